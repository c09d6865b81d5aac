"""Per-stage statistics of a running flow: counters kept under the pipeline's lock, read as frozen snapshots."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

#: durations kept per stage for the percentile: the most recent ones [items]
_WINDOW = 2048


class _Counters:
    """What one node records; every field is written under the pipeline's lock."""

    __slots__ = (
        "blocked_s",
        "blocked_since",
        "busy_s",
        "durations",
        "failures",
        "items_in",
        "items_out",
        "occ_area",
        "occ_len",
        "occ_max",
        "occ_t",
        "ring_pos",
    )

    def __init__(self) -> None:
        self.items_in = 0
        self.items_out = 0
        self.failures = 0
        self.busy_s = 0.0
        self.durations: list[float] = []
        self.ring_pos = 0
        self.blocked_s = 0.0
        self.blocked_since: float | None = None
        self.occ_area = 0.0
        self.occ_len = 0
        self.occ_max = 0
        self.occ_t = time.perf_counter()

    def duration(self, dt: float) -> None:
        self.busy_s += dt
        ring = self.durations
        if len(ring) < _WINDOW:
            ring.append(dt)
        else:
            ring[self.ring_pos] = dt
            self.ring_pos = (self.ring_pos + 1) % _WINDOW

    def occupancy(self, length: int, now: float) -> None:
        """The input queue now holds ``length`` items (time-weighted mean and maximum)."""
        self.occ_area += self.occ_len * (now - self.occ_t)
        self.occ_t = now
        self.occ_len = length
        if length > self.occ_max:
            self.occ_max = length

    def blocked(self, waiting: bool, now: float) -> None:
        """Outputs are (``waiting``) or are no longer waiting for room downstream."""
        if waiting:
            if self.blocked_since is None:
                self.blocked_since = now
        elif self.blocked_since is not None:
            self.blocked_s += now - self.blocked_since
            self.blocked_since = None


@dataclass(frozen=True)
class StageStats:
    """One stage of a flow, as seen at one moment.

    Attributes:
        name: the stage's name (``source``, a function's name, ``aggregate(32)``, ``sink``).
        kind: ``source``, ``thread``, ``async``, ``process`` (or another executor), ``sink``.
        concurrency: items the stage may work on at once.
        items_in: items the stage has started.
        items_out: items it finished successfully.
        failures: items whose function raised.
        in_flight: started, not finished (``items_in - items_out - failures``).
        mean_s: mean time per item in the stage's function [seconds].
        p95_s: 95th percentile of that time over the last 2,048 items [seconds].
        busy_s: total time in the function, summed over concurrent items [seconds].
        blocked_s: time with finished outputs waiting for room in the next stage's queue [seconds].
        queue_mean: time-weighted mean length of the stage's input queue [items].
        queue_max: longest the input queue has been [items].
        queue_now: its length now [items].
        queue_capacity: its bound [items].
        utilization: ``busy_s / (elapsed * concurrency)``: near 1, the stage is saturated.
    """

    name: str
    kind: str
    concurrency: int
    items_in: int
    items_out: int
    failures: int
    in_flight: int
    mean_s: float
    p95_s: float
    busy_s: float
    blocked_s: float
    queue_mean: float
    queue_max: int
    queue_now: int
    queue_capacity: int
    utilization: float


@dataclass(frozen=True)
class PipelineStats:
    """A snapshot of a flow's statistics: :meth:`Pipeline.stats`.

    Attributes:
        elapsed_s: time since ``start()`` (until ``stop()`` once stopped) [seconds].
        delivered: items handed to the consumer.
        consumer_wait_s: time the consumer waited for an item [seconds].
        stages: the source, each ``pipe`` stage and the sink, in order.
        accounting: the per-step accounting, as a Loader's ``stats()["accounting"]``: the share of its
            time the consumer waited, the verdict, the stage blamed for most of the waiting (each wait is
            blamed on the stage holding the next item) and a suggestion (see ``docs/observability.md``);
            empty with ``STOKER_ACCOUNTING=0``.
    """

    elapsed_s: float
    delivered: int
    consumer_wait_s: float
    stages: tuple[StageStats, ...]
    accounting: dict[str, Any] = field(default_factory=dict)

    def stage(self, name: str) -> StageStats:
        """The stage called ``name``.

        Raises:
            KeyError: no stage has that name (the message lists them).
        """
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"no stage named {name!r}; the stages are {[s.name for s in self.stages]}")

    def bottleneck(self) -> StageStats | None:
        """The ``pipe`` stage that is busiest relative to its concurrency, or ``None`` when none ran."""
        work = [s for s in self.stages if s.kind not in ("source", "sink") and s.items_in]
        return max(work, key=lambda s: s.utilization) if work else None

    def report(self) -> str:
        """A table, one row per stage, and a hint naming the stage to give more concurrency."""
        rate = self.delivered / self.elapsed_s if self.elapsed_s > 0 else 0.0
        lines = [
            f"flow: {self.delivered} items delivered in {self.elapsed_s:.2f} s ({rate:.1f}/s); consumer waited {self.consumer_wait_s:.2f} s",
            f"{'stage':<24} {'kind':<8} {'conc':>4} {'in':>8} {'out':>8} {'fail':>5} {'mean ms':>8} {'p95 ms':>8} "
            f"{'busy %':>6} {'blocked s':>9} {'queue mean/max/cap':>18}",
        ]
        for s in self.stages:
            queue = f"{s.queue_mean:.1f}/{s.queue_max}/{s.queue_capacity}" if s.queue_capacity else "-"
            lines.append(
                f"{s.name[:24]:<24} {s.kind:<8} {s.concurrency:>4} {s.items_in:>8} {s.items_out:>8} {s.failures:>5} "
                f"{_ms(s.mean_s):>8} {_ms(s.p95_s):>8} {100 * s.utilization:>6.0f} {s.blocked_s:>9.2f} {queue:>18}"
            )
        lines.append(self._hint())
        return "\n".join(lines)

    def _hint(self) -> str:
        top = self.bottleneck()
        sink = self.stages[-1] if self.stages and self.stages[-1].kind == "sink" else None
        if sink is not None and sink.queue_capacity and sink.queue_mean >= 0.75 * sink.queue_capacity:
            return "hint: the sink is mostly full: the consumer is the slowest part, not the pipeline"
        if top is None:
            return "hint: no stage has run yet"
        if top.utilization >= 0.8:
            return (
                f"hint: stage '{top.name}' is busy {100 * top.utilization:.0f}% of its concurrency ({top.concurrency}): "
                "give it more concurrency (and num_threads), or make it cheaper"
            )
        return (
            f"hint: no stage is saturated (busiest: '{top.name}', {100 * top.utilization:.0f}%): the source or the consumer sets the pace"
        )


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{1000 * seconds:.3f}"


def percentile(durations: list[float], q: float) -> float:
    """The ``q`` quantile (0 < q <= 1) of ``durations`` by rank (``nan`` for none)."""
    if not durations:
        return math.nan
    ordered = sorted(durations)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))]


def _p95(durations: list[float]) -> float:
    return percentile(durations, 0.95)


def snapshot(name: str, kind: str, concurrency: int, c: _Counters, queue_now: int, capacity: int, elapsed: float, now: float) -> StageStats:
    """A :class:`StageStats` of counters ``c`` at time ``now`` (called under the pipeline's lock)."""
    area = c.occ_area + c.occ_len * (now - c.occ_t)
    blocked = c.blocked_s + (now - c.blocked_since if c.blocked_since is not None else 0.0)
    done = c.items_out + c.failures
    return StageStats(
        name=name,
        kind=kind,
        concurrency=concurrency,
        items_in=c.items_in,
        items_out=c.items_out,
        failures=c.failures,
        in_flight=c.items_in - done,
        mean_s=c.busy_s / done if done else math.nan,
        p95_s=_p95(c.durations),
        busy_s=c.busy_s,
        blocked_s=blocked,
        queue_mean=area / elapsed if elapsed > 0 else 0.0,
        queue_max=c.occ_max,
        queue_now=queue_now,
        queue_capacity=capacity,
        utilization=min(1.0, c.busy_s / (elapsed * concurrency)) if elapsed > 0 and concurrency else 0.0,
    )
