"""A fault-injecting HTTP/1.1 proxy for the remote tests: a store that throttles, resets, cuts, goes away and crawls.

:class:`FaultProxy` sits on 127.0.0.1 in front of a real server (moto's S3
server, or the range HTTP server) and passes requests and answers through,
understanding just enough HTTP/1.1 (request and response heads,
``Content-Length`` and chunked bodies, keep-alive) to break them on purpose:

- ``slowdown``: the request is answered ``503 SlowDown`` (S3's throttling) without reaching the server;
- ``reset``: the connection is reset (TCP RST) instead of an answer;
- ``truncate``: the answer's head promises the whole body, part of it is sent, then the connection is closed;
- ``short``: a ``206`` answer is cut to half, *well framed* (``Content-Length`` and ``Content-Range`` say so);
- ``corrupt``: one byte of the body is flipped (a bit error in transit that TCP did not catch);
- :meth:`FaultProxy.outage`: the store is gone for some seconds (connections reset as they come), then back;
- :meth:`FaultProxy.throttle_for`: every request answered ``503 SlowDown`` for some seconds (a burst of throttling);
- ``bandwidth``: every answer's body is sent at most this fast [bytes/s], shared by all connections.

Faults hit requests drawn at random (a seeded generator) at the given rates,
or the next ones (:meth:`FaultProxy.fail_next`, for bursts), and only requests
whose method is in ``methods`` and whose path contains ``only`` (when given).
Every fault injected is counted in :attr:`FaultProxy.injected`, so that a test
asserts that the faults it rode through really happened.
"""

from __future__ import annotations

import collections
import contextlib
import random
import re
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from stoker._threads import start_thread

__all__ = ["FAULTS", "FaultProxy"]

#: the kinds of fault a request can be given
FAULTS = ("slowdown", "reset", "truncate", "short", "corrupt")
_PIECE = 16 * 1024  # bytes sent at a time (a throttled answer is sent in pieces this big)
_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_SLOWDOWN_BODY = (
    b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
    b"<Message>Please reduce your request rate (stoker fault proxy)</Message></Error>"
)


class _Closed(Exception):
    """The peer closed the connection (or the proxy stopped)."""


class _Conn:
    """A socket with a read buffer: heads by line, bodies by length."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def _fill(self) -> None:
        data = self.sock.recv(256 * 1024)
        if not data:
            raise _Closed
        self.buf += data

    def head(self) -> bytes:
        while True:
            at = self.buf.find(b"\r\n\r\n")
            if at >= 0:
                out = bytes(self.buf[: at + 4])
                del self.buf[: at + 4]
                return out
            if len(self.buf) > 1 << 20:
                raise _Closed
            self._fill()

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def line(self) -> bytes:
        while True:
            at = self.buf.find(b"\r\n")
            if at >= 0:
                out = bytes(self.buf[: at + 2])
                del self.buf[: at + 2]
                return out
            self._fill()

    def rest(self) -> bytes:
        """Everything until the peer closes."""
        try:
            while True:
                self._fill()
        except (_Closed, OSError):
            pass
        out = bytes(self.buf)
        self.buf.clear()
        return out


def _headers(head: bytes) -> tuple[str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    fields: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            name, _, value = line.partition(":")
            fields[name.strip().lower()] = value.strip()
    return lines[0], fields


def _body(conn: _Conn, fields: dict[str, str], until_close: bool) -> bytes:
    """A message body framed by ``fields``: its bytes (a chunked body de-chunked)."""
    if "chunked" in fields.get("transfer-encoding", "").lower():
        out = bytearray()
        while True:
            size = int(conn.line().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while conn.line() != b"\r\n":  # trailers
                    pass
                return bytes(out)
            out += conn.exactly(size)
            conn.exactly(2)
    if "content-length" in fields:
        return conn.exactly(int(fields["content-length"]))
    return conn.rest() if until_close else b""


def _rewrite(head: bytes, drop: set[str], add: dict[str, str]) -> bytes:
    """``head`` without the headers named in ``drop`` (lowercase), with ``add`` appended."""
    lines = head.decode("latin-1").split("\r\n")
    kept = [lines[0]] + [ln for ln in lines[1:] if ln and ln.partition(":")[0].strip().lower() not in drop]
    kept += [f"{k}: {v}" for k, v in add.items()]
    return ("\r\n".join(kept) + "\r\n\r\n").encode("latin-1")


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a TCP RST (what a load balancer that drops a connection sends)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class FaultProxy:
    """An HTTP/1.1 proxy on 127.0.0.1 in front of ``host:port`` that injects faults into what passes (see the module).

    Args:
        host, port: the server behind the proxy.
        seed: the seed of the generator that draws which requests get a fault.
        bandwidth: the most bytes per second of answers' bodies, all connections together; ``None``: no cap.
        methods: the request methods that may get a fault (default ``GET`` and ``HEAD``: reads).
        only: a fault hits only requests whose path contains this (e.g. ``".stoker"``); ``None``: any.
        rates: ``kind=share`` for each kind of :data:`FAULTS` (e.g. ``slowdown=0.2, truncate=0.1``).

    Attributes:
        endpoint: ``http://127.0.0.1:<port>``.
        injected: how many faults of each kind (and ``outage`` for each connection refused in an outage) were injected.
        requests: requests received, by method.
        gets: ``GET`` requests received, by path (faulted ones included).
        ranged: the ``GET`` requests of ``gets`` with a ``Range`` header (a shard's head, not its download), by path.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        seed: int = 0,
        bandwidth: float | None = None,
        methods: tuple[str, ...] = ("GET", "HEAD"),
        only: str | None = None,
        **rates: float,
    ) -> None:
        unknown = set(rates) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; the kinds are {FAULTS}")
        if sum(rates.values()) > 1 or any(r < 0 for r in rates.values()):
            raise ValueError(f"fault rates must be >= 0 and sum to at most 1; got {rates}")
        self.target = (host, int(port))
        self.rates = {k: float(rates.get(k, 0.0)) for k in FAULTS}
        self.bandwidth = bandwidth
        self._capped: Callable[[str], bool] | None = None
        self.methods = tuple(m.upper() for m in methods)
        self.only = only
        self.injected: collections.Counter[str] = collections.Counter()
        self.requests: collections.Counter[str] = collections.Counter()
        self.gets: collections.Counter[str] = collections.Counter()
        self.ranged: collections.Counter[str] = collections.Counter()
        self.port = 0
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._queue: list[str] = []
        self._down_until = 0.0
        self._throttled_until = 0.0
        self._next_free = 0.0
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._sockets: set[socket.socket] = set()
        self._stopping = threading.Event()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ---- control -------------------------------------------------------------------------------------
    def set_rates(self, **rates: float) -> None:
        """Change the fault rates (kinds not named become 0)."""
        with self._lock:
            self.rates = {k: float(rates.get(k, 0.0)) for k in FAULTS}

    def fail_next(self, count: int, kind: str = "slowdown") -> None:
        """Give the next ``count`` requests that may get a fault the fault ``kind`` (a burst)."""
        if kind not in FAULTS:
            raise ValueError(f"unknown fault kind {kind!r}; the kinds are {FAULTS}")
        with self._lock:
            self._queue.extend([kind] * count)

    def outage(self, seconds: float) -> None:
        """The store is gone for ``seconds`` from now: open connections are reset, new ones reset as they come."""
        with self._lock:
            self._down_until = time.monotonic() + seconds
            sockets = list(self._sockets)
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def throttle_for(self, seconds: float) -> None:
        """Answer every request that may get a fault with ``503 SlowDown`` for ``seconds`` from now (a burst)."""
        with self._lock:
            self._throttled_until = time.monotonic() + seconds

    def set_bandwidth(self, bandwidth: float | None, where: Callable[[str], bool] | None = None) -> None:
        """Change the cap on answers' bodies [bytes/s] (``None``: none); with ``where``, only of requests whose path it accepts."""
        with self._lock:
            self.bandwidth = bandwidth
            self._capped = where
            self._next_free = 0.0

    def _down(self) -> bool:
        return time.monotonic() < self._down_until

    # ---- lifecycle -----------------------------------------------------------------------------------
    def __enter__(self) -> FaultProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        self._listener = listener
        self.port = int(listener.getsockname()[1])
        self._spawn(self._accept, "fault-proxy-accept")

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is None:
            return
        self._stopping.set()
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        while True:
            with self._lock:
                sockets = list(self._sockets)
                threads, self._threads = self._threads, []
            for s in sockets:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            if not threads:
                break
            for t in threads:
                t.join()

    def _spawn(self, target: Any, name: str, *args: Any) -> None:
        thread = start_thread(target, *args, name=name)
        with self._lock:
            self._threads.append(thread)

    def _accept(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._stopping.is_set():
            try:
                client, _ = listener.accept()
            except OSError:
                return
            if self._down():
                with self._lock:
                    self.injected["outage"] += 1
                _reset(client)
                continue
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets.add(client)
            self._spawn(self._serve, "fault-proxy-conn", client)

    # ---- one connection ------------------------------------------------------------------------------
    def _draw(self, method: str, path: str) -> tuple[str | None, bool]:
        """The fault of this request (or ``None``), and whether it came from :meth:`fail_next`'s queue."""
        if method not in self.methods or (self.only is not None and self.only not in path):
            return None, False
        with self._lock:
            if time.monotonic() < self._throttled_until:
                return "slowdown", False
            if self._queue:
                return self._queue.pop(0), True
            else:
                x, kind = self._random.random(), None
                for k in FAULTS:
                    if x < self.rates[k]:
                        kind = k
                        break
                    x -= self.rates[k]
        return kind, False

    def _unused(self, kind: str | None, queued: bool) -> None:
        """A fault that did not apply to its request (a short answer to a request that is not a range): the next gets it."""
        if kind is not None and queued:
            with self._lock:
                self._queue.insert(0, kind)

    def _count(self, kind: str) -> None:
        with self._lock:
            self.injected[kind] += 1

    def _throttle(self, n: int, path: str) -> None:
        with self._lock:
            bandwidth = self.bandwidth
            if bandwidth is None or (self._capped is not None and not self._capped(path)):
                return
            now = time.monotonic()
            start = max(now, self._next_free)
            self._next_free = start + n / bandwidth
            wait = self._next_free - now
        if wait > 0:
            self._stopping.wait(wait)

    def _send_body(self, sock: socket.socket, body: bytes | memoryview, path: str) -> None:
        view = memoryview(body)
        for at in range(0, len(view), _PIECE):
            if self._stopping.is_set() or self._down():
                raise _Closed
            piece = view[at : at + _PIECE]
            self._throttle(len(piece), path)
            sock.sendall(piece)

    def _serve(self, client_sock: socket.socket) -> None:
        client = _Conn(client_sock)
        upstream: _Conn | None = None
        try:
            while not self._stopping.is_set():
                head = client.head()
                request_line, fields = _headers(head)
                method, _, rest = request_line.partition(" ")
                path = rest.rpartition(" ")[0]
                body = _body(client, fields, until_close=False)
                with self._lock:
                    self.requests[method] += 1
                    if method == "GET":
                        self.gets[path] += 1
                        if "range" in fields:
                            self.ranged[path] += 1
                if self._down():
                    self._count("outage")
                    raise _Closed
                kind, queued = self._draw(method, path)
                if kind == "slowdown":
                    self._count(kind)
                    answer = (
                        b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: "
                        + str(len(_SLOWDOWN_BODY)).encode()
                        + b"\r\nConnection: close\r\n\r\n"
                        + _SLOWDOWN_BODY
                    )
                    client_sock.sendall(answer)
                    return
                if kind == "reset":
                    self._count(kind)
                    _reset(client_sock)
                    return
                if upstream is None:
                    up = socket.create_connection(self.target, timeout=60)
                    up.settimeout(None)
                    up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    with self._lock:
                        self._sockets.add(up)
                    upstream = _Conn(up)
                upstream.sock.sendall(_rewrite(head, {"content-length", "transfer-encoding"}, {"Content-Length": str(len(body))})
                                      if body or "content-length" in fields or "transfer-encoding" in fields else head)  # fmt: skip
                if body:
                    upstream.sock.sendall(body)
                rhead = upstream.head()
                status_line, rfields = _headers(rhead)
                status = int(status_line.split()[1])
                bodiless = method == "HEAD" or status in (204, 304) or 100 <= status < 200
                closes = rfields.get("connection", "").lower() == "close"
                framed = bodiless or "content-length" in rfields or "chunked" in rfields.get("transfer-encoding", "").lower()
                rbody = b"" if bodiless else _body(upstream, rfields, until_close=not framed)
                if not framed:
                    closes = True
                whole = 200 <= status < 300 and len(rbody) >= 2  # an answer with a body that a fault can cut or flip
                match = _RANGE.fullmatch(rfields.get("content-range", "")) if status == 206 else None
                if (kind == "short" and (match is None or not whole)) or (kind in ("corrupt", "truncate") and not whole):
                    self._unused(kind, queued)  # (a queued fault waits for a request it applies to)
                    kind = None
                if kind is not None:
                    self._count(kind)
                if kind == "short" and match is not None:
                    first = int(match[1])
                    rbody = rbody[: len(rbody) // 2]
                    new_range = f"bytes {first}-{first + len(rbody) - 1}/{match[3]}"
                    rhead = _rewrite(rhead, {"content-length", "content-range", "transfer-encoding"},
                                     {"Content-Length": str(len(rbody)), "Content-Range": new_range})  # fmt: skip
                elif not bodiless:
                    rhead = _rewrite(rhead, {"content-length", "transfer-encoding"}, {"Content-Length": str(len(rbody))})
                if kind == "corrupt":
                    flipped = bytearray(rbody)
                    flipped[len(flipped) // 2] ^= 0x10
                    rbody = bytes(flipped)
                client_sock.sendall(rhead)
                if kind == "truncate":  # the head promises the whole body; half of it comes, then the connection closes
                    self._send_body(client_sock, memoryview(rbody)[: len(rbody) // 2], path)
                    return
                self._send_body(client_sock, rbody, path)
                if closes:
                    return
        except (_Closed, OSError, ValueError, IndexError):
            pass
        finally:
            with self._lock:
                self._sockets.discard(client_sock)
                if upstream is not None:
                    self._sockets.discard(upstream.sock)
            if self._down():
                _reset(client_sock)
            else:
                with contextlib.suppress(OSError):
                    client_sock.shutdown(socket.SHUT_RDWR)
                client_sock.close()
            if upstream is not None:
                upstream.sock.close()
