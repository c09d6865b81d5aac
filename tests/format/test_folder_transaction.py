"""A folder dataset is written as a transaction: a failed, killed or concurrent-with-a-reader write never shows a mix.

Issue 23, findings 1 and 2. Each case writes a small dataset (version 1),
rewrites it (version 2) and breaks the rewrite: an exception at a random
sample, SIGTERM or SIGKILL of a writer process at a random step, a full disk.
The folder must then read as version 1 exactly (sample values compared), or
as version 2 when the break came after the commit, or, where there was no
dataset before, be refused; and the next write must clean what was left.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stoker.dataset.sharded as sharded_module
from stoker.dataset import ShardedReader, ShardedWriter, open_dataset
from stoker.dataset._transaction import FolderTransaction
from stoker.dataset.shards import MANIFEST_NAME, read_manifest, write_manifest
from stoker.errors import DatasetFormatError, SampleError
from stoker.fields import IntField, NDArrayField
from stoker.format import DatasetWriter
from tests.format._folder_data import FIELDS, Data, as_plain, expected

REPO = Path(__file__).resolve().parents[2]
PER = 3  # samples per shard: several shards even for tiny datasets


def write(folder: Path, version: int, n: int, per: int = PER, fail_at: int | None = None) -> list[Path]:
    return ShardedWriter(folder, FIELDS, samples_per_shard=per, num_workers=1, progress=False).from_indexed_dataset(
        Data(version, n, fail_at)
    )


def contents(source: Any, **kwargs: Any) -> list[tuple[int, bytes, tuple[int, ...]]]:
    reader = open_dataset(source, **kwargs)
    return [as_plain(reader.read(i)) for i in range(len(reader))]


def listing(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# ---- an exception ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_an_exception_at_a_random_sample_keeps_the_old_dataset(tmp_path: Path, seed: int) -> None:
    """Finding 1: the old writer removed the manifest first and replaced shards in place (seen failing: a mix, no manifest)."""
    rng = np.random.default_rng(seed)
    old_n, new_n = int(rng.integers(4, 14)), int(rng.integers(4, 14))
    write(tmp_path, 1, old_n)
    before = listing(tmp_path)
    fail_at = int(rng.integers(0, new_n))
    with pytest.raises(SampleError, match=rf"sample {fail_at}"):
        write(tmp_path, 2, new_n, fail_at=fail_at)
    assert listing(tmp_path) == before  # the same files, byte for byte: nothing of the failed write is left
    assert contents(tmp_path) == expected(1, old_n)
    write(tmp_path, 2, new_n)
    assert contents(tmp_path) == expected(2, new_n)
    assert len(list(tmp_path.glob("*.stoker"))) == -(-new_n // PER)  # the previous generation's shards are gone


def test_a_first_write_that_fails_leaves_nothing_readable(tmp_path: Path) -> None:
    """Finding 1: the old writer left its complete shards, which the folder fallback read as a smaller dataset (seen failing)."""
    folder = tmp_path / "d"
    with pytest.raises(SampleError, match="sample 7"):
        write(folder, 1, 10, fail_at=7)
    assert list(folder.iterdir()) == []
    with pytest.raises(DatasetFormatError, match=re.escape("no manifest.stoker.json and no *.stoker files")):
        open_dataset(folder)


def test_shard_files_without_a_manifest_are_refused(tmp_path: Path) -> None:
    """Finding 1: two datasets in one folder were read as one (seen failing); names of the files still read them."""
    from stoker.loader.loader import Loader

    for name, n in (("train.stoker", 5), ("val.stoker", 2)):
        DatasetWriter(tmp_path / name, FIELDS, num_workers=1, progress=False).from_indexed_dataset(Data(1, n))
    message = (
        re.escape(f"{tmp_path}: ")
        + r"a folder of \*\.stoker files \(train\.stoker, val\.stoker\) without its manifest\.stoker\.json: a write into it did not finish"
    )
    with pytest.raises(DatasetFormatError, match=message):
        open_dataset(tmp_path)
    with pytest.raises(DatasetFormatError, match="name the files you mean: a glob pattern"):
        Loader(tmp_path, batch_size=2, num_workers=1)
    assert contents([tmp_path / "train.stoker"]) == expected(1, 5)
    assert len(contents(str(tmp_path / "*.stoker"))) == 7


# ---- signals -----------------------------------------------------------------------------------------


def run_writer(folder: Path, version: int, n: int, sig: int | None = None, at: int = -1) -> list[str]:
    """Rewrite ``folder`` in a child process that stops before each step; send ``sig`` at step ``at``. The steps seen."""
    cmd = [sys.executable, "-m", "tests.format._folder_data", str(folder), str(version), str(n), str(PER)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    steps: list[str] = []
    try:
        while line := proc.stdout.readline():
            steps.append(line.strip())
            if len(steps) - 1 == at and sig is not None:
                proc.send_signal(sig)
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.write("\n")
                proc.stdin.flush()
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.close()
        stderr = proc.stderr.read() if proc.stderr else ""
        proc.stdout.close()
        if proc.stderr:
            proc.stderr.close()
    if sig is None:
        assert code == 0, stderr
    else:
        assert code == -sig, f"the writer ended with {code}, not by signal {sig}: {stderr}"
    return steps


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The steps of a whole rewrite (version 1 of 8 samples by version 2 of 10), to draw the moments from."""
    folder = tmp_path_factory.mktemp("steps")
    write(folder, 1, 8)
    steps = run_writer(folder, 2, 10)
    assert contents(folder) == expected(2, 10)
    assert steps[-1] == "done" and f"replace {MANIFEST_NAME}" in steps and sum(s.startswith("unlink shard-") for s in steps) == 3
    return steps


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
@pytest.mark.parametrize("run", range(20))
def test_a_killed_writer_leaves_the_old_or_the_new_dataset(tmp_path: Path, full_run: list[str], sig: int, run: int) -> None:
    """The writer is signalled just before a step drawn at random; the next write cleans what it left."""
    at = int(np.random.default_rng([run, int(sig)]).integers(0, len(full_run)))
    committed = at > full_run.index(f"replace {MANIFEST_NAME}")
    write(tmp_path, 1, 8)
    before = listing(tmp_path)
    steps = run_writer(tmp_path, 2, 10, sig, at)
    assert len(steps) == at + 1 or sig == signal.SIGTERM  # SIGKILL: nothing after; SIGTERM goes on through the clean-up
    if committed:
        assert contents(tmp_path) == expected(2, 10)
    else:
        assert contents(tmp_path) == expected(1, 8)
        if sig == signal.SIGTERM:  # unwound: the files of the write are gone too
            assert listing(tmp_path) == before
    write(tmp_path, 3, 4)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted([MANIFEST_NAME] + [info.path.name for info in read_manifest(tmp_path)])  # nothing left over
    assert contents(tmp_path) == expected(3, 4)


def test_a_killed_first_write_leaves_nothing_readable(tmp_path: Path, full_run: list[str]) -> None:
    run_writer(tmp_path, 2, 10, signal.SIGKILL, full_run.index("sample 5"))
    assert len(list(tmp_path.glob("*.stoker"))) == 1  # the first shard, complete, and no manifest
    with pytest.raises(DatasetFormatError, match="a write into it did not finish"):
        open_dataset(tmp_path)
    write(tmp_path, 3, 4)
    assert contents(tmp_path) == expected(3, 4)
    assert len(list(tmp_path.iterdir())) == 3  # two shards and the manifest


# ---- a full disk -------------------------------------------------------------------------------------


@contextlib.contextmanager
def disk_of(budget: int, folder: Path) -> Iterator[list[int]]:
    """Writes into ``folder`` fail with ENOSPC past ``budget`` bytes (os.write, os.pwrite, os.pwritev); yields ``[bytes left]``."""
    real = {name: getattr(os, name) for name in ("write", "pwrite", "pwritev")}
    left = [budget]
    lock = threading.Lock()
    prefix = str(folder.resolve())

    def ours(fd: int) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}").startswith(prefix)
        except OSError:
            return False

    def wrap(name: str) -> Any:
        def call(fd: int, data: Any, *args: Any) -> int:
            if ours(fd):
                size = sum(memoryview(d).nbytes for d in data) if name == "pwritev" else memoryview(data).nbytes
                with lock:
                    if size > left[0]:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    left[0] -= size
            return int(real[name](fd, data, *args))

        return call

    for name in real:
        setattr(os, name, wrap(name))
    try:
        yield left
    finally:
        for name, fn in real.items():
            setattr(os, name, fn)


@pytest.mark.parametrize("seed", range(8))
def test_a_full_disk_keeps_the_old_dataset(tmp_path: Path, seed: int) -> None:
    """ENOSPC after a random number of bytes (the low-level writes patched): the old dataset, or none, stays."""
    with disk_of(1 << 40, tmp_path) as left:
        write(tmp_path / "probe", 2, 10)
    size = (1 << 40) - left[0]  # the bytes a write of version 2 writes
    budget = int(np.random.default_rng(seed).integers(0, size))
    write(tmp_path / "d", 1, 8)
    before = listing(tmp_path / "d")
    with disk_of(budget, tmp_path), pytest.raises(OSError, match="No space left"):
        write(tmp_path / "d", 2, 10)
    assert listing(tmp_path / "d") == before
    assert contents(tmp_path / "d") == expected(1, 8)
    with disk_of(budget, tmp_path), pytest.raises(OSError, match="No space left"):
        write(tmp_path / "first", 2, 10)
    assert list((tmp_path / "first").iterdir()) == []


def _mount_tmpfs(path: Path, size: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, check=False)
    return result.returncode == 0


def test_a_full_tmpfs_keeps_the_old_dataset(tmp_path: Path) -> None:
    """A real full disk: a 512 KiB tmpfs (mounted only as root, where mount works)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if not _mount_tmpfs(disk, "512k"):
        pytest.skip("cannot mount a tmpfs here (not root, or no mount): test_a_full_disk_keeps_the_old_dataset simulates ENOSPC")
    try:
        fields = {"x": NDArrayField((4096,), np.dtype("<f4")), "i": IntField()}  # 16 KiB a sample

        def arrays(n: int, version: int) -> dict[str, np.ndarray]:
            return {"x": np.full((n, 4096), version, np.float32), "i": np.arange(n) + 1000 * version}

        ShardedWriter(disk / "d", fields, samples_per_shard=4, num_workers=1, progress=False).from_arrays(arrays(8, 1))
        before = listing(disk / "d")
        with pytest.raises(OSError, match="No space left"):
            ShardedWriter(disk / "d", fields, samples_per_shard=4, num_workers=1, progress=False).from_arrays(arrays(40, 2))
        assert listing(disk / "d") == before
        reader = open_dataset(disk / "d")
        assert [int(reader.read(i)[1]) for i in range(len(reader))] == list(range(1000, 1008))
        shutil.rmtree(disk / "d")
        with pytest.raises(OSError, match="No space left"):
            ShardedWriter(disk / "d", fields, samples_per_shard=4, num_workers=1, progress=False).from_arrays(arrays(40, 2))
        assert list((disk / "d").iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True, check=False)


# ---- readers while a write runs ----------------------------------------------------------------------


def test_a_reader_during_rewrites_sees_the_old_or_the_new_dataset(tmp_path: Path) -> None:
    """A thread opens and reads the folder in a loop while it is rewritten 12 times (seen failing: mixes, half datasets)."""
    sizes = {v: 3 + (5 * v) % 11 for v in range(1, 14)}
    versions = {v: expected(v, n) for v, n in sizes.items()}
    write(tmp_path, 1, sizes[1], per=1)
    stop = threading.Event()
    seen: list[int] = []
    errors: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            try:
                got = contents(tmp_path)
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            version = got[0][0] // 1000 if got else -1
            if got != versions.get(version):
                errors.append(f"a mix: {[v for v, _b, _x in got]}")
            seen.append(version)

    thread = threading.Thread(target=reader, name="reader")
    thread.start()
    try:
        for v in range(2, 14):
            write(tmp_path, v, sizes[v], per=1)
    finally:
        stop.set()
        thread.join()
    assert not errors, errors[:3]
    assert len(set(seen)) >= 2, seen  # it did read while the writes ran


def test_an_open_retries_when_a_write_commits_in_between(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The old manifest is read, then a rewrite commits and deletes its shards before they are opened: the new one is opened."""
    write(tmp_path, 1, 7)
    real = sharded_module.Reader
    calls: list[str] = []

    def reader(path: Path, **kwargs: Any) -> Any:
        calls.append(Path(path).name)
        if len(calls) == 1:
            write(tmp_path, 2, 5)
        return real(path, **kwargs)

    monkeypatch.setattr(sharded_module, "Reader", reader)
    assert contents(tmp_path) == expected(2, 5)
    assert calls[0] not in {p.name for p in tmp_path.iterdir()}  # the first file opened was of the old dataset


@pytest.mark.parametrize(("n", "bounded"), [(7, False), (7, True), (2, False)], ids=["shards", "bounded", "one-shard"])
def test_an_open_dataset_outlives_a_rewrite(tmp_path: Path, n: int, bounded: bool) -> None:
    """A reader keeps the files it opened: the rewrite deletes them, the reader still reads the old samples."""
    write(tmp_path, 1, n)
    reader = open_dataset(tmp_path, bounded=bounded)
    write(tmp_path, 2, 5)
    assert [as_plain(reader.read(i)) for i in range(len(reader))] == expected(1, n)
    if isinstance(reader, ShardedReader):
        assert len(reader.metadata) == n
    assert contents(tmp_path) == expected(2, 5)


# ---- the transaction itself --------------------------------------------------------------------------


def test_one_writer_at_a_time(tmp_path: Path) -> None:
    write(tmp_path, 1, 4)
    with FolderTransaction(tmp_path) as tx:
        with pytest.raises(RuntimeError, match=re.escape(f"{tmp_path}: ") + "another write into this folder is running"):
            write(tmp_path, 2, 4)
        assert tx.state == "open"
    assert tx.state == "aborted"
    write(tmp_path, 2, 4)
    assert contents(tmp_path) == expected(2, 4)


def test_the_next_write_deletes_what_earlier_writes_left(tmp_path: Path) -> None:
    write(tmp_path, 1, 4)
    leftover = tmp_path / "shard-gdeadbeef-00000.stoker"
    shutil.copy(read_manifest(tmp_path)[0].path, leftover)
    dead = tmp_path / ".shard-gdeadbeef-00001.stoker.stoker-tmp-999999999-0a1b2c3d"  # no such process
    dead.write_bytes(b"half a shard")
    keep = [tmp_path / "notes.txt", tmp_path / "train.stoker", tmp_path / "shard-x.stoker"]
    for path in keep:
        path.write_bytes(b"not ours")
    assert contents(tmp_path) == expected(1, 4)  # leftovers are never read
    paths = write(tmp_path, 2, 4)
    assert sorted(tmp_path.iterdir()) == sorted([tmp_path / MANIFEST_NAME, *paths, *keep])


def test_a_folder_of_an_earlier_version_is_read_and_replaced(tmp_path: Path) -> None:
    """Folders written before generations (``shard-00000.stoker``, no ``generation`` key) read as before."""
    for k, (a, b) in enumerate([(0, 3), (3, 5)]):
        DatasetWriter(tmp_path / f"shard-{k:05d}.stoker", FIELDS, num_workers=1, progress=False).from_indexed_dataset(
            Data(1, 5), indices=range(a, b)
        )
    write_manifest(tmp_path, ["shard-00000.stoker", "shard-00001.stoker"])
    assert "generation" not in json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert contents(tmp_path) == expected(1, 5)
    with pytest.raises(SampleError):
        write(tmp_path, 2, 6, fail_at=4)
    assert contents(tmp_path) == expected(1, 5)
    paths = write(tmp_path, 2, 6)
    assert sorted(tmp_path.iterdir()) == sorted([tmp_path / MANIFEST_NAME, *paths])


def test_overwrite_false_refuses_a_dataset(tmp_path: Path) -> None:
    write(tmp_path, 1, 4)
    with pytest.raises(FileExistsError, match=re.escape(f"{tmp_path} already holds a stoker dataset (manifest.stoker.json)")):
        FolderTransaction(tmp_path, overwrite=False).begin()
    assert contents(tmp_path) == expected(1, 4)


class Recording:
    """A commit point that records what exists when the manifest is published (as an object store would)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.data, self.files_then = folder, None, None

    def current(self) -> bytes | None:
        return self.data

    def publish(self, manifest: bytes) -> None:
        self.files_then = sorted(p.name for p in self.folder.iterdir())
        self.data = manifest


def test_the_commit_point_is_published_last(tmp_path: Path) -> None:
    point = Recording(tmp_path)
    with FolderTransaction(tmp_path, commit_point=point) as tx:
        paths = [tx.shard_path(k) for k in range(2)]
        for k, path in enumerate(paths):
            DatasetWriter(path, FIELDS, num_workers=1, progress=False).from_indexed_dataset(Data(1, 4), indices=[2 * k, 2 * k + 1])
        with pytest.raises(ValueError, match="lists shards of this generation"):
            tx.commit([tmp_path / "shard-00000.stoker"])
        tx.commit(paths)
    assert point.files_then == [p.name for p in paths]  # every shard complete (no temporary) before the manifest
    manifest = json.loads(point.data or b"")
    assert manifest["generation"] == tx.generation and [s["name"] for s in manifest["shards"]] == [p.name for p in paths]
