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
import signal
import threading
from collections.abc import Callable
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
