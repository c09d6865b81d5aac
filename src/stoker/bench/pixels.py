"""Pixel checks for the image benchmarks: a system's images against the expected ones, within a tolerance.

Different decoders and resizers do not give identical pixels, so the checks
bound the mean absolute difference over the batch and the largest one, the
latter optionally away from the border (resizers treat the edges
differently). A random flip is checked by accepting, per sample, the expected
image or its mirror, and bounding the fraction flipped. Anything else raises
:class:`~stoker.bench.loading.BenchCheckError`: a system that fails reports
no number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from stoker.bench.loading import BenchCheckError


@dataclass(frozen=True)
class Tolerance:
    """How far a system's images may be from the expected ones.

    Attributes:
        mean_abs: bound on the mean absolute difference over all pixels of the batch.
        max_abs: bound on the largest absolute difference, ``border`` pixels away from the edges.
        border: pixels at each edge left out of ``max_abs``.
        edge_max_abs: bound on the largest absolute difference including the border
            (``None``: the same as ``max_abs``).
    """

    mean_abs: float
    max_abs: float
    border: int = 0
    edge_max_abs: float | None = None

    def __post_init__(self) -> None:
        if self.mean_abs < 0 or self.max_abs < 0 or self.border < 0:
            raise ValueError(f"a Tolerance's bounds must be >= 0; got {self}")

    def describe(self) -> str:
        """The bounds in words, for reports."""
        text = f"mean |diff| <= {self.mean_abs:g}, max |diff| <= {self.max_abs:g}"
        if self.border:
            text += f" away from a {self.border}-pixel border"
            text += f" ({self.edge_max_abs if self.edge_max_abs is not None else self.max_abs:g} with it)"
        return text


def layout(x: Any) -> str:
    """``"contiguous"``, ``"channels_last"`` (NCHW view of NHWC memory) or ``"strided"`` for a 4-d tensor or array."""
    if hasattr(x, "is_contiguous"):
        import torch

        if x.is_contiguous():
            return "contiguous"
        if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
            return "channels_last"
        return "strided"
    a = np.asarray(x)
    if a.flags.c_contiguous:
        return "contiguous"
    if a.ndim == 4 and np.transpose(a, (0, 2, 3, 1)).flags.c_contiguous:
        return "channels_last"
    return "strided"


def to_numpy(x: Any) -> np.ndarray:
    """A numpy copy of a tensor or array (the batch's memory may be reused)."""
    if hasattr(x, "detach"):
        return np.array(x.detach().cpu().numpy())
    return np.array(x)


def _diffs(got: np.ndarray, want: np.ndarray, border: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per sample: mean |diff|, max |diff| away from the border, max |diff|."""
    d = np.abs(got.astype(np.float64) - want.astype(np.float64))
    n = d.shape[0]
    flat = d.reshape(n, -1)
    inner = d[..., border : d.shape[-2] - border, border : d.shape[-1] - border] if border else d
    return flat.mean(axis=1), inner.reshape(n, -1).max(axis=1, initial=0.0), flat.max(axis=1, initial=0.0)


def _check_shape(got: np.ndarray, want: np.ndarray, who: str) -> None:
    if got.shape != want.shape:
        raise BenchCheckError(f"{who}: images of shape {got.shape} were expected to be {want.shape}")


def _bound(mean: float, inner: float, full: float, tol: Tolerance, who: str, where: str) -> None:
    edge = tol.max_abs if tol.edge_max_abs is None else tol.edge_max_abs
    if mean > tol.mean_abs or inner > tol.max_abs or full > edge:
        raise BenchCheckError(
            f"{who}: images differ from the expected ones{where}: mean |diff| {mean:.3f}, max |diff| {inner:g} "
            f"(border included: {full:g}); allowed: {tol.describe()}"
        )


def check_images(got: np.ndarray, want: np.ndarray, tol: Tolerance, who: str) -> dict[str, float]:
    """Check a batch of images (any layout, same shape) against the expected ones.

    Args:
        got: the system's images, ``(N, ...)``, the last two axes height and width.
        want: the expected images, same shape.
        tol: the bounds.
        who: the system's name, for the message.

    Returns:
        ``{"mean_abs", "max_abs", "edge_max_abs"}`` over the batch.

    Raises:
        BenchCheckError: another shape, or a bound exceeded.
    """
    _check_shape(got, want, who)
    mean, inner, full = _diffs(got, want, tol.border)
    stats = {"mean_abs": float(mean.mean()), "max_abs": float(inner.max(initial=0.0)), "edge_max_abs": float(full.max(initial=0.0))}
    _bound(stats["mean_abs"], stats["max_abs"], stats["edge_max_abs"], tol, who, "")
    return stats


def check_maybe_flipped(got: np.ndarray, want: np.ndarray, tol: Tolerance, who: str, flip_prob: float = 0.5) -> dict[str, float]:
    """Check images that were flipped left-right at random: each must match the expected image or its mirror.

    The orientation closer to each sample is chosen, the bounds of ``tol``
    apply to the chosen ones, and the fraction flipped must lie within 4.5
    standard deviations of ``flip_prob``.

    Returns:
        ``{"mean_abs", "max_abs", "edge_max_abs", "flipped"}`` (the fraction flipped).

    Raises:
        BenchCheckError: another shape, a bound exceeded, or a fraction flipped that is not ``flip_prob``'s.
    """
    _check_shape(got, want, who)
    plain = _diffs(got, want, tol.border)
    mirror = _diffs(got, want[..., ::-1], tol.border)
    flipped = mirror[0] < plain[0]
    mean, inner, full = (np.where(flipped, m, p) for p, m in zip(plain, mirror))
    n = len(flipped)
    frac = float(flipped.mean()) if n else 0.0
    stats = {
        "mean_abs": float(mean.mean()),
        "max_abs": float(inner.max(initial=0.0)),
        "edge_max_abs": float(full.max(initial=0.0)),
        "flipped": frac,
    }
    _bound(stats["mean_abs"], stats["max_abs"], stats["edge_max_abs"], tol, who, " (each compared with the expected image or its mirror)")
    spread = 4.5 * math.sqrt(flip_prob * (1 - flip_prob) / max(n, 1))
    if abs(frac - flip_prob) > spread:
        raise BenchCheckError(
            f"{who}: {frac:.1%} of {n} images were flipped; a random flip with p={flip_prob} flips {flip_prob:.0%} ± {spread:.1%}"
        )
    return stats
