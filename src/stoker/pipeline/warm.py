"""Compiling without making the user wait: what is ready, compiling in the background, and saying so when it is slow.

* :func:`state`: whether a compiled function is ready for given argument types,
  in this process or in Numba's disk cache, without compiling it;
* :class:`Background`: one compilation in a child process of its own (forked:
  it inherits the compiler's state), started when asked (a loader starts its
  producer loop's after its first batch, made meanwhile by Python producers, and
  uses the loop from the next epoch on, loaded from the disk cache the child
  wrote). The child holds no lock, no GIL and no thread of the training process:
  a process that is done exits at once, and the child finishes on its own and
  caches the result (written whole and renamed: a cut-short child leaves nothing
  that is loaded). Without a disk cache to hand the result over (or without
  ``fork``), a thread of the process compiles it, as before;
* the compilations of stoker's code on any thread (a loader's producers, its
  loop): one line to the ``stoker`` logger (INFO) once they have made the
  process wait :data:`ANNOUNCE_AFTER` seconds, said from the thread that
  compiles, naming the kernels; on a terminal a progress line, rewritten in
  place and cleared when compiling stops; their time goes to
  :mod:`stoker.observe._compiles` (``report()``'s first batch);
* :func:`announced`: the same message for one block of one thread.

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


#: a compile child ends after this long whatever it is doing (SIGALRM) [seconds]: the longest compile is a few minutes
_CHILD_LIMIT_S = 3600
#: set in a compile child process (:class:`Background`): it says nothing (its parent may be gone) and counts nothing
_IN_CHILD = False


def _forkable(dispatcher: Any) -> bool:
    """Whether a child process can compile ``dispatcher`` and hand it over: ``fork`` and a disk cache it is saved to."""
    if not hasattr(os, "fork") or os.environ.get("STOKER_COMPILE_IN_CHILD", "1") == "0":
        return False
    cache: Any = getattr(dispatcher, "_cache", None)
    try:
        from numba.core.caching import NullCache

        return cache is not None and not isinstance(cache, NullCache) and bool(cache._cache_path)
    except Exception:  # another Numba's internals, or no private folder: compile here
        return False


def _fork_compiler(dispatcher: Any, argtypes: tuple[Any, ...]) -> int:
    """Fork a child that compiles ``dispatcher`` for ``argtypes`` into its disk cache and exits; the child's pid.

    Forked while this thread holds Numba's compiler lock and stoker's linking lock (no other thread holds them: the
    child's copies are free). The child leaves the parent's session (a Ctrl-C or a hang-up of the parent's terminal
    does not stop it), reads and writes nothing of the parent's files (its standard streams go to ``/dev/null``, every
    other descriptor is closed: a pipe the parent's caller reads to its end is not held open), compiles, and ends with
    ``os._exit`` (no exit handler of the parent runs twice). Its exit status: 0 when compiled and cached.
    """
    from numba.core.compiler_lock import global_compiler_lock

    from stoker.pipeline import linking

    while True:  # (both locks, without waiting on one while holding the other: their order differs between callers)
        with global_compiler_lock:
            if linking._LOCK.acquire(blocking=False):
                try:
                    pid = os.fork()
                    if pid == 0:  # pragma: no cover - the child (measured by the tests through its exit status)
                        _compile_in_child(dispatcher, argtypes)
                    return pid
                finally:
                    linking._LOCK.release()
        time.sleep(0.005)


def _compile_in_child(dispatcher: Any, argtypes: tuple[Any, ...]) -> None:  # pragma: no cover - runs in the child
    global _IN_CHILD
    code = 1
    try:
        _IN_CHILD = True
        import signal

        os.setsid()
        for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_IGN)
        signal.alarm(_CHILD_LIMIT_S)  # (a child stuck on a lock it was forked holding ends, never lingers)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.closerange(3, 1 << 16)
        dispatcher.compile(argtypes)
        code = 0
    except BaseException:
        code = 1
    finally:
        os._exit(code)


class Background:
    """Compile ``dispatcher`` for ``argtypes`` in a child process of its own (or a thread), once :meth:`start` is called.

    The child (see :func:`_fork_compiler`) compiles into the disk cache and ends on its
    own, whether the loader is closed or the process ends meanwhile: the next process
    finds the result in the cache. Once it has ended, the parent's next call of the
    dispatcher loads it from the cache. Where a child cannot hand the result over (no
    disk cache, no ``fork``, ``STOKER_COMPILE_IN_CHILD=0``), a thread of this process
    compiles it, and the process waits for it at exit.
    """

    def __init__(self, dispatcher: Any, argtypes: tuple[Any, ...], what: str) -> None:
        self.dispatcher, self.argtypes, self.what = dispatcher, argtypes, what
        self.error: BaseException | None = None
        self.seconds = 0.0
        #: the compile child's process id (``None``: compiled by a thread, or not started)
        self.pid: int | None = None
        self._thread: threading.Thread | None = None
        self._started = False
        self._t0 = 0.0
        self._lock = threading.Lock()
        self._done = threading.Event()

    def start(self) -> None:
        """Start compiling (any number of calls: the first one starts)."""
        with self._lock:
            if self._started:
                return
            self._started = True
            self._t0 = time.perf_counter()
            if _forkable(self.dispatcher):
                try:
                    self.pid = _fork_compiler(self.dispatcher, self.argtypes)
                except OSError:  # (no process to spare: compile in a thread)
                    self.pid = None
                if self.pid is not None:
                    logger.info(
                        f"stoker: compiling {self.what} in a child process (pid {self.pid}); batches are made meanwhile, "
                        "and it is cached on disk afterwards, even if this process ends first"
                    )
                    return
            # (SIGINT and SIGTERM blocked in it: a Ctrl-C reaches the loop's thread, not a compilation)
            self._thread = start_thread(self._run, name="stoker-compile", daemon=False)

    def _reap(self, block: bool) -> None:
        """The child's end, if it has ended (``block``: wait for it)."""
        pid = self.pid
        if pid is None or self._done.is_set():
            return
        with self._lock:
            if self._done.is_set():
                return
            try:
                done, status = os.waitpid(pid, 0 if block else os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: ask the cache
                done, status = pid, 0
            if done == 0:
                return
            code = os.waitstatus_to_exitcode(status)
            self.seconds = time.perf_counter() - self._t0
            if code != 0:
                self.error = RuntimeError(f"the process compiling {self.what} (pid {pid}) exited with status {code}")
            elif state(self.dispatcher, self.argtypes) == "missing":
                self.error = RuntimeError(f"the process compiling {self.what} (pid {pid}) left nothing in the disk cache")
            self.dispatcher = None
            self._done.set()

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
        return self._started

    def done(self) -> bool:
        """Whether the compilation has ended (successfully or not)."""
        self._reap(block=False)
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Start it if not started, wait until it ends; whether it has."""
        self.start()
        if self.pid is None:
            return self._done.wait(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True


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
                    if state[3] is None:  # (a block of announced() says its own message)
                        _burst_start(_kernel_name(ev))
                state[0] += 1

            def on_end(self, ev: Any) -> None:
                state = _threads.get(threading.get_ident())
                if state is None or state[0] == 0:
                    return
                state[0] -= 1
                if state[0] == 0:
                    state[2] += time.perf_counter() - state[1]
                    _burst_end()
                _check(state)

        class Passes(event.Listener):  # type: ignore[misc]
            def on_start(self, ev: Any) -> None:
                state = _threads.get(threading.get_ident())
                if state is not None:
                    _check(state)
                    if state[3] is None:
                        _burst_check()

            def on_end(self, ev: Any) -> None:
                pass

        event.register("numba:compile", Compiles())
        event.register("numba:run_pass", Passes())
        _watching = True


def watch() -> None:
    """Follow the compilations of stoker's code from now on (idempotent; a loader calls it when it is planned)."""
    _watch_compiles()


def _kernel_name(ev: Any) -> str | None:
    """The short name of the function an event compiles if it is stoker's (a kernel, generated code), else ``None``."""
    dispatcher = ev.data.get("dispatcher") if isinstance(getattr(ev, "data", None), dict) else None
    fn = getattr(dispatcher, "py_func", None)
    module = getattr(fn, "__module__", None) or ""
    if fn is None or not (module.startswith("stoker.") or module.startswith("stoker_fused_")):
        return None
    if module.startswith("stoker_fused_"):
        return f"generated {fn.__name__}"
    return f"{module.rsplit('.', 1)[-1]}.{fn.__qualname__}"


#: seconds without compiling after which the next compilation starts a new burst (a new wait, a new message)
_BURST_GAP = 2.0
_burst_lock = threading.Lock()
#: the current burst of compilations of stoker's code on any thread: thread id -> (kernel, since) of those under way,
#: the kernels done, seconds compiled (overlaps once), when the last one ended, whether it was said, progress shown
_burst: dict[str, Any] = {"running": {}, "done": [], "seconds": 0.0, "last": -1e9, "said": False, "shown": 0.0, "t0": 0.0}


def _burst_start(name: str | None) -> None:
    if name is None or _IN_CHILD:
        return
    now = time.perf_counter()
    with _burst_lock:
        b = _burst
        if not b["running"] and now - b["last"] > _BURST_GAP:
            b.update(running={}, done=[], seconds=0.0, said=False, shown=0.0, t0=now)
        b["running"][threading.get_ident()] = (name, now)
    _burst_check(force=True)


def _burst_end() -> None:
    now = time.perf_counter()
    with _burst_lock:
        b = _burst
        hit = b["running"].pop(threading.get_ident(), None)
        if hit is None:
            return
        name, since = hit
        # (seconds with some compilation under way: a span that overlaps one counted already counts from that one's end)
        b["seconds"] += max(0.0, now - max(since, b["last"]))
        b["last"] = now
        b["done"].append(name)
        running = bool(b["running"])
    from stoker.observe import _compiles

    _compiles.add(int(since * 1e9), int(now * 1e9))
    _burst_check(force=True)
    if not running:
        _progress("")


def _burst_check(force: bool = False) -> None:
    """Say the burst's message once it has compiled :data:`ANNOUNCE_AFTER` seconds; on a terminal, draw its progress line."""
    if _IN_CHILD:
        return
    now = time.perf_counter()
    message = None
    with _burst_lock:
        b = _burst
        if not b["running"]:
            return
        earliest = min(t for _, t in b["running"].values())
        compiled = b["seconds"] + (now - max(earliest, b["last"]))
        if compiled < ANNOUNCE_AFTER:
            return
        current = sorted({n for n, _ in b["running"].values()})
        k = len(b["done"]) + len(b["running"])
        if not b["said"]:
            b["said"] = True
            done = f"; done: {', '.join(b['done'])}" if b["done"] else ""
            message = (
                f"stoker: waiting for the compiler before the next batch: compiling {', '.join(current)} "
                f"(kernel {k} of those compiled so far{done}); each is compiled once, cached afterwards "
                "(see docs/loader.md, 'Cold start')"
            )
        line = None
        if force or now - b["shown"] >= 0.5:
            b["shown"] = now
            line = f"stoker: compiling {', '.join(current)} ({k} kernels, {now - b['t0']:.0f} s; cached afterwards)"
    if message is not None:
        logger.info(message)
    if line is not None:
        _progress(line)


def _progress(line: str) -> None:
    """On a terminal, ``line`` in place of the previous progress line (``""``: cleared); elsewhere nothing."""
    if not _on_terminal():
        return
    try:
        sys.stderr.write("\r\x1b[K" + line[:160])
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


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
