"""The timeline: Chrome trace-event JSON (Perfetto, ``chrome://tracing``) and spans in ``torch.profiler``.

A :class:`TraceSession` collects events while it is active. Recorders add their
rows when they fold them (off the hot path); flows add each stage call as it
ends; a lower layer (a download) calls :func:`record_span` for a span on its
own thread. :meth:`TraceSession.write` writes ``{"traceEvents": [...]}``:
complete events (``"ph": "X"``, ``ts`` and ``dur`` in microseconds since the
session started) and metadata events naming each track (``thread_name``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from stoker.observe._recorder import (
    BATCH,
    EPOCH,
    LOOP_MADE,
    M_DONE,
    M_START,
    MAKER,
    MARK_FIXED,
    STEP_FIXED,
    T_ENTER,
    T_EXIT,
    T_READY,
)

if TYPE_CHECKING:
    from stoker.observe._recorder import Recorder

_SESSIONS: list[TraceSession] = []
_LOCK = threading.Lock()


class TraceSession:
    """Events collected between :func:`start` and :func:`stop`.

    Args:
        sources: the recorders whose spans this session keeps (``None``: every one, and every
            :func:`record_span`).
    """

    def __init__(self, sources: list[Recorder] | None) -> None:
        self.sources = None if sources is None else {id(r) for r in sources}
        self.t0 = time.perf_counter_ns()
        self.pid = os.getpid()
        self.events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": self.pid, "tid": 0, "args": {"name": "stoker"}}]
        self._tids: dict[Any, int] = {}
        self.lock = threading.Lock()
        #: also keep record_span's spans (a session of every source does)
        self.spans_too = sources is None

    def wants(self, rec: Recorder | None) -> bool:
        return self.sources is None or (rec is not None and id(rec) in self.sources)

    def tid(self, key: Any, name: str) -> int:
        """The track for ``key`` (named ``name`` the first time)."""
        tid = self._tids.get(key)
        if tid is None:
            tid = self._tids[key] = len(self._tids) + 1
            self.events.append({"name": "thread_name", "ph": "M", "pid": self.pid, "tid": tid, "args": {"name": name}})
            self.events.append({"name": "thread_sort_index", "ph": "M", "pid": self.pid, "tid": tid, "args": {"sort_index": tid}})
        return tid

    def span(self, tid: int, name: str, cat: str, start_ns: int, end_ns: int, args: dict[str, Any] | None = None) -> None:
        event: dict[str, Any] = {
            "name": name,
            "cat": cat,
            "ph": "X",
            "ts": (start_ns - self.t0) / 1e3,
            "dur": max(0, end_ns - start_ns) / 1e3,
            "pid": self.pid,
            "tid": tid,
        }
        if args:
            event["args"] = args
        self.events.append(event)

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the events as trace-event JSON; returns the path."""
        out = Path(path)
        with self.lock:
            text = json.dumps({"traceEvents": self.events, "displayTimeUnit": "ms"})
        out.write_text(text)
        return out


def start(sources: list[Recorder] | None = None) -> TraceSession:
    """Start collecting events (of ``sources`` only, or of everything)."""
    session = TraceSession(sources)
    with _LOCK:
        _SESSIONS.append(session)
    return session


def stop(session: TraceSession) -> None:
    with _LOCK, contextlib.suppress(ValueError):
        _SESSIONS.remove(session)


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
        with session.lock:
            tid = session.tid(("thread", thread.ident), thread.name)
            session.span(tid, name, category, start_ns, end_ns, args)


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
    """Turn folded rows of ``rec`` into spans: the loop's waits, steps and Python stages; each batch on its producer's track."""
    for session in sessions_for(rec):
        with session.lock:
            _add_rows(session, rec, s, m, prev_exit, prev_epoch)


def _add_rows(session: TraceSession, rec: Recorder, s: np.ndarray, m: np.ndarray, prev_exit: int, prev_epoch: int) -> None:
    loop = session.tid((id(rec), "loop"), f"{rec.label}: the loop (waits, steps, Python stages)")
    for r in range(len(s)):
        row, marks = s[r], m[r]
        t_enter, t_ready, t_exit = int(row[T_ENTER]), int(row[T_READY]), int(row[T_EXIT])
        batch, epoch = int(row[BATCH]), int(row[EPOCH])
        if prev_exit > 0 and epoch == prev_epoch and t_enter >= session.t0:
            session.span(loop, "step", "step", prev_exit, t_enter)
        prev_exit, prev_epoch = t_exit, epoch
        if t_enter < session.t0:
            continue
        if t_ready > t_enter:
            session.span(loop, f"wait for batch {batch}", "stall", t_enter, t_ready, {"epoch": epoch, "batch": batch})
        t = t_ready
        for k, c in enumerate(rec.loop):
            d = int(row[STEP_FIXED + k])
            if d > 0:
                session.span(loop, c.name, c.kind if c.kind in ("copy", "device") else "python", t, t + d)
            t += d
        start, done = int(marks[M_START]), int(marks[M_DONE])
        if start <= 0 or done < start:
            continue
        maker = int(row[MAKER])
        track = "the loop's thread (batches made while it waited)" if maker == LOOP_MADE else f"producer {maker}"
        tid = session.tid((id(rec), maker), f"{rec.label}: {rec.trace_tracks.get(maker, track)}")
        session.span(tid, f"batch {batch}", "batch", start, done, {"epoch": epoch, "batch": batch})
        t = start
        for k, c in enumerate(rec.producer):
            d = int(marks[MARK_FIXED + k])
            if d > 0:
                session.span(tid, c.name, c.kind, t, min(t + d, done))
            t += d


def add_stage_span(rec: Recorder, stage: str, start_ns: int, end_ns: int) -> None:
    """A flow stage's call on an item, on the track of (stage, thread)."""
    thread = threading.current_thread()
    for session in sessions_for(rec):
        with session.lock:
            tid = session.tid((id(rec), stage, thread.ident), f"{rec.label}: {stage} ({thread.name})")
            session.span(tid, stage, "stage", start_ns, end_ns)


@contextlib.contextmanager
def tracing(rec: Recorder | None, path: str | os.PathLike[str]) -> Iterator[None]:
    """Collect ``rec``'s spans (and every :func:`record_span`) while the block runs; write them to ``path`` at its end.

    With ``rec`` ``None`` (accounting off) only :func:`record_span` spans are kept.
    """
    if rec is not None:
        rec.fold()  # rows from before the block stay out of it
    session = start([rec] if rec is not None else [])
    session.spans_too = True
    try:
        yield
    finally:
        if rec is not None:
            rec.fold()
        stop(session)
        session.write(path)
