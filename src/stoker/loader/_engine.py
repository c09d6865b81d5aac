"""The Loader's one epoch engine: producers make each batch's compiled part into slots; the loop runs the rest.

Every field's pipeline splits in two (:attr:`FieldPipeline.head`):

* the **head**, its leading compiled steps (decoder, crops, flips and other
  random augmentations, with seeds from (seed, epoch, position)), run by
  producer threads into batch slots, with no GIL and no Python between batches;
* the **tail**, the steps that are Python (``ToTensor``, ``ToDevice``,
  ``Squeeze``, ``ToTorchImage``, ``Convert``, torch modules, callables), run by
  the loop's own thread once per batch as it hands the batch over: they wrap or
  view memory (microseconds a batch). A loader that copies to CUDA runs each
  batch's tail as soon as the batch is made instead (:meth:`CompiledEpoch._look_ahead`,
  inside ``next()`` for an earlier batch), on its transfer's stream
  (:class:`~stoker.device._stream.StreamTransfer`): the copy is queued ahead of
  the user's step, and handed over with the slot's event.

Producers come in two kinds, both following the slot ring's protocol
(:mod:`stoker.loader._ring`); :func:`~stoker.loader._planner.plan` chooses,
once per loader (again after a rebuild or a change of its slot count):

* **compiled**, for a memory-mapped dataset (``os_cache=True``, on Linux) whose
  every field's head compiles: each producer makes its share of the epoch's
  batches in one ``nogil`` call of a generated loop
  (:func:`stoker.loader._planner._source`), waiting and signalling as the ring's
  protocol says. Fields whose heads share one compiled function (a wide table's
  scalar columns) are made by one call site in a loop over the group, so the
  loop's compile time grows with the distinct pipelines, not with the fields;
* **Python**, one call per batch, wherever the head cannot run whole-epoch:
  always for ``os_cache=False`` and so for every dataset in object storage and
  every mix that holds one (the bounded cache acquires and releases each batch's
  bytes); and for lazily validated metadata (checked per batch before compiled
  code reads it), numba's workqueue layer, operations run as Python
  (``compile=False``), a head whose memory is not plain numpy, or a loop that
  did not compile (``STOKER_COMPILED_EPOCH=0`` forces it).

When the batch the loop needs is not ready and no producer has started it, and
every operation is reentrant, the loop makes it itself
(:meth:`CompiledEpoch._make_here`): the first batch of every epoch, and later
batches while it waits (:meth:`CompiledEpoch._work_while_waiting`).

With compiled producers, the next epoch's ``RANDOM`` order (when small enough:
``order.PREPARED_ORDER_MAX``) is shuffled by producer 0, a piece with each of
its batches and while it waits; otherwise each epoch's order is made when it
starts (:mod:`stoker.loader._share`). Producer 0 then makes the next epoch's
first batch (:class:`~stoker.loader._producers.Ahead`): once the loop has taken
all but the last ``producers * ahead`` batches, it waits for the token of the
slot after the epoch's last one (the slot the next epoch gives its first batch),
checks it as every slot is checked (a batch the user keeps is never written
over) and makes the batch there, with the next epoch's seeds. The next
``iter()`` hands it over instead of making it, if the epoch before was handed
out to its end and nothing it depends on changed since (``set_epoch``,
``load_state_dict``, ``expect_held``, a rebuild, ``close()``: see
:meth:`Ahead.fits <stoker.loader._producers.Ahead.fits>`); else it is dropped
and the first batch is made as before. Same seed, same batches, whichever.

Where each part lives: planning and code generation in :mod:`stoker.loader._planner` (:func:`plan`,
:func:`_source`), the producers' jobs in :mod:`stoker.loader._producers` (:class:`_Batches`, :class:`_Job`), the
consumer loop here (:class:`CompiledEpoch`, its common case's ``next()`` in :mod:`stoker.loader._handover`), the
slot ring in :mod:`stoker.loader._ring`. The loop reads the Loader it is given as a
:class:`~stoker.loader._view.LoaderView`; the epoch is started by :mod:`stoker.loader._iteration`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
import time
from collections import defaultdict
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np

from stoker._threads import available_cpus, interrupts_blocked
from stoker.device._stream import issuing
from stoker.errors import LoaderError, StokerError
from stoker.loader import _accounting, _tuning
from stoker.loader._epoch import Epoch, _layer_is_workqueue, busy_token, fork_generation
from stoker.loader._graph import FieldPipeline
from stoker.loader._handover import Handover, _TailError, applies, next_batch
from stoker.loader._planner import (
    Group,
    Plan,
    python_plan,
)
from stoker.loader._producers import NO_SHUFFLE, Ahead, _Batches, _Job, producers_beside_loop
from stoker.loader._ring import DONE, FAILED, FALLBACK, LOOP_CLAIM, PENDING, End, RingMemory, SlotRing
from stoker.loader.distributed import samples_per_rank
from stoker.observe import _trace
from stoker.observe._recorder import BLOCKED, LOOP_MADE, MAKER, ROWS, STEP_FIXED, T_ENTER, T_EXIT, T_READY
from stoker.pipeline import warm

if TYPE_CHECKING:
    from stoker.loader._epoch import _Producers
    from stoker.loader._view import LoaderView
    from stoker.loader.order import PreparedOrder


#: when the batch the loop needs is not ready and no producer has started it, the loop makes it itself (tests turn it off)
MAKE_WHEN_WAITING = True

#: producer 0 makes the next epoch's first batch once the epoch has none left for it (:class:`Ahead`; tests turn it off)
MAKE_FIRST_AHEAD = True

#: at an epoch's start, the loop makes the batch it needs and the next ones no producer has started in one compiled
#: call (:meth:`CompiledEpoch._make_run`) for about this long at most (the batch it needs is handed over after): about
#: as long as a producer takes to start here (its thread's wake-up and its Python, while the call leaves the GIL free);
#: Otto, the same processes: 100 us 0.99x-1.04x the compiled one-thread gather, 500 us 1.09x-1.14x [ns]
MAKE_RUN_NS = 500_000

#: when the batch the loop needs is being made by a producer, the loop makes later batches no producer has started,
#: in one compiled call, for about this long by its last batch's time (:meth:`CompiledEpoch._work_while_waiting`;
#: batches that take longer: one to a call, as before): a call costs the loop ~100 us of Python around it, slow
#: right after a run of batches has filled the CPU's caches (Otto's ~45 us batches one to a call: 0.92x-1.02x the
#: compiled one-thread gather; in runs of this bound 1.05x-1.14x, each pair in the same process) [ns]
WAIT_RUN_NS = 250_000

#: an epoch made by Python producers while its producer loop compiles in the background asks whether the compilation
#: has ended (a ``waitpid``) at a batch boundary at most this often [ns]; once it has, it goes over to the loop there
SWITCH_LOOK_NS = 50_000_000

logger = logging.getLogger("stoker")


def _cpus() -> int:
    """The CPUs this process may run on (tests pin it)."""
    return available_cpus()


class CompiledEpoch(Epoch):
    """The loop's side of an epoch: takes each batch from the ring in order and runs the fields' tails on it."""

    #: the common case in one frame (the fast hand-over, :mod:`stoker.loader._handover`); every other case goes on to
    #: :meth:`Epoch.__next__ <stoker.loader._epoch.Epoch>`, then :meth:`_next_slow`
    __next__ = next_batch

    def __init__(self, loader: LoaderView, plan_: Plan, epoch: int, skip: int, slot_base: int, pool: _Producers) -> None:
        self._started_ns = time.perf_counter_ns()  # (iter(): the switch to a loop compiled meanwhile is said from here)
        self._look_at = 0  # when the loop next asks whether the producer loop compiled in the background is done
        self.epoch = epoch
        self.consumed = skip
        self.finished = False
        self._loader = loader  # keeps the loader (and its memory) alive while the epoch runs
        self._busy = busy_token()
        self._pid = fork_generation()  # (compared per batch: no system call)
        self._loop_thread: int | None = None
        self._wait = loader.wait_seconds
        self._pipelines = loader.pipelines
        # CUDA (pipelines ending in ToDevice('cuda')): the loader's transfer; with `ahead`, each batch's tails (its copy
        # among them) run as soon as the batch is made, in next() calls for earlier batches (see _look_ahead)
        self._xfer = loader._transfer
        self._ahead = self._xfer is not None and self._xfer.ahead
        self._pool = pool
        self._own_error: BaseException | None = None
        order, runs = loader._epoch_share(epoch, prepared=True)
        self._order = np.ascontiguousarray(order)
        self._runs = runs
        self._n_batches = -(-len(order) // loader.batch_size)
        self._forgiven = frozenset(s for s in loader._last_slots if s is not None)
        # per-step accounting (stoker.observe): batch c's rows are at (self._rec_base + c) % ROWS
        rec = self._rec = loader._recorder
        self._rec_base = _accounting.start_epoch(loader, rec, epoch, skip, len(pool)) if rec is not None else 0
        self._sv = rec.step_view if rec is not None else None
        self._row_off = 0
        self._prof = _trace.profiler()  # torch.autograd.profiler: next() is a span while it records
        self._profiling = False
        self._tuned: _tuning.Choice | None = None  # this epoch's producers and batches ahead (chosen by the first _begin)
        self._begin(plan_, skip, slot_base)

    def _begin(self, plan_: Plan, skip: int, slot_base: int) -> None:
        """Start the producers for batches ``skip ...`` (slot ``slot_base`` first) with ``plan_``."""
        loader, pool = self._loader, self._pool
        self._plan = plan_
        compiled = plan_.loop is not None
        # per field: where its head's output is, where its tail's seconds go, and each tail step (``simple``: called as
        # ``code(batch, dst)``, no indices or seeds; its column in the accounting's step ring)
        columns = itertools.count(STEP_FIXED)
        self._tail_plan = [
            (i, p, plan_.outputs[i] if compiled else 0, loader._loop_seconds[p.name],
             [(j, p.steps[j].code, p.steps[j].name, p.steps[j].arity <= 2 and not p.steps[j].uses_seeds and not p.steps[j].is_decoder,
               p.steps[j], next(columns)) for j in range(p.head, len(p.steps))])
            for i, p in enumerate(self._pipelines)
        ]  # fmt: skip
        # per field: whether its tail is of views only (its output kept per slot: FieldPipeline.keep_tail)
        self._views_only = [bool(tail) and all(step.op.view_only for *_, step, _ in tail) for *_, tail in self._tail_plan]
        nxt = loader._prepare_order(self.epoch + 1) if compiled else None
        # only reentrant operations may run on two batches at once (a JPEG decoder keeps a handle per thread of a batch)
        self._make_when_waiting = MAKE_WHEN_WAITING and loader._reentrant and not _layer_is_workqueue()
        first_begin = self._tuned is None  # (not a restart inside the epoch)
        if self._tuned is None:  # producers and batches ahead: chosen once per epoch, within what the user set (_tuning)
            most = producers_beside_loop(loader.num_workers, len(pool), self._make_when_waiting, _cpus())
            limits = _tuning.Limits(most, loader._tokens_per_producer * len(pool) // most * most,
                                    self._make_when_waiting and self._xfer is None and loader.remote is None)  # fmt: skip
            self._tuned = loader._tuner.epoch_start(self.epoch, limits, self._rec)
        running, ahead = self._tuned.producers, self._tuned.ahead
        producers = max(1, running)  # the ring's (none running: the loop claims and makes every batch itself)
        memory = loader._ring_memory
        if memory is None or not memory.fits(loader._num_slots, plan_.width, len(pool)):
            memory = loader._ring_memory = RingMemory(loader._num_slots, plan_.width, len(pool))
        made, memory.ahead = memory.ahead, None  # this epoch's first batch, made ahead by the epoch before (or None)
        xfer = self._xfer
        rec = self._rec
        # CUDA, accounting on: the loop-side times of everything next() does (the tails of the batches it issues, its
        # waits for the GPU) add up here, and go to the row of the batch handed over
        self._acc: list[int] | None = [0] * rec.width if rec is not None and xfer is not None else None
        self._dev_col = next(columns) if xfer is not None else 0  # the accounting's column of the loop's waits for the GPU
        self._issued: dict[int, Any] = {}  # batch -> its tails' outputs (or _TailError), run ahead on the transfer's stream
        self._ready_seen: set[int] = set()  # batches whose ready signal the loop took while looking ahead
        self._next_issue = skip  # the first batch not yet issued ahead
        setter = functools.partial(_set_addresses, memory.addresses, plan_.groups, self._pipelines) if compiled else None
        ring = SlotRing(memory, self._pipelines, setter, self._n_batches, skip, slot_base, producers, ahead, loader._held,
                        self._forgiven, before_free=functools.partial(_reuse_slot, xfer, self._acc, self._dev_col) if xfer else None,
                        after_free=xfer.release if xfer is not None else None)  # fmt: skip
        if self._acc is not None:  # (the waits of the epoch's start are not a step's)
            self._acc[self._dev_col] = 0
        self._ring = ring
        s = self._batches = _Batches(loader, plan_, self._order, self._runs, self.epoch, ring)
        s.mark_base = self._rec_base
        # Python producers while the producer loop compiles in the background: the loop goes over to it once it is done
        self._may_switch = not s.compiled and plan_.loop is not None and (plan_.background is not None or plan_.ready_at is not None)
        schedule = getattr(loader.reader, "schedule", None)  # a dataset in object storage: download its shards in this order
        if schedule is not None:
            schedule(self._order, loader.batch_size, skip)
        self._loop_spent = np.zeros(1 + len(self._pipelines), dtype=np.int64)
        self._loop_seeds = s.seeds_buffer() if compiled else None
        self._made_ahead: set[int] = set()  # batches after the one being waited for, made by the loop meanwhile
        # the first batch: made by the loop's first next() (producers skip it), so the first batch does not wait for
        # a producer to wake up
        self._first_claimed = self._make_when_waiting and skip < self._n_batches and ring.claim(skip)
        # or made already, by the epoch before's producer 0 (Ahead), if nothing it depends on changed: handed over as it is
        self._first_ready = bool(first_begin and self._first_claimed and made is not None
                                 and made.fits(self.epoch, skip, ring.slot(skip), plan_, pool, self._order, self._runs, loader))  # fmt: skip
        self._first_ready_at_start = int(self._first_ready)  # (tests: whether this epoch began with a batch made ahead)
        if self._first_ready:
            ring.status[skip] = DONE
            if made.marks is not None:  # its row of the accounting: the loop's columns (start, done, read, heads) come
                row = s.marks[(s.mark_base + skip) % len(s.marks)]  # first (the recorder's row may have more)
                n = min(len(row), len(made.marks))
                row[:n] = made.marks[:n]
            memory.firsts_ahead += 1
        del made
        # the next epoch's first batch, made by producer 0 once this epoch has no batch left for it (see Ahead)
        memory.ahead = nxt_first = self._ahead_first(plan_, s, nxt, running, pool)
        # what the common case's next() reads, bound once per epoch (None: every batch takes the slow path)
        self._fast = Handover(self) if applies(self) else None
        pool.current = ring  # (stopped by the next epoch, close() or exit if this one is dropped without close(): see _Producers)
        threads_each = max(1, loader.num_workers // len(pool))  # the threads of each producer's operations (see plan())
        jobs = []
        for t in range(running):
            shuffle = (nxt.values, nxt.key, nxt.state, nxt.source) if (t == 0 and nxt is not None) else NO_SHUFFLE
            jobs.append((t, _Job(s, t, threads_each, loader._producer_seconds[t], loader._producer_wait[t], shuffle,
                                 nxt_first if t == 0 else None)))  # type: ignore[arg-type]  # fmt: skip
        # with the first batch claimed by the loop, the producers start as the first next() returns it: woken here,
        # each one takes the GIL for its Python start (~0.1 ms; ms on a busy machine) at the loop's first release of
        # it (a ctypes call, the loop's nogil batch), between iter() and the first batch
        self._jobs: list[tuple[int, _Job]] | None = jobs
        if not self._first_claimed or self._xfer is not None:  # (CUDA: as before)
            self._submit_jobs()

    def _ahead_first(self, plan_: Plan, s: _Batches, nxt: PreparedOrder | None, running: int, pool: _Producers) -> Ahead | None:
        """What producer 0 needs to make the next epoch's first batch ahead (:class:`Ahead`), or ``None`` where it cannot
        or should not: a compiled epoch whose first batch the loop would make (reentrant operations), no transfer to
        CUDA, one rank, the next epoch's order prepared (``RANDOM``, small enough, not a mix), no elastic resume into
        it, and a loop that steps between batches (``Choice.first_ahead``: see :mod:`stoker.loader._tuning`)."""
        loader = self._loader
        if (
            not MAKE_FIRST_AHEAD
            or nxt is None
            or running < 1
            or (self._tuned is not None and not self._tuned.first_ahead)
            or not s.compiled
            or not self._make_when_waiting
            or self._xfer is not None
            or loader.world_size != 1
            or (loader._seen is not None and loader._seen[0] == self.epoch + 1)
        ):
            return None
        k = samples_per_rank(len(nxt.values), 1, loader.batch_size, loader.drop_last)
        if k <= 0:
            return None
        view = SimpleNamespace(batch_size=loader.batch_size, pipelines=loader.pipelines, seed=loader.seed, reader=loader.reader,
                               _data_check=loader._data_check, _data_covered=loader._data_covered, os_cache=loader.os_cache,
                               _recorder=None)  # fmt: skip
        return Ahead(view, plan_, nxt.values[:k], self.epoch + 1, self._ring, pool)

    def _submit_jobs(self) -> None:
        """Start the producers of the epoch (once; none if it has ended meanwhile)."""
        jobs, self._jobs = self._jobs, None
        if jobs and self._ring.end is None:
            for t, job in jobs:
                self._pool.submit(t, job)

    # ---- the loop's side ---------------------------------------------------------------------
    def _next_batch(self) -> tuple[Any, ...] | dict[str, Any]:
        # (the fast hand-over is __next__ itself: what reaches here, or starts again after a restart, is the slow path's)
        return self._next_slow()

    def _next_slow(self) -> tuple[Any, ...] | dict[str, Any]:
        """Every case of ``next()``: the first batch, a batch not ready, CUDA, extras, the profiler, the end."""
        t_enter = time.perf_counter_ns()
        prof = self._prof
        if prof is not None and prof._is_profiler_enabled and not self._profiling:
            return self._next_profiled()
        self._loop_thread = threading.get_ident()
        loader = self._loader
        if loader._held[0]:  # first, before anything changes: a warning turned into an error loses no batch
            loader._note_held()
        ring = self._ring
        if ring.end is not None:
            return self._ended()
        c = self.consumed
        if c >= self._n_batches:
            ring.set_end(End("exhausted"))
            return self._ended()
        if self._may_switch and t_enter >= self._look_at and self._switch(c, t_enter):
            return self._next_batch()
        t = maker = ring.producer_of(c)
        blocked = 0
        if c == ring.skip and self._first_ready:  # made ahead by the epoch before's producer 0 (see Ahead)
            self._first_ready = False
            maker = 0
        elif c == ring.skip and self._first_claimed:  # claimed at the start: no producer makes it
            try:
                self._make_here(c)
            except BaseException:
                self._submit_jobs()
                raise
            maker = LOOP_MADE
        elif c in self._made_ahead:  # made here while the loop waited for an earlier batch
            self._made_ahead.discard(c)
            maker = LOOP_MADE
        elif c in self._ready_seen:  # its ready signal was taken while the loop looked ahead (CUDA)
            self._ready_seen.discard(c)
        elif not ring.try_ready(c):
            if self._make_when_waiting and ring.claim(c):  # no producer has started it: make it here rather than sleep
                if self._fast is not None and not self._fast.running and self._batches.cache is None:
                    self._make_run(c)  # (the epoch's start: no producer has handed a batch over yet)
                else:
                    self._make_here(c)
                maker = LOOP_MADE
            elif not (self._make_when_waiting and self._work_while_waiting(c, t)):
                t0 = time.perf_counter()
                ring.wait_ready(c)
                self._wait["consumer_waiting_for_producer"] += time.perf_counter() - t0
                blocked = 1
        if ring.end is not None:  # closed (from another thread) while the loop waited
            return self._ended()
        status = int(ring.status[c])
        if status != DONE:
            return self._not_made(c, t, status)
        rec = self._rec
        if rec is not None:
            t_ready = time.perf_counter_ns()
            self._row_off = off = ((self._rec_base + c) % ROWS) * rec.width
        slot = ring.slot(c)
        if self._ahead:
            ring.give_token(c)
            outputs = self._issued.pop(c, None)
            if outputs is None:
                outputs = self._issue(c)
            if isinstance(outputs, _TailError):
                self._tail_failed(c, slot, outputs)
            self._xfer.hand_over(slot, outputs)
            self._look_ahead(c)
        else:
            heads = self._batches.outputs.pop(c, None)
            ring.give_token(c)
            outputs = self._tails(c, slot, heads)
        if loader._extras:  # fresh tensors, never slot memory: a kept batch keeps its own
            bs = loader.batch_size
            outputs = loader._extras.add(self._pipelines, outputs, self._order[c * bs : (c + 1) * bs])
        self.consumed = c + 1
        loader._position = (self.epoch, c + 1)
        loader._last_slots = (loader._last_slots[-1], slot)
        if rec is not None:  # the step's row (Recorder.step, written here: a call costs as much as the writes)
            sv = rec.step_view
            sv[off + T_ENTER] = t_enter
            sv[off + T_READY] = t_ready
            sv[off + T_EXIT] = time.perf_counter_ns()
            sv[off + MAKER] = maker
            sv[off + BLOCKED] = blocked  # (BATCH and EPOCH are filled when the rows are read)
            acc = self._acc
            if acc is not None:
                for k in range(STEP_FIXED, rec.width):
                    sv[off + k] = acc[k]
                    acc[k] = 0
            rec.count += 1
            if rec.count >= rec.fold_at:
                rec.fold()
        if self._jobs is not None:  # the first batch, made here: the producers start now (see _begin)
            self._submit_jobs()
        if loader.named:
            return dict(zip(loader.output_names, outputs))
        return tuple(outputs)

    def _tails(self, c: int, slot: int, heads: list[Any] | None) -> list[Any]:
        """Run each field's tail on batch ``c`` (in slot ``slot``) as it is handed over: on this thread, once per batch.

        CUDA without copies ahead (the earlier behaviour): the copies are queued
        now, on the transfer's stream, behind the work the user's stream has queued.
        """
        xfer = self._xfer
        outputs: list[Any] = []
        try:
            if xfer is None:
                self._run_tails(c, slot, heads, outputs)
                return outputs
            with issuing(xfer, slot, outputs):
                self._run_tails(c, slot, heads, outputs)
        except _TailError as exc:
            self._tail_failed(c, slot, exc)
        xfer.hand_over(slot, outputs)
        return outputs

    def _issue(self, c: int) -> list[Any] | _TailError:
        """Run batch ``c``'s tails now, on the transfer's stream: its copies are queued as soon as it is made.

        Returns its outputs, or the failure, which the loop raises when it reaches ``c``.
        """
        heads = self._batches.outputs.pop(c, None)
        slot = self._ring.slot(c)
        outputs: list[Any] = []
        try:
            with issuing(self._xfer, slot, outputs):
                self._run_tails(c, slot, heads, outputs)
        except _TailError as exc:
            return exc
        return outputs

    def _look_ahead(self, c: int) -> None:
        """After handing over batch ``c``: issue the copies of the batches after it that are made already, in order.

        Their ready signals are taken here (:attr:`_ready_seen`), so that the
        copies are queued a batch or more before the loop asks for them, never
        behind the step the user queues next. Stops at the first batch not made
        yet (or failed: its failure reaches the loop when it gets there).
        """
        ring = self._ring
        hi = min(self._n_batches, c + 1 + ring.producers * ring.ahead)
        b = max(self._next_issue, c + 1)
        while b < hi and ring.end is None:
            if b not in self._made_ahead and b not in self._ready_seen:
                if b == ring.skip and self._first_claimed:
                    break
                if not ring.try_ready(b):
                    break
                self._ready_seen.add(b)
            if ring.status[b] != DONE:
                break
            self._issued[b] = self._issue(b)
            b += 1
        self._next_issue = b

    def _run_tails(self, c: int, slot: int, heads: list[Any] | None, outputs: list[Any]) -> None:
        """Each field's tail steps on batch ``c``, appended to ``outputs``; a failure raises :class:`_TailError`."""
        bs = self._loader.batch_size
        n = min(bs, len(self._order) - c * bs)
        # a full batch in slot memory, nothing added after: a tail of views only hands over the slot's kept output, as the
        # fast hand-over does (FieldPipeline.keep_tail); its step columns of the accounting's row are zero then
        cached = heads is None and n == bs and self._xfer is None and not self._loader._extras
        sv, off = self._sv, self._row_off
        i = 0
        try:
            for i, p, out_step, seconds, tail in self._tail_plan:
                views_only = cached and self._views_only[i]
                if views_only:
                    e = p._tail_cache[slot]
                    if e is not None and e.out_step == out_step:
                        if sv is not None:
                            for *_, col in tail:
                                sv[off + col] = 0
                        outputs.append(e.out)
                        continue
                    e = None  # (another step's output: dropped by keep_tail below)
                views = p._views[slot]
                if heads is not None:
                    out = heads[i]
                else:
                    out = views[out_step]
                    if n != bs:
                        out = out[:n]
                if tail:
                    out = self._tail(c, p, views, n, out, tail, seconds)
                if views_only:  # kept for the slot's next full batches (if a view of its memory)
                    box = [out]
                    del out
                    out = p.keep_tail(slot, out_step, box)
                outputs.append(out)
        except Exception as exc:
            raise _TailError(i, exc) from exc

    def _tail_failed(self, c: int, slot: int, failure: _TailError) -> Any:
        """Field ``failure.field``'s tail failed on batch ``c``: end the epoch with an error naming the sample."""
        self._stop_producers(End("failed"))
        s = self._batches
        indices, positions = s.indices(c), s.positions(c)
        err = self._pipelines[failure.field].locate_error(indices, positions, slot, s.seeds_fn, failure.error)
        err.__cause__ = failure.error
        return self._fail(err)

    def _tail(self, c: int, p: FieldPipeline, views: list[Any], n: int, out: Any, tail: list[Any], seconds: dict[str, float]) -> Any:
        """One field's tail steps on batch ``c``'s head output ``out``."""
        s, bs = self._batches, self._loader.batch_size
        clock = time.perf_counter_ns
        sv, off = self._sv, self._row_off  # the step's row of the accounting (or None)
        acc = self._acc  # (CUDA: the times of the call that runs the tail, added up)
        t1 = clock()
        for j, code, name, simple, step, col in tail:
            dst = views[j]
            if dst is not None and n != bs:
                dst = dst[:n]
            if simple:  # (batch, dst): ToTensor, ToDevice, Squeeze, modules
                out = code(out, dst)
            else:
                out = code(*p._args(step, out, dst, s.indices(c), p._seeds(step, s.seeds_fn, s.positions(c))))
            t2 = clock()
            seconds[name] += (t2 - t1) * 1e-9
            if acc is not None:
                acc[col] += t2 - t1
            elif sv is not None:
                sv[off + col] = t2 - t1
            t1 = t2
        return out

    def _next_profiled(self) -> tuple[Any, ...] | dict[str, Any]:
        """``next()`` as one span of ``torch.profiler`` (while it records): the wait for the batch and the Python stages."""
        self._profiling = True
        try:
            with self._prof.record_function("stoker: Loader next() (wait + Python stages)"):
                return self._next_batch()
        finally:
            self._profiling = False

    def _work_while_waiting(self, c: int, t: int) -> bool:
        """While producer ``t`` makes batch ``c``: make later batches no producer has started; whether ``c`` became ready.

        Only batches whose slots are free (fewer than ``producers * ahead`` past ``c``), and only while the next one's
        shards are in the cache: a batch whose shard is still being downloaded would hold the loop until that download
        ends (16 s for a 1 MB shard at 64 KB/s), long after ``c`` is ready. With the compiled loop and no node cache,
        the first such batch and the ones after it go to one call (:meth:`_make_run`) spanning ``producers + 1`` times
        the batches the loop makes in :data:`WAIT_RUN_NS` (none if one takes longer: then one batch): the producers take
        their next batches meanwhile (each batch is claimed by whoever gets to it first), and the loop makes about its
        share of them.
        """
        ring = self._ring
        hi = min(self._n_batches, c + ring.producers * ring.ahead)
        for b in range(c + 1, hi):
            if ring.claims[b] != 0:
                continue
            if not self._batches.local(b):  # its shard is still downloaded: the loop would wait for it, not for c
                return False
            if not ring.claim(b):  # (a producer took it meanwhile)
                continue
            each = ring.memory.loop_batch_ns
            run = WAIT_RUN_NS // each if each > 0 else 1  # (batches longer than WAIT_RUN_NS: one at a time)
            if run >= 1 and self._batches.compiled and self._batches.cache is None:  # b and the next ones in one call
                self._make_run(b, min(hi, b + (ring.producers + 1) * run))
            else:
                self._make_here(b)
            self._made_ahead.add(b)
            if self._own_error is not None or ring.status[b] != DONE:  # the loop failed: wait for c (the failure surfaces at b)
                return False
            if ring.try_ready(c):
                return True
        return False

    def _make_here(self, c: int) -> None:
        """Make batch ``c`` (claimed) in this thread; its outcome goes to ``status[c]``.

        A producer that has not started its next batch (asleep, or still waking up: on a
        virtual machine that can take a millisecond) would make the loop wait longer than
        the batch takes to make; the producer skips a batch claimed here. An interrupt
        (``KeyboardInterrupt``) is the user's: it leaves ``next()`` as itself.
        """
        if c == self._ring.skip:  # the epoch's first batch: a message if it waits for the compiler more than a second
            fields = ", ".join(f"'{p.name}'" for p in self._pipelines)
            with warm.announced(f"the pipelines of fields {fields}"):
                self._make(c)
        else:
            self._make(c)

    def _make_run(self, c: int, end: int | None = None) -> None:
        """Make batch ``c`` (claimed) in this thread, and in the same compiled call the batches after it that no
        producer has started and whose slots are free (fewer than ``producers * ahead`` past ``c``), as many as take
        about :data:`MAKE_RUN_NS` by the fields' time of the loop's last batch (``c`` waits for them: Otto's 1024 rows,
        ~40 us a batch, two; seed 003's 300 integers, every one the slots allow), or those before ``end`` when given
        (:meth:`_work_while_waiting`'s run: there ``c`` too is made ahead, the caller says so).

        For an epoch's start, before any producer has handed a batch over: the producers are still waking up and
        starting (a few hundred microseconds on a virtual machine), and a batch made here one call at a time costs
        ~20 us of Python against ~2 us for each batch of one call. The loop claims each later batch as it gets to it
        (a producer that claimed one first makes it; the loop goes on with the next); the ones it made are handed
        over as made ahead (:attr:`_made_ahead`). A batch the call leaves unmade (an exception with no batch marked)
        is made again alone, as :meth:`_make` makes one; a failed one fails when the loop reaches it.
        """
        s, ring, loader = self._batches, self._ring, self._loader
        # as many as the loop makes in about MAKE_RUN_NS (its last batch made alone, timed): batch c waits for them
        if end is None:
            each = ring.memory.loop_batch_ns
            end = min(self._n_batches, c + ring.producers * ring.ahead, c + (MAKE_RUN_NS // each if each > 0 else 1))
        if not s.compiled or end <= c + 1:
            self._make(c)
            return
        own = self._loop_spent
        before = own.copy()
        try:
            with interrupts_blocked():  # (as _make)
                s.run_loop(c, 1, 0, 0, own, NO_SHUFFLE, self._loop_seeds, end)  # type: ignore[arg-type]
        except Exception:  # (no batch marked: each batch left is made again alone below, its error kept as _make keeps it)
            pass
        spent_ns = self._count_fields(own, before)
        claims, status = ring.claims, ring.status
        made = 0
        for b in range(c, end):
            if b == c or claims[b] == LOOP_CLAIM:
                if status[b] == PENDING:
                    self._make(b)
                else:
                    loader._made_by_loop[0] += 1
                    made += 1
                if b != c:
                    self._made_ahead.add(b)
        if made:
            ring.memory.loop_batch_ns = max(1, spent_ns // made)

    def _make(self, c: int) -> None:
        s = self._batches
        loader = self._loader
        if not s.compiled:
            try:
                s.make_python(c, loader._loop_seconds)
            except Exception as exc:
                self._own_error = exc
                return
            loader._made_by_loop[0] += 1
            return
        own = self._loop_spent
        before = own.copy()
        try:
            with interrupts_blocked():  # (Numba threads started by this call inherit the mask: see stoker._threads)
                s.run_loop(c, self._n_batches, 0, 0, own, NO_SHUFFLE, self._loop_seeds)  # type: ignore[arg-type]
        except Exception as exc:  # compiling or calling the loop failed (an operation's failure sets the status)
            self._own_error = exc
            return
        loader._made_by_loop[0] += 1
        self._ring.memory.loop_batch_ns = max(1, self._count_fields(own, before))  # (its fields' time: no call's)

    def _count_fields(self, own: np.ndarray, before: np.ndarray) -> int:
        """Add each field's time in the loop's compiled call (``own`` less ``before``, the call's ``spent``) to the
        loader's seconds; their sum [ns]."""
        seconds = self._loader._loop_seconds
        total = 0
        for i, p in enumerate(self._pipelines):
            ns = int(own[1 + i] - before[1 + i])
            total += ns
            seconds[p.name][p.head_key] += ns / 1e9
        return total

    def _switch(self, c: int, now_ns: int) -> bool:
        """Before batch ``c`` of an epoch made by Python producers: go over to the compiled loop if its background
        compilation has ended well; whether the producers were stopped (the caller's ``next()`` starts again).

        The mid-epoch fallback of :meth:`_not_made`, the other way: the Python producers stop
        (each finishes the batch it is making), and the compiled plan begins at batch ``c``
        in the same slot. The batches they made ahead of ``c`` are dropped and made again by
        the compiled producers (at most ``producers * ahead`` batches, once per loader): the
        same batches, whose seeds come from (seed, epoch, position). Batches the user keeps
        are never written: the new ring checks each slot before a producer may write it, as
        every ring does (``SlotRing.free_slot``). A compilation that failed keeps the Python
        producers; later epochs run the loop from their first batch (:meth:`Plan.usable`).
        """
        self._look_at = now_ns + SWITCH_LOOK_NS
        plan_ = self._plan
        if not plan_.usable(self._batches, c):
            if plan_.background is not None and plan_.background.error is not None:
                self._may_switch = False  # (did not compile: Python producers, for the rest of this loader)
            return False
        self._may_switch = False
        if not self._restart(plan_, c):
            return True
        seconds = (time.perf_counter_ns() - self._started_ns) / 1e9
        plan_.switched = (self.epoch, c, seconds)
        logger.info(
            f"stoker: the producer loop of fields {', '.join(repr(p.name) for p in self._pipelines)} is compiled: epoch "
            f"{self.epoch} goes on with it from batch {c} of {self._n_batches}, {seconds:.2f} s after iter()"
        )
        return True

    def _restart(self, plan_: Plan, c: int) -> bool:
        """Stop this epoch's producers (each finishes its batch) and begin ``plan_`` from batch ``c`` in the same slot
        (the mid-epoch switch to the compiled loop, the fallback to Python producers); ``False`` when ``close()`` came
        from another thread meanwhile: nothing begins, and the loop's ``next()`` ends the epoch."""
        ring = self._ring
        self._stop_producers(End("closed"))
        if ring.end is not None and ring.end.by_other_thread:
            return False
        self._begin(plan_, c, ring.slot(c))
        return True

    def _not_made(self, c: int, t: int, status: int) -> tuple[Any, ...] | dict[str, Any]:
        """Batch ``c`` was not made: an operation failed, returned other memory, or the loop failed."""
        self._submit_jobs()  # (the first batch failed: the producers start all the same)
        ring = self._ring
        error = self._own_error if self._own_error is not None else ring.producer_errors[t]
        if status == FALLBACK or (status == PENDING and error is not None and _is_compile_error(error)):
            # go on with Python producers from this batch; this loader does not try the compiled loop again
            why = "a compiled operation returned other memory than its slot's" if status == FALLBACK else "the loop failed to compile"
            self._loader._plan = python_plan(why)
            self._own_error = None
            self._restart(self._loader._plan, c)
            return self._next_batch()
        if status == FAILED:
            err = ring.errors.get(c)
            bad = int(self._batches.bad[c])
            if err is None and bad >= 0 and self._batches.check is not None:  # a corrupt data block, found by the compiled loop
                err = self._batches.check.error(bad, self._batches.indices(c))
            elif err is None:  # the compiled loop failed it: run it again in Python to name the sample and the operation
                err = self._locate(c)
        elif error is not None:
            err = LoaderError("*", "loader", None, f"{type(error).__name__}: {error}")
            err.__cause__ = error
        else:  # pragma: no cover - a producer signals only after setting a status or an error
            err = LoaderError("*", "loader", None, f"batch {c} was signalled but not made")
        return self._fail(err)

    def _fail(self, err: BaseException) -> Any:
        """End the epoch with ``err``: no thread is left behind, and the loop gets ``err``."""
        self._stop_producers(End("failed", err))
        self.finished = True
        self._issued = {}
        self._loader.close()  # a failed epoch leaves no thread behind
        raise err

    def _ended(self) -> Any:
        """The one place where an epoch's end reaches the loop."""
        end = self._ring.end or End("closed")
        if end.kind == "closed" and end.by_other_thread:  # the closing thread waits for the producers (close()): the loop
            self._ring.set_end(end)  # raises now, whatever they are in the middle of (a download, a compile)
        else:
            self._stop_producers(end)
        self.finished = True
        self._issued = {}  # (batches issued ahead of a closed epoch: their slot memory is the next epoch's)
        if end.kind == "exhausted":  # (the position stays (epoch, batches): state_dict() reads it as the next epoch's start,
            self._cover_data()  # and state_dict(unseen=k) of a consumer that read the end ahead still counts back)
            raise StopIteration
        if end.kind == "failed" and end.error is not None:
            raise end.error
        if end.kind == "closed" and end.by_other_thread:
            raise StokerError(
                f"loader.close() was called from another thread while this loop iterated epoch {self.epoch} (after "
                f"{self.consumed} of {self._n_batches} batches): the epoch ended there. Iterate the loader again to go on with the "
                "next epoch (where loader.state_dict() now starts; a state saved inside the loop goes on after its batch)"
            )
        raise StopIteration

    def _cover_data(self) -> None:
        """After a whole epoch: check the blocks of the loader's samples no batch has read yet (those ``drop_last`` or
        another rank's share left out), so that later epochs do no check per batch (the check is per process)."""
        loader, check = self._loader, self._batches.check
        if check is None or loader._data_covered or self.consumed != self._n_batches:
            return
        reader = loader.reader
        check.check(loader.indices, lazy=not reader._metadata_valid, bounded=not loader.os_cache)
        loader._data_covered = True

    def _locate(self, c: int) -> LoaderError:
        """Run failed batch ``c`` again in Python, field by field, to name the sample and the operation."""
        s = self._batches
        indices, positions, slot = s.indices(c), s.positions(c), self._ring.slot(c)
        self._stop_producers(End("failed"))  # nothing else writes into the slots while the batch runs again
        for p in self._pipelines:
            try:
                p.run(indices, positions, slot, s.seeds_fn, defaultdict(float))
            except Exception as exc:
                err = p.locate_error(indices, positions, slot, s.seeds_fn, exc)
                err.__cause__ = exc
                return err
        return LoaderError("*", "loader", None, f"batch {c} failed in compiled code but not when run again")

    def _stop_producers(self, end: End) -> None:
        self._ring.set_end(end)
        if self._pool.current is self._ring:  # (an old epoch closed late: its producers stopped long ago, others run now)
            self._pool.wait_idle()

    def close(self) -> None:
        """End the epoch (from any thread): stop the producers (they finish the batch they are making).

        From the loop's own thread (or while the loop is not inside ``next()``... see
        ``docs/loader.md``): the loop's next ``next()`` ends the epoch normally. From another
        thread while the loop iterates: the loop's ``next()`` raises :class:`StokerError`.
        """
        other = self._loop_thread is not None and self._loop_thread != threading.get_ident()
        self.finished = True
        self._issued = {}
        end = End("closed", by_other_thread=other)
        self._ring.set_end(end)  # first: a batch whose download is stopped below never reaches the loop
        stopped = getattr(self._loader.reader, "downloads_stopped", None)  # a dataset in a store: its downloads end now
        with stopped() if stopped is not None else contextlib.nullcontext():
            self._stop_producers(end)


def _reuse_slot(xfer: Any, acc: list[int] | None, col: int, slot: int) -> None:
    """Before a producer may write ``slot`` again: the copy out of its page-locked memory has completed (a wait for
    the GPU if not: the accounting's device column). (A function of the ring's, holding no reference to the epoch.)"""
    waited = xfer.reuse(slot)
    if waited and acc is not None:
        acc[col] += waited


def _set_addresses(addresses: np.ndarray, groups: list[Group], pipelines: list[FieldPipeline], slot: int) -> None:
    """Write slot ``slot``'s memory addresses into the table compiled producers write through (see :class:`Group`)."""
    for group in groups:
        width = len(group.memory)
        for q, i in enumerate(group.fields):
            views = pipelines[i]._views[slot]
            for c, j in enumerate(group.memory):
                addresses[slot, group.column + q * width + c] = views[j].ctypes.data


def _is_compile_error(exc: BaseException) -> bool:
    from numba.core.errors import NumbaError

    return isinstance(exc, NumbaError)
