"""The Loader on a faulty store: it rides through throttling, cut bodies and outages, stops at once, names what failed.

A fault proxy (tests/remote/_faults.py) stands between the loader and moto's S3 server; every test asserts that
the faults it rode through were really injected, and that every sample of every epoch came exactly once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from benchmarks._servers.loopback import S3Server

from stoker import Loader, OrderOption
from stoker.dataset.shards import write_shards
from stoker.errors import DatasetFormatError, LoaderError, RemoteError, StokerError
from stoker.fields import IntField, NDArrayField
from stoker.format.reader import Reader
from stoker.remote import open_store
from tests.remote._faults import FaultProxy
from tests.remote.conftest import options

ROOT = Path(__file__).resolve().parents[2]
N = 1200
PER_SHARD = 200
FIELDS = {"x": NDArrayField(np.dtype("float32"), (64,)), "y": IntField()}


def _dataset(s3: S3Server, folder: Path, prefix: str, n: int = N, per_shard: int = PER_SHARD, width: int = 64) -> tuple[str, list[int]]:
    """A dataset of ``n`` samples (``y`` = its index) written locally, then uploaded under ``prefix``; its URL and shard sizes."""
    rng = np.random.default_rng(0)
    fields = {"x": NDArrayField(np.dtype("float32"), (width,)), "y": IntField()}
    arrays = {"x": rng.normal(size=(n, width)).astype(np.float32), "y": np.arange(n, dtype=np.int64)}
    write_shards(folder, fields, arrays, samples_per_shard=per_shard, num_workers=1, progress=False)
    store = open_store(s3.url(prefix), options(s3.endpoint))
    names = sorted(p.name for p in folder.iterdir())
    for name in names:
        if name.endswith(".stoker"):
            store.upload(name, folder / name)
    store.upload("manifest.stoker.json", folder / "manifest.stoker.json")
    return s3.url(prefix), [(folder / name).stat().st_size for name in names if name.endswith(".stoker")]


@pytest.fixture(scope="module")
def small(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[int]]:
    """6 shards of about 55 KB."""
    return _dataset(s3, tmp_path_factory.mktemp("small") / "ds", "faults-small/")


@pytest.fixture(scope="module")
def large(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[int]]:
    """4 shards of about 1 MB: a 64 KB/s store takes 16 s for one."""
    return _dataset(s3, tmp_path_factory.mktemp("large") / "ds", "faults-large/", n=1000, per_shard=250, width=1024)


@pytest.fixture
def faults(s3: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(s3.host, s3.port, seed=29) as proxy:
        yield proxy


def _epochs(loader: Loader, epochs: int = 2, after_first: Any = None) -> list[list[int]]:
    out = []
    for _ in range(epochs):
        seen: list[int] = []
        for batch in loader:
            seen += batch[1].numpy().ravel().tolist()
            if after_first is not None:
                after_first()
                after_first = None
        out.append(sorted(seen))
    return out


def _nothing_partial(cache_dir: Path, sizes: list[int]) -> None:
    """No partial download is left, and every shard file in the cache is whole and passes every check."""
    files = [p for p in cache_dir.rglob("*") if p.is_file() and "heads" not in p.parts]
    assert not [p for p in files if p.name.endswith(".part")]
    for p in files:
        if p.name.endswith(".stoker") and not p.name.startswith("."):
            assert p.stat().st_size in sizes
            with Reader(p) as reader:
                reader.verify()


def _loader(url: str, proxy: FaultProxy, cache: Path, limit: int | None, **extra: Any) -> Loader:
    opts = options(proxy.endpoint, **extra.pop("storage", {}))
    kw: dict[str, Any] = {"batch_size": 100, "order": OrderOption.QUASI_RANDOM, "seed": 0, "num_workers": 2, "chunk_size": 100,
                          "window_chunks": 2, **extra}  # fmt: skip
    loader = Loader(url, cache_dir=cache, cache_limit=limit, storage_options=opts, **kw)
    loader.reader.read_heads()  # type: ignore[union-attr]  # (every head now, as at Loader() before issue 44: faults hit downloads)
    return loader


# ---- riding through ------------------------------------------------------------------------------------
def test_two_epochs_ride_through_throttling_and_cut_bodies(small: tuple[str, list[int]], faults: FaultProxy, tmp_path: Path) -> None:
    """20% of the reads answered 503 SlowDown and 10% cut in the middle of the body, from the manifest on, and a burst of
    throttling (every read answered SlowDown for 1.5 s: a request tried more than the 5 times of old): two epochs give
    every sample once each, every fault is retried and counted, and report() says so."""
    url, sizes = small
    faults.set_rates(slowdown=0.2, truncate=0.1)
    with _loader(url, faults, tmp_path / "c", 3 * max(sizes), storage={"max_backoff": 0.1}) as loader:
        epochs = _epochs(loader, after_first=lambda: faults.throttle_for(1.5))  # and a burst: every read throttled for 1.5 s
        stats = loader.stats()["remote"]
        report = loader.report()
    assert epochs == [list(range(N))] * 2
    injected = faults.injected["slowdown"] + faults.injected["truncate"]
    assert faults.injected["slowdown"] >= 10 and faults.injected["truncate"] >= 2
    assert stats["retries"] == injected  # each fault: one retry, counted
    assert stats["retries_throttled"] == faults.injected["slowdown"]
    assert stats["downloads"] > len(sizes)  # the cache (3 shards) holds half the dataset: the second epoch downloads again
    assert f"{injected} retries of transient errors (throttled {faults.injected['slowdown']}" in report
    _nothing_partial(tmp_path / "c", sizes)


@pytest.mark.parametrize("outage", [6.0, pytest.param(20.0, marks=pytest.mark.long)])
def test_two_epochs_ride_through_an_outage(small: tuple[str, list[int]], faults: FaultProxy, tmp_path: Path, outage: float) -> None:
    """The store goes away for longer than the retries of old covered (5 attempts, about 3 s), after the first batch:
    the epoch waits for it and both epochs give every sample once. (The 20 s run is the issue's, with default backoff.)"""
    url, sizes = small
    storage = {"max_backoff": 1.0} if outage < 10 else {"backoff": 0.1}
    with _loader(url, faults, tmp_path / "c", 2 * max(sizes), download_ahead=1, storage=storage) as loader:
        start = time.monotonic()
        epochs = _epochs(loader, after_first=lambda: faults.outage(outage))
        took = time.monotonic() - start
        stats = loader.stats()["remote"]
    assert epochs == [list(range(N))] * 2
    assert took >= outage - 0.5  # it waited the outage out
    assert faults.injected["outage"] >= 5 and stats["retries_connection"] >= 5


def test_a_spent_retry_budget_reaches_the_loop_as_a_remote_error_naming_the_url(small: tuple[str, list[int]], faults: FaultProxy,
                                                                                tmp_path: Path) -> None:  # fmt: skip
    """The store gone for good: after retry_budget seconds the loop gets RemoteError (not LoaderError) naming the
    shard's URL, the last error and how long it tried."""
    url, _sizes = small
    loader = _loader(url, faults, tmp_path / "c", None, storage={"retry_budget": 1.0, "max_backoff": 0.2})
    faults.outage(3600)
    try:
        with pytest.raises(RemoteError) as info:
            _epochs(loader, 1)
    finally:
        faults.outage(0)
        loader.close()
    error = info.value
    assert not isinstance(error, LoaderError)
    text = str(error)
    assert text.startswith(f"{url}shard-g") and ".stoker: download failed after " in text and "field '*'" not in text
    assert "retry_budget=1 s" in text and "the last error: " in text


def test_short_answers_to_the_heads_reads_are_retried(small: tuple[str, list[int]], faults: FaultProxy, tmp_path: Path) -> None:
    """At Loader(), a shard's head answered with fewer bytes than asked (a well-framed 206) is read again."""
    url, _sizes = small
    faults.only = ".stoker"
    faults.fail_next(3, "short")
    with _loader(url, faults, tmp_path / "c", None) as loader:
        stats = loader.stats()["remote"]
        assert _epochs(loader, 1) == [list(range(N))]
    assert faults.injected["short"] == 3 and stats["retries_cut"] == 3


@pytest.mark.parametrize("times", [1, 2])
def test_a_shard_corrupted_in_transit_is_fetched_once_more_then_refused(small: tuple[str, list[int]], faults: FaultProxy, tmp_path: Path,
                                                                        times: int) -> None:  # fmt: skip
    """A byte flipped in transit: the shard is downloaded once more; flipped again, it is refused naming its URL.
    Either way it is downloaded twice, never a third time."""
    url, sizes = small
    loader = _loader(url, faults, tmp_path / "c", None, order=OrderOption.SEQUENTIAL)
    name = loader.remote.names[2]
    path = f"/{url.partition('://')[2]}{name}"
    before = faults.gets[path]  # (its head's range reads)
    faults.only = name
    faults.fail_next(times, "corrupt")
    try:
        if times == 1:
            assert _epochs(loader, 1) == [list(range(N))]
            assert loader.stats()["remote"]["refetches"] == 1
        else:
            with pytest.raises(DatasetFormatError) as info:
                _epochs(loader, 1)
            assert str(info.value).startswith(url + name) and "field '*'" not in str(info.value)
    finally:
        loader.close()
    assert faults.injected["corrupt"] == times
    assert faults.gets[path] - before == 2
    _nothing_partial(tmp_path / "c", sizes)


# ---- stopping at once ----------------------------------------------------------------------------------
def _shard_gets(proxy: FaultProxy) -> int:
    return sum(n for p, n in proxy.gets.items() if p.endswith(".stoker"))


def _downloading(proxy: FaultProxy, start: int, count: int) -> None:
    """Wait until the proxy has received ``count`` more GETs of shards than ``start`` (downloads under way)."""
    deadline = time.monotonic() + 60
    while _shard_gets(proxy) < start + count:
        assert time.monotonic() < deadline, "no download started"
        time.sleep(0.02)
    time.sleep(0.3)


def test_close_from_another_thread_returns_at_once_under_a_slow_store(large: tuple[str, list[int]], faults: FaultProxy,
                                                                      tmp_path: Path) -> None:  # fmt: skip
    """At 64 KB/s a shard takes 16 s: close() from another thread stops the downloads and returns within 2 s; the
    loop gets the 'closed from another thread' error; no partial shard is left to be read."""
    url, sizes = large
    loader = _loader(url, faults, tmp_path / "c", None, batch_size=50, chunk_size=50)  # heads read at full speed
    faults.set_bandwidth(64_000)
    base = _shard_gets(faults)
    errors: list[BaseException] = []
    started = threading.Event()

    def iterate() -> None:
        try:
            it = iter(loader)
            started.set()
            for _ in it:
                pass
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=iterate)
    thread.start()
    assert started.wait(60)
    _downloading(faults, base, 2)
    start = time.monotonic()
    loader.close()
    took = time.monotonic() - start
    thread.join(60)
    faults.set_bandwidth(None)
    assert took < 2.0, f"close() took {took:.1f} s"
    assert len(errors) == 1 and isinstance(errors[0], StokerError) and "close() was called from another thread" in str(errors[0])
    _nothing_partial(tmp_path / "c", sizes)
    loader.close()


def test_leaving_the_with_block_stops_the_downloads_ahead(large: tuple[str, list[int]], faults: FaultProxy, tmp_path: Path) -> None:
    """An epoch begun (its downloads ahead under way at 64 KB/s: 16 s a shard), then the block left: within 2 s."""
    url, sizes = large
    with _loader(url, faults, tmp_path / "c", None, batch_size=50, chunk_size=50) as loader:
        faults.set_bandwidth(64_000)
        base = _shard_gets(faults)
        iter(loader)  # the epoch's shards are downloaded ahead from now on
        _downloading(faults, base, 2)
        start = time.monotonic()
    took = time.monotonic() - start
    faults.set_bandwidth(None)
    assert took < 2.0, f"leaving the block took {took:.1f} s"
    _nothing_partial(tmp_path / "c", sizes)


_CHILD = """
import atexit, sys, time
# registered first, so run last: when every exit handler (stoker's too) has run and every non-daemon thread is joined
atexit.register(lambda: print("handlers done", time.monotonic(), flush=True))
from stoker import Loader, OrderOption
url, endpoint, cache, how = sys.argv[1:5]
opts = {"endpoint": endpoint, "access_key_id": "a", "secret_access_key": "b", "region": "us-east-1"}
loader = Loader(url, batch_size=50, num_workers=2, cache_dir=cache, storage_options=opts, order=OrderOption.SEQUENTIAL)
try:
    for k, _ in enumerate(loader):
        print("batch", flush=True)
        if how == "exit" and k == 4:  # the batches of shard 0 done; the next shards are being downloaded
            time.sleep(0.5)
            print("leaving", flush=True)
            sys.exit(0)  # without close(): the end of the process stops the downloads
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


@pytest.mark.parametrize("how", ["ctrl-c", "exit"])
def test_ctrl_c_or_the_end_of_the_process_stops_the_downloads(large: tuple[str, list[int]], faults: FaultProxy, tmp_path: Path,
                                                            how: str) -> None:  # fmt: skip
    """Ctrl-C while the loop waits for a batch whose shard a 64 KB/s store sends (16 s a shard): the loop gets the
    KeyboardInterrupt within 2 s; or the script ends without close() while shards are downloaded: either way the
    process ends soon after, its downloads stopped and their files deleted."""
    url, sizes = large
    prefix = url.partition("://")[2]
    # shard 0 (the first 5 batches) at full speed, the others at 64 KB/s
    faults.set_bandwidth(64_000, where=lambda path: prefix in path and path.endswith(".stoker") and not path.endswith("-00000.stoker"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, url, faults.endpoint, str(tmp_path / "c"), how], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    assert child.stdout is not None
    begun = time.monotonic()
    seen: list[str] = []

    def failed(why: str) -> str:  # the child stopped first (no process left for the next test), its lines' times and stderr
        child.kill()
        _, err = child.communicate()
        return f"{why}; lines after [s]: {seen}; the child's stderr: {err[-3000:]}"

    try:
        for _ in range(5):
            line = child.stdout.readline()
            seen.append(f"{line.strip()!r} {time.monotonic() - begun:.1f}")
            assert line.strip() == "batch", failed("5 batches expected (shard 0)")
        if how == "ctrl-c":
            time.sleep(0.5)  # the loop waits for batch 5, of shard 1 (16 s at 64 KB/s)
            start = time.monotonic()
            child.send_signal(signal.SIGINT)
            line = child.stdout.readline()  # the loop's KeyboardInterrupt, caught
            took = time.monotonic() - start
            seen.append(f"{line.strip()!r} {time.monotonic() - begun:.1f}")
            assert line.strip() == "interrupted", failed("the loop's KeyboardInterrupt expected after the SIGINT")
            assert took < 2.0, failed(f"Ctrl-C took {took:.1f} s to reach the loop")
        else:
            assert child.stdout.readline().strip() == "leaving", failed("'leaving' expected")
            start = time.monotonic()
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    ended = time.monotonic() - start
    faults.set_bandwidth(None)
    assert child.returncode == 0 and out.startswith("handlers done "), f"{out!r} {err[-3000:]}"
    # (its downloads ahead: 16 s a shard; the heads read in pools the interpreter joined before its exit handler stopped
    # the store: 5-7 s, 12 s under load; now about 0.5 s). Timed to the end of the exit handlers, read on the same clock
    # (CLOCK_MONOTONIC is the machine's): what follows them, the interpreter's collection of torch's and Numba's modules,
    # is not stoker's and takes 0.6-1.7 s on a quiet 2-core machine by itself, 5 s beside other work.
    handlers = float(out.split()[2]) - start
    assert handlers < 5.0, f"the exit handlers were done {handlers:.1f} s after, the process ended {ended:.1f} s after"
    _nothing_partial(tmp_path / "c", sizes)
