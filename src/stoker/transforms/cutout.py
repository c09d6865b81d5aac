"""Cutout (random erasing of a square) on image batches: :class:`Cutout`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numba
import numpy as np

from stoker import _numba_cache
from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.compiler import Compiler
from stoker.pipeline.operation import Operation
from stoker.pipeline.random import randint
from stoker.pipeline.state import State
from stoker.transforms.translate import fill_array, fill_values

_numba_cache.register()  # before its cache=True kernels: their compiled code is kept in stoker's private folder only


@numba.njit(nogil=True, cache=True)
def cutout_one(image, seed, crop_size, fill):  # type: ignore[no-untyped-def]
    """Set a ``crop_size`` square centred at a random pixel of one HWC ``image`` to ``fill``, in place."""
    h, w, c = image.shape
    half = crop_size // 2
    cy = randint(seed, 0, 0, h)
    cx = randint(seed, 1, 0, w)
    y0, x0 = max(cy - half, 0), max(cx - half, 0)
    y1, x1 = min(cy - half + crop_size, h), min(cx - half + crop_size, w)
    for y in range(y0, y1):
        for x in range(x0, x1):
            for k in range(c):
                image[y, x, k] = fill[k]
    return image


@numba.njit(nogil=True, cache=True)
def cutout_chw_one(image, seed, crop_size, fill):  # type: ignore[no-untyped-def]
    """CHW: :func:`cutout_one` plane by plane (contiguous runs of each row), the same draws."""
    c, h, w = image.shape
    half = crop_size // 2
    cy = randint(seed, 0, 0, h)
    cx = randint(seed, 1, 0, w)
    y0, x0 = max(cy - half, 0), max(cx - half, 0)
    y1, x1 = min(cy - half + crop_size, h), min(cx - half + crop_size, w)
    flat = image.reshape(-1)
    for k in range(c):
        f = fill[k]
        for y in range(y0, y1):
            start = numba.uint64((k * h + y) * w + x0)
            for x in range(numba.uint64(x1 - x0)):  # a contiguous run, unsigned indices: vectorises
                flat[start + x] = f
    return image


@numba.njit(nogil=True, parallel=True, cache=True)
def _cutout_kernel(images, seeds, crop_size, fill):  # type: ignore[no-untyped-def]
    """:func:`cutout_one` for each HWC image of the batch."""
    for i in numba.prange(images.shape[0]):
        cutout_one(images[i], seeds[i], crop_size, fill)
    return images


@numba.njit(nogil=True, parallel=True, cache=True)
def _cutout_chw_kernel(images, seeds, crop_size, fill):  # type: ignore[no-untyped-def]
    """:func:`cutout_chw_one` for each CHW image of the batch."""
    for i in numba.prange(images.shape[0]):
        cutout_chw_one(images[i], seeds[i], crop_size, fill)
    return images


class Cutout(Operation):
    """Erases a random ``crop_size`` x ``crop_size`` square of each image (in place, compiled).

    Works on numpy image batches of any dtype (place it before ``ToTensor``),
    in either layout, HWC or CHW (after ``NormalizeImage``): the state's
    layout says which axes are the height and the width. The square's centre
    ``(cy, cx)`` is drawn uniformly over the image's pixels
    (``randint(seeds[i], 0, 0, height)``, ``randint(seeds[i], 1, 0, width)``);
    the square covers rows
    ``cy - crop_size // 2`` to ``cy - crop_size // 2 + crop_size`` (excluded)
    and the same for columns, clipped at the borders, so near an edge less
    than a full square is erased (DeVries & Taylor's Cutout).

    Args:
        crop_size: side of the square [pixels], >= 1.
        fill: the value of erased pixels, one per channel, in the units of
            the batch it receives (after ``NormalizeImage``, normalised ones).

    Raises:
        ValueError: ``crop_size`` < 1; at build time, samples that are not
            images of a known layout, a ``fill`` whose length is not the
            number of channels or whose values the images' dtype cannot hold.
    """

    reentrant = True
    wraps_kernels = True  # its generated function only calls compiled kernels

    def __init__(self, crop_size: int, fill: Sequence[float] = (0, 0, 0)) -> None:
        if int(crop_size) != crop_size or crop_size < 1:
            raise ValueError(f"crop_size must be an integer >= 1; got {crop_size}")
        self.crop_size = int(crop_size)
        self.fill = fill_values(fill)
        self._fill: np.ndarray | None = None
        self._chw = False

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        self._fill = fill_array(self, self.fill, previous_state)
        self._chw = previous_state.layout == "CHW"
        return replace(previous_state, jit_mode=True), None

    def generate_code(self) -> Callable[..., Any]:
        compiled = _cutout_chw_kernel if self._chw else _cutout_kernel
        kernel = compiled if Compiler.is_enabled() else compiled.py_func
        crop_size, fill = self.crop_size, self._fill if self._fill is not None else np.array(self.fill, dtype=np.uint8)

        def cutout(batch: np.ndarray, dst: Any, indices: np.ndarray, seeds: np.ndarray) -> np.ndarray:
            return kernel(batch, seeds, crop_size, fill)  # type: ignore[no-any-return]

        return cutout

    def generate_sample_code(self) -> Callable[..., Any]:
        one = cutout_chw_one if self._chw else cutout_one
        crop_size, fill = self.crop_size, self._fill if self._fill is not None else np.array(self.fill, dtype=np.uint8)

        def cutout_sample(image: np.ndarray, dst: Any, index: int, seed: np.uint64) -> np.ndarray:
            return one(image, seed, crop_size, fill)  # type: ignore[no-any-return]

        return cutout_sample

    def __repr__(self) -> str:
        return f"Cutout(crop_size={self.crop_size}, fill={self.fill})"
