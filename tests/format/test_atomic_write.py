"""The destination only ever holds a complete file: a writer killed mid-write leaves nothing there."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
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


# ---- SIGTERM ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_workers", [1, 2])
def test_sigterm_mid_write_removes_the_temporary_and_ends_the_process(tmp_path: Path, num_workers: int) -> None:
    dest = tmp_path / "data.stoker"
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_WRITER, str(dest), str(num_workers)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        wait_for_data(tmp_path, dest.name, proc)
        time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM, err.decode()  # ended by the signal, as without stoker's handler
    assert b"finished" not in out
    assert list(tmp_path.iterdir()) == []  # no destination, no temporary


def test_sigterm_keeps_the_previous_file(tmp_path: Path) -> None:
    dest = tmp_path / "data.stoker"
    DatasetWriter(dest, {"i": IntField(), "b": BytesField()}, num_workers=1, progress=False).from_indexed_dataset([(7, b"old")])
    before = dest.read_bytes()
    proc = subprocess.Popen([sys.executable, "-c", SLOW_WRITER, str(dest), "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for_data(tmp_path, dest.name, proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM
    assert dest.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["data.stoker"]


class SignalsAt:
    """Sends SIGTERM to this process while sample ``k`` is read (encoding in this process)."""

    def __init__(self, n: int, k: int) -> None:
        self.n, self.k = n, k

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.k:
            os.kill(os.getpid(), signal.SIGTERM)
        return i


def test_sigterm_chains_to_the_previous_python_handler(tmp_path: Path) -> None:
    calls: list[int] = []

    def mine(signum: int, frame: object) -> None:
        calls.append(signum)

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        DatasetWriter(tmp_path / "d.stoker", {"i": IntField()}, num_workers=1, progress=False).from_indexed_dataset(SignalsAt(100, 40))
        assert calls == [signal.SIGTERM]  # called once, and the write went on: the handler chose not to stop
        assert signal.getsignal(signal.SIGTERM) is mine  # restored after the write
    finally:
        signal.signal(signal.SIGTERM, previous)
    with Reader(tmp_path / "d.stoker") as reader:
        assert len(reader) == 100


def test_sigterm_handler_that_raises_stops_the_write_and_cleans_up(tmp_path: Path) -> None:
    def stop(signum: int, frame: object) -> None:
        raise SystemExit(143)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        with pytest.raises(SystemExit):
            DatasetWriter(tmp_path / "d.stoker", {"i": IntField()}, num_workers=1, progress=False).from_indexed_dataset(
                SignalsAt(100, 40), chunksize=10
            )
        assert signal.getsignal(signal.SIGTERM) is stop
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert list(tmp_path.iterdir()) == []


def test_handlers_are_restored_and_left_alone_outside_the_main_thread(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    write = DatasetWriter(tmp_path / "a.stoker", {"i": IntField()}, num_workers=2, progress=False)
    write.from_indexed_dataset(list(range(50)), chunksize=5)
    assert signal.getsignal(signal.SIGTERM) == before
    errors: list[BaseException] = []

    def in_thread() -> None:
        try:
            DatasetWriter(tmp_path / "b.stoker", {"i": IntField()}, num_workers=1, progress=False).from_indexed_dataset([1, 2])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join()
    assert errors == []
    assert signal.getsignal(signal.SIGTERM) == before
    assert (tmp_path / "b.stoker").exists()


# ---- stale temporaries -----------------------------------------------------------------------------
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temporary_of_a_dead_writer_is_removed_unless_locked(tmp_path: Path) -> None:
    pid = dead_pid()
    stale = tmp_path / f".data.stoker.stoker-tmp-{pid}-0123abcd"
    locked = tmp_path / f".data.stoker.stoker-tmp-{pid}-4567cdef"  # as a live writer on another machine holds it
    for path in (stale, locked):
        path.write_bytes(b"partial")
    fd = os.open(locked, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        DatasetWriter(tmp_path / "data.stoker", {"i": IntField()}, num_workers=1, progress=False).from_indexed_dataset([1, 2, 3])
    finally:
        os.close(fd)
    assert not stale.exists()
    assert locked.exists()


def test_stale_temporaries_of_other_destinations_are_kept(tmp_path: Path) -> None:
    """The destination's name is matched exactly, not as a glob pattern: 'a[b]' must not match 'ab'."""
    pid = dead_pid()
    other = tmp_path / f".ab.stoker.stoker-tmp-{pid}-0123abcd"
    other.write_bytes(b"partial")
    DatasetWriter(tmp_path / "a[b].stoker", {"i": IntField()}, num_workers=1, progress=False).from_indexed_dataset([1])
    assert other.exists()
    assert (tmp_path / "a[b].stoker").exists()


def test_the_writer_locks_its_temporary(tmp_path: Path) -> None:
    """While a write runs, its temporary is locked: a cleaner elsewhere (PID unknown there) leaves it."""
    seen: list[bool] = []

    class Probe:
        def __len__(self) -> int:
            return 10

        def __getitem__(self, i: int) -> int:
            if i == 5:
                (tmp,) = temporaries(tmp_path, "d.stoker")
                fd = os.open(tmp, os.O_RDONLY)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    seen.append(False)
                except BlockingIOError:
                    seen.append(True)
                finally:
                    os.close(fd)
            return i

    DatasetWriter(tmp_path / "d.stoker", {"i": IntField()}, num_workers=1, progress=False).from_indexed_dataset(Probe(), chunksize=2)
    assert seen == [True]
