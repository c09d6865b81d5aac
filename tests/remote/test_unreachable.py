"""A store that cannot be reached is an error, soon, and every wait on a store is said (issue 44).

A refused connection, an unknown host, a failed TLS handshake: a WARNING naming the endpoint and the cause at the
first failure, then a :class:`RemoteError` naming them after ``connect_budget`` (default 20 s), not the 10-minute
budget of throttling and 5xx answers. A store that has answered and then stops is an outage, ridden through within
the long budget. Real servers on loopback only: a closed port (a socket bound, its port read, then closed), a name
under ``.invalid`` (which never resolves), a TLS server with a self-signed certificate, moto behind the proxies.
"""

from __future__ import annotations

import datetime
import http.server
import ipaddress
import logging
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from benchmarks._servers.loopback import LatencyProxy, S3Server

from stoker._threads import start_thread
from stoker.dataset._manifest import MANIFEST_NAME
from stoker.dataset._remote import open_remote
from stoker.dataset.shards import write_shards
from stoker.errors import RemoteError
from stoker.fields import IntField, NDArrayField
from stoker.remote import Store, open_store
from tests.remote._faults import FaultProxy
from tests.remote.conftest import SECRET, options


def _closed_port() -> int:
    """A loopback port that nothing listens on: bound, read, closed."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _read_in_a_thread(store: Store, key: str, limit: float) -> tuple[BaseException | None, float]:
    """``store.read(key)`` in a thread of its own (not the test's): what it raised, and when [seconds]. A read still
    running after ``limit`` seconds is interrupted (the old code's 10-minute wait), and the test fails."""
    out: list[Any] = []
    start = time.monotonic()

    def read() -> None:
        try:
            store.read(key)
            out.append(None)
        except BaseException as exc:
            out.append(exc)
        out.append(time.monotonic() - start)

    thread = start_thread(read, name="test-unreachable-read")
    thread.join(limit)
    if thread.is_alive():
        store.interrupt()
        thread.join(10)
        pytest.fail(f"the read of an unreachable store was still retrying after {limit:g} s")
    return out[0], out[1]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "stoker.remote" and r.levelno == logging.WARNING]


def test_a_closed_port_is_said_at_once_and_an_error_naming_the_endpoint_after_connect_budget(caplog: pytest.LogCaptureFixture) -> None:
    """The WARNING names the endpoint and "connection refused" within 2 s (asserted within 5 s), from the reading thread;
    the RemoteError names them too, after about ``connect_budget`` (asserted between it and 4x it plus 5 s)."""
    caplog.set_level(logging.INFO)
    budget = 1.5
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    store = open_store("s3://bucket/train/", options(endpoint, connect_budget=budget))
    start = time.time()
    error, seconds = _read_in_a_thread(store, MANIFEST_NAME, 4 * budget + 5)
    assert isinstance(error, RemoteError), error
    text = str(error)
    assert text.startswith(f"s3://bucket/train/{MANIFEST_NAME}: read failed: cannot reach the store at ")
    assert endpoint in text and "connection refused" in text and f"connect_budget={budget:g} s" in text
    assert SECRET not in text
    assert budget <= seconds < 4 * budget + 5
    said = _warnings(caplog)
    assert said, "no warning while the store could not be reached"
    first = said[0]
    assert endpoint in first.getMessage() and "connection refused" in first.getMessage()
    assert first.threadName == "test-unreachable-read"
    assert first.created - start < 5.0  # the target is 2 s; it comes at the first failure
    assert len(said) <= 1 + budget / 5 + 1  # at most one every 5 s after the first: no flood
    # the store has never answered: a second request fails at once, its budget spent
    again, seconds = _read_in_a_thread(store, "other", 10)
    assert isinstance(again, RemoteError) and "connection refused" in str(again) and seconds < budget


def test_an_unknown_host_is_named(caplog: pytest.LogCaptureFixture) -> None:
    """A name under .invalid never resolves (RFC 6761): "unknown host", with the endpoint."""
    caplog.set_level(logging.WARNING)
    endpoint = "http://stoker-no-such-host.invalid:9000"
    store = open_store("s3://bucket/train/", options(endpoint, connect_budget=1.0))
    error, seconds = _read_in_a_thread(store, MANIFEST_NAME, 30)
    assert isinstance(error, RemoteError)
    assert endpoint in str(error) and "unknown host" in str(error) and seconds < 30
    assert any("unknown host" in r.getMessage() and endpoint in r.getMessage() for r in _warnings(caplog))


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[str]:
    """An HTTPS server on loopback whose certificate no one signed: its URL."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key()).serial_number(1)
        .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    (tmp_path / "key.pem").write_bytes(pem)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    class TLSServer(http.server.ThreadingHTTPServer):
        def finish_request(self, request: Any, client_address: Any) -> None:  # the handshake in the connection's thread
            try:
                request = context.wrap_socket(request, server_side=True)
            except OSError:
                return
            super().finish_request(request, client_address)

    server = TLSServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"https://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def test_a_certificate_no_one_signed_is_a_tls_error(tls_server: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    store = open_store(tls_server + "/data/", {"connect_budget": 1.0, "backoff": 0.01})
    error, seconds = _read_in_a_thread(store, MANIFEST_NAME, 30)
    assert isinstance(error, RemoteError)
    assert tls_server in str(error) and "TLS: invalid peer certificate (UnknownIssuer)" in str(error) and seconds < 30
    assert any("TLS: " in r.getMessage() for r in _warnings(caplog))


def test_a_store_that_answered_then_refuses_is_an_outage_under_the_long_budget(s3: S3Server, prefix: str) -> None:
    """Once the store has answered, a refused connection is an outage (a restart): ridden through for retry_budget,
    not cut after connect_budget."""
    with LatencyProxy(s3.host, s3.port) as proxy:
        store = open_store(s3.url(prefix), options(proxy.endpoint, connect_budget=0.2, retry_budget=2.5, max_backoff=0.2))
        store.write("obj", b"x" * 100)
        assert store.read("obj") == b"x" * 100
    start = time.monotonic()
    with pytest.raises(RemoteError) as info:
        store.read("obj")  # the proxy is gone: its port refuses
    assert time.monotonic() - start >= 2.4
    assert "retry_budget=2.5 s" in str(info.value) and "connection refused" in str(info.value)


def test_a_retry_streak_is_said_at_most_once_every_few_seconds(s3: S3Server, prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """3.5 s of 503 SlowDown, retried every few ms: a WARNING naming the endpoint and why, not one per retry."""
    caplog.set_level(logging.WARNING)
    with FaultProxy(s3.host, s3.port, seed=5) as faults:
        store = open_store(s3.url(prefix), options(faults.endpoint, max_backoff=0.05))
        store.write("obj", b"y" * 100)
        faults.throttle_for(3.5)
        assert store.read("obj") == b"y" * 100
    retries = store.stats()["retries_throttled"]
    said = [r.getMessage() for r in _warnings(caplog)]
    assert retries >= 20, retries
    assert 1 <= len(said) <= 2, said  # (after 1 s of failures, then at most one every 5 s)
    assert said[0].startswith(f"retrying {faults.endpoint}: HTTP 503 SlowDown, attempt ")


def test_a_slow_open_says_what_it_downloads(s3: S3Server, prefix: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Each request held 0.7 s: the manifest, then the heads, take more than a second; one INFO line says so, from a
    helper thread, while the open waits."""
    folder = tmp_path / "ds"
    n = 64
    write_shards(folder, {"x": NDArrayField(np.dtype("float32"), (4,)), "y": IntField()},
                 {"x": np.ones((n, 4), np.float32), "y": np.arange(n)}, samples_per_shard=32, num_workers=1, progress=False)  # fmt: skip
    with LatencyProxy(s3.host, s3.port) as proxy:
        store = open_store(s3.url(prefix), options(proxy.endpoint))
        for path in sorted(folder.iterdir()):
            store.upload(path.name, path)
        caplog.set_level(logging.INFO, logger="stoker.dataset")
        proxy.latency = 0.7
        reader = open_remote(s3.url(prefix), storage_options=options(proxy.endpoint), cache_dir=tmp_path / "cache")
        try:
            assert reader.num_samples == n
        finally:
            reader.close()
    said = [r for r in caplog.records if r.name == "stoker.dataset" and r.levelno == logging.INFO]
    assert len(said) == 1, [r.getMessage() for r in said]
    assert said[0].getMessage().startswith(f"downloading the manifest and heads from {s3.url(prefix)} (")
    assert said[0].threadName != threading.current_thread().name


@pytest.mark.long
def test_the_default_connect_budget_gives_up_within_30_s(caplog: pytest.LogCaptureFixture) -> None:
    """The issue's target with the defaults: a WARNING within 2 s and the RemoteError within 30 s (measured: 20 s);
    the old code retried for 10 minutes (the read is interrupted after 60 s here)."""
    caplog.set_level(logging.WARNING)
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    store = open_store("s3://bucket/train/", {k: v for k, v in options(endpoint).items() if k != "backoff"})
    error, seconds = _read_in_a_thread(store, MANIFEST_NAME, 60)
    assert isinstance(error, RemoteError) and endpoint in str(error) and "connection refused" in str(error)
    assert seconds < 30
    assert any(endpoint in r.getMessage() for r in _warnings(caplog))
