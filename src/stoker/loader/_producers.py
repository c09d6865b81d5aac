"""Producers: the jobs that make an epoch's batches' heads into slots of the ring.

:class:`_Batches` holds one epoch's batches as producers see them (order, positions, seeds, the arguments of the
compiled loop of :mod:`stoker.loader._planner`) and makes a batch with Python calls where there is no compiled loop
(:meth:`_Batches.make_python`); :class:`_Job` is one producer thread's share of the epoch. They signal each batch
through the slot ring (:mod:`stoker.loader._ring`); the consumer loop (:mod:`stoker.loader._engine`) starts them.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from stoker.errors import CacheFullError, DatasetFormatError, RemoteError
from stoker.format import _verify
from stoker.loader._accounting import HEAD_COLUMNS, READ_COLUMN
from stoker.loader._epoch import _WORKQUEUE_LOCK, _layer_is_workqueue, set_producer_threads
from stoker.loader._graph import FieldPipeline
from stoker.loader._planner import (
    Plan,
)
from stoker.loader._ring import DONE, FAILED, SPIN_NS, SlotRing
from stoker.loader.distributed import positions_of
from stoker.observe._recorder import M_DONE, M_START
from stoker.pipeline import native, warm
from stoker.pipeline.random import SHUFFLE_BLOCK, sample_seeds

if TYPE_CHECKING:
    from stoker.dataset.sharded import ShardedReader
    from stoker.loader._view import LoaderView


#: the loop's ``shuffle`` arguments when it makes no order (``next_order, next_key, next_state, next_source``): one value,
#: copied and shuffled already (never written)
NO_SHUFFLE = (
    np.zeros(1, dtype=np.int64),
    np.uint64(0),
    np.array([0, 1] + [0] * SHUFFLE_BLOCK, dtype=np.int64),
    np.zeros(1, dtype=np.int64),
)


def producers_beside_loop(num_workers: int, pool_size: int, loop_works: bool, cpus: int) -> int:
    """How many of the pool's ``pool_size`` producers an epoch starts: all, unless the loop would have no CPU of its own.

    When the loop's thread makes batches while it waits (``loop_works``) and the
    workers alone would take every one of the ``cpus`` this process may run on,
    one CPU is left to the loop: on 2 CPUs, 1 producer beside the loop rather than
    3 threads taking turns on 2 CPUs (Otto, 2 workers on 2 CPUs: 1.04x-1.20x the
    compiled one-thread gather with 2 producers, 1.19x-1.34x with 1). A loop busy
    with the user's own work (training) has its CPU then too.
    """
    if not loop_works or pool_size < 2 or num_workers < cpus:
        return pool_size
    return max(1, min(pool_size, cpus - 1))


#: a group of this many fields or more passes its fields' arrays as a typed list (one compiled loop for any count;
#: a tuple's type and indexing code grow with its length: 120 scalar fields took a minute to compile), fewer as a
#: tuple (a typed list costs about 0.6 s to set up once per process)
LIST_FROM = 8


def _arrays_arg(pipelines: list[FieldPipeline]) -> Any:
    """The group's per-field ``arrays`` as the compiled loop indexes them (``a[q]``): a tuple, or a typed list."""
    if len(pipelines) < LIST_FROM:
        return tuple(p.arrays for p in pipelines)
    from numba.typed import List

    arrays = List()
    for p in pipelines:
        arrays.append(p.arrays)
    return arrays


def _seed_bases(seed: int, epoch: int, salts: list[int]) -> np.ndarray:
    """``sample_seeds``' per-(seed, epoch, salt) part: the compiled loop mixes in each sample's position."""
    from stoker import _splitmix

    mix = _splitmix.mix64_int
    mask = (1 << 64) - 1
    out = np.empty(len(salts), dtype=np.uint64)
    for r, salt in enumerate(salts):
        out[r] = mix(mix(mix(seed & mask) ^ (epoch & mask)) ^ (salt & mask))
    return out


class _Batches:
    """What one run of the producers needs (shared by producer threads and the loop; never the Epoch itself)."""

    def __init__(self, loader: LoaderView, plan_: Plan, order: np.ndarray, runs: np.ndarray, epoch: int, ring: SlotRing) -> None:
        self.plan, self.ring, self.order = plan_, ring, order
        self.batch_size, self.runs = loader.batch_size, runs  # the samples' global positions (distributed.Share.runs)
        self.pipelines = loader.pipelines
        self.seed, self.epoch = loader.seed, epoch
        self.validate = loader.reader.validate_samples
        self.reader = loader.reader
        # the data blocks' CRCs: checked for each batch until every block is (then nothing is done per batch)
        check = loader._data_check
        self.check = check if check is not None and not loader._data_covered and not check.all_verified() else None
        self.bad = np.full(max(1, ring.n_batches), -1, dtype=np.int64)  # batch -> the corrupt data block that failed it
        self.cache = None if loader.os_cache else cast("ShardedReader", loader.reader)
        self.lock = _WORKQUEUE_LOCK if _layer_is_workqueue() else None
        self.outputs: dict[int, list[Any]] = {}  # batch -> heads' outputs (Python producers)
        self.after_first: Any = None  # called once the first batch is made (starts a loop's background compilation)
        self.field_args: list[Any] = []
        self.verify_args: tuple[Any, ...] = ()
        self.seed_rows = 1
        # each batch's row of the loader's accounting (stoker.observe), at (mark_base + batch) % rows; accounting off: a
        # scratch row (the compiled loop's arguments keep one type either way)
        rec = loader._recorder
        self.marks = rec.marks if rec is not None else np.zeros((1, 3 + len(self.pipelines)), dtype=np.int64)
        self.mark_base = 0
        if plan_.loop is not None:
            rows = max([len(g.seeded) for g in plan_.groups] + [1])
            for g in plan_.groups:
                ps = [self.pipelines[i] for i in g.fields]
                salts = [[ps[q].jit_steps[j].salt for j in g.seeded] for q in range(len(ps))]
                bases = np.zeros((len(ps), max(1, len(g.seeded))), dtype=np.uint64)
                for q in range(len(ps)):
                    if g.seeded:
                        bases[q] = _seed_bases(self.seed, epoch, salts[q])
                shapes = [np.array([p._views[0][j].shape for p in ps], dtype=np.int64).reshape(len(ps), -1) for j in g.memory]
                self.field_args += [_arrays_arg(ps), ps[0].storage, np.array(g.fields, dtype=np.int64), bases, *shapes]
            self.seed_rows = rows
            self.verify_args = self.check.kernel_args() if self.check is not None else _verify.empty_args()
        # this epoch's producers run the compiled loop (else Python producers make its batches while it compiles)
        self.compiled = plan_.usable(self, ring.skip)
        if not self.compiled and plan_.background is not None and not plan_.background.started:
            self.after_first = plan_.background.start
        # while the loop compiles: the Python producers' batch times, told to the compilation (its priority)
        self.compiling = plan_.background if not self.compiled and plan_.background is not None else None
        self.timed: list[int] = []

    def seeds_buffer(self) -> np.ndarray:
        """Scratch for one thread's per-sample seeds (rows: a group's seeded steps)."""
        return np.empty((self.seed_rows, max(1, min(self.batch_size, len(self.order)))), dtype=np.uint64)

    def seeds_fn(self, salt: int, positions: np.ndarray) -> np.ndarray:
        return sample_seeds(self.seed, self.epoch, positions, salt)

    def positions(self, b: int) -> np.ndarray:
        lo = b * self.batch_size
        return positions_of(self.runs, lo, min(lo + self.batch_size, len(self.order)))

    def indices(self, b: int) -> np.ndarray:
        return self.order[b * self.batch_size : (b + 1) * self.batch_size]

    def loop_args(
        self, first: int, step: int, tokens: int, ready: int, spent: np.ndarray, at: np.ndarray, shuffle: tuple[Any, ...],
        seeds: np.ndarray, end: int | None = None,
    ) -> tuple[Any, ...]:  # fmt: skip
        r = self.ring
        return (
            self.order, self.batch_size, first, step, r.n_batches if end is None else end, r.skip, r.slot_base, r.num_slots, r.memory.addresses,
            tokens, ready, r.stop, r.ctl, r.span, SPIN_NS, r.status, r.claims, spent, at, *shuffle, self.runs, seeds, int(self.check is not None),
            self.bad, *self.verify_args, self.marks, self.mark_base, *self.field_args,
        )  # fmt: skip

    def loop_types(self) -> tuple[Any, ...]:
        """The Numba types of the loop's arguments (the same for every call of an epoch, and of every epoch)."""
        import numba

        spent = np.zeros(1 + len(self.pipelines), dtype=np.int64)
        args = self.loop_args(0, 1, 0, 0, spent, _running(), NO_SHUFFLE, self.seeds_buffer())
        return tuple(numba.typeof(a) for a in args)

    def run_loop(
        self, first: int, step: int, tokens: int, ready: int, spent: np.ndarray, shuffle: tuple[Any, ...], seeds: np.ndarray,
        end: int | None = None,
    ) -> None:  # fmt: skip
        """Run the compiled loop (batches ``first, first + step, ...`` before ``end``, default the epoch's end); an
        exception raised by an operation fails the batch it was making.

        The loop marks the batch whose operations run in ``at``; one of them raising leaves the loop, and the batch
        fails here as the loop would fail it (its status, then a signal on ``ready``): the consumer then runs it again
        in Python to name the sample and the operation. An exception with no batch marked (compiling or calling the
        loop failed) reaches the caller.
        """
        at = _running()
        try:
            self.plan.loop(*self.loop_args(first, step, tokens, ready, spent, at, shuffle, seeds, end))
        except Exception:
            b = int(at[0])
            if b < 0:
                raise
            self.ring.status[b] = FAILED
            if ready != 0:
                native.post_address(ready)

    def local(self, b: int) -> bool:
        """Whether making batch ``b`` would not wait for a download (a shard in object storage not yet in the cache)."""
        return self.cache is None or self.cache.local(self.indices(b))

    def make_python(self, b: int, seconds: dict[str, dict[str, float]]) -> None:
        """Make batch ``b`` (claimed) with Python calls of each head; its outcome goes to the ring."""
        ring = self.ring
        indices, positions, slot = self.indices(b), self.positions(b), ring.slot(b)
        clock = time.perf_counter_ns  # the batch's row of the loader's accounting (stoker.observe)
        marks = self.marks[(self.mark_base + b) % len(self.marks)]
        marks[M_START] = t0 = clock()
        ticket = None
        try:
            self.validate(indices)
            if self.check is not None:  # the data blocks the batch reads, against their CRCs (once per process)
                self.check.check(indices, lazy=not self.reader._metadata_valid, bounded=self.cache is not None)
            if self.cache is not None:  # os_cache=False: the batch's bytes, read into the bounded cache
                ticket = self.cache.acquire(indices)
        except (DatasetFormatError, RemoteError, CacheFullError) as exc:
            # corrupt metadata or data (named sample and block, before any compiled code reads it), or a store or cache that
            # failed (named URL): the loop gets the error as itself (``except RemoteError`` catches a store's)
            ring.finish(b, FAILED, exc)
            return
        marks[READ_COLUMN] = (t1 := clock()) - t0  # reading (the bounded cache, the data check)
        # while the producer loop compiles in the background, the heads run step by step: nothing to compile for them
        unfused = self.plan.loop is not None
        try:
            outputs = []
            for i, p in enumerate(self.pipelines):
                try:
                    if self.lock is not None:
                        with self.lock:
                            out = p.run_head(indices, positions, slot, self.seeds_fn, seconds[p.name], unfused)
                    else:
                        out = p.run_head(indices, positions, slot, self.seeds_fn, seconds[p.name], unfused)
                except Exception as exc:
                    interrupt = exc.__cause__ or exc.__context__
                    if isinstance(exc, SystemError) and isinstance(interrupt, KeyboardInterrupt):
                        # Ctrl-C during a compiled call on the loop's thread (Numba returns it as a SystemError):
                        # the user's, as anywhere else in next() (the epoch ends), not a failure of the batch
                        raise interrupt from None
                    err = p.locate_error(indices, positions, slot, self.seeds_fn, exc)
                    err.__cause__ = exc
                    ring.finish(b, FAILED, err)
                    return
                outputs.append(out)
                marks[HEAD_COLUMNS + i] = (t2 := clock()) - t1
                t1 = t2
        finally:  # every head's output is in slot memory now: the cached bytes are no longer needed
            if ticket is not None:
                self.cache.release(ticket)  # type: ignore[union-attr]
        if getattr(ticket, "stale", False):  # a page it read was dropped meanwhile (its shard downloaded again): made again
            self.make_python(b, seconds)
            return
        self.outputs[b] = outputs
        marks[M_DONE] = done = clock()
        compiling = self.compiling
        if compiling is not None:
            timed = self.timed
            timed.append(done - t0)
            if len(timed) >= warm.TIMED_BATCHES:
                self.compiling = None
                compiling.batches_take(sorted(timed)[len(timed) // 2] / 1e9)
        # the loop's background compilation starts before the first batch is handed over: once a user holds it, the
        # compilation has begun (the user's loop never sees a first batch whose compile has not started)
        # (cleared only once called: a producer that sees it cleared knows the compilation has started)
        start = self.after_first
        if start is not None:
            start()  # idempotent, under a lock
            self.after_first = None
        ring.finish(b, DONE)


def _running() -> np.ndarray:
    """``at`` for a call of the compiled loop: the batch whose operations run, ``-1`` between batches."""
    return np.full(1, -1, dtype=np.int64)


#: the global positions of an epoch on one rank with nothing handed out before (``distributed.Share.runs``)
_ONE_RUN = np.zeros((1, 2), dtype=np.int64)


class _AheadRing:
    """What the compiled loop reads of a ring, for one batch made outside any epoch's ring: batch 0 of the next epoch,
    in slot ``slot`` (the loop's own batch: no token, no claim, no signal)."""

    def __init__(self, memory: Any, slot: int) -> None:
        self.memory, self.n_batches, self.skip, self.slot_base, self.num_slots = memory, 1, 0, slot, memory.num_slots
        self.stop = np.zeros(1, dtype=np.int64)
        self.ctl = np.zeros(32 + 16, dtype=np.int64)
        self.span = 1
        self.status = np.zeros(1, dtype=np.int8)
        self.claims = np.zeros(1, dtype=np.int32)


class Ahead:
    """The next epoch's first batch, made by producer 0 once this epoch has no batch left for it to make.

    Its order is known (the next epoch's ``RANDOM`` order, which producer 0 has just finished shuffling), its seeds
    come from (seed, epoch, position), and its slot is the one the next epoch's ring gives its first batch (the
    slot after this epoch's last batch): the producer waits for that slot's token as for a batch of this epoch
    (the loop has taken every batch but the last ``producers * ahead``), checks it (``SlotRing.free_slot``: a batch the
    user keeps is never written over) and makes the batch there. The next epoch's start takes it
    (:meth:`CompiledEpoch._begin <stoker.loader._engine.CompiledEpoch>`) only if nothing it depends on changed
    (:meth:`fits`); otherwise it is made again as every first batch is. Holds no reference to the loader.

    Args:
        view: what :class:`_Batches` reads of the loader (taken when this epoch started).
        plan_: the loader's plan.
        order: the next epoch's samples on this rank (the prepared order's memory, shuffled by producer 0).
        epoch: the next epoch.
        ring: this epoch's ring.
        pool: the producer threads (``loader.close()`` makes new ones: what was made ahead is dropped).
    """

    def __init__(self, view: Any, plan_: Plan, order: np.ndarray, epoch: int, ring: SlotRing, pool: Any) -> None:
        self.view, self.plan, self.order, self.epoch, self.ring, self.pool = view, plan_, order, epoch, ring, pool
        self.seed, self.batch_size, self.pipelines = view.seed, view.batch_size, view.pipelines
        self.slot = ring.slot(ring.n_batches)  # (the next epoch's ring: slot_base = this one's + its batches)
        self.done = False  # made, in ``slot``
        self.settled = False  # made, or given up (the epoch ended first, a failure): producer 0 is done with it
        self.views: list[Any] = []  # each pipeline's memory of the slot once made (a slot renewed since has other lists)
        self.marks: np.ndarray | None = None  # its row of the accounting's marks (start, read, heads, done)
        self.seconds = np.zeros(1 + len(self.pipelines), dtype=np.int64)  # (as the loop's ``spent``)

    def make(self, t: int, seconds: dict[str, dict[str, float]]) -> None:
        """Producer ``t`` (0): wait for the slot's token, check the slot, make the batch (no batch if the epoch ends)."""
        ring = self.ring
        s = _Batches(self.view, self.plan, self.order, _ONE_RUN, self.epoch, _AheadRing(ring.memory, self.slot))  # type: ignore[arg-type]
        if not s.compiled:
            return
        if not ring.take_token(t, ring.n_batches, soonest=True) or ring.end is not None:
            return
        ring.free_slot(ring.n_batches)  # a batch the user keeps in that slot: the slot gets fresh memory
        # its accounting marks in a row of its own (the recorder's rows are this epoch's batches'), copied into the
        # next epoch's row for it when that epoch hands it over
        s.marks, s.mark_base = np.zeros((1, s.marks.shape[1]), dtype=s.marks.dtype), 0
        spent = self.seconds
        s.run_loop(0, 1, 0, 0, spent, NO_SHUFFLE, s.seeds_buffer())
        for i, p in enumerate(s.pipelines):
            seconds[p.name][p.head_key] += float(spent[1 + i]) / 1e9
        if int(s.ring.status[0]) == DONE:  # (failed: not kept; the next epoch makes it again and says why)
            self.marks = s.marks[0].copy()
            self.views = [p._views[self.slot] for p in self.pipelines]
            self.done = True

    def fits(self, epoch: int, skip: int, slot: int, plan_: Plan, pool: Any, order: np.ndarray, runs: np.ndarray, view: Any) -> bool:
        """Whether the epoch starting now (``epoch`` from batch ``skip``, its first batch in ``slot``, ``order`` and
        ``runs`` its share) is the one this batch was made for, and nothing changed since: every batch of the epoch
        before handed out, the same plan, producers, seed, batch size, order and the slot's memory."""
        prev = self.ring
        return (
            self.done
            and epoch == self.epoch
            and skip == 0
            and slot == self.slot
            and plan_ is self.plan
            and pool is self.pool
            and int(prev.ctl[0]) == prev.n_batches  # (CONSUMED: every batch of the epoch before; not after a break)
            and view.seed == self.seed
            and view.batch_size == self.batch_size
            and view.pipelines is self.pipelines
            and len(order) == len(self.order)
            and order.ctypes.data == self.order.ctypes.data
            and runs.shape == _ONE_RUN.shape
            and not runs.any()
            and all(p._views[slot] is v for p, v in zip(self.pipelines, self.views, strict=True))
        )


#: per producer thread: the ``(threads, batch_size)`` its Numba settings were last set for (set_producer_threads)
_THREADS_SET = threading.local()


class _Job:
    """One producer's share of an epoch: runs in a kept producer thread (holds the batches, never the Epoch)."""

    def __init__(self, batches: _Batches, t: int, num_threads: int, seconds: dict[str, dict[str, float]], wait: dict[str, float],
                 shuffle: tuple[Any, ...], ahead: Ahead | None = None) -> None:  # fmt: skip
        self.batches, self.t, self.num_threads = batches, t, num_threads
        self.seconds, self.wait, self.shuffle = seconds, wait, shuffle
        self.ahead = ahead  # the next epoch's first batch, made once this producer's batches are (or None)

    def run(self) -> None:
        s, t = self.batches, self.t
        ring = s.ring
        try:
            threads = (self.num_threads, s.batch_size)
            if getattr(_THREADS_SET, "value", None) != threads:  # (Numba's per-thread settings stay: ~40 us under the GIL)
                set_producer_threads(*threads)
                _THREADS_SET.value = threads
            if s.compiled:
                spent = np.zeros(1 + len(s.pipelines), dtype=np.int64)
                try:
                    s.run_loop(ring.skip + t, ring.producers, ring.sems.address(t), ring.sems.address(ring.ready_index(t)), spent,
                               self.shuffle, s.seeds_buffer())  # fmt: skip
                finally:
                    self.wait["producer_waiting_for_consumer"] += float(spent[0]) / 1e9
                    for i, p in enumerate(s.pipelines):
                        self.seconds[p.name][p.head_key] += float(spent[1 + i]) / 1e9
                ahead = self.ahead
                state = self.shuffle[2]
                if ahead is not None and ring.end is None and state[0] == 0 and state[1] == len(self.shuffle[0]):  # (its order made whole)
                    try:
                        ahead.make(t, self.seconds)
                    except Exception:  # (not this epoch's: the next one makes its first batch again, and says why if it fails)
                        ahead.done = False
                    finally:
                        ahead.settled = True
            else:
                for b in range(ring.skip + t, ring.n_batches, ring.producers):
                    t0 = time.perf_counter()
                    go = ring.take_token(t, b)
                    self.wait["producer_waiting_for_consumer"] += time.perf_counter() - t0
                    if not go:
                        return
                    if not ring.claim(b):
                        continue
                    s.make_python(b, self.seconds)
                    ring.made(t, b)
                    if ring.status[b] != DONE:
                        return
        except BaseException as exc:  # compiling or calling the loop failed (not an operation: those set a status)
            ring.producer_errors[t] = exc
            ring.post_ready(t)
        finally:
            self.batches = None  # type: ignore[assignment]  # hold nothing of the epoch while idle
            self.ahead = None
