"""Disk cache of generated pipeline functions, and one dispatcher per process for each.

Numba caches functions defined in files. A fused function (and a loader's
producer loop) is generated per pipeline, so its source is written to a file
named after its *fingerprint* (:func:`~stoker.pipeline.fingerprint.fingerprint`:
everything that determines its machine code), and the same pipeline in another
process finds the same file and Numba loads the compiled function instead of
compiling it. Within a process, the same fingerprint gives the same dispatcher
(:func:`load_cached` imports the file and loads its machine code once): Numba
never frees the code it loads, so a copy per pipeline built would stay for good.

Code that cannot be fingerprinted (a closure over an arbitrary object, a
jitclass, a ctypes function) means no cache: the caller compiles the function
itself, in each process. When in doubt, miss.

The cache is ``fused/`` in stoker's cache root (:func:`stoker._cache_roots.cache_root`:
``$STOKER_CACHE_DIR``, else ``$XDG_CACHE_HOME/stoker``, else ``~/.cache/stoker``).
Its files are imported and their machine code run, so it is only ever used in a
folder of this user's own (:func:`stoker._cache_roots.private_dir`: made
``0700``, owned by the user and writable by nobody else, its files ``0600`` and
never reached through a link); otherwise every process compiles (a
:class:`~stoker._cache_roots.CacheWarning` says why, once). Numba's index and
machine code of a module go to ``fused/__pycache__`` beside it
(:class:`~stoker._numba_cache.PrivateFunctionCache`), whatever
``$NUMBA_CACHE_DIR`` says: Numba reads its index with :mod:`pickle`. A module file whose
text is not the source it is named after (a truncated write) is written again.
An entry whose machine code calls a kernel by symbol that the entry does not
register itself (:func:`registers_its_calls`) is a miss: compiled again, and
written over.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from stoker import _cache_roots
from stoker.errors import UnsafeCacheError
from stoker.pipeline.compiler import Compiler
from stoker.pipeline.fingerprint import fingerprint

__all__ = ["cache_dir", "fingerprint", "load_cached"]

# (fingerprint, function name) -> its dispatcher: loaded once per process
_LOADED: dict[tuple[str, str], Callable[..., Any]] = {}
_LOADED_LOCK = threading.Lock()


def cache_dir() -> Path | None:
    """Where fused functions are cached (a private folder, made if missing), or ``None`` when there is none."""
    folder = _cache_roots.private_dir("fused")
    if folder is not None:
        try:  # Numba's index and machine code of the modules (stoker._numba_cache.PrivateFunctionCache): private too
            _cache_roots.open_folder(folder).subfolder("__pycache__")
        except (OSError, UnsafeCacheError):
            return None
    return folder


def load_cached(source: str, namespace: dict[str, Any], name: str, options: Mapping[str, Any] | None = None) -> Callable[..., Any] | None:
    """Compile ``name`` from ``source`` with Numba's disk cache, or return ``None`` if it cannot be cached.

    The same fingerprint (source, the functions in ``namespace``, options) gives
    the same dispatcher within a process: the file is imported, and its machine
    code loaded, once.

    Args:
        source: the generated module source, defining ``name``.
        namespace: the globals it calls (the operations).
        name: the function to compile.
        options: ``numba.njit`` options; default :meth:`Compiler.fused_options`
            (bounds checks in debug mode). They are part of the key.
    """
    options = Compiler.fused_options() if options is None else dict(options)
    key = fingerprint(source, [v for k, v in sorted(namespace.items())], options)
    if key is None:
        return None
    with _LOADED_LOCK:
        loaded = _LOADED.get((key, name))
        if loaded is None:
            loaded = _load(key, source, namespace, name, options)
            if loaded is not None:
                _LOADED[key, name] = loaded
    return loaded


def _load(key: str, source: str, namespace: dict[str, Any], name: str, options: dict[str, Any]) -> Callable[..., Any] | None:
    """A new dispatcher of ``name``, defined in the cache file of ``key`` (written if missing)."""
    import numba

    folder = cache_dir()
    if folder is None:
        return None
    path = folder / f"fused_{key}.py"
    try:
        if _read(path) != source:
            _cache_roots.write_file(path, source.encode("utf-8"))
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
    dispatcher = numba.njit(**options)(getattr(module, name))
    # its index and machine code beside it, in fused/__pycache__ (private: made and checked by cache_dir()), never
    # where Numba would put them ($NUMBA_CACHE_DIR: see stoker._numba_cache)
    dispatcher._cache = _fast_loading_class()(dispatcher.py_func, folder / "__pycache__")
    return dispatcher  # type: ignore[no-any-return]


_FAST: type | None = None


def _fast_loading_class() -> type:
    """:class:`~stoker._numba_cache.PrivateFunctionCache` loading without Numba's registry refresh, checking each entry."""
    global _FAST
    if _FAST is None:
        from stoker._numba_cache import PrivateFunctionCache
        from stoker.pipeline.prebuilt import load_without_refresh

        class FastLoadingCache(PrivateFunctionCache):  # type: ignore[misc]
            def load_overload(self, sig: Any, target_context: Any) -> Any:
                return load_without_refresh(self, sig, target_context)

            def _load_overload(self, sig: Any, target_context: Any) -> Any:
                # Numba's own, with a check between reading the entry and loading its machine code
                if not self._enabled:
                    return None
                payload = self._cache_file.load(self._index_key(sig, target_context.codegen()))
                if payload is None or not registers_its_calls(payload):
                    return None  # a miss: compiled again, and the entry written over
                return self._impl.rebuild(target_context, payload)

        _FAST = FastLoadingCache
    return _FAST


def registers_its_calls(payload: Any) -> bool:
    """Whether a cache entry (Numba's reduced compile result) registers every kernel its machine code calls by symbol.

    An entry that does not (written by a process that linked a cached function
    and lost its ``reload_init``: :mod:`stoker.pipeline.linking`) would call
    unresolved symbols in a process that loads it first; anything unexpected
    counts as not.
    """
    from stoker.pipeline import linking

    try:
        (_, kind, data), reload_init = payload[0], payload[7]
        blobs = data if kind == "object" else (data,)
        code = b"".join(blobs)
        return not linking.unregistered(code, reload_init)
    except (TypeError, ValueError, IndexError):
        return False


def _read(path: Path) -> str | None:
    """The text of the module file ``path`` (not through a link), or ``None``."""
    try:
        fd = _cache_roots.open_file(path)
    except OSError:
        return None
    try:
        with open(fd, "rb") as fh:
            return fh.read().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
