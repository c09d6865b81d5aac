"""The writer's workers start without Numba's TBB fork warning, also after a Loader ran in the same process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# a Loader epoch (Numba's parallel layer starts, from a loader thread), then writes with 2 workers
SCRIPT = r"""
import sys

import numpy as np

from stoker.fields import IntField, RGBImageField
from stoker.format import DatasetWriter
from stoker.format import _workers
from stoker.loader import Loader

folder = sys.argv[1]
fields = {"image": RGBImageField(write_mode="jpg"), "label": IntField()}
samples = [(np.full((16, 12, 3), i, np.uint8), i) for i in range(120)]
DatasetWriter(folder + "/one.stoker", fields, num_workers=1, progress=False).from_indexed_dataset(samples)
print("fork safe before the loader:", _workers.fork_is_safe(), file=sys.stderr)
for _ in Loader(folder + "/one.stoker", batch_size=16, num_workers=2):
    pass
import numba

print("threading layer:", numba.threading_layer(), "fork safe:", _workers.fork_is_safe(), file=sys.stderr)
DatasetWriter(folder + "/two.stoker", fields, num_workers=2, progress=False).from_indexed_dataset(samples, chunksize=10)
print("written", file=sys.stderr)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Numba's TBB layer (the warning) is what stoker uses on Linux")
def test_no_tbb_fork_warning_after_a_loader(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0] == "fork safe before the loader: True"
    assert lines[1].endswith("fork safe: False")  # so the workers were fresh interpreters
    assert lines[-1] == "written"
    assert "fork" not in proc.stderr.replace("fork safe", "").lower() and "TBB" not in proc.stderr, proc.stderr
    assert (tmp_path / "one.stoker").read_bytes() == (tmp_path / "two.stoker").read_bytes()


def test_sources_that_a_fresh_interpreter_cannot_rebuild_are_forked() -> None:
    from stoker.format import _workers

    class Local:
        pass

    assert _workers.portable_pickle([1, 2, {"a": b"x"}]) is not None
    assert _workers.portable_pickle(Local()) is None  # a local class does not pickle
    assert _workers.portable_pickle(lambda: 0) is None
    main = type("InMain", (), {"__module__": "__main__"})
    assert _workers.portable_pickle([main]) is None  # __main__ is not imported in a fresh interpreter
