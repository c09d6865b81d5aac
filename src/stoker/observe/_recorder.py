"""Per-step accounting: what the training loop waited for, batch by batch, in preallocated rings.

One :class:`Recorder` per Loader or flow. The hot path writes integers into two
rings of ``ROWS`` rows (no allocation, no lock):

* the **step ring** ``steps`` is written by the loop's thread, one row per batch
  handed over: when ``next()`` was entered, when the batch was ready, when
  ``next()`` returned, who made the batch, its index, the epoch, then the time
  of each *loop-side* component (the Python stages run inside ``next()``);
* the **mark ring** ``marks`` is written by whoever made the batch (a compiled
  producer loop, a Python producer, the loop itself): when it started and
  finished the batch, then the time of each *producer-side* component (reading,
  each field's head).

Batch ``c`` of an epoch lives in row ``(base + c) % ROWS`` of both, ``base`` fixed
when the epoch starts so that the row of the batch being handed over is
``count % ROWS``. Every ``FOLD_EVERY`` steps (and whenever someone reads the
figures) the rows not yet folded are turned, vectorised, into running totals
(:meth:`Recorder.fold`); the trace, the percentiles and the plot read the rings.

Where one step's stall goes (``t_exit - t_enter``, all of it attributed)::

    t_enter ......... t_ready ....... t_exit
    |<- wait for head ->|<- loop-side ->|
      hand-over: t_ready - max(t_done, t_enter)   (the batch was done; the sleeping loop had to wake)
      the rest of the wait: split over the batch's producer-side components in proportion to their times
      loop-side components: their own times; what is left: "loader overhead"
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from stoker.observe import _compiles

#: rows of each ring: the last this many batches are kept for percentiles, the trace and the plot
ROWS = 4096
#: fold the rings into the totals every this many steps (a vectorised pass over them, about 0.2 ms; < ROWS - AHEAD_MARGIN)
FOLD_EVERY = 3072
#: rows a producer may write ahead of the loop (beyond them, a row is never read for percentiles)
AHEAD_MARGIN = 512
#: the loop waits for data at least this share of its time: the training is data-bound
DATA_BOUND_SHARE = 0.10

# the step ring's fixed columns (BLOCKED: the loop slept until the batch was signalled, rather than working meanwhile)
T_ENTER, T_READY, T_EXIT, MAKER, BATCH, EPOCH, BLOCKED = range(7)
STEP_FIXED = 7
# the mark ring's fixed columns
M_START, M_DONE = range(2)
MARK_FIXED = 2
#: ``MAKER`` of a batch the loop's own thread made
LOOP_MADE = -1

HANDOVER = "hand-over (a thread wakes up)"
OVERHEAD = "loader overhead"


@dataclass(frozen=True)
class Component:
    """One place a batch's time can go, named as the user knows it.

    Attributes:
        name: ``"x: RandomResizedCropRGBImageDecoder+RandomHorizontalFlip"``, ``"y: ToTensor"``,
            ``"read"``, a flow stage's function name.
        kind: ``"read"``, ``"compiled"`` (a field's compiled operations), ``"python"`` (a Python
            stage), ``"copy"`` (a host-to-device copy), ``"stage"`` (a flow stage), ``"source"``.
        side: ``"producer"`` (made before the loop asked; the loop's wait is split over these) or
            ``"loop"`` (run inside ``next()`` on the loop's thread).
        field: the Loader field it belongs to (``""`` for none).
    """

    name: str
    kind: str
    side: str
    field: str = ""


class Recorder:
    """The rings and running totals of one Loader or flow (see the module's docstring).

    Args:
        label: how reports name the owner (``"Loader('data.stoker', batch_size=512)"``).
        kind: ``"loader"`` or ``"flow"``.
    """

    def __init__(self, label: str, kind: str) -> None:
        self.label, self.kind = label, kind
        self.lock = threading.Lock()  # fold() and readers; the hot path writes without it
        self.producer: list[Component] = []
        self.loop: list[Component] = []
        self.steps = np.zeros((ROWS, STEP_FIXED), dtype=np.int64)
        self.marks = _aligned_rows(MARK_FIXED)
        self.step_view = self.steps.reshape(-1).data
        self.width = STEP_FIXED
        #: batches handed over so far (the next one goes to row ``count % ROWS``)
        self.count = 0
        self.fold_at = FOLD_EVERY
        self.folded = 0
        self.context: dict[str, Any] = {}  # what suggestions depend on (num_workers, cpus, batches_ahead, ...)
        self.durations: Any = None  # flows: () -> {stage: (items, mean_s, p50_s, p95_s)} from their own counters
        self.trace_tracks: dict[int, str] = {}  # MAKER -> track name (producer threads)
        self._epochs: list[tuple[int, int, int]] = []  # (first step, row base, epoch) of each epoch
        #: when the owner's first ``iter()`` was called (``note_iter``): the first batch is timed from there
        self.first_iter_ns: int | None = None
        self._reset_totals()

    def _reset_totals(self) -> None:
        self.total_steps = 0
        self.stall_ns = 0
        self.wait_ns = 0
        self.step_ns = 0
        self.steps_timed = 0  # steps with a previous next() in the same epoch (their step time is known)
        self.waited = 0  # steps that waited for their batch's head
        self.first_enter: int | None = None
        self.first_batch_ns = 0  # the first batch as the user waits for it: from the first iter() (not in the totals)
        self.first_next_ns = 0  # the first step's stall alone (its next())
        self.first_compile_ns = 0  # of the first batch's time, compiling stoker's code (any thread: observe._compiles)
        self.last_exit = 0
        self._prev_exit, self._prev_epoch = 0, -1
        self.comp_stall: dict[str, float] = {}  # name -> ns of stall attributed
        self.comp_time: dict[str, float] = {}  # name -> ns spent (producer-side: on any thread)
        self.comp_items: dict[str, int] = {}
        self.comp_info: dict[str, Component] = {}

    def note_iter(self) -> None:
        """The owner's ``iter()`` was called: the first one (before any batch) starts the first batch's time.

        A user waits for the first batch from ``iter()`` (which plans and compiles the pipelines and starts the
        producers) to the end of the first ``next()``; both are in ``first_batch_s``.
        """
        if self.first_iter_ns is None and self.count == 0:
            self.first_iter_ns = time.perf_counter_ns()

    # ---- configuration (once per epoch, off the hot path) ------------------------------------
    def configure(self, producer: list[Component], loop: list[Component]) -> None:
        """Set the components; the rings are made again (after folding) only when their widths change."""
        with self.lock:
            if len(producer) != len(self.producer) or len(loop) != len(self.loop):
                self._fold_locked()  # (rows in the old layout)
                self.steps = np.zeros((ROWS, STEP_FIXED + len(loop)), dtype=np.int64)
                self.marks = _aligned_rows(MARK_FIXED + len(producer))
                self.step_view = self.steps.reshape(-1).data
                self.width = STEP_FIXED + len(loop)
            self.producer, self.loop = list(producer), list(loop)
            for c in (*producer, *loop):
                self.comp_info[c.name] = c

    def epoch_base(self, skip: int, epoch: int) -> int:
        """The row base of epoch ``epoch``, whose first batch handed over is batch ``skip`` (recorded: a step's
        ``BATCH`` and ``EPOCH`` columns are filled from it when rows are read, not on the hot path)."""
        base = self.count - skip
        with self.lock:
            if self._epochs and self._epochs[-1][0] == self.count:  # an epoch that handed nothing over
                self._epochs.pop()
            self._epochs.append((self.count, base, epoch))
            while len(self._epochs) > 1 and self._epochs[1][0] <= self.count - ROWS:  # (no row of it is left)
                self._epochs.pop(0)
        return base

    def step(self, row_off: int, t_enter: int, t_ready: int, t_exit: int, maker: int, blocked: int) -> None:
        """Record a step (the loop-side columns of the row at ``row_off`` are written already).

        The Loader writes the same columns itself (``CompiledEpoch._next_slow``; its fast hand-over in one store): no call
        on its hot path.
        """
        v = self.step_view
        v[row_off] = t_enter
        v[row_off + 1] = t_ready
        v[row_off + 2] = t_exit
        v[row_off + 3] = maker
        v[row_off + 6] = blocked
        self.count += 1
        if self.count >= self.fold_at:
            self.fold()

    def _rows(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Copies of steps ``lo .. hi - 1`` (step and mark rows), with their ``BATCH`` and ``EPOCH`` filled in."""
        index = np.arange(lo, hi)
        rows = index % ROWS
        s, m = self.steps[rows], self.marks[rows]
        if self._epochs:
            starts = np.array([e[0] for e in self._epochs])
            k = np.maximum(np.searchsorted(starts, index, side="right") - 1, 0)
            s[:, BATCH] = index - np.array([e[1] for e in self._epochs])[k]
            s[:, EPOCH] = np.array([e[2] for e in self._epochs])[k]
        return s, m

    # ---- folding ------------------------------------------------------------------------------
    def fold(self) -> None:
        """Add the rows not yet folded to the running totals (and to an active trace)."""
        with self.lock:
            self._fold_locked()

    def try_fold(self) -> bool:
        """:meth:`fold` unless someone holds the lock (then nothing); whether it folded.

        A trace's writer thread folds its recorders this way, so that the loop's thread rarely
        reaches ``fold_at`` itself; it never waits for the lock (the loop may hold it while it
        waits for room in the trace's queue).
        """
        if not self.lock.acquire(blocking=False):
            return False
        try:
            self._fold_locked()
        finally:
            self.lock.release()
        return True

    def _fold_locked(self) -> None:
        lo, hi = self.folded, self.count
        self.fold_at = hi + FOLD_EVERY
        if hi <= lo:
            return
        lo = max(lo, hi - (ROWS - AHEAD_MARGIN))  # (rows older than that were overwritten: never, with FOLD_EVERY < ROWS)
        s, m = self._rows(lo, hi)
        if lo == 0:  # the first batch (warm-up: compiles, starts threads, faults the first pages in): reported apart
            t_enter, t_exit = int(s[0, T_ENTER]), int(s[0, T_EXIT])
            since = self.first_iter_ns if self.first_iter_ns is not None and self.first_iter_ns <= t_enter else t_enter
            self.first_batch_ns, self.first_next_ns = t_exit - since, t_exit - t_enter
            self.first_compile_ns = _compiles.overlap(since, t_exit)
            self._prev_exit, self._prev_epoch = int(s[0, T_EXIT]), int(s[0, EPOCH])
            self.first_enter = int(s[0, T_EXIT])
            s, m = s[1:], m[1:]
            if len(s) == 0:
                self.folded = hi
                return
        a = attribute(s, m)
        self.total_steps += len(s)
        self.stall_ns += int(a["stall"].sum())
        self.wait_ns += int(a["wait"].sum())
        self.waited += int((a["head_wait"] > 0).sum())
        if self.first_enter is None:
            self.first_enter = int(s[0, T_ENTER])
        self.last_exit = int(s[-1, T_EXIT])
        p_exit, p_epoch = self._prev_exit, self._prev_epoch
        prev_exit = np.concatenate(([self._prev_exit], s[:-1, T_EXIT]))
        prev_epoch = np.concatenate(([self._prev_epoch], s[:-1, EPOCH]))
        timed = (prev_epoch == s[:, EPOCH]) & (prev_exit > 0)
        self.step_ns += int((s[timed, T_ENTER] - prev_exit[timed]).sum())
        self.steps_timed += int(timed.sum())
        self._prev_exit, self._prev_epoch = int(s[-1, T_EXIT]), int(s[-1, EPOCH])
        for k, c in enumerate(self.producer):
            self._add(c.name, a["producer_stall"][:, k], m[:, MARK_FIXED + k])
        for k, c in enumerate(self.loop):
            self._add(c.name, s[:, STEP_FIXED + k], s[:, STEP_FIXED + k])
        self._add(HANDOVER, a["handover"], None)
        self._add(OVERHEAD, a["other"], None)
        self.folded = hi
        from stoker.observe import _trace

        if _trace.sessions_for(self):
            _trace.add_rows(self, s, m, p_exit, p_epoch)

    def _add(self, name: str, stall: np.ndarray, time: np.ndarray | None) -> None:
        self.comp_stall[name] = self.comp_stall.get(name, 0.0) + float(stall.sum())
        if time is not None:
            self.comp_time[name] = self.comp_time.get(name, 0.0) + float(time.sum())
            self.comp_items[name] = self.comp_items.get(name, 0) + len(time)

    def recent(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the step and mark rows of the last batches (at most ``ROWS - AHEAD_MARGIN``, never the first), oldest first."""
        with self.lock:
            hi = self.count
            lo = max(1, hi - (ROWS - AHEAD_MARGIN))  # (not the first step: reported apart)
            return self._rows(lo, hi)


def _aligned_rows(width: int) -> np.ndarray:
    """``ROWS`` rows of int64, each on cache lines of its own (64 bytes, or a multiple): producer threads write
    neighbouring rows at once, and a line shared by two would bounce between their cores."""
    cols = -(-width // 8) * 8
    buf = np.zeros(ROWS * cols + 8, dtype=np.int64)
    first = (-buf.ctypes.data % 64) // 8
    return buf[first : first + ROWS * cols].reshape(ROWS, cols)


def attribute(s: np.ndarray, m: np.ndarray) -> dict[str, np.ndarray]:
    """Where each step's stall went (rows of the step and mark rings; see the module's docstring) [ns]."""
    t_enter, t_ready, t_exit = s[:, T_ENTER], s[:, T_READY], s[:, T_EXIT]
    stall = np.maximum(t_exit - t_enter, 0)
    wait = np.clip(t_ready - t_enter, 0, stall)
    loop_side = s[:, STEP_FIXED:].sum(axis=1)
    t_done = m[:, M_DONE]
    # (a loop that made other batches while it waited saw this one late because it was busy: not a hand-over)
    handover = np.where((t_done > 0) & (s[:, BLOCKED] != 0), np.clip(t_ready - np.maximum(t_done, t_enter), 0, wait), 0)
    head_wait = wait - handover
    durations = m[:, MARK_FIXED:].astype(np.float64)
    total = durations.sum(axis=1)
    share = np.divide(head_wait, total, out=np.zeros(len(total)), where=total > 0)
    producer_stall = durations * share[:, None]
    unattributed = np.where(total > 0, 0, head_wait)
    other = np.maximum(stall - wait - loop_side, 0) + unattributed
    return {"stall": stall, "wait": wait, "handover": handover, "head_wait": head_wait, "producer_stall": producer_stall, "other": other}
