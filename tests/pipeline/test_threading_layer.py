"""Numba's threading layer on one CPU: a process that ran a Loader exits (TBB's exit hang, oneTBB issue 2056)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# One CPU (as in a container with a CPU quota of 1), a Loader built on the main thread and iterated on another
# thread, so that Numba's parallel kernels (the flip) first run off the main thread; then the interpreter exits.
SCRIPT = r"""
import os
import sys
import threading

import numpy as np

os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
from stoker.fields import IntField, RGBImageField
from stoker.decoders import IntDecoder, SimpleRGBImageDecoder
from stoker.format import DatasetWriter
from stoker.loader import Loader
from stoker.transforms import RandomHorizontalFlip

path = sys.argv[1]
samples = [(np.full((16, 16, 3), i % 250, np.uint8), i) for i in range(256)]
DatasetWriter(path, {"image": RGBImageField(write_mode="raw"), "label": IntField()}, progress=False).from_indexed_dataset(samples)
loader = Loader(path, batch_size=64, num_workers=1, seed=0,
                pipelines={"image": [SimpleRGBImageDecoder(), RandomHorizontalFlip()], "label": [IntDecoder()]})
seen = []
worker = threading.Thread(target=lambda: seen.extend(len(b[1]) for b in loader))
worker.start()
worker.join()
import numba

print("layer", numba.threading_layer(), "samples", sum(seen), flush=True)
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity (Linux)")
def test_a_process_on_one_cpu_exits_after_a_loader(tmp_path: Path) -> None:
    try:
        proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "d.stoker")], capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the process did not exit within 240 s (it printed {exc.stdout!r}): Numba's TBB layer waits at exit")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-2:] == ["samples", "256"], proc.stdout
