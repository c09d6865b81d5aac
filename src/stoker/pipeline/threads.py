"""Choice of Numba's threading layer, made once, before the first parallel region.

Numba picks TBB, then OpenMP, then its own workqueue. TBB steals work, so a
thread descheduled by another process does not stall the batch; GNU OpenMP's
static schedule does (a batch can take milliseconds on a loaded machine), and
the workqueue layer cannot run two parallel regions at once. The ``tbb``
wheel installs ``libtbb.so.12`` under ``sys.prefix/lib``, where Numba does not
look: :func:`prefer_tbb` loads it so that Numba finds it.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

_done = False


def prefer_tbb() -> str | None:
    """Make TBB available to Numba if the ``tbb`` wheel is installed; returns the library loaded.

    Called by the loader before its first parallel region, never at import.
    Respects ``NUMBA_THREADING_LAYER`` when the user set it.
    """
    global _done
    if _done:
        return None
    _done = True
    if os.environ.get("NUMBA_THREADING_LAYER") or not sys.platform.startswith("linux"):
        return None
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        for lib in sorted(glob.glob(os.path.join(prefix, "lib", "libtbb.so.12*"))):
            try:
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
                return lib
            except OSError:
                continue
    return None


def threading_layer() -> str:
    """The layer Numba uses (``'tbb'``, ``'omp'``, ``'workqueue'``), or ``'none'`` before any parallel region."""
    import numba

    try:
        return str(numba.threading_layer())
    except ValueError:
        return "none"
