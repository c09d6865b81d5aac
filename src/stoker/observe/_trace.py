"""The timeline: Chrome trace-event JSON streamed to a file (Perfetto, ``chrome://tracing``), and spans in ``torch.profiler``.

A :class:`TraceSession` writes its file from the moment it starts. What the
recorders and the hooks give it is queued (folded rows of a recorder as numpy
copies, single spans as tuples) and turned into JSON text by the session's
writer thread, which also folds the session's recorders every ``FLUSH_S``, so
that neither the formatting nor (mostly) the fold runs on the training loop's
thread. The queue is bounded (``MAX_QUEUED`` events): a thread that would grow it
further waits for the writer, so memory does not grow with the run.

The file is valid JSON after every write: ``{"traceEvents": [ ... ], ...}``, each
write putting its events where the closing tail was and the tail after them, in
one ``pwrite``. A run ended by Ctrl-C, an exception or ``sys.exit`` is closed by
the ``with`` block (or ``stoker profile``, or at interpreter exit) with every
event in it; a process killed outright leaves the events of the last write.

Events: complete events (``"ph": "X"``, ``ts`` and ``dur`` in microseconds since
the session started) and metadata events naming each track (``thread_name``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from stoker._threads import start_thread
from stoker.observe import _events, _registry

if TYPE_CHECKING:
    from stoker.observe._recorder import Recorder

#: the writer thread folds its recorders and writes what is queued this often [s]
FLUSH_S = 0.2
#: rows of a recorder (or spans) formatted and written at a time
PIECE = 1024
#: queued events beyond which the writer is woken at once
WAKE_AT = 4096
#: queued events beyond which a thread adding more waits until the writer has taken them
MAX_QUEUED = 20_000

_SESSIONS: list[TraceSession] = []
_LOCK = threading.Lock()
_WRITERS: set[int] = set()  # idents of writer threads (they never wait for room: they make it)
_AT_EXIT = False

_PWRITEV = hasattr(os, "pwritev")
_TAIL = b'\n],"displayTimeUnit":"ms"}\n'


class TraceSession:
    """Events streamed to ``path`` between :func:`start` and :func:`stop`.

    Args:
        sources: the recorders whose spans this session keeps (``None``: every one, and every
            :func:`record_span`).
        path: the trace file (created, or replaced, at once).
        spans_too: also keep :func:`record_span`'s spans (default: when ``sources`` is ``None``).

    Raises:
        OSError: the file cannot be created.
    """

    def __init__(self, sources: list[Recorder] | None, path: str | os.PathLike[str], spans_too: bool | None = None) -> None:
        self.recorders = None if sources is None else list(sources)
        self.sources = None if sources is None else {id(r) for r in sources}
        self.spans_too = sources is None if spans_too is None else spans_too
        self.path = Path(path)
        self.t0 = time.perf_counter_ns()
        self.pid = os.getpid()
        self.lock = threading.Lock()  # the queue, the tracks, the counts
        self._room = threading.Condition(self.lock)
        self._wake = threading.Event()
        self._queue: list[Any] = []  # _events.Rows and span tuples, in the order they came
        self._queued = 0  # events they make (about)
        self._tids: dict[Any, int] = {}
        self._meta: list[str] = []  # the new tracks' metadata events, not yet written
        self._stopping = False
        self._closed = False
        self.error: BaseException | None = None
        self.dropped = 0  # events not written (the writer failed)
        self.written = 0  # events written
        self.peak_queued = 0
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        head = f'{{"traceEvents":[\n{_events.process_name(self.pid)}'.encode()
        os.pwrite(self._fd, head + _TAIL, 0)
        self._end = len(head)  # where the tail starts
        self._writer = start_thread(self._run, name="stoker-trace-writer")  # (SIGINT left to the main thread)

    # ---- what the recorders and hooks call ----------------------------------------------------
    def wants(self, rec: Recorder | None) -> bool:
        return self.sources is None or (rec is not None and id(rec) in self.sources)

    def track(self, key: Any, name: str) -> int:
        """The track for ``key`` (named ``name`` the first time)."""
        with self.lock:
            return self._track(key, name)

    def _track(self, key: Any, name: str) -> int:
        tid = self._tids.get(key)
        if tid is None:
            tid = self._tids[key] = len(self._tids) + 1
            self._meta.extend(_events.metadata(self.pid, tid, name))
        return tid

    def add_span(
        self, key: Any, track_name: str, name: str, cat: str, start_ns: int, end_ns: int, args: dict[str, Any] | None = None
    ) -> None:
        """Queue one span on the track of ``key``."""
        with self.lock:
            if self._make_room():
                self._queue.append((self._track(key, track_name), name, cat, start_ns, end_ns, args))
                self._added(1)

    def add_rows(self, rows: _events.Rows) -> None:
        """Queue a recorder's folded rows (made into spans by the writer)."""
        with self.lock:
            if self._make_room():
                self._queue.append(rows)
                self._added(rows.cost)

    def _make_room(self) -> bool:
        """(Under the lock.) Wait while the queue is full (the writer makes room); ``False``: drop the event."""
        while self._queued >= MAX_QUEUED and self.error is None and not self._closed and threading.get_ident() not in _WRITERS:
            if not self._writer.is_alive():
                break  # (stopped: the closing thread writes what is queued)
            self._wake.set()
            self._room.wait(1.0)
        if self.error is not None or self._closed or os.getpid() != self.pid:  # (a forked child never writes the file)
            self.dropped += 1
            return False
        return True

    def _added(self, cost: int) -> None:
        self._queued += cost
        self.peak_queued = max(self.peak_queued, self._queued)
        if self._queued >= WAKE_AT:
            self._wake.set()

    # ---- the writer ---------------------------------------------------------------------------
    def _run(self) -> None:
        _WRITERS.add(threading.get_ident())
        try:
            while not self._stopping:
                self._wake.wait(FLUSH_S)
                self._wake.clear()
                if self._stopping:
                    break
                for rec in self._recorders():
                    rec.try_fold()  # (never waits for a recorder's lock: its owner may be waiting for room here)
                self.flush()
        except BaseException as exc:  # kept for close(); adders stop waiting
            with self.lock:
                self.error = exc
                self._room.notify_all()
        finally:
            _WRITERS.discard(threading.get_ident())

    def _recorders(self) -> list[Recorder]:
        recs = _registry.registered() if self.recorders is None else self.recorders
        return [r for r in recs if r.count > r.folded]

    def flush(self) -> None:
        """Format what is queued and append it to the file (by the writer, and by :meth:`close` once it has stopped).

        Written a piece at a time (``PIECE`` rows of a recorder, or ``PIECE`` spans), so that the text held at
        once stays small.
        """
        with self.lock:
            queue, self._queue, self._queued = self._queue, [], 0
            self._room.notify_all()
        lines: list[str] = []
        for item in queue:
            if isinstance(item, _events.Rows):
                for piece in _events.pieces(item, PIECE):
                    lines.extend(_events.rows(piece, self.t0, self.pid, self.track))
                    if len(lines) >= PIECE:
                        self._write(lines)
                        lines = []
            else:
                tid, name, cat, start_ns, end_ns, args = item
                lines.append(_events.span(self.pid, tid, name, cat, (start_ns - self.t0) / 1e3, max(0, end_ns - start_ns) / 1e3, args))
                if len(lines) >= PIECE:
                    self._write(lines)
                    lines = []
        del queue
        self._write(lines)

    def _write(self, lines: list[str]) -> None:
        """Append the new tracks' names and ``lines`` where the tail is, and the tail after them (one write)."""
        with self.lock:
            meta, self._meta = self._meta, []
        if not lines and not meta:
            return
        body = (",\n" + ",\n".join(meta + lines if meta else lines)).encode()
        if _PWRITEV:
            os.pwritev(self._fd, [body, _TAIL], self._end)  # (valid JSON before the write and after it)
        else:
            os.pwrite(self._fd, body + _TAIL, self._end)
        self._end += len(body)
        self.written += len(lines)

    def close(self) -> Path:
        """Stop the writer, write what is left, close the file; returns its path.

        Raises:
            OSError: the trace could not be written (disk full...).
        """
        if self._closed:
            return self.path
        if os.getpid() != self.pid:  # a forked child (its copy of the session has no writer): the parent's file is not its
            self._closed = True
            return self.path
        self._stopping = True
        self._wake.set()
        self._writer.join()
        try:
            if self.error is None:
                self.flush()
        except BaseException as exc:
            self.error = exc
        finally:
            with self.lock:
                self._closed = True
                self._room.notify_all()
            os.close(self._fd)
        if self.error is not None:
            raise OSError(f"the trace {self.path} could not be written ({self.dropped} events dropped): {self.error}") from self.error
        return self.path


def start(sources: list[Recorder] | None, path: str | os.PathLike[str], spans_too: bool | None = None) -> TraceSession:
    """Start streaming events (of ``sources`` only, or of everything) to ``path``."""
    global _AT_EXIT
    session = TraceSession(sources, path, spans_too)
    with _LOCK:
        _SESSIONS.append(session)
        if not _AT_EXIT:  # a session left open (no with, no stop) is closed at exit, its file complete
            atexit.register(_close_all)
            _AT_EXIT = True
    return session


def stop(session: TraceSession) -> Path:
    """Stop ``session``: write what is queued and close its file (see :meth:`TraceSession.close`)."""
    with _LOCK, contextlib.suppress(ValueError):
        _SESSIONS.remove(session)
    return session.close()


def _close_all() -> None:
    for session in list(_SESSIONS):
        with contextlib.suppress(Exception):
            stop(session)


def sessions_for(rec: Recorder) -> list[TraceSession]:
    if not _SESSIONS:
        return []
    return [s for s in list(_SESSIONS) if s.wants(rec)]


def active() -> bool:
    """Whether any trace session is collecting (a cheap check for hot paths)."""
    return bool(_SESSIONS)


def record_span(name: str, start_ns: int, end_ns: int, category: str = "download", args: dict[str, Any] | None = None) -> None:
    """Record a span on the calling thread's track of every active trace (the hook for lower layers, e.g. downloads).

    Costs one list check when no trace is active. Times are ``time.perf_counter_ns()``
    values (``CLOCK_MONOTONIC`` on Linux: the clock of every stoker span).

    Args:
        name: what the span did (``"GET shard-00003.stoker [0, 16 MiB)"``).
        start_ns: when it started [ns].
        end_ns: when it ended [ns].
        category: the trace's category (``"download"``, ``"read"``...).
        args: extra key/values shown with the span.
    """
    if not _SESSIONS:
        return
    thread = threading.current_thread()
    for session in sessions_for_spans():
        session.add_span(("thread", thread.ident), thread.name, name, category, start_ns, end_ns, args)


def sessions_for_spans() -> list[TraceSession]:
    return [s for s in list(_SESSIONS) if s.spans_too]


@contextlib.contextmanager
def span(name: str, category: str = "download") -> Iterator[None]:
    """Time a block as a span: on the calling thread's track of active traces, and in ``torch.profiler`` while it records."""
    prof = profiler()
    ctx = prof.record_function(f"stoker: {name}") if prof is not None and prof._is_profiler_enabled else contextlib.nullcontext()
    t0 = time.perf_counter_ns()
    try:
        with ctx:
            yield
    finally:
        record_span(name, t0, time.perf_counter_ns(), category)


def profiler() -> Any:
    """``torch.autograd.profiler`` when torch is imported (its ``_is_profiler_enabled`` is a cheap check), else ``None``."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    return getattr(getattr(torch, "autograd", None), "profiler", None)


def add_rows(rec: Recorder, s: np.ndarray, m: np.ndarray, prev_exit: int, prev_epoch: int) -> None:
    """Queue folded rows of ``rec`` (copies) for every session that keeps it; the writer makes them spans."""
    sessions = sessions_for(rec)
    if not sessions:
        return
    rows = _events.Rows(
        id(rec),
        rec.label,
        s,
        m,
        prev_exit,
        prev_epoch,
        tuple((c.name, c.kind) for c in rec.loop),
        tuple((c.name, c.kind) for c in rec.producer),
        dict(rec.trace_tracks),
    )
    for session in sessions:
        session.add_rows(rows)


def add_stage_span(rec: Recorder, stage: str, start_ns: int, end_ns: int) -> None:
    """A flow stage's call on an item, on the track of (stage, thread)."""
    thread = threading.current_thread()
    for session in sessions_for(rec):
        session.add_span((id(rec), stage, thread.ident), f"{rec.label}: {stage} ({thread.name})", stage, "stage", start_ns, end_ns)


@contextlib.contextmanager
def tracing(rec: Recorder | None, path: str | os.PathLike[str]) -> Iterator[None]:
    """Stream ``rec``'s spans (and every :func:`record_span`) to ``path`` while the block runs; complete it at its end.

    With ``rec`` ``None`` (accounting off) only :func:`record_span` spans are kept. The file
    is valid trace-event JSON from the start, and complete however the block ends.
    """
    if rec is not None:
        rec.fold()  # rows from before the block stay out of it
    session = start([rec] if rec is not None else [], path, spans_too=True)
    try:
        yield
    except BaseException:
        _finish(rec, session, quiet=True)
        raise
    _finish(rec, session, quiet=False)


def _finish(rec: Recorder | None, session: TraceSession, quiet: bool) -> None:
    """Fold the last rows and close the trace; a failure to write it is a warning when an error is already on its way."""
    try:
        if rec is not None:
            rec.fold()
    finally:
        try:
            stop(session)
        except OSError as exc:
            if not quiet:
                raise
            warnings.warn(str(exc), RuntimeWarning, stacklevel=3)
