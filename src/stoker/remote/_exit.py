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

What. Store requests run on a :class:`RequestLoop`, whose
``call_soon_threadsafe`` counts the calls in progress from other threads, and
the first store opened registers :func:`quiesce` with :mod:`atexit` (atexit
runs before finalization, while a thread may still take the GIL): it stops
the requests of every store still open, waits until no Rust thread is inside
``call_soon_threadsafe`` and then lets the GIL go for a moment, so that a Rust
thread that still needs it (to finish a completion, or to see that its
request was cancelled) gets it before the interpreter goes away.
"""

from __future__ import annotations

import asyncio
import atexit
import contextvars
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol, TypeVarTuple

__all__ = ["RequestLoop", "quiesce", "watch"]

#: how long :func:`quiesce` waits for the Rust threads at most [seconds]
QUIESCE_TIMEOUT = 5.0
#: how long :func:`quiesce` lets the GIL go after the last completion, for a Rust thread that still needs it [seconds]
SETTLE = 0.02

_lock = threading.Lock()
_calls = 0  # calls of RequestLoop.call_soon_threadsafe in progress (from obstore's threads, the loops' own, interrupt())
_idle = threading.Condition(_lock)
_registered = False
_Ts = TypeVarTuple("_Ts")


class _Interruptible(Protocol):
    def interrupt(self) -> None: ...


_stores: weakref.WeakSet[Any] = weakref.WeakSet()


class RequestLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``call_soon_threadsafe`` from another thread (obstore's completing a request) is counted."""

    def call_soon_threadsafe(
        self, callback: Callable[[*_Ts], object], *args: *_Ts, context: contextvars.Context | None = None
    ) -> asyncio.Handle:
        global _calls
        with _lock:
            _calls += 1
        try:
            return super().call_soon_threadsafe(callback, *args, context=context)
        finally:
            with _lock:
                _calls -= 1
                if _calls == 0:
                    _idle.notify_all()


def settle(timeout: float = QUIESCE_TIMEOUT) -> bool:
    """Wait until no thread is inside :meth:`RequestLoop.call_soon_threadsafe`, then let the GIL go for :data:`SETTLE`.

    Returns:
        ``False`` when some call was still in progress after ``timeout`` [seconds].
    """
    deadline = time.monotonic() + timeout
    with _lock:
        while _calls:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            _idle.wait(min(left, 0.01))
    time.sleep(SETTLE)  # (a Rust thread past the call, or one about to see its request cancelled, takes the GIL now)
    return True


def watch(store: _Interruptible) -> None:
    """Remember ``store`` (weakly) for :func:`quiesce`, and register :func:`quiesce` with :mod:`atexit` once per process."""
    global _registered
    with _lock:
        _stores.add(store)
        if _registered:
            return
        _registered = True
    atexit.register(quiesce)


def quiesce() -> None:
    """At exit: stop the requests of every open store, and wait until obstore's threads no longer need the GIL."""
    for store in list(_stores):
        try:
            store.interrupt()
        except Exception:  # (at exit: the next store is still to be stopped)
            continue
    settle()
