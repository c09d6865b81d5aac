"""Choice of Numba's threading layer, made once, before the first parallel region.

Numba picks TBB, then OpenMP, then its own workqueue. TBB steals work, so a
thread descheduled by another process does not stall the batch; GNU OpenMP's
static schedule does (a batch can take milliseconds on a loaded machine), and
the workqueue layer cannot run two parallel regions at once. The ``tbb``
wheel installs ``libtbb.so.12`` under ``sys.prefix/lib``, where Numba does not
look: :func:`prefer_tbb` loads it so that Numba finds it.

Numba's threading layer is then started on the thread that builds the
Loader (the main thread, as a rule), not lazily on a producer thread at the
first parallel kernel. With TBB and one CPU available (a container's CPU
quota of 1, or ``taskset -c 0``), TBB starts no worker thread, and the task
Numba queues when it starts its layer can then only be run by the thread
that queued it: when that was a producer thread, which has ended, the
interpreter's exit waits for the task forever (oneTBB issue 2056, Numba
issue 10556). Started on the main thread, which is the one that waits at
exit, it runs.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

_done = False


def prefer_tbb() -> str | None:
    """Make TBB available to Numba if the ``tbb`` wheel is installed, and start Numba's threading layer on this thread.

    Returns the library loaded. Called by the loader before its first
    parallel region (from the thread that builds it), never at import.
    Respects ``NUMBA_THREADING_LAYER`` when the user set it.
    """
    global _done
    if _done:
        return None
    _done = True
    loaded = _load_tbb()
    _start_numba_threads()
    return loaded


def _load_tbb() -> str | None:
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


def _start_numba_threads() -> None:
    """Start Numba's threading layer from this thread (see the module's docstring: a hang at exit otherwise)."""
    import numba

    try:
        numba.get_num_threads()  # (starts the layer: Numba's public way to do it)
    except ValueError:  # no layer can start here (none installed): the first parallel kernel says why
        return


def threading_layer() -> str:
    """The layer Numba uses (``'tbb'``, ``'omp'``, ``'workqueue'``), or ``'none'`` before any parallel region."""
    import numba

    try:
        return str(numba.threading_layer())
    except ValueError:
        return "none"
