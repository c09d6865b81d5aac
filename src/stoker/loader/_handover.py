"""The loop's fast hand-over: ``next()`` in the common case, in one Python frame, everything it needs bound once per epoch.

:class:`CompiledEpoch._next_slow <stoker.loader._engine.CompiledEpoch>` handles every
case (the first batch made by the loop, a batch not ready, a transfer to CUDA, extras,
the profiler, a held batch to report, the end, a failure). Most batches of an epoch are
none of these: compiled producers made the batch already, the loop takes it, frees the
slot of the batch ``producers * ahead`` later, stores the count of batches taken (and
wakes a producer only if one sleeps and is due: no system call otherwise), runs the
fields' tails (a tail of views only, ``Operation.view_only``, runs once per slot: its
tensor is kept by :meth:`FieldPipeline.keep_tail <stoker.loader._graph.FieldPipeline.keep_tail>`
and handed out again while nothing holds it) and writes the accounting row.
:func:`next_batch`, the epoch's ``__next__`` itself, does exactly that, reading what
:class:`Handover` bound for the epoch: the slot ring's arithmetic inline, a status read
instead of a semaphore, one token popped from a list instead of a lock for one ``next()``
at a time, one Python call per field to check the slot it frees
(:meth:`FieldPipeline.slot_in_use <stoker.loader._graph.FieldPipeline.slot_in_use>`), and
the accounting row in one store. Whatever it does not handle it hands to the general
``next()`` (:meth:`Epoch.__next__ <stoker.loader._epoch.Epoch>`, then the slow path)
*before* it has changed anything, so that the slow path sees the state it would have
seen without it.

The ring's contract stays (see :mod:`stoker.loader._ring`): the slot of batch
``c + producers * ahead`` is checked (and renewed if a batch the user keeps still uses
it) before the count of batches taken lets its producer write there; ``KeyboardInterrupt``
between two statements leaves what an interrupt of the slow path leaves (the epoch
ends: the epoch is closed, as :meth:`Epoch.__next__ <stoker.loader._epoch.Epoch>` closes it).
"""

from __future__ import annotations

import struct
import threading
import time
from typing import TYPE_CHECKING, Any

from stoker.errors import StokerError
from stoker.loader import _ring
from stoker.loader._epoch import _FORK_GEN, TWO_THREADS, Epoch, _compiles
from stoker.observe._recorder import LOOP_MADE, MAKER, ROWS, T_ENTER, T_EXIT, T_READY
from stoker.pipeline import native

if TYPE_CHECKING:
    from stoker.loader._engine import CompiledEpoch
    from stoker.loader._ring import SlotRing

_DONE, _PENDING, _CONSUMED = _ring.DONE, _ring.PENDING, _ring.CONSUMED

#: how long ``next()`` waits here for a batch a running producer is about to finish before it takes the slow path
#: (which makes the batch itself or sleeps: ~8-20 us a batch in Python against a producer's ~2 us) [ns]; not at all
#: where the loop's own last batch took longer (``RingMemory.loop_batch_ns``): a batch that long is rarely done within
#: the spin, and the slow path makes another one meanwhile (Otto's ~40 us batches spun 10 us for nothing each time)
LOOP_SPIN_NS = 10_000


class _TailError(Exception):
    """Field ``field``'s tail raised ``error`` on a batch (kept until the loop reaches that batch when it ran ahead)."""

    def __init__(self, field: int, error: Exception) -> None:
        super().__init__(field, error)
        self.field, self.error = field, error


def _row_struct(width: int) -> struct.Struct:
    """A step row of ``width`` columns in one store: ``T_ENTER, T_READY, T_EXIT, MAKER`` (the ring's first four
    columns), then zero in every other column (``pack_into`` clears the pad bytes)."""
    fixed = (T_ENTER, T_READY, T_EXIT, MAKER)
    if fixed != tuple(range(len(fixed))):  # pragma: no cover - the recorder's layout (observe._recorder)
        raise AssertionError(f"the step row's first columns moved: {fixed}")
    return struct.Struct("<" + "q" * len(fixed) + "x" * (8 * max(0, width - len(fixed))))


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
    """What one epoch's fast ``next()`` (:func:`next_batch`, see the module) reads, bound once per epoch. Holds no
    reference to the epoch (the epoch is freed by its last reference, as after ``break``).

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
        self.slot_shift = ring.slot_base - ring.skip  # batch b is in slot (b + slot_shift) % num_slots (as ring.slot)
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
        self.memory = ring.memory  # (its loop_batch_ns: the loop's last batch's time, see LOOP_SPIN_NS)
        # per field: (pipeline, where its head's output is, its tail seconds, [(step, code, name, column)], and whether
        # it is a tail of views only, made once per slot: see FieldPipeline.keep_tail)
        self.tails = [(p, out_step, seconds, [(j, code, name, col) for j, code, name, _, _, col in tail],
                       bool(tail) and all(step.op.view_only for *_, step, _ in tail))
                      for _, p, out_step, seconds, tail in epoch._tail_plan]  # fmt: skip
        rec = self.rec = epoch._rec
        self.rec_base = epoch._rec_base
        # the accounting's step rows (their layout is set for the epoch before it starts: _accounting.start_epoch)
        self.width = rec.width if rec is not None else 0
        self.row = _row_struct(self.width)
        self.prof = epoch._prof
        self.named = loader.named
        self.names = loader.output_names if loader.named else None
        self.hits = 0  # batches handed over here (tests, benchmarks)
        #: whether a producer has handed a batch over here this epoch (it runs: worth waiting a few microseconds for
        #: the next one; before that, at the epoch's start, the loop makes a batch not made yet itself at once)
        self.running = False
        self.spins = 0  # batches waited for here, by spinning (tests, benchmarks)


class _Slow(Exception):
    """Raised inside :func:`next_batch` before anything changed: the batch goes to the general ``next()``."""


def next_batch(epoch: CompiledEpoch) -> tuple[Any, ...] | dict[str, Any]:
    """``CompiledEpoch.__next__``: hand over batch ``epoch.consumed``, the common case in this one frame (see the module).

    Whatever it does not handle, it hands, before anything changed, to :meth:`Epoch.__next__
    <stoker.loader._epoch.Epoch>` (the general ``next()``: the fork and two-thread checks, the compile watch, the
    slow path); it keeps that method's contract: one ``next()`` at a time (the epoch's token), an error propagates
    as itself, ``KeyboardInterrupt`` (or ``SystemExit``) ends the epoch and leaves as itself.
    """
    h = epoch._fast
    if h is None or epoch._pid != _FORK_GEN[0] or epoch._interrupted is not None:
        return Epoch.__next__(epoch)
    clock = time.perf_counter_ns
    t_enter = clock()
    busy = epoch._busy
    try:
        busy.pop()  # (the token: see busy_token)
    except IndexError:
        raise StokerError(TWO_THREADS) from None
    compiled = -1  # the compilations counted in this thread before a tail step ran (-1: none ran)
    try:
        ring = h.ring
        c = epoch.consumed
        prof = h.prof
        loader = h.loader
        if (
            ring.end is not None
            or c >= h.n_full
            or c == h.first
            or (prof is not None and prof._is_profiler_enabled)
            or h.heads  # (compiled producers leave every head's output in its slot: none here)
        ):
            raise _Slow
        if h.held[0] and not loader._warned_held:  # first, before anything changes (as the slow path does)
            loader._note_held()
        status = h.status
        if status[c] != _DONE:  # not made yet, or failed: the slow path claims, makes, waits or fails
            if not h.running or status[c] != _PENDING or h.memory.loop_batch_ns > LOOP_SPIN_NS:
                raise _Slow
            # a running producer a little behind the loop: a few microseconds' wait here, not the slow path's
            deadline = t_enter + LOOP_SPIN_NS
            while status[c] == _PENDING and clock() < deadline:
                pass
            if status[c] != _DONE:
                raise _Slow
            h.spins += 1
        made_ahead = h.made_ahead
        if made_ahead and c in made_ahead:  # made by the loop while it waited, or with the epoch's first batches
            made_ahead.discard(c)
            maker = LOOP_MADE
        else:
            maker = (c - h.skip) % h.producers
            h.running = True
        tid = epoch._loop_thread = threading.get_ident()
        num_slots = h.num_slots
        slot = (c + h.slot_shift) % num_slots
        # the token: the slot of batch c + producers * ahead is checked (renewed if still held) before its producer
        # may write there
        c1 = c + 1
        nxt = c + h.span
        if nxt < h.n_batches:
            if h.forgiven:
                ring.free_slot(nxt)
            else:
                nslot = (nxt + h.slot_shift) % num_slots
                for p in h.pipelines:
                    if p.slot_in_use(nslot):
                        ring.free_slot(nxt)
                        break
        # CONSUMED = c + 1, then a wake for each producer asleep and due (see stoker.loader._ring)
        if h.strong:
            ctl = h.ctl
            ctl[_CONSUMED] = c1
            for t_, sleeping, wake_at in h.sleepers:
                if ctl[sleeping] and c1 >= ctl[wake_at]:
                    ctl[sleeping] = 0
                    h.post(h.token_at[t_])
        else:  # pragma: no cover - x86-64 here
            ring.publish(c1)
        # the tails (a tail of views: its output made once for the slot, no step run), each step's time kept for the row
        outputs = []
        timed = None
        try:
            for p, out_step, seconds, steps, views_only in h.tails:
                if views_only:
                    e = p._tail_cache[slot]
                    if e is not None and e.out_step == out_step:
                        outputs.append(e.out)
                        continue
                    e = None  # (another step's output: dropped by keep_tail below, held by no frame)
                views = p._views[slot]
                out = views[out_step]
                if steps:
                    if compiled < 0:
                        compiled = _compiles.get(tid, 0)
                        timed = []
                    t1 = clock()
                    for j, code, name, col in steps:
                        out = code(out, views[j])
                        t2 = clock()
                        seconds[name] += (t2 - t1) * 1e-9
                        timed.append((col, t2 - t1))  # type: ignore[union-attr]
                        t1 = t2
                if views_only:  # kept for the slot's next full batches (if a view of it)
                    box = [out]
                    del out
                    out = p.keep_tail(slot, out_step, box)
                outputs.append(out)
        except Exception as exc:
            return epoch._tail_failed(c, slot, _TailError(len(outputs), exc))  # type: ignore[no-any-return]
        epoch.consumed = c1
        loader._position = (h.epoch_no, c1)
        loader._last_slots = (loader._last_slots[-1], slot)
        h.hits += 1
        rec = h.rec
        if rec is not None:  # the step's row (as the slow path writes it), in one store (see _row_struct)
            sv = rec.step_view
            off = ((h.rec_base + c) % ROWS) * h.width
            h.row.pack_into(sv, off * 8, t_enter, t_enter, clock(), maker)
            if timed is not None:  # (the tail steps that ran: their columns)
                for col, ns in timed:
                    sv[off + col] = ns
            rec.count += 1
            if rec.count >= rec.fold_at:
                rec.fold()
        if h.named:
            return dict(zip(h.names, outputs))  # type: ignore[arg-type]
        return tuple(outputs)
    except _Slow:
        pass
    except Exception:
        raise
    except BaseException as exc:  # KeyboardInterrupt, SystemExit: the user's, anywhere in the hand-over; the epoch ends
        epoch._interrupted = type(exc).__name__
        epoch.close()
        raise
    finally:
        busy.append(True)
        if compiled >= 0 and _compiles.get(tid, 0) != compiled:  # a compile's garbage may hold the epoch (compiles_here)
            loader._compile_garbage = True
    return Epoch.__next__(epoch)
