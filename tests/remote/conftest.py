"""Real servers on loopback for the remote tests (benchmarks._servers.loopback): moto's S3 server, an HTTP server, a proxy."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto.server")

from benchmarks._servers.loopback import LatencyProxy, RangeHTTPServer, S3Server, s3_server

from stoker.remote import Store, open_store

#: a secret that must never show in an error message
SECRET = "s3cr3t-MUST-NOT-LEAK-9f8e7d"


@pytest.fixture(scope="session", autouse=True)
def _no_instance_metadata() -> Iterator[None]:
    """No test may ask the cloud's instance-metadata service (169.254.169.254) for credentials."""
    saved = os.environ.get("AWS_EC2_METADATA_DISABLED")
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    yield
    if saved is None:
        os.environ.pop("AWS_EC2_METADATA_DISABLED", None)
    else:
        os.environ["AWS_EC2_METADATA_DISABLED"] = saved


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Server]:
    """moto's S3 server for the session (the environment left alone: stores get their options explicitly)."""
    with s3_server("stoker-test", environment=False) as server:
        yield server


@pytest.fixture
def proxy(s3: S3Server) -> Iterator[LatencyProxy]:
    """A proxy in front of the S3 server (no latency, no cap: tests set what they need)."""
    with LatencyProxy(s3.host, s3.port) as p:
        yield p


def options(endpoint: str, **extra: Any) -> dict[str, Any]:
    """storage_options for the loopback server (moto accepts any key; the secret is the one that must not leak)."""
    return {"endpoint": endpoint, "access_key_id": "testing", "secret_access_key": SECRET, "region": "us-east-1", "backoff": 0.01, **extra}


@pytest.fixture
def prefix() -> str:
    """A fresh prefix per test: tests share the bucket."""
    return f"t-{uuid.uuid4().hex[:12]}/"


@pytest.fixture
def store(s3: S3Server, proxy: LatencyProxy, prefix: str) -> Store:
    """A store of a fresh prefix, through the proxy."""
    return open_store(s3.url(prefix), options(proxy.endpoint))


@pytest.fixture
def http_server(tmp_path: Path) -> Iterator[RangeHTTPServer]:
    """An HTTP server of ``tmp_path / "www"``."""
    (tmp_path / "www").mkdir()
    with RangeHTTPServer(tmp_path / "www") as server:
        yield server
