"""SplitMix64's finaliser on numpy ``uint64`` arrays: the one mixing function behind every seed.

A bijective mix of 64 bits (Steele, Lea & Flood, 2014). It sits below every
layer (the writer's ``proportion`` mode and the loader's per-sample seeds use
it); the compiled twin that kernels call is :func:`stoker.pipeline.random.mix64`.
"""

from __future__ import annotations

import numpy as np

GOLDEN = 0x9E3779B97F4A7C15
M1 = 0xBF58476D1CE4E5B9
M2 = 0x94D049BB133111EB
_MASK = (1 << 64) - 1


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser applied to every element of a ``uint64`` array (wrapping arithmetic)."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = x + np.uint64(GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(M1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(M2)
        return z ^ (z >> np.uint64(31))  # type: ignore[no-any-return]


def mix64_int(x: int) -> int:
    """:func:`mix64` of one value as a Python int (no numpy scalars: a tenth of the time, for keys computed once an epoch)."""
    z = (x + GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * M1) & _MASK
    z = ((z ^ (z >> 27)) * M2) & _MASK
    return z ^ (z >> 31)
