"""A process that used a store exits cleanly: no SIGABRT from obstore's threads while the interpreter shuts down.

obstore completes an asynchronous request from a Rust thread that takes the GIL; one that asks for it once
``Py_Finalize`` has begun aborts the process (see :mod:`stoker.remote._exit`). Each case runs a small process
several times, since the race is lost only sometimes (before the fix: about 1 run in 7 on a 2-core machine).
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from stoker.remote import open_store
from stoker.remote.loopback import S3Server
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
