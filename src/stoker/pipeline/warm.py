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
                self._thread = threading.Thread(target=self._run, name="stoker-compile", daemon=False)
                self._thread.start()

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


_local = threading.local()
#: thread id -> compilations running in it (Numba's compile events; nested ones count once each)
_compiling: dict[int, int] = {}
_watching = False
_watch_lock = threading.Lock()


def _watch_compiles() -> None:
    """Count, per thread, the compilations running (a Numba event listener, registered once, when first needed)."""
    global _watching
    with _watch_lock:
        if _watching:
            return
        from numba.core import event

        class Watch(event.Listener):  # type: ignore[misc]
            def on_start(self, ev: Any) -> None:
                tid = threading.get_ident()
                _compiling[tid] = _compiling.get(tid, 0) + 1

            def on_end(self, ev: Any) -> None:
                tid = threading.get_ident()
                _compiling[tid] = _compiling.get(tid, 1) - 1

        event.register("numba:compile", Watch())
        _watching = True


@contextlib.contextmanager
def announced(what: str, background: bool = False) -> Iterator[None]:
    """Within the block, a message once this thread has spent :data:`ANNOUNCE_AFTER` seconds compiling in it.

    The message goes to the ``stoker`` logger (INFO); on a terminal, when that
    logger would not show it, also one line to stderr; a second line says how
    long it took. Time spent on anything else (reading data) does not count.
    Nested blocks announce only the outermost.
    """
    if getattr(_local, "depth", 0):
        _local.depth += 1
        try:
            yield
        finally:
            _local.depth -= 1
        return
    _watch_compiles()
    _local.depth = 1
    tid = threading.get_ident()
    t0 = time.perf_counter()
    done = threading.Event()
    said = threading.Event()

    def watch() -> None:
        compiling, step = 0.0, 0.1
        while not done.wait(step):
            if _compiling.get(tid, 0) > 0:
                compiling += step
            if compiling >= ANNOUNCE_AFTER:
                said.set()
                where = "in the background; batches are made meanwhile" if background else "before the first batch"
                _emit(f"stoker: compiling {what} ({where}): once, then it is cached on disk (see docs/loader.md, 'Cold start')")
                return

    watcher = threading.Thread(target=watch, name="stoker-compile-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        _local.depth = 0
        done.set()
        watcher.join()
        if said.is_set():
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
