"""A folder dataset in object storage, read through a bounded local cache of whole shards.

The store holds what a local folder holds: the manifest and the shard files
(:mod:`stoker.dataset._manifest`). Reading it takes three parts:

* **heads**: at open, each shard's header, field table, metadata table and
  checksum table (everything but the data region) are read with range
  requests, checked against the manifest (size, header CRC) and kept as files
  of the shard cache (:mod:`stoker.dataset._remote_heads`). A
  :class:`~stoker.format.reader.Reader` opens a head as it opens a shard
  (``head=True``): the metadata is validated as for a local file.
* **shards**: the data is read from whole shards that
  :class:`stoker.remote._cache.ShardCache` downloads into ``cache_dir``, checks
  against the manifest (size, header CRC) and, with ``verify``, every CRC they
  store, and publishes atomically, named after what they hold (the header's
  CRC and the size): a shard rewritten under the same name is another file.
  The cache never takes more than ``cache_limit`` bytes of disk (default: a
  fraction of the free disk), shared by every process on the node.
* **the check before use**: every data block a batch reads from a cached shard
  is checked against its CRC once per process before any compiled code reads
  it (:class:`~stoker.format._verify.DataCheck`, as for a local file), whoever
  downloaded the file: a shard this process downloaded and checked whole is
  not checked again; one found in the cache (an earlier run's, another
  process's) is, block by block as batches first read them. A shard that fails
  is downloaded again, once, then refused naming its URL and its cache path.
* **the schedule**: the loader tells :meth:`RemoteShards.schedule` the samples
  of the coming epoch, in order. Downloader threads fetch the shards in the
  order of their first use, at most ``ahead`` shards beyond the one the
  batches have reached, pinned *weakly* until a batch reads them: a download
  that a batch waits for (of this process or another sharing the cache) may
  evict them, and downloads ahead wait while they would take the room of one
  (see :mod:`stoker.remote._cache`). A shard is pinned while a batch reads it;
  the cache evicts the shards not needed again this epoch first, then those
  needed latest.

:class:`RemoteReader` is the :class:`~stoker.dataset.sharded.ShardedReader` over
the heads whose bounded page cache reads the data from the downloaded shards.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from stoker import _cache_roots
from stoker._threads import block_interrupts, start_thread
from stoker.dataset import _vstore
from stoker.dataset._manifest import MANIFEST_NAME, parse_manifest, shard_info
from stoker.dataset._remote_heads import MAX_MANIFEST_BYTES, open_head, said_if_slow, shard_ident
from stoker.dataset.sharded import ShardedReader
from stoker.errors import DatasetFormatError, RemoteError, StokerError
from stoker.fields import Field
from stoker.format import spec
from stoker.format._verify import DataCheck
from stoker.format.reader import Reader

if TYPE_CHECKING:
    from stoker.remote import Store

__all__ = ["RemoteManifest", "RemoteReader", "RemoteShards", "default_cache_dir"]

#: shards downloaded ahead of the batches when ``download_ahead`` is not given
DEFAULT_AHEAD = 4
#: threads that download shards ahead (each one stream)
DOWNLOAD_THREADS = 3
#: threads that read shards' heads at open
_HEAD_THREADS = 16
#: a download ahead that found no room tries again after this long, or when a batch is done with a shard [seconds]
_AHEAD_RETRY = 0.2
#: how long close() waits for the downloader threads, whose requests it has stopped [seconds]
_CLOSE_WAIT = 5.0


#: the causes of a cache repair (a cached file found damaged and replaced), as stats() counts them (``repairs_<cause>``)
_REPAIRS = {
    "block": ("shard", "downloaded again after a failed check of a data block"),
    "head": ("head", "read again after a failed check"),
    "header": ("shard", "downloaded again after a failed check of its header"),
    "size": ("shard", "of another size on disk (truncated) downloaded again"),
}

# every dataset whose shards are being downloaded: at exit their downloads stop before the loaders' epochs are stopped
_LIVE: weakref.WeakSet[RemoteShards] = weakref.WeakSet()


def _stop_at_exit() -> None:
    """At exit: every download stops at once (a stopped download deletes its partial file), and the downloader
    threads end, before the loaders' producer threads are joined (which would otherwise wait for their downloads)."""
    live = list(_LIVE)
    for remote in live:
        with contextlib.suppress(Exception):
            remote.interrupt()
    for remote in live:
        with contextlib.suppress(Exception):
            remote._join_downloaders()


def _stop_first_at_exit() -> None:
    """Make :func:`_stop_at_exit` the next exit function to run (atexit runs the last registered first)."""
    atexit.unregister(_stop_at_exit)
    atexit.register(_stop_at_exit)


def _store_kinds() -> tuple[str, ...]:
    from stoker.remote._store import RETRY_KINDS

    return RETRY_KINDS


def default_cache_dir() -> Path:
    """``$STOKER_CACHE_DIR/remote``, else the user's cache folder's ``stoker/remote`` (see :mod:`stoker._cache_roots`)."""
    return _cache_roots.remote_cache_dir()


class RemoteManifest:
    """A dataset folder in a store: the store, and the shards its manifest lists (nothing is cached).

    Args:
        url: the dataset's folder in a store (``s3://bucket/train/``, ``https://host/data/``, ...).
        storage_options: passed to :func:`stoker.remote.open_store` (credentials, endpoint).

    Raises:
        RemoteError: the manifest cannot be read (missing, denied): names the URL.
        DatasetFormatError: the manifest is corrupt or lists no shards.
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        from stoker.remote import _store

        if not url.endswith("/"):
            url += "/"
        self.store = _store.open_store(url, storage_options)
        self.url: str = self.store.url
        raw = self.store.read(MANIFEST_NAME, max_bytes=MAX_MANIFEST_BYTES)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise DatasetFormatError(
                self.url + MANIFEST_NAME, f"the manifest is larger than {MAX_MANIFEST_BYTES} bytes: not a stoker manifest"
            )
        manifest = parse_manifest(raw, self.url + MANIFEST_NAME)
        #: the write that made the dataset (8 hex digits), or ``None`` for a manifest of files named by hand
        self.generation: str | None = manifest.get("generation")
        #: the sha256 of the field table every shard has (checked against each shard's head at open)
        self.fields_sha256: str = manifest["fields_sha256"]
        self.entries: list[dict[str, Any]] = [{**e, "fields_sha256": self.fields_sha256} for e in manifest["shards"]]
        if not self.entries:
            raise DatasetFormatError(self.url + MANIFEST_NAME, "the manifest lists no shards")
        self.names = [str(e["name"]) for e in self.entries]


class RemoteShards:
    """The manifest, the shards' heads and the shared cache of a dataset at ``url``.

    Args:
        url: the dataset's folder in a store (``s3://bucket/train/``, ``https://host/data/``, ...).
        storage_options: passed to :func:`stoker.remote.open_store` (credentials, endpoint).
        cache_dir: the local cache folder (default :func:`default_cache_dir`).
        cache_limit: the most disk the cache takes, all processes sharing
            ``cache_dir`` together [bytes]; ``None``: half the space its disk
            has for it (:func:`stoker.remote._cache.default_limit`, measured now).
        verify: check every downloaded shard against the CRCs it stores (a
            shard that fails is downloaded once more, then refused), and every
            data block read from a shard this process did not download and
            check, once; ``False`` checks sizes and headers only.
        ahead: shards downloaded ahead of the batches (default 4).
        download_threads: shards downloaded at once (default 3).
        cache_shared: ``cache_dir`` is shared with other users on purpose (see
            :func:`stoker._cache_roots.open_folder`); otherwise a cache folder
            owned by another user or writable by others is refused.

    Raises:
        RemoteError: the manifest cannot be read (missing, denied): names the URL.
        DatasetFormatError: the manifest or a shard's head is corrupt or does
            not match the manifest (names the shard's URL).
        UnsafeCacheError: ``cache_dir`` belongs to another user or others can write it.
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | None = None,
        verify: bool = True,
        ahead: int | None = None,
        download_threads: int = DOWNLOAD_THREADS,
        cache_shared: bool = False,
    ) -> None:
        listing = RemoteManifest(url, storage_options)
        self.url: str = listing.url
        #: the write that made the dataset (8 hex digits), or ``None`` for a manifest of files named by hand
        self.generation: str | None = listing.generation
        self._setup(listing.store, listing.entries, listing.names, cache_dir, cache_limit, verify, ahead, download_threads, cache_shared)

    def _setup(
        self,
        store: Store,
        entries: Sequence[dict[str, Any]],
        keys: Sequence[str],
        cache_dir: str | os.PathLike[str] | None,
        cache_limit: int | None,
        verify: bool,
        ahead: int | None,
        download_threads: int,
        cache_shared: bool,
    ) -> None:
        """The cache of the shards ``entries`` (the manifest's records) of ``store``, ``keys`` their keys in it, and the
        schedule's state, empty. (:class:`stoker.dataset.mixed.MixedShards` gathers several datasets' shards, then calls it.)"""
        from stoker.remote import _cache

        self.store = store
        self.entries: list[dict[str, Any]] = list(entries)
        self.names = list(keys)  # each shard's key in the cache (one dataset's: its name in the store)
        self.sizes = [int(e["file_size"]) for e in self.entries]
        self.header_crcs = [int(e["header_crc"]) for e in self.entries]
        #: each shard's identity in the cache: what it holds (see stoker.dataset._remote_heads.shard_ident)
        self.idents = [shard_ident(c, n) for c, n in zip(self.header_crcs, self.sizes)]
        self._index = {name: k for k, name in enumerate(self.names)}
        self.ahead = DEFAULT_AHEAD if ahead is None else max(1, int(ahead))
        self.download_threads = max(1, int(download_threads))
        self.verify = bool(verify)
        self.cache = _cache.ShardCache(store, default_cache_dir() if cache_dir is None else cache_dir, None, check=self._check,
                                       shared=bool(cache_shared))  # fmt: skip
        self.cache_dir = self.cache.cache_dir
        #: the limit was not given: a fraction of the disk's free space (stoker.remote._cache.default_limit)
        self.default_limit = cache_limit is None
        self.limit = _cache.default_limit(self.cache_dir, self.cache.usage_bytes()) if cache_limit is None else int(cache_limit)
        self.cache.limit = self.limit
        self.cache.headroom = _cache.disk_bytes(max(self.sizes))  # a download ahead leaves room for one that a batch waits for
        # the schedule (see schedule()): per shard, the batches of this epoch that still need it
        self._lock = threading.Condition()
        self._remaining = np.zeros(len(self.entries), dtype=np.int64)
        self._next_use = np.zeros(len(self.entries), dtype=np.int64)
        self._first_order: list[int] = []  # shards by first use in the epoch
        self._rank_of = np.zeros(len(self.entries), dtype=np.int64)  # shard -> its place in _first_order
        self._reached = -1  # the furthest place in _first_order that a batch has asked for
        self._pinned: dict[int, Path] = {}  # shard -> its cached file, pinned once by this process while batches read it
        self._ahead: dict[int, Path] = {}  # shard -> its cached file, downloaded ahead: pinned weakly until the epoch is done with it
        self._readers: dict[int, int] = {}  # shard -> batches reading it now (between begin() and done())
        self._active: set[int] = set()  # shards read this epoch that later batches read again
        self._fds: dict[int, int] = {}
        self._retired: dict[int, list[int]] = {}  # shard -> descriptors of files refetched while batches read them
        self._fd_files: dict[int, tuple[int, ...]] = {}  # an open descriptor of a shard -> its file's _identity()
        self._checked: dict[int, tuple[int, ...]] = {}  # shard -> _identity() of the file this process downloaded and checked whole
        self._shard_locks: dict[int, threading.Lock] = {}  # shard -> held while its blocks are checked (and it is refetched)
        self._generation = 0  # bumped by every schedule(): an old downloader stops
        self._place = 0  # the next place in _first_order for a downloader thread
        self._retry_at = 0.0  # a download ahead found no room: none before then (time.monotonic())
        self._inflight: set[int] = set()  # shards a downloader thread is fetching
        self._failed: dict[int, BaseException] = {}  # shard -> why its download ahead failed this epoch (a hint for its batch)
        self._stopped = False  # interrupt() (a loader closing) until the next schedule(): batches fetch nothing (see begin())
        self._fetching: dict[int, int] = {}  # thread -> the batches' shard fetches (begin()) it runs now
        self._downloaders: list[threading.Thread] = []
        self.cache.set_priority(self._priority)

    # ---- heads -------------------------------------------------------------------------------
    def shard_url(self, k: int) -> str:
        """The URL of shard ``k`` (no credentials)."""
        return self.url + self.names[k]

    def _head_source(self, k: int) -> tuple[Store, str]:
        """The store that holds shard ``k``, and its name there (its head is read with range requests)."""
        return self.store, self.names[k]

    def open_heads(self, custom_fields: Mapping[str, type[Field]] | None = None) -> tuple[list[Path], list[Reader]]:
        """Every shard's head (cached, or read from the store), opened and checked against the manifest: their paths and Readers."""
        heads = min(_HEAD_THREADS, len(self.entries))

        def one(k: int) -> tuple[Path, Reader]:
            store, name = self._head_source(k)
            path, reader = open_head(
                self.cache, store, name, self.sizes[k], self.header_crcs[k], custom_fields, key=self.names[k],
                num_samples=int(self.entries[k]["num_samples"]),
            )  # fmt: skip
            want = self.entries[k].get("fields_sha256")
            if want is not None and (got := shard_info(path).fields_sha256) != want:
                reader.close()
                raise DatasetFormatError(
                    self.shard_url(k),
                    f"has other fields than its manifest records: the sha256 of its field table is {got}, the manifest's "
                    f"fields_sha256 is {want} (the shard was written with other fields, or the manifest was edited)",
                )
            return path, reader

        with ThreadPoolExecutor(heads, thread_name_prefix="stoker-heads", initializer=block_interrupts) as pool:
            opened = list(pool.map(one, range(len(self.entries))))
        return [p for p, _ in opened], [r for _, r in opened]

    def _check(self, key: str, path: Path) -> None:
        """A downloaded shard against the manifest: its size, its header, and (``verify``) every CRC it stores."""
        k = self._index.get(key)
        if k is None:
            raise DatasetFormatError(self.url + key, "is not a shard of the manifest")
        reader = Reader(path)
        try:
            if reader.file_size != self.sizes[k] or reader.header_crc != self.header_crcs[k]:
                raise DatasetFormatError(
                    self.shard_url(k),
                    f"differs from the manifest's record: {reader.file_size} bytes with header CRC {reader.header_crc:#010x}, the "
                    f"manifest says {self.sizes[k]} bytes and {self.header_crcs[k]:#010x}",
                )
            if self.verify:
                reader.verify()
                with self._lock:  # (a file keeps its identity when it is published by rename)
                    self._checked[k] = _identity(os.lstat(path))
        finally:
            reader.close()

    def cached_path(self, k: int) -> Path:
        """Where shard ``k`` is (or would be) in the cache."""
        return self.cache.path(self.names[k], self.idents[k])

    # ---- the schedule ------------------------------------------------------------------------
    def schedule(self, shard_of_sample: np.ndarray, batch_size: int, skip: int = 0) -> None:
        """Plan the coming epoch: ``shard_of_sample`` is the shard of each sample of this rank's order (-1: none of these).

        Shards needed by batches ``skip ...`` are downloaded in the order of
        their first use; shards this process pinned that the new epoch does not
        need are let go.
        """
        shards = np.asarray(shard_of_sample, dtype=np.int64)[skip * batch_size :]
        n = len(self.entries)
        batch = np.arange(len(shards), dtype=np.int64) // max(1, batch_size)
        if len(shards) and shards.min() < 0:  # samples of no shard of this store (a mix's local datasets): not scheduled
            mine = shards >= 0
            shards, batch = shards[mine], batch[mine]
        # per shard: the number of batches that need it, and the first one
        pairs = np.unique(batch * n + shards)
        pb, ps = pairs // n, pairs % n
        remaining = np.bincount(ps, minlength=n).astype(np.int64)
        first = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(first, ps, pb)
        order = [int(k) for k in np.argsort(first, kind="stable") if remaining[k] > 0]
        self.store.resume()  # (after a close(): reads are accepted again)
        with self._lock:
            self._generation += 1
            self._stopped = False
            self._failed.clear()
            self._remaining = remaining
            self._next_use = first
            self._first_order = order
            self._rank_of = np.full(n, len(order), dtype=np.int64)
            self._rank_of[order] = np.arange(len(order), dtype=np.int64)
            self._reached = -1
            self._place = 0
            self._retry_at = 0.0
            self._active.clear()
            for k in [k for k in self._pinned if remaining[k] == 0 and self._readers.get(k, 0) <= 0]:
                self._unpin(k)
            for k in [k for k in self._ahead if remaining[k] == 0]:
                self._let_go(k)
            generation = self._generation
            self._lock.notify_all()
        _LIVE.add(self)
        _stop_first_at_exit()  # (after the loader's producers registered theirs: this one runs before)
        self._downloaders = [t for t in self._downloaders if t.is_alive()]  # (an earlier epoch's finish their fetch, then stop)
        self._downloaders += [
            start_thread(self._download_ahead, generation, name=f"stoker-download-{i}") for i in range(self.download_threads)
        ]

    def _priority(self, key: str, ident: str) -> float:
        """Eviction order for the cache: heads and shards not needed again this epoch first, then by latest next use."""
        k = self._index.get(key)
        if k is None or ident != self.idents[k] or self._remaining[k] <= 0:
            return float("-inf")
        return -float(self._next_use[k])

    def _download_ahead(self, generation: int) -> None:
        """One of the downloader threads: fetch the epoch's shards in order of first use, ``ahead`` beyond the
        furthest one a batch has asked for (the threads share the next place; several streams fill a link that one
        TCP stream does not: 106 MB/s with one, 166 MB/s with two, 186 MB/s with four on the loopback store capped
        at 200 MB/s). A download that finds no room in the cache (it would take the room of one that a batch waits
        for) is tried again later: downloads ahead are the first to wait."""
        while True:
            with self._lock:
                while self._generation == generation and self._place < len(self._first_order):
                    pause = self._retry_at - time.monotonic()
                    if pause <= 0 and self._place <= self._reached + self.ahead and self._fits_ahead(self._place):
                        break
                    self._lock.wait(min(0.5, pause) if pause > 0 else 0.5)
                if self._generation != generation or self._place >= len(self._first_order):
                    return
                k = self._first_order[self._place]
                self._place += 1
                if k in self._pinned or k in self._ahead or k in self._inflight or self._remaining[k] <= 0:
                    continue
                self._inflight.add(k)
            path: Path | None = None
            failed = False
            try:
                path = self.cache.pin_ahead(self.names[k], self.sizes[k], self.idents[k])
            except BaseException as exc:  # a hint for the batch that needs the shard: it tries itself (see begin())
                failed = True
                with self._lock:
                    if self._generation == generation and isinstance(exc, StokerError) and not self.store.interrupted:
                        self._failed[k] = exc  # the retries are spent, or the shard was refused: not fetched ahead again
            with self._lock:
                self._inflight.discard(k)
                if path is None and not failed and self._generation == generation:  # no room now: this place again, later
                    self._place = min(self._place, int(self._rank_of[k]))
                    self._retry_at = time.monotonic() + _AHEAD_RETRY
                elif path is not None:
                    if self._generation != generation or k in self._ahead or self._remaining[k] <= 0:
                        self.cache.unpin(self.names[k], self.idents[k], ahead=True)
                    else:
                        self._ahead[k] = path
                self._lock.notify_all()

    def _fits_ahead(self, place: int) -> bool:
        """Whether the shard at ``place`` fits beside the shards this process uses (pinned, downloaded ahead, or read
        and needed again), leaving room for one more that a batch reads on demand; with none in use, it always does."""
        from stoker.remote._cache import disk_bytes

        used = self._active.union(self._pinned, self._inflight, self._ahead)
        if not used:
            return True
        sizes = self.sizes
        return sum(disk_bytes(sizes[k]) for k in used) + disk_bytes(sizes[self._first_order[place]]) + self.cache.headroom <= self.limit

    def begin(self, k: int) -> None:
        """A batch is about to read shard ``k``: it is downloaded (or waited for) and pinned while batches read it.

        The batch's download has its own retries (the store's ``retry_budget``
        and ``max_attempts``): a download ahead of the same shard that failed
        (its retries spent, the store down then) is a hint, not a verdict; the
        batch tries again, and its error, if it fails too, says both. A shard
        whose bytes were *refused* ahead (downloaded twice, and both times not
        the manifest's: :class:`~stoker.errors.DatasetFormatError`) is not
        downloaded a third and fourth time: the stored object is wrong, not the
        link. After :meth:`interrupt` (a loader closing, from any thread) and
        until the next :meth:`schedule`, it raises at once, and a wait or a
        download in progress ends within milliseconds.

        Raises:
            RemoteError: the store failed this batch's download (naming the attempts, and the download ahead's failure),
                or the loader was closed.
            DatasetFormatError: the shard's bytes were refused (now, or by its download ahead this epoch).
            CacheFullError: no room for it.
        """
        me = threading.get_ident()
        with self._lock:
            if k < len(self._rank_of):
                self._reached = max(self._reached, int(self._rank_of[k]))
                self._lock.notify_all()
            self._readers[k] = self._readers.get(k, 0) + 1
            while k in self._inflight and k not in self._pinned and not self._stopped:
                self._lock.wait(0.5)  # a downloader thread fetches it: its outcome is this batch's, if it succeeds
            if k in self._pinned:
                return
            if self._stopped:
                self._readers[k] -= 1
                raise self._closed_error(k)
            failed = self._failed.get(k)
            self._fetching[me] = self._fetching.get(me, 0) + 1  # (close() lets the store resume only once it ends)
        try:  # a hit when it was downloaded ahead (unless a batch's download evicted it since)
            if isinstance(failed, DatasetFormatError):
                raise DatasetFormatError(
                    self.shard_url(k),
                    f"{failed.problem} (found by its download ahead this epoch; not downloaded again: the stored object is "
                    "not the manifest's)",
                ) from failed
            try:
                path = self.cache.pin(self.names[k], self.sizes[k], self.idents[k])  # its own retries, its own error
            except RemoteError as exc:
                if failed is None or self._stopped:
                    raise
                ahead = failed.problem if isinstance(failed, RemoteError) else f"{type(failed).__name__}: {failed}"
                error = type(exc)(exc.url, exc.key, f"{exc.problem}. Before that, its download ahead had failed: {ahead}")
                error.__notes__ = list(getattr(exc, "__notes__", []))
                raise error from exc
        except BaseException:
            with self._lock:
                self._readers[k] -= 1
            raise
        finally:
            with self._lock:
                self._fetching[me] -= 1
                if not self._fetching[me]:
                    del self._fetching[me]
                self._lock.notify_all()
        with self._lock:
            self._failed.pop(k, None)
            if k in self._pinned:
                self.cache.unpin(self.names[k], self.idents[k])
            else:
                self._pinned[k] = path
                self._lock.notify_all()

    def local(self, shards: Iterable[int]) -> bool:
        """Whether :meth:`begin` of each of ``shards`` would not wait for a download now (each one pinned by a batch
        or downloaded ahead)."""
        with self._lock:
            return all(k in self._pinned or k in self._ahead for k in shards)

    def done(self, k: int) -> None:
        """A batch has read what it needs of shard ``k`` into memory: unpinned once no batch is reading it.

        A shard that later batches need again stays cached while room allows
        (the cache evicts it after those no batch needs again), and counts as
        in use for the download-ahead.
        """
        with self._lock:
            self._remaining[k] -= 1
            self._readers[k] -= 1
            if self._remaining[k] > 0:
                self._active.add(k)
            else:
                self._active.discard(k)
                if k in self._ahead:
                    self._let_go(k)
            if self._readers[k] <= 0 and k in self._pinned:
                self._unpin(k)
            self._lock.notify_all()

    def _unpin(self, k: int) -> None:
        for fd in [self._fds.pop(k, -1), *self._retired.pop(k, [])]:
            if fd >= 0:
                self._fd_files.pop(fd, None)
                os.close(fd)
        del self._pinned[k]
        self.cache.unpin(self.names[k], self.idents[k])

    def _let_go(self, k: int) -> None:
        del self._ahead[k]
        self.cache.unpin(self.names[k], self.idents[k], ahead=True)

    def fd(self, k: int) -> int:
        """A descriptor of shard ``k``'s cached file, between :meth:`begin` and :meth:`done` of a batch that reads it."""
        with self._lock:
            fd = self._fds.get(k)
            if fd is None:
                path = self._pinned.get(k)
                if path is None:
                    raise StokerError(f"internal: shard {self.shard_url(k)} read while not pinned (begin() was not called)")
                fd = self._fds[k] = _cache_roots.open_file(path)
            return fd

    def check(self, k: int, check: DataCheck, indices: np.ndarray, at: int | None = None) -> None:
        """Check the data blocks samples ``indices`` (of shard ``k``, between :meth:`begin` and :meth:`done`) read, once per
        process and file: a block that fails has the shard downloaded again, once, then refused.

        The blocks checked are those of every whole page the reader's page
        cache reads for these samples (a page may hold the end of one block
        and the start of the next, and the gaps between nearby ranges are read
        too): no byte enters the page cache unchecked. After a download again,
        every page of the shard in the reader's page cache is dropped
        (:meth:`stoker.dataset._vstore.PageCache.drop`) before anything reads it.

        Args:
            k: the shard.
            check: the data check of the reader that reads it.
            indices: the samples (the reader's global indices).
            at: the shard's place among ``check``'s shards (default ``k``; a mix's reader lays other shards beside these).

        Raises:
            DatasetFormatError: a block failed in the shard downloaded again too (names the URL and the cache path).
        """
        at = k if at is None else at
        self._bind(k, check, at)
        if check.verified[check.block_base[at] : check.block_base[at + 1]].all():  # (a shard checked whole: nothing to do)
            return
        pages = _page_blocks(check, indices, at)
        if check.shard_checked(at) and check.verified[pages].all():  # (every epoch after the first)
            return
        with self._lock:
            lock = self._shard_locks.setdefault(k, threading.Lock())
        with lock:  # one thread checks a shard at a time: another one waits, then finds its blocks checked
            self._bind(k, check, at)  # (downloaded again meanwhile?)
            try:
                check.check(indices, bounded=True)
                check.check_blocks(pages, indices)
                return
            except DatasetFormatError as first:
                failed = os.fstat(self.fd(k))
                problem = first.problem
            self._refetch(k, failed, problem)
            cache = getattr(check.reader, "cache", None)
            if isinstance(cache, _vstore.PageCache):  # the old file's pages: none is read again (the new file's are read)
                cache.drop(at)
            self._bind(k, check, at)
            try:
                check.check(indices, bounded=True)
                check.check_blocks(pages, indices)
            except DatasetFormatError as exc:
                raise DatasetFormatError(
                    self.shard_url(k),
                    f"{exc.problem}; found in the cached shard {self.cached_path(k)}, which was downloaded again, and the new "
                    f"download failed too (the first time: {problem})",
                ) from None

    def _bind(self, k: int, check: DataCheck, at: int) -> None:
        fd = self.fd(k)
        with self._lock:
            file = self._fd_files.get(fd)
            if file is None:  # (a descriptor's file never changes: its identity is taken once)
                file = self._fd_files[fd] = _identity(os.fstat(fd))
            checked = self._checked.get(k) == file
        check.bind(at, file, checked)

    def _refetch(self, k: int, failed: os.stat_result, problem: str) -> None:
        """Shard ``k``'s cached file ``failed`` has a corrupt block: delete it and download the shard again (pinned as it was).

        Raises:
            DatasetFormatError: the new download failed its checks twice (names the URL and the cache path).
        """
        name, ident = self.names[k], self.idents[k]  # (the caller holds the shard's lock)
        self.cache.discard(name, ident, failed, cause="block")
        try:
            self.cache.pin(name, self.sizes[k], ident)  # pinned already: downloaded (and checked) again
        except DatasetFormatError as exc:
            raise DatasetFormatError(
                self.shard_url(k),
                f"the cached shard {self.cached_path(k)} was corrupt ({problem}), and its downloads since failed too: {exc.problem}",
            ) from None
        self.cache.unpin(name, ident)
        with self._lock:  # the old descriptor may still be read by a batch of this shard: closed when no batch reads it
            self._retired.setdefault(k, []).append(self._fds.pop(k))

    def read_sample(self, k: int, local: int, custom_fields: Mapping[str, type[Field]] | None) -> tuple[Any, ...]:
        """Sample ``local`` of shard ``k``, decoded in Python from the cached shard (downloaded if absent); the data
        blocks it reads are checked against their CRCs first (with ``verify``). A cached shard whose front (header,
        field table, metadata) does not open as the manifest's shard is downloaded again, once (a repair)."""
        name, ident = self.names[k], self.idents[k]
        for attempt in range(2):
            path = self.cache.pin(name, self.sizes[k], ident)
            try:
                try:
                    reader = Reader(path, custom_fields=custom_fields)
                except DatasetFormatError as exc:
                    problem = exc.problem
                else:
                    with reader:
                        if reader.header_crc == self.header_crcs[k]:
                            if self.verify:
                                _check_blocks(reader, local, f"{self.shard_url(k)} (cached as {path})")
                            return reader.read(local)
                    problem = f"another header (CRC {reader.header_crc:#010x}, the manifest says {self.header_crcs[k]:#010x})"
                if attempt:
                    raise DatasetFormatError(
                        self.shard_url(k), f"its cached file {path} is not the manifest's shard ({problem}), also once downloaded again"
                    )
                with contextlib.suppress(FileNotFoundError):
                    self.cache.discard(name, ident, os.lstat(path), cause="header")
            finally:
                self.cache.unpin(name, ident)
        raise AssertionError("unreachable")  # pragma: no cover

    def stats(self) -> dict[str, float]:
        """The cache's counters (downloads, hits, evictions, refetches, ...), the store's (requests, retries,
        bytes_downloaded [bytes]: everything, manifest and heads included), the cache's disk use now and at its peak,
        and its limit [bytes]."""
        out = dict(self.cache.stats())
        out.update(self.store.stats())  # requests, retries, and every byte downloaded: manifest, heads and shards
        out["cache_bytes"] = float(self.cache.usage_bytes())
        out["cache_peak_bytes"] = float(self.cache.peak_bytes)
        out["cache_limit"] = float(self.limit)
        for cause in _REPAIRS:
            out.setdefault(f"repairs_{cause}", 0.0)
        out["repairs"] = float(sum(out[f"repairs_{cause}"] for cause in _REPAIRS))
        return out

    def summary(self) -> str:
        """One line for ``loader.report()``: the store's downloads, the retries of its faults by kind, and refetches."""
        st = self.stats()
        kinds = ", ".join(f"{kind} {int(st[f'retries_{kind}'])}" for kind in _store_kinds() if st.get(f"retries_{kind}", 0))
        retries = int(st.get("retries", 0))
        line = (
            f"store {self.url or 'of the mix'}: {int(st.get('downloads', 0))} shards downloaded "
            f"({st.get('bytes_downloaded', 0.0) / 1e6:.1f} MB in all), {int(st.get('hits', 0))} cache hits; "
            f"{retries} {'retry' if retries == 1 else 'retries'} of transient errors"
        )
        if retries:
            line += f" ({kinds}; {st.get('retry_wait_s', 0.0):.1f} s of backoff)"
        if st.get("resumed_downloads"):
            line += f", {int(st['resumed_downloads'])} downloads resumed"
        repairs = int(st.get("repairs", 0))
        if repairs:
            causes = ", ".join(
                f"{n} {noun if n == 1 else noun + 's'} {what}"
                for cause, (noun, what) in _REPAIRS.items()
                if (n := int(st.get(f"repairs_{cause}", 0)))
            )
            line += f", {repairs} cache {'repair' if repairs == 1 else 'repairs'} ({causes})"
        failed = int(st.get("refetches", 0)) - int(sum(st.get(f"repairs_{c}", 0) for c in ("block", "head", "header")))
        if failed > 0:  # (a download that failed the manifest's check, made again at once)
            line += f", {failed} {'download' if failed == 1 else 'downloads'} made again after a failed check"
        return line

    def interrupt(self) -> None:
        """Stop every download now (the downloads ahead, and the batches' own: they raise), whatever the store's speed.

        A loader's ``close()`` calls it once its epoch has ended (from any
        thread); :meth:`close` or the end of :meth:`downloads_stopped` accepts
        the store's requests again, once the batches' fetches in progress have
        ended; a batch's :meth:`begin` raises until the next :meth:`schedule`.
        A wait for a downloader thread, for room, or for another process's
        download, ends too.
        """
        with self._lock:
            self._generation += 1
            self._stopped = True
            self._lock.notify_all()
        self.store.interrupt()
        self.cache.cancel()

    def _closed_error(self, k: int) -> RemoteError:
        return RemoteError(self.url, self.names[k], "not downloaded: the loader was closed (downloads stop until its next epoch)")

    def _settle(self) -> None:
        """After :meth:`interrupt`: wait until the batches' fetches that began before it have ended (each one raises within
        milliseconds: its store requests are refused, its waits in the cache cancelled), at most ``_CLOSE_WAIT`` seconds,
        so that the store accepts requests again only once none of them can start one (a fetch of the calling thread
        itself, interrupted by a signal handler that closes the loader, is not waited for)."""
        me = threading.get_ident()
        deadline = time.monotonic() + _CLOSE_WAIT
        with self._lock:
            while any(t != me for t in self._fetching) and time.monotonic() < deadline:
                self.cache.cancel()  # (a fetch that took its mark in the cache after interrupt()'s cancel)
                self._lock.wait(0.02)

    @contextlib.contextmanager
    def downloads_stopped(self) -> Iterator[None]:
        """Downloads stop at once inside the block (:meth:`interrupt`) and are accepted again after it."""
        self.interrupt()
        try:
            yield
        finally:
            self._settle()
            self.store.resume()

    def close(self) -> None:
        """Stop downloading (at once: requests in flight are stopped) and let go of every pinned shard.

        Waits for the downloader threads at most a few seconds; one that is
        still waiting then (on another process's lock) stops by itself.
        Nothing partial is published: a stopped download's file is deleted.
        """
        self.interrupt()
        with self._lock:
            for k in list(self._pinned):
                self._unpin(k)
            for k in list(self._ahead):
                self._let_go(k)
            self._lock.notify_all()
        self._join_downloaders()
        self._settle()
        self.store.resume()
        _LIVE.discard(self)

    def _join_downloaders(self) -> None:
        """Wait for the downloader threads (stopped: a few milliseconds), at most ``_CLOSE_WAIT`` seconds in all."""
        downloaders, self._downloaders = self._downloaders, []
        deadline = time.monotonic() + _CLOSE_WAIT
        for thread in downloaders:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        self._downloaders = [t for t in downloaders if t.is_alive()]

    def __repr__(self) -> str:
        return f"RemoteShards({self.url!r}, shards={len(self.entries)}, cache_dir={str(self.cache_dir)!r}, cache_limit={self.limit})"


def _identity(st: os.stat_result) -> tuple[int, ...]:
    """A file's identity for the data check's marks: changed when it is replaced or written (as for a local file)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _page_blocks(check: DataCheck, indices: np.ndarray, at: int) -> np.ndarray:
    """The data blocks of shard ``at`` of ``check`` that the whole pages its reader's page cache reads for samples
    ``indices`` overlap (as :meth:`stoker.dataset._vstore.PageCache.acquire` reads them: nearby ranges merged)."""
    reader = check.reader
    starts, ends = reader.data_extents(np.asarray(indices, dtype=np.int64))
    cache = getattr(reader, "cache", None)
    if not isinstance(cache, _vstore.PageCache):
        return check.blocks_in(at, starts, ends)
    firsts, stops = _vstore.page_runs(starts, ends, cache.max_gap)
    return check.blocks_in(at, firsts * _vstore.PAGE, stops * _vstore.PAGE)


def _check_blocks(reader: Reader, local: int, name: str) -> None:
    """Check the data blocks that sample ``local`` of ``reader`` (a whole shard) stores its values in."""
    starts, ends = reader.sample_extents(np.array([local]))
    data = (starts >= reader.data_offset) & (ends > starts)
    bs = reader.data_block_size
    blocks: set[int] = set()
    for a, b in zip(starts[data].tolist(), ends[data].tolist()):
        blocks.update(range((a - reader.data_offset) // bs, (b - 1 - reader.data_offset) // bs + 1))
    for g in sorted(blocks):
        lo = reader.data_offset + g * bs
        hi = min(lo + bs, reader.data_offset + reader.data_size)
        if spec.crc32(reader.storage[lo:hi]) != int(reader._data_crcs[g]):
            raise DatasetFormatError(
                name, f"corrupt data region: checksum mismatch in data block {g} (bytes {lo}..{hi}), read for sample {local}"
            )


class _RemoteSource:
    """What the page cache and the data check read a shard's bytes from: the downloaded shard, not its head."""

    def __init__(self, remote: RemoteShards) -> None:
        self.remote = remote

    def fd(self, k: int) -> int:
        return self.remote.fd(k)

    def name(self, k: int) -> str:
        return f"{self.remote.shard_url(k)} (cached as {self.remote.cached_path(k)})"


class RemoteReader(ShardedReader):
    """A :class:`~stoker.dataset.sharded.ShardedReader` of a dataset in object storage (always ``bounded``).

    Its metadata comes from the shards' heads; a batch's data is read, through
    the bounded page cache, from shards downloaded into the local cache
    (:class:`RemoteShards`). ``acquire`` returns a ticket that ``release``
    takes back, as for a local bounded reader.
    """

    def __init__(self, remote: RemoteShards, custom_fields: Mapping[str, type[Field]] | None = None, max_gap: int = 8) -> None:
        self.remote = remote
        self.bounded = True
        self._custom_fields = custom_fields
        self.paths, self.shards = remote.open_heads(custom_fields)
        self._same_fields(self.shards)
        self.cache = _vstore.PageCache(self.paths, remote.sizes, max_gap=max_gap, source=_RemoteSource(remote))
        self._setup(remote.url, None)
        #: the data blocks' check before use (:meth:`check_data`), or None
        self.data_check: DataCheck | None = None

    def check_data(self, fields: list[str]) -> None:
        """From now on, check every data block of ``fields`` that a batch reads against its CRC before it is read (once per
        process and cached file; see :meth:`RemoteShards.check`)."""
        if self.data_check is None:
            self.data_check = DataCheck(self, fields, source=self.cache.source if self.cache is not None else None)

    def schedule(self, order: np.ndarray, batch_size: int, skip: int = 0) -> None:
        """The coming epoch's samples (this rank's, in order): download their shards ahead, in order of first use."""
        self.remote.schedule(self.locate(order)[0], batch_size, skip)

    def local(self, indices: np.ndarray) -> bool:
        """Whether the shards of samples ``indices`` are all in the cache now (:meth:`acquire` would not wait for a download)."""
        return self.remote.local(np.unique(self.locate(np.asarray(indices, dtype=np.int64))[0]).tolist())

    def acquire(self, indices: np.ndarray) -> list[int]:
        """Read what samples ``indices`` store into the page cache, shard after shard: each shard is downloaded
        (or waited for) and pinned only while its blocks are checked and its pages read; returns the pages, for
        :meth:`release`."""
        assert self.cache is not None  # noqa: S101 - bounded
        idx = np.asarray(indices, dtype=np.int64)
        shard = self.locate(idx)[0]
        check = self.data_check
        pages = self.cache.ticket()  # (stale at release if a page it holds is dropped: the batch is made again)
        try:
            for k in np.unique(shard).tolist():
                self.remote.begin(k)
                try:
                    mine = idx[shard == k]
                    if check is not None:
                        self.remote.check(k, check, mine)
                    pages += self.cache.acquire(*self.data_extents(mine))
                finally:
                    self.remote.done(k)
        except BaseException:
            self.cache.release(pages)
            raise
        return pages

    def read(self, index: int) -> tuple[Any, ...]:
        """Decode sample ``index`` in Python (from its shard, downloaded into the cache if absent)."""
        if not -self.num_samples <= index < self.num_samples:
            raise IndexError(f"sample index {index} out of range for {self.num_samples} samples")
        shard, local = self.locate([index % self.num_samples])
        return self.remote.read_sample(int(shard[0]), int(local[0]), self._custom_fields)

    def downloads_stopped(self) -> contextlib.AbstractContextManager[None]:
        """Inside the block, downloads in flight stop at once and new ones are refused (a loader's epoch closing)."""
        return self.remote.downloads_stopped()

    def close(self) -> None:
        self.remote.close()
        super().close()

    def __repr__(self) -> str:
        return f"RemoteReader({self.remote.url!r}, shards={self.num_shards}, samples={self.num_samples})"


def open_remote(
    url: str,
    custom_fields: Mapping[str, type[Field]] | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit: int | None = None,
    verify: bool = True,
    ahead: int | None = None,
    cache_shared: bool | None = None,
) -> RemoteReader:
    """Open the dataset folder at ``url`` (see :class:`RemoteShards` for the arguments).

    Raises:
        RemoteError: the store cannot be reached, or the manifest is missing or denied.
        DatasetFormatError: a corrupt manifest or shard head (names its URL).
        UnsafeCacheError: ``cache_dir`` belongs to another user or others can write it (and not ``cache_shared``).
        StokerError: the cache's limit cannot hold the largest shard.
    """
    from stoker.remote._store import printable_url

    check_limit_arg(cache_limit)
    with said_if_slow(f"downloading the manifest and heads from {printable_url(url)}"):
        remote = RemoteShards(url, storage_options, cache_dir, cache_limit, verify, ahead, cache_shared=bool(cache_shared))
        check_limit(remote)
        return RemoteReader(remote, custom_fields)


def check_limit_arg(cache_limit: Any) -> None:
    """Refuse a ``cache_limit`` that is neither ``None`` nor a number of bytes > 0."""
    if cache_limit is not None and (isinstance(cache_limit, bool) or not isinstance(cache_limit, (int, np.integer)) or cache_limit <= 0):
        raise ValueError(f"cache_limit must be a number of bytes > 0, or None for the default; got {cache_limit!r}")


def check_limit(remote: RemoteShards) -> None:
    """Refuse a cache whose limit (given or the default) cannot hold the largest shard, with the cache's folders.

    Raises:
        StokerError: names the limit (and whether it is the default), the largest shard's URL and size.
    """
    from stoker.remote._cache import DEFAULT_LIMIT_FRACTION, check_fits_disk, disk_bytes

    k = int(np.argmax(remote.sizes))
    largest = remote.sizes[k]
    check_fits_disk(remote.shard_url(k), int(largest), remote.cache_dir)  # a manifest's error, not the limit's
    least = disk_bytes(largest) + 2 * _vstore.PAGE  # the shard on disk, and the cache's two folders
    if remote.limit < least:
        which = (
            f"the default cache_limit ({DEFAULT_LIMIT_FRACTION:g} of the space on the disk of {remote.cache_dir}), {remote.limit} bytes,"
            if remote.default_limit
            else f"cache_limit={remote.limit} bytes"
        )
        raise StokerError(
            f"{which} is smaller than the largest shard, {remote.shard_url(k)} ({largest} bytes; {least} bytes of disk with the "
            "cache's folders): shards are cached whole; give a cache_limit of a few shards (see docs/remote.md for the sizing "
            "rule), free space on that disk, or write smaller shards"
        )
