"""Copies for compiled kernels.

Numba checks every signed index for wraparound (negative indices), which keeps
LLVM from vectorising element loops: a byte loop over signed indices copies at
about 1 GB/s, the same loop over unsigned indices at memory speed. Slice
assignments inside ``prange`` trip Numba's parallel analysis, hence these.
"""

from __future__ import annotations

import numba

from stoker import _numba_cache

_numba_cache.register()  # before its cache=True kernels: their compiled code is kept in stoker's private folder only


@numba.njit(nogil=True, cache=True)
def copy(dst, d0, src, s0, n):  # type: ignore[no-untyped-def]
    """``dst[d0 : d0 + n] = src[s0 : s0 + n]`` for 1-D arrays (no overlap)."""
    d = numba.uint64(d0)
    s = numba.uint64(s0)
    for k in range(numba.uint64(n)):
        dst[d + k] = src[s + k]


@numba.njit(nogil=True, cache=True)
def fill(dst, d0, n, value):  # type: ignore[no-untyped-def]
    """``dst[d0 : d0 + n] = value`` for a 1-D array."""
    d = numba.uint64(d0)
    for k in range(numba.uint64(n)):
        dst[d + k] = value
