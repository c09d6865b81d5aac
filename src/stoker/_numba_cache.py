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

One compile per entry across processes: a lookup that misses takes an
exclusive :func:`fcntl.flock` on ``<function>.<entry hash>.lock`` in the same
private folder (opened as its other files are: ``0600``, never through a link),
then looks again; a process that waited there loads what the other one saved
instead of compiling it. The lock is released once the entry is saved, when the
compile fails (Numba's ``numba:compile`` end event), and by the kernel when the
process dies. A wait longer than a second is logged (``stoker.compile``, naming
the function); after ``$STOKER_COMPILE_LOCK_TIMEOUT`` seconds (default 600: a
peer that is stopped) the process compiles anyway. Locks are taken in call
order (a caller's, then its callees'), and a process never waits on an entry it
holds itself. No private folder, or one that cannot be written: no lock.

This module imports nothing of stoker but :mod:`stoker._cache_roots`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import inspect
import logging
import os
import stat
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from numba.core import caching, dispatcher, event, sigutils

from stoker import _cache_roots

__all__ = ["PrivateFunctionCache", "is_stokers", "register", "try_lock"]

#: the folder of stoker's cache root that holds the library's kernels
KERNELS = "kernels"
_PACKAGE = os.path.realpath(Path(__file__).parent)
_LOCK = threading.Lock()
_ORIGINAL: list[Any] = []  # Numba's own Dispatcher.enable_caching, once register() has run
log = logging.getLogger("stoker.compile")
#: the environment variable: how long (seconds) a process waits for another one compiling the same entry
LOCK_TIMEOUT_ENV = "STOKER_COMPILE_LOCK_TIMEOUT"
_DEFAULT_LOCK_TIMEOUT = 600.0
_SAY_AFTER = 1.0  # seconds of waiting before the one line that says so


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
        event.register("numba:compile", _ReleaseOnFailure())
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_forget_held)
        _ORIGINAL.append(original)


def lock_timeout() -> float:
    """Seconds a process waits for another one compiling the same cache entry before compiling it too.

    ``$STOKER_COMPILE_LOCK_TIMEOUT`` (default 600); a value that is not a
    non-negative number is an error naming the variable.
    """
    raw = os.environ.get(LOCK_TIMEOUT_ENV, "").strip()
    if not raw:
        return _DEFAULT_LOCK_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # (NaN too)
        raise ValueError(f"${LOCK_TIMEOUT_ENV}={raw!r}: expected a number of seconds >= 0")
    return value


class _Held:
    """One entry's lock held by this process: its file, and how many lookups of this process hold it."""

    def __init__(self, fd: int | None) -> None:
        self.fd = fd  # None: not locked (waited too long, or could not lock): nothing to release but the count
        self.count = 1


# the entry locks this process holds, by lock file; taken and released under Numba's compiler lock (one thread at a
# time), guarded anyway
_HELD: dict[str, _Held] = {}
_HELD_LOCK = threading.Lock()


def _acquire(path: str, name: str) -> bool:
    """Hold the lock ``path`` (for compiling ``name``); whether a lookup should be tried again (the lock was waited for).

    Re-entrant within the process (a recursive compile of the same entry never
    waits on itself). A lock file that cannot be opened (a folder without
    write access, a link) or locked: no lock, compiled as before.
    """
    with _HELD_LOCK:
        held = _HELD.get(path)
        if held is not None:
            held.count += 1
            return False
    try:
        fd = _open_lock(path)
    except OSError:
        return False
    waited = False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            waited = True
            if not _wait(fd, path, name):
                os.close(fd)
                fd = -1
    except OSError:  # (a filesystem without flock)
        os.close(fd)
        return False
    with _HELD_LOCK:
        _HELD[path] = _Held(None if fd < 0 else fd)
    return waited


def _open_lock(path: str) -> int:
    """The lock file ``path``, made ``0600`` (``O_EXCL``) or opened, never through a link; a regular file of this user."""
    try:
        return _cache_roots.create_file(path, 0o600, os.O_RDWR)
    except FileExistsError:
        pass
    fd = _cache_roots.open_file(path, os.O_RDWR)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (hasattr(os, "geteuid") and st.st_uid != os.geteuid()):
        os.close(fd)
        raise OSError(f"{path}: expected a regular file of this user")
    return fd


def _wait(fd: int, path: str, name: str) -> bool:
    """Wait for the lock on ``fd`` (another process compiles ``name``); whether it was got within the time allowed."""
    timeout = lock_timeout()
    start = time.monotonic()
    said = False
    pause = 0.005
    while True:
        elapsed = time.monotonic() - start
        if elapsed >= timeout:
            log.warning(
                "stoker: waited %.0f s for another process compiling %s (lock %s, $%s): compiling it here too",
                elapsed,
                name,
                path,
                LOCK_TIMEOUT_ENV,
            )
            return False
        if not said and elapsed >= _SAY_AFTER:
            said = True
            log.info("stoker: waiting for another process compiling %s (lock %s)", name, path)
        time.sleep(min(pause, max(timeout - elapsed, 0.0)))
        pause = min(pause * 2, 0.1)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue
        if said:
            log.debug("stoker: %s: the other process is done (%.1f s)", name, time.monotonic() - start)
        return True


def _release(path: str) -> None:
    """One lookup of this process is done with the lock ``path``: unlocked when none holds it any more."""
    with _HELD_LOCK:
        held = _HELD.get(path)
        if held is None:
            return
        held.count -= 1
        if held.count > 0:
            return
        del _HELD[path]
    if held.fd is not None:
        with contextlib.suppress(OSError):
            fcntl.flock(held.fd, fcntl.LOCK_UN)
        os.close(held.fd)


def _nothing_to_release() -> None:
    return None


def try_lock(dispatcher: Any, argtypes: tuple[Any, ...]) -> Callable[[], None] | None:
    """Take the cross-process lock of ``dispatcher``'s cache entry for ``argtypes`` without waiting.

    Returns the function that releases it, or ``None`` when another process holds it (that process compiles the
    entry). While held, this process's own compile of the entry takes the same lock again without waiting (the lock
    is re-entrant within the process). A function cached nowhere private, or a lock file that cannot be opened or
    locked: a release that does nothing (the caller compiles as it would without the lock).
    """
    cache = getattr(dispatcher, "_cache", None)
    if not isinstance(cache, PrivateFunctionCache) or isinstance(cache._cache_file, _NoFile):
        return _nothing_to_release
    path = cache.lock_path(argtypes, dispatcher.targetctx)
    with _HELD_LOCK:
        held = _HELD.get(path)
        if held is not None:
            held.count += 1
            return lambda: _release(path)
    try:
        fd = _open_lock(path)
    except OSError:
        return _nothing_to_release
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError:  # (a filesystem without flock)
        os.close(fd)
        return _nothing_to_release
    with _HELD_LOCK:
        _HELD[path] = _Held(fd)
    return lambda: _release(path)


def _forget_held() -> None:
    """In a forked child: the parent's entry locks are the parent's (closing the child's copies releases nothing)."""
    for held in _HELD.values():
        if held.fd is not None:
            with contextlib.suppress(OSError):
                os.close(held.fd)
    _HELD.clear()


class _ReleaseOnFailure(event.Listener):  # type: ignore[misc]
    """Releases the entry lock of a compile that failed (Numba's ``numba:compile`` end event, with an exception)."""

    def on_start(self, ev: event.Event) -> None:
        return None

    def on_end(self, ev: event.Event) -> None:
        # (failed: no overload added. Numba's Event.is_failed is the wrong way round in the Numba this runs with)
        if not isinstance(ev.data, dict):
            return
        found = ev.data.get("dispatcher")
        args = tuple(ev.data.get("args") or ())
        cache = getattr(found, "_cache", None)
        if isinstance(cache, PrivateFunctionCache) and args not in getattr(found, "overloads", {}):
            cache._release(args)


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
        self._locks: list[tuple[tuple[Any, ...], str]] = []  # (argument types, lock file) of the entries held, innermost last
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

    def load_overload(self, sig: Any, target_context: Any) -> Any:
        """Numba's (its registries refreshed first), with the entry's cross-process lock: see :meth:`load_or_lock`."""
        target_context.refresh()
        return self.load_or_lock(sig, target_context)

    def load_or_lock(self, sig: Any, target_context: Any) -> Any:
        """The entry of ``sig`` loaded from the cache; else ``None`` with the entry's lock held until it is saved.

        A miss takes the entry's exclusive lock (waiting while another process
        compiles it), then looks again: what the other process saved is loaded.
        Called by ``Dispatcher.compile`` (under Numba's compiler lock) only: the
        lock is released by :meth:`save_overload`, or when the compile fails.
        """
        cres = self._load_overload(sig, target_context)
        if cres is not None or not self._enabled or isinstance(self._cache_file, _NoFile):
            return cres
        args = tuple(sigutils.normalize_signature(sig)[0])
        path = self.lock_path(sig, target_context)
        name = f"{getattr(self._py_func, '__module__', '?')}.{getattr(self._py_func, '__qualname__', self._name)}"
        waited = _acquire(path, f"{name}{tuple(str(a) for a in args)}")
        self._locks.append((args, path))
        if waited:
            cres = self._load_overload(sig, target_context)
            if cres is not None:
                self._release(args)
        return cres

    def lock_path(self, sig: Any, target_context: Any) -> str:
        """The lock file of the entry of ``sig``: ``<function>.<entry hash>.lock`` in this function's cache folder."""
        sig_, magic, _ = self._index_key(sig, target_context.codegen())
        entry = hashlib.sha256(repr((str(sig_), magic)).encode()).hexdigest()[:20]
        return os.path.join(self._cache_path, f"{self._impl.filename_base}.{entry}.lock")

    def save_overload(self, sig: Any, data: Any) -> None:
        """Numba's; then the entry's lock is released (waiting processes load what was saved)."""
        try:
            super().save_overload(sig, data)
        finally:
            self._release(tuple(sigutils.normalize_signature(sig)[0]))

    def _release(self, args: tuple[Any, ...]) -> None:
        """Release the innermost lock this cache holds for ``args`` (none: nothing)."""
        for i in range(len(self._locks) - 1, -1, -1):
            if self._locks[i][0] == args:
                _release(self._locks.pop(i)[1])
                return

    def _load_overload(self, sig: Any, target_context: Any) -> Any:
        # Numba runs a loaded entry's reload_init (registering the kernels its code calls by symbol:
        # stoker.pipeline.linking) but gives the rebuilt library none: a kernel compiled later that links this one
        # (a parallel kernel's serial twin) would be cached calling those symbols without registering them
        cres = super()._load_overload(sig, target_context)
        if cres is not None and cres.reload_init:
            cres.library._reload_init.update(cres.reload_init)
        return cres
