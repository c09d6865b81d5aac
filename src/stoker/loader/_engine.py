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
(:mod:`stoker.loader._ring`):

* **compiled** (the rule): each producer makes its share of the epoch's
  batches in one ``nogil`` call of a generated loop (:func:`_source`), waiting
  for tokens and signalling batches through POSIX semaphores. Fields whose heads
  share one compiled function (a wide table's scalar columns) are made by one
  call site in a loop over the group, so the loop's compile time grows with the
  distinct pipelines, not with the fields;
* **Python**, one call per batch, where the head cannot run whole-epoch: the
  bounded cache of ``os_cache=False`` (each batch's bytes acquired and
  released), lazily validated metadata (checked per batch before compiled code
  reads it), numba's workqueue layer, operations run as Python
  (``compile=False``), or a head whose memory is not plain numpy.

When the batch the loop needs is not ready and no producer has started it, and
every operation is reentrant, the loop makes it itself (see
:meth:`Epoch._next_batch`): the first batch of every epoch, and batches a
sleeping producer would be late for.

The next epoch's ``RANDOM`` order is shuffled by compiled producer 0, a piece
with each of its batches and while it waits for a token.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np

from stoker._threads import available_cpus, interrupts_blocked
from stoker.device._stream import issuing
from stoker.errors import CacheFullError, DatasetFormatError, LoaderError, RemoteError, StokerError
from stoker.format import _verify
from stoker.loader import _accounting
from stoker.loader._accounting import HEAD_COLUMNS, READ_COLUMN
from stoker.loader._epoch import _WORKQUEUE_LOCK, Epoch, _layer_is_workqueue, set_producer_threads
from stoker.loader._graph import _NO_SEEDS, FieldPipeline
from stoker.loader._ring import DONE, FAILED, FALLBACK, PENDING, End, RingMemory, SlotRing
from stoker.loader.distributed import positions_of
from stoker.observe import _trace
from stoker.observe._recorder import BLOCKED, LOOP_MADE, M_DONE, M_START, MAKER, ROWS, STEP_FIXED, T_ENTER, T_EXIT, T_READY
from stoker.pipeline import linking, native, warm
from stoker.pipeline.cache import load_cached
from stoker.pipeline.compiler import Compiler
from stoker.pipeline.random import mix64, sample_seeds, shuffle_steps

if TYPE_CHECKING:
    from stoker.dataset.sharded import ShardedReader
    from stoker.loader._epoch import _Producers
    from stoker.loader.loader import Loader

#: steps of the next epoch's shuffle a producer does between two looks at its tokens (about 3 us)
_SHUFFLE_PIECE = 1024
_NO_ORDER, _NOTHING_AT = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)  # no shuffle to do (at 0: never written)
#: when the batch the loop needs is not ready and no producer has started it, the loop makes it itself (tests turn it off)
MAKE_WHEN_WAITING = True
_generated = 0
#: the loops generated in this process, by source and compiled functions: one per fingerprint, never loaded twice
_LOOPS: dict[tuple[Any, ...], Any] = {}
_LOOPS_LOCK = threading.Lock()


@dataclass
class Group:
    """Fields whose heads one call site of the compiled loop makes: the same compiled function and argument types.

    Attributes:
        fields: the fields' positions among the loader's pipelines.
        memory: the head's steps whose memory the loop writes (indices into the steps; the same for every field).
        seeded: the head's steps that draw random seeds.
        column: the group's first column in the slot address table (field ``q``'s memory ``c`` is at
            ``column + q * len(memory) + c``).
    """

    fields: list[int]
    memory: list[int]
    seeded: list[int]
    column: int


class LoopCalls(Protocol):
    """What :meth:`Plan.usable` needs of an epoch's batches (a producers' ``_Batches``): the fields and the loop's argument types."""

    pipelines: list[FieldPipeline]

    def loop_types(self) -> tuple[Any, ...]: ...


@dataclass
class Plan:
    """How a loader's epochs make their batches' heads.

    Attributes:
        loop: the compiled producer loop (see :func:`_source`); ``None``: Python producers, one call per batch.
        why: why there is no compiled loop (``""`` when there is one).
        groups: the fields, grouped by compiled function (compiled loop only).
        width: columns of the slot address table.
        outputs: per field, the step whose slot memory holds the head's output (compiled loop only).
    """

    loop: Any = None
    why: str = ""
    groups: list[Group] = field(default_factory=list)
    width: int = 0
    outputs: list[int] = field(default_factory=list)
    #: the loop is compiled in this process (or in the disk cache) for the arguments epochs call it with
    ready: bool = False
    #: the loop's compilation on a thread of its own, while Python producers make the batches (see :meth:`usable`)
    background: warm.Background | None = None

    def usable(self, batches: LoopCalls) -> bool:
        """Whether ``batches``' epoch runs the compiled loop; if it is not compiled yet, start compiling it.

        A loop neither compiled in this process nor cached on disk is compiled on a
        thread of its own, started once the epoch's first batch is made (by the Python
        producers, which make this epoch's batches: the same batches); a later epoch
        that starts once it is done runs it. ``STOKER_COMPILE_IN_BACKGROUND=0``: it
        is compiled at its first call, before the first batch, as before.
        """
        if self.loop is None:
            return False
        if self.ready:
            return True
        if self.background is not None:
            if not self.background.done():
                return False
            if self.background.error is not None:  # the same batches from Python producers, for the rest of this loader
                self.why = f"the producer loop did not compile ({type(self.background.error).__name__})"
                return False
            self.ready = True
            return True
        argtypes = batches.loop_types()
        if not warm.in_background() or warm.state(self.loop, argtypes) != "missing":
            self.ready = True
            return True
        fields = ", ".join(f"'{p.name}'" for p in batches.pipelines)
        self.background = warm.Background(self.loop, argtypes, f"the producer loop of fields {fields}")
        return False


def _enabled() -> bool:
    return os.environ.get("STOKER_COMPILED_EPOCH", "1") != "0"


def _is_dispatcher(fn: Any) -> bool:
    from numba.core.registry import CPUDispatcher

    return isinstance(fn, CPUDispatcher)


def _numpy_type(dtype: np.dtype[Any]) -> str | None:
    if dtype.fields is not None or dtype.subdtype is not None or dtype.kind not in "biuf":
        return None
    return f"np.{dtype.type.__name__}"


def python_plan(why: str) -> Plan:
    return Plan(None, why)


def _signature(p: FieldPipeline, memory: list[int]) -> tuple[Any, ...]:
    """What must be equal for two fields to share a call site: the function, its arguments' types, the memory's."""
    import numba

    views = p._views[0]
    return (
        id(p.compiled_code()),
        str(numba.typeof(p.arrays)),
        str(numba.typeof(p.storage)),
        (p.storage.ctypes.data, p.storage.shape),  # one storage for the group
        tuple((str(views[j].dtype), views[j].ndim) for j in memory),
        tuple(s.uses_seeds for s in p.jit_steps),
        p.fused is not None,
    )


def plan(loader: Loader) -> Plan:
    """The compiled producer loop for ``loader``'s pipelines, or a plan of Python producers saying why not."""
    if not _enabled():
        return python_plan("STOKER_COMPILED_EPOCH=0")
    if not native.available():
        return python_plan("not Linux")
    if not loader.os_cache:
        return python_plan("os_cache=False (the bounded cache holds each batch's bytes)")
    if _layer_is_workqueue():
        return python_plan("numba's workqueue threading layer")
    pipelines: list[FieldPipeline] = loader.pipelines
    if not pipelines:
        return python_plan("no field")
    memories: list[list[int]] = []
    for p in pipelines:
        k = len(p.jit_steps)
        if k == 0:
            return python_plan(f"field '{p.name}' has no compiled step")
        if not _is_dispatcher(p.compiled_code()):
            return python_plan("operations run as Python (compile=False)")
        views = p._views[0]
        used = [j for j in range(k) if views[j] is not None]
        if not used:  # the output is the memory of the last compiled step that asks for some (later ones work in place)
            return python_plan(f"field '{p.name}': no compiled step asks for memory")
        for j in used:
            for slot_views in p._views:
                v = slot_views[j]
                if not isinstance(v, np.ndarray) or not v.flags.c_contiguous or _numpy_type(v.dtype) is None:
                    return python_plan(f"field '{p.name}': memory of step {j} is not a contiguous numpy array of numbers")
        memories.append(used)
    groups: list[Group] = []
    by_signature: dict[tuple[Any, ...], Group] = {}
    for i, (p, used) in enumerate(zip(pipelines, memories, strict=True)):
        sig = _signature(p, used)
        group = by_signature.get(sig)
        if group is None:
            seeded = [j for j, s in enumerate(p.jit_steps) if s.uses_seeds]
            group = by_signature[sig] = Group([], used, seeded, 0)
            groups.append(group)
        group.fields.append(i)
    column = 0
    for group in groups:
        group.column = column
        column += len(group.fields) * len(group.memory)
    # a producer with one thread of its own runs every operation serially (a parallel region would only add a hand-off)
    serial = max(1, loader.num_workers // loader._producers) == 1
    try:
        loop = _compile(pipelines, groups, serial)
    except Exception as exc:  # a loop that does not compile: the same batches, made by Python producers
        return python_plan(f"the producer loop did not compile ({type(exc).__name__})")
    return Plan(loop, "", groups, column, [max(used) for used in memories])


def _source(pipelines: list[FieldPipeline], groups: list[Group]) -> str:
    """The producer loop: batches ``first, first + step, ...`` of the epoch, every group of fields, a signal per batch."""
    args = "".join(f", a{g}, st{g}, fi{g}, sb{g}" + "".join(f", sh{g}_{j}" for j in group.memory) for g, group in enumerate(groups))
    lines = [
        "# generated by stoker: a loader's producer loop (stoker.loader._engine)",
        "import numba",
        "import numpy as np",
        "",
        "",
        "def epoch_loop(order, batch_size, first, step, n_batches, skip, slot_base, num_slots, addresses, tokens, ready, stop,"
        " status, claims, spent, next_order, next_key, next_at, runs, seeds, v_on, v_bad, vss, vcb, vcs, vhb, vbb, vds,"
        f" vde, vbs, vcrc, vmap, vcnt, vst, marks, mark_base{args}):",
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
        "        run0 = np.searchsorted(runs[:, 0], lo, side='right') - 1  # the run of global positions batch b starts in",
        "        slot = (slot_base + b - skip) % num_slots",
        "        mrow = (mark_base + b) % marks.shape[0]  # the batch's row of the loader's accounting (stoker.observe)",
        f"        marks[mrow, {M_START}] = t1",
        f"        marks[mrow, {READ_COLUMN}] = 0",
        "        if v_on != 0:  # the data blocks the batch reads, checked against their CRCs once per process (format._verify)",
        "            g = check_samples(idx, False, vss, vcb, vcs, vhb, vbb, vds, vde, vbs, vcrc, vmap, vcnt, vst, True)",
        "            if g >= 0:",
        "                v_bad[b] = g",
        f"                status[b] = {FAILED}",
        "                if ready != 0:",
        "                    sem_post(ready)",
        "                return",
        "            t2 = monotonic_ns()  # (the check's time counts as reading, not as the first field's)",
        f"            marks[mrow, {READ_COLUMN}] = t2 - t1",
        "            t1 = t2",
    ]
    for g, group in enumerate(groups):
        p = pipelines[group.fields[0]]
        k = len(p.jit_steps)
        width = len(group.memory)
        np_types = {j: _numpy_type(p._views[0][j].dtype) for j in group.memory}
        lines.append(f"        for q in range(len(fi{g})):  # fields {[pipelines[i].name for i in group.fields]}")
        for c, j in enumerate(group.memory):
            lines.append(
                f"            d{j} = numba.carray(address_as_pointer(addresses[slot, {group.column + c} + q * {width}]), "
                f"({''.join(f'sh{g}_{j}[q, {d}], ' for d in range(p._views[0][j].ndim))}), {np_types[j]})[:n]"
            )
        seeds = []
        for row in range(len(group.seeded)):  # this field's seeds for each seeded step: mix64(base ^ position), as sample_seeds
            lines += [  # a sample's global position: the start of its run (distributed.Share.runs) plus its offset in it
                f"            base = sb{g}[q, {row}]",
                "            j = run0",
                "            for s in range(n):",
                "                while j + 1 < runs.shape[0] and runs[j + 1, 0] <= lo + s:",
                "                    j += 1",
                f"                seeds[{row}, s] = mix64(base ^ np.uint64(runs[j, 1] + lo + s - runs[j, 0]))",
            ]
        for j in range(k):
            seeds.append(f"seeds[{group.seeded.index(j)}, :n]" if j in group.seeded else "no_seeds")
        dsts = [f"d{j}" if j in group.memory else "None" for j in range(k)]
        if p.fused is not None:
            call = f"f{g}(idx, a{g}[q], st{g}, {', '.join(dsts + seeds)})"
        else:
            call = f"f{g}(idx, {dsts[0]}, a{g}[q], st{g}, {seeds[0]})"
        out = f"d{max(group.memory)}"  # the head's output: steps after the last one with memory work in place
        lines += [
            "            try:",
            f"                r = {call}",
            "            except Exception:",
            f"                status[b] = {FAILED}",
            "                if ready != 0:",
            "                    sem_post(ready)",
            "                return",
            f"            if r.ctypes.data != {out}.ctypes.data or r.shape != {out}.shape or r.strides != {out}.strides:",
            f"                status[b] = {FALLBACK}",
            "                if ready != 0:",
            "                    sem_post(ready)",
            "                return",
            "            t2 = monotonic_ns()",
            f"            spent[1 + fi{g}[q]] += t2 - t1",
            f"            marks[mrow, {HEAD_COLUMNS} + fi{g}[q]] = t2 - t1",
            "            t1 = t2",
        ]
    lines += [
        f"        marks[mrow, {M_DONE}] = t1",
        f"        status[b] = {DONE}",
        "        if ready != 0:",
        "            sem_post(ready)",
        "    while next_at[0] > 0 and stop[0] == 0:  # the rest of the next epoch's order (the loop finishes it if stopped)",
        f"        next_at[0] = shuffle_steps(next_order, next_key, next_at[0], {_SHUFFLE_PIECE})",
        "",
    ]
    return "\n".join(lines)


def _compile(pipelines: list[FieldPipeline], groups: list[Group], serial: bool) -> Any:
    """The compiled producer loop: one per process for the same source and functions (cached on disk too)."""
    global _generated
    import numba

    source = _source(pipelines, groups)
    functions = [pipelines[g.fields[0]].compiled_code(serial) for g in groups]
    memo = (source, repr(sorted(Compiler.fused_options().items())), *map(id, functions))
    with _LOOPS_LOCK:
        loop = _LOOPS.get(memo)
        if loop is not None:
            return loop[0]
        # the heads and the library's kernels are called by symbol: their code is compiled (or loaded) on its own
        namespace: dict[str, Any] = {f"f{g}": linking.swap(fn) for g, fn in enumerate(functions)}
        namespace.update(
            monotonic_ns=native.monotonic_ns,
            sem_wait=native.sem_wait,
            sem_post=native.sem_post,
            address_as_pointer=native.address_as_pointer,
            compare_and_swap=native.compare_and_swap,
            sem_trywait=native.sem_trywait,
            shuffle_steps=linking.swap(shuffle_steps),
            mix64=mix64,
            no_seeds=_NO_SEEDS,
            check_samples=linking.swap(_verify.kernel()),
        )
        loop = load_cached(source, namespace, "epoch_loop")
        if loop is None:
            _generated += 1
            namespace.update(numba=numba, np=np)
            exec(compile(source, f"<stoker producer loop {_generated}>", "exec"), namespace)
            loop = numba.njit(**Compiler.fused_options())(namespace["epoch_loop"])
        _LOOPS[memo] = (loop, functions)  # (the functions stay alive with the memo: their ids stay unique)
        return loop


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


def _cpus() -> int:
    """The CPUs this process may run on (tests pin it)."""
    return available_cpus()


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

    def __init__(self, loader: Loader, plan_: Plan, order: np.ndarray, runs: np.ndarray, epoch: int, ring: SlotRing) -> None:
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
        self.compiled = plan_.usable(self)
        if not self.compiled and plan_.background is not None and not plan_.background.started:
            self.after_first = plan_.background.start

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
        self, first: int, step: int, tokens: int, ready: int, spent: np.ndarray, shuffle: tuple[Any, ...], seeds: np.ndarray
    ) -> tuple[Any, ...]:
        r = self.ring
        return (
            self.order, self.batch_size, first, step, r.n_batches, r.skip, r.slot_base, r.num_slots, r.memory.addresses,
            tokens, ready, r.stop, r.status, r.claims, spent, *shuffle, self.runs, seeds, int(self.check is not None),
            self.bad, *self.verify_args, self.marks, self.mark_base, *self.field_args,
        )  # fmt: skip

    def loop_types(self) -> tuple[Any, ...]:
        """The Numba types of the loop's arguments (the same for every call of an epoch, and of every epoch)."""
        import numba

        spent = np.zeros(1 + len(self.pipelines), dtype=np.int64)
        args = self.loop_args(0, 1, 0, 0, spent, (_NO_ORDER, np.uint64(0), _NOTHING_AT), self.seeds_buffer())
        return tuple(numba.typeof(a) for a in args)

    def run_loop(
        self, first: int, step: int, tokens: int, ready: int, spent: np.ndarray, shuffle: tuple[Any, ...], seeds: np.ndarray
    ) -> None:
        self.plan.loop(*self.loop_args(first, step, tokens, ready, spent, shuffle, seeds))

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
        self.outputs[b] = outputs
        marks[M_DONE] = clock()
        ring.finish(b, DONE)
        start, self.after_first = self.after_first, None
        if start is not None:
            start()


class _Job:
    """One producer's share of an epoch: runs in a kept producer thread (holds the batches, never the Epoch)."""

    def __init__(self, batches: _Batches, t: int, num_threads: int, seconds: dict[str, dict[str, float]], wait: dict[str, float],
                 shuffle: tuple[Any, ...]) -> None:  # fmt: skip
        self.batches, self.t, self.num_threads = batches, t, num_threads
        self.seconds, self.wait, self.shuffle = seconds, wait, shuffle

    def run(self) -> None:
        s, t = self.batches, self.t
        ring = s.ring
        try:
            set_producer_threads(self.num_threads, s.batch_size)
            if s.compiled:
                spent = np.zeros(1 + len(s.pipelines), dtype=np.int64)
                try:
                    s.run_loop(ring.skip + t, ring.producers, ring.sems.address(t), ring.sems.address(ring.ready_index(t)), spent,
                               self.shuffle, s.seeds_buffer())  # fmt: skip
                finally:
                    self.wait["producer_waiting_for_consumer"] += float(spent[0]) / 1e9
                    for i, p in enumerate(s.pipelines):
                        self.seconds[p.name][p.head_key] += float(spent[1 + i]) / 1e9
            else:
                for b in range(ring.skip + t, ring.n_batches, ring.producers):
                    t0 = time.perf_counter()
                    go = ring.take_token(t)
                    self.wait["producer_waiting_for_consumer"] += time.perf_counter() - t0
                    if not go:
                        return
                    if not ring.claim(b):
                        continue
                    s.make_python(b, self.seconds)
                    ring.post_ready(t)
                    if ring.status[b] != DONE:
                        return
        except BaseException as exc:  # compiling or calling the loop failed (not an operation: those set a status)
            ring.producer_errors[t] = exc
            ring.post_ready(t)
        finally:
            self.batches = None  # type: ignore[assignment]  # hold nothing of the epoch while idle


class _TailError(Exception):
    """Field ``field``'s tail raised ``error`` on a batch (kept until the loop reaches that batch when it ran ahead)."""

    def __init__(self, field: int, error: Exception) -> None:
        super().__init__(field, error)
        self.field, self.error = field, error


class CompiledEpoch(Epoch):
    """The loop's side of an epoch: takes each batch from the ring in order and runs the fields' tails on it."""

    def __init__(self, loader: Loader, plan_: Plan, epoch: int, skip: int, slot_base: int, pool: _Producers) -> None:
        self.epoch = epoch
        self.consumed = skip
        self.finished = False
        self._loader = loader  # keeps the loader (and its memory) alive while the epoch runs
        self._busy = threading.Lock()
        self._pid = os.getpid()
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
        nxt = loader._prepare_order(self.epoch + 1) if compiled else None
        # only reentrant operations may run on two batches at once (a JPEG decoder keeps a handle per thread of a batch)
        self._make_when_waiting = MAKE_WHEN_WAITING and loader._reentrant and not _layer_is_workqueue()
        producers = producers_beside_loop(loader.num_workers, len(pool), self._make_when_waiting, _cpus())
        ahead = loader._tokens_per_producer * len(pool) // producers  # the same batches ahead in all, as many slots
        memory = loader._ring_memory
        if memory is None or not memory.fits(loader._num_slots, plan_.width, len(pool)):
            memory = loader._ring_memory = RingMemory(loader._num_slots, plan_.width, len(pool))
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
        schedule = getattr(loader.reader, "schedule", None)  # a dataset in object storage: download its shards in this order
        if schedule is not None:
            schedule(self._order, loader.batch_size, skip)
        self._loop_spent = np.zeros(1 + len(self._pipelines), dtype=np.int64)
        self._loop_seeds = s.seeds_buffer() if compiled else None
        self._made_ahead: set[int] = set()  # batches after the one being waited for, made by the loop meanwhile
        # the first batch: made by the loop's first next() (producers skip it), so the first batch does not wait for
        # a producer to wake up
        self._first_claimed = self._make_when_waiting and skip < self._n_batches and ring.claim(skip)
        pool.current = ring  # (stopped by the next epoch, close() or exit if this one is dropped without close(): see _Producers)
        threads_each = max(1, loader.num_workers // len(pool))  # the threads of each producer's operations (see plan())
        for t in range(producers):
            shuffle = (nxt.values, nxt.key, nxt.at) if (t == 0 and nxt is not None) else (_NO_ORDER, np.uint64(0), _NOTHING_AT)
            pool.submit(t, _Job(s, t, threads_each, loader._producer_seconds[t], loader._producer_wait[t], shuffle))  # type: ignore[arg-type]

    # ---- the loop's side ---------------------------------------------------------------------
    def _next_batch(self) -> tuple[Any, ...] | dict[str, Any]:
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
        t = maker = ring.producer_of(c)
        blocked = 0
        if c == ring.skip and self._first_claimed:  # claimed at the start: no producer makes it
            self._make_here(c)
            maker = LOOP_MADE
        elif c in self._made_ahead:  # made here while the loop waited for an earlier batch
            self._made_ahead.discard(c)
            maker = LOOP_MADE
        elif c in self._ready_seen:  # its ready signal was taken while the loop looked ahead (CUDA)
            self._ready_seen.discard(c)
        elif not ring.try_ready(t):
            if self._make_when_waiting and ring.claim(c):  # no producer has started it: make it here rather than sleep
                self._make_here(c)
                maker = LOOP_MADE
            elif not (self._make_when_waiting and self._work_while_waiting(c, t)):
                t0 = time.perf_counter()
                ring.wait_ready(t)
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
                if not ring.try_ready(ring.producer_of(b)):
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
        i = 0
        try:
            for i, p, out_step, seconds, tail in self._tail_plan:
                views = p._views[slot]
                if heads is not None:
                    out = heads[i]
                else:
                    out = views[out_step]
                    if n != bs:
                        out = out[:n]
                if tail:
                    out = self._tail(c, p, views, n, out, tail, seconds)
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

        Only batches whose slots are free (fewer than ``producers * ahead`` past ``c``).
        """
        ring = self._ring
        hi = min(self._n_batches, c + ring.producers * ring.ahead)
        while True:
            b = native.claim_first(ring.claims, c + 1, hi)
            if b < 0:
                return False
            self._make_here(b)
            self._made_ahead.add(b)
            if self._own_error is not None or ring.status[b] != DONE:  # the loop failed: wait for c (the failure surfaces at b)
                return False
            if ring.try_ready(t):
                return True

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
                s.run_loop(c, self._n_batches, 0, 0, own, (_NO_ORDER, np.uint64(0), _NOTHING_AT), self._loop_seeds)  # type: ignore[arg-type]
        except Exception as exc:  # compiling or calling the loop failed (an operation's failure sets the status)
            self._own_error = exc
            return
        loader._made_by_loop[0] += 1
        seconds = loader._loop_seconds
        for i, p in enumerate(self._pipelines):
            seconds[p.name][p.head_key] += float(own[1 + i] - before[1 + i]) / 1e9

    def _not_made(self, c: int, t: int, status: int) -> tuple[Any, ...] | dict[str, Any]:
        """Batch ``c`` was not made: an operation failed, returned other memory, or the loop failed."""
        ring = self._ring
        error = self._own_error if self._own_error is not None else ring.producer_errors[t]
        if status == FALLBACK or (status == PENDING and error is not None and _is_compile_error(error)):
            # go on with Python producers from this batch; this loader does not try the compiled loop again
            self._stop_producers(End("closed"))
            why = "a compiled operation returned other memory than its slot's" if status == FALLBACK else "the loop failed to compile"
            self._loader._plan = python_plan(why)
            self._own_error = None
            self._begin(self._loader._plan, c, ring.slot(c))
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
                f"{self.consumed} of {self._n_batches} batches): the epoch ended there. loader.state_dict() records the "
                "last batch this loop received; iterate the loader again to go on"
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
