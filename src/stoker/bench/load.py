"""Was the machine busy while the benchmark ran? Other work's load, sampled beside the benchmark's own.

``os.getloadavg()`` counts every runnable thread, the benchmark's own included: on a
quiet 2-core machine the benchmark alone brings it to about 2. What matters is the
load of *other* work against the cores the benchmark leaves free. A
:class:`LoadMonitor` samples, four times a second, the runnable threads of the whole
machine (``/proc/loadavg``'s fourth field) and those of this process and its
children (DataLoader workers, the fresh processes of the time to first batch:
``/proc/<pid>/task/<tid>/stat``); the difference is other work. Averaged over a
window (a round of the benchmark, or the whole run), it is other work's load
average; the machine was **busy** when it exceeded the cores the benchmark left
free (``os.sched_getaffinity`` cores minus the benchmark's own mean load) by
``BUSY_MARGIN``.

Without ``/proc`` (not Linux) nothing is sampled and only ``os.getloadavg()`` is
reported: ``busy`` is then ``None`` (unknown).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stoker._threads import start_thread

#: other work's load above the free cores from which the machine counts as busy [runnable threads]
BUSY_MARGIN = 0.5
#: seconds between two samples
INTERVAL_S = 0.25


@dataclass(frozen=True)
class LoadWindow:
    """Load over a window of time (means of the samples taken in it).

    Attributes:
        others: other work's mean runnable threads (its load average over the window).
        own: the benchmark's own mean runnable threads (this process and its children).
        cores: the cores this process may run on (``os.sched_getaffinity``).
        samples: samples taken (0: nothing known; ``busy`` is then ``None``).
    """

    others: float
    own: float
    cores: int
    samples: int

    @property
    def free(self) -> float:
        """The cores the benchmark left free (its own load taken from the cores it may use)."""
        return max(0.0, self.cores - self.own)

    @property
    def busy(self) -> bool | None:
        """Other work's load exceeded the free cores by ``BUSY_MARGIN`` (``None``: no sample)."""
        if self.samples == 0:
            return None
        return self.others > self.free + BUSY_MARGIN

    def to_dict(self) -> dict[str, Any]:
        return {"others": self.others, "own": self.own, "cores": self.cores, "free": self.free, "samples": self.samples, "busy": self.busy}


def cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1  # pragma: no cover - Linux has sched_getaffinity


def _running_total(proc: Path) -> int:
    """Runnable threads of the whole machine now (``/proc/loadavg``: ``1.0 0.9 0.8 3/187 4564``)."""
    return int((proc / "loadavg").read_text().split()[3].split("/")[0])


def _state(stat: str) -> str:
    """The state letter of a ``/proc/.../stat`` line (``"pid (comm) S ppid ..."``: after the command's name)."""
    return stat[stat.rindex(")") + 2]


def _parents(proc: Path) -> dict[int, int]:
    """``pid -> ppid`` of every process (for kernels without ``/proc/<pid>/task/<tid>/children``)."""
    out = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            out[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    return out


def _running_own(proc: Path, pid: int) -> int:
    """Runnable threads of ``pid`` and its descendants now."""
    running, todo, seen = 0, [pid], set()
    parents: dict[int, int] | None = None
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            tasks = list((proc / str(p) / "task").iterdir())
        except OSError:  # (ended meanwhile)
            continue
        for task in tasks:
            try:
                if _state((task / "stat").read_text()) == "R":
                    running += 1
            except OSError:
                continue
            try:
                todo.extend(int(c) for c in (task / "children").read_text().split())
            except FileNotFoundError:  # (no CONFIG_PROC_CHILDREN: find the children from every process's parent)
                if parents is None:
                    parents = _parents(proc)
                todo.extend(c for c, pp in parents.items() if pp == p and c not in seen)
            except OSError:
                continue
    return running


class LoadMonitor:
    """Samples other work's and the benchmark's own runnable threads on a thread of its own.

    Use as a context manager (the thread stops at its end); :meth:`window` gives
    the load since the previous call, :meth:`total` over the whole run.

    Args:
        interval_s: seconds between samples.
        proc: the ``/proc`` folder (a test may point it elsewhere).
    """

    def __init__(self, interval_s: float = INTERVAL_S, proc: str | os.PathLike[str] = "/proc") -> None:
        self.interval_s = interval_s
        self.proc = Path(proc)
        self.cores = cores()
        self.available = (self.proc / "loadavg").exists()
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sums = [0.0, 0.0, 0]  # others, own, samples: since the start
        self._mark = [0.0, 0.0, 0]  # the same at the last window()
        self.loadavg_start = os.getloadavg()[0]
        self.loadavg_max = self.loadavg_start

    def __enter__(self) -> LoadMonitor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        if self.available and self._thread is None:
            self._thread = start_thread(self._run, name="stoker-bench-load")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def sample(self) -> None:
        """Take one sample now (the thread calls it; a test may too)."""
        try:
            own = _running_own(self.proc, self._pid)
            total = _running_total(self.proc)
        except (OSError, ValueError, IndexError):
            return
        with self._lock:
            self._sums[0] += max(0, total - own)
            self._sums[1] += own
            self._sums[2] += 1
            self.loadavg_max = max(self.loadavg_max, os.getloadavg()[0])

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def _window(self, a: list[float], b: list[float]) -> LoadWindow:
        n = int(b[2] - a[2])
        if n == 0:
            return LoadWindow(0.0, 0.0, self.cores, 0)
        return LoadWindow((b[0] - a[0]) / n, (b[1] - a[1]) / n, self.cores, n)

    def window(self) -> LoadWindow:
        """The load since the previous call (or the start)."""
        with self._lock:
            now = list(self._sums)
            out = self._window(self._mark, now)
            self._mark = now
        return out

    def total(self) -> LoadWindow:
        """The load since the start."""
        with self._lock:
            return self._window([0.0, 0.0, 0], list(self._sums))

    def summary(self) -> dict[str, Any]:
        """The whole run's load and ``os.getloadavg()`` (1 min) at the start, at its highest and now."""
        return {**self.total().to_dict(), "loadavg_1min": {"start": self.loadavg_start, "max": self.loadavg_max, "end": os.getloadavg()[0]}}


def busy_note(load: dict[str, Any]) -> str | None:
    """One line saying the machine was busy and what that does to the verdict (``None`` when it was not)."""
    if not load.get("busy"):
        return None
    return (
        f"WARNING: the machine was busy: other work kept {load['others']:.1f} threads runnable on average where this "
        f"benchmark left {load['free']:.1f} of its {load['cores']} cores free (load average, 1 min, "
        f"{load['loadavg_1min']['start']:.1f} at the start, up to {load['loadavg_1min']['max']:.1f}). The rounds alternate "
        "the systems so that each ratio compares them under the same load, but a load that changes within a round moves "
        "it, and a system of more threads than the cores left to it loses more than a one-thread one: the verdicts below "
        "may be unreliable; run again on a quiet machine."
    )
