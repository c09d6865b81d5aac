"""Child processes that compile into the disk cache: forked while no other thread compiles, detached, silent.

:func:`fork_child` forks a process that runs one function (a compilation that
caches its result) and exits on its own: :class:`~stoker.pipeline.warm.Background`
(a loader's producer loop) and :mod:`stoker.pipeline._ahead` (a first batch's
kernels) use it. :func:`forkable` says whether a function's compilation can be
handed over that way (``fork`` and a disk cache; ``STOKER_COMPILE_IN_CHILD=0``: never).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

#: a compile child ends after this long whatever it is doing (SIGALRM) [seconds]: the longest compile is a few minutes
_CHILD_LIMIT_S = 3600
#: the lowest priority (``nice``): a compile that takes only the CPU time the training process leaves (see
#: :func:`lower_priority`)
BACKGROUND_NICE = 19
#: set in a compile child process (:class:`~stoker.pipeline.warm.Background`, :mod:`stoker.pipeline._ahead`): it says nothing (its parent may be gone) and counts nothing
IN_CHILD = False


def forkable(dispatcher: Any) -> bool:
    """Whether a child process can compile ``dispatcher`` and hand it over: ``fork`` and a disk cache it is saved to."""
    if not hasattr(os, "fork") or os.environ.get("STOKER_COMPILE_IN_CHILD", "1") == "0":
        return False
    cache: Any = getattr(dispatcher, "_cache", None)
    try:
        from numba.core.caching import NullCache

        return cache is not None and not isinstance(cache, NullCache) and bool(cache._cache_path)
    except Exception:  # another Numba's internals, or no private folder: compile here
        return False


def fork_compiler(dispatcher: Any, argtypes: tuple[Any, ...]) -> int:
    """Fork a child that compiles ``dispatcher`` for ``argtypes`` into its disk cache and exits; the child's pid.

    See :func:`fork_child`; the child's exit status: 0 when compiled and cached.
    """
    return fork_child(lambda: dispatcher.compile(argtypes))


def fork_child(run: Callable[[], Any], keep: Iterable[int] = (), patience: float | None = None) -> int:
    """Fork a child process that calls ``run()`` and exits (status 0 when it returned, 1 when it raised); its pid.

    Forked while this thread holds Numba's compiler lock and stoker's linking lock (no other thread holds them: the
    child's copies are free). The child leaves the parent's session (a Ctrl-C or a hang-up of the parent's terminal
    does not stop it), reads and writes nothing of the parent's files (its standard streams go to ``/dev/null``, every
    other descriptor but those in ``keep`` is closed: a pipe the parent's caller reads to its end is not held open),
    says nothing (:data:`IN_CHILD`), ends after :data:`_CHILD_LIMIT_S` at the latest, and ends with ``os._exit``
    (no exit handler of the parent runs twice). ``patience``: seconds to wait for another thread's compilation to
    end (its locks), then :class:`TimeoutError` (``None``: as long as it takes). Its priority is its parent's
    (:func:`lower_priority` lowers it, once its parent knows the compile can wait: ``warm.Background.batches_take``).
    """
    from numba.core.compiler_lock import global_compiler_lock

    from stoker.pipeline import linking

    keep = tuple(keep)
    deadline = None if patience is None else time.monotonic() + patience
    while True:  # (both locks, without waiting on one while holding the other: their order differs between callers)
        if deadline is None:
            global_compiler_lock.acquire()
        elif not global_compiler_lock._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError("another thread is compiling: no process forked")
        try:
            if linking._LOCK.acquire(blocking=False):
                try:
                    with tbb_fork_quiet():
                        pid = os.fork()
                    if pid == 0:  # pragma: no cover - the child (measured by the tests through its exit status)
                        _run_in_child(run, keep)
                    return pid
                finally:
                    linking._LOCK.release()
        finally:
            if deadline is None:
                global_compiler_lock.release()
            else:
                global_compiler_lock._lock.release()
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError("another thread is compiling: no process forked")
        time.sleep(0.005)


#: what Numba's TBB layer prints (C code) around a fork: on file descriptor 2 when a thread other than the main one
#: forks, on file descriptor 1 (stdout) when its worker threads are busy in another thread's parallel region (a
#: Loader's first batch on Python producers: ``make bench`` printed it seven times); harmless for a compile child (it
#: starts no parallel region), and said once per fork; nothing else is held back
_TBB_FORK_LINES = (
    b"Numba: Attempted to fork from a non-main thread, the TBB library may be in an invalid state in the child process.",
    b"Unable to join threads to shut down before fork(). This can break multithreading in child processes.",
)
#: the descriptors TBB's fork handlers print on
_TBB_FORK_FDS = (1, 2)


def _tbb_layer() -> bool:
    """Whether Numba's threading layer is started and is TBB (whose fork handler prints :data:`_TBB_FORK_LINES`)."""
    try:
        import numba

        return bool(numba.threading_layer() == "tbb")
    except Exception:  # (not started yet: no fork handler prints anything)
        return False


@contextlib.contextmanager
def tbb_fork_quiet() -> Iterator[None]:
    """Around a ``fork()``: hold back exactly :data:`_TBB_FORK_LINES` from the process's stdout and stderr (file
    descriptors 1 and 2).

    With TBB as the threading layer, each descriptor goes to a pipe during the fork; afterwards it is restored, and
    what reached the pipe meanwhile (another thread's output too) is written to it again, without those lines.
    """
    if not _tbb_layer():
        yield
        return
    held: list[tuple[int, int, int]] = []  # (descriptor, its saved copy, the pipe's read end)
    try:
        for fd in _TBB_FORK_FDS:
            saved = os.dup(fd)
            try:
                r, w = os.pipe()
            except OSError:
                os.close(saved)
                raise
            os.dup2(w, fd)
            os.close(w)
            held.append((fd, saved, r))
    except OSError:  # (no descriptor left: as without the filter, for the descriptors not redirected yet)
        pass
    try:
        yield
    finally:
        for fd, saved, r in held:
            os.dup2(saved, fd)
            os.close(saved)
            _write_back(fd, r)


def _write_back(fd: int, r: int) -> None:
    """What is in the pipe ``r`` now (closed after), less :data:`_TBB_FORK_LINES`, written to ``fd``."""
    os.set_blocking(r, False)
    chunks = []
    try:
        while True:  # (what is in the pipe now: the fork handlers' lines were written before fork() returned)
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    except BlockingIOError:
        pass
    finally:
        os.close(r)
    text = b"".join(chunks)
    for line in _TBB_FORK_LINES:
        text = text.replace(line + b"\n\n", b"").replace(line + b"\n", b"").replace(line, b"")
    if text:
        with contextlib.suppress(OSError):
            os.write(fd, text)


def lower_priority(nice: int, pid: int = 0) -> None:
    """Set process ``pid``'s priority (0: this process) to ``nice`` if that is lower, and its session's as a whole
    where the kernel shares CPU time between sessions first (Linux's autogroups, ``/proc/<pid>/autogroup``): a process
    in a session of its own (a compile child, which leaves its parent's) otherwise gets as much CPU time as the
    training process's whole session, whatever its own nice value (photo crops on 2 cores: half speed beside a
    nice-19 compile child in its own session)."""
    with contextlib.suppress(OSError, AttributeError):  # (a platform without priorities, a process gone)
        os.setpriority(os.PRIO_PROCESS, pid, max(nice, os.getpriority(os.PRIO_PROCESS, pid)))
    where = "self" if pid == 0 else str(pid)
    with contextlib.suppress(OSError), open(f"/proc/{where}/autogroup", "w") as f:  # (no autogroups: nothing to do)
        f.write(str(nice))


def _run_in_child(run: Callable[[], Any], keep: tuple[int, ...]) -> None:  # pragma: no cover - runs in the child
    global IN_CHILD
    code = 1
    try:
        IN_CHILD = True
        import signal

        os.setsid()
        for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_IGN)
        signal.alarm(_CHILD_LIMIT_S)  # (a child stuck on a lock it was forked holding ends, never lingers)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        low = 3
        for fd in sorted(k for k in keep if k >= 3):
            os.closerange(low, fd)
            low = fd + 1
        os.closerange(low, 1 << 16)
        run()
        code = 0
    except BaseException:
        code = 1
    finally:
        os._exit(code)
