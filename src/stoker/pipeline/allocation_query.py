"""A request for batch memory, made by an operation when the pipeline is built."""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np

#: the boundary :attr:`AllocationQuery.offset` counts from [bytes]
ALIGNMENT = 64


def offset_array(shape: tuple[int, ...], dtype: Any, offset: int) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts ``offset`` bytes past a multiple of :data:`ALIGNMENT`.

    Its memory is a private anonymous mapping (its ``base``; pages come on first
    touch, as ``np.empty``'s large blocks do, and stay private to a process across a
    fork), not another array, so views of the result keep the result itself alive,
    as views of ``np.empty``'s do: what holds a view counts as a reference to the
    returned array.
    """
    dt = np.dtype(dtype)
    if offset % dt.itemsize:
        raise ValueError(f"an offset of {offset} bytes leaves {dt} items unaligned: use a multiple of {dt.itemsize}")
    size = int(np.prod(shape, dtype=np.int64)) * dt.itemsize + ALIGNMENT
    raw: Any = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE) if hasattr(mmap, "MAP_PRIVATE") else bytearray(size)
    start = (offset - np.frombuffer(raw, dtype=np.uint8).ctypes.data) % ALIGNMENT
    return np.ndarray(shape, dtype=dt, buffer=raw, offset=start)


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
        offset: where the batch's memory starts, in bytes past a multiple of
            :data:`ALIGNMENT` (0: on one); honoured for CPU memory that is
            neither pinned nor a torch dtype's. For a writer whose speed depends on
            alignment: libjpeg-turbo writes rows that start on a 32-byte boundary
            with non-temporal stores, which send the decoded pixels past the
            cache that the next operation reads them from.
    """

    shape: tuple[int, ...]
    dtype: Any
    device: Any = None
    offset: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.shape, tuple) or any((not isinstance(s, int)) or s < 0 for s in self.shape):
            raise ValueError(f"AllocationQuery.shape must be a tuple of non-negative ints; got {self.shape!r}")
        if not isinstance(self.offset, int) or not 0 <= self.offset < ALIGNMENT:
            raise ValueError(f"AllocationQuery.offset must be an int in [0, {ALIGNMENT}); got {self.offset!r}")
        try:
            itemsize = np.dtype(self.dtype).itemsize
        except TypeError:  # a torch dtype: its memory comes from torch, without an offset
            return
        if self.offset % itemsize:
            raise ValueError(
                f"AllocationQuery.offset={self.offset} leaves {np.dtype(self.dtype)} items unaligned: use a multiple of {itemsize}"
            )
