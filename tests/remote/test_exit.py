"""A process that used a store exits cleanly: no SIGABRT from obstore's threads while the interpreter shuts down.

obstore completes an asynchronous request from a Rust thread that takes the GIL; one that asks for it once
``Py_Finalize`` has begun aborts the process (see :mod:`stoker.remote._exit`). Each case runs a small process
several times, since the race is lost only sometimes (before the fix: about 1 run in 7 on a 2-core machine).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from benchmarks._servers.loopback import LatencyProxy, S3Server

from stoker.errors import RemoteError, RemoteNotFoundError
from stoker.remote import Store, open_store
from stoker.remote._exit import pending, settle
from tests.remote.conftest import options

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("_exit_child.py")
RUNS = 6


@pytest.fixture(scope="module")
def exit_url(s3: S3Server) -> str:
    url = s3.url("exit-tests/")
    open_store(url, options(s3.endpoint)).write("data", b"x" * 100_000)
    return url


@pytest.mark.parametrize("mode", ["missing", "read", "busy"])
def test_a_process_that_read_from_a_store_exits_without_abort(s3: S3Server, exit_url: str, mode: str) -> None:
    """A missing object (``stoker inspect`` of an empty prefix), a read then exit (a training script), and an exit
    with reads in flight on daemon threads: every run exits with status 0, never killed by SIGABRT."""
    arg = json.dumps({"url": exit_url, "options": options(s3.endpoint), "key": "data", "mode": mode})
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src"), "AWS_EC2_METADATA_DISABLED": "true"}

    def run(_: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(CHILD), arg], capture_output=True, text=True, env=env, timeout=120)

    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(run, range(RUNS)))
    codes = [r.returncode for r in done]
    assert codes == [0] * RUNS, f"exit statuses {codes} (-6: SIGABRT at interpreter shutdown); a stderr: " + next(
        (r.stderr[-2000:] for r in done if r.returncode), ""
    )
    expected = "RemoteNotFoundError" if mode == "missing" else "100000"
    assert all(r.stdout.split() == [expected] for r in done), [r.stdout for r in done]


def test_every_request_is_accounted_for(store: Store, proxy: LatencyProxy, tmp_path: Path) -> None:
    """The exit hook waits for obstore's threads to finish with each request's future: after reads that succeed,
    fail or are interrupted, none is left pending (one left would hold every exit for its 5 s bound)."""
    store.write("a", b"x" * 300_000)
    assert store.read("a") == b"x" * 300_000 and store.read("a", max_bytes=10) == bytes(11)
    assert store.read_range("a", 5, 9) == b"xxxx" and store.size("a") == 300_000
    with pytest.raises(RemoteNotFoundError):
        store.read("missing")
    proxy.bandwidth = 64_000  # a download of 5 s: interrupted in the middle
    errors: list[BaseException] = []

    def download() -> None:
        try:
            store.download("a", tmp_path / "a")
        except RemoteError as exc:
            errors.append(exc)

    reader = threading.Thread(target=download)
    before = proxy.bytes_down
    reader.start()
    while proxy.bytes_down - before < 20_000 and reader.is_alive():
        time.sleep(0.01)
    store.interrupt()
    reader.join(timeout=60)
    assert not reader.is_alive() and len(errors) == 1 and "stopped" in str(errors[0])
    store.resume()
    assert settle(timeout=10.0) and pending() == 0
