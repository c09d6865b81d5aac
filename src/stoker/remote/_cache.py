"""The shard cache: whole objects of a store downloaded into a local folder, shared by a node's processes, bounded.

One folder per store, ``cache_dir/<16 hex digits of sha256(store.url)>/``::

    shard-g1f0c9a3e-00007.stoker          a complete, checked shard (published by rename)
    .shard-g1f0c9a3e-00007.stoker.<size>.part
                                          its download in progress: reserved at <size> bytes
    .shard-g1f0c9a3e-00007.stoker.lock    flock held exclusively while one process downloads it
    .shard-g1f0c9a3e-00007.stoker.pin     flock held shared by every process that uses it (pinned)
    .cache.lock                           flock held exclusively to change the folder, shared to measure it

How the limit holds at all times, across processes:

- Every change of the folder (reserve a download, publish it by rename,
  evict, delete a failed or stale download) happens under the exclusive
  ``.cache.lock``; :meth:`ShardCache.usage_bytes` counts under it shared.
- The usage is the complete files' sizes plus every download in progress at
  its *full* size (from its name): a download is reserved before its first
  byte, and :meth:`Store.download <stoker.remote.Store.download>` writes no more.
- To make room, unpinned complete files are deleted, lowest
  ``priority`` first. A file is unpinned when the evicting process can take
  its ``.pin`` lock exclusively (without waiting): pins are shared locks held
  by the processes (and threads) that use the file.
- When the pinned files leave no room, the reservation is tried again until
  ``wait`` seconds have passed, then :class:`~stoker.errors.CacheFullError`.

One download per key per node: the downloader holds the key's ``.lock``;
another process asking for the same key waits on that lock, then finds the
complete file. A process killed while downloading leaves a ``.part`` whose
``.lock`` nobody holds (the kernel released it): the next reservation in the
folder deletes it, and the next fetch downloads the key again. A ``.part`` is
never returned: only the complete file, after its size and ``check`` passed.
Lock files stay (empty); they are never deleted, so a lock is always taken on
the file that the other processes lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote, unquote

from stoker.errors import CacheFullError, DatasetFormatError
from stoker.observe import span
from stoker.remote._store import Store

__all__ = ["ShardCache", "default_cache_dir"]

_CACHE_LOCK = ".cache.lock"
_PART = ".part"
_FULL_DISK = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


def default_cache_dir() -> Path:
    """``$STOKER_CACHE_DIR/remote``, else the user's cache folder's ``stoker/remote`` (``~/.cache/stoker/remote`` on Linux)."""
    root = os.environ.get("STOKER_CACHE_DIR")
    if root:
        return Path(root).expanduser() / "remote"
    if sys.platform == "darwin":
        base = Path("~/Library/Caches").expanduser()
    elif sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path("~/AppData/Local").expanduser())
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path("~/.cache").expanduser())
    return base / "stoker" / "remote"


def _file_name(key: str) -> str:
    name = quote(key, safe="")
    return "%2E" + name[1:] if name.startswith(".") else name


@contextlib.contextmanager
def _flock(path: Path, mode: int) -> Iterator[bool]:
    """Hold ``flock(mode)`` on ``path`` (created if missing) for the block; yields whether it was free at once."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            free = True
        except BlockingIOError:
            if mode & fcntl.LOCK_NB:
                raise
            fcntl.flock(fd, mode)
            free = False
        yield free
    finally:
        os.close(fd)


def _try_lock(path: Path) -> int | None:
    """An exclusive flock on ``path`` taken without waiting (its descriptor), or ``None`` when someone holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


class ShardCache:
    """Whole objects of ``store`` in ``cache_dir``, shared by the processes of a node, at most ``limit`` bytes.

    Args:
        store: where the objects come from.
        cache_dir: the cache's root; this store's files are in a folder named
            after its URL's hash inside it.
        limit: the most bytes the store's folder holds at any time (complete
            files and downloads in progress); ``None``: no limit.
        check: called on each downloaded file (after its size matched)
            before it is published; raises
            :class:`~stoker.errors.DatasetFormatError` for bad bytes.
        wait: how long a reservation waits for pinned files to be unpinned
            before it gives up with :class:`~stoker.errors.CacheFullError` [seconds].

    Attributes:
        directory: this store's folder in the cache.
        peak_bytes: the largest usage this process observed (after each
            reservation, and at each :meth:`usage_bytes`).
    """

    def __init__(
        self,
        store: Store,
        cache_dir: str | os.PathLike[str],
        limit: int | None,
        check: Callable[[Path], None] | None = None,
        *,
        wait: float = 60.0,
    ) -> None:
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"limit must be an int >= 1 [bytes] or None; got {limit!r}")
        if not wait >= 0:
            raise ValueError(f"wait must be >= 0 [seconds]; got {wait!r}")
        self.store = store
        self.cache_dir = Path(cache_dir)
        self.limit = limit
        self.check = check
        self.wait = float(wait)
        self.directory = self.cache_dir / hashlib.sha256(store.url.encode()).hexdigest()[:16]
        self.directory.mkdir(parents=True, exist_ok=True)
        self.peak_bytes = 0
        self._priority: Callable[[str], float] = lambda key: 0.0
        self._mutex = threading.Lock()
        self._key_mutexes: dict[str, threading.Lock] = {}
        self._pins: dict[str, tuple[int, int]] = {}  # key -> (count, descriptor holding the shared pin lock)
        self._stats = {"downloads": 0, "bytes_downloaded": 0, "hits": 0, "evictions": 0, "refetches": 0, "waits_for_other_process": 0}

    def __repr__(self) -> str:
        return f"ShardCache({self.store.url!r}, {str(self.directory)!r}, limit={self.limit})"

    # ---- names -----------------------------------------------------------------------------------------
    def path(self, key: str) -> Path:
        """Where the complete file of ``key`` is (or would be)."""
        return self.directory / _file_name(key)

    def _aux(self, key: str, suffix: str) -> Path:
        return self.directory / f".{_file_name(key)}{suffix}"

    def _part(self, key: str, size: int) -> Path:
        return self._aux(key, f".{size}{_PART}")

    # ---- public ----------------------------------------------------------------------------------------
    def set_priority(self, priority: Callable[[str], float]) -> None:
        """Evict unpinned files in the order of ``priority(key)``, lowest first (ties: the oldest first)."""
        self._priority = priority

    def stats(self) -> dict[str, float]:
        """This process's counts: downloads, bytes_downloaded, hits, evictions, refetches, waits_for_other_process, retries."""
        with self._mutex:
            out = {k: float(v) for k, v in self._stats.items()}
        out["retries"] = self.store.stats()["retries"]
        return out

    def _count(self, **amounts: int) -> None:
        with self._mutex:
            for name, n in amounts.items():
                self._stats[name] += n

    def usage_bytes(self) -> int:
        """The bytes the store's folder holds now: complete files, and downloads in progress at their full size (all processes)."""
        with _flock(self.directory / _CACHE_LOCK, fcntl.LOCK_SH):
            used = sum(size for _kind, _key, size, _mtime in self._entries())
        self._observe(used)
        return used

    def _observe(self, used: int) -> None:
        with self._mutex:
            self.peak_bytes = max(self.peak_bytes, used)

    def fetch(self, key: str, size: int) -> Path:
        """The complete, checked file of ``key``, downloaded if absent; pinned for this process until :meth:`unpin`.

        Pins nest (each fetch needs an unpin). While another process
        downloads the same key, this waits for it and uses its file.

        Args:
            key: the object's key in the store.
            size: its size [bytes] (from the manifest).

        Raises:
            DatasetFormatError: the object's bytes failed the size or ``check``
                twice (names the key and the URL).
            CacheFullError: it cannot fit within the limit (pinned files), or the disk is full.
            RemoteError: the store failed (see :mod:`stoker.remote._store`).
        """
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"size must be an int >= 0 [bytes]; got {size!r}")
        with self._mutex:
            mutex = self._key_mutexes.setdefault(key, threading.Lock())
        with mutex:  # one thread of this process per key at a time
            with self._mutex:
                pinned = self._pins.get(key)
                if pinned is not None:
                    self._pins[key] = (pinned[0] + 1, pinned[1])
                    self._stats["hits"] += 1
                    return self.path(key)
            fd = os.open(self._aux(key, ".pin"), os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)  # from now on nobody evicts the file
                self._obtain(key, size)
            except BaseException:
                os.close(fd)
                raise
            with self._mutex:
                self._pins[key] = (1, fd)
            return self.path(key)

    def unpin(self, key: str) -> None:
        """Undo one :meth:`fetch` of ``key``: when none is left, other processes may evict its file.

        Raises:
            KeyError: ``key`` is not pinned by this process.
        """
        with self._mutex:
            count, fd = self._pins[key]
            if count > 1:
                self._pins[key] = (count - 1, fd)
                return
            del self._pins[key]
        os.close(fd)

    def close(self) -> None:
        """Unpin everything this process pinned."""
        with self._mutex:
            pins, self._pins = self._pins, {}
        for _count, fd in pins.values():
            os.close(fd)

    # ---- downloading ---------------------------------------------------------------------------------
    def _complete(self, key: str, size: int) -> bool:
        try:
            return self.path(key).stat().st_size == size
        except FileNotFoundError:
            return False

    def _obtain(self, key: str, size: int) -> None:
        """Make the complete file of ``key`` exist (pinned by the caller): found, waited for, or downloaded."""
        if self._complete(key, size):
            self._count(hits=1)
            return
        with _flock(self._aux(key, ".lock"), fcntl.LOCK_EX) as free:
            if not free:
                self._count(waits_for_other_process=1)
            if self._complete(key, size):  # the other process published it
                self._count(hits=1)
                return
            for attempt in range(2):
                part = self._reserve(key, size)
                try:
                    problem = self._download(key, size, part)
                    if problem is None:
                        self._publish(key, part)
                        return
                finally:
                    if part.exists():
                        self._remove(part)
                if attempt == 0:
                    self._count(refetches=1)
            raise DatasetFormatError(
                f"{self.store.url}{key}",
                f"downloaded twice, and both times its bytes did not match the manifest ({problem}): the stored object is "
                "corrupt or was rewritten after the manifest; write the dataset again",
            )

    def _download(self, key: str, size: int, part: Path) -> str | None:
        """Download ``key`` into ``part`` and check it; returns ``None`` when good, else the problem."""
        try:
            with span(f"download {key}", "download"):  # on the timeline of an active loader.trace(), and in torch.profiler
                got = self.store.download(key, part, size)
        except OSError as exc:
            if exc.errno in _FULL_DISK:
                raise CacheFullError(
                    str(self.cache_dir),
                    self.limit,
                    f"the disk is full ({os.strerror(exc.errno or errno.ENOSPC)}) while downloading {key} ({size} bytes); "
                    "free space on that disk, set a lower cache_limit, or choose another cache_dir",
                ) from None
            raise
        finally:
            with contextlib.suppress(OSError):
                self._count(downloads=1, bytes_downloaded=part.stat().st_size)
        if got != size:
            return f"{'more than ' if got > size else ''}{min(got, size)} bytes instead of {size}"
        if self.check is not None:
            try:
                with span(f"check {key}", "download"):
                    self.check(part)
            except DatasetFormatError as exc:
                return exc.problem
        return None

    # ---- the folder, under its lock ------------------------------------------------------------------
    def _entries(self) -> Iterator[tuple[str, str, int, float]]:
        """``(kind, key, bytes, mtime)`` of every complete file (``"file"``) and download (``"part"``)."""
        with os.scandir(self.directory) as it:
            for entry in it:
                name = entry.name
                try:
                    if not name.startswith("."):
                        st = entry.stat()
                        yield "file", unquote(name), st.st_size, st.st_mtime
                    elif name.endswith(_PART):
                        stem, _, size = name[1 : -len(_PART)].rpartition(".")
                        yield "part", unquote(stem), int(size), 0.0
                except (FileNotFoundError, ValueError):
                    continue

    def _remove(self, path: Path) -> None:
        with _flock(self.directory / _CACHE_LOCK, fcntl.LOCK_EX), contextlib.suppress(FileNotFoundError):
            path.unlink()

    def _publish(self, key: str, part: Path) -> None:
        with _flock(self.directory / _CACHE_LOCK, fcntl.LOCK_EX):
            os.replace(part, self.path(key))

    def _reserve(self, key: str, size: int) -> Path:
        """Create ``key``'s ``.part`` (its reservation) once ``size`` more bytes fit in the limit, evicting to make room."""
        deadline = time.monotonic() + self.wait
        pause = 0.02
        while True:
            with _flock(self.directory / _CACHE_LOCK, fcntl.LOCK_EX):
                entries = list(self._entries())
                for kind, other, n, _m in entries:
                    if kind == "part" and other == key:  # we hold its download lock: a killed downloader's
                        with contextlib.suppress(FileNotFoundError):
                            self._part(key, n).unlink()
                    elif kind == "part":
                        self._remove_if_stale(other, n)
                entries = list(self._entries())
                used = sum(n for _kind, _key, n, _m in entries)
                stale_self = self.path(key).exists()  # a complete file of another size (rewritten object)
                if stale_self:
                    used -= self.path(key).stat().st_size
                    self.path(key).unlink()
                if self.limit is not None and used + size > self.limit:
                    used = self._evict(entries, used, size, key)
                if self.limit is None or used + size <= self.limit:
                    part = self._part(key, size)
                    part.touch(exist_ok=False)
                    self._observe(used + size)
                    return part
                pinned = used
            if self.limit is not None and size > self.limit:
                raise CacheFullError(
                    str(self.cache_dir), self.limit, f"{key} alone ({size} bytes) is larger than the limit: raise cache_limit above {size}"
                )
            if time.monotonic() >= deadline:
                raise CacheFullError(
                    str(self.cache_dir),
                    self.limit,
                    f"no room for {key} ({size} bytes): {pinned} bytes are held by pinned shards and downloads in progress, "
                    f"and none was released within {self.wait:g} s; raise cache_limit (at least the shards in use at once "
                    "by every process sharing this cache, plus those being downloaded) or read fewer shards ahead",
                )
            time.sleep(pause)
            pause = min(0.5, pause * 2)

    def _remove_if_stale(self, key: str, size: int) -> None:
        """Delete ``key``'s ``.part`` if no process downloads it (its ``.lock`` is free): a killed downloader's."""
        fd = _try_lock(self._aux(key, ".lock"))
        if fd is None:
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                self._part(key, size).unlink()
        finally:
            os.close(fd)

    def _evict(self, entries: list[tuple[str, str, int, float]], used: int, size: int, key: str) -> int:
        """Delete unpinned complete files, lowest priority first, until ``size`` more bytes fit; returns the usage left."""
        assert self.limit is not None  # noqa: S101 - called with a limit only

        def order(entry: tuple[str, str, int, float]) -> tuple[float, float]:
            try:
                p = float(self._priority(entry[1]))
            except Exception:  # a key the loader does not know (another dataset's leftover): first to go
                p = -math.inf
            return (p, entry[3])

        for _kind, other, n, _m in sorted((e for e in entries if e[0] == "file" and e[1] != key), key=order):
            if used + size <= self.limit:
                break
            fd = _try_lock(self._aux(other, ".pin"))
            if fd is None:
                continue  # pinned by some process
            try:
                with contextlib.suppress(FileNotFoundError):
                    self.path(other).unlink()
                    used -= n
                    self._count(evictions=1)
            finally:
                os.close(fd)
        return used
