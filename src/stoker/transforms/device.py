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

    On CUDA the copy is issued from pinned batch memory on the loader's own
    CUDA stream into device memory allocated once per batch slot; events make
    your stream wait for the copy and keep the loader from overwriting a
    buffer still in use. On ``cpu`` it does nothing.

    Args:
        device: a ``torch.device`` or a string such as ``'cuda'``, ``'cuda:1'``, ``'cpu'``.
        non_blocking: issue the copy asynchronously (CUDA only).
    """

    reentrant = True

    def __init__(self, device: Any, non_blocking: bool = True) -> None:
        import torch

        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
        self.non_blocking = non_blocking

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
                return batch

            return on_cpu
        non_blocking = self.non_blocking

        def to_device(batch: Any, dst: Any) -> Any:
            if dst.shape != batch.shape:  # a last batch smaller than the others
                dst = dst[: batch.shape[0]]
            dst.copy_(batch, non_blocking=non_blocking)
            return dst

        return to_device

    def __repr__(self) -> str:
        return f"ToDevice({str(self.device)!r})"
