"""Every OS error a ``stoker`` command reports names a path, also one raised without a file name (a full disk)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from stoker.cli._errors import error_message
from stoker.cli.main import main

ENOSPC = os.strerror(errno.ENOSPC)

#: `stoker convert` in a process whose writes (and syncs) fail as on a full disk: an OSError without a file name
FULL_DISK = """
import errno, os, sys

def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

for name in sys.argv[1].split(","):
    setattr(os, name, full)
from stoker.cli.main import main

sys.exit(main(sys.argv[2:]))
"""


@pytest.fixture
def src(tmp_path: Path) -> Path:
    for k, name in enumerate(("cat", "dog")):
        (tmp_path / "src" / name).mkdir(parents=True)
        for i in range(2):
            Image.fromarray(np.full((12, 16, 3), 40 * (2 * k + i), np.uint8)).save(tmp_path / "src" / name / f"{i}.png")
    return tmp_path / "src"


@pytest.mark.parametrize("calls", ["pwritev,pwrite", "fsync"], ids=["write", "sync"])
def test_convert_on_a_full_disk_names_the_file_it_writes(tmp_path: Path, src: Path, calls: str) -> None:
    dst = tmp_path / "out.stoker"
    argv = ["convert", "imagefolder", str(src), str(dst), "--num-workers", "1", "--quiet"]
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, calls, *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr == f"stoker convert imagefolder: error: {dst}: {ENOSPC} [Errno {errno.ENOSPC}] (writing it)\n"
    assert proc.stdout == ""


def test_bench_and_inspect_name_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import stoker.bench.otto
    import stoker.cli.inspect

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, ENOSPC)

    monkeypatch.setattr(stoker.bench.otto, "run_otto_bench", full)
    assert main(["bench", "--quick", "--out", str(tmp_path / "bench")]) == 1
    assert f"stoker bench: FAILED, no numbers reported: {tmp_path / 'bench'}: {ENOSPC}" in capsys.readouterr().err

    def eio(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(stoker.cli.inspect, "describe", eio)
    assert main(["inspect", str(tmp_path / "x.stoker")]) == 1
    assert capsys.readouterr().err == f"stoker inspect: error: {tmp_path / 'x.stoker'}: Input/output error [Errno 5] (reading it)\n"


@pytest.mark.parametrize(
    ("exc", "message"),
    [
        (OSError(errno.ENOSPC, ENOSPC), f"out.stoker: {ENOSPC} [Errno 28] (writing it)"),
        (OSError(errno.EIO, "Input/output error"), "Input/output error [Errno 5], reading images or writing out.stoker"),
        (FileNotFoundError(errno.ENOENT, "No such file or directory", "images/a.jpg"), "images/a.jpg: No such file or directory [Errno 2]"),
        (OSError(errno.EXDEV, "Invalid cross-device link", "a", None, "b"), "a -> b: Invalid cross-device link [Errno 18]"),
        (ValueError("not an OS error"), "not an OS error"),
    ],
)
def test_error_message(exc: BaseException, message: str) -> None:
    assert error_message(exc, writing="out.stoker", reading="images") == message


def test_error_message_with_one_path() -> None:
    assert error_message(OSError(errno.EIO, "Input/output error"), reading="x") == "x: Input/output error [Errno 5] (reading it)"
    assert error_message(OSError(errno.EIO, "Input/output error"), writing="y") == "y: Input/output error [Errno 5] (writing it)"


def test_a_message_that_names_the_path_is_kept(tmp_path: Path) -> None:
    """``stoker convert`` of a folder that does not exist: the library's message names it; no "reading ... or writing ..." after it."""
    proc = subprocess.run(
        [sys.executable, "-m", "stoker", "convert", "imagefolder", "nonexist", "out.stoker"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert (
        proc.stderr == "stoker convert imagefolder: error: nonexist does not exist; give the folder that holds one sub-folder per class\n"
    )
    assert (
        error_message(FileNotFoundError("x.stoker is not a folder"), writing="out", reading="x")
        == "x.stoker is not a folder, reading x or writing out"
    )
