"""Planning and code generation: how a Loader's epochs make their batches' heads.

:func:`plan` groups the fields whose heads share one compiled function, and either generates and compiles one
producer loop for all of them (:func:`_source`: Python source from the plan, compiled by Numba once per fingerprint,
see :mod:`stoker.pipeline.cache`) or says why the epochs use Python producers instead (:func:`python_plan`).
The producers (:mod:`stoker.loader._producers`) run what is planned here; the consumer loop
(:mod:`stoker.loader._engine`) hands the batches over.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from stoker.format import _verify
from stoker.loader._accounting import HEAD_COLUMNS, READ_COLUMN
from stoker.loader._epoch import _layer_is_workqueue
from stoker.loader._graph import _NO_SEEDS, FieldPipeline
from stoker.loader._ring import DONE, FAILED, FALLBACK, LOOP_CLAIM
from stoker.observe._recorder import M_DONE, M_START
from stoker.pipeline import _ahead, linking, native, warm
from stoker.pipeline.cache import load_cached
from stoker.pipeline.compiler import Compiler
from stoker.pipeline.random import mix64, order_steps

if TYPE_CHECKING:
    from stoker.loader._view import LoaderView

logger = logging.getLogger("stoker")


#: steps of the next epoch's shuffle a producer does between two looks at its tokens (about 3 us)
_SHUFFLE_PIECE = 1024


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
    #: the loop's compilation in a child process (or a thread), while Python producers make the batches (see :meth:`usable`)
    background: warm.Background | None = None
    #: where an epoch went over from Python producers to the loop once its background compilation ended:
    #: ``(epoch, batch, seconds after the epoch's iter())`` (see ``CompiledEpoch._switch``), ``None``: it did not
    switched: tuple[int, int, float] | None = None
    #: tests only: the loop counts as still compiling before this batch of every epoch, as if its background
    #: compilation ended there (``None``: ask the compilation); the switch to it is the real one
    ready_at: int | None = None

    def usable(self, batches: LoopCalls, batch: int = 0) -> bool:
        """Whether ``batches``' epoch runs the compiled loop from batch ``batch`` on; if it is not compiled yet, start
        compiling it.

        A loop neither compiled in this process nor cached on disk is compiled in a
        child process of its own (:class:`~stoker.pipeline.warm.Background`), started once the epoch's first batch is made (by the Python
        producers, which make this epoch's batches: the same batches); the epoch goes
        over to it at the first batch boundary after it is done (the loop asks again
        every :data:`~stoker.loader._engine.SWITCH_LOOK_NS`), and later epochs run it
        from their first batch. ``STOKER_COMPILE_IN_BACKGROUND=0``: it is compiled at
        its first call, before the first batch, as before.
        """
        if self.loop is None:
            return False
        if self.ready_at is not None and batch < self.ready_at:
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


def plan(loader: LoaderView) -> Plan:
    """The compiled producer loop for ``loader``'s pipelines, or a plan of Python producers saying why not.

    The kernels the first batch compiles are compiled meanwhile in child processes too (:mod:`stoker.pipeline._ahead`).
    """
    planned = _plan(loader)
    if _ahead.children():  # (a $STOKER_COMPILE_CHILDREN that is not a number is an error naming it)
        with contextlib.suppress(Exception):  # (a call whose types cannot be told: compiled by the batch alone, as before)
            _ahead.start(_first_calls(loader.pipelines, unfused=planned.loop is not None))
    return planned


def _first_calls(pipelines: list[FieldPipeline], unfused: bool) -> list[_ahead.Call]:
    """The compiled calls of the first batch's heads (what :meth:`FieldPipeline.run_head` calls), with the argument
    types of the values it passes; an operation that is Python calling kernels: its compiled form, typed only to
    find the kernels it calls. A step's input is taken to be the memory of the step before (or its input)."""
    import numba

    calls = []
    indices = np.zeros(1, dtype=np.int64)  # (a slice of the epoch's order)
    for p in pipelines:
        if not p.jit_steps or not p._views:
            continue
        views = p._views[0]
        seeds = [np.zeros(1, dtype=np.uint64) if s.uses_seeds else _NO_SEEDS for s in p.steps]
        if p.fused is not None and not unfused:
            jit = [k for k, s in enumerate(p.steps) if s.jit]
            args = (indices, p.arrays, p.storage, *(views[k] for k in jit), *(seeds[k] for k in jit))
            calls.append(_ahead.Call(p.fused, tuple(numba.typeof(a) for a in args)))
            continue
        out = None
        for k in range(p.head):
            step = p.steps[k]
            code = step.python if unfused and step.python is not None else step.code
            args = p._args(step, out, views[k], indices, seeds[k])
            out = views[k] if views[k] is not None else out
            function = code if _is_dispatcher(code) else step.code
            if _is_dispatcher(function):
                calls.append(_ahead.Call(function, tuple(numba.typeof(a) for a in args), needed=function is code))
    return calls


def _plan(loader: LoaderView) -> Plan:
    warm.watch(loader.pipelines)  # (from here on, any thread's compiling of stoker's code before a batch is said, "n of m")
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
        " ctl, span, spin_ns, status, claims, spent, at, next_order, next_key, next_state, next_source, runs, seeds, v_on, v_bad, vss, vcb, vcs, vhb, vbb, vds,"
        f" vde, vbs, vcrc, vmap, vcnt, vst, marks, mark_base{args}):",
        "    total = order.shape[0]",
        "    claimed = claims.ctypes.data",
        "    # the ring's words (stoker.loader._ring): CONSUMED, LOOP_WAITS, this producer's SLEEPING and WAKE_AT",
        "    consumed_at = ctl.ctypes.data",
        "    loop_waits_at = consumed_at + 8 * 8",
        "    sleeping_at = consumed_at + 8 * (16 + 16 * (first - skip))",
        "    wake_at = sleeping_at + 8 * 8",
        "    stop_at = stop.ctypes.data",
        "    later = max(0, span // 2 - 1)  # woken when half the batches ahead are left (wake_after)",
        "    status_at = status.ctypes.data",
        "    # the next epoch's order (a copy of the indices, then its shuffle), spread over this producer's batches (a",
        "    # producer that never waits still makes it)",
        "    mine = max(1, (n_batches - first + step - 1) // step)",
        "    left = order_steps(next_order, next_source, next_state, next_key, 0)",
        "    for b in range(first, n_batches, step):",
        "        if tokens != 0:  # a producer: b once its slot is free (b < CONSUMED + span), unless the loop made it itself",
        "            t0 = monotonic_ns()",
        "            shuffling = 0",
        "            spin_end = t0 + spin_ns",
        "            while b >= atomic_load(consumed_at) + span and atomic_load(stop_at) == 0:",
        "                if left > 0:  # a piece of the next epoch's order meanwhile",
        "                    s0 = monotonic_ns()",
        f"                    left = order_steps(next_order, next_source, next_state, next_key, {_SHUFFLE_PIECE})",
        "                    shuffling += monotonic_ns() - s0",
        "                    continue",
        "                if monotonic_ns() < spin_end:",
        "                    continue",
        "                atomic_store(wake_at, b - span + 1 + later)  # then asleep (a full fence), then CONSUMED again",
        "                atomic_exchange(sleeping_at, 1)",
        "                if b < atomic_load(consumed_at) + span or atomic_load(stop_at) != 0:",
        "                    atomic_store(sleeping_at, 0)",
        "                    break",
        "                sem_wait(tokens)",
        "                atomic_store(sleeping_at, 0)",
        "                spin_end = monotonic_ns() + spin_ns",
        "            t1 = monotonic_ns()",
        "            spent[0] += t1 - t0 - shuffling",
        "            if atomic_load(stop_at) != 0:",
        "                return",
        "            if left > 0:  # (not counted as waiting nor as any field's time)",
        "                rest = mine - (b - first) // step  # this producer's batches left, b's included",
        "                left = order_steps(next_order, next_source, next_state, next_key, (left + rest - 1) // rest)",
        "                t1 = monotonic_ns()",
        "            if compare_and_swap(claimed + 4 * b, 0, 1) != 0:",
        "                continue",
        "        else:  # the loop's own batches: the first claimed already, the next ones claimed here (2: the loop's)",
        f"            if b != first and compare_and_swap(claimed + 4 * b, 0, {LOOP_CLAIM}) != 0:",
        "                continue",
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
        # the batch whose operations run: an exception one of them raises leaves the loop (a try/except here made the
        # loop's compilation about 1.6 times as long) and the caller fails this batch (``_Batches.run_loop``)
        "        at[0] = b",
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
            f"            r = {call}",
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
        "        at[0] = -1",
        f"        store_i8(status_at + b, {DONE})  # (a release store: the batch's memory is seen first)",
        "        fence()",
        "        if ready != 0 and atomic_load(loop_waits_at) == b:  # the loop sleeps for b",
        "            sem_post(ready)",
        "    while left > 0 and stop[0] == 0:  # the rest of the next epoch's order (the loop finishes it if stopped)",
        f"        left = order_steps(next_order, next_source, next_state, next_key, {_SHUFFLE_PIECE})",
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
            atomic_load=native.atomic_load,
            atomic_store=native.atomic_store,
            atomic_exchange=native.atomic_exchange,
            fence=native.fence,
            store_i8=native.store_i8,
            order_steps=linking.swap(order_steps),
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
