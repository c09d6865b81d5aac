"""Random horizontal flips of image batches: :class:`RandomHorizontalFlip`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numba
import numpy as np

from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.compiler import Compiler
from stoker.pipeline.operation import Operation
from stoker.pipeline.random import uniform
from stoker.pipeline.state import State


@numba.njit(nogil=True, parallel=True, cache=True)
def _flip_kernel(images, seeds, flip_prob):  # type: ignore[no-untyped-def]
    """Mirror ``images[i]`` (HWC) left-right, in place, where ``uniform(seeds[i], 0) < flip_prob``."""
    n, h, w, c = images.shape
    row = numba.uint64(w * c)
    cu = numba.uint64(c)
    half = numba.uint64(w // 2)
    last = numba.uint64(w - 1)
    for i in numba.prange(n):
        if uniform(seeds[i], 0) < flip_prob:
            flat = images[i].reshape(-1)
            for y in range(numba.uint64(h)):
                start = y * row
                if c == 3:  # literal strides let LLVM vectorise the RGB case
                    for x in range(half):
                        a = start + numba.uint64(3) * x
                        b = start + numba.uint64(3) * (last - x)
                        t0, t1, t2 = flat[a], flat[a + numba.uint64(1)], flat[a + numba.uint64(2)]
                        flat[a], flat[a + numba.uint64(1)], flat[a + numba.uint64(2)] = (
                            flat[b],
                            flat[b + numba.uint64(1)],
                            flat[b + numba.uint64(2)],
                        )
                        flat[b], flat[b + numba.uint64(1)], flat[b + numba.uint64(2)] = t0, t1, t2
                else:
                    for x in range(half):  # unsigned indices: no wraparound checks
                        a = start + x * cu
                        b = start + (last - x) * cu
                        for k in range(cu):
                            t = flat[a + k]
                            flat[a + k] = flat[b + k]
                            flat[b + k] = t
    return images


def check_hwc(op: Operation, state: State) -> tuple[int, int, int]:
    """The (height, width, channels) of an image state; raises ``ValueError`` for anything else."""
    if len(state.shape) != 3:
        raise ValueError(f"{type(op).__name__} expects (height, width, channels) image samples; got sample shape {state.shape}")
    h, w, c = state.shape
    return h, w, c


class RandomHorizontalFlip(Operation):
    """Flips each image left-right with probability ``flip_prob`` (in place, compiled).

    Works on ``(batch, height, width, channels)`` numpy batches (place it
    before ``ToTensor``). Sample ``i`` is flipped when
    ``uniform(seeds[i], 0) < flip_prob``: the choice depends only on the
    loader's seed, the epoch and the sample, not on the number of threads.

    Args:
        flip_prob: probability of flipping each image, in [0, 1].

    Raises:
        ValueError: ``flip_prob`` outside [0, 1].
    """

    reentrant = True

    def __init__(self, flip_prob: float = 0.5) -> None:
        if not 0.0 <= float(flip_prob) <= 1.0:
            raise ValueError(f"flip_prob must lie in [0, 1]; got {flip_prob}")
        self.flip_prob = float(flip_prob)

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        check_hwc(self, previous_state)
        return replace(previous_state, jit_mode=True), None

    def generate_code(self) -> Callable[..., Any]:
        kernel = _flip_kernel if Compiler.is_enabled() else _flip_kernel.py_func
        flip_prob = self.flip_prob

        def random_horizontal_flip(batch: np.ndarray, dst: Any, indices: np.ndarray, seeds: np.ndarray) -> np.ndarray:
            return kernel(batch, seeds, flip_prob)  # type: ignore[no-any-return]

        return random_horizontal_flip

    def __repr__(self) -> str:
        return f"RandomHorizontalFlip(flip_prob={self.flip_prob})"
