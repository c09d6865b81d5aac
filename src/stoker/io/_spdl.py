"""The few ``spdl.io`` names that SPDL's image examples use, on top of :mod:`stoker.io`'s functions.

They let code written for ``spdl.io`` run with the import changed: a "filter
description" is only the output size, "packets" are the file's bytes, "frames" an
HWC uint8 array, a "buffer" an NHWC batch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np

from stoker import _numba_cache
from stoker.io._image import _bytes, decode_image

_numba_cache.register()  # before its cache=True kernels: their compiled code is kept in stoker's private folder only


@dataclass(frozen=True)
class FilterDesc:
    """What :func:`get_video_filter_desc` describes: the output's size [pixels] (``None``: unchanged)."""

    width: int | None = None
    height: int | None = None


@dataclass(frozen=True)
class ImagePackets:
    """An encoded image, as read from its file."""

    data: np.ndarray
    src: str

    def __repr__(self) -> str:
        return f"ImagePackets(src={self.src!r}, {self.data.shape[0]} bytes)"


def get_video_filter_desc(*, scale_width: int | None = None, scale_height: int | None = None, **unsupported: Any) -> FilterDesc:
    """SPDL's filter description, for scaling only.

    Raises:
        ValueError: another option of SPDL's (stoker supports scaling only), or one side only.
    """
    if unsupported:
        raise ValueError(f"stoker.io supports scale_width and scale_height only; got {sorted(unsupported)}")
    if (scale_width is None) != (scale_height is None):
        raise ValueError("give both scale_width and scale_height, or neither")
    return FilterDesc(scale_width, scale_height)


def demux_image(path: str | os.PathLike[str]) -> ImagePackets:
    """Read an image file's bytes (I/O releases the GIL)."""
    return ImagePackets(_bytes(path), os.fspath(path))


def decode_packets(packets: ImagePackets, filter_desc: FilterDesc | None = None) -> np.ndarray:
    """Decode (and scale, per ``filter_desc``) to an HWC uint8 RGB array; see :func:`stoker.io.decode_image`."""
    size = None
    if filter_desc is not None and filter_desc.width is not None and filter_desc.height is not None:
        size = (filter_desc.height, filter_desc.width)
    try:
        return decode_image(packets.data, size=size)
    except ValueError as exc:
        raise ValueError(f"{packets.src}: {exc}") from None


def convert_frames(frames: Sequence[np.ndarray]) -> np.ndarray:
    """Stack HWC frames of one shape into one ``(n, h, w, c)`` batch, held channels-first (planar) in memory.

    The batch's shape is NHWC, as SPDL's; its memory is NCHW: ``to_torch(buffer).permute(0, 3, 1, 2)``
    (what SPDL's examples do for a model) is then a contiguous NCHW tensor, without a copy,
    and the operations after it (``tensor.float() / 255``, a normalisation) run on contiguous
    memory: on a channels-last batch torch's broadcasting arithmetic runs 3-4 times slower.
    Indexing the buffer as NHWC gives the frames' values; ``np.ascontiguousarray`` gives an
    interleaved copy. The frames are copied into the batch by a compiled loop (no GIL).

    Raises:
        ValueError: no frames, or frames of different shapes.
    """
    if not len(frames):
        raise ValueError("convert_frames() needs at least one frame")
    shape = frames[0].shape
    for i, f in enumerate(frames):
        if f.shape != shape:
            raise ValueError(f"convert_frames() needs frames of one shape; frame 0 is {shape}, frame {i} is {f.shape}")
    first = np.asarray(frames[0])
    if first.ndim != 3 or first.dtype.kind not in "biuf" or (first.dtype.itemsize == 2 and first.dtype.kind == "f"):
        out = np.empty((len(frames), *shape), dtype=first.dtype)  # not an image batch the compiled copy handles: stacked as is
        for i, f in enumerate(frames):
            out[i] = f
        return out
    h, w, c = shape
    planar = np.empty((len(frames), c, h, w), dtype=first.dtype)
    for i, f in enumerate(frames):
        _to_planar(np.ascontiguousarray(f), planar[i])
    return planar.transpose(0, 2, 3, 1)


@numba.njit(nogil=True, cache=True)
def _to_planar(frame, out):  # type: ignore[no-untyped-def]
    """``out[k, y, x] = frame[y, x, k]``: one HWC frame into CHW memory."""
    h, w, c = frame.shape
    hw = numba.uint64(h * w)
    cu = numba.uint64(c)
    src = frame.reshape(-1)
    dst = out.reshape(-1)
    if c == 3:  # literal strides: the de-interleave vectorises
        for p in range(hw):
            q = numba.uint64(3) * p
            dst[p] = src[q]
            dst[hw + p] = src[q + numba.uint64(1)]
            dst[numba.uint64(2) * hw + p] = src[q + numba.uint64(2)]
    else:
        for p in range(hw):
            for k in range(cu):
                dst[k * hw + p] = src[p * cu + k]


def to_torch(buffer: np.ndarray) -> Any:
    """The batch as a torch tensor sharing its memory, with its shape (NHWC) and its memory layout (see :func:`convert_frames`)."""
    import torch

    return torch.from_numpy(np.asarray(buffer))
