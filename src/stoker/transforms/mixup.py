"""Mixup of images and of their labels: :class:`ImageMixup`, :class:`LabelMixup`.

Both operations must pair the same samples with the same weights. The loader
derives each operation's per-sample seeds from (loader seed, epoch, sample
index, salt), the salt normally being the operation's position; mixup
operations set the attribute ``seed_salt`` instead (the same value for both by
default), so an ``ImageMixup`` and a ``LabelMixup`` in two fields of one loader
receive identical seeds, and :func:`mixup_plan` turns them into identical
pairings and weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numba
import numpy as np

from stoker import _numba_cache
from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.compiler import Compiler
from stoker.pipeline.operation import Operation
from stoker.pipeline.random import randint, uniform
from stoker.pipeline.state import State
from stoker.transforms.flip import numpy_image_size

_numba_cache.register()  # before its cache=True kernels: their compiled code is kept in stoker's private folder only

#: the seed salt shared by :class:`ImageMixup` and :class:`LabelMixup` ("mixup" in ASCII)
MIXUP_SEED_SALT = 0x6D69787570
#: the first counter of the stream of ``seeds[0]`` used to shuffle the batch (beta draws use counters from 0)
_PERMUTATION_COUNTER = 1 << 20
_MAX_TRIES = 256


@numba.njit(nogil=True, cache=True)
def _log_gamma(seed, k, shape):  # type: ignore[no-untyped-def]
    """log of a Gamma(shape, 1) draw from the counters ``k, k + 1, ...`` of ``seed``; returns it and the next counter.

    Marsaglia & Tsang's method (normals by Box-Muller); for ``shape < 1`` the
    draw for ``shape + 1`` is scaled by ``U ** (1 / shape)``, in log space so
    that small shapes do not underflow to 0.
    """
    boost = 0.0
    a = shape
    if a < 1.0:
        boost = math.log(1.0 - uniform(seed, k)) / a
        k += 1
        a += 1.0
    d = a - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    for _ in range(_MAX_TRIES):
        u1 = 1.0 - uniform(seed, k)
        u2 = uniform(seed, k + 1)
        u = 1.0 - uniform(seed, k + 2)
        k += 3
        z = math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)
        v = 1.0 + c * z
        if v <= 0.0:
            continue
        v = v * v * v
        if math.log(u) < 0.5 * z * z + d - d * v + d * math.log(v):
            return math.log(d * v) + boost, k
    return math.log(d) + boost, k  # reached with probability < 0.05 ** 256


@numba.njit(nogil=True, cache=True)
def beta(seed, alpha):  # type: ignore[no-untyped-def]
    """A Beta(alpha, alpha) draw, a pure function of ``seed`` (X / (X + Y) with X, Y ~ Gamma(alpha))."""
    lx, k = _log_gamma(seed, 0, alpha)
    ly, _ = _log_gamma(seed, k, alpha)
    t = ly - lx  # lambda = 1 / (1 + exp(t)), written so that exp cannot overflow
    if t > 0.0:
        e = math.exp(-t)
        return e / (1.0 + e)
    return 1.0 / (1.0 + math.exp(t))


@numba.njit(nogil=True, cache=True)
def mixup_plan(seeds, alpha, same_lambda):  # type: ignore[no-untyped-def]
    """The partner and the weight of each sample of a batch, from the batch's mixup seeds.

    Returns:
        ``(partner, lam)``: sample ``i`` becomes ``lam[i] * x[i] + (1 - lam[i]) * x[partner[i]]``.
        ``partner`` is a permutation of the batch, shuffled (Fisher-Yates) from
        the stream of ``seeds[0]``; ``lam[i] ~ Beta(alpha, alpha)`` is drawn from
        ``seeds[i]``, or from ``seeds[0]`` for every sample when ``same_lambda``.
    """
    n = seeds.shape[0]
    partner = np.arange(n)
    lam = np.empty(n, dtype=np.float64)
    if n == 0:
        return partner, lam
    for j in range(n - 1, 0, -1):
        r = randint(seeds[0], _PERMUTATION_COUNTER + j, 0, j + 1)
        t = partner[j]
        partner[j] = partner[r]
        partner[r] = t
    if same_lambda:
        lam[:] = beta(seeds[0], alpha)
    else:
        for i in range(n):
            lam[i] = beta(seeds[i], alpha)
    return partner, lam


@numba.njit(nogil=True, parallel=True, cache=True)
def _image_mixup_kernel(images, dst, seeds, alpha, same_lambda):  # type: ignore[no-untyped-def]
    partner, lam = mixup_plan(seeds, alpha, same_lambda)
    n, d0, d1, d2 = images.shape  # HWC or CHW alike: the blend is value by value
    for i in numba.prange(n):
        a = lam[i]
        b = 1.0 - a
        j = partner[i]
        for y in range(d0):
            for x in range(d1):
                for k in range(d2):
                    dst[i, y, x, k] = int(a * images[i, y, x, k] + b * images[j, y, x, k] + 0.5)
    return dst


@numba.njit(nogil=True, cache=True)
def _label_mixup_kernel(labels, dst, seeds, alpha, same_lambda):  # type: ignore[no-untyped-def]
    partner, lam = mixup_plan(seeds, alpha, same_lambda)
    for i in range(labels.shape[0]):
        dst[i, 0] = labels[i, 0]
        dst[i, 1] = labels[partner[i], 0]
        dst[i, 2] = lam[i]
    return dst


class _Mixup(Operation):
    def __init__(self, alpha: float, same_lambda: bool, *, seed_salt: int = MIXUP_SEED_SALT) -> None:
        if not float(alpha) > 0.0:
            raise ValueError(f"alpha must be > 0 (the parameter of Beta(alpha, alpha)); got {alpha}")
        self.alpha = float(alpha)
        self.same_lambda = bool(same_lambda)
        #: read by the loader: the seeds of this operation come from this salt, not from its position
        self.seed_salt = int(seed_salt)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(alpha={self.alpha}, same_lambda={self.same_lambda})"


class ImageMixup(_Mixup):
    """Mixup on uint8 image batches: each image blended with another image of its batch (compiled).

    Image ``i`` becomes ``round(lam[i] * x[i] + (1 - lam[i]) * x[partner[i]])``
    with ``(partner, lam) = mixup_plan(seeds, alpha, same_lambda)``: ``partner``
    is a permutation of the batch (which may leave a sample paired with
    itself), ``lam ~ Beta(alpha, alpha)``. Put a :class:`LabelMixup` with the
    same arguments on the label field: both draw from seeds salted with
    ``seed_salt`` rather than with their position, so they agree on every
    pairing and weight. Works on uint8 numpy image batches (before
    ``ToTensor``), into new memory; the blend is per value, so either layout,
    HWC or CHW, is kept as it is.

    Args:
        alpha: the parameter of the Beta(alpha, alpha) distribution of the weights, > 0.
        same_lambda: one weight for the whole batch (drawn from the first sample's seed).
        seed_salt: the salt of the seeds; ImageMixup and LabelMixup must share it.

    Raises:
        ValueError: ``alpha`` <= 0; at build time, a batch that is not uint8
            images of a known layout.
    """

    reentrant = True
    wraps_kernels = True  # its generated function only calls compiled kernels

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        numpy_image_size(self, previous_state)
        if np.dtype(previous_state.dtype) != np.uint8:
            raise ValueError(f"ImageMixup works on uint8 images (place it before NormalizeImage); got {previous_state.dtype}")
        return replace(previous_state, jit_mode=True), AllocationQuery(previous_state.shape, np.dtype(np.uint8))

    def generate_code(self) -> Callable[..., Any]:
        kernel = _image_mixup_kernel if Compiler.is_enabled() else _image_mixup_kernel.py_func
        alpha, same_lambda = self.alpha, self.same_lambda

        def image_mixup(batch: np.ndarray, dst: np.ndarray, indices: np.ndarray, seeds: np.ndarray) -> np.ndarray:
            return kernel(batch, dst, seeds, alpha, same_lambda)  # type: ignore[no-any-return]

        return image_mixup


class LabelMixup(_Mixup):
    """The labels of a batch mixed by :class:`ImageMixup`: ``(label, partner's label, lam)`` per sample.

    Takes ``(batch, 1)`` labels (e.g. from ``IntDecoder``) and returns
    ``(batch, 3)`` float64, as FFCV: the loss is
    ``lam * loss(out, label) + (1 - lam) * loss(out, partner's label)``.

    Args:
        alpha: as given to the :class:`ImageMixup` of the image field.
        same_lambda: as given to the :class:`ImageMixup` of the image field.
        seed_salt: the salt of the seeds; ImageMixup and LabelMixup must share it.

    Raises:
        ValueError: ``alpha`` <= 0; at build time, samples that are not one label each.
    """

    reentrant = True
    wraps_kernels = True  # its generated function only calls compiled kernels

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        if previous_state.shape != (1,):
            raise ValueError(
                f"LabelMixup expects one label per sample (sample shape (1,), as IntDecoder gives); got {previous_state.shape}"
            )
        out = np.dtype(np.float64)
        return replace(previous_state, jit_mode=True, shape=(3,), dtype=out), AllocationQuery((3,), out)

    def generate_code(self) -> Callable[..., Any]:
        kernel = _label_mixup_kernel if Compiler.is_enabled() else _label_mixup_kernel.py_func
        alpha, same_lambda = self.alpha, self.same_lambda

        def label_mixup(batch: np.ndarray, dst: np.ndarray, indices: np.ndarray, seeds: np.ndarray) -> np.ndarray:
            return kernel(batch, dst, seeds, alpha, same_lambda)  # type: ignore[no-any-return]

        return label_mixup


# FFCV defines MixupToOneHot in this module: ``from stoker.transforms.mixup import MixupToOneHot`` works as there
from stoker.transforms.mixup_one_hot import MixupToOneHot  # noqa: E402

__all__ = ["ImageMixup", "LabelMixup", "MixupToOneHot", "beta", "mixup_plan"]
