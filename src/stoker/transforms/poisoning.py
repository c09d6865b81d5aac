"""A mask blended into chosen images: :class:`Poison` (FFCV's ``ffcv.transforms.poisoning``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numba
import numpy as np

from stoker import _numba_cache
from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.compiler import Compiler
from stoker.pipeline.operation import Operation
from stoker.pipeline.state import State
from stoker.transforms.flip import numpy_image_size
from stoker.transforms.replace_label import contains, sorted_indices

_numba_cache.register()  # before its cache=True kernels: their compiled code is kept in stoker's private folder only


@numba.njit(nogil=True, parallel=True, cache=True)
def _poison_kernel(images, indices, to_poison, mask, alpha, low, high):  # type: ignore[no-untyped-def]
    n, h, w, c = images.shape
    for i in numba.prange(n):
        if not contains(to_poison, indices[i]):
            continue
        img = images[i]
        for y in range(h):
            for x in range(w):
                a = alpha[y, x]
                for k in range(c):
                    # float32 after each step, as FFCV's float32 scratch image
                    t = np.float32(np.float64(img[y, x, k]) * (1.0 - a))
                    t = np.float32(np.float64(t) + mask[y, x, k] * a)
                    t = min(max(t, np.float32(low)), np.float32(high))
                    img[y, x, k] = np.uint8(int(t))
    return images


class Poison(Operation):
    """Blends ``mask`` into the images whose dataset index is in ``indices`` (compiled, in place).

    Image ``x`` of a chosen sample becomes
    ``clip(x * (1 - alpha) + mask * alpha, *clamp)``, computed in float32 and
    truncated to uint8, as in FFCV; the other images are unchanged. Works on
    uint8 HWC image batches (after a decoder, before ``ToTensor`` and
    ``NormalizeImage``).

    Args:
        mask: ``(height, width, channels)``, the picture blended in.
        alpha: ``(height, width)``, its opacity per pixel, in [0, 1].
        indices: the indices, in the dataset file, of the samples to poison.
        clamp: the range the values are clipped to.

    Raises:
        ValueError: ``alpha`` not 2-d, ``mask`` not 3-d or of another height
            and width, ``indices`` not a 1-d sequence of non-negative
            integers, ``clamp`` not ``(low, high)`` with ``low <= high``; at
            build time, a batch that is not uint8 HWC images of the mask's shape.
    """

    reentrant = True
    wraps_kernels = True  # its generated function only calls compiled kernels

    def __init__(
        self, mask: np.ndarray, alpha: np.ndarray, indices: Sequence[int] | np.ndarray, clamp: tuple[float, float] = (0, 255)
    ) -> None:
        self.mask = np.ascontiguousarray(mask, dtype=np.float64)
        self.alpha = np.ascontiguousarray(alpha, dtype=np.float64)
        if self.mask.ndim != 3 or self.alpha.shape != self.mask.shape[:2]:
            raise ValueError(
                f"Poison: mask must be (height, width, channels) and alpha (height, width); got mask {self.mask.shape}, alpha {self.alpha.shape}"
            )
        low, high = (float(v) for v in clamp)
        if not low <= high:
            raise ValueError(f"Poison: clamp must be (low, high) with low <= high; got {clamp}")
        self.clamp = (low, high)
        self.indices = sorted_indices(self, indices)

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        numpy_image_size(self, previous_state)
        if previous_state.layout != "HWC" or np.dtype(previous_state.dtype) != np.uint8 or previous_state.shape != self.mask.shape:
            raise ValueError(
                f"Poison works on uint8 images in the (height, width, channels) layout of the mask, {self.mask.shape} "
                f"(place it after the decoder, before NormalizeImage); got {previous_state.dtype} samples of shape "
                f"{previous_state.shape}, layout {previous_state.layout}"
            )
        return previous_state, None

    def generate_code(self) -> Callable[..., Any]:
        kernel = _poison_kernel if Compiler.is_enabled() else _poison_kernel.py_func
        to_poison, mask, alpha = self.indices, self.mask, self.alpha
        low, high = self.clamp

        def poison(batch: np.ndarray, dst: Any, indices: np.ndarray) -> np.ndarray:
            return kernel(batch, indices, to_poison, mask, alpha, low, high)  # type: ignore[no-any-return]

        return poison

    def __repr__(self) -> str:
        return f"Poison(mask={self.mask.shape}, indices=<{self.indices.size} indices>, clamp={self.clamp})"
