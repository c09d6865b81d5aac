"""The loop's fast hand-over: ``next()`` in the common case, with everything it needs bound once per epoch.

:class:`CompiledEpoch._next_slow <stoker.loader._engine.CompiledEpoch>` handles every
case (the first batch made by the loop, a batch not ready, a transfer to CUDA, extras,
the profiler, a held batch to report, the end, a failure). Most batches of an epoch are
none of these: compiled producers made the batch already, the loop takes it, frees the
slot of the batch ``producers * ahead`` later, stores the count of batches taken (and
wakes a producer only if one sleeps and is due: no system call otherwise), runs the
fields' tails (a tail of views only, ``Operation.view_only``, runs once per slot: its
tensor is kept by :meth:`FieldPipeline.keep_tail <stoker.loader._graph.FieldPipeline.keep_tail>`
and handed out again while nothing holds it) and writes the accounting row. :class:`Handover` does exactly that, with
the slot ring's arithmetic inline, a status read instead of a semaphore, and the accounting row as plain stores; whatever it does not handle it hands to the
slow path *before* it has changed anything, so that the slow path sees the state it
would have seen without it.

The ring's contract stays (see :mod:`stoker.loader._ring`): the slot of batch
``c + producers * ahead`` is checked (and renewed if a batch the user keeps still uses
it) before the count of batches taken lets its producer write there; ``KeyboardInterrupt``
between two statements leaves what an interrupt of the slow path leaves (the epoch
ends: :meth:`Epoch.__next__ <stoker.loader._epoch.Epoch>` closes it).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from stoker.loader import _ring
from stoker.observe._recorder import BLOCKED, MAKER, ROWS, T_ENTER, T_EXIT, T_READY
from stoker.pipeline import native

if TYPE_CHECKING:
    from stoker.loader._engine import CompiledEpoch
    from stoker.loader._ring import SlotRing

_DONE, _CONSUMED = _ring.DONE, _ring.CONSUMED


class _TailError(Exception):
    """Field ``field``'s tail raised ``error`` on a batch (kept until the loop reaches that batch when it ran ahead)."""

    def __init__(self, field: int, error: Exception) -> None:
        super().__init__(field, error)
        self.field, self.error = field, error


def applies(epoch: CompiledEpoch) -> bool:
    """Whether this epoch's common case may take the fast hand-over: compiled producers, native semaphores, no
    transfer, no extras, and every tail step a plain ``code(batch, dst)`` call (``ToTensor``, ``Squeeze``, ...)."""
    ring = epoch._ring
    return (
        epoch._plan.loop is not None
        and epoch._batches.compiled
        and epoch._xfer is None
        and not epoch._loader._extras
        and isinstance(ring.sems, native.Semaphores)
        and all(simple for *_, tail in epoch._tail_plan for _, _, _, simple, _, _ in tail)
    )


class Handover:
    """One epoch's fast ``next()`` (see the module): :meth:`next` hands over batch ``epoch.consumed`` or calls the
    slow path. Holds no reference to the epoch (the epoch is freed by its last reference, as after ``break``).

    Args:
        epoch: the epoch, its ring and producers started (read here once).
    """

    def __init__(self, epoch: CompiledEpoch) -> None:
        ring: SlotRing = epoch._ring
        loader = epoch._loader
        self.ring = ring
        self.loader = loader
        self.epoch_no = epoch.epoch
        self.skip, self.slot_base, self.num_slots = ring.skip, ring.slot_base, ring.num_slots
        self.producers, self.span = ring.producers, ring.producers * ring.ahead
        self.n_batches = ring.n_batches
        bs = loader.batch_size
        self.n_full = min(ring.n_batches, len(epoch._order) // bs)  # batches of batch_size samples (the last may be short)
        self.first = ring.skip if epoch._first_claimed else -1  # made by the loop's first next(): the slow path
        self.made_ahead = epoch._made_ahead  # (the same set: the slow path adds to it)
        self.held = loader._held
        self.forgiven = ring._forgiven
        self.pipelines = list(ring.pipelines)
        self.status = ring.status.data  # (a memoryview: ~60 ns a read)
        self.ctl = ring.ctl_view
        self.strong = _ring._STRONG_ORDER
        self.sleepers = [(t, _ring.SLEEPING(t), _ring.WAKE_AT(t)) for t in range(ring.producers)]
        self.post = native._libc().sem_post
        self.token_at = [ring.sems.address(t) for t in range(ring.producers)]
        self.heads = epoch._batches.outputs  # (compiled producers leave it empty)
        # per field: (pipeline, where its head's output is, its tail seconds, [(step, code, name, column)], and for a
        # tail of views only, made once per slot (see FieldPipeline.keep_tail), its accounting columns, else None)
        self.tails = [(p, out_step, seconds, [(j, code, name, col) for j, code, name, _, _, col in tail],
                       [col for *_, col in tail] if tail and all(step.op.view_only for *_, step, _ in tail) else None)
                      for _, p, out_step, seconds, tail in epoch._tail_plan]  # fmt: skip
        self.rec = epoch._rec
        self.rec_base = epoch._rec_base
        self.prof = epoch._prof
        self.named = loader.named
        self.names = loader.output_names if loader.named else None
        self.hits = 0  # batches handed over here (tests, benchmarks)

    def next(self, epoch: CompiledEpoch) -> tuple[Any, ...] | dict[str, Any]:
        """Hand over batch ``epoch.consumed`` (the epoch's ``_next_batch``)."""
        clock = time.perf_counter_ns
        t_enter = clock()
        prof = self.prof
        ring = self.ring
        c = epoch.consumed
        if (
            ring.end is not None
            or c >= self.n_full
            or c == self.first
            or (prof is not None and prof._is_profiler_enabled)
            or (self.made_ahead and c in self.made_ahead)
        ):
            return epoch._next_slow()
        loader = self.loader
        if self.held[0] and not loader._warned_held:  # first, before anything changes (as the slow path does)
            loader._note_held()
        if self.status[c] != _DONE:  # not made yet, or failed: the slow path claims, makes, waits or fails
            return epoch._next_slow()
        epoch._loop_thread = threading.get_ident()
        skip = self.skip
        t = (c - skip) % self.producers
        rec = self.rec
        num_slots = self.num_slots
        slot = (self.slot_base + c - skip) % num_slots
        heads = self.heads.pop(c, None) if self.heads else None
        # the token: the slot of batch c + producers * ahead is checked (renewed if still held) before its producer
        # may write there
        nxt = c + self.span
        if nxt < self.n_batches:
            if self.forgiven:
                ring.free_slot(nxt)
            else:
                nslot = (self.slot_base + nxt - skip) % num_slots
                for p in self.pipelines:
                    if p.slot_in_use(nslot):
                        ring.free_slot(nxt)
                        break
        # CONSUMED = c + 1, then a wake for each producer asleep and due (see stoker.loader._ring)
        if self.strong:
            ctl = self.ctl
            ctl[_CONSUMED] = c + 1
            for t_, sleeping, wake_at in self.sleepers:
                if ctl[sleeping] and c + 1 >= ctl[wake_at]:
                    ctl[sleeping] = 0
                    self.post(self.token_at[t_])
        else:  # pragma: no cover - x86-64 here
            ring.publish(c + 1)
        # the tails, each step's time in its accounting column
        sv = rec.step_view if rec is not None else None
        off = ((self.rec_base + c) % ROWS) * rec.width if rec is not None else 0
        outputs = []
        i = 0
        try:
            for p, out_step, seconds, steps, folded in self.tails:
                if folded is not None and heads is None:  # a tail of views: its output made once for the slot
                    e = p._tail_cache[slot]
                    if e is not None and e.out_step == out_step:
                        outputs.append(e.out)
                        if sv is not None:  # (no step ran: the row's columns of the tail say 0)
                            for col in folded:
                                sv[off + col] = 0
                        i += 1
                        continue
                    e = None  # (another step's output: dropped by keep_tail below, held by no frame)
                views = p._views[slot]
                out = views[out_step] if heads is None else heads[i]
                if steps:
                    t1 = clock()
                    for j, code, name, col in steps:
                        out = code(out, views[j])
                        t2 = clock()
                        seconds[name] += (t2 - t1) * 1e-9
                        if sv is not None:
                            sv[off + col] = t2 - t1
                        t1 = t2
                if folded is not None and heads is None:  # kept for the slot's next full batches (if a view of it)
                    box = [out]
                    del out
                    out = p.keep_tail(slot, out_step, box)
                outputs.append(out)
                i += 1
        except Exception as exc:
            return epoch._tail_failed(c, slot, _TailError(i, exc))  # type: ignore[no-any-return]
        epoch.consumed = c + 1
        loader._position = (self.epoch_no, c + 1)
        loader._last_slots = (loader._last_slots[-1], slot)
        self.hits += 1
        if rec is not None:  # the step's row (as the slow path writes it)
            sv[off + T_ENTER] = t_enter  # type: ignore[index]
            sv[off + T_READY] = t_enter  # type: ignore[index]  # (ready when next() was called)
            sv[off + T_EXIT] = clock()  # type: ignore[index]
            sv[off + MAKER] = t  # type: ignore[index]
            sv[off + BLOCKED] = 0  # type: ignore[index]
            rec.count += 1
            if rec.count >= rec.fold_at:
                rec.fold()
        if self.named:
            return dict(zip(self.names, outputs))  # type: ignore[arg-type]
        return tuple(outputs)
