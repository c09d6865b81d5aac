"""Counter-based randomness: every draw is a pure function of (seed, counter).

The loader gives each random operation one ``uint64`` seed per sample, derived
from (loader seed, epoch, sample index, operation). Inside compiled code,
``uniform(seed, k)`` is the k-th draw for that sample: no generator state is
shared between threads, so results do not depend on the number of threads.
"""

from __future__ import annotations

import numba
import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)
_INV53 = 1.0 / 9007199254740992.0  # 2**-53


@numba.njit(nogil=True, cache=True)
def mix64(x: np.uint64) -> np.uint64:
    """SplitMix64's finaliser: a bijective mix of 64 bits."""
    z = x + _GOLDEN
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


@numba.njit(nogil=True, cache=True)
def uniform(seed: np.uint64, k: int) -> float:
    """The k-th uniform draw in [0, 1) of the stream ``seed``."""
    return float(mix64(seed ^ mix64(np.uint64(k))) >> _S11) * _INV53


@numba.njit(nogil=True, cache=True)
def randint(seed: np.uint64, k: int, low: int, high: int) -> int:
    """The k-th integer draw in [low, high) of the stream ``seed``."""
    return low + int(uniform(seed, k) * (high - low))


def _mix_np(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> _S30)) * _M1
        z = (z ^ (z >> _S27)) * _M2
        return z ^ (z >> _S31)


def sample_seeds(seed: int, epoch: int, indices: np.ndarray, salt: int) -> np.ndarray:
    """One ``uint64`` seed per sample: a pure function of (seed, epoch, index, salt)."""
    base = _mix_np(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
    base = _mix_np(base ^ np.uint64(epoch & 0xFFFFFFFFFFFFFFFF))
    base = _mix_np(base ^ np.uint64(salt & 0xFFFFFFFFFFFFFFFF))
    return _mix_np(base ^ indices.astype(np.uint64))
