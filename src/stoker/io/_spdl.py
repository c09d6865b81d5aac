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

import numpy as np

from stoker.io._image import _bytes, decode_image, to_tensor_batch


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
    """Stack HWC frames of one shape into one NHWC batch.

    Raises:
        ValueError: no frames, or frames of different shapes.
    """
    if not len(frames):
        raise ValueError("convert_frames() needs at least one frame")
    shape = frames[0].shape
    out = np.empty((len(frames), *shape), dtype=frames[0].dtype)
    for i, f in enumerate(frames):
        if f.shape != shape:
            raise ValueError(f"convert_frames() needs frames of one shape; frame 0 is {shape}, frame {i} is {f.shape}")
        out[i] = f
    return out


def to_torch(buffer: np.ndarray) -> Any:
    """The batch as a torch tensor sharing its memory, in its own layout (NHWC)."""
    return to_tensor_batch(buffer, channels_first=False)
