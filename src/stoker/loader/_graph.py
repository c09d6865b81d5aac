"""One field's pipeline: states declared, memory allocated, code compiled and fused.

Lifecycle: configure (a list of operations) -> build (declare states, compile,
fuse consecutive compiled operations into one function) -> allocate (memory per
batch slot) -> run (once per batch).
"""

from __future__ import annotations

import inspect
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from stoker.errors import LoaderError, PipelineError
from stoker.pipeline import linking, prebuilt
from stoker.pipeline.allocation_query import AllocationQuery, offset_array
from stoker.pipeline.cache import load_cached
from stoker.pipeline.compiler import Compiler
from stoker.pipeline.operation import Operation, SampleDecoder
from stoker.pipeline.state import State

if TYPE_CHECKING:
    from stoker.fields.base import Field
    from stoker.format.reader import Reader

SeedsFn = Callable[[int, np.ndarray], np.ndarray]
#: an operation's seeds when it draws none: read-only, as Numba types the same array read by a generated loop (a
#: global), so that a kernel has one signature whether Python or the loop calls it
_NO_SEEDS = np.zeros(0, dtype=np.uint64)
_NO_SEEDS.flags.writeable = False
_fused_ids = itertools.count()


def _is_dispatcher(value: Any) -> bool:
    import numba

    return isinstance(value, numba.core.dispatcher.Dispatcher)


def _arity(code: Callable[..., Any]) -> int:
    py = getattr(code, "py_func", code)
    try:
        params = inspect.signature(py).parameters.values()
    except (TypeError, ValueError):
        return 2
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in params)


@dataclass
class Step:
    """One operation of a built pipeline."""

    op: Operation
    code: Callable[..., Any]
    is_decoder: bool
    jit: bool
    arity: int
    query: AllocationQuery | None
    salt: int
    uses_seeds: bool
    #: the operation's code as Python calling compiled kernels (``Operation.wraps_kernels``), or a compiled kernel
    #: itself: what :meth:`FieldPipeline.run_head` calls, step by step, while the fused code is not compiled yet
    python: Callable[..., Any] | None = None
    #: the operation's per-sample code (:meth:`Operation.generate_sample_code`: a compiled function, or a decoder's
    #: :class:`~stoker.pipeline.operation.SampleDecoder`), or ``None``
    sample: Any = None

    @property
    def name(self) -> str:
        name = self.__dict__.get("_name")
        if name is None:
            name = self.__dict__["_name"] = repr(self.op)
        return name


_MEMORY_GENERATIONS = itertools.count(1)


def _is_torch_dtype(dtype: Any) -> bool:
    """Whether ``dtype`` is a ``torch.dtype`` (there is none unless torch was imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(dtype, torch.dtype)


_refs = sys.getrefcount


def _use_count(memory: Any) -> int:
    """How many references keep ``memory`` (one slot of one step) alive: a numpy owner's, or a torch storage's."""
    if isinstance(memory, np.ndarray):
        return sys.getrefcount(memory)
    import torch

    return int(torch._C._storage_Use_Count(memory.untyped_storage()._cdata))


class _TailCache:
    """A slot's tail output made once (:meth:`FieldPipeline.keep_tail`): a tensor viewing the slot's memory, its
    storage, and what :meth:`FieldPipeline.slot_in_use` compares, taken when only this object held them."""

    __slots__ = ("cdata", "out", "out_step", "refs", "storage", "storage_refs", "use", "uses", "version")

    def __init__(self, out: Any, storage: Any, out_step: int, use: Callable[[int], int]) -> None:
        self.out, self.storage, self.cdata, self.out_step, self.use = out, storage, storage._cdata, out_step, use
        self.refs = self.storage_refs = self.uses = self.version = -1  # (until counted: "in use", never wrongly free)


@dataclass
class FieldPipeline:
    """The built pipeline of one field.

    Memory is allocated per batch slot, one owner array (or tensor) per step
    and slot, so that the loader can tell whether anything outside it still
    uses a slot (a batch the user kept): :meth:`slot_in_use`.
    """

    name: str
    steps: list[Step]
    arrays: tuple[np.ndarray, ...]
    storage: np.ndarray
    fused: Callable[..., Any] | None
    final_state: State
    #: the fused function is one loop over samples (decided when the pipeline was built: ``STOKER_FUSE``)
    per_sample: bool = False

    def __post_init__(self) -> None:
        self.jit_steps: list[Step] = [s for s in self.steps if s.jit]
        #: steps run by the producer threads: the leading compiled ones (or the decoder alone, when it is Python)
        self.head = max(1, len(self.jit_steps))
        self._jit_key = "compiled[" + " + ".join(s.name for s in self.jit_steps) + "]"
        self._views: list[list[Any]] = []  # per slot, per step: the slot's memory (its only owner), or None
        self._baseline: list[list[int]] = []
        #: per slot, what :meth:`slot_in_use` counts the references of in one pass: the slot's numpy memory, and its
        #: cached tail output and that tensor's storage (see :meth:`_count`); ``None`` where some memory is a tensor
        self._counted: list[list[Any] | None] = []
        #: per slot, the output of its tail of views made once (see :meth:`keep_tail`), or ``None``
        self._tail_cache: list[_TailCache | None] = []
        self.memory_generation = 0  # a number no other memory of any pipeline had: changes whenever a slot gets new memory
        self._batch_size = 0
        self._pinned = False
        self._serial: Callable[..., Any] | None = None

    def compiled_code(self, serial: bool = False) -> Callable[..., Any] | None:
        """The function that runs the leading compiled steps (the fused one, or the only step's); ``None`` if there are none.

        Called as the fused function is (``indices, arrays, storage, *memory, *seeds``)
        or, for a single step, as a decoder (``indices, memory, arrays, storage, seeds``).

        Args:
            serial: the same without threads (see :func:`~stoker.pipeline.compiler.serial_twin`),
                for a caller that runs on one thread of its own.
        """
        from stoker.pipeline.compiler import serial_twin

        if not self.jit_steps:
            return None
        if not serial:
            return self.fused if self.fused is not None else self.jit_steps[0].code
        if self._serial is None:
            if self.fused is None:
                self._serial = serial_twin(self.jit_steps[0].code)
            elif self.per_sample:  # the same loop over samples, without threads
                self._serial = _fuse(self.name, self.jit_steps, serial=True, per_sample=True)
            else:
                twins = [replace(s, code=serial_twin(s.code)) for s in self.jit_steps]
                same = all(t.code is s.code for t, s in zip(twins, self.jit_steps, strict=True))
                self._serial = self.fused if same else _fuse(self.name, twins)
        return self._serial

    @property
    def wants_pinned(self) -> bool:
        return any(getattr(s.op, "is_cuda", False) for s in self.steps)

    @property
    def stage_names(self) -> list[str]:
        """The keys :meth:`run` adds times to."""
        return [self.head_key] + [s.name for s in self.steps[self.head :]]

    # ---- memory -----------------------------------------------------------------
    def slot_bytes(self, batch_size: int) -> int:
        """Bytes of one slot's memory for ``batch_size`` samples (every step that asks for memory)."""
        total = 0
        for step in self.steps:
            q = step.query
            if q is not None:
                try:
                    itemsize = np.dtype(q.dtype).itemsize  # a numpy dtype, or a type such as np.uint8
                except TypeError:
                    itemsize = q.dtype.itemsize  # a torch dtype
                total += batch_size * int(np.prod(q.shape, dtype=np.int64)) * int(itemsize)
        return total

    def _new_memory(self, step: Step) -> Any:
        q = step.query
        if q is None:
            return None
        shape = (self._batch_size, *q.shape)
        if q.device is None and not _is_torch_dtype(q.dtype) and not (self._pinned and step.jit):
            offset = getattr(q, "offset", 0)  # a query made like FFCV's, by another class, has none
            if offset:
                return offset_array(shape, q.dtype, offset)
            return np.empty(shape, dtype=np.dtype(q.dtype))  # numpy memory, without importing torch
        import torch

        if isinstance(q.dtype, torch.dtype):
            return torch.empty(shape, dtype=q.dtype, device=q.device or "cpu")
        if q.device is not None and torch.device(q.device).type != "cpu":
            from stoker.transforms.tensor import _torch_dtype

            return torch.empty(shape, dtype=_torch_dtype(q.dtype), device=q.device)
        if self._pinned and step.jit:
            from stoker.transforms.tensor import _torch_dtype

            return torch.empty(shape, dtype=_torch_dtype(q.dtype), pin_memory=True).numpy()
        return np.empty(shape, dtype=np.dtype(q.dtype))

    def allocate(self, num_slots: int, batch_size: int, pinned: bool) -> None:
        """Allocate each step's memory once per slot: ``(batch_size, *shape)`` each."""
        self._batch_size, self._pinned = batch_size, pinned
        self._views = [[] for _ in range(num_slots)]
        self._baseline = [[] for _ in range(num_slots)]
        self._counted = [None] * num_slots
        self._tail_cache = [None] * num_slots
        for slot in range(num_slots):
            self.renew_slot(slot)

    def renew_slot(self, slot: int) -> None:
        """Give slot ``slot`` fresh memory (the old memory stays with whoever still holds it)."""
        self._tail_cache[slot] = None  # (its tensor views the old memory)
        self._views[slot] = [self._new_memory(s) for s in self.steps]
        self._count(slot)
        self.memory_generation = next(_MEMORY_GENERATIONS)

    def slot_memory(self, slot: int) -> list[Any]:
        """Each step's memory in slot ``slot`` (``None`` for steps that need none)."""
        return list(self._views[slot])

    def _use_counts(self, slot: int) -> list[int]:
        counts = []
        for v in self._views[slot]:  # (counted as in slot_in_use: the same references to each memory)
            counts.append(0 if v is None else _use_count(v))
        return counts

    def _count(self, slot: int) -> None:
        """Take the counts :meth:`slot_in_use` compares, with nothing outside the loader holding the slot.

        Where every memory of the slot is numpy (or none), one list holds it, and the cached tail output and its
        storage (:meth:`keep_tail`): ``slot_in_use`` compares their reference counts in one loop (no call but
        ``sys.getrefcount`` per object), taken here the same way, with this list's references among them.
        """
        views = self._views[slot]
        if all(v is None or type(v) is np.ndarray for v in views):
            counted = [v for v in views if v is not None]
            e = self._tail_cache[slot]
            if e is not None:
                counted += (e.out, e.storage)
            self._counted[slot] = counted
            counts = []
            for obj in counted:  # (as slot_in_use counts them: the loop's variable holds one reference)
                counts.append(_refs(obj))
            self._baseline[slot] = counts
        else:  # (a tensor's memory: counted by its storage's uses, view by view)
            self._counted[slot] = None
            self._baseline[slot] = self._use_counts(slot)

    def slot_in_use(self, slot: int) -> bool:
        """Whether something outside the loader (a batch kept by the user) still uses slot ``slot``'s memory.

        With a cached tail output (:meth:`keep_tail`): also whether anything refers to the tensor (the batch's tuple,
        a dict, the tensor itself) or to its storage (a view of it: ``y[:10]``, ``y.view(-1)``, ``y.numpy()``,
        ``np.asarray(y)``, ``y.untyped_storage()``); the slot's memory counts alone miss those, as the tensor keeps
        its memory referred to once for all of them. A tensor changed in place while nothing holds it any more
        (``y.unsqueeze_(0)``, ``resize_``, ``requires_grad_()``: its version or its autograd flag moved) is dropped
        from the cache here (it is made again for the slot's next batch); the slot is not in use.
        """
        e = self._tail_cache[slot]
        counted = self._counted[slot]
        if counted is not None:  # numpy memory: one loop over the references (see _count), then the storage's uses
            baseline = self._baseline[slot]
            k = 0
            for obj in counted:
                if _refs(obj) != baseline[k]:
                    return True
                k += 1  # noqa: SIM113 (as _count counts: enumerate's reused tuple would hold obj)
            if e is not None and e.use(e.cdata) != e.uses:
                return True
        else:
            if e is not None and (_refs(e.out) != e.refs or _refs(e.storage) != e.storage_refs or e.use(e.cdata) != e.uses):
                return True
            baseline = self._baseline[slot]
            k = 0
            for v in self._views[slot]:  # once a batch: no list built (and no zip, whose reused tuple would hold v)
                if v is not None and _use_count(v) != baseline[k]:
                    return True
                k += 1  # noqa: SIM113 (enumerate's reused tuple would hold v: one more reference than the baseline counted)
        if e is not None and (e.out._version != e.version or e.out.requires_grad):
            del e  # (this frame's reference too: the tensor goes now, before the slot's memory is counted again)
            self.drop_tail(slot)
        return False

    def keep_tail(self, slot: int, out_step: int, box: list[Any]) -> Any:
        """Keep a full batch's tail output (``box``'s one item, taken out: the caller keeps no other reference to it)
        as slot ``slot``'s output for its next full batches, if it is a CPU tensor over the slot's memory (step
        ``out_step``'s, the head's output); returns it.

        Called by the loop for a tail of views only (:attr:`Operation.view_only
        <stoker.pipeline.operation.Operation.view_only>`): the same tensor, with the same shape, is what the tail
        would make of every full batch in this slot while its memory stays (:meth:`renew_slot` drops it). The counts
        :meth:`slot_in_use` compares are taken here, with nothing outside the cache holding the tensor yet.
        """
        out = box.pop()
        self._tail_cache[slot] = None
        memory = self._views[slot][out_step]
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(out, torch.Tensor) or not isinstance(memory, np.ndarray) or len(memory) != self._batch_size:
            return out
        try:
            # a view of the slot's memory (not a copy a step made after all), that autograd and inference mode leave alone
            if out.device.type != "cpu" or out.requires_grad or out.is_inference():
                return out
            storage = out.untyped_storage()
            if storage.data_ptr() != memory.ctypes.data:
                return out
            e = _TailCache(out, storage, out_step, torch._C._storage_Use_Count)
        except Exception:  # (a tensor subclass, a torch without the call: no cache)
            return out
        del out, storage, memory  # (the cache's references alone, counted as slot_in_use counts them)
        self._tail_cache[slot] = e
        self._count(slot)  # (the tensor keeps the slot's memory referred to, once)
        e.refs, e.storage_refs, e.uses, e.version = _refs(e.out), _refs(e.storage), e.use(e.cdata), e.out._version
        return e.out

    def drop_tail(self, slot: int) -> None:
        """Forget slot ``slot``'s cached tail output (nothing outside holds it: see :meth:`slot_in_use`)."""
        self._tail_cache[slot] = None
        self._count(slot)

    # ---- running ----------------------------------------------------------------
    def _args(self, step: Step, prev: Any, dst: Any, indices: np.ndarray, seeds: np.ndarray) -> tuple[Any, ...]:
        if step.is_decoder:
            return (indices, dst, self.arrays, self.storage, seeds)
        return (prev, dst, indices, seeds)[: max(2, min(step.arity, 4))]

    @staticmethod
    def _seeds(step: Step, seeds_fn: SeedsFn, positions: np.ndarray) -> np.ndarray:
        return seeds_fn(step.salt, positions) if step.uses_seeds else _NO_SEEDS

    @property
    def head_key(self) -> str:
        """The stage name the head's seconds are added to (see :attr:`stage_names`)."""
        return self._jit_key if self.jit_steps else self.steps[0].name

    def run(self, indices: np.ndarray, positions: np.ndarray, slot: int, seeds_fn: SeedsFn, seconds: dict[str, float]) -> Any:
        """Process one batch into slot ``slot``; returns the field's output; adds stage times to ``seconds``.

        Args:
            indices: the samples' indices in the file.
            positions: their positions in the epoch's order (the key of their random seeds).
            slot: the batch slot whose memory is written.
            seeds_fn: ``(salt, positions) -> uint64 seeds``.
            seconds: stage name -> seconds, added to.
        """
        out = self.run_head(indices, positions, slot, seeds_fn, seconds)
        return self.run_tail(out, indices, positions, slot, seeds_fn, seconds)

    def _slot_views(self, slot: int, n: int) -> list[Any]:
        views = self._views[slot]
        if n != self._batch_size:
            views = [None if v is None else v[:n] for v in views]
        return views

    def run_head(
        self, indices: np.ndarray, positions: np.ndarray, slot: int, seeds_fn: SeedsFn, seconds: dict[str, float], unfused: bool = False
    ) -> Any:
        """The producers' part of one batch (the first :attr:`head` steps) into slot ``slot``; returns its output.

        ``unfused``: step by step, each operation that allows it (:attr:`Step.python`) as Python calling its
        compiled kernels, so that nothing is compiled for it: the same batch as the fused code makes.
        """
        views = self._slot_views(slot, len(indices))
        t0 = time.perf_counter()
        if self.fused is not None and not unfused:
            seeds = [self._seeds(s, seeds_fn, positions) for s in self.jit_steps]
            out = self.fused(indices, self.arrays, self.storage, *views[: len(self.jit_steps)], *seeds)
        else:
            out = None
            for k in range(self.head):
                step = self.steps[k]
                code = step.python if unfused and step.python is not None else step.code
                out = code(*self._args(step, out, views[k], indices, self._seeds(step, seeds_fn, positions)))
        seconds[self.head_key] += time.perf_counter() - t0
        return out

    def run_tail(
        self, out: Any, indices: np.ndarray, positions: np.ndarray, slot: int, seeds_fn: SeedsFn, seconds: dict[str, float]
    ) -> Any:
        """The steps after the head (Python, once per batch: ``ToTensor``, ``ToDevice``, ``Squeeze``, modules) on ``out``."""
        steps = self.steps
        if len(steps) == self.head:
            return out
        views = self._slot_views(slot, len(indices))
        clock = time.perf_counter
        t1 = clock()
        for j in range(self.head, len(steps)):
            step = steps[j]
            out = step.code(*self._args(step, out, views[j], indices, self._seeds(step, seeds_fn, positions)))
            t2 = clock()
            seconds[step.name] += t2 - t1
            t1 = t2
        return out

    def locate_error(self, indices: np.ndarray, positions: np.ndarray, slot: int, seeds_fn: SeedsFn, exc: BaseException) -> LoaderError:
        """Find the sample and the operation behind ``exc`` by running step by step."""
        for k in range(len(indices)):
            found = self._run_stepwise(indices[k : k + 1], positions[k : k + 1], slot, seeds_fn)
            if found is not None:
                step, err = found
                return LoaderError(self.name, step.name, int(indices[k]), _describe(step, err))
        found = self._run_stepwise(indices, positions, slot, seeds_fn)
        op = found[0].name if found else "?"
        return LoaderError(self.name, op, None, f"{type(exc).__name__}: {exc}")

    def _run_stepwise(self, indices: np.ndarray, positions: np.ndarray, slot: int, seeds_fn: SeedsFn) -> tuple[Step, BaseException] | None:
        out: Any = None
        n = len(indices)
        for step, memory in zip(self.steps, self._views[slot]):
            dst = None if memory is None else memory[:n]
            try:
                out = step.code(*self._args(step, out, dst, indices, self._seeds(step, seeds_fn, positions)))
            except Exception as err:
                return step, err
        return None


def _describe(step: Step, err: BaseException) -> str:
    """The error's text, with the operation's own explanation when it has one (``describe_error()``)."""
    text = f"{type(err).__name__}: {err}"
    describe = getattr(step.op, "describe_error", None)
    if describe is not None:
        try:
            detail = describe()
        except Exception as exc:  # an explanation must never hide the error itself
            detail = f"(describe_error failed: {type(exc).__name__}: {exc})"
        if detail:
            text += f" ({detail})"
    return text


def _as_operation(op: Any) -> Operation:
    if isinstance(op, Operation):
        return op
    if callable(op):
        from stoker.transforms.module import ModuleWrapper

        return ModuleWrapper(op)
    raise PipelineError(f"pipeline entries must be Operations, torch modules or callables; got {type(op).__name__} {op!r:.60}")


# (source, options, ids of the steps' functions) -> (the fused function, those functions, kept so that their ids stay unique)
_FUSED: dict[tuple[Any, ...], tuple[Callable[..., Any], list[Any]]] = {}
_FUSED_LOCK = threading.Lock()


def fusion_enabled() -> bool:
    """Whether consecutive per-sample steps fuse into one loop over samples (``STOKER_FUSE``, default on)."""
    return os.environ.get("STOKER_FUSE", "1") != "0"


def _per_sample(steps: list[Step]) -> bool:
    """Whether ``steps`` (a head's compiled steps) fuse into one loop over samples: every step after the decoder has
    per-sample code (the decoder itself then runs per sample too if it has some, else once for the batch first)."""
    return fusion_enabled() and len(steps) >= 2 and all(s.sample is not None for s in steps[1:])


def _seed(k: int) -> str:
    return f"(s{k}[i] if s{k}.shape[0] > 0 else np.uint64(0))"


def _sample_source(steps: list[Step]) -> tuple[list[str], dict[str, Any]]:
    """The body of a fused function that runs ``steps`` sample by sample: one pass over each sample, in parallel.

    Each sample goes through every step while it is in the cache: decoded (or, with a decoder
    without per-sample code, taken from the batch the decoder made first), then each step's
    per-sample function, writing its memory's row for the sample (or, without memory, in place).
    """
    first = steps[0]
    decoder = first.sample if first.is_decoder else None
    body = ["    n = indices.shape[0]"]
    namespace: dict[str, Any] = {}
    if decoder is not None:
        namespace["decode0"] = decoder.sample
        if decoder.begin is not None:
            namespace["begin0"] = decoder.begin
            body.append("    begin0(indices, d0, arrays)")
    else:
        namespace["op0"] = first.code
        body.append("    r0 = op0(indices, d0, arrays, storage, s0)")
    body += ["    for i in numba.prange(n):", "        j = indices[i]"]
    if decoder is not None:
        body += [f"        decode0(i, j, {_seed(0)}, d0, arrays, storage)", "        r = d0[i]"]
    else:
        body.append("        r = r0[i]")
    last = 0  # the head's output: the memory of the last step that has some (the decoder's, if no other)
    for k, step in enumerate(steps[1:], start=1):
        namespace[f"one{k}"] = step.sample
        dst = f"d{k}[i]" if step.query is not None else "r"
        body.append(f"        r = one{k}(r, {dst}, j, {_seed(k)})")
        if step.query is not None:
            last = k
    if decoder is not None and decoder.end is not None:
        namespace["end0"] = decoder.end
        body.append("    end0(indices, d0, arrays)")
    body.append(f"    return d{last}" if last or decoder is not None else "    return r0")  # (a decoder's own batch)
    return body, namespace


def _fuse(name: str, steps: list[Step], serial: bool = False, per_sample: bool | None = None) -> Callable[..., Any]:
    """Generate and compile one function that runs consecutive compiled steps.

    Steps with per-sample code (:meth:`Operation.generate_sample_code`) are fused into one
    loop over the batch's samples (in parallel, or serially with ``serial``); others are
    called one after the other, each on the whole batch. The same steps' functions (which
    :meth:`Compiler.compile` shares between fields) give the same fused function, one per
    process; so does the same fingerprint (:func:`~stoker.pipeline.cache.load_cached`).
    Steps that cannot be fingerprinted are fused anew for each pipeline.
    """
    import numba

    k = len(steps)
    dsts = [f"d{i}" for i in range(k)]
    seeds = [f"s{i}" for i in range(k)]
    lines = [f"def fused(indices, arrays, storage, {', '.join(dsts + seeds)}):"]
    options = Compiler.fused_options()
    if _per_sample(steps) if per_sample is None else per_sample:
        body, namespace = _sample_source(steps)
        lines += body
        if not Compiler.is_debug():
            options = {**options, "parallel": not serial}
        header = "# generated by stoker: one pipeline's consecutive compiled operations, one pass over each sample\n"
    else:
        for i, step in enumerate(steps):
            if step.is_decoder:
                lines.append(f"    r = op{i}(indices, d{i}, arrays, storage, s{i})")
            else:
                extra = ["indices", f"s{i}"][: max(0, min(step.arity, 4) - 2)]
                lines.append(f"    r = op{i}({', '.join(['r', f'd{i}', *extra])})")
        lines.append("    return r")
        namespace = {f"op{i}": s.code for i, s in enumerate(steps)}
        header = "# generated by stoker: one pipeline's consecutive compiled operations\n"
    source = header + "import numba\nimport numpy as np\n\n\n" + "\n".join(lines) + "\n"
    functions = [namespace[key] for key in sorted(namespace)]
    memo = (source, repr(sorted(options.items())), *map(id, functions))
    with _FUSED_LOCK:
        hit = _FUSED.get(memo)
    if hit is not None:
        return hit[0]
    namespace = {key: linking.swap(fn) for key, fn in namespace.items()}
    cached = load_cached(source, namespace, "fused", options)
    if cached is None:  # not fingerprinted: a fused function of its own (kept by no memo, which would only grow)
        namespace.update(numba=numba, np=np)
        exec(compile(source, f"<stoker fused pipeline {next(_fused_ids)}: {name}>", "exec"), namespace)
        return numba.njit(**options)(namespace["fused"])  # type: ignore[no-any-return]
    with _FUSED_LOCK:
        return _FUSED.setdefault(memo, (cached, functions))[0]


def _sample_form(op: Operation) -> Any:
    """An operation's per-sample code (:meth:`Operation.generate_sample_code`), compiled; ``None`` if it has none."""
    make = getattr(op, "generate_sample_code", None)
    code = make() if callable(make) else None
    # compiled into the fused loop and inlined, with the kernels it calls (but a large one such as a JPEG decoder, by symbol)
    if isinstance(code, SampleDecoder):
        return SampleDecoder(Compiler.compile(code.sample, per_sample=True), code.begin, code.end)
    return None if code is None else Compiler.compile(code, per_sample=True)


class _Deferred:
    """A place before a ``ToTensor`` for the compiled form of the operation after it, known once the state there is."""

    def __init__(self, after: Any) -> None:
        self.after = after

    def resolve(self, state: State) -> Operation | None:
        return self.after.compiled_form(state)  # type: ignore[no-any-return]


def _with_compiled_forms(ops: list[Operation], compiling: bool) -> list[Any]:
    """``ops`` with a place for the compiled form of each operation that a ``ToTensor`` precedes and that has one.

    ``[..., ToTensor(), ToTorchImage(channels_last=False)]``: the layout change is then made by the
    producers, fused with the steps before it (one pass over each sample), and ``ToTorchImage``
    passes the CHW batch through. The places are made past views (``tensor_view``: ``ToTorchImage``),
    so that ``[..., ToTensor(), ToTorchImage(), NormalizeImage(...)]`` normalises in the producers too.
    Only when compiling and fusing (``STOKER_FUSE=0``: as written).
    """
    if not compiling or not fusion_enabled():
        return list(ops)
    out: list[Any] = []
    placed: set[int] = set()
    for k, op in enumerate(ops):
        if getattr(op, "tensor_view", False):
            for after in ops[k + 1 :]:  # the operations after it, through the views that follow it
                if id(after) not in placed and callable(getattr(after, "compiled_form", None)):
                    placed.add(id(after))
                    out.append(_Deferred(after))
                if not getattr(after, "tensor_view", False):
                    break
        out.append(op)
    return out


def _first_device(ops: list[Operation]) -> Any:
    """The device of a pipeline's first state: ``torch.device('cpu')``, as in FFCV, which operations of other
    libraries may read; ``None`` (the CPU, in jit mode where the device is ignored) when every operation is
    stoker's own, which set the device when they make tensors: a pipeline of numpy batches never imports torch."""
    if all(type(op).__module__.startswith("stoker.") for op in ops):
        return None
    import torch

    return torch.device("cpu")


def build_pipeline(
    name: str, field_: Field, operations: Sequence[Any], reader: Reader, field_position: int, batch_size: int = 0
) -> FieldPipeline:
    """Declare states, check them, compile and fuse: the build step of a field's pipeline.

    Raises:
        PipelineError: an empty pipeline, a compiled operation after a Python
            one, or an operation that rejects its input state.
    """
    ops = [_as_operation(op) for op in operations]
    prebuilt.attach_all()  # the library's kernels load from the package's prebuilt files when no cache has them
    if not ops:
        raise PipelineError(f"the pipeline of field '{name}' is empty; give a decoder, or None to skip the field")
    state = State(jit_mode=True, device=_first_device(ops), shape=(), dtype=np.dtype("u1"))
    steps: list[Step] = []
    compiling = Compiler.is_enabled()
    ops = _with_compiled_forms(ops, compiling)
    inserted = 0
    for index, op in enumerate(ops):
        position = index - inserted  # the operation's place in the pipeline as given: its seeds' salt
        if isinstance(op, _Deferred):  # a tail operation's compiled form, before ToTensor (see _with_compiled_forms)
            inserted += 1
            form = op.resolve(state)
            if form is None:
                continue
            op = form
        op.field, op.field_name, op.reader = field_, name, reader
        op.batch_size = batch_size  # type: ignore[attr-defined]
        op.accept_field(field_)
        op.accept_globals(reader.metadata)
        try:
            new_state, query = op.declare_state_and_memory(state)
        except PipelineError:
            raise
        except Exception as exc:
            raise PipelineError(f"field '{name}', operation {position} ({op!r}) rejects its input {state}: {exc}") from exc
        if new_state.jit_mode and not state.jit_mode:
            raise PipelineError(
                f"field '{name}': {op!r} is a compiled (numpy) operation; place it before ToTensor and other tensor operations"
            )
        jit = state.jit_mode and new_state.jit_mode
        code = raw = op.generate_code()
        if not jit and getattr(code, "is_parallel", False):
            raise PipelineError(
                f"field '{name}': {op!r} generates parallel compiled code; place it before ToTensor and other tensor operations"
            )
        if jit:
            code = Compiler.compile(code)
        uses_seeds = bool(getattr(op, "uses_seeds", False)) if position == 0 else _arity(code) >= 4
        salt = getattr(op, "seed_salt", None)  # operations that must share their seeds (mixup) set the same salt
        salt = field_position * 1000 + position if salt is None else int(salt)
        python = sample = None
        if jit and compiling:  # see Step.python: a compiled kernel itself, or a function that only calls kernels
            python = raw if _is_dispatcher(raw) else (raw if getattr(op, "wraps_kernels", False) else None)
            sample = _sample_form(op)
        steps.append(Step(op, code, position == 0, jit, _arity(code), query, salt, uses_seeds, python, sample))
        state = new_state
    arrays_fn = getattr(ops[0], "loader_arrays", None)
    arrays = arrays_fn() if arrays_fn is not None else field_.loader_arrays(reader, name)
    arrays = tuple(np.asarray(a).view(np.ndarray) if isinstance(a, np.memmap) else a for a in arrays)
    storage = reader.storage.view(np.ndarray)
    jit_steps = [s for s in steps if s.jit]
    per_sample = compiling and _per_sample(jit_steps)
    fused = _fuse(name, jit_steps, per_sample=per_sample) if compiling and len(jit_steps) >= 2 else None
    return FieldPipeline(name, steps, arrays, storage, fused, state, per_sample)
