"""The state of a batch between two operations of a pipeline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class State:
    """What an operation receives: per-sample shape, dtype, device, and whether it is compilable.

    Attributes:
        jit_mode: ``True`` while the data is a numpy array on the CPU, so the
            next operation can be compiled with Numba.
        device: where the data lives (a ``torch.device`` once it is a tensor;
            ignored in jit mode).
        shape: the shape of *one sample* (the batch dimension is implicit).
        dtype: a numpy dtype in jit mode, a torch dtype otherwise.
    """

    jit_mode: bool
    device: Any
    shape: tuple[int, ...]
    dtype: Any

    def __post_init__(self) -> None:
        if not isinstance(self.shape, tuple):
            raise TypeError(f"State.shape must be a tuple; got {type(self.shape).__name__} {self.shape!r}")
