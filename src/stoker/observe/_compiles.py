"""Time spent compiling stoker's code in this process, as intervals: what a loader's first batch waited for.

:mod:`stoker.pipeline.warm` adds each outermost compilation of stoker's code (on any
thread; not the producer loop's, compiled in a child process); a recorder takes the part
of them within its first batch's wait (:func:`overlap`) for ``report()``.
"""

from __future__ import annotations

import threading
from collections import deque

_LOCK = threading.Lock()
#: (start, end) in ``time.perf_counter_ns``, the most recent ones
_INTERVALS: deque[tuple[int, int]] = deque(maxlen=4096)


def add(start_ns: int, end_ns: int) -> None:
    """Record a compilation from ``start_ns`` to ``end_ns`` (``time.perf_counter_ns``)."""
    with _LOCK:
        _INTERVALS.append((start_ns, end_ns))


def overlap(since_ns: int, until_ns: int) -> int:
    """Nanoseconds between ``since_ns`` and ``until_ns`` during which some compilation ran (overlaps counted once)."""
    with _LOCK:
        spans = sorted((max(a, since_ns), min(b, until_ns)) for a, b in _INTERVALS if b > since_ns and a < until_ns)
    total, end = 0, since_ns
    for a, b in spans:
        a = max(a, end)
        if b > a:
            total += b - a
            end = b
    return total
