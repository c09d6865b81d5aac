"""Move batches to a device: :class:`ToDevice`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.operation import Operation
from stoker.pipeline.state import State


class ToDevice(Operation):
    """Copies the batch to ``device``.

    On CUDA the copy is issued on the loader's own CUDA stream, from the
    batch's page-locked memory into device memory allocated once per batch
    slot, as soon as producer threads have made the batch: batches ahead of
    your loop, never behind your step. The loader's transfer
    (``stoker.device._stream.StreamTransfer``, shared with ``prefetch``) makes
    your stream wait for the copy's event and keeps the copy from overwriting
    memory still in use. The slot's device memory records the loader's stream
    (``Tensor.record_stream``), so that PyTorch's allocator does not reuse it,
    once freed (a kept batch, a loader deleted mid-epoch), before the copy
    into it is done. A batch you read on another stream than the current one
    (``with torch.cuda.stream(side)``): declare it with
    ``stoker.device.record_stream(batch, side)``, or its slot may be rewritten
    while that stream still reads it (see docs/device.md, "Side streams").

    Place it right after ``ToTensor`` (views such as ``ToTorchImage`` or
    ``Squeeze`` may come before it): the loader allocates page-locked memory
    for the compiled part of a pipeline that has a ``ToDevice``, and a batch
    made by a tensor operation before ``ToDevice`` (``Convert``, a module) lies
    in pageable memory, which CUDA copies synchronously through a staging
    buffer of its own (correct, but the host waits).

    On ``cpu`` it passes a CPU batch through and copies a CUDA batch back
    (waiting for the copy: never a non-blocking copy into pageable memory).

    Args:
        device: a ``torch.device`` or a string such as ``'cuda'``, ``'cuda:1'``, ``'cpu'``.
        non_blocking: issue the copy asynchronously (CUDA only).
    """

    reentrant = True

    def __init__(self, device: Any, non_blocking: bool = True) -> None:
        import torch

        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(
                f"ToDevice: device must be 'cpu', 'cuda', 'cuda:N' or a torch.device; got {device!r} (choose it with "
                "device = 'cuda' if torch.cuda.is_available() else 'cpu')"
            ) from exc
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
        self.non_blocking = non_blocking

    @property
    def view_only(self) -> bool:  # type: ignore[override]
        """On ``cpu``, a CPU batch passes through as it is."""
        return self.device.type == "cpu"

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        state = replace(previous_state, jit_mode=False, device=self.device)
        if self.device.type == "cpu":
            return state, None
        return state, AllocationQuery(previous_state.shape, previous_state.dtype, self.device)

    def generate_code(self) -> Callable[..., Any]:
        if self.device.type == "cpu":

            def on_cpu(batch: Any, dst: Any) -> Any:
                if getattr(batch, "is_cuda", False):
                    return batch.to("cpu")  # a blocking copy: the batch is complete when returned
                return batch

            return on_cpu
        non_blocking = self.non_blocking
        if self.device.type == "cuda":
            from stoker.device._stream import copy_into

            def to_cuda(batch: Any, dst: Any) -> Any:
                # (dst records the current stream, the loader's, which writes it: it was allocated on another)
                return copy_into(dst, batch, non_blocking)

            return to_cuda

        def to_device(batch: Any, dst: Any) -> Any:
            if dst.shape != batch.shape:  # a last batch smaller than the others
                dst = dst[: batch.shape[0]]
            dst.copy_(batch, non_blocking=non_blocking)
            return dst

        return to_device

    def __repr__(self) -> str:
        return f"ToDevice({str(self.device)!r})"
