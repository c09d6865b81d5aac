"""Cutout (random erasing of a square) on image batches: :class:`Cutout`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numba
import numpy as np

from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.compiler import Compiler
from stoker.pipeline.operation import Operation
from stoker.pipeline.random import randint
from stoker.pipeline.state import State
from stoker.transforms.flip import check_hwc


@numba.njit(nogil=True, parallel=True, cache=True)
def _cutout_kernel(images, seeds, crop_size, fill):  # type: ignore[no-untyped-def]
    """Set a ``crop_size`` square centred at a random pixel of ``images[i]`` to ``fill``, in place."""
    n, h, w, c = images.shape
    half = crop_size // 2
    for i in numba.prange(n):
        cy = randint(seeds[i], 0, 0, h)
        cx = randint(seeds[i], 1, 0, w)
        y0, x0 = max(cy - half, 0), max(cx - half, 0)
        y1, x1 = min(cy - half + crop_size, h), min(cx - half + crop_size, w)
        for y in range(y0, y1):
            for x in range(x0, x1):
                for k in range(c):
                    images[i, y, x, k] = fill[k]
    return images


class Cutout(Operation):
    """Erases a random ``crop_size`` x ``crop_size`` square of each image (in place, compiled).

    Works on ``(batch, height, width, channels)`` numpy batches (place it
    before ``ToTensor``). The square's centre ``(cy, cx)`` is drawn uniformly
    over the image's pixels (``randint(seeds[i], 0, 0, height)``,
    ``randint(seeds[i], 1, 0, width)``); the square covers rows
    ``cy - crop_size // 2`` to ``cy - crop_size // 2 + crop_size`` (excluded)
    and the same for columns, clipped at the borders, so near an edge less
    than a full square is erased (DeVries & Taylor's Cutout).

    Args:
        crop_size: side of the square [pixels], >= 1.
        fill: the value of erased pixels, one per channel.

    Raises:
        ValueError: ``crop_size`` < 1; at build time, a ``fill`` whose length
            is not the number of channels.
    """

    reentrant = True

    def __init__(self, crop_size: int, fill: Sequence[int] = (0, 0, 0)) -> None:
        if int(crop_size) != crop_size or crop_size < 1:
            raise ValueError(f"crop_size must be an integer >= 1; got {crop_size}")
        self.crop_size = int(crop_size)
        self.fill = tuple(int(v) for v in fill)
        self._fill: np.ndarray | None = None

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        _, _, c = check_hwc(self, previous_state)
        if len(self.fill) != c:
            raise ValueError(f"Cutout's fill needs one value per channel ({c}); got {self.fill}")
        self._fill = np.array(self.fill, dtype=np.dtype(previous_state.dtype))
        return replace(previous_state, jit_mode=True), None

    def generate_code(self) -> Callable[..., Any]:
        kernel = _cutout_kernel if Compiler.is_enabled() else _cutout_kernel.py_func
        crop_size, fill = self.crop_size, self._fill if self._fill is not None else np.array(self.fill, dtype=np.uint8)

        def cutout(batch: np.ndarray, dst: Any, indices: np.ndarray, seeds: np.ndarray) -> np.ndarray:
            return kernel(batch, seeds, crop_size, fill)  # type: ignore[no-any-return]

        return cutout

    def __repr__(self) -> str:
        return f"Cutout(crop_size={self.crop_size}, fill={self.fill})"
