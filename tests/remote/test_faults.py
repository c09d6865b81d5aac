"""The Store rides through a faulty store: retries within a time budget, downloads resumed, reads stopped at once.

Every fault comes from the fault proxy in front of moto's S3 server (tests/remote/_faults.py), and every test
asserts that the faults it rode through were really injected.
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

import pytest
from benchmarks._servers.loopback import S3Server

from stoker.errors import RemoteError, RemoteNotFoundError, RemotePermissionError
from stoker.remote import Store, open_store
from tests.remote._faults import FaultProxy
from tests.remote.conftest import SECRET, options

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def faults(s3: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(s3.host, s3.port, seed=3) as proxy:
        yield proxy


@pytest.fixture
def data(store: Store) -> bytes:
    payload = os.urandom(1_500_000)
    store.write("obj", payload)  # (through the plain proxy: no faults)
    return payload


def _through(s3: S3Server, prefix: str, proxy: FaultProxy, **extra: object) -> Store:
    return open_store(s3.url(prefix), options(proxy.endpoint, **extra))


KIND_OF = {"slowdown": "throttled", "reset": "connection", "truncate": "cut", "short": "cut"}


@pytest.mark.parametrize(
    ("fault", "read"),  # (a short, well-framed answer is an answer to a range request)
    [(f, r) for f in KIND_OF for r in ("read", "read_range", "download") if f != "short" or r == "read_range"],
)
def test_each_fault_is_retried_and_counted(s3: S3Server, prefix: str, faults: FaultProxy, data: bytes, tmp_path: Path,
                                           fault: str, read: str) -> None:  # fmt: skip
    store = _through(s3, prefix, faults)
    faults.fail_next(3, fault)
    if read == "read":
        assert store.read("obj") == data
    elif read == "read_range":
        assert store.read_range("obj", 1000, 901_000) == data[1000:901_000]
    else:
        assert store.download("obj", tmp_path / "obj") == len(data)
        assert (tmp_path / "obj").read_bytes() == data
    assert faults.injected[fault] == 3
    stats = store.stats()
    assert stats["retries"] == 3 == stats[f"retries_{KIND_OF[fault]}"]


def test_a_cut_download_resumes_from_the_bytes_received(s3: S3Server, prefix: str, faults: FaultProxy, data: bytes,
                                                       tmp_path: Path) -> None:  # fmt: skip
    """Each cut answer sends half its body: resumed, the download receives the object's bytes once in all."""
    store = _through(s3, prefix, faults)
    faults.fail_next(3, "truncate")
    assert store.download("obj", tmp_path / "obj", size=len(data)) == len(data)
    assert (tmp_path / "obj").read_bytes() == data
    stats = store.stats()
    assert faults.injected["truncate"] == 3 and stats["resumed_downloads"] == 3
    assert stats["bytes_downloaded"] == len(data)  # started over, it would be 1/2 + 3/4 + 7/8 + 1 of it


def test_an_outage_longer_than_a_few_retries_is_ridden_through(s3: S3Server, prefix: str, faults: FaultProxy, data: bytes) -> None:
    """The store is gone for 4 s (the 5 attempts of old covered about 3 s): the read waits it out within its budget."""
    store = _through(s3, prefix, faults, max_backoff=0.5)
    faults.outage(4.0)
    start = time.monotonic()
    assert store.read_range("obj", 0, 100) == data[:100]
    assert time.monotonic() - start >= 3.9  # it did wait for the store to come back
    assert faults.injected["outage"] >= 5 and store.stats()["retries"] >= 5


def test_the_budget_spent_is_a_remote_error_naming_the_url_the_error_and_the_time(s3: S3Server, prefix: str, faults: FaultProxy,
                                                                                  data: bytes) -> None:  # fmt: skip
    store = _through(s3, prefix, faults, retry_budget=1.0, max_backoff=0.2)
    faults.outage(3600)
    start = time.monotonic()
    with pytest.raises(RemoteError) as info:
        store.read("obj")
    assert time.monotonic() - start >= 1.0
    faults.outage(0)
    error = info.value
    assert not isinstance(error, (RemoteNotFoundError, RemotePermissionError))
    text = str(error)
    assert text.startswith(f"{store.url}obj: read failed after ") and "attempts over 1." in text
    assert "retry_budget=1 s" in text and "the last error: " in text and "error sending request" in text
    assert SECRET not in text
    assert store.stats()["retries"] >= 2


def test_progress_renews_the_budget(s3: S3Server, prefix: str, faults: FaultProxy, data: bytes, tmp_path: Path) -> None:
    """A download cut again and again, each time after some progress, is not given up: its budget counts from its last byte."""
    store = _through(s3, prefix, faults, retry_budget=0.3, backoff=0.05, max_backoff=0.05)
    faults.fail_next(3, "truncate")
    faults.set_bandwidth(1_000_000)  # each cut attempt takes longer than the budget of 0.3 s
    start = time.monotonic()
    assert store.download("obj", tmp_path / "obj") == len(data)
    assert time.monotonic() - start > 3 * 0.3 and faults.injected["truncate"] == 3
    assert store.stats()["resumed_downloads"] == 3
    assert (tmp_path / "obj").read_bytes() == data


def test_retry_options_are_checked() -> None:
    from stoker.remote._store import RetryPolicy

    with pytest.raises(ValueError, match=r"storage_options\['retry_budget'\] must be a number of seconds >= 0; got -1"):
        open_store("s3://b/p/", {"retry_budget": -1, "endpoint": "http://127.0.0.1:1", "access_key_id": "a", "secret_access_key": "b"})
    with pytest.raises(ValueError, match=r"storage_options\['max_attempts'\] must be an int >= 1"):
        RetryPolicy(max_attempts=0)
    waits = [RetryPolicy(backoff=0.1, max_backoff=1.0).wait(n) for n in range(200)]
    assert all(0 <= w <= 1.0 for w in waits) and max(waits[10:]) > 0.5  # full jitter under the capped bound


def test_interrupt_stops_a_download_at_once_on_a_slow_store(s3: S3Server, prefix: str, faults: FaultProxy, data: bytes,
                                                            tmp_path: Path) -> None:  # fmt: skip
    """At 64 KB/s the download needs 23 s; interrupt() ends it at once, and reads are refused until resume()."""
    store = _through(s3, prefix, faults)
    faults.set_bandwidth(64_000)
    errors: list[BaseException] = []

    def download() -> None:
        try:
            store.download("obj", tmp_path / "obj")
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=download)
    thread.start()
    while not faults.gets and thread.is_alive():
        time.sleep(0.01)
    time.sleep(0.3)
    start = time.monotonic()
    store.interrupt()
    thread.join(20)
    assert time.monotonic() - start < 2.0
    assert len(errors) == 1 and isinstance(errors[0], RemoteError) and "stopped" in str(errors[0])
    with pytest.raises(RemoteError, match="stopped"):
        store.read_range("obj", 0, 10)
    store.resume()
    faults.set_bandwidth(None)
    assert store.read_range("obj", 0, 10) == data[:10]


_CHILD = """
import sys, time
from stoker.remote import open_store
store = open_store(sys.argv[1], {"endpoint": sys.argv[2], "access_key_id": "a", "secret_access_key": "b", "region": "us-east-1"})
print("downloading", flush=True)
try:
    store.download("obj", sys.argv[3])
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_ctrl_c_stops_the_main_threads_download(s3: S3Server, prefix: str, faults: FaultProxy, data: bytes, tmp_path: Path) -> None:
    faults.set_bandwidth(64_000)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, s3.url(prefix), faults.endpoint, str(tmp_path / "obj")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "downloading"
        while not faults.gets:
            time.sleep(0.01)
        time.sleep(0.5)
        start = time.monotonic()
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=60)
    finally:  # a failure leaves no process behind (its warning would fail a later test)
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert time.monotonic() - start < 5.0, "the download went on after Ctrl-C"
    assert out.strip() == "interrupted", err[-2000:]


def test_reads_from_a_thread_that_runs_an_event_loop(store: Store, data: bytes) -> None:
    """A notebook's thread runs an asyncio loop: a read there runs on a helper thread, and works the same."""
    import asyncio

    async def main() -> bytes:
        return store.read_range("obj", 10, 20)

    assert asyncio.run(main()) == data[10:20]
