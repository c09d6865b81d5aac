"""The writer's write-behind thread (``format._sink``): every byte lands where it was asked, errors reach the caller,
the thread never outlives the sink, and it does not start before the writer's worker processes are forked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.fields import BytesField
from stoker.format import DatasetWriter, Reader, _sink, spec
from stoker.format._sink import WriteBehind, pwrite_all


def _sink_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "stoker-write-behind"]


@settings(max_examples=60, deadline=None)
@given(
    writes=st.lists(st.tuples(st.integers(0, 300), st.lists(st.integers(0, 90), max_size=5)), max_size=12),
    max_pending=st.integers(1, 400),
    flush_every=st.integers(0, 300),
    seed=st.integers(0, 1000),
)
def test_writes_land_as_in_a_bytearray(
    tmp_path_factory: pytest.TempPathFactory, writes: list[tuple[int, list[int]]], max_pending: int, flush_every: int, seed: int
) -> None:
    """Writes of one buffer or several, overlapping or not, queued against a small bound: the file is the model's bytes."""
    rng = np.random.default_rng(seed)
    path = tmp_path_factory.mktemp("sink") / "out.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    model = bytearray()
    try:
        sink = WriteBehind(fd, max_pending=max_pending, flush_every=flush_every)
        for offset, sizes in writes:
            pieces = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
            data = b"".join(pieces)
            sink.write(pieces[0] if len(pieces) == 1 else pieces, offset)
            if data:
                model.extend(b"\0" * max(0, offset + len(data) - len(model)))
                model[offset : offset + len(data)] = data
        sink.close()
    finally:
        os.close(fd)
    assert path.read_bytes() == bytes(model)
    assert not _sink_threads()


def test_flush_without_fdatasync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """macOS has no ``fdatasync``: ``fsync`` instead."""
    synced = []
    monkeypatch.delattr(os, "fdatasync", raising=False)
    monkeypatch.setattr(os, "fsync", synced.append)
    _sink.flush(7)
    assert synced == [7]


def test_short_writes_are_finished(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pwritev that writes less than asked (a signal, a nearly full disk): the rest is written after it."""
    real = os.pwritev
    calls = []

    def short(fd: int, buffers: list[bytes], offset: int) -> int:
        calls.append(len(buffers))
        first = bytes(buffers[0])
        return real(fd, [first[: max(1, len(first) // 2)]], offset)  # half of the first buffer only

    monkeypatch.setattr(os, "pwritev", short)
    pieces = [bytes([i]) * (10 + i) for i in range(5)]
    path = tmp_path / "short.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        pwrite_all(fd, pieces, 7)
    finally:
        os.close(fd)
    assert calls  # the vectored call was made, and cut short
    assert path.read_bytes() == b"\0" * 7 + b"".join(pieces)


def test_periodic_flushes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``fdatasync`` after every ``flush_every`` bytes: the final fsync waits for a tail, not the whole file."""
    synced = []
    real = _sink.flush
    monkeypatch.setattr(_sink, "flush", lambda fd: (synced.append(fd), real(fd))[1])
    fd = os.open(tmp_path / "f.bin", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        sink = WriteBehind(fd, flush_every=100)
        for k in range(10):
            sink.write(b"x" * 60, 60 * k)
        sink.close()
    finally:
        os.close(fd)
    assert len(synced) == sink.flushes == 5  # 600 bytes, one flush per 100 or more since the last


def test_an_error_of_the_thread_reaches_the_caller(tmp_path: Path) -> None:
    """A write that fails on the thread (here: a read-only descriptor) is raised by the next write or by close."""
    path = tmp_path / "ro.bin"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)
    try:
        sink = WriteBehind(fd, max_pending=10)
        with pytest.raises(OSError):
            for k in range(100):  # the bound makes a later write wait for the failed one, which then raises
                sink.write(b"y" * 10, 10 * k)
            sink.close()
        sink.abort()
    finally:
        os.close(fd)
    assert not _sink_threads()


def test_abort_drops_pending_writes_and_joins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer aborts on any error of its own: the thread stops before the descriptor is closed."""
    gate = threading.Event()
    real = _sink.pwrite_all

    def slow(fd: int, pieces: list[bytes], offset: int) -> None:
        gate.wait(5)
        real(fd, pieces, offset)

    monkeypatch.setattr(_sink, "pwrite_all", slow)
    path = tmp_path / "a.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        sink = WriteBehind(fd)
        for k in range(20):
            sink.write(b"z" * 8, 8 * k)
        assert _sink_threads()
        threading.Timer(0.2, gate.set).start()
        sink.abort()
        assert not _sink_threads()
    finally:
        os.close(fd)
    assert len(path.read_bytes()) < 160  # the write in progress at most, not the twenty


def test_no_thread_before_the_first_write() -> None:
    fd = os.open(os.devnull, os.O_WRONLY)
    try:
        sink = WriteBehind(fd)
        assert not _sink_threads()
        sink.close()
    finally:
        os.close(fd)


SCRIPT = r"""
import sys

import numpy as np

from stoker.fields import BytesField, IntField
from stoker.format import DatasetWriter, _workers

methods = []
real = _workers.Workers.__init__


def record(self, *args, **kwargs):
    real(self, *args, **kwargs)
    methods.append(self.start_method)


_workers.Workers.__init__ = record
samples = [(np.full(1000 + i, i % 256, np.uint8), i) for i in range(200)]
DatasetWriter(sys.argv[1], {"blob": BytesField(), "label": IntField()}, num_workers=2, progress=False).from_indexed_dataset(
    samples, chunksize=10
)
print(methods)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork start method")
def test_workers_are_forked_before_the_thread_starts(tmp_path: Path) -> None:
    """A sink thread started before the workers would make them fresh interpreters (a 0.1 s start, measured)."""
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "w.stoker")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['fork']"


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=3000), split=st.integers(0, 3000), seed=st.integers(0, 2**32 - 1))
def test_crc32_is_zlibs(data: bytes, split: int, seed: int) -> None:
    """The file checksums (python-isal's CRC-32 where installed) equal zlib's, also continued from a running value."""
    assert spec.crc32(data) == zlib.crc32(data) & 0xFFFFFFFF
    head, tail = data[:split], data[split:]
    assert spec.crc32(tail, spec.crc32(head)) == zlib.crc32(data) & 0xFFFFFFFF
    assert spec.crc32(data, seed) == zlib.crc32(data, seed) & 0xFFFFFFFF


def test_queued_bytes_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the disk is slow, ``write`` waits once ``max_pending`` bytes are queued: memory stays bounded."""
    gate = threading.Event()
    real = _sink.pwrite_all
    monkeypatch.setattr(_sink, "pwrite_all", lambda fd, pieces, offset: (gate.wait(5), real(fd, pieces, offset))[1])
    fd = os.open(tmp_path / "b.bin", os.O_RDWR | os.O_CREAT, 0o600)
    done = []
    try:
        sink = WriteBehind(fd, max_pending=100)

        def produce() -> None:
            for k in range(30):
                sink.write(b"q" * 10, 10 * k)
                done.append(k)

        producer = threading.Thread(target=produce)
        producer.start()
        producer.join(0.5)
        assert producer.is_alive() and len(done) == 10  # ten writes of 10 bytes fill the bound; the eleventh waits
        gate.set()
        producer.join(5)
        sink.close()
    finally:
        os.close(fd)
    assert len(done) == 30 and (tmp_path / "b.bin").read_bytes() == b"q" * 300


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="SIGALRM timers")
def test_abort_after_an_interrupted_close_waits_for_the_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while close() waits: abort() must still wait for the thread before the writer closes the descriptor
    (in CPython 3.11 an interrupted join marks the thread stopped, and later joins returned while it still wrote)."""
    running, finished = threading.Event(), threading.Event()
    real = _sink.pwrite_all

    def slow(fd: int, pieces: list[bytes], offset: int) -> None:
        running.set()
        time.sleep(0.8)
        real(fd, pieces, offset)
        finished.set()

    monkeypatch.setattr(_sink, "pwrite_all", slow)

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    fd = os.open(tmp_path / "f.bin", os.O_RDWR | os.O_CREAT, 0o600)
    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        sink = WriteBehind(fd)
        sink.write(b"x" * 10, 0)
        assert running.wait(5)
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(KeyboardInterrupt):
            try:  # what DatasetWriter._fill does
                sink.close()
            except BaseException:
                sink.abort()
                raise
        assert finished.is_set() and not _sink_threads()  # the write in progress ended before abort() returned
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        os.close(fd)


class _ViewField(BytesField):
    """A custom heap field that returns a float32 view, or a bytearray it changes after returning it."""

    def __init__(self) -> None:
        super().__init__()
        self.last = bytearray()

    def encode(self, value: object, index: int) -> tuple[dict[str, object], bytes | None]:
        if index % 2:
            return {}, memoryview(np.arange(index, dtype=np.float32))  # type: ignore[return-value]
        self.last[:] = b"changed later"  # the previous sample's bytearray, if it were still referenced
        self.last = bytearray(np.arange(index, dtype=np.float32).tobytes())
        return {}, self.last  # type: ignore[return-value]


def test_custom_payloads_are_stored_as_their_bytes(tmp_path: Path) -> None:
    """Heap payloads that are not bytes are copied as bytes when encoded: sizes in bytes, contents as returned."""
    path = tmp_path / "v.stoker"
    DatasetWriter(path, {"v": _ViewField()}, num_workers=1, progress=False).from_indexed_dataset([b""] * 40, chunksize=7)
    with Reader(path) as reader:
        reader.verify()
        for i in range(40):
            ptr, size = int(reader.metadata["v/ptr"][i]), int(reader.metadata["v/size"][i])
            assert bytes(reader.storage[ptr : ptr + size]) == np.arange(i, dtype=np.float32).tobytes(), i
