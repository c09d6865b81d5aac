"""Real servers on the loopback interface, for stoker's tests and benchmarks (not for production use).

Three pieces, each a context manager that starts its threads on entry and
stops and joins them on exit:

- :func:`s3_server`: moto's threaded S3 server (``pip install "moto[server]"``,
  imported when called) on ``127.0.0.1`` and a free port, one bucket created;
  yields an :class:`S3Server` with the endpoint. The ``AWS_*`` variables
  (dummy keys, the endpoint, the region) are set for the block and restored
  afterwards.
- :class:`RangeHTTPServer`: a plain HTTP server of a folder that answers
  ``Range: bytes=a-b`` requests (``https://``-style stores); it can answer the
  next requests with an error status (:meth:`RangeHTTPServer.fail_next`).
- :class:`LatencyProxy`: a TCP proxy that adds a latency to every request (the
  first bytes a client sends after the server has answered) and caps the
  bandwidth shared by all its connections, counting the bytes it passes; it
  can answer the next requests with an error such as ``503 SlowDown`` (:meth:`LatencyProxy.fail_next`).

Example::

    with s3_server() as s3, LatencyProxy(s3.host, s3.port, latency_ms=20, bandwidth=200e6) as proxy:
        store = open_store(f"s3://{s3.bucket}/train/", {"endpoint": proxy.endpoint})
"""

from __future__ import annotations

import contextlib
import http.server
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from stoker._threads import start_thread

__all__ = ["LatencyProxy", "RangeHTTPServer", "S3Server", "free_port", "s3_server"]

_CHUNK = 64 * 1024
_REASONS = {403: "Forbidden", 404: "Not Found", 429: "Too Many Requests", 500: "Internal Server Error", 503: "Slow Down"}


def _error_response(status: int, code: str) -> bytes:
    body = f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>stoker loopback proxy</Message></Error>".encode()
    head = f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"Connection: close\r\n\r\n" + body


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class S3Server:
    """A running loopback S3 server: ``endpoint`` is ``http://127.0.0.1:<port>``, ``bucket`` exists."""

    host: str
    port: int
    bucket: str

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url(self, prefix: str = "") -> str:
        """``s3://<bucket>/<prefix>``."""
        return f"s3://{self.bucket}/{prefix}"


_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",  # moto's dummy key
    "AWS_REGION": "us-east-1",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",  # never ask the cloud's instance-metadata service
}


@contextlib.contextmanager
def _environment(values: dict[str, str | None]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


@contextlib.contextmanager
def s3_server(bucket: str = "stoker-test", *, environment: bool = True) -> Iterator[S3Server]:
    """Start moto's threaded S3 server on 127.0.0.1 (a free port), create ``bucket``, and yield it.

    With ``environment`` (default), inside the block ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` are dummy
    keys, ``AWS_REGION`` is ``us-east-1``, ``AWS_ENDPOINT_URL`` is the server
    (``AWS_ENDPOINT_URL_S3`` and ``AWS_PROFILE`` are unset); the previous
    values come back on exit, and the server's thread is joined.

    Raises:
        ImportError: moto is not installed (``pip install "moto[server]"``).
    """
    try:
        from moto.server import ThreadedMotoServer
    except ImportError as exc:
        raise ImportError('benchmarks._servers.loopback.s3_server needs moto\'s server: pip install "moto[server]"') from exc
    import logging

    quiet = logging.getLogger("werkzeug")  # one line per request otherwise
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        info = S3Server("127.0.0.1", port, bucket)
        env: dict[str, str | None] = {**_AWS_ENV, "AWS_ENDPOINT_URL": info.endpoint, "AWS_ENDPOINT_URL_S3": None, "AWS_PROFILE": None}
        with _environment(env if environment else {}):
            _create_bucket(info)
            yield info
    finally:
        server.stop()
        quiet.setLevel(level)


def _create_bucket(server: S3Server) -> None:
    import http.client

    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    try:
        conn.request("PUT", f"/{server.bucket}", headers={"Content-Length": "0"})
        response = conn.getresponse()
        body = response.read()
        if response.status >= 300:
            raise RuntimeError(f"moto refused to create bucket {server.bucket!r}: {response.status} {body[:200]!r}")
    finally:
        conn.close()


class _Threads:
    """Start, stop (any number of times) and join: the lifecycle the servers below share."""

    def __enter__(self) -> Any:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError


# ---- HTTP server with ranges ---------------------------------------------------------------------------
_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")


class _RangeHandler(http.server.SimpleHTTPRequestHandler):
    server: _HTTPServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _failure(self) -> bool:
        status = self.server.owner._take_failure()
        if status is None:
            return False
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()
        return True

    def do_HEAD(self) -> None:
        if not self._failure():
            super().do_HEAD()

    def do_GET(self) -> None:
        if self._failure():
            return
        self.server.owner._count_request()
        path = Path(self.translate_path(self.path))
        match = _RANGE.match(self.headers.get("Range", "").strip())
        if not path.is_file() or match is None:
            super().do_GET()
            return
        size = path.stat().st_size
        first, last = match.groups()
        if first == "":  # suffix range: the last N bytes
            start, stop = max(0, size - int(last or 0)), size
        else:
            start, stop = int(first), min(size, int(last) + 1 if last else size)
        if start >= size or start >= stop:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(206)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{size}")
        self.send_header("Content-Length", str(stop - start))
        self.send_header("Last-Modified", self.date_time_string(int(path.stat().st_mtime)))
        self.end_headers()
        with open(path, "rb") as fh:
            fh.seek(start)
            left = stop - start
            while left > 0:
                chunk = fh.read(min(_CHUNK, left))
                if not chunk:
                    break
                self.wfile.write(chunk)
                left -= len(chunk)


class _HTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    owner: RangeHTTPServer


class RangeHTTPServer(_Threads):
    """A plain HTTP server of ``folder`` on 127.0.0.1 (a free port) that honours ``Range: bytes=a-b``.

    Args:
        folder: the folder served (``GET /name`` returns ``folder/name``).

    Attributes:
        endpoint: ``http://127.0.0.1:<port>``.
        requests: GET requests answered so far (failures excluded).
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        self.requests = 0
        self._failures: list[int] = []
        self._lock = threading.Lock()
        self._server: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def fail_next(self, count: int, status: int = 503) -> None:
        """Answer the next ``count`` requests with ``status`` (and no body) instead of serving them."""
        with self._lock:
            self._failures.extend([status] * count)

    def _take_failure(self) -> int | None:
        with self._lock:
            return self._failures.pop(0) if self._failures else None

    def _count_request(self) -> None:
        with self._lock:
            self.requests += 1

    def start(self) -> None:
        if self._server is not None:
            return
        folder = os.fspath(self.folder)

        def handler(*args: Any, **kwargs: Any) -> _RangeHandler:
            return _RangeHandler(*args, directory=folder, **kwargs)

        self._server = _HTTPServer(("127.0.0.1", 0), handler)
        self._server.owner = self
        self.port = int(self._server.server_address[1])
        self._thread = start_thread(self._server.serve_forever, name="stoker-loopback-http")

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


# ---- latency and bandwidth proxy ---------------------------------------------------------------------
class LatencyProxy(_Threads):
    """A TCP proxy on 127.0.0.1 that adds latency per request and caps the bandwidth of all its connections.

    A request is what a client sends first on a connection, or after the
    server's answer: the proxy holds it ``latency_ms`` before passing it on.
    Bytes in either direction pass through one shared token bucket of
    ``bandwidth`` bytes per second (``None``: no cap).

    Args:
        host, port: the server behind the proxy.
        latency_ms: the delay added to each request [milliseconds].
        bandwidth: the cap shared by all connections and both directions [bytes/s]; ``None``: none.

    Attributes:
        endpoint: ``http://127.0.0.1:<port>`` of the proxy.
        bytes_down, bytes_up: bytes passed server -> client and client -> server.
        requests: requests passed on (see above).
    """

    def __init__(self, host: str, port: int, latency_ms: float = 0.0, bandwidth: float | None = None) -> None:
        if latency_ms < 0 or (bandwidth is not None and bandwidth <= 0):
            raise ValueError(f"latency_ms must be >= 0 and bandwidth > 0 or None; got {latency_ms!r}, {bandwidth!r}")
        self.target = (host, int(port))
        self.latency = float(latency_ms) / 1000.0
        self.bandwidth = bandwidth
        self.bytes_down = 0
        self.bytes_up = 0
        self.requests = 0
        self.port = 0
        self._lock = threading.Lock()
        self._next_free = 0.0
        self._failures: list[tuple[int, str]] = []
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._sockets: set[socket.socket] = set()
        self._stopping = threading.Event()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def bytes_passed(self) -> int:
        """Bytes passed in both directions."""
        return self.bytes_down + self.bytes_up

    def fail_next(self, count: int, status: int = 503, code: str = "SlowDown") -> None:
        """Answer the next ``count`` requests with ``status`` and an S3 error ``code`` (default S3's throttling), then close.

        ``fail_next(1, 403, "AccessDenied")`` makes the next request denied.
        """
        with self._lock:
            self._failures.extend([(int(status), code)] * count)

    def start(self) -> None:
        if self._listener is not None:
            return
        self._stopping.clear()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        self._listener = listener
        self.port = int(listener.getsockname()[1])
        self._spawn(self._accept, "stoker-proxy-accept")

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is None:
            return
        self._stopping.set()
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        while True:
            with self._lock:
                threads, self._threads = self._threads, []
            if not threads:
                break
            for t in threads:
                t.join()
        for s in sockets:
            s.close()

    def _spawn(self, target: Any, name: str, *args: Any) -> None:
        thread = start_thread(target, *args, name=name)
        with self._lock:  # stop() joins the accepting thread (which spawns) before it takes this list for the last time
            self._threads.append(thread)

    def _accept(self) -> None:
        listener = self._listener
        assert listener is not None  # set by start()
        while not self._stopping.is_set():
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=30)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets.update((client, upstream))
            turn = {"answered": True}  # the server has answered: the client's next bytes are a new request
            self._spawn(self._pump, "stoker-proxy-up", client, upstream, True, turn)
            self._spawn(self._pump, "stoker-proxy-down", upstream, client, False, turn)

    def _throttle(self, n: int) -> None:
        if self.bandwidth is None:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next_free)
            self._next_free = start + n / self.bandwidth
            wait = self._next_free - now
        if wait > 0:
            time.sleep(wait)

    def _pump(self, src: socket.socket, dst: socket.socket, upward: bool, turn: dict[str, bool]) -> None:
        try:
            while not self._stopping.is_set():
                data = src.recv(_CHUNK)
                if not data:
                    break
                if upward and turn["answered"]:
                    turn["answered"] = False
                    with self._lock:
                        fail = self._failures.pop(0) if self._failures else None
                        self.requests += int(fail is None)
                    if fail is not None:
                        src.sendall(_error_response(*fail))
                        break
                    if self.latency:
                        time.sleep(self.latency)
                elif not upward:
                    turn["answered"] = True
                self._throttle(len(data))
                dst.sendall(data)
                with self._lock:
                    if upward:
                        self.bytes_up += len(data)
                    else:
                        self.bytes_down += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._sockets.discard(src)
                self._sockets.discard(dst)
            src.close()
