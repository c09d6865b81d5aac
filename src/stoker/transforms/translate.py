"""Random translations of image batches: :class:`RandomTranslate`."""

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
def _translate_kernel(images, dst, seeds, padding, fill):  # type: ignore[no-untyped-def]
    """``dst[i, y, x] = images[i, y - dy, x - dx]`` (or ``fill`` outside), dy, dx uniform in [-padding, padding]."""
    n, h, w, c = images.shape
    for i in numba.prange(n):
        dy = randint(seeds[i], 0, -padding, padding + 1)
        dx = randint(seeds[i], 1, -padding, padding + 1)
        for y in range(h):
            sy = y - dy
            for x in range(w):
                sx = x - dx
                if 0 <= sy < h and 0 <= sx < w:
                    for k in range(c):
                        dst[i, y, x, k] = images[i, sy, sx, k]
                else:
                    for k in range(c):
                        dst[i, y, x, k] = fill[k]
    return dst


class RandomTranslate(Operation):
    """Shifts each image by a random offset, filling the uncovered pixels (compiled).

    Works on ``(batch, height, width, channels)`` numpy batches (place it
    before ``ToTensor``); the output has the input's shape, in new memory.
    Sample ``i`` moves ``dy`` pixels down and ``dx`` pixels right, with
    ``dy = randint(seeds[i], 0, -padding, padding + 1)`` and
    ``dx = randint(seeds[i], 1, -padding, padding + 1)`` (both ends included:
    FFCV draws from a zero-padded copy, which is the same picture).

    Args:
        padding: the largest shift [pixels], >= 0.
        fill: the value of uncovered pixels, one per channel.

    Raises:
        ValueError: a negative ``padding``; at build time, a ``fill`` whose
            length is not the number of channels.
    """

    reentrant = True

    def __init__(self, padding: int, fill: Sequence[int] = (0, 0, 0)) -> None:
        if int(padding) != padding or padding < 0:
            raise ValueError(f"padding must be an integer >= 0; got {padding}")
        self.padding = int(padding)
        self.fill = tuple(int(v) for v in fill)
        self._fill: np.ndarray | None = None

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        _, _, c = check_hwc(self, previous_state)
        if len(self.fill) != c:
            raise ValueError(f"RandomTranslate's fill needs one value per channel ({c}); got {self.fill}")
        dtype = np.dtype(previous_state.dtype)
        self._fill = np.array(self.fill, dtype=dtype)
        return replace(previous_state, jit_mode=True), AllocationQuery(previous_state.shape, dtype)

    def generate_code(self) -> Callable[..., Any]:
        kernel = _translate_kernel if Compiler.is_enabled() else _translate_kernel.py_func
        padding, fill = self.padding, self._fill if self._fill is not None else np.array(self.fill, dtype=np.uint8)

        def random_translate(batch: np.ndarray, dst: np.ndarray, indices: np.ndarray, seeds: np.ndarray) -> np.ndarray:
            return kernel(batch, dst, seeds, padding, fill)  # type: ignore[no-any-return]

        return random_translate

    def __repr__(self) -> str:
        return f"RandomTranslate(padding={self.padding}, fill={self.fill})"
