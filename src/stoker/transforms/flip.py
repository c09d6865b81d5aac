"""Random horizontal flips of image batches: :class:`RandomHorizontalFlip`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numba
import numpy as np

from stoker import _numba_cache
from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.compiler import Compiler
from stoker.pipeline.operation import Operation
from stoker.pipeline.random import uniform
from stoker.pipeline.state import State

_numba_cache.register()  # before its cache=True kernels: their compiled code is kept in stoker's private folder only


@numba.njit(nogil=True, cache=True)
def flip_one(image, seed, flip_prob):  # type: ignore[no-untyped-def]
    """Mirror one HWC ``image`` left-right, in place, if ``uniform(seed, 0) < flip_prob``; returns it."""
    h, w, c = image.shape
    if uniform(seed, 0) >= flip_prob:
        return image
    row = numba.uint64(w * c)
    cu = numba.uint64(c)
    half = numba.uint64(w // 2)
    last = numba.uint64(max(w - 1, 0))  # w = 0: nothing to swap, and uint64 cannot hold -1
    flat = image.reshape(-1)
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
    return image


@numba.njit(nogil=True, cache=True)
def flip_chw_one(image, seed, flip_prob):  # type: ignore[no-untyped-def]
    """Mirror one CHW ``image`` left-right, in place, if ``uniform(seed, 0) < flip_prob``: each row of each plane reversed."""
    c, h, w = image.shape
    if uniform(seed, 0) >= flip_prob:
        return image
    rows = numba.uint64(c * h)
    wu = numba.uint64(w)
    half = numba.uint64(w // 2)
    last = numba.uint64(max(w - 1, 0))  # w = 0: nothing to swap, and uint64 cannot hold -1
    flat = image.reshape(-1)
    for r in range(rows):
        start = r * wu
        end = start + last
        for x in range(half):  # contiguous rows, unsigned indices: a reversed vector load and store
            t = flat[start + x]
            flat[start + x] = flat[end - x]
            flat[end - x] = t
    return image


@numba.njit(nogil=True, parallel=True, cache=True)
def _flip_kernel(images, seeds, flip_prob):  # type: ignore[no-untyped-def]
    """Mirror ``images[i]`` (HWC) left-right, in place, where ``uniform(seeds[i], 0) < flip_prob``."""
    for i in numba.prange(images.shape[0]):
        flip_one(images[i], seeds[i], flip_prob)
    return images


@numba.njit(nogil=True, parallel=True, cache=True)
def _flip_chw_kernel(images, seeds, flip_prob):  # type: ignore[no-untyped-def]
    """Mirror ``images[i]`` (CHW) left-right, in place, where ``uniform(seeds[i], 0) < flip_prob``."""
    for i in numba.prange(images.shape[0]):
        flip_chw_one(images[i], seeds[i], flip_prob)
    return images


def numpy_image_size(op: Operation, state: State) -> tuple[int, int, int]:
    """The (height, width, channels) of the numpy image batches a compiled image operation receives.

    Raises:
        ValueError: the batch is not a numpy batch that Numba can compile, or
            its samples are not images of a known layout.
    """
    if not state.jit_mode:
        raise ValueError(
            f"{type(op).__name__} is a compiled operation on numpy batches: place it before ToTensor and other tensor operations "
            f"(and not after NormalizeImage(type=np.float16)); got a batch of {state.dtype}"
        )
    return state.image_size(op)


class RandomHorizontalFlip(Operation):
    """Flips each image left-right with probability ``flip_prob`` (in place, compiled).

    Works on numpy image batches of any dtype (place it before ``ToTensor``),
    in either layout: ``(batch, height, width, channels)`` as decoders make
    them, or ``(batch, channels, height, width)`` as ``NormalizeImage`` does;
    the state's layout says which, and the width axis is mirrored. Sample
    ``i`` is flipped when ``uniform(seeds[i], 0) < flip_prob``: the choice
    depends only on the loader's seed, the epoch and the sample's position,
    not on the number of threads.

    Args:
        flip_prob: probability of flipping each image, in [0, 1].

    Raises:
        ValueError: ``flip_prob`` outside [0, 1]; at build time, samples that
            are not images of a known layout.
    """

    reentrant = True
    wraps_kernels = True  # its generated function only calls compiled kernels

    def __init__(self, flip_prob: float = 0.5) -> None:
        if not 0.0 <= float(flip_prob) <= 1.0:
            raise ValueError(f"flip_prob must lie in [0, 1]; got {flip_prob}")
        self.flip_prob = float(flip_prob)
        self._chw = False

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        numpy_image_size(self, previous_state)
        self._chw = previous_state.layout == "CHW"
        return replace(previous_state, jit_mode=True), None

    def generate_code(self) -> Callable[..., Any]:
        compiled = _flip_chw_kernel if self._chw else _flip_kernel
        kernel = compiled if Compiler.is_enabled() else compiled.py_func
        flip_prob = self.flip_prob

        def random_horizontal_flip(batch: np.ndarray, dst: Any, indices: np.ndarray, seeds: np.ndarray) -> np.ndarray:
            return kernel(batch, seeds, flip_prob)  # type: ignore[no-any-return]

        return random_horizontal_flip

    def generate_sample_code(self) -> Callable[..., Any]:
        one = flip_chw_one if self._chw else flip_one
        flip_prob = self.flip_prob

        def random_horizontal_flip_one(image: np.ndarray, dst: Any, index: int, seed: np.uint64) -> np.ndarray:
            return one(image, seed, flip_prob)  # type: ignore[no-any-return]

        return random_horizontal_flip_one

    def __repr__(self) -> str:
        return f"RandomHorizontalFlip(flip_prob={self.flip_prob})"
