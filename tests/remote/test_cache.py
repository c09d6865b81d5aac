"""stoker.remote's ShardCache against moto's S3 server: the limit, sharing between processes, kills, bad bytes."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

import pytest
from benchmarks._servers.loopback import LatencyProxy, S3Server
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import stoker
from stoker.errors import CacheFullError, DatasetFormatError, RemoteNotFoundError
from stoker.remote import ShardCache, Store, default_cache_dir, open_store
from stoker.remote._cache_room import disk_bytes
from tests.remote.conftest import options

from .._profile import examples

CHILD = Path(__file__).with_name("_child.py")
ROOT = Path(__file__).resolve().parents[2]


def _blocks(n: int) -> int:
    """The disk a file of ``n`` bytes takes (4 KiB blocks)."""
    return -(-n // 4096) * 4096


def _put(store: Store, sizes: dict[str, int]) -> dict[str, bytes]:
    data = {key: os.urandom(n) for key, n in sizes.items()}
    for key, payload in data.items():
        store.write(key, payload)
    return data


def test_fetch_hit_pin_and_unpin(store: Store, tmp_path: Path) -> None:
    data = _put(store, {"a": 1000, "b": 2000})
    cache = ShardCache(store, tmp_path, limit=None)
    base = cache.usage_bytes()  # the cache's folders
    path = cache.pin("a", 1000)
    assert path.read_bytes() == data["a"]
    assert path.parent == cache.directory and cache.directory.parent == tmp_path
    assert cache.pin("a", 1000) == path  # pinned twice
    cache.unpin("a")
    cache.unpin("a")
    with pytest.raises(KeyError):
        cache.unpin("a")
    assert cache.pin("a", 1000) == path
    stats = cache.stats()
    assert stats["downloads"] == 1 and stats["hits"] == 2 and stats["bytes_downloaded"] == 1000
    assert cache.usage_bytes() == base + _blocks(1000)
    assert cache.peak_bytes == base + disk_bytes(1000)  # the download's reservation
    # a second cache on the same folder (another process would do the same) finds the file
    other = ShardCache(store, tmp_path, limit=None)
    assert other.pin("a", 1000) == path and other.stats()["downloads"] == 0
    assert sorted(p.name for p in cache.directory.iterdir() if not p.name.startswith(".")) == ["a@1000"]


def test_threads_fetching_one_key_download_it_once(store: Store, tmp_path: Path) -> None:
    data = _put(store, {"k": 500_000})
    cache = ShardCache(store, tmp_path, limit=600_000)
    start = threading.Barrier(8)
    paths: list[Path] = []

    def fetch() -> None:
        start.wait()
        paths.append(cache.pin("k", 500_000))

    threads = [threading.Thread(target=fetch) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(paths) == 8 and all(p.read_bytes() == data["k"] for p in paths)
    stats = cache.stats()
    assert (stats["downloads"], stats["hits"]) == (1, 7)
    for _ in range(8):
        cache.unpin("k")
    with pytest.raises(KeyError):
        cache.unpin("k")


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path / "remote"
    monkeypatch.delenv("STOKER_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    if sys.platform.startswith("linux"):
        assert default_cache_dir() == tmp_path / "xdg" / "stoker" / "remote"


def test_eviction_follows_priority(store: Store, tmp_path: Path) -> None:
    _put(store, {k: 1000 for k in "abcd"})
    cache = ShardCache(store, tmp_path, limit=None)
    cache.limit = cache.usage_bytes() + 3 * _blocks(1000) + disk_bytes(1000) - _blocks(1000)  # three files, or two and a download
    for k in "abc":
        cache.pin(k, 1000)
        cache.unpin(k)
    order = {"a": -2.0, "b": float("-inf"), "c": -1.0, "d": 0.0}
    cache.set_priority(lambda key, ident: order[key])
    cache.pin("d", 1000)
    present = sorted(p.name for p in cache.directory.iterdir() if not p.name.startswith("."))
    assert present == ["a@1000", "c@1000", "d@1000"]  # b (-inf: not needed again) went first
    assert cache.stats()["evictions"] == 1


def test_limit_holds_while_threads_fetch(store: Store, tmp_path: Path) -> None:
    sizes = {f"s{i}": 20_000 + 3_000 * i for i in range(12)}
    _put(store, sizes)
    limit = 3 * max(sizes.values())
    cache = ShardCache(store, tmp_path, limit=limit, wait=30.0)
    samples: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append(cache.usage_bytes())

    def consume(keys: list[str]) -> None:
        for key in keys:
            path = cache.pin(key, sizes[key])
            assert path.stat().st_size == sizes[key]
            cache.unpin(key)

    sampler = threading.Thread(target=sample)
    sampler.start()
    keys = list(sizes) * 3
    workers = [threading.Thread(target=consume, args=(keys[i::2],)) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    done.set()
    sampler.join()
    assert samples and max(samples) <= limit
    assert cache.peak_bytes <= limit
    assert cache.stats()["evictions"] > 0


KEYS = {f"h{i}": 3000 * (i + 1) for i in range(8)}


@pytest.fixture(scope="module")
def model_store(s3: S3Server) -> Store:
    store = open_store(s3.url("hypothesis/"), options(s3.endpoint))
    for key in KEYS:
        store.write(key, model_data(key))
    return store


@settings(max_examples=examples(ci=10, long=30), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    room=st.integers(0, 80_000),
    priorities=st.permutations(list(range(len(KEYS)))),
    ops=st.lists(st.tuples(st.sampled_from(sorted(KEYS)), st.sampled_from(["read", "keep", "ahead"])), max_size=16),
)
# a batch's download evicts a file downloaded ahead (h3) when the rest is pinned (h7): it never waits on room that only
# downloads ahead hold
@example(room=55_000, priorities=list(range(8)), ops=[("h3", "ahead"), ("h7", "keep"), ("h6", "read")])
def test_cache_against_a_reference_model(model_store: Store, room: int, priorities: list[int], ops: list[tuple[str, str]]) -> None:
    """Each op fetches a key for a batch ("read": then unpins it; "keep": keeps it pinned) or ahead of need ("ahead":
    pinned weakly); the cache must do what a plain model of its disk does: a file takes its blocks, a download its
    blocks and one more; a batch's download evicts what no batch holds, lowest priority first, or fails; a download
    ahead evicts only what nobody holds, and leaves ``headroom`` that a batch's download could take (free, or held by
    files it may evict), or is put off."""
    priority = dict(zip(sorted(KEYS), priorities))
    with tempfile.TemporaryDirectory() as tmp:
        cache = ShardCache(model_store, tmp, limit=None, wait=0.0)
        base = cache.usage_bytes()  # the folders
        cache.limit = limit = base + room
        cache.headroom = headroom = disk_bytes(max(KEYS.values()))
        cache.set_priority(lambda key, ident: float(priority[key]))
        present: set[str] = set()
        pins: dict[str, int] = {}
        weak: dict[str, int] = {}
        downloads = evictions = 0
        for key, mode in ops:
            size = KEYS[key]
            if key not in present:
                need = disk_bytes(size)
                used = base + sum(_blocks(KEYS[k]) for k in present)
                hard = base + sum(_blocks(KEYS[k]) for k in present & set(pins))  # what a batch's download cannot evict
                deferred = mode == "ahead" and used + need + headroom > limit and hard + need + headroom > limit
                held = set(pins) | (set(weak) if mode == "ahead" else set())
                for victim in sorted(present - held, key=priority.__getitem__):
                    if deferred or used + need <= limit:
                        break
                    present.discard(victim)
                    used -= _blocks(KEYS[victim])
                    evictions += 1
                if deferred or used + need > limit:
                    if mode == "ahead":
                        assert cache.pin_ahead(key, size) is None
                    else:
                        with pytest.raises(CacheFullError):
                            cache.pin(key, size)
                    assert cache.usage_bytes() <= limit
                    continue
                present.add(key)
                downloads += 1
            if mode == "ahead":
                assert cache.pin_ahead(key, size) == cache.path(key, size)
                weak[key] = weak.get(key, 0) + 1
            else:
                assert cache.pin(key, size).read_bytes() == model_data(key)
                if mode == "keep":
                    pins[key] = pins.get(key, 0) + 1
                else:
                    cache.unpin(key)
            assert cache.usage_bytes() <= limit
        on_disk = {p.name for p in cache.directory.iterdir() if not p.name.startswith(".")}
        assert on_disk == {f"{k}@{KEYS[k]}" for k in present}
        assert cache.usage_bytes() == base + sum(_blocks(KEYS[k]) for k in present)
        stats = cache.stats()
        assert (stats["downloads"], stats["evictions"]) == (downloads, evictions)
        assert not list(cache.directory.glob(".*.part"))
        for key, n in weak.items():
            for _ in range(n):
                cache.unpin(key, ahead=True)
        cache.close()


def model_data(key: str) -> bytes:
    return bytes((7 * int(key[1:]) + i) % 251 for i in range(KEYS[key]))


def test_full_cache_is_a_clear_error(store: Store, tmp_path: Path) -> None:
    _put(store, {"a": 4000, "b": 4000, "c": 4000, "huge": 20_000})
    cache = ShardCache(store, tmp_path / "cache", limit=None, wait=0.3)
    base = cache.usage_bytes()
    cache.limit = limit = base + 2 * _blocks(4000) + disk_bytes(4000) - 1
    cache.pin("a", 4000)
    cache.pin("b", 4000)  # both pinned: less than a download's reservation left
    with pytest.raises(CacheFullError) as info:
        cache.pin("c", 4000)
    message = str(info.value)
    assert str(tmp_path / "cache") in message and str(limit) in message and str(disk_bytes(4000)) in message
    assert str(base + 2 * _blocks(4000)) in message  # what is held
    with pytest.raises(CacheFullError, match="larger than the limit"):
        cache.pin("huge", 20_000)
    assert cache.usage_bytes() == base + 2 * _blocks(4000)  # nothing reserved by the failures
    cache.unpin("a")
    assert cache.pin("c", 4000).read_bytes()  # once a pin is released it fits


def test_full_disk_is_a_clear_error(store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _put(store, {"a": 4000})
    cache = ShardCache(store, tmp_path / "cache", limit=100_000)
    base = cache.usage_bytes()

    def full(key: str, dest: Path, size: int | None = None) -> int:
        dest.write_bytes(b"x" * 10)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(store, "download", full)
    with pytest.raises(CacheFullError, match=r"disk is full.*cache_limit") as info:
        cache.pin("a", 4000)
    assert str(tmp_path / "cache") in str(info.value)
    assert cache.usage_bytes() == base


def test_missing_object_leaves_nothing(store: Store, tmp_path: Path) -> None:
    cache = ShardCache(store, tmp_path, limit=100_000)
    base = cache.usage_bytes()
    with pytest.raises(RemoteNotFoundError, match=r"nope\.stoker"):
        cache.pin("nope.stoker", 100)
    assert cache.usage_bytes() == base and [p.name for p in cache.directory.iterdir() if "part" in p.name] == []


def test_flipped_byte_is_refused_after_one_refetch(store: Store, tmp_path: Path) -> None:
    good = os.urandom(5000)
    crc = zlib.crc32(good)
    bad = bytearray(good)
    bad[1234] ^= 0x01
    store.write("shard-00000.stoker", bytes(bad))

    def check(key: str, path: Path) -> None:
        if zlib.crc32(path.read_bytes()) != crc:
            raise DatasetFormatError(path, "checksum does not match the manifest")

    cache = ShardCache(store, tmp_path, limit=None, check=check)
    base = cache.usage_bytes()
    with pytest.raises(DatasetFormatError) as info:
        cache.pin("shard-00000.stoker", 5000)
    assert f"{store.url}shard-00000.stoker" in str(info.value)
    assert "checksum" in str(info.value)
    stats = cache.stats()
    assert stats["downloads"] == 2 and stats["refetches"] == 1
    assert cache.usage_bytes() == base and not cache.path("shard-00000.stoker", 5000).exists()
    # a wrong size is refused the same way
    store.write("short", good[:100])
    with pytest.raises(DatasetFormatError, match="100 bytes instead of 5000"):
        ShardCache(store, tmp_path, limit=None).pin("short", 5000)
    store.write("shard-00000.stoker", good)
    assert cache.pin("shard-00000.stoker", 5000).read_bytes() == good


def _child(url: str, endpoint: str, cache_dir: Path, limit: int | None, keys: list[tuple[str, int]]) -> subprocess.Popen[str]:
    args = {"url": url, "options": options(endpoint), "cache_dir": str(cache_dir), "limit": limit, "keys": keys}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(Path(stoker.__file__).parents[1])])}  # this stoker
    return subprocess.Popen(
        [sys.executable, str(CHILD), json.dumps(args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )


def test_two_processes_download_each_key_once(s3: S3Server, store: Store, prefix: str, tmp_path: Path) -> None:
    sizes = {f"k{i}": 200_000 for i in range(6)}
    data = _put(store, sizes)
    keys = sorted(sizes.items())
    # a slow link (5 MB/s shared) makes the two processes overlap on the same keys
    with LatencyProxy(s3.host, s3.port, latency_ms=5, bandwidth=5e6) as slow:
        children = [_child(s3.url(prefix), slow.endpoint, tmp_path, None, keys[::step]) for step in (1, -1)]
        results = [c.communicate(timeout=120) for c in children]
        for child, (_out, err) in zip(children, results):
            assert child.returncode == 0, err
        stats = [json.loads(out) for out, _err in results]
    assert sum(s["downloads"] for s in stats) == len(sizes)
    assert sum(s["hits"] for s in stats) == len(sizes)
    cache = ShardCache(store, tmp_path, limit=None)
    for key, size in keys:
        assert cache.pin(key, size).read_bytes() == data[key]
    assert cache.stats()["downloads"] == 0


def test_killed_download_leaves_nothing_that_is_read(s3: S3Server, store: Store, prefix: str, tmp_path: Path) -> None:
    data = _put(store, {"big": 3_000_000, "other": 2_000_000})
    with LatencyProxy(s3.host, s3.port, bandwidth=300_000) as slow:  # 10 s for the object: killed long before
        child = _child(s3.url(prefix), slow.endpoint, tmp_path, 4_000_000, [("big", 3_000_000)])
        try:
            parts: list[Path] = []
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not any(p.stat().st_size > 0 for p in parts):
                time.sleep(0.05)
                parts = list(tmp_path.glob("*/.*.part"))
            assert parts, "the child never started writing its download"
        finally:
            child.send_signal(signal.SIGKILL)
            child.communicate(timeout=30)
    assert child.returncode == -signal.SIGKILL
    cache = ShardCache(store, tmp_path, limit=4_000_000)
    assert not cache.path("big", 3_000_000).exists()
    folders = 2 * 4096
    assert cache.usage_bytes() == folders + disk_bytes(3_000_000)  # the dead download's reservation, until the next reservation removes it
    # another key needs that room: the stale download is seen as such (its lock is free) and removed
    assert cache.pin("other", 2_000_000).read_bytes() == data["other"]
    assert not list(cache.directory.glob(".*.part"))
    cache.unpin("other")
    path = cache.pin("big", 3_000_000)  # the killed process's lock was released with it: no wait
    assert path.read_bytes() == data["big"]
    assert cache.usage_bytes() == folders + _blocks(3_000_000)  # "other" evicted to make room
