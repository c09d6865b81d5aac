"""A folder dataset in object storage, read through a bounded local cache of whole shards.

The store holds what a local folder holds: the manifest and the shard files
(:mod:`stoker.format._manifest`). Reading it takes three parts:

* **heads**: at open, each shard's header, field table, metadata table and
  checksum table (everything but the data region) are read with range
  requests, checked against the manifest (size, header CRC) and written into
  a sparse local file of the shard's size, the shard's *stub*
  (``<cache_dir>/heads/<store>/``). A :class:`~stoker.format.reader.Reader`
  opens a stub as it opens a shard: the metadata is validated as for a local
  file, and no data byte is ever read from it.
* **shards**: the data is read from whole shards that
  :class:`stoker.remote._cache.ShardCache` downloads into ``cache_dir``, checks
  (size, then every CRC the file stores) and publishes atomically; the cache
  never holds more than ``cache_limit`` bytes, shared by every process on the node.
* **the schedule**: the loader tells :meth:`RemoteShards.schedule` the samples
  of the coming epoch, in order. A downloader thread fetches the shards in the
  order of their first use, at most ``ahead`` shards beyond the one the
  batches have reached (and within the cache's limit), and every shard stays
  pinned (never evicted) from its download until the last batch that needs it
  is done; the cache evicts the shards not needed again this epoch first, then
  those needed latest.

:class:`RemoteReader` is the :class:`~stoker.format.sharded.ShardedReader` over
the stubs whose bounded page cache reads the data from the downloaded shards.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from stoker._threads import block_interrupts, start_thread
from stoker.errors import DatasetFormatError, StokerError
from stoker.fields import Field
from stoker.format import spec
from stoker.format._manifest import MANIFEST_NAME, parse_manifest
from stoker.format.reader import Reader
from stoker.format.sharded import ShardedReader

__all__ = ["RemoteReader", "RemoteShards", "default_cache_dir"]

#: shards downloaded ahead of the batches when ``download_ahead`` is not given
DEFAULT_AHEAD = 4
#: threads that download shards ahead (each one stream)
DOWNLOAD_THREADS = 3
#: threads that read shards' heads at open
_HEAD_THREADS = 16
#: the first request of a shard's head: its header and, for shards of modest metadata, the rest of its front [bytes]
_FIRST_READ = 1 << 16


def default_cache_dir() -> Path:
    """``$STOKER_CACHE_DIR/remote``, else ``$XDG_CACHE_HOME/stoker/remote``, else ``~/.cache/stoker/remote``."""
    root = os.environ.get("STOKER_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "stoker")
    return Path(root) / "remote"


class RemoteShards:
    """The manifest, the shards' stubs and the shared cache of a dataset at ``url``.

    Args:
        url: the dataset's folder in a store (``s3://bucket/train/``, ``https://host/data/``, ...).
        storage_options: passed to :func:`stoker.remote.open_store` (credentials, endpoint).
        cache_dir: the local cache folder (default :func:`default_cache_dir`).
        cache_limit: the most bytes of shards the cache holds, all processes
            sharing ``cache_dir`` together [bytes]; ``None``: no limit.
        verify: check every downloaded shard against the CRCs it stores (a
            shard that fails is downloaded once more, then refused); ``False``
            checks its size only.
        ahead: shards downloaded ahead of the batches (default 4).
        download_threads: shards downloaded at once (default 3).

    Raises:
        RemoteError: the manifest cannot be read (missing, denied): names the URL.
        DatasetFormatError: the manifest or a shard's head is corrupt or does
            not match the manifest (names the shard's URL).
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
    ) -> None:
        from stoker.remote import _cache, _store

        if not url.endswith("/"):
            url += "/"
        self.store = _store.open_store(url, storage_options)
        self.url: str = self.store.url
        manifest = parse_manifest(self.store.read(MANIFEST_NAME), Path(self.url + MANIFEST_NAME))
        self.entries: list[dict[str, Any]] = list(manifest["shards"])
        if not self.entries:
            raise DatasetFormatError(self.url + MANIFEST_NAME, "the manifest lists no shards")
        self.names = [str(e["name"]) for e in self.entries]
        self.sizes = [int(e["file_size"]) for e in self.entries]
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.limit = None if cache_limit is None else int(cache_limit)
        self.ahead = DEFAULT_AHEAD if ahead is None else max(1, int(ahead))
        self.download_threads = max(1, int(download_threads))
        self.verify = bool(verify)
        self.cache = _cache.ShardCache(self.store, self.cache_dir, self.limit, check=self._check)
        tag = hashlib.sha256(self.url.encode()).hexdigest()[:16]
        self.heads_dir = self.cache_dir / "heads" / tag
        self.heads_dir.mkdir(parents=True, exist_ok=True)
        heads = min(_HEAD_THREADS, len(self.entries))
        with ThreadPoolExecutor(heads, thread_name_prefix="stoker-heads", initializer=block_interrupts) as pool:
            self.stubs: list[Path] = list(pool.map(self._stub, self.entries))
        self._init_schedule()

    def _init_schedule(self) -> None:
        """The schedule's state, empty (see :meth:`schedule`); the cache evicts by it. (A subclass that gathers its
        shards otherwise, :class:`stoker.format.mixed.MixedShards`, calls it once its shards are set.)"""
        # the schedule (see schedule()): per shard, the batches of this epoch that still need it
        self._lock = threading.Condition()
        self._remaining = np.zeros(len(self.entries), dtype=np.int64)
        self._next_use = np.zeros(len(self.entries), dtype=np.int64)
        self._first_order: list[int] = []  # shards by first use in the epoch
        self._rank_of = np.zeros(len(self.entries), dtype=np.int64)  # shard -> its place in _first_order
        self._reached = -1  # the furthest place in _first_order that a batch has asked for
        self._pinned: dict[int, Path] = {}  # shard -> its cached file, pinned once by this process
        self._readers: dict[int, int] = {}  # shard -> batches reading it now (between begin() and done())
        self._active: set[int] = set()  # shards read this epoch that later batches read again
        self._fds: dict[int, int] = {}
        self._generation = 0  # bumped by every schedule(): an old downloader stops
        self._place = 0  # the next place in _first_order for a downloader thread
        self._inflight: set[int] = set()  # shards a downloader thread is fetching
        self._downloaders: list[threading.Thread] = []
        self.cache.set_priority(self._priority)

    # ---- heads -------------------------------------------------------------------------------
    def shard_url(self, k: int) -> str:
        """The URL of shard ``k`` (no credentials)."""
        return self.url + self.names[k]

    def _stub(self, entry: Mapping[str, Any]) -> Path:
        """The shard's stub: a sparse file of its size holding every byte but the data region's, checked."""
        name, size, header_crc = str(entry["name"]), int(entry["file_size"]), int(entry["header_crc"])
        where = self.url + name
        path = self.heads_dir / name
        try:
            if path.stat().st_size == size:
                with open(path, "rb") as fh:
                    head = fh.read(spec.HEADER_SIZE)
                if len(head) == spec.HEADER_SIZE and int.from_bytes(head[252:256], "little") == header_crc:
                    return path  # made by an earlier open (written whole, then renamed)
        except OSError:
            pass
        first = self.store.read_range(name, 0, min(size, _FIRST_READ))  # the header, and often the whole front
        head = first[: spec.HEADER_SIZE]
        if len(head) < spec.HEADER_SIZE or head[: len(spec.MAGIC)] != spec.MAGIC:
            raise DatasetFormatError(where, "not a stoker dataset (no stoker header)")
        h = np.frombuffer(head, dtype=spec.HEADER_DTYPE)[0]
        if spec.crc32(head[:252]) != int(h["header_crc"]) or int(h["header_crc"]) != header_crc:
            raise DatasetFormatError(
                where, "its header differs from the manifest's record: the shard was rewritten after the manifest, or is corrupt"
            )
        if int(h["file_size"]) != size:
            raise DatasetFormatError(where, f"its header says {int(h['file_size'])} bytes, the manifest {size}")
        data_offset, checksum_offset = int(h["data_offset"]), int(h["checksum_offset"])
        if not spec.HEADER_SIZE <= data_offset <= checksum_offset <= size:
            raise DatasetFormatError(
                where, f"sections out of order in its header (data at {data_offset}, checksums at {checksum_offset}, size {size})"
            )
        front = first[spec.HEADER_SIZE : data_offset]
        if len(first) < data_offset:
            front += self.store.read_range(name, len(first), data_offset)
        back = self.store.read_range(name, checksum_offset, size) if size > checksum_offset else b""
        if len(front) != data_offset - spec.HEADER_SIZE or len(back) != size - checksum_offset:
            raise DatasetFormatError(where, "is shorter than the manifest says")
        fd, tmp = tempfile.mkstemp(dir=self.heads_dir, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.truncate(size)  # sparse: the data region takes no disk
                fh.write(head)
                fh.write(front)
                fh.seek(checksum_offset)
                fh.write(back)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    def _check(self, path: Path) -> None:
        """A downloaded shard against the manifest: its size, its header, and (``verify``) every CRC it stores."""
        k = self.names.index(path.name) if path.name in self.names else None
        reader = Reader(path)
        try:
            if k is not None and (reader.file_size != self.sizes[k] or reader.header_crc != int(self.entries[k]["header_crc"])):
                raise DatasetFormatError(path, "differs from the manifest's record (size or header)")
            if self.verify:
                reader.verify()
        finally:
            reader.close()

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
        with self._lock:
            self._generation += 1
            self._remaining = remaining
            self._next_use = first
            self._first_order = order
            self._rank_of = np.full(n, len(order), dtype=np.int64)
            self._rank_of[order] = np.arange(len(order), dtype=np.int64)
            self._reached = -1
            self._place = 0
            self._active.clear()
            for k in [k for k in self._pinned if remaining[k] == 0 and self._readers.get(k, 0) <= 0]:
                self._unpin(k)
            generation = self._generation
            self._lock.notify_all()
        self._downloaders = [t for t in self._downloaders if t.is_alive()]  # (an earlier epoch's finish their fetch, then stop)
        self._downloaders += [
            start_thread(self._download_ahead, generation, name=f"stoker-download-{i}") for i in range(self.download_threads)
        ]

    def _priority(self, key: str) -> float:
        """Eviction order for the cache: not needed again this epoch first, then by latest next use."""
        try:
            k = self.names.index(key)
        except ValueError:
            return float("-inf")
        if self._remaining[k] <= 0:
            return float("-inf")
        return -float(self._next_use[k])

    def _download_ahead(self, generation: int) -> None:
        """One of the downloader threads: fetch the epoch's shards in order of first use, ``ahead`` beyond the
        furthest one a batch has asked for (the threads share the next place; several streams fill a link that one
        TCP stream does not: 106 MB/s with one, 166 MB/s with two, 186 MB/s with four on the loopback store capped
        at 200 MB/s)."""
        while True:
            with self._lock:
                while (
                    self._generation == generation
                    and self._place < len(self._first_order)
                    and (self._place > self._reached + self.ahead or not self._fits_ahead(self._place))
                ):
                    self._lock.wait(0.5)
                if self._generation != generation or self._place >= len(self._first_order):
                    return
                k = self._first_order[self._place]
                self._place += 1
                if k in self._pinned or k in self._inflight:
                    continue
                self._inflight.add(k)
            try:
                path = self.cache.fetch(self.names[k], self.sizes[k])
            except BaseException:  # the batch that needs the shard fetches it again, and raises the error itself
                with self._lock:
                    self._inflight.discard(k)
                    self._lock.notify_all()
                continue
            with self._lock:
                self._inflight.discard(k)
                if self._generation != generation or k in self._pinned or self._remaining[k] <= 0:
                    self.cache.unpin(self.names[k])
                else:
                    self._pinned[k] = path
                self._lock.notify_all()

    def _fits_ahead(self, place: int) -> bool:
        """Whether the shard at ``place`` fits beside the shards in use (pinned, or read and needed again), leaving
        room for one more that a batch reads on demand; with none in use, it always does."""
        if self.limit is None:
            return True
        used = self._active.union(self._pinned, self._inflight)
        if not used:
            return True
        return sum(self.sizes[k] for k in used) + self.sizes[self._first_order[place]] + max(self.sizes) <= self.limit

    def begin(self, k: int) -> None:
        """A batch is about to read shard ``k``: it is downloaded (or waited for) and pinned while batches read it."""
        with self._lock:
            if k < len(self._rank_of):
                self._reached = max(self._reached, int(self._rank_of[k]))
                self._lock.notify_all()
            self._readers[k] = self._readers.get(k, 0) + 1
            if k in self._pinned:
                return
        try:
            path = self.cache.fetch(self.names[k], self.sizes[k])  # raises a clear error (the download's own)
        except BaseException:
            with self._lock:
                self._readers[k] -= 1
            raise
        with self._lock:
            if k in self._pinned:
                self.cache.unpin(self.names[k])
            else:
                self._pinned[k] = path
                self._lock.notify_all()

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
            if self._readers[k] <= 0 and k in self._pinned:
                self._unpin(k)
            self._lock.notify_all()

    def _unpin(self, k: int) -> None:
        fd = self._fds.pop(k, None)
        if fd is not None:
            os.close(fd)
        del self._pinned[k]
        self.cache.unpin(self.names[k])

    def fd(self, k: int) -> int:
        """A descriptor of shard ``k``'s cached file, between :meth:`begin` and :meth:`done` of a batch that reads it."""
        with self._lock:
            fd = self._fds.get(k)
            if fd is None:
                path = self._pinned.get(k)
                if path is None:
                    raise StokerError(f"internal: shard {self.shard_url(k)} read while not pinned (begin() was not called)")
                fd = self._fds[k] = os.open(path, os.O_RDONLY)
            return fd

    def read_sample(self, k: int, local: int, custom_fields: Mapping[str, type[Field]] | None) -> tuple[Any, ...]:
        """Sample ``local`` of shard ``k``, decoded in Python from the cached shard (downloaded if absent)."""
        path = self.cache.fetch(self.names[k], self.sizes[k])
        try:
            with Reader(path, custom_fields=custom_fields) as reader:
                return reader.read(local)
        finally:
            self.cache.unpin(self.names[k])

    def stats(self) -> dict[str, float]:
        """The cache's counters (downloads, hits, evictions, refetches, ...), the store's (requests, retries,
        bytes_downloaded [bytes]: everything, manifest and heads included) and the cache's size now and at its peak [bytes]."""
        out = dict(self.cache.stats())
        out.update(self.store.stats())  # requests, retries, and every byte downloaded: manifest, heads and shards
        out["cache_bytes"] = float(self.cache.usage_bytes())
        out["cache_peak_bytes"] = float(self.cache.peak_bytes)
        return out

    def close(self) -> None:
        """Stop downloading ahead and let go of every pinned shard."""
        with self._lock:
            self._generation += 1
            for k in list(self._pinned):
                self._unpin(k)
            self._lock.notify_all()
        downloaders, self._downloaders = self._downloaders, []
        for thread in downloaders:
            if thread is not threading.current_thread():
                thread.join()

    def __repr__(self) -> str:
        return f"RemoteShards({self.url!r}, shards={len(self.entries)}, cache_dir={str(self.cache_dir)!r}, cache_limit={self.limit})"


class _RemoteSource:
    """What the page cache reads a shard's bytes from: the downloaded shard, not its stub."""

    def __init__(self, remote: RemoteShards) -> None:
        self.remote = remote

    def fd(self, k: int) -> int:
        return self.remote.fd(k)

    def name(self, k: int) -> str:
        return self.remote.shard_url(k)


class RemoteReader(ShardedReader):
    """A :class:`~stoker.format.sharded.ShardedReader` of a dataset in object storage (always ``bounded``).

    Its metadata comes from the shards' stubs; a batch's data is read, through
    the bounded page cache, from shards downloaded into the local cache
    (:class:`RemoteShards`). ``acquire`` returns a ticket that ``release``
    takes back, as for a local bounded reader.
    """

    def __init__(self, remote: RemoteShards, custom_fields: Mapping[str, type[Field]] | None = None, max_gap: int = 8) -> None:
        self.remote = remote
        self.bounded = True
        self._custom_fields = custom_fields
        self.paths, self.shards, self.cache, mapped = self._open(list(remote.stubs), custom_fields, True, max_gap)
        self._setup(remote.url, mapped)
        assert self.cache is not None  # noqa: S101 - bounded
        self.cache.source = _RemoteSource(remote)

    def schedule(self, order: np.ndarray, batch_size: int, skip: int = 0) -> None:
        """The coming epoch's samples (this rank's, in order): download their shards ahead, in order of first use."""
        self.remote.schedule(self.locate(order)[0], batch_size, skip)

    def acquire(self, indices: np.ndarray) -> list[int]:
        """Read what samples ``indices`` store into the page cache, shard after shard: each shard is downloaded
        (or waited for) and pinned only while its pages are read; returns the pages, for :meth:`release`."""
        assert self.cache is not None  # noqa: S101 - bounded
        idx = np.asarray(indices, dtype=np.int64)
        shard = self.locate(idx)[0]
        pages: list[int] = []
        try:
            for k in np.unique(shard).tolist():
                self.remote.begin(k)
                try:
                    pages += self.cache.acquire(*self.data_extents(idx[shard == k]))
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
) -> RemoteReader:
    """Open the dataset folder at ``url`` (see :class:`RemoteShards` for the arguments).

    Raises:
        RemoteError: the store cannot be reached, or the manifest is missing or denied.
        DatasetFormatError: a corrupt manifest or shard head (names its URL).
    """
    if cache_limit is not None and (isinstance(cache_limit, bool) or not isinstance(cache_limit, (int, np.integer)) or cache_limit <= 0):
        raise ValueError(f"cache_limit must be a number of bytes > 0, or None for no limit; got {cache_limit!r}")
    remote = RemoteShards(url, storage_options, cache_dir, cache_limit, verify, ahead)
    if remote.limit is not None and remote.limit < max(remote.sizes):
        raise StokerError(
            f"cache_limit={remote.limit} bytes is smaller than the largest shard of {remote.url} "
            f"({max(remote.sizes)} bytes, {remote.names[int(np.argmax(remote.sizes))]}): shards are cached whole; "
            "give a cache_limit of a few shards (the download-ahead needs room), or write smaller shards"
        )
    return RemoteReader(remote, custom_fields)
