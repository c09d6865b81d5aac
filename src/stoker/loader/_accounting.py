"""The Loader's side of per-step accounting (:mod:`stoker.observe`): its components, named as the user knows them.

A batch's time goes to (producer side, in the mark ring) reading and each
field's head (its leading compiled operations, or a Python decoder), and (loop
side, in the step ring) each Python step of each field's tail, run inside
``next()``; a ``ToDevice`` step is the host-to-device copy. A loader that
copies to CUDA has one more loop-side component, the device (:data:`DEVICE`):
the time ``next()`` waited for the GPU (a copy out of a slot's page-locked
memory still queued behind the user's GPU work when the slot came round
again), which is not the loader's time.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from stoker._threads import available_cpus
from stoker.observe import _registry
from stoker.observe._recorder import MARK_FIXED, Component, Recorder

if TYPE_CHECKING:
    from stoker.loader._graph import FieldPipeline
    from stoker.loader._view import LoaderView


def new_recorder(loader: LoaderView) -> Recorder | None:
    """The loader's recorder, or ``None`` when ``STOKER_ACCOUNTING=0``."""
    if not _registry.enabled():
        return None
    rec = Recorder(f"Loader('{Path(str(loader.reader.path)).name}', batch_size={loader.batch_size})", "loader")
    _registry.register(rec)
    return rec


def _op_name(step: Any) -> str:
    """An operation's class name; a wrapped callable's ``__name__`` (a module's class name)."""
    inner = getattr(step.op, "module", None) if type(step.op).__name__ == "ModuleWrapper" else None
    if inner is not None:
        return getattr(inner, "__name__", None) or type(inner).__name__
    return type(step.op).__name__


def _is_copy(step: Any) -> bool:
    return bool(getattr(step.op, "is_cuda", False)) or type(step.op).__name__ == "ToDevice"


#: a Loader's producer-side columns of the mark ring, in :func:`components`' order: reading (the bounded cache, the
#: data check), then each field's head, field ``i`` at ``HEAD_COLUMNS + i``
READ_COLUMN = MARK_FIXED
HEAD_COLUMNS = MARK_FIXED + 1

#: the loop-side component of a loader that copies to CUDA: next() waiting for the GPU (its last column)
DEVICE = "the GPU (next() waited for it)"


def _compiled(p: FieldPipeline) -> bool:
    """Whether the head's compiled operations were compiled (not run as Python: ``compile=False``, ``Compiler.disabled()``)."""
    return bool(p.jit_steps) and all(hasattr(s.code, "py_func") for s in p.jit_steps)


def components(pipelines: list[FieldPipeline], device: bool = False) -> tuple[list[Component], list[Component]]:
    """(producer-side, loop-side) components of these pipelines, in the rings' column order.

    Args:
        pipelines: the loader's pipelines.
        device: the loader has a transfer to a device (CUDA): one more loop-side component, :data:`DEVICE`, last.
    """
    producer = [Component("read", "read", "producer")]  # READ_COLUMN, then the heads from HEAD_COLUMNS
    loop: list[Component] = []
    for p in pipelines:
        head = p.steps[: p.head]
        kind = "compiled" if _compiled(p) else "python"
        producer.append(Component(f"{p.name}: " + "+".join(_op_name(s) for s in head), kind, "producer", p.name))
        for s in p.steps[p.head :]:
            loop.append(Component(f"{p.name}: {_op_name(s)}", "copy" if _is_copy(s) else "python", "loop", p.name))
    if device:
        loop.append(Component(DEVICE, "device", "loop"))
    return producer, loop


def forms(pipelines: list[FieldPipeline]) -> dict[str, str]:
    """What each Python component of these pipelines is, for ``report()``'s advice (``context["forms"]``).

    A head: ``"decoder"`` (a decoder Numba does not compile) or ``"uncompiled"`` (compiled operations run as
    Python: ``compile=False``). A step of a tail: ``"function"`` (a callable or torch module placed in the
    pipeline), ``"movable"`` (an operation that runs compiled when placed before ``ToTensor``, now after it:
    ``NormalizeImage``; ``"movable on the GPU"`` after a copy to CUDA) or ``"operation"`` (any other).
    """
    # (imported here, at an epoch's start, so that importing the Loader does not import the transforms)
    from stoker.transforms.module import ModuleWrapper
    from stoker.transforms.normalize import NormalizeImage
    from stoker.transforms.tensor import ToTensor

    out: dict[str, str] = {}
    for p in pipelines:
        head_name = f"{p.name}: " + "+".join(_op_name(s) for s in p.steps[: p.head])
        if not _compiled(p):
            out[head_name] = "uncompiled" if p.jit_steps else "decoder"
        tensors = on_gpu = False
        for s in p.steps[p.head :]:
            name = f"{p.name}: {_op_name(s)}"
            if isinstance(s.op, ToTensor):
                tensors = True
            if _is_copy(s):
                on_gpu = on_gpu or bool(getattr(s.op, "is_cuda", False))
                continue
            if isinstance(s.op, ModuleWrapper):
                out.setdefault(name, "function")
            elif isinstance(s.op, NormalizeImage) and tensors and s.op.dtype != np.float16:
                out.setdefault(name, "movable on the GPU" if on_gpu else "movable")
            else:
                out.setdefault(name, "operation")
    return out


def start_epoch(loader: LoaderView, rec: Recorder, epoch: int, skip: int, producers: int) -> int:
    """Configure ``rec`` for epoch ``epoch`` starting at batch ``skip``; returns the epoch's row base.

    Once per epoch, but cheap after the first (a few microseconds: an Otto epoch takes 10 ms):
    the components are made again only when the pipelines were rebuilt.
    """
    device = loader._transfer is not None
    if rec.context.get("pipelines") is not loader.pipelines or rec.context.get("device") != device:
        producer, loop = components(loader.pipelines, device)
        rec.configure(producer, loop)
        rec.context.update(pipelines=loader.pipelines, device=device, cpus=available_cpus(), forms=forms(loader.pipelines))
    remote = loader.remote
    rec.context.update(
        num_workers=loader.num_workers,
        batches_ahead=loader.batches_ahead,
        os_cache=loader.os_cache,
        producers=producers,
        verify=loader.check_data,
        remote=remote is not None,
        download_ahead=remote.ahead if remote is not None else None,
    )
    return rec.epoch_base(skip, epoch)
