"""Run-time tuning: how many producers an epoch starts and how many batches they make ahead, within what the user set.

A loop that is not data-bound (a training step much longer than a batch takes to
make) gains nothing from producers racing ahead of it, and on a machine with few
CPUs they take CPU time from the step's own threads (``make bench``'s training step
beside one busy process: stoker's mean 2.3x the batched DataLoader's, its median on
par). So at each epoch's start the loader looks at the previous epoch's accounting
(:mod:`stoker.observe`: when each ``next()`` was entered and when its batch was
ready) and chooses a level of a ladder, from what the user set down:

1. fewer producers (the same batches ahead in all), one at a time down to one;
2. one producer, fewer batches ahead (a quarter, at least 2);
3. no producer: the loop makes each batch itself inside ``next()`` (as a DataLoader
   with ``num_workers=0`` does), where the loop can make batches (every operation
   reentrant, no transfer to CUDA, not a dataset in object storage).

The rule (:func:`choose`, pure: numbers in, a :class:`Choice` and its reason out):

* the first epoch, and every epoch with too few batches timed, runs as set (or as the
  epoch before: nothing to go by);
* the loop waited for its batches (or made them) at least :data:`WAITED_HIGH` of the
  last epoch: back to what the user set at once, and the level it came from is never
  chosen again (hysteresis: no flapping between a level too low and the top);
* the loop waited less than :data:`WAITED_LOW` and its steps (the time between
  ``next()`` calls: the user's training step) took at least :data:`STEPPED_LOW` of
  the epoch: one level down (one epoch at a time). A loop that does little between
  batches (a benchmark, an evaluation pass, seed 003's loop) is as fast as its
  batches come even when it never waits: it keeps what the user set;
* in between: the same level as the epoch before.

The same rows say whether producer 0 makes the next epoch's first batch ahead
(:class:`~stoker.loader._producers.Ahead`, :attr:`Choice.first_ahead`): yes, unless
the last epoch was timed (:data:`MIN_STEPS` batches or more) and its steps took less
than :data:`STEPPED_LOW` of it. A loop that does little between batches holds the
GIL from one ``next()`` to the next, so the Python parts of making that batch (before
and after its compiled call) wait for the epoch's end, and the loop's last ``next()``
waits for them (Otto's tight loop: 2.4 ms an epoch without it against 2.5-2.7 ms).
A training step releases the GIL (torch's operations): the batch is made meanwhile,
and ready when the next epoch starts.

Batches depend on (seed, epoch, position) only, never on which thread made them:
the choice changes when batches are made, not what they hold. ``STOKER_TUNING=0``
turns the tuning off (every epoch as set); ``Loader.report()`` says what was chosen
for the last epoch and why.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from stoker.observe._recorder import AHEAD_MARGIN, ROWS, T_ENTER, T_EXIT, T_READY

#: the environment variable that turns the tuning off (``0``)
TUNING_ENV = "STOKER_TUNING"
#: the loop waited for data less than this share of the last epoch: one level down
WAITED_LOW = 0.01
#: the loop waited for data at least this share of the last epoch: back to what the user set
WAITED_HIGH = 0.05
#: the loop's steps (between ``next()`` calls) took at least this share of the last epoch: fewer producers may do
STEPPED_LOW = 0.5
#: batches of the last epoch timed (its first left out) needed to choose anything
MIN_STEPS = 16
#: the fewest batches ahead of one producer the ladder's level of fewer batches ahead has
LEAST_AHEAD = 2


@dataclass(frozen=True)
class Limits:
    """What the user's settings allow an epoch.

    Attributes:
        producers: the most producers (the pool's, less the CPU left to the loop: ``producers_beside_loop``).
        total: batches ahead in all at the most producers (``producers * ahead``; the slots are sized for it).
        loop_makes: the loop can make every batch itself (no producer at all).
    """

    producers: int
    total: int
    loop_makes: bool

    def __post_init__(self) -> None:
        if self.producers < 1 or self.total < self.producers:
            raise ValueError(f"Limits needs producers >= 1 and total >= producers; got producers={self.producers}, total={self.total}")


def ladder(limits: Limits) -> list[tuple[int, int]]:
    """The levels (producers, batches ahead per producer), what the user set first, fewer after (see the module)."""
    levels = [(p, limits.total // p) for p in range(limits.producers, 0, -1)]
    fewer = max(LEAST_AHEAD, limits.total // 4)
    if fewer < limits.total:
        levels.append((1, fewer))
    if limits.loop_makes:
        levels.append((0, 1))  # (the ring still has one producer's slot arithmetic: the loop claims every batch)
    return levels


@dataclass(frozen=True)
class Choice:
    """One epoch's producers and batches ahead, and why.

    Attributes:
        producers: producer threads started (0: the loop makes every batch inside ``next()``).
        ahead: batches each producer may be ahead of the loop.
        level: the index of (producers, ahead) in :func:`ladder` of ``limits`` (0: as the user set).
        floor: the deepest level this loader may choose from now on (hysteresis).
        limits: the limits it was chosen within.
        reason: why, in words (``report()``'s).
        waited: the share of the last epoch the loop waited for data (``None``: not measured).
        first_ahead: producer 0 makes the next epoch's first batch ahead (see the module).
    """

    producers: int
    ahead: int
    level: int
    floor: int
    limits: Limits
    reason: str
    waited: float | None = None
    first_ahead: bool = True


def _pct(share: float) -> str:
    return f"{share * 100:.1f}%"


def choose(
    limits: Limits, previous: Choice | None, waited: float | None, steps: int, enabled: bool = True, stepped: float | None = None
) -> Choice:
    """The next epoch's producers and batches ahead (see the module for the rule).

    Args:
        limits: what the user's settings allow this epoch.
        previous: the choice of the epoch before (``None``: the first epoch).
        waited: the share of the last epoch's time the loop spent waiting for its batches (or making them) (``None``:
            not measured, e.g. accounting off).
        steps: the last epoch's batches timed (-1: accounting off).
        enabled: tuning on (``STOKER_TUNING`` not ``0``).
        stepped: the share of the last epoch's time the loop spent between ``next()`` calls (the user's step; ``None``:
            not measured, taken as a step long enough).
    """
    levels = ladder(limits)
    deepest = len(levels) - 1
    # (tuning off: as before there was any; too few batches timed: nothing to go by)
    first_ahead = not (enabled and stepped is not None and steps >= MIN_STEPS and stepped < STEPPED_LOW)

    def at(level: int, floor: int, reason: str) -> Choice:
        p, a = levels[level]
        return Choice(p, a, level, floor, limits, reason, waited, first_ahead)

    if not enabled:
        return at(0, 0, "as set (tuning is off: STOKER_TUNING=0)")
    if previous is None or previous.limits != limits:
        return at(0, deepest, "as set (the first epoch)" if previous is None else "as set (the loader's settings changed)")
    level, floor = previous.level, previous.floor
    if steps < 0:
        return at(level, floor, "kept (nothing measured: STOKER_ACCOUNTING=0)")
    if steps < MIN_STEPS:
        return at(level, floor, f"kept (the last epoch timed {steps} batches; {MIN_STEPS} needed)")
    if waited is None:
        return at(level, floor, "kept (the last epoch's rows of the accounting were written over)")
    said = f"the loop waited {_pct(waited)} of the last epoch for its batches"
    if waited >= WAITED_HIGH:
        if level == 0:
            return at(0, floor, f"as set: {said} ({_pct(WAITED_HIGH)} or more)")
        return at(0, min(floor, level - 1), f"as set again: {said} ({_pct(WAITED_HIGH)} or more); no fewer than before from now on")
    if waited < WAITED_LOW:
        if stepped is not None and stepped < STEPPED_LOW:
            return at(
                level,
                floor,
                f"kept: {said}, but its steps took {_pct(stepped)} of it (under {_pct(STEPPED_LOW)}): "
                "a loop that does little between batches goes as fast as they come",
            )
        if level < floor:
            return at(level + 1, floor, f"fewer: {said} (under {_pct(WAITED_LOW)})")
        why = "but fewer made the loop wait before" if floor < deepest else "and this is the fewest"
        return at(level, floor, f"kept: {said}, {why}")
    return at(level, floor, f"kept: {said} (between {_pct(WAITED_LOW)} and {_pct(WAITED_HIGH)})")


def _rows(rec: Any, lo: int, hi: int) -> np.ndarray:
    """Steps ``lo .. hi - 1``'s rows of ``rec`` (at most ``ROWS``): a view where they do not wrap around the ring
    (every epoch's start reads them: a copy of a thousand rows was a tenth of a millisecond), else a copy."""
    a, b = lo % ROWS, hi % ROWS
    if a < b or (b == 0 and hi > lo):
        return rec.steps[a : b or ROWS]  # type: ignore[no-any-return]
    return rec.steps[np.arange(lo, hi) % ROWS]  # type: ignore[no-any-return]


def waited_share(rec: Any, lo: int, hi: int) -> tuple[float | None, int]:
    """The share of steps ``lo .. hi - 1``'s time (the first left out: the epoch's start) that the loop spent waiting for
    its batches or making them (``t_ready - t_enter``), and the steps timed; ``None`` when the rows are gone.

    Args:
        rec: the loader's :class:`~stoker.observe._recorder.Recorder`.
        lo: the first step of the epoch (``rec.count`` when it started).
        hi: ``rec.count`` now.
    """
    lo = max(lo, hi - (ROWS - AHEAD_MARGIN))  # (older rows may be written over)
    if hi - lo < 2:
        return None, max(0, hi - lo - 1)
    rows = _rows(rec, lo, hi)
    enter, ready, exit_ = rows[1:, T_ENTER], rows[1:, T_READY], rows[1:, T_EXIT]
    wall = int(exit_[-1]) - int(rows[0, T_EXIT])
    if wall <= 0 or bool((enter <= 0).any()) or bool((ready < enter).any()):  # (rows of another layout: reconfigured)
        return None, len(enter)
    return float((ready - enter).sum()) / wall, len(enter)


def stepped_share(rec: Any, lo: int, hi: int) -> float | None:
    """The share of steps ``lo .. hi - 1``'s time (as :func:`waited_share` counts it) the loop spent between ``next()``
    calls (``t_enter`` of a step less ``t_exit`` of the one before): the user's own work; ``None`` when the rows are gone.
    """
    lo = max(lo, hi - (ROWS - AHEAD_MARGIN))
    if hi - lo < 2:
        return None
    rows = _rows(rec, lo, hi)
    enter, exit_ = rows[1:, T_ENTER], rows[:, T_EXIT]
    wall = int(exit_[-1]) - int(exit_[0])
    if wall <= 0 or bool((enter <= 0).any()):
        return None
    gaps = enter - exit_[:-1]
    return float(np.maximum(gaps, 0, out=gaps).sum()) / wall  # (np.clip's Python wrapper: several times as long)


class Tuner:
    """One loader's tuning state: the choice of its last epoch (:func:`choose`), read by ``report()``.

    Reads ``STOKER_TUNING`` when made (a Loader makes one). Tests set :attr:`force`.

    Attributes:
        enabled: tuning on.
        last: the last epoch's choice (``None`` before the first epoch).
        before: the choice of the epoch before it.
        epoch: the epoch ``last`` was chosen for.
        force: ``(epoch, limits) -> (producers, ahead)``, the choice forced for an epoch (tests: the same batches
            whatever is chosen); ``None``: :func:`choose`.
    """

    def __init__(self) -> None:
        self.enabled = os.environ.get(TUNING_ENV, "1") != "0"
        self.last: Choice | None = None
        self.before: Choice | None = None
        self.epoch = -1
        self.force: Callable[[int, Limits], tuple[int, int]] | None = None
        self._mark: int | None = None  # the recorder's step count when the last epoch started

    def epoch_start(self, epoch: int, limits: Limits, rec: Any) -> Choice:
        """Choose epoch ``epoch``'s producers and batches ahead from the last epoch's rows of ``rec`` (or ``None``).

        Raises:
            ValueError: a forced choice outside ``limits``.
        """
        waited, steps, stepped = (None, -1 if rec is None else 0, None)
        if rec is not None and self._mark is not None:
            waited, steps = waited_share(rec, self._mark, rec.count)
            stepped = stepped_share(rec, self._mark, rec.count)
        self._mark = rec.count if rec is not None else None
        if self.force is not None:
            p, a = self.force(epoch, limits)
            if not (0 <= p <= limits.producers and a >= 1 and p * a <= limits.total) or (p == 0 and not limits.loop_makes):
                raise ValueError(f"forced choice ({p} producers, {a} ahead) is outside {limits}")
            choice = Choice(p, a, 0, len(ladder(limits)) - 1, limits, "forced (a test's)", waited)
        else:
            choice = choose(limits, self.last, waited, steps, self.enabled, stepped)
        self.before, self.last, self.epoch = self.last, choice, epoch
        return choice

    def describe(self) -> str | None:
        """``report()``'s line: the last epoch's producers and batches ahead, the change from the epoch before, and why."""
        c = self.last
        if c is None:
            return None
        now = _what(c.producers, c.ahead)
        b = self.before
        was = _what(b.producers, b.ahead) if b is not None else None
        change = f"{was} -> {now}" if was is not None and was != now else now
        line = f"producers (epoch {self.epoch}): {change}; {c.reason}"
        if not c.first_ahead and c.producers > 0:
            line += (
                f"; the next epoch's first batch is not made ahead (the loop's steps took under {_pct(STEPPED_LOW)} of the "
                "last epoch: its last next() would wait for it)"
            )
        return line


def _what(producers: int, ahead: int) -> str:
    if producers == 0:
        return "no producer (the loop makes each batch)"
    return f"{producers} producer{'s' if producers != 1 else ''}, {ahead} batch{'es' if ahead != 1 else ''} ahead each"
