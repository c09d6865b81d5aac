"""A plain numpy model of the decoders' resampling: crop a box, then resize it."""

from __future__ import annotations

import numpy as np


def resample_matrix(start: float, length: float, n_out: int, n_src: int) -> np.ndarray:
    """``(n_out, n_src)`` weights: the overlap of each output pixel's span with each source pixel (shrinking),
    or bilinear interpolation at pixel centres with the edge repeated (enlarging)."""
    f = length / n_out
    m = np.zeros((n_out, n_src))
    src = np.arange(n_src)
    for o in range(n_out):
        if f > 1.0:
            a, b = start + o * f, start + (o + 1) * f
            m[o] = np.clip(np.minimum(b, src + 1) - np.maximum(a, src), 0.0, None) / f
        else:
            c = start + (o + 0.5) * f - 0.5
            lo = int(np.floor(c))
            t = c - lo
            m[o, min(max(lo, 0), n_src - 1)] += 1.0 - t
            m[o, min(max(lo + 1, 0), n_src - 1)] += t
    return m


def reference_crop(image: np.ndarray, box: tuple[float, float, float, float], out: tuple[int, int]) -> np.ndarray:
    """The box ``(y, x, h, w)`` (fractional) of ``image`` cropped (rounded out to whole pixels), then resampled to ``out``."""
    y, x, ch, cw = box
    y0, x0 = int(np.floor(y)), int(np.floor(x))
    crop = image[y0 : int(np.ceil(y + ch)), x0 : int(np.ceil(x + cw))].astype(np.float64)
    my = resample_matrix(y - y0, ch, out[0], crop.shape[0])
    mx = resample_matrix(x - x0, cw, out[1], crop.shape[1])
    res = np.stack([my @ crop[:, :, c] @ mx.T for c in range(3)], axis=-1)
    return np.clip(np.floor(res + 0.5), 0, 255).astype(np.uint8)
