"""Room on the shard cache's disk: what a file takes, the limit, and a download's reservation, evicting to make room.

The cache (:mod:`stoker.remote._cache`) pins and downloads; every change of its
folders that takes or frees disk is made here, under the root ``.lock``.

How the limit holds at all times, across processes:

- The usage is **disk use**, as ``du`` counts it: the blocks of every file and
  folder stoker keeps in ``cache_dir`` (every store's folder), plus each
  download in progress at its *full* reservation (from its name: the blocks of
  its final size, and one more block): a download is reserved before its first
  byte. Changes (reserve, publish, evict, delete) happen under the exclusive
  root ``.lock``; :meth:`~stoker.remote._cache.ShardCache.usage_bytes` counts under it shared.
- To make room, complete files are deleted, lowest ``priority`` first
  (another store's, and anything not needed again, first); in a folder of
  more than :attr:`~stoker.remote._cache_files.Index.EXACT` files, the lowest
  of a sample (the oldest half, a random half), so that a reservation costs
  about the same at 10^5 files as at 10^3 (``benchmarks/cache_reserve.py``).
  Each process keeps an index of the folders (:class:`~stoker.remote._cache_files.Index`):
  current when the generation has not moved, else brought up to date by a
  listing of the folders' names. A file whose
  ``.pin`` someone holds (a batch reads it) is never evicted. A file pinned
  only *weakly* (downloaded ahead of the batches, and not yet read) is evicted
  for a download that a batch waits for, never for another download ahead.
- A download ahead (:meth:`~stoker.remote._cache.ShardCache.pin_ahead`) never waits for room: it
  is made only when ``headroom`` bytes stay free after it, or held only by
  files that a download for a batch may evict (room for one), else it returns
  ``None`` and the caller tries again later.
  A download for a batch waits for pins and downloads in progress to go, up to
  ``wait`` seconds, then raises :class:`~stoker.errors.CacheFullError`.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol
from urllib.parse import unquote

from stoker import _cache_roots
from stoker.errors import CacheFullError, DatasetFormatError, StokerError
from stoker.remote._cache_files import PART, Index, Item, key_ident, lock, locked

__all__ = ["DEFAULT_LIMIT_FRACTION", "CacheRoom", "check_fits_disk", "default_limit", "disk_bytes"]

_BLOCK = 4096
#: without a ``cache_limit``, the cache takes at most this fraction of the space its disk has for it (free + its own)
DEFAULT_LIMIT_FRACTION = 0.5


def disk_bytes(size: int) -> int:
    """The disk a file of ``size`` bytes may take while it is written [bytes]: its blocks, and one more (the file system's own)."""
    return -(-int(size) // _BLOCK) * _BLOCK + _BLOCK * (1 + int(size) // (128 << 20))


def check_fits_disk(url: str, size: int, cache_dir: str | os.PathLike[str]) -> None:
    """Refuse an object of ``size`` bytes (as its manifest says) that is larger than the whole disk of ``cache_dir``.

    Raises:
        DatasetFormatError: names ``url``, the size and the disk: the manifest is wrong, not the cache's limit.
    """
    st = os.statvfs(cache_dir)
    disk = st.f_blocks * st.f_frsize
    if disk_bytes(size) > disk:
        raise DatasetFormatError(
            url,
            f"its manifest gives it {size} bytes ({size / 2**30:.6g} GiB), more than the whole disk of the cache {cache_dir} "
            f"({disk} bytes): no cache_limit and no node could hold it. The manifest is wrong (damaged, or its sizes were "
            "not written by stoker): write the dataset again",
        )


def default_limit(cache_dir: str | os.PathLike[str], used: int = 0) -> int:
    """The limit of a cache without ``cache_limit``: :data:`DEFAULT_LIMIT_FRACTION` of the free space on ``cache_dir``'s
    disk plus ``used`` (what the cache holds already) [bytes]."""
    st = os.statvfs(cache_dir)
    return max(1, int(DEFAULT_LIMIT_FRACTION * (st.f_bavail * st.f_frsize + used)))


class _Named(Protocol):
    url: str  # (named in messages)


class CacheRoom:
    """The disk of a :class:`~stoker.remote._cache.ShardCache`: its usage, the reservation of each download within
    ``limit`` (evicting what nobody reads), and the waits for room, which :meth:`cancel` ends.

    The base of :class:`~stoker.remote._cache.ShardCache`, whose ``__init__`` sets the attributes below (see its
    docstring for the public ones).
    """

    store: _Named
    cache_dir: Path
    directory: Path
    limit: int | None
    wait: float
    headroom: int
    peak_bytes: int
    _mode: int
    _root_lock: Path
    _index: Index
    _priority: Callable[[str, str], float]
    _mutex: threading.Lock
    _cancels: int
    _stats: dict[str, int]

    def _count(self, **amounts: int) -> None:
        with self._mutex:
            for name, n in amounts.items():
                self._stats[name] = self._stats.get(name, 0) + n

    def usage_bytes(self) -> int:
        """The disk the cache takes now [bytes]: every store's folder, its files, and downloads in progress at their
        reservation (all processes); what ``du`` counts, within a block per download."""
        with self._shared() as index:
            used = index.used()
        self._observe(used)
        return used

    def _observe(self, used: int) -> None:
        with self._mutex:
            self.peak_bytes = max(self.peak_bytes, used)

    def cancel(self) -> None:
        """End the waits in progress (for room, for another process's download): they raise :class:`~stoker.errors.StokerError`."""
        with self._mutex:
            self._cancels += 1

    def _cancelled(self, mark: int) -> bool:
        return self._cancels != mark

    # ---- the folders, under the root lock --------------------------------------------------------------
    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[Index]:
        """Hold the root lock exclusively, with the index current; moves the generation if the block changed a folder."""
        with locked(self._root_lock, fcntl.LOCK_EX, self._mode) as fd, self._index.mutex:
            generation = os.fstat(fd).st_size  # the root lock file's size: a sparse file, no disk
            self._index.sync(generation)
            self._index.changed = False
            try:
                yield self._index
            finally:
                if self._index.changed:
                    os.ftruncate(fd, generation + 1)
                    self._index.generation = generation + 1

    @contextlib.contextmanager
    def _shared(self) -> Iterator[Index]:
        """Hold the root lock shared (to measure), with the index current."""
        with locked(self._root_lock, fcntl.LOCK_SH, self._mode) as fd, self._index.mutex:
            self._index.sync(os.fstat(fd).st_size)
            yield self._index

    def _remove(self, path: Path) -> None:
        with self._exclusive() as index, contextlib.suppress(FileNotFoundError):
            path.unlink()
            index.remove(path.parent, path.name)

    def _check_size(self, key: str, size: int) -> None:
        """Refuse an object larger than the whole disk of the cache (a manifest's error: no cache_limit could hold it)."""
        check_fits_disk(f"{self.store.url}{key}", size, self.cache_dir)

    def _reserve(self, entry: str, size: int, ahead: bool, mark: int) -> Path | None:
        """Create ``entry``'s ``.part`` (its reservation) once its disk fits in the limit, evicting to make room;
        ``None`` when ``ahead`` and it does not fit now, or would leave less than :attr:`headroom` that a download for a
        batch could take (free, or held only by files it may evict: unpinned, or downloaded ahead)."""
        need = disk_bytes(size)
        part = self.directory / f".{entry}.{need}{PART}"
        self._check_size(unquote(entry.rpartition("@")[0]), size)
        deadline = time.monotonic() + self.wait
        pause = 0.01
        while True:
            with self._exclusive() as index:
                self._clean(index, entry)
                used = index.used()
                room = (self.limit or 0) - need - self.headroom  # what a download ahead may leave held, with a batch's to come
                if ahead and self.limit is not None and used > room and not self._can_free(index, used - room):
                    return None  # it would take the room of a download that a batch waits for
                if self.limit is not None and used + need > self.limit:
                    used = self._evict(index, used, need, entry, ahead)
                if self.limit is None or used + need <= self.limit:
                    os.close(_cache_roots.create_file(part, self._mode))
                    index.add(part.parent, part.name)
                    self._observe(used + need)
                    return part
                held = used
            if ahead:
                return None
            if self.limit is not None and need > self.limit:
                raise CacheFullError(
                    str(self.cache_dir),
                    self.limit,
                    f"{unquote(entry)} alone ({need} bytes on disk) is larger than the limit: raise cache_limit above {need}",
                )
            if time.monotonic() >= deadline:
                raise CacheFullError(
                    str(self.cache_dir),
                    self.limit,
                    f"no room for {unquote(entry)} ({need} bytes on disk): {held} bytes are held by shards that batches are "
                    f"reading, downloads in progress and the cache's folders, and none was released within {self.wait:g} s; "
                    "raise cache_limit (at least one shard per batch that every process sharing this cache reads at once, "
                    "plus one being downloaded: see docs/remote.md)",
                )
            if self._cancelled(mark):
                raise StokerError(f"{self.store.url}{unquote(entry)}: the shard cache was closed while this waited for room")
            time.sleep(pause)
            pause = min(0.25, pause * 2)

    def _clean(self, index: Index, entry: str) -> None:
        """Under the exclusive root lock: delete stale downloads (their ``.lock`` free: a killed downloader's),
        ``entry``'s old ``.part`` (the caller holds its lock) and anything not a file where the cache keeps files (a
        planted link)."""
        for path in index.strange():
            if os.path.islink(path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                index.remove(path.parent, path.name)
        for item in index.parts():
            if item.folder == self.directory and item.entry == entry:
                fd: int | None = -1
            else:
                fd = lock(item.folder / f".{item.entry}.lock", fcntl.LOCK_EX, False, self._mode)
            if fd is None:
                continue  # being downloaded
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(item.folder / item.name)
                index.remove(item.folder, item.name)
            finally:
                if fd >= 0:
                    os.close(fd)

    def _can_free(self, index: Index, want: int) -> bool:
        """Whether a download for a batch could free ``want`` bytes: complete files that no batch reads (not pinned),
        looked at oldest first, until they are enough."""
        free = 0
        for item in index.files():
            if free >= want:
                break
            fd = lock(item.folder / f".{item.entry}.pin", fcntl.LOCK_EX, False, self._mode)
            if fd is not None:
                os.close(fd)
                free += item.disk
        return free >= want

    def _evict(self, index: Index, used: int, need: int, entry: str, ahead: bool) -> int:
        """Delete complete files nobody reads (``ahead``: nor downloaded ahead), another store's first (oldest first),
        then this store's lowest priority first (among a sample, in a folder of more than :attr:`Index.EXACT` files),
        until ``need`` more bytes fit; returns the usage left."""
        assert self.limit is not None  # noqa: S101 - called with a limit only

        def order(item: Item) -> tuple[float, float]:  # (an item of this store's folder)
            try:
                p = float(self._priority(*key_ident(item.entry)))
            except Exception:  # an entry the loader does not know (another content's leftover): first to go
                p = -math.inf
            return (p, item.mtime)

        def files() -> Iterator[Item]:
            yield from index.files(self.directory, others=True)  # another store's: first to go, oldest first
            chosen, sample = index.candidates(self.directory, entry)
            yield from sorted(chosen, key=order)
            if sample:  # it was not enough: the others, oldest first
                seen = {i.name for i in chosen}
                yield from (i for i in index.files(self.directory) if i.name not in seen and i.name != entry)

        for item in files():
            if used + need <= self.limit:
                break
            held: list[tuple[Path, int]] = []
            try:
                for suffix in (".pin", ".ahead") if ahead else (".pin",):
                    fd = lock(item.folder / f".{item.entry}{suffix}", fcntl.LOCK_EX, False, self._mode)
                    if fd is None:
                        break  # pinned by some process
                    held.append((item.folder / f".{item.entry}{suffix}", fd))
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(item.folder / item.name)
                        used -= item.disk
                        self._count(evictions=1)
                    index.remove(item.folder, item.name)
                    download = lock(item.folder / f".{item.entry}.lock", fcntl.LOCK_EX, False, self._mode)
                    if download is not None:
                        held.append((item.folder / f".{item.entry}.lock", download))
                    for path, _fd in held:  # its lock files go with it (held exclusively: nobody else holds them)
                        with contextlib.suppress(FileNotFoundError):
                            path.unlink()
                        index.remove(path.parent, path.name)
            finally:
                for _path, fd in held:
                    os.close(fd)
        return used
