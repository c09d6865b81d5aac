"""Random brightness, contrast and saturation of uint8 image batches, with FFCV's names and formulas.

:class:`RandomBrightness`, :class:`RandomContrast` and :class:`RandomSaturation`
(FFCV's ``ffcv.transforms.color_jitter``). Each changes an image with
probability ``p`` by a factor ``f`` uniform in ``[max(0, 1 - magnitude), 1 + magnitude]``,
blending it with a grey version of itself as torchvision's ColorJitter does:

* brightness: ``x' = f * x`` (blended with black);
* contrast: ``x' = f * x + (1 - f) * mean(grey)``, one mean per image;
* saturation: ``x' = f * x + (1 - f) * grey``, pixel by pixel;

where ``grey = uint8(0.2989 * r + 0.587 * g + 0.114 * b)``, and ``x'`` is clipped
to [0, 255] and truncated to uint8, as in FFCV. Sample ``i`` is changed when
``uniform(seeds[i], 0) < p``, with ``f = low + (high - low) * uniform(seeds[i], 1)``:
the draws depend only on the loader's seed, the epoch and the sample's position.
"""

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
from stoker.transforms.flip import numpy_image_size

_numba_cache.register()  # before its cache=True kernels: their compiled code is kept in stoker's private folder only

_BRIGHTNESS, _CONTRAST, _SATURATION = 0, 1, 2


@numba.njit(nogil=True, cache=True)
def _to_u8(v):  # type: ignore[no-untyped-def]
    """``np.clip(v, 0, 255).astype(np.uint8)``: clipped, then truncated."""
    if v < 0.0:
        v = 0.0
    elif v > 255.0:
        v = 255.0
    return np.uint8(int(v))


@numba.njit(nogil=True, cache=True)
def _grey(img, y, x):  # type: ignore[no-untyped-def]
    """The uint8 grey level of pixel ``(y, x)`` of an HWC RGB image (ITU-R 601-2 luma, truncated)."""
    v = 0.2989 * np.float64(img[y, x, 0]) + 0.587 * np.float64(img[y, x, 1]) + 0.114 * np.float64(img[y, x, 2])
    return np.uint8(int(v))


@numba.njit(nogil=True, cache=True)
def color_one(img, seed, kind, p, low, high):  # type: ignore[no-untyped-def]
    """Brightness, contrast or saturation (``kind``) of one uint8 HWC image, in place."""
    h, w, c = img.shape
    if uniform(seed, 0) >= p:
        return img
    f = low + (high - low) * uniform(seed, 1)
    if kind == _BRIGHTNESS:
        for y in range(h):
            for x in range(w):
                for k in range(c):
                    img[y, x, k] = _to_u8(f * np.float64(img[y, x, k]))
    elif kind == _CONTRAST:
        total = 0
        for y in range(h):
            for x in range(w):
                total += int(_grey(img, y, x))
        mean = total / max(h * w, 1)
        for y in range(h):
            for x in range(w):
                for k in range(c):
                    img[y, x, k] = _to_u8(f * np.float64(img[y, x, k]) + (1.0 - f) * mean)
    else:
        for y in range(h):
            for x in range(w):
                g = np.float64(_grey(img, y, x))
                for k in range(c):
                    img[y, x, k] = _to_u8(f * np.float64(img[y, x, k]) + (1.0 - f) * g)
    return img


@numba.njit(nogil=True, parallel=True, cache=True)
def _color_kernel(images, seeds, kind, p, low, high):  # type: ignore[no-untyped-def]
    """:func:`color_one` for each image of the batch."""
    for i in numba.prange(images.shape[0]):
        color_one(images[i], seeds[i], kind, p, low, high)
    return images


class _ColorOperation(Operation):
    """A random colour change of uint8 RGB images in the HWC layout, in place (compiled)."""

    reentrant = True
    wraps_kernels = True  # its generated function only calls compiled kernels
    _kind = _BRIGHTNESS

    def __init__(self, magnitude: float, p: float = 0.5) -> None:
        if not float(magnitude) >= 0.0:
            raise ValueError(
                f"{type(self).__name__}: magnitude must be >= 0 (the factor lies in [max(0, 1 - magnitude), 1 + magnitude]); got {magnitude}"
            )
        if not 0.0 <= float(p) <= 1.0:
            raise ValueError(f"{type(self).__name__}: p must lie in [0, 1]; got {p}")
        self.magnitude = float(magnitude)
        self.p = float(p)

    @property
    def factor_range(self) -> tuple[float, float]:
        """The interval ``(low, high)`` of the factor: ``(max(0, 1 - magnitude), 1 + magnitude)``."""
        return max(0.0, 1.0 - self.magnitude), 1.0 + self.magnitude

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        _, _, c = numpy_image_size(self, previous_state)
        name = type(self).__name__
        if previous_state.layout != "HWC" or np.dtype(previous_state.dtype) != np.uint8:
            raise ValueError(
                f"{name} works on uint8 images in the (height, width, channels) layout, as decoders make them "
                f"(place it before NormalizeImage); got {previous_state.dtype} samples of shape {previous_state.shape}, "
                f"layout {previous_state.layout}"
            )
        if c != 3:
            raise ValueError(f"{name} works on RGB images (3 channels); got {c} channels")
        return replace(previous_state, jit_mode=True), None

    def generate_code(self) -> Callable[..., Any]:
        kernel = _color_kernel if Compiler.is_enabled() else _color_kernel.py_func
        kind, p = self._kind, self.p
        low, high = self.factor_range

        def color(batch: np.ndarray, dst: Any, indices: np.ndarray, seeds: np.ndarray) -> np.ndarray:
            return kernel(batch, seeds, kind, p, low, high)  # type: ignore[no-any-return]

        return color

    def generate_sample_code(self) -> Callable[..., Any]:
        kind, p = self._kind, self.p
        low, high = self.factor_range

        def color_sample(image: np.ndarray, dst: Any, index: int, seed: np.uint64) -> np.ndarray:
            return color_one(image, seed, kind, p, low, high)  # type: ignore[no-any-return]

        return color_sample

    def __repr__(self) -> str:
        return f"{type(self).__name__}(magnitude={self.magnitude}, p={self.p})"


class RandomBrightness(_ColorOperation):
    """Scales each image by a random factor with probability ``p``: ``x' = f * x`` (compiled, in place).

    Works on uint8 HWC image batches (after a decoder, before ``ToTensor`` and
    ``NormalizeImage``). See :mod:`stoker.transforms.color_jitter` for the
    formula, the rounding and the draws.

    Args:
        magnitude: the factor ``f`` is uniform in ``[max(0, 1 - magnitude), 1 + magnitude]``; >= 0.
        p: the probability of changing each image, in [0, 1].

    Raises:
        ValueError: ``magnitude`` < 0 or ``p`` outside [0, 1]; at build time,
            a batch that is not uint8 RGB images in the HWC layout.
    """

    _kind = _BRIGHTNESS


class RandomContrast(_ColorOperation):
    """Blends each image with its mean grey level with probability ``p``: ``x' = f * x + (1 - f) * mean(grey)``.

    Compiled, in place, on uint8 HWC RGB image batches. See
    :mod:`stoker.transforms.color_jitter` for the formula, the rounding and the draws.

    Args:
        magnitude: the factor ``f`` is uniform in ``[max(0, 1 - magnitude), 1 + magnitude]``; >= 0.
        p: the probability of changing each image, in [0, 1].

    Raises:
        ValueError: ``magnitude`` < 0 or ``p`` outside [0, 1]; at build time,
            a batch that is not uint8 RGB images in the HWC layout.
    """

    _kind = _CONTRAST


class RandomSaturation(_ColorOperation):
    """Blends each image with its grey version with probability ``p``: ``x' = f * x + (1 - f) * grey``.

    Compiled, in place, on uint8 HWC RGB image batches; ``f = 0`` gives the
    grey image, ``f > 1`` more saturated colours. See
    :mod:`stoker.transforms.color_jitter` for the formula, the rounding and the draws.

    Args:
        magnitude: the factor ``f`` is uniform in ``[max(0, 1 - magnitude), 1 + magnitude]``; >= 0.
        p: the probability of changing each image, in [0, 1].

    Raises:
        ValueError: ``magnitude`` < 0 or ``p`` outside [0, 1]; at build time,
            a batch that is not uint8 RGB images in the HWC layout.
    """

    _kind = _SATURATION
