"""stoker._progress: a bar when asked (or on a terminal), otherwise no tqdm object and no thread."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from stoker._progress import progress_bar

SRC = str(Path(__file__).resolve().parents[1] / "src")

WRITE = r"""
import sys, threading
import numpy as np
from stoker.fields import IntField, NDArrayField
from stoker.format import DatasetWriter
progress = {"none": None, "false": False, "true": True}[sys.argv[2]]
DatasetWriter(sys.argv[1], {"x": NDArrayField((3,), np.float32), "y": IntField()}, num_workers=1,
              progress=progress).from_indexed_dataset([(np.zeros(3, np.float32), i) for i in range(50)])
print(sorted(t.name for t in threading.enumerate()))
"""


@pytest.mark.parametrize(("progress", "shown"), [("false", False), ("none", False), ("true", True)])
def test_a_write_without_a_bar_starts_no_thread(tmp_path: Path, progress: str, shown: bool) -> None:
    """A fresh process (tqdm's monitor starts once per process): ``progress=False``, and ``None`` with stderr not a
    terminal (a pipe here), write with no bar and leave no thread; tqdm 4.70 started its monitor thread for a disabled
    bar too, a daemon thread that stayed for the rest of the process (the flow tests' thread check caught it)."""
    proc = subprocess.run([sys.executable, "-c", WRITE, str(tmp_path / "d.stoker"), progress], capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": SRC, "PATH": ""})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    threads = proc.stdout.strip()
    assert ("writing d.stoker" in proc.stderr) is shown, proc.stderr
    if not shown:
        assert threads == "['MainThread']", threads


def test_the_bar_that_shows_nothing_counts_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    with progress_bar(10, "samples", "writing x", False) as bar:
        bar.update(3)
        bar.update()
    with progress_bar(10, "samples", "writing y", True) as bar:
        bar.update(10)
    err = capsys.readouterr().err
    assert "writing x" not in err and "writing y" in err and "10/10" in err
