"""Threads that leave interrupts to the main thread, and the CPUs this process may use.

The bottom layer: every part of stoker (writer, loader, flow, prefetch) starts
its threads through :func:`start_thread`, and counts CPUs with :func:`available_cpus`.

Signals. POSIX delivers a process-directed signal (Ctrl-C's SIGINT, SIGTERM)
to any thread that does not block it. Python runs its handlers in the main
thread only, and only between bytecodes: a SIGINT delivered to a worker
thread that sits in compiled code does not interrupt a main thread blocked in
``sem_wait`` or ``read``, so the ``KeyboardInterrupt`` arrives late, or, when
the main thread is itself in a long call, at a point that depends on which
thread the kernel picked. A thread started here blocks SIGINT and SIGTERM
before it runs anything (threads it starts in turn, Numba's among them,
inherit the mask), so the kernel delivers those signals to the main thread,
interrupting whatever system call it waits in.
"""

from __future__ import annotations

import _signal
import os
import queue
import signal
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

#: the signals stoker's threads leave to the main thread
INTERRUPTS = frozenset({signal.SIGINT, signal.SIGTERM})
_INTERRUPT_NUMBERS = {int(s) for s in INTERRUPTS}
_HAS_MASK = hasattr(_signal, "pthread_sigmask")


def block_interrupts() -> None:
    """Block SIGINT and SIGTERM in the calling thread (nothing where the platform has no ``pthread_sigmask``)."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, INTERRUPTS)


class interrupts_blocked:
    """Block SIGINT and SIGTERM in the calling thread for the ``with`` block, then restore its mask.

    For compiled work the main thread runs itself: no Python handler can run inside it
    anyway, and threads a thread pool starts meanwhile (Numba's, on its first parallel
    region) inherit the mask, so that they never take a Ctrl-C meant for the main thread.
    A signal that arrives meanwhile is delivered when the block ends.
    """

    __slots__ = ("_old",)

    def __enter__(self) -> None:
        self._old = _signal.pthread_sigmask(_signal.SIG_BLOCK, _INTERRUPT_NUMBERS) if _HAS_MASK else None

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            _signal.pthread_sigmask(_signal.SIG_SETMASK, self._old)


def _run_blocked(target: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    block_interrupts()
    target(*args, **kwargs)


def start_thread(target: Callable[..., Any], *args: Any, name: str, daemon: bool = True, **kwargs: Any) -> threading.Thread:
    """Start a thread running ``target(*args, **kwargs)`` with SIGINT and SIGTERM blocked; returns it (started).

    Args:
        target: what the thread runs.
        args: its positional arguments.
        name: the thread's name (``stoker-...``: it shows in ``py-spy``, ``gdb`` and tracebacks).
        daemon: whether the interpreter may exit while it runs (stoker's threads are joined by their owners).
        kwargs: its keyword arguments.
    """
    thread = threading.Thread(target=_run_blocked, args=(target, args, kwargs), name=name, daemon=daemon)
    thread.start()
    return thread


class DaemonPool(Executor):
    """An executor of at most ``workers`` threads from :func:`start_thread` (daemon, signals blocked), started as work comes.

    Unlike ``ThreadPoolExecutor``, whose threads the interpreter joins before :mod:`atexit` runs, the end of the
    process does not wait for the work in progress: a read from a slow store held a process's end for seconds
    (5-7 s at 64 KB/s) before stoker's exit handler (``stoker.remote._exit.quiesce``) could stop it. The owner stops
    the work it cares about and calls :meth:`shutdown`; a pool dropped without it lets its idle threads go.

    Args:
        workers: threads at most.
        name: the threads' name prefix (``stoker-...``).
    """

    def __init__(self, workers: int, name: str) -> None:
        self._workers, self._name = max(1, int(workers)), name
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False
        # (the threads hold the queue, not the pool: a pool dropped unclosed is collected, and its idle threads end)
        weakref.finalize(self, _stop_workers, self._queue, self._threads)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        """Run ``fn(*args, **kwargs)`` on a thread of the pool; its :class:`~concurrent.futures.Future`.

        Raises:
            RuntimeError: the pool was shut down.
        """
        future: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the {self._name} pool was shut down")
            self._queue.put((future, fn, args, kwargs))
            if len(self._threads) < self._workers:
                self._threads.append(start_thread(_work, self._queue, name=f"{self._name}-{len(self._threads)}"))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Take no more work; ``cancel_futures``: cancel the work not started; ``wait``: join the threads (after their
        current work)."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        _stop_workers(self._queue, threads)
        if wait:
            me = threading.current_thread()
            for thread in threads:
                if thread is not me:
                    thread.join()


def _stop_workers(work: queue.SimpleQueue[Any], threads: list[threading.Thread]) -> None:
    for _ in threads:
        work.put(None)


def _work(work: queue.SimpleQueue[Any]) -> None:
    """A :class:`DaemonPool` thread: run each item of ``work`` until ``None``."""
    while True:
        item = work.get()
        if item is None:
            return
        future, fn, args, kwargs = item
        del item
        if not future.set_running_or_notify_cancel():
            continue
        result = None
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(result)
        del future, fn, args, kwargs, result  # (nothing of the work kept while idle)


def _cgroup_cpus(root: str | os.PathLike[str] = "/sys/fs/cgroup") -> float | None:
    """The CPU quota of this process's cgroup, in CPUs; ``None``: none (or none readable).

    Reads cgroup v2's ``cpu.max`` (``"<quota> <period>"`` or ``"max <period>"``),
    else cgroup v1's ``cpu/cpu.cfs_quota_us`` (``-1``: none) and
    ``cpu/cpu.cfs_period_us``, both in microseconds, under ``root`` (the
    cgroup file system, where a container sees its own cgroup).

    Args:
        root: the folder of those files.
    """
    try:
        with open(os.path.join(root, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
        if quota != "max" and int(quota) > 0 and int(period) > 0:
            return int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as f:
            quota_us = int(f.read())
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as f:
            period_us = int(f.read())
        if quota_us > 0 and period_us > 0:
            return quota_us / period_us
    except (OSError, ValueError):
        pass
    return None


#: ``(pid, affinity, cpus)`` of the last :func:`available_cpus` answer (renewed after fork and when the affinity changes)
_CPUS_CACHE: tuple[int, Any, int] | None = None


def _affinity() -> Any:
    """This process's CPU affinity set (cheap: one system call), or ``None`` where the platform has none."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None


def available_cpus() -> int:
    """The CPUs this process may use: its affinity set, capped by its cgroup's CPU quota (containers, SLURM), at least 1.

    Cached per process: the cgroup files are read again after a fork or when the affinity set changes
    (compared on each call, one system call), never on every call (each epoch start asks).
    """
    global _CPUS_CACHE
    pid, affinity = os.getpid(), _affinity()
    cached = _CPUS_CACHE
    if cached is not None and cached[0] == pid and cached[1] == affinity:
        return cached[2]
    count = getattr(os, "process_cpu_count", None)
    if count is not None:
        cpus = max(1, count() or 1)
    elif affinity is not None:
        cpus = max(1, len(affinity))
    else:
        cpus = max(1, os.cpu_count() or 1)
    quota = _cgroup_cpus()
    if quota is not None:
        cpus = max(1, min(cpus, int(quota + 0.999)))
    _CPUS_CACHE = (pid, affinity, cpus)
    return cpus
