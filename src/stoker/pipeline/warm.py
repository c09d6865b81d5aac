"""Compiling without making the user wait: what is ready, compiling in the background, and saying so when it is slow.

* :func:`state`: whether a compiled function is ready for given argument types,
  in this process or in Numba's disk cache, without compiling it;
* :class:`Background`: one compilation on a thread of its own, started when asked
  (a loader starts its producer loop's after its first batch, made meanwhile by
  Python producers, and uses the loop from the next epoch on);
* :func:`announced`: a one-line message, when compiling takes longer than a
  second, of what is compiled and that it is cached afterwards.

``STOKER_COMPILE_IN_BACKGROUND=0`` turns background compilation off: whatever is
needed is compiled before the first batch, as the user asked for it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from stoker._threads import start_thread

logger = logging.getLogger("stoker")

#: seconds of compiling before the message
ANNOUNCE_AFTER = 1.0


def in_background() -> bool:
    """Whether loaders compile their producer loop in the background (``STOKER_COMPILE_IN_BACKGROUND``, default on)."""
    return os.environ.get("STOKER_COMPILE_IN_BACKGROUND", "1") != "0"


def state(dispatcher: Any, argtypes: tuple[Any, ...]) -> str:
    """``"ready"`` (compiled in this process), ``"cached"`` (in Numba's disk cache) or ``"missing"`` for ``argtypes``.

    Reads the cache's index only (the code is loaded at the first call). A cache
    this Numba cannot be asked about counts as ``"cached"``: the caller then compiles
    as it would without this check.
    """
    if argtypes in dispatcher.overloads:
        return "ready"
    cache: Any = getattr(dispatcher, "_cache", None)
    try:
        from numba.core.caching import NullCache

        if isinstance(cache, NullCache):
            return "missing"
        key = cache._index_key(argtypes, dispatcher.targetctx.codegen())
        return "cached" if key in cache._cache_file._load_index() else "missing"
    except Exception:  # another Numba's internals: no way to tell
        return "cached"


class Background:
    """Compile ``dispatcher`` for ``argtypes`` on a thread of its own, once :meth:`start` is called.

    The thread holds the dispatcher and the types, nothing of a loader; a compilation
    cannot be interrupted, so it finishes even if its loader is closed (its result is
    cached on disk for the next process), and the process waits for it at exit.
    """

    def __init__(self, dispatcher: Any, argtypes: tuple[Any, ...], what: str) -> None:
        self.dispatcher, self.argtypes, self.what = dispatcher, argtypes, what
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()

    def start(self) -> None:
        """Start compiling (any number of calls: the first one starts)."""
        with self._lock:
            if self._thread is None:
                # (SIGINT and SIGTERM blocked in it: a Ctrl-C reaches the loop's thread, not a compilation)
                self._thread = start_thread(self._run, name="stoker-compile", daemon=False)

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            with announced(self.what, background=True):
                self.dispatcher.compile(self.argtypes)
        except BaseException as exc:  # kept: the loader goes on with Python producers
            self.error = exc
        finally:
            self.seconds = time.perf_counter() - t0
            self.dispatcher = None  # hold nothing once done
            self._done.set()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def done(self) -> bool:
        """Whether the compilation has ended (successfully or not)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Start it if not started, wait until it ends; whether it has."""
        self.start()
        return self._done.wait(timeout)


#: thread id -> [compilations running (nested ones count once each), when the outermost began, seconds compiled
#: before it, the announced block's state or None]
_threads: dict[int, list[Any]] = {}
_watching = False
_watch_lock = threading.Lock()


def _watch_compiles() -> None:
    """Follow each thread's compilations through Numba's events (a listener registered once, when first needed).

    The message is said from the compiling thread itself, at the first of Numba's compiler
    passes (dozens a function) after the block has compiled :data:`ANNOUNCE_AFTER` seconds:
    no thread of its own.
    """
    global _watching
    with _watch_lock:
        if _watching:
            return
        from numba.core import event

        class Compiles(event.Listener):  # type: ignore[misc]
            def on_start(self, ev: Any) -> None:
                state = _threads.setdefault(threading.get_ident(), [0, 0.0, 0.0, None])
                if state[0] == 0:
                    state[1] = time.perf_counter()
                state[0] += 1

            def on_end(self, ev: Any) -> None:
                state = _threads.get(threading.get_ident())
                if state is None or state[0] == 0:
                    return
                state[0] -= 1
                if state[0] == 0:
                    state[2] += time.perf_counter() - state[1]
                _check(state)

        class Passes(event.Listener):  # type: ignore[misc]
            def on_start(self, ev: Any) -> None:
                state = _threads.get(threading.get_ident())
                if state is not None:
                    _check(state)

            def on_end(self, ev: Any) -> None:
                pass

        event.register("numba:compile", Compiles())
        event.register("numba:run_pass", Passes())
        _watching = True


def _check(state: list[Any]) -> None:
    """Say the block's message if it has compiled long enough (called in the compiling thread)."""
    block = state[3]
    if block is None or block["said"]:
        return
    compiled = state[2] + (time.perf_counter() - state[1] if state[0] > 0 else 0.0)
    if compiled >= ANNOUNCE_AFTER:
        block["said"] = True
        where = "in the background; batches are made meanwhile" if block["background"] else "before the first batch"
        _emit(f"stoker: compiling {block['what']} ({where}): once, then it is cached on disk (see docs/loader.md, 'Cold start')")


@contextlib.contextmanager
def announced(what: str, background: bool = False) -> Iterator[None]:
    """Within the block, a message once this thread has spent :data:`ANNOUNCE_AFTER` seconds compiling in it.

    The message goes to the ``stoker`` logger (INFO); on a terminal, when that
    logger would not show it, also one line to stderr; a second line says how
    long it took. Time spent on anything else (reading data) does not count.
    Nested blocks announce only the outermost.
    """
    _watch_compiles()
    state = _threads.setdefault(threading.get_ident(), [0, 0.0, 0.0, None])
    if state[3] is not None:  # nested: the outer block announces
        yield
        return
    t0 = time.perf_counter()
    state[2] = 0.0
    if state[0] > 0:  # (inside a compilation already: count from here)
        state[1] = t0
    state[3] = block = {"what": what, "background": background, "said": False}
    try:
        yield
    finally:
        state[3] = None
        if block["said"]:
            _emit(f"stoker: compiled {what} in {time.perf_counter() - t0:.1f} s")


def _emit(message: str) -> None:
    logger.info(message)
    if not logger.isEnabledFor(logging.INFO) and _on_terminal():
        sys.stderr.write(message + "\n")
        sys.stderr.flush()


def _on_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False
