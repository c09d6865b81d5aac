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
  that is loaded; Numba's TBB warning about a fork from a thread other than
  the main one is held back, exactly that line). Without a disk cache to hand the result over (or without
  ``fork``), a thread of the process compiles it, as before;
* the compilations of stoker's code on any thread (a loader's producers, its
  loop): one line to the ``stoker`` logger (INFO) once they have made the
  process wait :data:`ANNOUNCE_AFTER` seconds, said from the thread that
  compiles, naming the kernels and how far it is ("kernel n of m not in the
  cache": :func:`watch` lists the kernels a loader's first batch calls that no
  cache holds); after it, a line for each kernel (at any depth) as it starts
  and ends compiling ("compiling kernel 2 of 5: _resize.resize (cached
  afterwards)"); on a terminal a progress line, rewritten in
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
from collections.abc import Iterable, Iterator
from typing import Any

from stoker._threads import start_thread
from stoker.pipeline import _fork

logger = logging.getLogger("stoker")

#: seconds of compiling before the message
ANNOUNCE_AFTER = 1.0


def in_background() -> bool:
    """Whether loaders compile their producer loop in the background (``STOKER_COMPILE_IN_BACKGROUND``, default on)."""
    return os.environ.get("STOKER_COMPILE_IN_BACKGROUND", "1") != "0"


def state(dispatcher: Any, argtypes: tuple[Any, ...]) -> str:
    """``"ready"`` (compiled in this process), ``"cached"`` (in Numba's disk cache, or among the prebuilt kernels
    shipped with the package: :mod:`stoker.pipeline.prebuilt`) or ``"missing"`` for ``argtypes``.

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
        codegen = dispatcher.targetctx.codegen()
        if cache._index_key(argtypes, codegen) in cache._cache_file._load_index():
            return "cached"
        in_prebuilt = getattr(cache, "in_prebuilt", None)  # (stoker's kernels: the files shipped with the package too)
        return "cached" if in_prebuilt is not None and in_prebuilt(argtypes, codegen) else "missing"
    except Exception:  # another Numba's internals: no way to tell
        return "cached"


#: batches that take the Python producers this long or more [s] set a loop's compile child to the lowest priority: the
#: producers' own cost per batch (a few hundred microseconds of Python) is a few percent of it, so they make batches
#: about as fast as the compiled loop would, and the compile should take only the CPU time they leave (photo crops,
#: 64 a batch, 2 cores: 0.9x the warm speed 2.4 s after iter() beside a child at the lowest priority, 0.5x until it
#: ended 7-15 s later beside one at normal priority); lighter batches (tables) gain most from the loop, which then
#: compiles at normal priority (Otto: compiled 2-3 s after iter(), 14-15 s at the lowest)
LOW_PRIORITY_FROM_S = 0.005
#: how many batches the Python producers make before :meth:`Background.batches_take` is told (the first one pays for
#: loading kernels)
TIMED_BATCHES = 4


class Background:
    """Compile ``dispatcher`` for ``argtypes`` in a child process of its own (or a thread), once :meth:`start` is called.

    The child (see :func:`~stoker.pipeline._fork.fork_compiler`) compiles into the disk cache and ends on its
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
        self._lowered = False  # (batches_take: the child's priority lowered)

    def start(self) -> None:
        """Start compiling (any number of calls: the first one starts)."""
        with self._lock:
            if self._started:
                return
            self._started = True
            self._t0 = time.perf_counter()
            if _fork.forkable(self.dispatcher):
                try:
                    self.pid = _fork.fork_compiler(self.dispatcher, self.argtypes)
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

    def batches_take(self, seconds: float) -> None:
        """How long the Python producers take a batch meanwhile (a median) [s]: from :data:`LOW_PRIORITY_FROM_S` on,
        the compile child is set to the lowest priority (see there); once per compilation."""
        if not self._lock.acquire(blocking=False):  # (being reaped: it has ended)
            return
        try:
            if self._lowered or self.pid is None or seconds < LOW_PRIORITY_FROM_S or self._done.is_set():
                return
            self._lowered = True
            _fork.lower_priority(_fork.BACKGROUND_NICE, self.pid)  # (under the lock: the child is not reaped meanwhile)
        finally:
            self._lock.release()
        logger.debug(f"stoker: batches take {seconds * 1e3:.1f} ms from Python producers: {self.what} compiles at the lowest priority")

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
                    else:
                        name = _kernel_name(ev)
                        if name is not None:
                            state[3]["kernels"].append(name)
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

        class Kernels(event.Listener):  # type: ignore[misc]
            """Each kernel of stoker (at any depth) as it starts and ends compiling, once the wait has been said."""

            def on_start(self, ev: Any) -> None:
                _kernel_start(_kernel_name(ev))

            def on_end(self, ev: Any) -> None:
                _kernel_end(_kernel_name(ev))

        event.register("numba:compile", Kernels())  # (first: a burst's first kernel is named by the burst's message)
        event.register("numba:compile", Compiles())
        event.register("numba:run_pass", Passes())
        _watching = True


def watch(pipelines: Iterable[Any] = ()) -> None:
    """Follow the compilations of stoker's code from now on (idempotent; a loader calls it when it is planned).

    ``pipelines``: the loader's field pipelines (objects with ``steps`` and ``head``): the kernels their first batch
    calls that no cache holds (:func:`_kernels_called`, not in any cache) are the "m" of the next message's "kernel n of m".
    """
    _watch_compiles()
    pipelines = list(pipelines)
    if pipelines:
        functions = [s.python if s.python is not None else s.code for p in pipelines for s in p.steps[: p.head]]
        missing = [k for k in _kernels_called(functions) if not _in_a_cache(k)]
        with _burst_lock:
            _burst["expected"] = missing


def _code_names(code: Any) -> Iterator[str]:
    """The global names ``code`` and the functions defined in it read."""
    yield from code.co_names
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            yield from _code_names(const)


def _stokers(fn: Any) -> bool:
    module = getattr(fn, "__module__", None) or ""
    return module.startswith("stoker.") or module.startswith("stoker_fused_")


def _kernels_called(functions: Iterable[Any], depth: int = 3) -> list[Any]:
    """stoker's compiled kernels (Numba dispatchers) that ``functions`` are or call from Python (their globals and
    closures, ``depth`` Python calls deep): the outermost compilations calling them can start (a kernel's own callees
    compile within it)."""
    from numba.core.dispatcher import Dispatcher

    found: dict[int, Any] = {}
    seen: set[int] = set()

    def visit(fn: Any, level: int) -> None:
        if id(fn) in seen:
            return
        seen.add(id(fn))
        if isinstance(fn, Dispatcher):
            if _stokers(fn.py_func):
                found.setdefault(id(fn), fn)
            return
        fn = getattr(fn, "__func__", fn)
        code = getattr(fn, "__code__", None)
        if code is None or level > depth or not _stokers(fn):
            return
        scope = getattr(fn, "__globals__", {})
        values = [scope.get(name) for name in set(_code_names(code))]
        for cell in getattr(fn, "__closure__", None) or ():
            with contextlib.suppress(ValueError):  # (an empty cell)
                values.append(cell.cell_contents)
        for value in values:
            if callable(value):
                visit(value, level + 1)

    for fn in functions:
        with contextlib.suppress(Exception):  # (an object that answers attribute lookups in its own way: not followed)
            visit(fn, 0)
    return list(found.values())


def _in_a_cache(dispatcher: Any) -> bool:
    """Whether ``dispatcher`` is compiled in this process or has any entry in its disk cache (or the prebuilt files):
    a question without its argument types, which are known only at its first call."""
    if dispatcher.overloads:
        return True
    cache: Any = getattr(dispatcher, "_cache", None)
    try:
        from numba.core.caching import NullCache

        if cache is None or isinstance(cache, NullCache):
            return False
        if cache._cache_file._load_index():
            return True
        prebuilt = getattr(cache, "_prebuilt", None)
        return bool(prebuilt is not None and prebuilt._load_index())
    except Exception:  # another Numba's internals: no way to tell
        return True


def _kernel_name(ev: Any) -> str | None:
    """The short name of the function an event compiles if it is stoker's (a kernel, generated code), else ``None``."""
    dispatcher = ev.data.get("dispatcher") if isinstance(getattr(ev, "data", None), dict) else None
    fn = getattr(dispatcher, "py_func", None)
    module = getattr(fn, "__module__", None) or ""
    if fn is None or not (module.startswith("stoker.") or module.startswith("stoker_fused_")):
        return None
    return _name_of(fn)


def _name_of(fn: Any) -> str:
    """How messages name one of stoker's functions: ``module.function``, or ``generated name`` for generated code."""
    module = getattr(fn, "__module__", None) or ""
    if module.startswith("stoker_fused_"):
        return f"generated {fn.__name__}"
    return f"{module.rsplit('.', 1)[-1]}.{fn.__qualname__}"


#: seconds without compiling after which the next compilation starts a new burst (a new wait, a new message)
_BURST_GAP = 2.0
_burst_lock = threading.Lock()
#: the current burst of compilations of stoker's code on any thread: thread id -> (kernel, since) of those under way,
#: the kernels done, seconds compiled (overlaps once), when the last one ended, whether it was said, progress shown
_burst: dict[str, Any] = {
    "running": {}, "done": [], "seconds": 0.0, "last": -1e9, "said": False, "shown": 0.0, "t0": 0.0, "expected": [],
    "started": 0,
}  # fmt: skip
#: thread id -> the kernels of stoker it is compiling, outermost first: [name, since, number in the burst, said]
_kernels: dict[int, list[list[Any]]] = {}


def _wait_said(tid: int) -> bool:
    """Whether the wait that thread ``tid``'s compiling belongs to has been said (its announced block's, or the burst's)."""
    state = _threads.get(tid)
    block = state[3] if state is not None else None
    if block is not None:
        return bool(block["said"])
    b = _burst  # (a burst over: the next one is said anew, after ANNOUNCE_AFTER)
    return bool(b["said"]) and (bool(b["running"]) or time.perf_counter() - b["last"] <= _BURST_GAP)


def _kernel_start(name: str | None) -> None:
    """A kernel of stoker starts compiling in this thread: numbered, and said once the wait has been said."""
    if name is None or _fork.IN_CHILD:
        return
    tid = threading.get_ident()
    now = time.perf_counter()
    with _burst_lock:
        b = _burst
        if not b["running"] and not any(_kernels.values()) and now - b["last"] > _BURST_GAP:  # (a new burst: from 1)
            b["started"] = 0
        k = b["started"] = b.get("started", 0) + 1
        stack = _kernels.setdefault(tid, [])
        stack.append([name, now, k, False])
    if _wait_said(tid):
        with _burst_lock:
            stack[-1][3] = True
            of = _of(_burst, k, [e[0] for st in _kernels.values() for e in st])
        logger.info(f"stoker: compiling kernel {of}: {name} (cached afterwards)")
        _progress(f"stoker: compiling kernel {of}: {name} ({now - _burst['t0']:.0f} s; cached afterwards)")


def _kernel_end(name: str | None) -> None:
    """A kernel of stoker is compiled: said if its start was, or if the wait has been said meanwhile."""
    if name is None or _fork.IN_CHILD:
        return
    tid = threading.get_ident()
    stack = _kernels.get(tid)
    if not stack or stack[-1][0] != name:
        return
    _, since, k, said = stack.pop()
    if not stack:
        _kernels.pop(tid, None)
    if said or _wait_said(tid):
        logger.info(f"stoker: compiled kernel {k}: {name} in {time.perf_counter() - since:.1f} s")


def _of(b: dict[str, Any], k: int, current: Iterable[str]) -> str:
    """``"n of m"`` for the burst's ``k``-th kernel: ``m`` counts besides the ``k`` the kernels of the next batch that no
    cache held when :func:`watch` looked and that are neither compiled since nor compiling now (``current``)."""
    running = set(current)
    later = sum(1 for d in b["expected"] if not d.overloads and _name_of(d.py_func) not in running)
    return f"{k} of {k + later}"


def _burst_start(name: str | None) -> None:
    if name is None or _fork.IN_CHILD:
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
    if _fork.IN_CHILD:
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
                f"(kernel {_of(b, k, current)} not in the cache{done}); each is compiled once, cached afterwards "
                "(see docs/loader.md, 'Cold start')"
            )
        line = None
        if force or now - b["shown"] >= 0.5:
            b["shown"] = now
            inner = sorted({st[-1][0] for st in list(_kernels.values()) if st}) or current  # (the innermost: the one now)
            line = f"stoker: compiling {', '.join(inner)} (kernel {_of(b, k, current)}, {now - b['t0']:.0f} s; cached afterwards)"
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
        kernels = block["kernels"]
        if kernels:
            with _burst_lock:
                where += f"; now {kernels[-1]}, kernel {_of(_burst, len(kernels), kernels[-1:])} not in the cache"
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
    state[3] = block = {"what": what, "background": background, "said": False, "kernels": []}
    with _burst_lock:
        if not _burst["running"]:  # (the block's kernels are numbered from 1)
            _burst["started"] = 0
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
