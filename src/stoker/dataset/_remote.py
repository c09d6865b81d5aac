"""A folder dataset in object storage, read through a bounded local cache of whole shards.

The store holds what a local folder holds: the manifest and the shard files
(:mod:`stoker.dataset._manifest`). Reading it takes four parts:

* **heads**: each shard's header, field table, metadata table and
  checksum table (everything but the data region) are read with range
  requests, one round trip per shard for most shards (its first and last bytes
  at once), checked against the manifest (size, header CRC) and kept as files
  of the shard cache (:mod:`stoker.dataset._remote_heads`). A
  :class:`~stoker.format.reader.Reader` opens a head as it opens a shard
  (``head=True``): the metadata is validated as for a local file. The open
  reads the first shard's head; the others when a batch first needs them, or
  in the background after the first batch, when the manifest records what the
  plan needs of them (:mod:`stoker.dataset._head_record`); else all at open,
  16 at a time (a manifest of an older stoker).
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
* **the schedule**: the shards of the coming epoch downloaded ahead in the
  order of their first use, and pinned while batches read them
  (:mod:`stoker.dataset._remote_schedule`).

:class:`RemoteShards` holds the four; :class:`RemoteReader` is the reader of
shards from stores (:class:`stoker.dataset._store_reader.StoreReader`, the one a
mix uses too) over one dataset.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from stoker import _cache_roots
from stoker._threads import block_interrupts
from stoker.dataset import _vstore
from stoker.dataset._head_record import PendingHead
from stoker.dataset._manifest import MANIFEST_NAME, fields_hash, parse_manifest
from stoker.dataset._remote_heads import MAX_MANIFEST_BYTES, head_ident, log, open_head, said_if_slow, shard_ident
from stoker.dataset._remote_schedule import ShardSchedule, ShardStore
from stoker.dataset._store_reader import StoreReader
from stoker.errors import DatasetFormatError, StokerError
from stoker.fields import Field
from stoker.format import spec
from stoker.format._verify import DataCheck
from stoker.format.reader import Reader

if TYPE_CHECKING:
    from stoker.remote import Store

__all__ = ["RemoteManifest", "RemoteReader", "RemoteShards", "open_remote"]

#: shards downloaded ahead of the batches when ``download_ahead`` is not given
DEFAULT_AHEAD = 4
#: threads that download shards ahead (each one stream)
DOWNLOAD_THREADS = 3
#: threads that read shards' heads at open
_HEAD_THREADS = 16


#: the causes of a cache repair (a cached file found damaged and replaced), as stats() counts them (``repairs_<cause>``)
_REPAIRS = {
    "block": ("shard", "downloaded again after a failed check of a data block"),
    "head": ("head", "read again after a failed check"),
    "header": ("shard", "downloaded again after a failed check of its header"),
    "size": ("shard", "of another size on disk (truncated) downloaded again"),
}


def _store_kinds() -> tuple[str, ...]:
    from stoker.remote._store import RETRY_KINDS

    return RETRY_KINDS


class RemoteManifest:
    """A dataset folder in a store: the store, and the shards its manifest lists (nothing is cached).

    Args:
        url: the dataset's folder in a store (``s3://bucket/train/``, ``https://host/data/``, ...).
        storage_options: passed to :func:`stoker.remote.open_store` (credentials, endpoint).
        store: the store of ``url`` opened already (then ``storage_options`` are not used).

    Raises:
        RemoteError: the manifest cannot be read (missing, denied): names the URL.
        DatasetFormatError: the manifest is corrupt or lists no shards.
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None, store: Store | None = None) -> None:
        from stoker.remote import _store

        if not url.endswith("/"):
            url += "/"
        self.store = _store.open_store(url, storage_options) if store is None else store
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


class RemoteShards(ShardSchedule):
    """The manifest, the shards' heads and the shared cache of a dataset at ``url``.

    Args:
        url: the dataset's folder in a store (``s3://bucket/train/``, ``https://host/data/``, ...).
        storage_options: passed to :func:`stoker.remote.open_store` (credentials, endpoint).
        cache_dir: the local cache folder (default :func:`stoker.remote.default_cache_dir`).
        cache_limit: the most disk the cache takes, all processes sharing
            ``cache_dir`` together [bytes]; ``None``: half the space its disk
            has for it (:func:`stoker.remote._cache_room.default_limit`, measured now).
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
        self._setup(listing.store, [listing], listing.names, cache_dir, cache_limit, verify, ahead, download_threads, cache_shared)

    def _setup(
        self,
        store: ShardStore,
        parts: Sequence[RemoteManifest],
        keys: Sequence[str],
        cache_dir: str | os.PathLike[str] | None,
        cache_limit: int | None,
        verify: bool,
        ahead: int | None,
        download_threads: int,
        cache_shared: bool,
    ) -> None:
        """The cache of the shards of ``parts`` (each dataset's manifest: their shards laid end to end), downloaded from
        ``store`` (one dataset's store, or a mix's stores behind one), ``keys`` their keys in it, and the schedule's state,
        empty. (:class:`stoker.dataset.mixed.MixedShards` gathers several datasets' shards, then calls it.)"""
        from stoker.remote import _cache, _cache_room

        self.store: ShardStore = store
        #: each dataset's manifest (one here; a mix's: see stoker.dataset.mixed.MixedShards), and its number of shards
        self.parts = list(parts)
        self.part_sizes = [len(p.entries) for p in self.parts]
        #: per shard: its dataset, and its name in that dataset's store
        self._where = [(i, name) for i, p in enumerate(self.parts) for name in p.names]
        self.entries: list[dict[str, Any]] = [e for p in self.parts for e in p.entries]
        self.names = list(keys)  # each shard's key in the cache (one dataset's: its name in the store)
        self.sizes = [int(e["file_size"]) for e in self.entries]
        self.header_crcs = [int(e["header_crc"]) for e in self.entries]
        #: each shard's identity in the cache: what it holds (see stoker.dataset._remote_heads.shard_ident)
        self.idents = [shard_ident(c, n) for c, n in zip(self.header_crcs, self.sizes)]
        self._index = {name: k for k, name in enumerate(self.names)}
        self.ahead = DEFAULT_AHEAD if ahead is None else max(1, int(ahead))
        self.download_threads = max(1, int(download_threads))
        self.verify = bool(verify)
        self.cache = _cache.ShardCache(store, _cache.default_cache_dir() if cache_dir is None else cache_dir, None, check=self._check,
                                       shared=bool(cache_shared))  # fmt: skip
        self.cache_dir = self.cache.cache_dir
        #: the limit was not given: a fraction of the disk's free space (stoker.remote._cache_room.default_limit)
        self.default_limit = cache_limit is None
        self.limit = _cache_room.default_limit(self.cache_dir, self.cache.usage_bytes()) if cache_limit is None else int(cache_limit)
        self.cache.limit = self.limit
        self.cache.headroom = _cache_room.disk_bytes(max(self.sizes))  # a download ahead leaves room for one that a batch waits for
        self._init_schedule()  # (stoker.dataset._remote_schedule)
        self._checked: dict[int, tuple[int, ...]] = {}  # shard -> _identity() of the file this process downloaded and checked whole
        self._shard_locks: dict[int, threading.Lock] = {}  # shard -> held while its blocks are checked (and it is refetched)
        self.cache.set_priority(self._priority)

    # ---- heads -------------------------------------------------------------------------------
    def shard_url(self, k: int) -> str:
        """The URL of shard ``k`` (no credentials)."""
        i, name = self._where[k]
        return self.parts[i].url + name

    def _head_source(self, k: int) -> tuple[Store, str]:
        """The store that holds shard ``k``, and its name there (its head is read with range requests)."""
        i, name = self._where[k]
        return self.parts[i].store, name

    def head(self, k: int, custom_fields: Mapping[str, type[Field]] | None = None, tails: Executor | None = None) -> tuple[Path, Reader]:
        """Shard ``k``'s head (cached, or read from the store: ``tails`` reads its last bytes beside its first), opened and
        checked against the manifest (size, header CRC, samples, the field table's hash): its path and Reader.

        Raises:
            DatasetFormatError: the head is corrupt or differs from the manifest (names the shard's URL).
            RemoteError: the store failed.
        """
        store, name = self._head_source(k)
        record = self.entries[k].get("head")  # (its front's length: the head in one round trip; checked when read)
        path, reader = open_head(
            self.cache, store, name, self.sizes[k], self.header_crcs[k], custom_fields, key=self.names[k],
            num_samples=int(self.entries[k]["num_samples"]), tails=tails,
            front=int(record["data_offset"]) if isinstance(record, dict) else None,
        )  # fmt: skip
        want = self.entries[k].get("fields_sha256")
        # (hashed from the head this reader opened: read again by path, another process sharing the cache may have evicted it)
        if want is not None and (got := fields_hash(reader.field_table)) != want:
            reader.close()
            raise DatasetFormatError(
                self.shard_url(k),
                f"has other fields than its manifest records: the sha256 of its field table is {got}, the manifest's "
                f"fields_sha256 is {want} (the shard was written with other fields, or the manifest was edited)",
            )
        return path, reader

    def open_heads(
        self, custom_fields: Mapping[str, type[Field]] | None = None, lazy: bool = False
    ) -> tuple[list[Path], list[Reader | PendingHead]]:
        """Every shard's head (cached, or read from the store), opened and checked against the manifest: their paths and
        Readers. ``lazy``: the shards whose manifest entry has a ``head`` record (:mod:`stoker.dataset._head_record`),
        but each dataset's first, are :class:`~stoker.dataset._head_record.PendingHead` objects (read later: see
        :meth:`head`); their paths are where their heads will be cached."""
        firsts = set(np.cumsum([0, *self.part_sizes[:-1]]).tolist())
        later = {k for k, e in enumerate(self.entries) if lazy and k not in firsts and e.get("head") is not None}
        if lazy and len(later) < len(self.entries) - len(firsts):
            log.debug(
                "%s: the manifest records no head of %d of its %d shards (written by an older stoker, or sizes that make no "
                "short record): their heads are read at open",
                self.url or "the mix", len(self.entries) - len(firsts) - len(later), len(self.entries),
            )  # fmt: skip
        now = [k for k in range(len(self.entries)) if k not in later]
        heads = min(_HEAD_THREADS, len(now))
        with (
            ThreadPoolExecutor(heads, thread_name_prefix="stoker-heads", initializer=block_interrupts) as pool,
            ThreadPoolExecutor(heads, thread_name_prefix="stoker-head-tails", initializer=block_interrupts) as tails,
        ):  # (a head's last bytes are read on a tails thread beside its first: one round trip)
            opened = dict(zip(now, pool.map(lambda k: self.head(k, custom_fields, tails), now)))
        paths: list[Path] = []
        readers: list[Reader | PendingHead] = []
        first = 0
        for k, entry in enumerate(self.entries):
            if k in firsts:
                first = k
            if k in opened:
                path, reader = opened[k]
                paths.append(path)
                readers.append(reader)
                continue
            path = self.cache.path(self.names[k], head_ident(self.header_crcs[k], self.sizes[k]))
            try:
                readers.append(PendingHead(cast(Reader, opened[first][1]), entry["head"], int(entry["num_samples"]), self.sizes[k],
                                           self.header_crcs[k], f"{self.shard_url(k)} (its manifest's head record)", path))  # fmt: skip
            except BaseException:
                for r in readers:
                    r.close()
                raise
            paths.append(path)
        return paths, readers

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

    def stats(self) -> dict[str, int | float]:
        """The cache's counters (downloads, hits, evictions, refetches, ...), the store's (requests, retries,
        bytes_downloaded [bytes]: everything, manifest and heads included), the cache's disk use now and at its peak,
        and its limit [bytes]. Counts and bytes are ints; durations (``retry_wait_s``) floats [seconds]."""
        out: dict[str, int | float] = dict(self.cache.stats())
        out.update(self.store.stats())  # requests, retries, and every byte downloaded: manifest, heads and shards
        out["cache_bytes"] = int(self.cache.usage_bytes())
        out["cache_peak_bytes"] = int(self.cache.peak_bytes)
        out["cache_limit"] = int(self.limit)
        for cause in _REPAIRS:
            out.setdefault(f"repairs_{cause}", 0)
        out["repairs"] = int(sum(out[f"repairs_{cause}"] for cause in _REPAIRS))
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


class RemoteReader(StoreReader):
    """The reader of one dataset in object storage (always ``bounded``): the reader of shards from stores
    (:class:`~stoker.dataset._store_reader.StoreReader`, as a mix's) over this dataset alone.

    Its metadata comes from the shards' heads; a batch's data is read, through
    the bounded page cache, from shards downloaded into the local cache
    (:class:`RemoteShards`). ``acquire`` returns a ticket that ``release``
    takes back, as for a local bounded reader.
    """

    def __init__(self, remote: RemoteShards, custom_fields: Mapping[str, type[Field]] | None = None, max_gap: int = 8) -> None:
        super().__init__([remote.url], [remote.url], [None], remote, custom_fields, bounded=True, max_gap=max_gap, lazy_heads=True)
        self.remote: RemoteShards = remote
        self.path = remote.url

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
    from stoker.remote._cache_room import DEFAULT_LIMIT_FRACTION, check_fits_disk, disk_bytes

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
