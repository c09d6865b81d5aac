"""The process that compiles prebuilt kernels for this CPU (started by :mod:`stoker.pipeline.prebuilt`).

It reads a pickled list of ``(module, qualname, serial, argument types)`` on its
standard input, and compiles each kernel for those types with prebuilt kernels
off: Numba saves each into stoker's private cache folder (the environment's
``STOKER_CACHE_DIR``), where the next processes load it before the generic
CPU's code. At the lowest priority (nice 19: only the CPU time the training process
leaves); a kernel that fails to compile is left
to the processes that use it (they keep the generic code). A module whose
kernels need something done before they compile (a C library's symbols
loaded) says so with a ``prepare_kernels()`` function, called first.

Run as ``python -m stoker.pipeline._host_kernels``; nothing runs at import.
"""

from __future__ import annotations

import importlib
import pickle
import sys


def main() -> int:
    """Compile what the standard input lists; the number of kernels compiled or loaded."""
    from stoker.pipeline._fork import lower_priority

    lower_priority(19)  # (its own session: the session's share too)
    items = pickle.loads(sys.stdin.buffer.read())  # (from the parent process, through a pipe only it holds)
    from stoker import _numba_cache
    from stoker.pipeline import linking

    _numba_cache.register()
    done = 0
    for module, qualname, serial, argtypes in items:
        try:
            prepare = getattr(importlib.import_module(module), "prepare_kernels", None)
            if prepare is not None:  # (what compiling the module's kernels needs first: a C library's symbols)
                prepare()
            linking._resolve(module, qualname, serial).compile(argtypes)
            done += 1
        except Exception:  # (one kernel's failure leaves the others to compile)
            continue
    return done


if __name__ == "__main__":
    main()
