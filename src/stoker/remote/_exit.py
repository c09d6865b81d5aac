"""Event loops for obstore's asynchronous requests that let the interpreter shut down safely.

Why. obstore completes an asynchronous request (``get_async``, ``head_async``,
a stream's next chunk) from one of its Rust (tokio) threads: that thread takes
the GIL and calls the event loop's ``call_soon_threadsafe``, which writes a
byte to the loop's self-pipe with ``socket.send``, and ``socket.send`` lets the
GIL go. The loop's thread wakes up on that byte, takes the GIL and finishes
the request; when that was the program's last request, the main thread may
reach ``Py_Finalize`` before the Rust thread takes the GIL back. A thread that
asks for the GIL once finalization has begun is ended by CPython with
``pthread_exit``, which cannot unwind Rust frames: glibc aborts the process
(SIGABRT, "Fatal Python error: Aborted", no Python frame), and a job that
exited after reading its data is marked failed. A request cancelled by
:meth:`Store.interrupt` or Ctrl-C takes the GIL once more from a Rust thread
too, when its Rust side stops.

What. Store requests run on a :class:`RequestLoop`: each future obstore makes
on it (``loop.create_future()``) counts as pending until obstore's thread is
done with it (its ``cancelled()`` answered ``True`` to that thread, or its
result's ``call_soon_threadsafe`` returned). The first store opened registers
:func:`quiesce` with :mod:`atexit` (atexit runs before finalization, while a
thread may still take the GIL): it stops the requests of every store still
open, waits (at most 5 s) until none is pending, then lets the GIL go for a
moment for a thread on its way out of the interpreter.
"""

from __future__ import annotations

import asyncio
import atexit
import contextvars
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol, TypeVarTuple

__all__ = ["RequestLoop", "pending", "quiesce", "settle", "watch"]

#: how long :func:`quiesce` waits for the Rust threads at most [seconds]
QUIESCE_TIMEOUT = 5.0
#: how long :func:`quiesce` lets the GIL go after the last completion, for a Rust thread that still needs it [seconds]
SETTLE = 0.02

_lock = threading.Lock()
_pending = 0  # obstore futures made on a RequestLoop whose Rust side has not yet finished with them
_idle = threading.Condition(_lock)
_registered = False
_Ts = TypeVarTuple("_Ts")


class _Interruptible(Protocol):
    def interrupt(self) -> None: ...


_stores: weakref.WeakSet[Any] = weakref.WeakSet()


def _finished() -> None:
    global _pending
    with _lock:
        _pending -= 1
        if _pending == 0:
            _idle.notify_all()


class _RequestFuture(asyncio.Future[Any]):
    """A future that obstore resolves from a Rust thread; it counts in ``_pending`` until that thread is done with it.

    pyo3-async-runtimes, once the Rust side of a request ends, asks ``future.cancelled()`` from a Rust thread: a
    cancelled future is left as it is (the Rust side is then done), any other gets its result through
    ``loop.call_soon_threadsafe`` (done when that call returns: see :meth:`RequestLoop.call_soon_threadsafe`).
    """

    _owner = 0
    _counted = False

    def cancelled(self) -> bool:
        out = super().cancelled()
        if out and self._counted and threading.get_ident() != self._owner:
            self._counted = False
            _finished()
        return out


class RequestLoop(asyncio.SelectorEventLoop):
    """An event loop for obstore's requests: the futures obstore makes on it count until obstore's thread is done."""

    def create_future(self) -> asyncio.Future[Any]:
        global _pending
        future = _RequestFuture(loop=self)
        future._owner = threading.get_ident()
        future._counted = True
        with _lock:
            _pending += 1
        return future

    def call_soon_threadsafe(
        self, callback: Callable[[*_Ts], object], *args: *_Ts, context: contextvars.Context | None = None
    ) -> asyncio.Handle:
        try:
            return super().call_soon_threadsafe(callback, *args, context=context)
        finally:  # (obstore's thread is done with the future once this returns: its byte to the self-pipe is sent)
            for arg in args:
                if isinstance(arg, _RequestFuture) and arg._counted and threading.get_ident() != arg._owner:
                    arg._counted = False
                    _finished()


def _forked() -> None:
    global _pending, _lock, _idle
    _lock = threading.Lock()  # (the parent's requests are not this process's, and its lock may have been held)
    _idle = threading.Condition(_lock)
    _pending = 0


def pending() -> int:
    """How many obstore futures a Rust thread has yet to finish with (for tests and :func:`settle`)."""
    with _lock:
        return _pending


def settle(timeout: float = QUIESCE_TIMEOUT) -> bool:
    """Wait until obstore's threads are done with every future made on a :class:`RequestLoop`, then let the GIL go
    for :data:`SETTLE` (for such a thread that has yet to release it).

    Returns:
        ``False`` when some were still pending after ``timeout`` [seconds].
    """
    deadline = time.monotonic() + timeout
    with _lock:
        while _pending > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            _idle.wait(min(left, 0.01))
    time.sleep(SETTLE)
    return True


def watch(store: _Interruptible) -> None:
    """Remember ``store`` (weakly) for :func:`quiesce`; the first time, register :func:`quiesce` with :mod:`atexit`
    (and a reset of the count in a forked child)."""
    global _registered
    with _lock:
        _stores.add(store)
        if _registered:
            return
        _registered = True
    atexit.register(quiesce)
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_forked)


def quiesce() -> None:
    """At exit: stop the requests of every open store, and wait until obstore's threads no longer need the GIL."""
    for store in list(_stores):
        try:
            store.interrupt()
        except Exception:  # (at exit: the next store is still to be stopped)
            continue
    settle()
