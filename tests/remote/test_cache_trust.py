"""Issue 29, the node cache: what it holds is checked before use, its limit is its disk use, it always makes progress
when shared, and it is safe on a shared node. A real S3 server (moto) on loopback; other processes are real processes."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")

import contextlib

from benchmarks._servers import loopback

import stoker
from stoker import Loader, OrderOption, _cache_roots
from stoker.dataset._manifest import MANIFEST_NAME, build_manifest
from stoker.dataset.shards import write_shards
from stoker.errors import DatasetFormatError, StokerError, UnsafeCacheError
from stoker.fields import IntField, NDArrayField
from stoker.format.reader import Reader
from stoker.remote import ShardCache, open_store
from stoker.remote._cache_room import DEFAULT_LIMIT_FRACTION, default_limit

FIELDS = {"x": NDArrayField(np.dtype("float32"), (16,)), "y": IntField()}
PER_SHARD = 100
#: this stoker, for child processes (the venv may hold another)
PATH = os.pathsep.join([str(Path(stoker.__file__).parents[1]), str(Path(__file__).resolve().parents[2])])


@pytest.fixture(scope="module")
def s3() -> Iterator[loopback.S3Server]:
    old = os.environ.get("AWS_EC2_METADATA_DISABLED")
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"  # never ask a cloud's instance metadata for credentials
    try:
        with loopback.s3_server("cache-trust") as server:
            yield server
    finally:
        if old is None:
            os.environ.pop("AWS_EC2_METADATA_DISABLED", None)
        else:
            os.environ["AWS_EC2_METADATA_DISABLED"] = old


def _arrays(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, 16)).astype(np.float32), "y": np.arange(n, dtype=np.int64)}


def _write(folder: Path, n: int, seed: int = 0, names: list[str] | None = None) -> list[Path]:
    """A folder dataset of ``n`` samples, ``PER_SHARD`` a shard (a few KB each); ``names``: the shards renamed so."""
    write_shards(folder, FIELDS, _arrays(n, seed), samples_per_shard=PER_SHARD, num_workers=1, progress=False)
    shards = sorted(folder.glob("*.stoker"))
    if names is not None:
        renamed = [p.rename(folder / name) for p, name in zip(shards, names)]
        (folder / MANIFEST_NAME).write_bytes(build_manifest(folder, renamed, None))
        shards = renamed
    return shards


def _upload(folder: Path, url: str) -> None:
    store = open_store(url)
    for path in sorted(folder.iterdir()):
        if path.name != MANIFEST_NAME:
            store.upload(path.name, path)
    store.upload(MANIFEST_NAME, folder / MANIFEST_NAME)


def _epoch(source: str, **kw: Any) -> tuple[np.ndarray, np.ndarray]:
    """One SEQUENTIAL epoch: every sample's x and y, in order."""
    with Loader(source, batch_size=64, num_workers=1, **kw) as loader:
        xs, ys = zip(*[(x.numpy().copy(), y.numpy().copy().ravel()) for x, y in loader])
    return np.concatenate(xs), np.concatenate(ys)


def _flip_data_byte(path: Path, sample: int = 5) -> None:
    """Flip a byte of sample ``sample``'s x in the data region (the head, checked at open, stays intact)."""
    with Reader(path) as reader:
        at = reader._columns["x"] + sample * 64 + 3
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x40
    path.write_bytes(bytes(raw))


_CHILD_EPOCH = """
import json, sys
import numpy as np
from stoker import Loader
url, cache, out = sys.argv[1], sys.argv[2], sys.argv[3]
with Loader(url, batch_size=64, num_workers=1, cache_dir=cache) as loader:
    xs, ys = zip(*[(x.numpy().copy(), y.numpy().copy().ravel()) for x, y in loader])
    np.savez(out, x=np.concatenate(xs), y=np.concatenate(ys))
    print(json.dumps(loader.remote.stats()))
"""


def _run(code: str, *args: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "PYTHONPATH": PATH, **(env or {})}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, env=environ)


def _du(cache_dir: Path) -> int:
    """What ``du`` counts of ``cache_dir`` (the blocks of every file and folder in it), taken under the cache's lock
    shared (the cache changes its folders under it exclusively: a rename is never seen half done)."""
    fd = os.open(cache_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        total = os.lstat(cache_dir).st_blocks * 512
        for root, dirs, files in os.walk(cache_dir):
            for name in dirs + files:
                with contextlib.suppress(FileNotFoundError):
                    total += os.lstat(os.path.join(root, name)).st_blocks * 512
        return total
    finally:
        os.close(fd)


# ---- content identity, checked before use ------------------------------------------------------------------
def test_bit_rot_in_the_cache_is_found_and_refetched_by_a_new_process(s3: loopback.S3Server, tmp_path: Path) -> None:
    """A byte flipped in a cached shard after a first run: the next process checks the blocks it reads (it did not
    download that file), finds the flip before any compiled code reads it, downloads the shard again and serves the
    right data."""
    folder = tmp_path / "ds"
    _write(folder, 400)
    url = s3.url("rot/")
    _upload(folder, url)
    want_x, want_y = _epoch(str(folder))
    cache = tmp_path / "cache"
    _epoch(url, cache_dir=cache)  # the first run fills the cache
    with Loader(url, batch_size=64, cache_dir=cache) as probe:
        rotten = probe.remote.cached_path(1)
    assert rotten.exists()
    _flip_data_byte(rotten)
    second = _run(_CHILD_EPOCH, url, str(cache), str(tmp_path / "second.npz"))
    assert second.returncode == 0, second.stderr[-3000:]
    got = np.load(tmp_path / "second.npz")
    assert np.array_equal(got["y"], want_y) and np.array_equal(got["x"], want_x)  # not the flipped value
    stats = json.loads(second.stdout)
    assert stats["refetches"] == 1 and stats["downloads"] == 1  # that shard, once
    with Reader(rotten) as reader:
        reader.verify()  # the cache holds the good shard again


def test_bit_rot_in_the_cache_and_in_the_store_is_refused_naming_the_url_and_the_cache_path(s3: loopback.S3Server, tmp_path: Path) -> None:
    folder = tmp_path / "ds"
    shards = _write(folder, 300)
    url = s3.url("rot-both/")
    _upload(folder, url)
    cache = tmp_path / "cache"
    _epoch(url, cache_dir=cache)
    with Loader(url, batch_size=64, cache_dir=cache) as probe:
        rotten = probe.remote.cached_path(2)
    _flip_data_byte(rotten)
    _flip_data_byte(shards[2])  # the store's copy too: the download again is refused as well
    open_store(url).upload(shards[2].name, shards[2])
    with pytest.raises(DatasetFormatError) as info:
        _epoch(url, cache_dir=cache)
    text = str(info.value)
    assert url + shards[2].name in text and str(rotten) in text, text


def test_a_rewritten_dataset_of_same_sized_shards_is_never_served_from_the_old_cache(s3: loopback.S3Server, tmp_path: Path) -> None:
    """Shards named by hand, rewritten at the same URL with other content of the same size: a Loader after the
    rewrite reads the new data (the cache names files by what they hold), never the old bytes under the new metadata."""
    names = [f"part-{k}.stoker" for k in range(3)]
    old, new = tmp_path / "old", tmp_path / "new"
    old_shards = _write(old, 300, seed=1, names=names)
    new_shards = _write(new, 300, seed=2, names=names)
    assert [p.stat().st_size for p in old_shards] == [p.stat().st_size for p in new_shards]
    url = s3.url("rewritten/")
    cache = tmp_path / "cache"
    _upload(old, url)
    old_x, _ = _epoch(url, cache_dir=cache)
    assert np.array_equal(old_x, _arrays(300, 1)["x"])
    _upload(new, url)
    for verify in (False, True):  # without the check before use too: the old files are not even looked at
        with Loader(url, batch_size=64, num_workers=1, cache_dir=cache, check_data=verify) as loader:
            got_x = np.concatenate([x.numpy() for x, _ in loader])
            stats = loader.remote.stats()
        assert np.array_equal(got_x, _arrays(300, 2)["x"])
        assert stats["downloads"] == (3 if not verify else 0) and stats["refetches"] == 0


def test_a_shard_replaced_after_its_head_was_read_is_refused_at_download(s3: loopback.S3Server, tmp_path: Path) -> None:
    """The download-time comparison with the manifest: a Loader opened version A (manifest and heads); the shards are
    then replaced by version B of the same size, whose CRCs are all consistent. The download must be refused (its
    header is not the manifest's), never read as A's data."""
    names = [f"part-{k}.stoker" for k in range(2)]
    a, b = tmp_path / "a", tmp_path / "b"
    _write(a, 200, seed=3, names=names)
    b_shards = _write(b, 200, seed=4, names=names)
    url = s3.url("replaced/")
    _upload(a, url)
    loader = Loader(url, batch_size=64, num_workers=1, cache_dir=tmp_path / "cache")
    try:
        store = open_store(url)
        for shard in b_shards:
            store.upload(shard.name, shard)  # B's shards under A's manifest
        with pytest.raises(StokerError) as info:
            for _ in loader:
                pass
        text = str(info.value) + repr(info.value.__cause__)
        assert url + names[0] in text and "manifest" in text
        assert loader.remote.stats()["refetches"] >= 1
        assert not loader.remote.cached_path(0).exists()
    finally:
        loader.close()


def test_the_heads_are_small_files_of_the_cache(s3: loopback.S3Server, tmp_path: Path) -> None:
    """No sparse stubs of full size: a head takes the bytes of its shard but the data region (any file system)."""
    folder = tmp_path / "ds"
    shards = _write(folder, 300)
    url = s3.url("heads/")
    _upload(folder, url)
    cache = tmp_path / "cache"
    with Loader(url, batch_size=64, cache_dir=cache) as loader:
        loader.reader.read_heads()  # type: ignore[union-attr]  # (the open reads the first, batches the others)
        for k, (head, shard) in enumerate(zip(loader.reader.paths, shards)):
            with Reader(shard) as reader:
                assert head.stat().st_size == reader.data_offset + reader.file_size - reader.checksum_offset < reader.file_size
            assert head.parent == loader.remote.cache.directory and head != loader.remote.cached_path(k)


# ---- the limit is the disk ---------------------------------------------------------------------------------------
def test_disk_use_stays_within_the_limit_over_two_epochs(s3: loopback.S3Server, tmp_path: Path) -> None:
    """``du`` of cache_dir, sampled from another thread all along two epochs of two producer threads: within the limit
    (heads, shards, downloads in progress, lock files and the folders all count)."""
    folder = tmp_path / "ds"
    shards = _write(folder, 1200)
    url = s3.url("disk/")
    _upload(folder, url)
    cache = tmp_path / "cache"
    limit = 5 * max(p.stat().st_size for p in shards)
    loader = Loader(url, batch_size=50, order=OrderOption.QUASI_RANDOM, seed=1, num_workers=2, cache_dir=cache, cache_limit=limit,
                    chunk_size=50, window_chunks=2)  # fmt: skip
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(_du(cache))
            stop.wait(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        seen = [int(v) for _ in range(2) for _, y in loader for v in y.numpy().ravel()]
    finally:
        stop.set()
        sampler.join()
        loader.close()
    assert sorted(seen) == sorted(list(range(1200)) * 2)
    assert len(samples) > 10 and max(samples) <= limit, (max(samples), limit)
    assert max(samples) > 2 * max(p.stat().st_size for p in shards)  # it did hold shards


def test_the_default_limit_is_a_fraction_of_the_free_disk(s3: loopback.S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "ds"
    _write(folder, 200)
    url = s3.url("default-limit/")
    _upload(folder, url)
    cache = tmp_path / "cache"
    with Loader(url, batch_size=64, cache_dir=cache) as loader:
        limit = loader.remote.limit
        used = loader.remote.cache.usage_bytes()
        st = os.statvfs(cache)
        free = st.f_bavail * st.f_frsize
        assert loader.remote.cache.limit == limit == loader.remote.stats()["cache_limit"]
        # (measured at open: the free space moves a little since, with this machine's other work)
        assert abs(limit - DEFAULT_LIMIT_FRACTION * (free + used)) < 0.01 * limit + (64 << 20)
    assert default_limit(cache, 1000) >= int(DEFAULT_LIMIT_FRACTION * 1000)
    # applied: a fraction that leaves less than a shard is refused, naming the default
    monkeypatch.setattr("stoker.remote._cache_room.DEFAULT_LIMIT_FRACTION", 1e-12)
    with pytest.raises(StokerError, match="the default cache_limit"):
        Loader(url, batch_size=64, cache_dir=cache)


# ---- a node cache that always makes progress ---------------------------------------------------------------------
_RANK = """
import json, sys
from stoker import Loader, OrderOption
url, cache, limit, rank = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
with Loader(url, batch_size=32, num_workers=2, order=OrderOption.QUASI_RANDOM, seed=rank, cache_dir=cache, cache_limit=limit,
            chunk_size=64, window_chunks=2) as loader:
    seen = sorted(int(v) for _ in range(2) for _, y in loader for v in y.numpy().ravel())
    print(json.dumps({"seen": seen, "stats": loader.remote.stats()}))
"""


def test_two_processes_share_a_cache_of_four_shards(s3: loopback.S3Server, tmp_path: Path) -> None:
    """Two trainers on one node, one cache of 4 shards' size, the default download_ahead (4): both complete two
    epochs with every sample twice (before, one waited 60 s and failed with CacheFullError: the shards the other
    had downloaded ahead held the room), and ``du`` of the cache, sampled all along, stays within the limit."""
    folder = tmp_path / "ds"
    shards = _write(folder, 1600)
    url = s3.url("two-ranks/")
    _upload(folder, url)
    cache = tmp_path / "shared"
    limit = 4 * max(p.stat().st_size for p in shards)
    env = {**os.environ, "PYTHONPATH": PATH}
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, url, str(cache), str(limit), str(r)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]  # fmt: skip
    samples = []
    deadline = time.monotonic() + 240
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if (cache / ".lock").exists():
            samples.append(_du(cache))
        time.sleep(0.005)
    outs = [p.communicate(timeout=60) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert json.loads(out)["seen"] == sorted(list(range(1600)) * 2)
    assert len(samples) > 10 and max(samples) <= limit, (max(samples), limit)


# ---- a cache safe on a shared node -------------------------------------------------------------------------------
_UMASK_0 = """
import os, sys
os.umask(0)
import numpy as np
from stoker import Loader, OrderOption
from stoker.format import _validated
for source in sys.argv[1:]:  # the remote dataset, and its local folder (compiled: its pipelines' code is cached)
    with Loader(source, batch_size=64, num_workers=1, order=OrderOption.QUASI_RANDOM, seed=0) as loader:
        for _ in loader:
            pass
_validated.record("a record")  # (the loader records only tables of 16 MiB and more)
print("ok")
"""


@pytest.mark.compiled_loop
def test_cache_folders_and_files_are_private_under_umask_0(s3: loopback.S3Server, tmp_path: Path) -> None:
    """With umask 0, every folder stoker makes in its cache root is 0700 and every file it writes 0600 (shards,
    heads, locks, generated code, records). Numba's own files in fused/__pycache__ take the umask, inside a 0700 folder."""
    folder = tmp_path / "ds"
    _write(folder, 200)
    url = s3.url("umask/")
    _upload(folder, url)
    root = tmp_path / "root"
    proc = _run(_UMASK_0, url, str(folder), env={"STOKER_CACHE_DIR": str(root)})
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
    folders = files = 0
    assert stat.S_IMODE(os.lstat(root).st_mode) == 0o700
    for where, dirs, names in os.walk(root):
        for name in dirs:
            assert stat.S_IMODE(os.lstat(Path(where) / name).st_mode) == 0o700, Path(where) / name
            folders += 1
        if Path(where).name == "__pycache__":
            continue  # Numba's index and machine code
        for name in names:
            st = os.lstat(Path(where) / name)
            assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, Path(where) / name
            files += 1
    assert {p.name for p in root.iterdir()} >= {"remote", "fused", "validated"}
    assert folders >= 4 and files >= 6


def test_planted_links_are_never_followed(s3: loopback.S3Server, tmp_path: Path) -> None:
    """Links planted under the names the cache uses (a shard, its download, its locks, a head) point to files of
    the planter's: nothing is read through them (a link to a true copy of a shard is not taken for it: the shard is
    downloaded), nothing written through them, and they are gone after."""
    from stoker.remote._cache_room import disk_bytes

    folder = tmp_path / "ds"
    shards = _write(folder, 300)
    url = s3.url("links/")
    _upload(folder, url)
    cache = tmp_path / "cache"
    want_x, want_y = _epoch(str(folder))
    with Loader(url, batch_size=64, cache_dir=cache) as probe:  # the names (the heads are cached now)
        names = [probe.remote.cached_path(k) for k in range(3)]
        heads = probe.reader.paths
    part = names[0].with_name(f".{names[0].name}.{disk_bytes(shards[0].stat().st_size)}.part")
    decoy = tmp_path / "decoy.stoker"
    shutil.copy(shards[0], decoy)
    victims = {what: tmp_path / f"victim-{what}" for what in ["lock", "pin", "part", "shard", "head"]}
    for victim in victims.values():
        victim.write_bytes(b"the planter's file")
    planted = {
        names[0]: decoy,
        part: victims["part"],
        names[1].with_name(f".{names[1].name}.lock"): victims["lock"],
        names[1].with_name(f".{names[1].name}.pin"): victims["pin"],
        names[2]: victims["shard"],
    }
    for link, target in planted.items():
        os.symlink(target, link)
    # download_ahead=1: shard 0 is the first thing the cache is asked for (no other download clears the links first)
    with Loader(url, batch_size=64, num_workers=1, cache_dir=cache, download_ahead=1) as loader:
        xs, ys = zip(*[(x.numpy().copy(), y.numpy().copy().ravel()) for x, y in loader])
        assert loader.remote.stats()["downloads"] == 3  # shard 0 too: the link to its copy was not followed
    assert np.array_equal(np.concatenate(xs), want_x) and np.array_equal(np.concatenate(ys), want_y)
    heads[1].unlink()
    os.symlink(victims["head"], heads[1])  # a head: read from the store again
    got_x, got_y = _epoch(url, cache_dir=cache)
    assert np.array_equal(got_x, want_x) and np.array_equal(got_y, want_y)
    for victim in victims.values():
        assert victim.read_bytes() == b"the planter's file"
    assert decoy.read_bytes() == shards[0].read_bytes()
    for link in [*planted, heads[1]]:
        assert not link.is_symlink(), link
    assert all(stat.S_ISREG(os.lstat(p).st_mode) for p in [*names, heads[1]])


def test_a_cache_folder_others_can_write_is_refused_unless_shared_on_purpose(s3: loopback.S3Server, tmp_path: Path) -> None:
    folder = tmp_path / "ds"
    _write(folder, 100)
    url = s3.url("perm/")
    _upload(folder, url)
    cache = tmp_path / "open-cache"
    cache.mkdir()
    cache.chmod(0o777)
    with pytest.raises(UnsafeCacheError, match=r"writable by its group and others \(mode 0777\).*cache_shared=True") as info:
        Loader(url, batch_size=64, cache_dir=cache)
    assert str(cache) in str(info.value)
    cache.chmod(0o770)
    with pytest.raises(UnsafeCacheError, match="writable by its group"):
        Loader(url, batch_size=64, cache_dir=cache)
    _, ys = _epoch(url, cache_dir=cache, cache_shared=True)  # opted in: used, every file still checked
    assert np.array_equal(ys, np.arange(100))
    made = [p for p in cache.iterdir() if p.is_dir()]
    assert made and all(stat.S_IMODE(p.stat().st_mode) == 0o770 for p in made)  # the folder's group bits
    assert all(stat.S_IMODE(p.stat().st_mode) & 0o022 == 0 for p in made[0].iterdir())  # no file writable by others
    inside = tmp_path / "inside-open"  # a private folder inside a folder others can write (not sticky)
    (inside / "cache").mkdir(parents=True, mode=0o700)
    inside.chmod(0o777)
    with pytest.raises(UnsafeCacheError, match="lies inside"):
        Loader(url, batch_size=64, cache_dir=inside / "cache")


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="making a folder of another user needs root")
def test_a_cache_folder_of_another_user_is_refused(s3: loopback.S3Server, tmp_path: Path) -> None:
    cache = tmp_path / "theirs"
    cache.mkdir(mode=0o700)
    os.chown(cache, 12345, 12345)
    with pytest.raises(UnsafeCacheError, match="belongs to another user"):
        _cache_roots.open_folder(cache)
    assert _cache_roots.open_folder(cache, shared=True).shared


def test_code_and_records_are_never_cached_where_others_can_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Generated code is run and a record skips a check: no opt-in, a root others can write is not used (a warning)."""
    from stoker.format import _validated
    from stoker.pipeline import cache as fused

    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    monkeypatch.setenv("STOKER_CACHE_DIR", str(root))
    monkeypatch.setattr(_cache_roots, "_WARNED", set())
    assert fused.cache_dir() == root / "fused" and stat.S_IMODE((root / "fused" / "__pycache__").stat().st_mode) == 0o700
    _validated.record("key")
    assert _validated.is_recorded("key")
    record = next((root / "validated").iterdir())
    record.unlink()
    os.symlink(tmp_path / "elsewhere", record)  # a planted record, through a link: not read
    (tmp_path / "elsewhere").write_text("key")
    assert not _validated.is_recorded("key")
    root.chmod(0o777)
    with pytest.warns(_cache_roots.CacheWarning, match="writable by"):
        assert fused.cache_dir() is None
    assert _cache_roots.private_dir("validated") is None and not _validated.is_recorded("key")


# ---- waits on another process ------------------------------------------------------------------------------------
def test_a_wait_for_another_process_download_ends_on_cancel_and_when_it_stalls(s3: loopback.S3Server, tmp_path: Path) -> None:
    store = open_store(s3.url("waits/"))
    store.write("k", b"z" * 5000)
    cache = ShardCache(store, tmp_path, limit=None, stall=3600)
    other = ShardCache(store, tmp_path, limit=None)  # as another process: its own descriptors (flock is per open file)
    lock = other._aux("k@5000", ".lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # "another process" downloads k, and never finishes
    try:
        errors: list[BaseException] = []

        def fetch() -> None:
            try:
                cache.pin("k", 5000)
            except BaseException as exc:
                errors.append(exc)

        waiter = threading.Thread(target=fetch)
        waiter.start()
        while not cache.stats()["waits_for_other_process"]:
            time.sleep(0.01)
        t0 = time.monotonic()
        cache.cancel()
        waiter.join(30)
        assert not waiter.is_alive() and time.monotonic() - t0 < 10  # (about 0.25 s)
        assert isinstance(errors[0], StokerError) and "closed" in str(errors[0])
        stalled = ShardCache(store, tmp_path, limit=None, stall=0.5)
        with pytest.raises(StokerError, match=r"no progress for 0\.5 s"):
            stalled.pin("k", 5000)
    finally:
        os.close(fd)
    assert cache.pin("k", 5000).read_bytes() == b"z" * 5000  # the lock free: no wait
