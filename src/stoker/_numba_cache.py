"""Where Numba keeps the compiled code of stoker's functions: only in stoker's private cache folder.

Numba's disk cache of a ``cache=True`` function is an index and data files read
with :mod:`pickle` (unpickling runs code) and machine code that is run. Numba
puts them in ``$NUMBA_CACHE_DIR`` when it is set (a folder often shared on
containers and cluster nodes, its files made with the umask's modes), else next
to the source file, else in the user's cache folder. For stoker's own functions
none of those is used:

* the library's kernels (``@numba.njit(cache=True)`` in stoker's modules, and
  their serial twins) cache in ``kernels/<folder>_<hash>/`` of stoker's cache
  root (:func:`stoker._cache_roots.private_dir`: ``0700``, owned by the user,
  writable by no one else; see :mod:`stoker._cache_roots`);
* generated pipeline functions (:mod:`stoker.pipeline.cache`) cache in
  ``fused/__pycache__`` beside their source, checked the same way;
* when there is no such folder (stoker's cache root is not private), nothing of
  them is cached on disk: every process compiles (a
  :class:`~stoker._cache_roots.CacheWarning` says why, once).

``$NUMBA_CACHE_DIR`` (and ``$NUMBA_CACHE_LOCATOR_CLASSES``) are never read for
them; the user's own Numba functions are cached as Numba always does. A
module of stoker that defines ``cache=True`` kernels calls :func:`register`
before them: from then on, Numba's ``enable_caching`` gives a function whose
source file is stoker's a :class:`PrivateFunctionCache` (any other function,
Numba's own cache). Its folder is found, made and checked at the first lookup
(the first call), not at import; its files are written ``0600`` with
``O_EXCL`` and never through a link.

This module imports nothing of stoker but :mod:`stoker._cache_roots`.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import os
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from numba.core import caching, dispatcher

from stoker import _cache_roots

__all__ = ["PrivateFunctionCache", "is_stokers", "register"]

#: the folder of stoker's cache root that holds the library's kernels
KERNELS = "kernels"
_PACKAGE = os.path.realpath(Path(__file__).parent)
_LOCK = threading.Lock()
_ORIGINAL: list[Any] = []  # Numba's own Dispatcher.enable_caching, once register() has run


def is_stokers(py_func: Any) -> bool:
    """Whether ``py_func`` is defined in a source file of stoker's package (its kernels, not generated code)."""
    try:
        source = os.path.realpath(inspect.getfile(py_func))
    except (TypeError, OSError):
        return False
    return source.startswith(_PACKAGE + os.sep)


def register() -> None:
    """Cache the compiled code of stoker's ``cache=True`` functions made from now on in stoker's private folder only.

    Idempotent. Numba's ``Dispatcher.enable_caching`` (what ``cache=True`` calls)
    gives a function of stoker's package a :class:`PrivateFunctionCache`; any
    other function gets Numba's own cache, as before.
    """
    with _LOCK:
        if _ORIGINAL:
            return
        original = dispatcher.Dispatcher.enable_caching

        def enable_caching(self: Any) -> None:
            if is_stokers(self.py_func):
                self._cache = PrivateFunctionCache(self.py_func)
            else:
                original(self)

        enable_caching.__doc__ = original.__doc__
        enable_caching.__wrapped__ = original  # type: ignore[attr-defined]
        dispatcher.Dispatcher.enable_caching = enable_caching  # type: ignore[method-assign]
        _ORIGINAL.append(original)


class _PrivateLocator(caching._SourceFileBackedLocatorMixin, caching._CacheLocator):  # type: ignore[misc]
    """A function's cache folder: ``folder`` when given (already made private by the caller), else the kernels' one.

    Resolved once, at the first use; ``None`` when there is no private folder.
    """

    def __init__(self, py_func: Any, py_file: str, folder: Path | None) -> None:
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        self._given = folder
        self._resolved: list[Path | None] = []

    def folder(self) -> Path | None:
        if not self._resolved:
            self._resolved.append(self._given if self._given is not None else _kernels_folder(self._py_file))
        return self._resolved[0]

    def get_cache_path(self) -> str:
        folder = self.folder()
        return "" if folder is None else str(folder)

    def ensure_cache_path(self) -> None:
        """Nothing to do: the folder was made and checked when it was resolved."""


def _kernels_folder(py_file: str) -> Path | None:
    """``kernels/<folder>_<hash of its path>`` of stoker's cache root for the kernels of ``py_file``, made private; or ``None``."""
    root = _cache_roots.kernels_dir()  # (None, with a warning once, when the folder is not private)
    if root is None:
        return None
    source_dir = os.path.dirname(os.path.abspath(py_file))
    name = f"{os.path.basename(source_dir)}_{hashlib.sha256(source_dir.encode()).hexdigest()[:32]}"
    try:
        return _cache_roots.CacheFolder(root).subfolder(name)
    except (OSError, _cache_roots.UnsafeCacheError) as exc:
        _cache_roots._warn_once(
            str(root / name), f"stoker's kernel cache {root / name} cannot be used ({exc}): its kernels are compiled in every process"
        )
        return None


class _PrivateImpl(caching.CompileResultCacheImpl):  # type: ignore[misc]
    """Numba's compile-result cache, with the private locator only (no locator of Numba's, whatever its settings)."""

    def __init__(self, py_func: Any, folder: Path | None = None) -> None:
        self._lineno = py_func.__code__.co_firstlineno
        qualname = getattr(py_func, "__qualname__", py_func.__name__)
        source = inspect.getfile(py_func)
        self._locator = _PrivateLocator(py_func, source, folder)
        fullname = f"{os.path.splitext(os.path.basename(source))[0]}.{qualname}"
        self._filename_base = self.get_filename_base(fullname, getattr(sys, "abiflags", ""))


class _PrivateFile(caching.IndexDataCacheFile):  # type: ignore[misc]
    """Numba's index and data files, written ``0600`` with ``O_EXCL`` and without following a link."""

    @contextlib.contextmanager
    def _open_for_write(self, filepath: str) -> Iterator[IO[bytes]]:
        tmp = f"{filepath}.tmp.{uuid.uuid4().hex[:16]}"
        try:
            with os.fdopen(_cache_roots.create_file(tmp), "wb") as fh:
                yield fh
            os.replace(tmp, filepath)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


class _NoFile:
    """No disk cache (no private folder): every lookup misses, nothing is written."""

    def _load_index(self) -> dict[Any, Any]:
        return {}

    def load(self, key: Any) -> None:
        return None

    def save(self, key: Any, data: Any) -> None:
        return None

    def flush(self) -> None:
        return None


class PrivateFunctionCache(caching.FunctionCache):  # type: ignore[misc]
    """Numba's cache of one function, kept only in a private folder of stoker's cache root.

    Args:
        py_func: the function.
        folder: its cache folder, already made private by the caller
            (generated code's ``fused/__pycache__``); default: the kernels'
            folder of stoker's cache root, resolved at the first lookup.
    """

    _impl_class = _PrivateImpl

    def __init__(self, py_func: Any, folder: Path | None = None) -> None:  # (Numba's resolves its folder here: not yet)
        self._name = repr(py_func)
        self._py_func = py_func
        self._impl = _PrivateImpl(py_func, folder)
        self._file: Any = None
        self.enable()

    @property
    def folder(self) -> Path | None:
        """The folder of this function's cache, or ``None`` when there is no private one (nothing cached)."""
        return self._impl.locator.folder()  # type: ignore[no-any-return]

    @property
    def _cache_path(self) -> str:  # type: ignore[override]
        return self._impl.locator.get_cache_path()  # type: ignore[no-any-return]

    @property
    def _cache_file(self) -> Any:  # type: ignore[override]
        if self._file is None:
            folder = self.folder
            stamp = self._impl.locator.get_source_stamp()
            self._file = _NoFile() if folder is None else _PrivateFile(str(folder), self._impl.filename_base, stamp)
        return self._file
