"""torchvision's RandomResizedCrop on decoded images: :class:`RandomResizedCrop` (FFCV's ``ffcv.transforms.random_resized_crop``).

The crop's geometry and the resampling are the kernels of
:class:`~stoker.fields.rgb_image.RandomResizedCropRGBImageDecoder`
(:func:`stoker.image._kernels.random_resized_crop` and
:func:`stoker.image._kernels.resize`), applied to images already decoded; the
decoder is faster, since it decodes only the crop.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numba
import numpy as np

from stoker import _numba_cache
from stoker.image import _kernels as kernels
from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.compiler import Compiler
from stoker.pipeline.operation import Operation
from stoker.pipeline.state import State
from stoker.transforms.flip import numpy_image_size

_numba_cache.register()  # before its cache=True kernels: their compiled code is kept in stoker's private folder only


@numba.njit(nogil=True, parallel=True, cache=True)
def _random_resized_crop_kernel(images, dst, seeds, scale_lo, scale_hi, lr_lo, lr_hi, scratch, taps):  # type: ignore[no-untyped-def]
    n, h, w, _ = images.shape
    for i in numba.prange(n):
        y0, x0, ch, cw = kernels.random_resized_crop(h, w, seeds[i], scale_lo, scale_hi, lr_lo, lr_hi)
        src = images[i].reshape(-1)
        i64 = np.int64  # (resize's one signature: every size int64, see stoker.image._resize.resize)
        kernels.resize(src, i64(0), i64(w * 3), i64(h), i64(w), float(y0), float(x0), float(ch), float(cw), dst[i], scratch[i], taps[i])
    return dst


class RandomResizedCrop(Operation):
    """Crops a random part of each decoded image and resizes it to ``size`` (compiled, into new memory).

    The crop covers a fraction of the image's area uniform in ``scale``, with
    an aspect ratio (width / height) log-uniform in ``ratio``, as torchvision's
    RandomResizedCrop; its draws come from the sample's seed. Works on uint8
    RGB images in the (height, width, channels) layout, after a decoder and
    before ``NormalizeImage``; ``RandomResizedCropRGBImageDecoder`` does the same
    while decoding, and faster.

    Args:
        scale: ``(lo, hi)``, the range of the crop's area relative to the image, ``0 < lo <= hi``.
        ratio: ``(lo, hi)``, the range of the crop's aspect ratio, ``0 < lo <= hi``.
        size: the output's side, or its ``(height, width)``.

    Raises:
        ValueError: bad ``scale``, ``ratio`` or ``size``; at build time, a batch
            that is not uint8 RGB images in the HWC layout.
    """

    reentrant = True
    wraps_kernels = True  # its generated function only calls compiled kernels

    def __init__(self, scale: tuple[float, float], ratio: tuple[float, float], size: int | tuple[int, int]) -> None:
        if not 0.0 < float(scale[0]) <= float(scale[1]):
            raise ValueError(f"RandomResizedCrop: scale must be (lo, hi) with 0 < lo <= hi; got {scale}")
        if not 0.0 < float(ratio[0]) <= float(ratio[1]):
            raise ValueError(f"RandomResizedCrop: ratio must be (lo, hi) with 0 < lo <= hi; got {ratio}")
        out = (size, size) if isinstance(size, int) else tuple(size)
        if len(out) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in out):
            raise ValueError(f"RandomResizedCrop: size must be an int >= 1 or (height, width); got {size!r}")
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self.size: tuple[int, int] = (int(out[0]), int(out[1]))
        self._source: tuple[int, int] = (0, 0)

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        h, w, c = numpy_image_size(self, previous_state)
        if previous_state.layout != "HWC" or np.dtype(previous_state.dtype) != np.uint8 or c != 3:
            raise ValueError(
                "RandomResizedCrop works on uint8 RGB images in the (height, width, channels) layout, as decoders make them "
                f"(place it before NormalizeImage); got {previous_state.dtype} samples of shape {previous_state.shape}, "
                f"layout {previous_state.layout}"
            )
        self._source = (h, w)
        shape = (*self.size, 3)
        return replace(previous_state, jit_mode=True, shape=shape), AllocationQuery(shape, np.dtype(np.uint8))

    def generate_code(self) -> Callable[..., Any]:
        kernel = _random_resized_crop_kernel if Compiler.is_enabled() else _random_resized_crop_kernel.py_func
        (h, w), (oh, ow) = self._source, self.size
        scratch_size = int(kernels.resize_scratch_size(h, w, oh, ow))
        taps_size = kernels.resize_taps_size(oh, ow)
        scale_lo, scale_hi = self.scale
        lr_lo, lr_hi = math.log(self.ratio[0]), math.log(self.ratio[1])

        def random_resized_crop(batch: np.ndarray, dst: np.ndarray, indices: np.ndarray, seeds: np.ndarray) -> np.ndarray:
            n = batch.shape[0]
            scratch = np.empty((n, scratch_size), dtype=np.float32)  # per call: the operation stays reentrant
            taps = np.empty((n, taps_size), dtype=np.int64)
            out = dst[:n]
            kernel(np.ascontiguousarray(batch), out, seeds, scale_lo, scale_hi, lr_lo, lr_hi, scratch, taps)
            return out

        return random_resized_crop

    def __repr__(self) -> str:
        return f"RandomResizedCrop(scale={self.scale}, ratio={self.ratio}, size={self.size})"
