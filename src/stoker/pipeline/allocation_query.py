"""A request for batch memory, made by an operation when the pipeline is built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AllocationQuery:
    """Memory for the output of one operation, for one sample.

    The loader allocates it once per batch slot, with a leading batch
    dimension, and hands the operation the slot to write into.

    Attributes:
        shape: the shape of one sample's output.
        dtype: a numpy dtype (CPU memory) or a torch dtype.
        device: ``None`` for CPU memory (pinned when the batch goes to CUDA),
            or a ``torch.device`` for device memory.
    """

    shape: tuple[int, ...]
    dtype: Any
    device: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.shape, tuple) or any((not isinstance(s, int)) or s < 0 for s in self.shape):
            raise ValueError(f"AllocationQuery.shape must be a tuple of non-negative ints; got {self.shape!r}")
