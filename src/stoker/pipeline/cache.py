"""Disk cache of fused pipeline functions.

Numba caches functions defined in files. A fused function is generated per
pipeline, so its source is written to a file named after a *fingerprint* of
everything that determines its machine code: each operation's bytecode,
constants and closure values, recursively through the compiled functions it
calls. The same pipeline in another process finds the same file and Numba
loads the compiled function instead of compiling it. An operation whose code
cannot be fingerprinted (a closure over an arbitrary object) is not cached.

The cache lives in ``$STOKER_CACHE_DIR``, else ``$XDG_CACHE_HOME/stoker``, else
``~/.cache/stoker``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


class _Uncacheable(Exception):
    pass


def cache_dir() -> Path:
    """Where fused functions are cached."""
    root = os.environ.get("STOKER_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "stoker")
    return Path(root) / "fused"


def _feed(h: Any, value: Any, seen: set[int], depth: int = 0) -> None:
    """Hash ``value`` into ``h``, or raise _Uncacheable."""
    if depth > 20:
        raise _Uncacheable("too deep")
    import numba

    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        h.update(f"{type(value).__name__}:{value!r};".encode())
    elif isinstance(value, np.ndarray):
        h.update(f"ndarray:{value.dtype.str}:{value.shape};".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, (np.generic, np.dtype)):
        h.update(f"np:{value!r};".encode())
    elif isinstance(value, (tuple, list)):
        h.update(f"{type(value).__name__}[{len(value)}];".encode())
        for v in value:
            _feed(h, v, seen, depth + 1)
    elif isinstance(value, numba.core.dispatcher.Dispatcher):
        h.update(f"dispatcher:{sorted(value.targetoptions.items())!r};".encode())
        _feed(h, value.py_func, seen, depth + 1)
    elif isinstance(value, types.FunctionType):
        if id(value) in seen:
            h.update(b"recursion;")
            return
        seen.add(id(value))
        h.update(f"function:{value.__module__}.{value.__qualname__};".encode())
        _feed_code(h, value.__code__, seen, depth)
        for cell in value.__closure__ or ():
            _feed(h, cell.cell_contents, seen, depth + 1)
        for name in _global_names(value.__code__):
            if name in value.__globals__:
                h.update(f"global:{name};".encode())
                _feed_global(h, value.__globals__[name], seen, depth + 1)
    elif isinstance(value, numba.core.extending._Intrinsic):
        h.update(f"intrinsic:{value._name};".encode())
        _feed(h, value._defn, seen, depth + 1)  # the typing function, with its codegen's bytecode
    elif isinstance(value, type):  # e.g. numba.prange captured by an operation's closure
        h.update(f"class:{value.__module__}.{value.__qualname__};".encode())
    elif isinstance(value, types.ModuleType):
        h.update(f"module:{value.__name__};".encode())
    elif isinstance(value, types.BuiltinFunctionType):
        h.update(f"builtin:{getattr(value, '__module__', '')}.{value.__qualname__};".encode())
    else:
        raise _Uncacheable(f"cannot fingerprint {type(value).__name__}")


def _feed_global(h: Any, value: Any, seen: set[int], depth: int) -> None:
    # numpy and math functions, numba helpers and classes are identified by name; the rest by value
    if (
        callable(value)
        and not isinstance(value, types.FunctionType)
        and type(value).__module__.split(".")[0] in ("numpy", "numba", "math", "builtins")
    ):
        h.update(f"{type(value).__module__}.{getattr(value, '__qualname__', type(value).__qualname__)};".encode())
        return
    if isinstance(value, type):
        h.update(f"class:{value.__module__}.{value.__qualname__};".encode())
        return
    _feed(h, value, seen, depth)


def _global_names(code: types.CodeType) -> list[str]:
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.extend(_global_names(const))
    return names


def _feed_code(h: Any, code: types.CodeType, seen: set[int], depth: int) -> None:
    h.update(code.co_code)
    h.update(repr(code.co_names).encode())
    h.update(repr(code.co_varnames).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _feed_code(h, const, seen, depth + 1)
        else:
            h.update(f"{type(const).__name__}:{const!r};".encode())


def fingerprint(source: str, functions: list[Callable[..., Any]]) -> str | None:
    """A hex digest of the generated source and every function it calls, or ``None`` if one cannot be hashed."""
    import numba

    h = hashlib.sha256()
    h.update(f"numba {numba.__version__}; python {sys.version_info[:2]}; numpy {np.__version__};".encode())
    h.update(source.encode())
    seen: set[int] = set()
    try:
        for fn in functions:
            _feed(h, fn, seen)
    except _Uncacheable:
        return None
    return h.hexdigest()[:32]


def load_cached(source: str, namespace: dict[str, Any], name: str) -> Callable[..., Any] | None:
    """Compile ``name`` from ``source`` with Numba's disk cache, or return ``None`` if it cannot be cached."""
    import numba

    key = fingerprint(source, [v for k, v in sorted(namespace.items())])
    if key is None:
        return None
    folder = cache_dir()
    path = folder / f"fused_{key}.py"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            tmp = folder / f".fused_{key}.{os.getpid()}.tmp"
            tmp.write_text(source)
            os.replace(tmp, path)
    except OSError:
        return None
    spec = importlib.util.spec_from_file_location(f"stoker_fused_{key}", path)
    if spec is None or spec.loader is None:
        return None
    module = sys.modules.get(spec.name)
    if module is None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        # registered so that Numba can find the module again when it loads the cached code
        sys.modules[spec.name] = module
    module.__dict__.update(namespace)  # the operations the generated code calls
    return numba.njit(nogil=True, cache=True)(getattr(module, name))  # type: ignore[no-any-return]
