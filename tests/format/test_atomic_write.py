"""The destination only ever holds a complete file: a writer killed mid-write leaves nothing there."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stoker.fields import BytesField, IntField
from stoker.format import DatasetWriter, Reader

# A writer slow enough to be caught mid-write: 20,000 samples of >= 1 ms each.
SLOW_WRITER = r"""
import sys
import time

from stoker.fields import BytesField, IntField
from stoker.format import DatasetWriter


class Slow:
    def __len__(self):
        return 20_000

    def __getitem__(self, i):
        time.sleep(0.001)
        return i, b"x" * (i % 100)


DatasetWriter(sys.argv[1], {"i": IntField(), "b": BytesField()}, num_workers=int(sys.argv[2]), progress=False).from_indexed_dataset(Slow(), chunksize=8)
print("finished", flush=True)
"""


def temporaries(folder: Path, name: str) -> list[Path]:
    return sorted(folder.glob(f".{name}.stoker-tmp-*"))


def wait_for_data(folder: Path, name: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> Path:
    """Wait until the writer's temporary file exists and has received sample data."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the writer exited early with {proc.returncode}"
        found = temporaries(folder, name)
        if found and found[0].stat().st_size > 0:
            return found[0]
        time.sleep(0.02)
    raise AssertionError("the writer never created its temporary file")


@pytest.mark.parametrize("num_workers", [1, 2])
def test_sigkill_mid_write_leaves_no_destination(tmp_path: Path, num_workers: int) -> None:
    dest = tmp_path / "data.stoker"
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_WRITER, str(dest), str(num_workers)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        tmp = wait_for_data(tmp_path, dest.name, proc)
        time.sleep(0.2)  # well inside the ~20 s the full write would take
        assert tmp.name.startswith(f".data.stoker.stoker-tmp-{proc.pid}-")
    finally:
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert b"finished" not in out
    assert not dest.exists()
    assert temporaries(tmp_path, dest.name) == [tmp]  # a SIGKILL cannot clean up: the stale temporary stays

    # the next successful write to the same destination removes the dead writer's temporary
    DatasetWriter(dest, {"i": IntField(), "b": BytesField()}, num_workers=1, progress=False).from_indexed_dataset([(1, b"a"), (2, b"")])
    assert [p.name for p in tmp_path.iterdir()] == ["data.stoker"]
    with Reader(dest) as reader:
        reader.verify()
        assert len(reader) == 2


def test_sigkill_keeps_the_previous_file(tmp_path: Path) -> None:
    dest = tmp_path / "data.stoker"
    DatasetWriter(dest, {"i": IntField(), "b": BytesField()}, num_workers=1, progress=False).from_indexed_dataset([(7, b"old")])
    before = dest.read_bytes()
    proc = subprocess.Popen([sys.executable, "-c", SLOW_WRITER, str(dest), "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for_data(tmp_path, dest.name, proc)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    assert dest.read_bytes() == before


def test_temporaries_of_live_processes_are_kept(tmp_path: Path) -> None:
    live = tmp_path / f".data.stoker.stoker-tmp-{os.getpid()}-0123abcd"
    odd = tmp_path / ".data.stoker.stoker-tmp-notapid"
    other = tmp_path / ".other.stoker.stoker-tmp-1-0123abcd"
    for path in (live, odd, other):
        path.write_bytes(b"partial")
    DatasetWriter(tmp_path / "data.stoker", {"i": IntField()}, num_workers=1, progress=False).from_indexed_dataset([1, 2, 3])
    assert live.exists() and odd.exists() and other.exists()


def test_keyboard_interrupt_removes_the_temporary(tmp_path: Path) -> None:
    class Interrupted:
        def __len__(self) -> int:
            return 100

        def __getitem__(self, i: int) -> int:
            if i == 50:
                raise KeyboardInterrupt
            return i

    with pytest.raises(KeyboardInterrupt):
        DatasetWriter(tmp_path / "d.stoker", {"i": IntField()}, num_workers=1, progress=False).from_indexed_dataset(
            Interrupted(), chunksize=10
        )
    assert list(tmp_path.iterdir()) == []
