"""The shard cache: objects of a store kept whole in a local folder, shared by a node's processes, bounded on disk.

Layout of ``cache_dir`` (made ``0700``, or checked: see :mod:`stoker._cache_roots`)::

    .lock                                 flock: exclusive to change any folder below, shared to measure; its size
                                          (sparse: no disk) is the generation, moved by every change (see Index)
    <16 hex digits of sha256(store.url)>/ one folder per store
        .stoker-store                     the empty marker: only a folder holding it is the cache's (nothing else in
                                          cache_dir is ever counted, evicted or deleted; a user's heads/ folder neither)
        <key>@<ident>                     a complete, checked file (published by rename)
        .<key>@<ident>.<bytes>.part       its download in progress, <bytes> of disk reserved for it
        .<key>@<ident>.lock               flock held exclusively while one process downloads it
        .<key>@<ident>.pin                flock held shared by every process reading it (a pin)
        .<key>@<ident>.ahead              flock held shared by processes that downloaded it ahead (a weak pin)

``<key>`` is the object's key, percent-quoted. ``<ident>`` says what the file
holds: the caller's content identity (for a shard: the CRC of its header, which
covers the CRCs of everything else, and its size), so an object rewritten under
the same name is never taken for the old one. Every file is created ``0600``
with ``O_EXCL`` and opened without following links; a link found in place of a
file is never followed, and removed.

How the limit holds at all times, across processes (reservations, eviction, waits for room):
see :mod:`stoker.remote._cache_room`.

One download per key per node: the downloader holds the key's ``.lock``;
another process asking for the same key waits on that lock (polling: the wait
ends when :meth:`ShardCache.cancel` is called, and when the other download
makes no progress for ``stall`` seconds), then finds the complete file. A
process killed while downloading leaves a ``.part`` whose ``.lock`` nobody
holds (the kernel released it): the next reservation deletes it. A ``.part`` is
never read: only the complete file, after its size and ``check`` passed. Lock
files are deleted only by a process holding them exclusively; a process that
takes a lock checks afterwards that the file it locked is still the one of
that name (else it takes the new one), so every process locks the same file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from stoker import _cache_roots
from stoker.errors import CacheFullError, DatasetFormatError, StokerError, UnsafeCacheError
from stoker.observe import span
from stoker.remote._cache_files import MARKER, PART, ROOT_LOCK, Index, check_ident, entry_name, is_file, lock
from stoker.remote._cache_room import CacheRoom, disk_bytes

__all__ = ["ObjectSource", "ShardCache", "default_cache_dir"]

_FULL_DISK = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


class ObjectSource(Protocol):
    """What the cache needs of its store: ``url`` (its folder's name and the prefix of every key in messages),
    :meth:`download` of a key into a file, and :meth:`stats` (its ``retries``)."""

    url: str

    def download(self, key: str, dest: Path, size: int | None = None) -> int: ...

    def stats(self) -> dict[str, int | float]: ...


def default_cache_dir() -> Path:
    """``$STOKER_CACHE_DIR/remote``, else the user's cache folder's ``stoker/remote`` (``~/.cache/stoker/remote`` on Linux)."""
    return _cache_roots.remote_cache_dir()


class _Pin:
    """This process's pins of one entry: shared flocks on its ``.pin`` (strong) and ``.ahead`` (weak) files."""

    __slots__ = ("ahead", "ahead_fd", "count", "fd")

    def __init__(self) -> None:
        self.count = 0
        self.fd = -1
        self.ahead = 0
        self.ahead_fd = -1


class ShardCache(CacheRoom):
    """Whole objects of ``store`` in ``cache_dir``, shared by the processes of a node, at most ``limit`` bytes of disk.

    Args:
        store: where the objects come from: a :class:`~stoker.remote.Store`, or anything with what
            :class:`ObjectSource` names (a mix's stores behind one).
        cache_dir: the cache's root (made ``0700``, or checked: refused when
            it belongs to another user or others can write it, unless
            ``shared``); this store's files are in a folder named after its
            URL's hash inside it.
        limit: the most disk the cache's folders take at any time, all their
            files and downloads in progress [bytes]; ``None``: no limit.
        check: called with ``(key, path)`` on each downloaded file (after its
            size matched) before it is published; raises
            :class:`~stoker.errors.DatasetFormatError` for bad bytes.
        wait: how long a download for a batch waits for pinned files and
            downloads in progress to make room before it gives up with
            :class:`~stoker.errors.CacheFullError` [seconds].
        stall: how long a process waits for another one downloading the same
            key while that download makes no progress [seconds].
        shared: ``cache_dir`` is shared with other users on purpose (see
            :func:`stoker._cache_roots.open_folder`).

    Attributes:
        directory: this store's folder in the cache.
        headroom: the disk a download ahead leaves free for one for a batch
            [bytes] (the caller sets it: the largest object's :func:`disk_bytes`).
        peak_bytes: the largest usage this process observed (after each
            reservation, and at each :meth:`usage_bytes`).
    """

    store: ObjectSource

    def __init__(
        self,
        store: ObjectSource,
        cache_dir: str | os.PathLike[str],
        limit: int | None,
        check: Callable[[str, Path], None] | None = None,
        *,
        wait: float = 60.0,
        stall: float = 600.0,
        shared: bool = False,
    ) -> None:
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"limit must be an int >= 1 [bytes] or None; got {limit!r}")
        if not wait >= 0:
            raise ValueError(f"wait must be >= 0 [seconds]; got {wait!r}")
        if not stall > 0:
            raise ValueError(f"stall must be > 0 [seconds]; got {stall!r}")
        self.store = store
        self.root = _cache_roots.open_folder(cache_dir, shared=shared)
        self.cache_dir = self.root.path
        self._mode = self.root.file_mode
        self.limit = limit
        self.check = check
        self.wait = float(wait)
        self.stall = float(stall)
        self.headroom = 0
        self.peak_bytes = 0
        self._root_lock = self.cache_dir / ROOT_LOCK
        self._index = Index(self.cache_dir)
        self.directory = self._store_folder(hashlib.sha256(store.url.encode()).hexdigest()[:16])
        self._priority: Callable[[str, str], float] = lambda key, ident: 0.0
        self._mutex = threading.Lock()
        self._key_mutexes: dict[str, threading.Lock] = {}
        self._pins: dict[tuple[str, str], _Pin] = {}
        self._cancels = 0  # bumped by cancel(): waits begun before it end
        self._stats = {"downloads": 0, "bytes_downloaded": 0, "hits": 0, "evictions": 0, "refetches": 0, "waits_for_other_process": 0,
                       "ahead_deferred": 0, "filled": 0}  # fmt: skip

    def __repr__(self) -> str:
        return f"ShardCache({self.store.url!r}, {str(self.directory)!r}, limit={self.limit})"

    def _store_folder(self, name: str) -> Path:
        """This store's folder ``name`` in the cache: made with its :data:`MARKER`, or found with it (or empty)."""
        try:  # every process that changes the cache moves the root lock's generation: it must be able to write it
            os.close(_cache_roots.open_file(self._root_lock, os.O_RDWR))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise UnsafeCacheError(
                self._root_lock,
                f"cannot be opened for writing ({exc.strerror or exc}): every process sharing the cache {self.cache_dir} "
                "must be able to write its lock file (make it writable by the group that shares the cache, or use a cache_dir of your own)",
            ) from None
        path = self.cache_dir / name
        with self._exclusive() as index:
            made = not os.path.lexists(path)
            path = self.root.subfolder(name)
            if not is_file(path / MARKER):
                if not made and any(n != MARKER for n in os.listdir(path)):
                    raise UnsafeCacheError(
                        path,
                        f"has the name stoker gives the cache of {self.store.url} but stoker's cache did not make it (it holds "
                        f"no {MARKER}): stoker never changes a folder it did not make. Move it out of {self.cache_dir}, "
                        "or choose another cache_dir",
                    )
                with contextlib.suppress(FileExistsError):
                    os.close(_cache_roots.create_file(path / MARKER, self._mode))
                index.add_folder(path)  # (other processes look again)
        return path

    # ---- names -----------------------------------------------------------------------------------------
    def path(self, key: str, ident: str | int) -> Path:
        """Where the complete file of ``key`` with content ``ident`` is (or would be); an int: the default ident of that size."""
        return self.directory / entry_name(key, str(ident) if isinstance(ident, int) else check_ident(ident))

    def _aux(self, entry: str, suffix: str) -> Path:
        return self.directory / f".{entry}{suffix}"

    # ---- public ----------------------------------------------------------------------------------------
    def set_priority(self, priority: Callable[[str, str], float]) -> None:
        """Evict unpinned files in the order of ``priority(key, ident)``, lowest first (ties: the oldest first)."""
        self._priority = priority

    def stats(self) -> dict[str, int]:
        """This process's counts (ints): downloads (whole objects), bytes_downloaded, filled (files written by a ``fill``:
        a shard's head), hits, evictions, refetches, waits_for_other_process, ahead_deferred (downloads ahead put off
        for want of room), retries, and ``repairs_<cause>`` once a cached file was found damaged and replaced (``block``,
        ``head``, ``header``: by :meth:`discard`; ``size``: a file of another size, downloaded again)."""
        with self._mutex:
            out = dict(self._stats)
        out["retries"] = int(self.store.stats()["retries"])
        return out

    def pin(
        self,
        key: str,
        size: int,
        ident: str | None = None,
        *,
        fill: Callable[[Path], int] | None = None,
        check: Callable[[str, Path], None] | None = None,
    ) -> Path:
        """The complete, checked file of ``key``, downloaded if absent; pinned for this process until :meth:`unpin`.

        Pins nest (each pin needs an unpin). While another process
        downloads the same key, this waits for it and uses its file. To make
        room, it evicts what nobody reads, downloads ahead included.

        Args:
            key: the object's key in the store.
            size: its size [bytes] (from the manifest).
            ident: what it holds (letters, digits, ``-``): part of the file's
                name, so that another content of ``key`` is another file.
                Default: ``str(size)``.
            fill: writes the file at the path it is given instead of
                downloading the whole object; returns the bytes written.
            check: this file's check instead of the cache's.

        Raises:
            DatasetFormatError: the object's bytes failed the size or the
                check twice (names the key and the URL).
            CacheFullError: it cannot fit within the limit (pinned files), or the disk is full.
            RemoteError: the store failed (see :mod:`stoker.remote._store`).
            StokerError: :meth:`cancel` was called while it waited.
        """
        path = self._fetch(key, size, ident, False, fill, check)
        assert path is not None  # noqa: S101 - only a download ahead returns None
        return path

    def pin_ahead(self, key: str, size: int, ident: str | None = None) -> Path | None:
        """:meth:`pin` for a download ahead of need: pinned *weakly* (a download that a batch waits for may evict it;
        :meth:`unpin` with ``ahead=True``); never waits for room: ``None`` when it does not fit after evicting only what
        nobody reads or downloaded ahead, or would leave less than :attr:`headroom` for a download that a batch waits for."""
        return self._fetch(key, size, ident, True, None, None)

    def _fetch(
        self,
        key: str,
        size: int,
        ident: str | None,
        ahead: bool,
        fill: Callable[[Path], int] | None,
        check: Callable[[str, Path], None] | None,
    ) -> Path | None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"size must be an int >= 0 [bytes]; got {size!r}")
        ident = str(size) if ident is None else check_ident(ident)
        mark = self._cancels
        entry = entry_name(key, ident)
        with self._mutex:
            mutex = self._key_mutexes.setdefault(entry, threading.Lock())
        while not mutex.acquire(timeout=0.1):  # one thread of this process per entry at a time
            if self._cancelled(mark):
                raise StokerError(f"{self.store.url}{key}: the shard cache was closed while this waited for another thread's download")
        try:
            path = self.path(key, ident)
            with self._mutex:
                pin = self._pins.get((key, ident))
                pinned = pin is not None and (pin.ahead if ahead else pin.count) > 0
            if pinned:  # by this process already: its file is there, unless evicted (weak) or discarded (corrupt)
                if not is_file(path, size) and not self._obtain(key, ident, size, ahead, fill, check or self.check, mark):
                    return None
                with self._mutex:
                    if ahead:
                        pin.ahead += 1  # type: ignore[union-attr]
                    else:
                        pin.count += 1  # type: ignore[union-attr]
                self._count(hits=1)
                return path
            fd = lock(self._aux(entry, ".ahead" if ahead else ".pin"), fcntl.LOCK_SH, True, self._mode)  # nobody evicts it now
            assert fd is not None  # noqa: S101 - blocking
            try:
                got = self._obtain(key, ident, size, ahead, fill, check or self.check, mark)
            except BaseException:
                os.close(fd)
                raise
            if not got:
                os.close(fd)
                return None
            with self._mutex:
                pin = self._pins.setdefault((key, ident), _Pin())
                if ahead:
                    pin.ahead, pin.ahead_fd = 1, fd
                else:
                    pin.count, pin.fd = 1, fd
            return path
        finally:
            mutex.release()

    def _pinned(self, key: str, ident: str) -> bool:
        """Count one more strong pin of an entry this process pins already, if its file is there."""
        with self._mutex:
            pin = self._pins.get((key, ident))
            if pin is None or not pin.count or not is_file(self.path(key, ident)):
                return False
            pin.count += 1
            return True

    def lookup(self, key: str, ident: str) -> Path | None:
        """The complete file of ``key`` with ``ident`` if the cache holds it (pinned, as by :meth:`pin`), else ``None``."""
        ident = check_ident(ident)
        if self._pinned(key, ident):
            self._count(hits=1)
            return self.path(key, ident)
        fd = lock(self._aux(entry_name(key, ident), ".pin"), fcntl.LOCK_SH, True, self._mode)
        assert fd is not None  # noqa: S101 - blocking
        if not is_file(self.path(key, ident)):
            os.close(fd)
            return None
        with self._mutex:
            pin = self._pins.setdefault((key, ident), _Pin())
            if pin.count:
                pin.count += 1
                os.close(fd)
            else:
                pin.count, pin.fd = 1, fd
        self._count(hits=1)
        return self.path(key, ident)

    def unpin(self, key: str, ident: str | None = None, *, ahead: bool = False) -> None:
        """Undo one :meth:`pin` of ``key`` (of that strength): when none is left, other processes may evict its file.

        Raises:
            KeyError: ``key`` is not pinned so by this process (or, without ``ident``, pinned with several).
        """
        fd = -1
        with self._mutex:
            if ident is None:
                found = [i for (k, i), p in self._pins.items() if k == key and (p.ahead if ahead else p.count)]
                if len(found) != 1:
                    raise KeyError(key)
                ident = found[0]
            pin = self._pins.get((key, ident))
            if pin is None or not (pin.ahead if ahead else pin.count):
                raise KeyError(key)
            if ahead:
                pin.ahead -= 1
                if not pin.ahead:
                    fd, pin.ahead_fd = pin.ahead_fd, -1
            else:
                pin.count -= 1
                if not pin.count:
                    fd, pin.fd = pin.fd, -1
            if not pin.count and not pin.ahead:
                del self._pins[key, ident]
        if fd >= 0:
            os.close(fd)

    def close(self) -> None:
        """Unpin everything this process pinned."""
        with self._mutex:
            pins, self._pins = self._pins, {}
        for pin in pins.values():
            for fd in (pin.fd, pin.ahead_fd):
                if fd >= 0:
                    os.close(fd)

    def discard(self, key: str, ident: str, like: os.stat_result, cause: str = "block") -> None:
        """Delete the complete file of ``key`` if it is still the file ``like`` (found corrupt: the next fetch downloads
        it again, counted as a refetch and as a repair, ``repairs_<cause>``: ``block``, ``head``, ``header``), pinned or not."""
        path = self.path(key, ident)
        with self._exclusive() as index:
            try:
                same = os.path.samestat(os.lstat(path), like)
            except FileNotFoundError:
                return
            if same:
                path.unlink()
                index.remove(path.parent, path.name)
                self._count(refetches=1, **{f"repairs_{cause}": 1})

    # ---- downloading ---------------------------------------------------------------------------------
    def _obtain(
        self, key: str, ident: str, size: int, ahead: bool, fill: Callable[[Path], int] | None, check: Callable[[str, Path], None] | None,
        mark: int,
    ) -> bool:  # fmt: skip
        """Make the complete file exist (pinned by the caller): found, waited for, or downloaded; ``False``: no room ahead."""
        path = self.path(key, ident)
        if is_file(path, size):
            self._count(hits=1)
            return True
        entry = entry_name(key, ident)
        lock = self._wait_for_download(entry, mark, key, size)
        try:
            if is_file(path, size):  # the other process published it
                self._count(hits=1)
                return True
            if os.path.lexists(path):  # a cached file of another size (truncated): the download replaces it
                self._count(repairs_size=1)
            problem = ""
            for attempt in range(2):
                part = self._reserve(entry, size, ahead, mark)
                if part is None:
                    self._count(ahead_deferred=1)
                    return False
                try:
                    problem = self._download(key, size, part, fill, check)
                    if not problem:
                        with self._exclusive() as index:
                            os.replace(part, path)
                            index.remove(part.parent, part.name)
                            index.add(path.parent, path.name)
                        return True
                finally:
                    if os.path.lexists(part):
                        self._remove(part)
                if attempt == 0:
                    self._count(refetches=1)
            raise DatasetFormatError(
                f"{self.store.url}{key}",
                f"downloaded twice (to be cached as {path}), and both times its bytes did not match the manifest ({problem}): "
                "the stored object is corrupt or was rewritten after the manifest; write the dataset again",
            )
        finally:
            os.close(lock)

    def _wait_for_download(self, entry: str, mark: int, key: str, size: int) -> int:
        """Take ``entry``'s download lock; while another process holds it, wait as long as its download makes progress."""
        path = self._aux(entry, ".lock")
        fd = lock(path, fcntl.LOCK_EX, False, self._mode)
        if fd is not None:
            return fd
        self._count(waits_for_other_process=1)
        pause, seen, since = 0.01, -1, time.monotonic()
        while True:
            if self._cancelled(mark):
                raise StokerError(f"{self.store.url}{key}: the shard cache was closed while this waited for another process's download")
            time.sleep(pause)
            pause = min(0.25, pause * 2)
            fd = lock(path, fcntl.LOCK_EX, False, self._mode)
            if fd is not None:
                return fd
            try:  # its bytes so far
                progress = os.lstat(self.directory / f".{entry}.{disk_bytes(size)}{PART}").st_size
            except OSError:
                progress = -1
            if progress != seen:
                seen, since = progress, time.monotonic()
            elif time.monotonic() - since > self.stall:
                raise StokerError(
                    f"{self.store.url}{key}: another process has downloaded it into {self.directory} with no progress for "
                    f"{self.stall:g} s (it holds {path}); its store may be unreachable. Stop that process, or try again"
                )

    def _download(
        self, key: str, size: int, part: Path, fill: Callable[[Path], int] | None, check: Callable[[str, Path], None] | None
    ) -> str:
        """Download ``key`` into ``part`` and check it; returns ``""`` when good, else the problem."""
        try:
            # on the timeline of an active loader.trace(), and in torch.profiler (a head's bytes, read already: "head file")
            with span(f"download {key}" if fill is None else f"head file {key}", "download"):
                got = fill(part) if fill is not None else self.store.download(key, part, size)
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
                if fill is None:
                    self._count(downloads=1, bytes_downloaded=os.lstat(part).st_size)
                else:
                    self._count(filled=1)
        if got != size:
            return f"{'more than ' if got > size else ''}{min(got, size)} bytes instead of {size}"
        if check is not None:
            try:
                with span(f"check {key}", "download"):
                    check(key, part)
            except DatasetFormatError as exc:
                return exc.problem
        return ""
