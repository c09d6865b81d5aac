"""An epoch whose producer loops are compiled whole: no GIL and no Python between batches.

When every field's pipeline is compiled operations, optionally followed by
``ToTensor``, each producer thread makes its share of the epoch's batches in
one ``nogil`` call (:func:`_source` generates it per loader, cached on disk
like the fused pipelines). Producers and the loop hand batches over through
POSIX semaphores (:mod:`stoker.pipeline.native`): a producer never waits for
the GIL, and a batch that is ready when the loop asks for it costs no wake-up.
On small batches (a table of a few hundred bytes per row) the GIL hand-offs
of a Python producer cost more than the copy itself, and waking a thread on
another CPU of a virtual machine costs tens of microseconds.

When every operation is reentrant (keeps no per-thread state, so that two
threads may run it on two batches at once) and the batch the loop needs next
is not ready and no producer has started it (a producer claims each batch with
an atomic compare-and-swap before making it), the loop makes it itself with the
same compiled loop rather than sleep until a producer wakes up: the first batch
of every epoch, and batches a sleeping producer would be late for. The
producer skips a batch claimed so. While a producer makes the batch the loop
needs, the loop makes later batches no producer has started (within the
batches whose slots are free), then hands them over in order: when the loader
is the bottleneck, the loop's thread is one more worker instead of a sleeper
woken once a batch.

The next epoch's ``RANDOM`` order is shuffled by producer 0, a piece with each
of its batches and more while it waits for a token, so that ``iter()`` finds it
(nearly) done.

The loop (:class:`CompiledEpoch`, the consumer) does what needs Python, once
per batch: it checks, before letting a producer write a slot, that no batch the
user kept still uses that slot's memory (else the slot gets fresh memory and
the producer its new address), wraps the outputs as tensors, and turns a
failed batch into the same :class:`~stoker.errors.LoaderError` as the Python
producers (by running that batch again step by step). A compiled operation
that returns other memory than its slot's, or a loop that does not compile,
makes the epoch go on with the Python producers from that batch (and this
loader never tries again).

Used only when it applies (:func:`plan`): Linux, CPU memory, no random
operation, no bounded cache, not the workqueue layer; and, checked at each
epoch by the loader, metadata validated. ``STOKER_COMPILED_EPOCH=0`` turns it off.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from stoker.errors import LoaderError
from stoker.loader._epoch import _LIVE_EPOCHS, Epoch, _EpochIterator, _layer_is_workqueue, set_producer_threads
from stoker.pipeline import native
from stoker.pipeline.cache import load_cached
from stoker.pipeline.compiler import Compiler
from stoker.pipeline.graph import _NO_SEEDS, FieldPipeline
from stoker.pipeline.random import shuffle_steps

if TYPE_CHECKING:
    from stoker.loader._epoch import _Producers
    from stoker.loader.loader import Loader
    from stoker.loader.order import PreparedOrder

_PENDING, _DONE, _FAILED, _FALLBACK = 0, 1, 2, 3
#: steps of the next epoch's shuffle a producer does between two looks at its tokens (about 3 us)
_SHUFFLE_PIECE = 1024
_NO_ORDER, _NOTHING_AT = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)  # no shuffle to do (at 0: never written)
#: when the batch the loop needs is not ready and no producer has started it, the loop makes it itself (tests turn it off)
MAKE_WHEN_WAITING = True
_generated = 0


@dataclass
class Plan:
    """A loader's compiled epoch loop and how to call it.

    Attributes:
        loop: the compiled producer loop (see :func:`_source`).
        memory: per field, the indices (into the field's steps) of the compiled steps' memory passed to the loop.
        columns: per field, its first column in the slot address table (one column per entry of ``memory``).
        shapes: the shape of each memory passed to the loop (a slot's), in the order of the address table.
    """

    loop: Any
    memory: list[list[int]]
    columns: list[int]
    shapes: list[tuple[int, ...]]

    @property
    def width(self) -> int:
        """Columns of the slot address table."""
        return sum(len(m) for m in self.memory)


def _enabled() -> bool:
    return os.environ.get("STOKER_COMPILED_EPOCH", "1") != "0"


def _is_dispatcher(fn: Any) -> bool:
    from numba.core.registry import CPUDispatcher

    return isinstance(fn, CPUDispatcher)


def _numpy_type(dtype: np.dtype[Any]) -> str | None:
    if dtype.fields is not None or dtype.subdtype is not None or dtype.kind not in "biuf":
        return None
    return f"np.{dtype.type.__name__}"


def plan(loader: Loader) -> Plan | None:
    """The compiled epoch loop for ``loader``'s pipelines, or ``None`` when it does not apply (see the module)."""
    from stoker.transforms.tensor import ToTensor

    if not (_enabled() and native.available()) or loader._cuda is not None or not loader.os_cache or _layer_is_workqueue():
        return None
    pipelines: list[FieldPipeline] = loader.pipelines
    if not pipelines:
        return None
    memory: list[list[int]] = []
    np_types: list[list[str | None]] = []
    sizes: list[tuple[int, ...]] = []
    for p in pipelines:
        k = len(p.jit_steps)
        if k == 0 or any(not s.jit for s in p.steps[:k]) or any(type(s.op) is not ToTensor for s in p.steps[k:]):
            return None
        if any(s.uses_seeds for s in p.jit_steps):
            return None
        if not _is_dispatcher(p.compiled_code()):  # Compiler disabled: the operations run as Python
            return None
        views = p._views[0]
        used = [j for j in range(k) if views[j] is not None]
        if k - 1 not in used:  # the output is the last compiled step's memory
            return None
        for j in used:
            for slot_views in p._views:
                v = slot_views[j]
                if not isinstance(v, np.ndarray) or not v.flags.c_contiguous or _numpy_type(v.dtype) is None:
                    return None
        memory.append(used)
        np_types.append([_numpy_type(views[j].dtype) for j in used])
        sizes += [tuple(int(d) for d in views[j].shape) for j in used]
    columns = [int(c) for c in np.cumsum([0] + [len(m) for m in memory])[:-1]]
    # a producer with one thread of its own runs every operation serially (a parallel region would only add a hand-off)
    serial = max(1, loader.num_workers // loader._producers) == 1
    loop = _compile(pipelines, memory, columns, np_types, serial)
    return Plan(loop, memory, columns, sizes)


def _source(pipelines: list[FieldPipeline], memory: list[list[int]], columns: list[int], np_types: list[list[str | None]]) -> str:
    """The producer loop: batches ``first, first + step, ...`` of the epoch, every field, then a signal per batch."""
    fields = ", ".join(f"a{i}, st{i}" for i in range(len(pipelines)))
    sizes = "".join(f", shape{i}_{j}" for i in range(len(pipelines)) for j in memory[i])  # run-time values: one build for all batch sizes
    lines = [
        "# generated by stoker: a loader's producer loop (stoker.loader._compiled_epoch)",
        "import numba",
        "import numpy as np",
        "",
        "",
        "def epoch_loop(order, batch_size, first, step, n_batches, skip, slot_base, num_slots, addresses, tokens, ready, stop,"
        f" status, claims, spent, next_order, next_key, next_at, no_seeds, {fields}{sizes}):",
        "    total = order.shape[0]",
        "    claimed = claims.ctypes.data",
        "    # the next epoch's shuffle, spread over this producer's batches (a producer that never waits still does it)",
        "    mine = max(1, (n_batches - first + step - 1) // step)",
        "    piece = (next_at[0] + mine - 1) // mine",
        "    for b in range(first, n_batches, step):",
        "        if tokens != 0:  # a producer: a token per batch, then the batch unless the loop has made it itself",
        "            t0 = monotonic_ns()",
        "            shuffling = 0",
        "            waiting = 1",
        "            while next_at[0] > 0:  # no token yet: shuffle a piece of the next epoch's order meanwhile",
        "                if sem_trywait(tokens) == 0:",
        "                    waiting = 0",
        "                    break",
        "                s0 = monotonic_ns()",
        f"                next_at[0] = shuffle_steps(next_order, next_key, next_at[0], {_SHUFFLE_PIECE})",
        "                shuffling += monotonic_ns() - s0",
        "            if waiting != 0:",
        "                sem_wait(tokens)",
        "            t1 = monotonic_ns()",
        "            spent[0] += t1 - t0 - shuffling",
        "            if stop[0] != 0:",
        "                return",
        "            if next_at[0] > 0:  # (not counted as waiting nor as any field's time)",
        "                next_at[0] = shuffle_steps(next_order, next_key, next_at[0], piece)",
        "                t1 = monotonic_ns()",
        "            if compare_and_swap(claimed + 4 * b, 0, 1) != 0:",
        "                continue",
        "        else:  # the loop's own batch, already claimed",
        "            t1 = monotonic_ns()",
        "        lo = b * batch_size",
        "        hi = min(lo + batch_size, total)",
        "        n = hi - lo",
        "        idx = order[lo:hi]",
        "        slot = (slot_base + b - skip) % num_slots",
    ]
    for i, p in enumerate(pipelines):
        k = len(p.jit_steps)
        names = {}
        for c, (j, np_type) in enumerate(zip(memory[i], np_types[i], strict=True)):
            names[j] = f"d{i}_{j}"
            lines.append(
                f"        d{i}_{j} = numba.carray(address_as_pointer(addresses[slot, {columns[i] + c}]), shape{i}_{j}, {np_type})[:n]"
            )
        dsts = [names.get(j, "None") for j in range(k)]
        if p.fused is not None:
            call = f"f{i}(idx, a{i}, st{i}, {', '.join(dsts + ['no_seeds'] * k)})"
        else:
            call = f"f{i}(idx, {dsts[0]}, a{i}, st{i}, no_seeds)"
        out = names[k - 1]
        lines += [
            "        try:",
            f"            r{i} = {call}",
            "        except Exception:",
            f"            status[b] = {_FAILED}",
            "            if ready != 0:",
            "                sem_post(ready)",
            "            return",
            f"        if r{i}.ctypes.data != {out}.ctypes.data or r{i}.shape != {out}.shape or r{i}.strides != {out}.strides:",
            f"            status[b] = {_FALLBACK}",
            "            if ready != 0:",
            "                sem_post(ready)",
            "            return",
            f"        t{i + 2} = monotonic_ns()",
            f"        spent[{i + 1}] += t{i + 2} - t{i + 1}",
        ]
    lines += [
        f"        status[b] = {_DONE}",
        "        if ready != 0:",
        "            sem_post(ready)",
        "    while next_at[0] > 0 and stop[0] == 0:  # the rest of the next epoch's order (the loop finishes it if stopped)",
        f"        next_at[0] = shuffle_steps(next_order, next_key, next_at[0], {_SHUFFLE_PIECE})",
        "",
    ]
    return "\n".join(lines)


def _compile(
    pipelines: list[FieldPipeline], memory: list[list[int]], columns: list[int], np_types: list[list[str | None]], serial: bool
) -> Any:
    global _generated
    import numba

    source = _source(pipelines, memory, columns, np_types)
    namespace: dict[str, Any] = {f"f{i}": p.compiled_code(serial) for i, p in enumerate(pipelines)}
    namespace.update(
        monotonic_ns=native.monotonic_ns,
        sem_wait=native.sem_wait,
        sem_post=native.sem_post,
        address_as_pointer=native.address_as_pointer,
        compare_and_swap=native.compare_and_swap,
        sem_trywait=native.sem_trywait,
        shuffle_steps=shuffle_steps,
    )
    cached = load_cached(source, namespace, "epoch_loop")
    if cached is not None:
        return cached
    _generated += 1
    namespace.update(numba=numba, np=np)
    exec(compile(source, f"<stoker producer loop {_generated}>", "exec"), namespace)
    return numba.njit(**Compiler.fused_options())(namespace["epoch_loop"])


def _cpus() -> int:
    """The CPUs this process may run on (tests pin it)."""
    from stoker.loader.loader import available_cpus

    return available_cpus()


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


class _Kept:
    """What a loader's compiled epochs keep from one epoch to the next: the slot address table and the semaphores.

    Only one epoch of a loader runs at a time, and its producers are idle before
    the next one starts, so the next one may set them again.
    """

    def __init__(self, plan_: Plan, num_slots: int, producers: int) -> None:
        self.plan = plan_
        self.addresses = np.zeros((num_slots, plan_.width), dtype=np.int64)
        self.generations: tuple[int, ...] = ()  # each pipeline's memory generation the table holds (none yet)
        self.producers = producers
        self.sems = native.Semaphores([0] * (2 * producers))

    @staticmethod
    def of(loader: Loader, plan_: Plan, producers: int) -> _Kept:
        """``loader``'s, made again with its plan (built with the pipelines, their slots and producers)."""
        kept: _Kept | None = loader._compiled_kept
        if kept is None or kept.plan is not plan_ or kept.producers != producers:
            kept = loader._compiled_kept = _Kept(plan_, loader._num_slots, producers)
        return kept


class _Shared:
    """What the producers of one compiled epoch share with its loop (never the loop itself: dropping it stops the epoch)."""

    def __init__(
        self,
        loader: Loader,
        plan_: Plan,
        order: np.ndarray,
        skip: int,
        slot_base: int,
        producers: int,
        ahead: int,
        next_order: PreparedOrder | None,
    ) -> None:
        kept = _Kept.of(loader, plan_, producers)
        self.plan = plan_
        self.order = order
        self.batch_size = loader.batch_size
        self.n_batches = -(-len(order) // loader.batch_size)
        self.skip, self.slot_base = skip, slot_base
        self.producers = producers
        self.ahead = ahead  # batches each producer may make ahead of the loop (its tokens)
        self.num_slots = loader._num_slots
        self.field_args = [x for p in loader.pipelines for x in (p.arrays, p.storage)]
        self.addresses = kept.addresses  # slot -> the address of each memory the loop writes (see CompiledEpoch)
        self.kept = kept
        self.status = np.zeros(max(1, self.n_batches), dtype=np.int8)
        self.claims = np.zeros(max(1, self.n_batches), dtype=np.int32)  # 1: a producer or the loop has started the batch
        self.stop = np.zeros(1, dtype=np.int64)
        # ns: waiting for a token, each field; one row per producer, the last for the batches the loop made itself
        self.spent = np.zeros((producers + 1, 1 + len(loader.pipelines)), dtype=np.int64)
        self.errors: list[BaseException | None] = [None] * producers
        self.sems = kept.sems
        self.sems.reset([self.ahead] * producers + [0] * producers)  # tokens, then ready batches
        # the next epoch's order, shuffled by producer 0 with its batches and while it waits for tokens (None: not prepared)
        self.next_order = next_order

    def shuffle_args(self, t: int) -> tuple[np.ndarray, np.uint64, np.ndarray]:
        """The next epoch's order for producer ``t`` to shuffle: producer 0's job, nothing for the others."""
        nxt = self.next_order
        if t != 0 or nxt is None:
            return _NO_ORDER, np.uint64(0), _NOTHING_AT
        return nxt.values, nxt.key, nxt.at


class _Job:
    """One producer's share of a compiled epoch: runs the loop once (in a kept producer thread)."""

    def __init__(self, shared: _Shared, t: int, num_threads: int, seconds: dict[str, dict[str, float]], wait: dict[str, float],
                 keys: list[tuple[str, str]]) -> None:  # fmt: skip
        self.shared, self.t, self.num_threads = shared, t, num_threads
        self.seconds, self.wait, self.keys = seconds, wait, keys

    def run(self) -> None:
        s, t = self.shared, self.t
        try:
            set_producer_threads(self.num_threads, s.batch_size)
            s.plan.loop(
                s.order, s.batch_size, s.skip + t, s.producers, s.n_batches, s.skip, s.slot_base, s.num_slots,
                s.addresses, s.sems.address(t), s.sems.address(s.producers + t), s.stop, s.status, s.claims, s.spent[t],
                *s.shuffle_args(t), _NO_SEEDS, *s.field_args, *s.plan.shapes,
            )  # fmt: skip
        except BaseException as exc:  # compiling or calling the loop failed (not an operation: those set a status)
            s.errors[t] = exc
            s.sems.post(s.producers + t)
        finally:
            spent = s.spent[t]
            self.wait["producer_waiting_for_consumer"] += float(spent[0]) / 1e9
            for i, (field, key) in enumerate(self.keys):
                self.seconds[field][key] += float(spent[1 + i]) / 1e9
            self.shared = None  # type: ignore[assignment]  # hold nothing of the epoch while idle


class CompiledEpoch(Epoch):
    """The loop's side of an epoch made by compiled producer loops (same contract as ``_EpochIterator``)."""

    def __init__(self, loader: Loader, plan_: Plan, epoch: int, skip: int, slot_base: int, pool: _Producers) -> None:
        self.epoch = epoch
        self.consumed = skip
        self.finished = False
        self._loader = loader  # keeps the loader (and its memory) alive while the epoch runs
        self._plan = plan_
        self._busy = threading.Lock()
        self._pid = os.getpid()
        self._wait = loader.wait_seconds
        self._pipelines = loader.pipelines
        # per field: its output (the last compiled step's memory) and the ToTensor steps applied to it here, each as its
        # code and where its seconds go
        seconds = loader._loop_seconds
        self._outputs = [
            (p, len(p.jit_steps) - 1, [(step.code, seconds[p.name], step.name) for step in p.steps[len(p.jit_steps) :]])
            for p in self._pipelines
        ]
        self._pool = pool
        self._delegate: Any = None
        order, _first_position = loader._epoch_share(epoch, prepared=True)
        nxt = loader._prepare_order(epoch + 1)
        # only reentrant operations may run on two batches at once (a JPEG decoder keeps a handle per thread of a batch)
        self._make_when_waiting = MAKE_WHEN_WAITING and loader._reentrant
        producers = producers_beside_loop(loader.num_workers, len(pool), self._make_when_waiting, _cpus())
        ahead = loader._tokens_per_producer * len(pool) // producers  # the same batches ahead in all, as many slots
        s = self._shared = _Shared(loader, plan_, np.ascontiguousarray(order), skip, slot_base, producers, ahead, nxt)
        if s.kept.generations != self._generations():  # memory changed since the table was filled (or never filled)
            for slot in range(s.num_slots):
                self._set_addresses(slot)
            s.kept.generations = self._generations()
        # each producer may make its first `ahead` batches at once: their slots must be free of kept batches
        for b in range(skip, min(s.n_batches, skip + s.producers * s.ahead)):
            self._free_slot(b)
        _LIVE_EPOCHS.add(self)
        threads_each = max(1, loader.num_workers // len(pool))  # the threads of each producer's operations (see plan())
        keys = self._keys = [(p.name, p._jit_key) for p in self._pipelines]
        self._own_error: BaseException | None = None
        self._made_ahead: set[int] = set()  # batches after the one being waited for, made by the loop meanwhile
        # the first batch: made by the loop's first next() (producers skip it), so the first batch does not wait for
        # a producer to wake up
        self._first_claimed = self._make_when_waiting and skip < s.n_batches and native.claim(s.claims, skip)
        for t in range(s.producers):
            pool.submit(t, _Job(s, t, threads_each, loader._producer_seconds[t], loader._producer_wait[t], keys))  # type: ignore[arg-type]

    # ---- slots -------------------------------------------------------------------------------
    def _slot(self, b: int) -> int:
        s = self._shared
        return (s.slot_base + b - s.skip) % s.num_slots

    def _generations(self) -> tuple[int, ...]:
        return tuple(p.memory_generation for p in self._pipelines)

    def _set_addresses(self, slot: int) -> None:
        for p, used, first in zip(self._pipelines, self._plan.memory, self._plan.columns, strict=True):
            views = p._views[slot]
            for c, j in enumerate(used):
                self._shared.addresses[slot, first + c] = views[j].ctypes.data

    def _free_slot(self, b: int) -> None:
        """Before batch ``b`` may be made: give its slot fresh memory where a kept batch still uses it."""
        slot = self._slot(b)
        renewed = False
        for p in self._pipelines:
            if p.slot_in_use(slot):
                p.renew_slot(slot)
                self._loader._held[0] += 1
                renewed = True
        if renewed:
            self._set_addresses(slot)
            self._shared.kept.generations = self._generations()

    # ---- the loop's side ---------------------------------------------------------------------
    def _from_delegate(self) -> tuple[Any, ...] | dict[str, Any]:
        try:
            return next(self._delegate)  # type: ignore[no-any-return]
        except StopIteration:
            self.finished = True
            raise

    def _next_batch(self) -> tuple[Any, ...] | dict[str, Any]:
        if self._loader._held[0]:  # first, before anything changes: a warning turned into an error loses no batch
            self._loader._note_held()
        if self._delegate is not None:
            return self._from_delegate()
        if self.finished:
            raise StopIteration
        c = self.consumed
        loader, s = self._loader, self._shared
        if c >= s.n_batches:
            self.close()
            loader._position = (self.epoch + 1, 0)
            raise StopIteration
        t = (c - s.skip) % s.producers
        if c == s.skip and self._first_claimed:  # claimed in __init__: no producer makes it
            self._make_here(c)
        elif c in self._made_ahead:  # made here while the loop waited for an earlier batch
            self._made_ahead.discard(c)
        elif not s.sems.try_wait(s.producers + t):
            if self._make_when_waiting and native.claim(s.claims, c):  # no producer has started it: make it here rather than sleep
                self._make_here(c)
            elif not (self._make_when_waiting and self._work_while_waiting(c, t)):
                t0 = time.perf_counter()
                s.sems.wait(s.producers + t)
                self._wait["consumer_waiting_for_producer"] += time.perf_counter() - t0
        status = int(s.status[c])
        if status != _DONE:
            return self._not_made(c, t, status)
        nxt = c + s.producers * s.ahead  # the batch the token given back lets producer t make
        if nxt < s.n_batches:
            self._free_slot(nxt)
        s.sems.post(t)
        slot = self._slot(c)
        bs = s.batch_size
        n = min(bs, len(s.order) - c * bs)
        outputs = []
        clock = time.perf_counter
        t1 = clock()
        for p, j, to_tensor in self._outputs:
            out: Any = p._views[slot][j]
            if n != len(out):
                out = out[:n]
            for code, field_seconds, name in to_tensor:
                out = code(out, None)
                t2 = clock()
                field_seconds[name] += t2 - t1
                t1 = t2
            outputs.append(out)
        if loader._extras:  # fresh tensors, never slot memory: a kept batch keeps its own
            outputs = loader._extras.add(self._pipelines, outputs, s.order[c * bs : (c + 1) * bs])
        self.consumed = c + 1
        loader._position = (self.epoch, c + 1)
        if loader.named:
            return dict(zip(loader.output_names, outputs))
        return tuple(outputs)

    def _work_while_waiting(self, c: int, t: int) -> bool:
        """While producer ``t`` makes batch ``c``: make later batches no producer has started; whether ``c`` became ready.

        Only batches whose slots are free (fewer than ``producers * ahead`` past ``c``).
        """
        s = self._shared
        hi = min(s.n_batches, c + s.producers * s.ahead)
        while True:
            b = native.claim_first(s.claims, c + 1, hi)
            if b < 0:
                return False
            self._make_here(b)
            self._made_ahead.add(b)
            if self._own_error is not None:  # the loop failed: wait for c (the failure surfaces at b)
                return False
            if s.sems.try_wait(s.producers + t):
                return True

    def _make_here(self, c: int) -> None:
        """Make batch ``c`` (claimed) in this thread, with the producers' compiled loop; its outcome goes to ``status[c]``.

        A producer that has not started its next batch (asleep, or still waking up: on a
        virtual machine that can take a millisecond) would make the loop wait longer than
        the batch takes to make; the producer skips a batch claimed here.
        """
        s = self._shared
        own = s.spent[s.producers]
        before = own.copy()
        try:
            s.plan.loop(
                s.order, s.batch_size, c, s.n_batches, s.n_batches, s.skip, s.slot_base, s.num_slots,
                s.addresses, 0, 0, s.stop, s.status, s.claims, own,
                _NO_ORDER, np.uint64(0), _NOTHING_AT, _NO_SEEDS, *s.field_args, *s.plan.shapes,
            )  # fmt: skip
        except BaseException as exc:  # compiling or calling the loop failed (an operation's failure sets the status)
            self._own_error = exc
            return
        self._loader._made_by_loop[0] += 1
        seconds = self._loader._loop_seconds
        for i, (field, key) in enumerate(self._keys):
            seconds[field][key] += float(own[1 + i] - before[1 + i]) / 1e9

    def _not_made(self, c: int, t: int, status: int) -> tuple[Any, ...] | dict[str, Any]:
        """Batch ``c`` was not made by the compiled loop: an operation failed, returned other memory, or the loop failed."""
        loader = self._loader
        error = self._own_error if self._own_error is not None else self._shared.errors[t]
        if status == _FALLBACK or (status == _PENDING and error is not None and _is_compile_error(error)):
            # go on with the Python producers from this batch; this loader does not try the compiled loop again
            self._stop_producers()
            loader._compiled_plan = False
            self._delegate = _EpochIterator(loader, self.epoch, c, self._slot(c))
            return self._from_delegate()
        if status == _FAILED:
            err: BaseException = self._locate(c)
        elif error is not None:
            err = LoaderError("*", "loader", None, f"{type(error).__name__}: {error}")
            err.__cause__ = error
        else:  # pragma: no cover - a producer signals only after setting a status or an error
            err = LoaderError("*", "loader", None, f"batch {c} was signalled but not made")
        self.close()
        loader.close()  # a failed epoch leaves no thread behind
        raise err

    def _locate(self, c: int) -> LoaderError:
        """Run failed batch ``c`` again in Python, field by field, to name the sample and the operation."""
        bs = self._shared.batch_size
        indices = self._shared.order[c * bs : (c + 1) * bs]
        where = np.arange(c * bs, c * bs + len(indices), dtype=np.int64)
        slot = self._slot(c)

        def seeds_fn(salt: int, positions: np.ndarray) -> np.ndarray:  # no operation here draws seeds (see plan())
            return _NO_SEEDS

        self._stop_producers()  # nothing else writes into the slots while the batch runs again
        for p in self._pipelines:
            try:
                p.run(indices, where, slot, seeds_fn, collections.defaultdict(float))
            except Exception as exc:
                err = p.locate_error(indices, where, slot, seeds_fn, exc)
                err.__cause__ = exc
                return err
        return LoaderError("*", "loader", None, f"batch {c} failed in compiled code but not when run again")

    def _stop_producers(self) -> None:
        s = self._shared
        if s.stop[0] != 0:
            return
        s.stop[0] = 1
        for t in range(s.producers):
            s.sems.post(t)  # wakes a producer waiting for a token: it sees the stop and returns
        self._pool.wait_idle()

    def close(self) -> None:
        """Stop the producers (they finish the batch they are making) and drop what is queued."""
        if self._delegate is not None:
            self._delegate.close()
        self.finished = True
        self._stop_producers()
        _LIVE_EPOCHS.discard(self)

    def __del__(self) -> None:
        # not contextlib.suppress: at interpreter exit modules may already be torn down (atexit stopped the producers)
        try:  # noqa: SIM105
            self.close()
        except Exception:
            pass


def _is_compile_error(exc: BaseException) -> bool:
    from numba.core.errors import NumbaError

    return isinstance(exc, NumbaError)
