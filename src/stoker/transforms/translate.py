"""Random translations of image batches: :class:`RandomTranslate`."""

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
from stoker.transforms.flip import numpy_image_size

_numba_cache.register()  # before its cache=True kernels: their compiled code is kept in stoker's private folder only


@numba.njit(nogil=True, cache=True)
def _shift_plane(src, out, base, h, w, s, dy, dx, fill, f):  # type: ignore[no-untyped-def]
    """``out[y, x] = src[y - dy, x - dx]``, or ``fill[f:f + s]`` where that is outside, on one plane.

    The plane is ``h`` rows of ``w`` pixels of ``s`` values each, contiguous
    from ``base`` in the flat arrays ``src`` and ``out``. Each row is one
    contiguous copy and two runs of fill; unsigned indices (``f`` is one too)
    keep Numba from inserting negative-index checks, so the copy vectorises.
    """
    x0 = min(max(dx, 0), w)  # the columns [x0, x1) of the output have a source pixel
    x1 = max(min(w + dx, w), x0)
    row = w * s
    su = numba.uint64(s)
    wu = numba.uint64(w)
    for y in range(h):
        sy = y - dy
        d = numba.uint64(base + y * row)
        lo, hi = x0, x1
        if 0 <= sy < h and x0 < x1:
            a = numba.uint64(base + sy * row + (x0 - dx) * s)
            b = d + numba.uint64(x0 * s)
            for p in range(numba.uint64((x1 - x0) * s)):
                out[b + p] = src[a + p]
        else:
            lo, hi = w, w
        for x in range(numba.uint64(lo)):
            for k in range(su):
                out[d + x * su + k] = fill[f + k]
        for x in range(numba.uint64(hi), wu):
            for k in range(su):
                out[d + x * su + k] = fill[f + k]


@numba.njit(nogil=True, cache=True)
def translate_one(image, out, seed, padding, fill):  # type: ignore[no-untyped-def]
    """One HWC image: ``out[y, x] = image[y - dy, x - dx]`` (or ``fill`` outside), dy, dx uniform in [-padding, padding]."""
    h, w, c = image.shape
    dy = randint(seed, 0, -padding, padding + 1)
    dx = randint(seed, 1, -padding, padding + 1)
    _shift_plane(image.reshape(-1), out.reshape(-1), 0, h, w, c, dy, dx, fill, numba.uint64(0))
    return out


@numba.njit(nogil=True, cache=True)
def translate_chw_one(image, out, seed, padding, fill):  # type: ignore[no-untyped-def]
    """CHW: :func:`translate_one` plane by plane, the same draws."""
    c, h, w = image.shape
    dy = randint(seed, 0, -padding, padding + 1)
    dx = randint(seed, 1, -padding, padding + 1)
    src = image.reshape(-1)
    flat = out.reshape(-1)
    for k in range(c):
        _shift_plane(src, flat, k * h * w, h, w, 1, dy, dx, fill, numba.uint64(k))
    return out


@numba.njit(nogil=True, parallel=True, cache=True)
def _translate_kernel(images, dst, seeds, padding, fill):  # type: ignore[no-untyped-def]
    """:func:`translate_one` for each HWC image of the batch."""
    for i in numba.prange(images.shape[0]):
        translate_one(images[i], dst[i], seeds[i], padding, fill)
    return dst


@numba.njit(nogil=True, parallel=True, cache=True)
def _translate_chw_kernel(images, dst, seeds, padding, fill):  # type: ignore[no-untyped-def]
    """:func:`translate_chw_one` for each CHW image of the batch."""
    for i in numba.prange(images.shape[0]):
        translate_chw_one(images[i], dst[i], seeds[i], padding, fill)
    return dst


def fill_array(op: Operation, fill: tuple[float, ...], state: State) -> np.ndarray:
    """``fill`` as an array of the state's dtype, one value per channel; raises ``ValueError`` otherwise."""
    _, _, c = numpy_image_size(op, state)
    if len(fill) != c:
        raise ValueError(f"{type(op).__name__}'s fill needs one value per channel ({c}); got {fill}")
    dtype = np.dtype(state.dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if not all(float(v).is_integer() and info.min <= v <= info.max for v in fill):
            raise ValueError(f"{type(op).__name__}'s fill must be integers in [{info.min}, {info.max}] for {dtype} images; got {fill}")
    return np.array(fill, dtype=dtype)


def fill_values(fill: Sequence[float]) -> tuple[float, ...]:
    """The fill as given: ints stay ints (the repr of uint8 fills is unchanged), other values are floats."""
    return tuple(int(v) if float(v).is_integer() else float(v) for v in fill)


class RandomTranslate(Operation):
    """Shifts each image by a random offset, filling the uncovered pixels (compiled).

    Works on numpy image batches of any dtype (place it before ``ToTensor``),
    in either layout, HWC or CHW (after ``NormalizeImage``): the state's
    layout says which axes are the height and the width. The output has the
    input's shape and layout, in new memory.
    Sample ``i`` moves ``dy`` pixels down and ``dx`` pixels right, with
    ``dy = randint(seeds[i], 0, -padding, padding + 1)`` and
    ``dx = randint(seeds[i], 1, -padding, padding + 1)`` (both ends included:
    FFCV draws from a zero-padded copy, which is the same picture).

    Args:
        padding: the largest shift [pixels], >= 0.
        fill: the value of uncovered pixels, one per channel, in the units
            of the batch it receives (after ``NormalizeImage``, normalised ones).

    Raises:
        ValueError: a negative ``padding``; at build time, samples that are
            not images of a known layout, a ``fill`` whose length is not the
            number of channels or whose values the images' dtype cannot hold.
    """

    reentrant = True
    wraps_kernels = True  # its generated function only calls compiled kernels

    def __init__(self, padding: int, fill: Sequence[float] = (0, 0, 0)) -> None:
        if int(padding) != padding or padding < 0:
            raise ValueError(f"padding must be an integer >= 0; got {padding}")
        self.padding = int(padding)
        self.fill = fill_values(fill)
        self._fill: np.ndarray | None = None
        self._chw = False

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        self._fill = fill_array(self, self.fill, previous_state)
        self._chw = previous_state.layout == "CHW"
        return replace(previous_state, jit_mode=True), AllocationQuery(previous_state.shape, np.dtype(previous_state.dtype))

    def generate_code(self) -> Callable[..., Any]:
        compiled = _translate_chw_kernel if self._chw else _translate_kernel
        kernel = compiled if Compiler.is_enabled() else compiled.py_func
        padding, fill = self.padding, self._fill if self._fill is not None else np.array(self.fill, dtype=np.uint8)

        def random_translate(batch: np.ndarray, dst: np.ndarray, indices: np.ndarray, seeds: np.ndarray) -> np.ndarray:
            return kernel(batch, dst, seeds, padding, fill)  # type: ignore[no-any-return]

        return random_translate

    def generate_sample_code(self) -> Callable[..., Any]:
        one = translate_chw_one if self._chw else translate_one
        padding, fill = self.padding, self._fill if self._fill is not None else np.array(self.fill, dtype=np.uint8)

        def random_translate_one(image: np.ndarray, dst: np.ndarray, index: int, seed: np.uint64) -> np.ndarray:
            return one(image, dst, seed, padding, fill)  # type: ignore[no-any-return]

        return random_translate_one

    def __repr__(self) -> str:
        return f"RandomTranslate(padding={self.padding}, fill={self.fill})"
