"""Counter-based randomness: every draw is a pure function of (seed, counter).

The loader gives each random operation one ``uint64`` seed per sample, derived
from (loader seed, epoch, the sample's *position* in the epoch's order,
operation). Keying by position rather than by dataset index means that a
sample drawn twice in an epoch (``indices=[i] * k``, oversampling) gets two
independent draws, while the result stays independent of the number of
threads and a resumed epoch draws exactly what the interrupted one would have.
Inside compiled code, ``uniform(seed, k)`` is the k-th draw for that sample: no
generator state is shared between threads.
"""

from __future__ import annotations

import numba
import numpy as np

from stoker import _numba_cache, _splitmix

_numba_cache.register()  # before its cache=True kernels: their compiled code is kept in stoker's private folder only

_GOLDEN = np.uint64(_splitmix.GOLDEN)
_M1 = np.uint64(_splitmix.M1)
_M2 = np.uint64(_splitmix.M2)
_S30, _S27, _S31, _S11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)
_INV53 = 1.0 / 9007199254740992.0  # 2**-53
_MASK64 = 0xFFFFFFFFFFFFFFFF


@numba.njit(nogil=True, cache=True)
def mix64(x: np.uint64) -> np.uint64:
    """SplitMix64's finaliser, compiled (the numpy twin is :func:`stoker._splitmix.mix64`)."""
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


#: steps of a shuffle whose draws are made before their swaps: the draws of a block run back to back, and the swaps'
#: random reads (cache misses for an array of megabytes) overlap, their addresses known (1.9x as fast for 300,000
#: values here; reading the values in the draws' loop too was slower)
SHUFFLE_BLOCK = 16


@numba.njit(nogil=True, cache=True)
def _shuffle_block_steps(values: np.ndarray, key: np.uint64, start: int, steps: int, scratch: np.ndarray) -> int:
    """:func:`shuffle_steps` with its scratch memory (``SHUFFLE_BLOCK`` int64 values, overwritten)."""
    stop = max(0, start - steps)
    i = start
    while i > stop:
        m = min(SHUFFLE_BLOCK, i - stop)
        for q in range(m):  # the block's draws
            s = i - q
            j = int(uniform(key, s) * (s + 1))
            if j > s:  # a uniform draw just below 1 times a large s + 1 may round up
                j = s
            scratch[q] = j
        for q in range(m):  # its swaps, in the steps' order
            s = i - q
            j = scratch[q]
            t = values[s]
            values[s] = values[j]
            values[j] = t
        i -= m
    return stop


@numba.njit(nogil=True, cache=True)
def shuffle_steps(values: np.ndarray, key: np.uint64, start: int, steps: int) -> int:
    """Steps ``start, start - 1, ...`` (at most ``steps`` of them, none below 1) of :func:`shuffle`; returns where to go on.

    Step ``i`` swaps ``values[i]`` with ``values[j]``, ``j`` drawn in ``[0, i]`` from ``uniform(key, i)``.
    ``shuffle_steps(v, key, len(v) - 1, k)`` then ``shuffle_steps(v, key, returned, ...)`` until it
    returns 0 is :func:`shuffle` cut into pieces (a thread can shuffle while it has nothing else to do).
    """
    return _shuffle_block_steps(values, key, start, steps, np.empty(SHUFFLE_BLOCK, dtype=np.int64))


#: a shuffle step's worth of copying in :func:`order_steps`: values copied in order (a sequential copy, ~0.5 ns a
#: value here) against one step's random swap (~4 ns)
COPIES_PER_STEP = 8


@numba.njit(nogil=True, cache=True)
def order_steps(values: np.ndarray, source: np.ndarray, state: np.ndarray, key: np.uint64, work: int) -> int:
    """About ``work`` steps' worth of a shuffled copy of ``source`` made in ``values``; returns the work left (0: done).

    The copy comes first (``state[1]``: the values copied so far, :data:`COPIES_PER_STEP` of them for a step's
    worth), then the steps of :func:`shuffle_steps` (``state[0]``: the next one, 0 once done; ``state[2:]``, at
    least :data:`SHUFFLE_BLOCK` values, is their scratch memory). From ``state = [len(values) - 1, 0, ...]``,
    calls with any ``work`` (0 only asks what is left) until one returns 0 leave ``values`` as
    ``values[:] = source`` then :func:`shuffle` would: a thread can make an epoch's order in pieces between
    batches, the copy included (no pass over the whole array before its first batch).
    """
    n = values.shape[0]
    filled = state[1]
    if filled < n and work > 0:
        k = min(n - filled, work * COPIES_PER_STEP)
        values[filled : filled + k] = source[filled : filled + k]
        filled += k
        state[1] = filled
        work -= (k + COPIES_PER_STEP - 1) // COPIES_PER_STEP
    if filled >= n and work > 0 and state[0] > 0:
        state[0] = _shuffle_block_steps(values, key, state[0], work, state[2:])
    return state[0] + (n - filled + COPIES_PER_STEP - 1) // COPIES_PER_STEP


@numba.njit(nogil=True, cache=True)
def shuffle(values: np.ndarray, key: np.uint64) -> None:
    """Shuffle ``values`` in place (Fisher-Yates, steps ``len(values) - 1`` down to 1; see :func:`shuffle_steps`).

    A pure function of ``key`` and ``len(values)``; about four times as fast
    as ``numpy.random.Generator.permutation`` here (300,000 values) and without the GIL.
    """
    shuffle_steps(values, key, values.shape[0] - 1, values.shape[0])


def permutation_key(seed: int, epoch: int, salt: int = 0) -> np.uint64:
    """The stream key of an epoch's permutation: a pure function of (seed, epoch, salt)."""
    mix = _splitmix.mix64_int
    k = mix(seed & _MASK64) ^ (epoch & _MASK64)
    return np.uint64(mix(mix(k) ^ (salt & _MASK64)))


def sample_seeds(seed: int, epoch: int, positions: np.ndarray, salt: int) -> np.ndarray:
    """One ``uint64`` seed per sample: a pure function of (seed, epoch, position, salt).

    Args:
        seed: the loader's seed.
        epoch: the epoch.
        positions: the samples' positions in the epoch's order (0 for the
            epoch's first sample), not their indices in the dataset.
        salt: the operation's salt (``field_position * 1000 + op_position``,
            or the operation's ``seed_salt``).
    """
    mix = _splitmix.mix64
    base = mix(np.array([seed & _MASK64], dtype=np.uint64))
    base = mix(base ^ np.uint64(epoch & _MASK64))
    base = mix(base ^ np.uint64(salt & _MASK64))
    return mix(base ^ np.asarray(positions).astype(np.uint64))
