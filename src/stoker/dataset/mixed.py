"""Several datasets read as one: the streams of a mix (:mod:`stoker.loader.mixing`) behind the API of a ShardedReader.

:func:`open_mixed` opens each dataset (a file, a folder of shards, a glob, a
list of files, or a URL), checks that they have the same fields, and returns a
:class:`MixedReader`: a :class:`~stoker.dataset.sharded.ShardedReader` over every
shard of every dataset, laid end to end::

    global index:  0 .......... n_0 - 1 | n_0 ......... n_0 + n_1 - 1 | ...
    dataset:       stream 0's samples   | stream 1's samples          | ...
    shards:        stream 0's shards    | stream 1's shards           | ...

``stream_starts`` holds each stream's first global index (and, last, the
total); ``stream_shards`` each stream's first shard.

Datasets in object storage share one cache (:class:`MixedShards`): one folder
of ``cache_dir`` and one ``cache_limit`` for all of them (the default limit
when none is given), their shards and heads named by what they hold, the
shards of every stream downloaded in the order the epoch first needs them,
whichever stream they belong to (the schedule of
:class:`~stoker.dataset._remote.RemoteShards`, over the union of their shards).
A mix with any dataset in object storage reads all of its data through the
bounded page cache (as ``os_cache=False``): its shards' heads hold the
metadata, and the data comes from the downloaded shards and the local files
(:class:`_MixedSource`). With ``verify``, every data block a batch reads is
checked before use, once per process, as for one dataset: a local file's as for
any local file, a cached shard's per block unless this process downloaded and
checked it whole (:meth:`MixedReader.check_data`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import quote

import numpy as np

from stoker.dataset import _vstore
from stoker.dataset._remote import DOWNLOAD_THREADS, RemoteManifest, RemoteShards, check_limit, check_limit_arg
from stoker.dataset.sharded import ShardedReader
from stoker.dataset.shards import open_files
from stoker.errors import DatasetFormatError
from stoker.fields import Field
from stoker.format._verify import DataCheck
from stoker.format.reader import Reader

if TYPE_CHECKING:
    from stoker.remote._store import Store

__all__ = ["MixedReader", "MixedShards", "open_mixed"]

#: the longest cache key built from a shard's URL; a longer URL is keyed by a hash of its dataset's URL (file names: 255 bytes)
_MAX_KEY = 200


def _is_url(source: Any) -> bool:
    return isinstance(source, str) and "://" in source


def check_fields(names: Sequence[str], where: Sequence[Any], fields: Sequence[Mapping[str, Field]]) -> None:
    """Every dataset has the first one's fields, of the same types, in the same order.

    Raises:
        DatasetFormatError: naming the dataset (its stream's name and its path or URL) and the field that differs.
    """
    first = list(fields[0].items())
    for s in range(1, len(fields)):
        mine = list(fields[s].items())
        if mine == first:
            continue
        ours, theirs = dict(first), dict(mine)
        head = f"stream {s} ({names[s]!r}) has other fields than stream 0 ({names[0]!r}, {where[0]}): "
        for name, field in first:
            if name not in theirs:
                raise DatasetFormatError(
                    where[s], head + f"it has no field {name!r} ({field!r} in stream 0); every stream of a mix needs the same fields"
                )
            if theirs[name] != field:
                raise DatasetFormatError(
                    where[s],
                    head + f"field {name!r} is {theirs[name]!r} here and {field!r} in stream 0; write them with the same field types",
                )
        for name, field in mine:
            if name not in ours:
                raise DatasetFormatError(
                    where[s], head + f"its field {name!r} ({field!r}) is not in stream 0; every stream of a mix needs the same fields"
                )
        raise DatasetFormatError(
            where[s],
            head + f"the fields come in another order ({[n for n, _ in mine]} vs {[n for n, _ in first]}); write them in the same order",
        )


class _StoreSet:
    """Several stores behind the one store a :class:`~stoker.remote.ShardCache` downloads from: a key is a shard's URL."""

    url = ""  # keys are whole URLs: the cache's messages name them as they are

    def __init__(self, stores: Sequence[Store]) -> None:
        self.stores = list(stores)
        self._route: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()
        self.per_store = [{"downloads": 0.0, "bytes_downloaded": 0.0, "download_s": 0.0} for _ in self.stores]

    def key(self, s: int, name: str) -> str:
        """The cache key of object ``name`` of store ``s`` (registered for :meth:`download`)."""
        url = self.stores[s].url
        key = url + name
        if len(quote(key, safe="")) > _MAX_KEY:
            key = f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-{name}"
        self._route[key] = (s, name)
        return key

    def download(self, key: str, dest: Path, size: int | None = None) -> int:
        s, name = self._route[key]
        t0 = time.perf_counter()
        try:
            return self.stores[s].download(name, dest, size)
        finally:
            with self._lock:
                counts = self.per_store[s]
                counts["downloads"] += 1
                counts["download_s"] += time.perf_counter() - t0
                with contextlib.suppress(OSError):
                    counts["bytes_downloaded"] += dest.stat().st_size

    def interrupt(self) -> None:
        """Stop every store's reads in flight (see :meth:`stoker.remote.Store.interrupt`)."""
        for store in self.stores:
            store.interrupt()

    def resume(self) -> None:
        """Accept reads again in every store."""
        for store in self.stores:
            store.resume()

    @property
    def interrupted(self) -> bool:
        """Whether the stores' reads are stopped."""
        return any(store.interrupted for store in self.stores)

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for store in self.stores:
            for k, v in store.stats().items():
                out[k] = out.get(k, 0.0) + float(v)
        return out


class MixedShards(RemoteShards):
    """The shards of several datasets in object storage, in one cache, on one schedule.

    The shards of every dataset are laid end to end (dataset 0's, then dataset
    1's ...); one :class:`~stoker.remote.ShardCache` holds them and their heads,
    keyed by their URLs, in one folder of ``cache_dir``, within one
    ``cache_limit`` (without one: the default, as for one dataset); the
    schedule (:meth:`RemoteShards.schedule`) downloads them in the order of
    their first use in the epoch, whichever dataset they belong to. The rest is
    :class:`RemoteShards`' own: files named by what they hold, heads as files of
    the cache, weak pins of downloads ahead, the check before use.

    Args:
        parts: each dataset's store and manifest.
        cache_dir: the cache's folder (default :func:`stoker.dataset._remote.default_cache_dir`).
        cache_limit: the most disk the cache takes [bytes]; ``None``: the default (see :class:`RemoteShards`).
        verify: as for :class:`RemoteShards`.
        ahead: shards downloaded ahead of the batches (default 4).
        cache_shared: ``cache_dir`` is shared with other users on purpose.
        download_threads: shards downloaded at once.

    Raises:
        UnsafeCacheError: ``cache_dir`` belongs to another user or others can write it (and not ``cache_shared``).
    """

    def __init__(
        self,
        parts: Sequence[RemoteManifest],
        cache_dir: str | os.PathLike[str] | None,
        cache_limit: int | None,
        verify: bool = True,
        ahead: int | None = None,
        cache_shared: bool = False,
        download_threads: int = DOWNLOAD_THREADS,
    ) -> None:
        self.parts = list(parts)
        stores = _StoreSet([p.store for p in self.parts])
        self.url = ""  # (the shards' keys are their URLs)
        #: per shard: its dataset, and its name in that dataset's store
        self._where = [(i, name) for i, p in enumerate(self.parts) for name in p.names]
        keys = [stores.key(i, name) for i, name in self._where]
        entries = [e for p in self.parts for e in p.entries]
        # (the cache uses its store's url, download() and stats(): what _StoreSet has of a Store)
        self._setup(cast("Store", stores), entries, keys, cache_dir, cache_limit, verify, ahead, download_threads, cache_shared)

    def shard_url(self, k: int) -> str:
        """The URL of shard ``k`` (no credentials)."""
        i, name = self._where[k]
        return self.parts[i].url + name

    def _head_source(self, k: int) -> tuple[Store, str]:
        i, name = self._where[k]
        return self.parts[i].store, name

    def part_stats(self) -> list[dict[str, float]]:
        """Per part (dataset): its downloads, bytes, seconds spent downloading [s], and its store's requests and retries."""
        out = []
        for part, counts in zip(self.parts, cast(_StoreSet, self.store).per_store):
            row = dict(counts)
            store = part.store.stats()
            row["requests"], row["retries"] = float(store.get("requests", 0)), float(store.get("retries", 0))
            out.append(row)
        return out

    def __repr__(self) -> str:
        return f"MixedShards({[p.url for p in self.parts]}, shards={len(self.entries)}, cache_dir={str(self.cache_dir)!r}, cache_limit={self.limit})"


class _MixedSource:
    """Where the page cache and the data check read shard ``k``'s bytes: a downloaded shard (object storage; the
    reader's ``paths[k]`` is its head), or the local file (a descriptor opened with the reader, closed with it)."""

    def __init__(self, remote: RemoteShards, remote_shard: np.ndarray, paths: Sequence[Path]) -> None:
        self.remote = remote
        self.remote_shard = remote_shard
        self.paths = list(paths)
        self.fds: dict[int, int] = {}
        self._finalizer = weakref.finalize(self, _close_fds, self.fds)
        for k in np.flatnonzero(remote_shard < 0).tolist():
            try:
                self.fds[k] = os.open(self.paths[k], os.O_RDONLY)
            except OSError as exc:
                self.close()
                raise DatasetFormatError(self.paths[k], f"cannot be read: {exc.strerror or exc}") from exc

    def fd(self, k: int) -> int:
        j = int(self.remote_shard[k])
        return self.remote.fd(j) if j >= 0 else self.fds[k]

    def name(self, k: int) -> str:
        j = int(self.remote_shard[k])
        return f"{self.remote.shard_url(j)} (cached as {self.remote.cached_path(j)})" if j >= 0 else str(self.paths[k])

    def close(self) -> None:
        self._finalizer()


def _close_fds(fds: dict[int, int]) -> None:
    for fd in fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


class MixedReader(ShardedReader):
    """The shards of several datasets read as one dataset (see :mod:`stoker.dataset.mixed`); made by :func:`open_mixed`.

    Args:
        names: each dataset's name.
        where: each dataset's path or URL (for messages).
        files: each local dataset's files; ``None`` for a dataset in object storage (its shards: ``remote``'s next ones).
        remote: the datasets in object storage, their shards in the order of ``files``' ``None``s; or ``None``.
        custom_fields: field name -> Field class.
        bounded: read local data through the bounded cache (a mix with ``remote`` always does).
        max_gap: as for :class:`~stoker.dataset.sharded.ShardedReader`.

    Attributes:
        stream_names: each dataset's name.
        stream_starts: each dataset's first global sample index, then the total.
        stream_shards: each dataset's first shard, then the number of shards.
        remote: the shared cache and schedule of the datasets in object storage
            (:class:`MixedShards`), or ``None``.
        remote_shard: per shard, its index in ``remote`` (``-1``: a local file).
        read_seconds: per dataset, the time batches spent making its bytes present (downloads waited for, the
            check before use, reads into the bounded cache) [s]; bounded readers only.
        data_check: the check before use of the data blocks batches read (see :meth:`check_data`), or ``None``.

    Raises:
        DatasetFormatError: a dataset whose fields differ from the first's (names the dataset and the field); a
            missing or corrupt file or head.
    """

    def __init__(
        self,
        names: Sequence[str],
        where: Sequence[Any],
        files: Sequence[Sequence[Path] | None],
        remote: MixedShards | None,
        custom_fields: Mapping[str, type[Field]] | None,
        bounded: bool,
        max_gap: int = 8,
    ) -> None:
        self.stream_names = list(names)
        self.remote: MixedShards | None = remote
        self.bounded = bool(bounded) or remote is not None
        self._custom_fields = custom_fields
        self.data_check: DataCheck | None = None
        heads, head_readers = remote.open_heads(custom_fields) if remote is not None else ([], [])
        try:
            self._open_streams(names, where, files, heads, head_readers, custom_fields, max_gap)
        except BaseException:
            for reader in head_readers:
                reader.close()
            raise
        self.stream_starts = self.shard_starts[self.stream_shards]
        self.read_seconds = np.zeros(len(names), dtype=np.float64)
        self._read_lock = threading.Lock()
        self._stream_of_shard = np.repeat(np.arange(len(names)), np.diff(self.stream_shards))
        #: a remote shard's place among the reader's shards (the data check's numbering)
        self._shard_of_remote = np.flatnonzero(self.remote_shard >= 0)

    def _open_streams(
        self,
        names: Sequence[str],
        where: Sequence[Any],
        files: Sequence[Sequence[Path] | None],
        heads: list[Path],
        head_readers: list[Reader],
        custom_fields: Mapping[str, type[Field]] | None,
        max_gap: int,
    ) -> None:
        """Check the datasets' fields alike, open the local files, and lay every shard out (local files and heads)."""
        remote = self.remote
        remote_sizes = iter([len(p.entries) for p in remote.parts] if remote is not None else [])
        counts: list[int] = []
        fields: list[dict[str, Field]] = []
        j = 0
        for group in files:
            if group is None:  # a dataset in object storage: its heads, the next of remote's
                n = next(remote_sizes)
                self._same_fields(head_readers[j : j + n])
                fields.append(dict(head_readers[j].fields))
                j += n
            else:
                n = len(group)
                with Reader(group[0], custom_fields=custom_fields) as first:
                    fields.append(dict(first.fields))
            counts.append(n)
        check_fields(names, where, fields)
        self.stream_shards = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        local = [p for group in files if group is not None for p in group]
        if remote is None:  # local files only: as a ShardedReader of them all
            self.paths, self.shards, self.cache, mapped = self._open(local, custom_fields, self.bounded, max_gap)
            self.remote_shard = np.full(len(self.shards), -1, dtype=np.int64)
            self._setup("[" + ", ".join(str(w) for w in where) + "]", mapped)
            return
        local_readers = self._open(local, custom_fields, False, max_gap)[1] if local else []  # (mapped: their metadata)
        self.paths, self.shards = [], []
        remote_of: list[int] = []
        i = j = 0
        for group, n in zip(files, counts):
            if group is None:
                self.paths += heads[j : j + n]
                self.shards += head_readers[j : j + n]
                remote_of += range(j, j + n)
                j += n
            else:
                self.paths += list(group)
                self.shards += local_readers[i : i + n]
                remote_of += [-1] * n
                i += n
        self.remote_shard = np.asarray(remote_of, dtype=np.int64)
        source = _MixedSource(remote, self.remote_shard, self.paths)
        self.cache = _vstore.PageCache(self.paths, [s.file_size for s in self.shards], max_gap=max_gap, source=source)
        self._setup("[" + ", ".join(str(w) for w in where) + "]", None)

    @property
    def num_streams(self) -> int:
        """The number of datasets."""
        return len(self.stream_names)

    def stream_of(self, indices: np.ndarray) -> np.ndarray:
        """The dataset of each global sample index."""
        return np.searchsorted(self.stream_starts, np.asarray(indices, dtype=np.int64), side="right") - 1

    def check_data(self, fields: list[str]) -> None:
        """From now on, check every data block of ``fields`` that a batch reads against its CRC before it is read, once per
        process (and, for a shard in object storage, per cached file: see :meth:`RemoteShards.check`); bounded readers."""
        if self.data_check is None and self.cache is not None:
            self.data_check = DataCheck(self, fields, source=self.cache.source)

    def schedule(self, order: np.ndarray, batch_size: int, skip: int = 0) -> None:
        """The coming epoch's samples (this rank's, in order): download the shards in object storage ahead, by first use."""
        if self.remote is not None:
            self.remote.schedule(self.remote_shard[self.locate(order)[0]], batch_size, skip)

    def local(self, indices: np.ndarray) -> bool:
        """Whether :meth:`acquire` of samples ``indices`` would not wait for a download (their shards in object storage,
        if any, all in the cache now)."""
        if self.remote is None:
            return True
        remote = self.remote_shard[self.locate(np.asarray(indices, dtype=np.int64))[0]]
        return self.remote.local(np.unique(remote[remote >= 0]).tolist())

    def acquire(self, indices: np.ndarray) -> list[int]:
        """Read what samples ``indices`` store into the page cache, their data blocks checked first (:meth:`check_data`);
        a shard in object storage is downloaded, or waited for, and pinned while its blocks are checked and its pages
        read. Returns the pages, for :meth:`release`. Times each dataset's part."""
        if self.cache is None:
            return []
        idx = np.asarray(indices, dtype=np.int64)
        shard = self.locate(idx)[0]
        stream = self._stream_of_shard[shard]
        remote = self.remote_shard[shard]
        check = self.data_check
        pages = self.cache.ticket()  # (stale at release if a page it holds is dropped: the batch is made again)
        try:
            for s in np.unique(stream).tolist():
                t0 = time.perf_counter()
                mine = stream == s
                local = mine & (remote < 0)
                if local.any():
                    if check is not None:
                        check.check(idx[local], bounded=True)
                    pages += self.cache.acquire(*self.data_extents(idx[local]))
                for j in np.unique(remote[mine & (remote >= 0)]).tolist():
                    assert self.remote is not None  # noqa: S101 - only remote shards have j >= 0
                    self.remote.begin(j)
                    try:
                        theirs = idx[mine & (remote == j)]
                        if check is not None:
                            self.remote.check(j, check, theirs, at=int(self._shard_of_remote[j]))
                        pages += self.cache.acquire(*self.data_extents(theirs))
                    finally:
                        self.remote.done(j)
                with self._read_lock:
                    self.read_seconds[s] += time.perf_counter() - t0
        except BaseException:
            self.cache.release(pages)
            raise
        return pages

    def read(self, index: int) -> tuple[Any, ...]:
        """Decode sample ``index`` in Python (a shard in object storage: downloaded into the cache if absent)."""
        if not -self.num_samples <= index < self.num_samples:
            raise IndexError(f"sample index {index} out of range for {self.num_samples} samples")
        shard, local = self.locate([index % self.num_samples])
        j = int(self.remote_shard[int(shard[0])])
        if j >= 0:
            assert self.remote is not None  # noqa: S101
            return self.remote.read_sample(j, int(local[0]), self._custom_fields)
        return self.shards[int(shard[0])].read(int(local[0]))

    def downloads_stopped(self) -> contextlib.AbstractContextManager[None]:
        """Inside the block, downloads in flight stop at once and new ones are refused (a loader's epoch closing)."""
        return self.remote.downloads_stopped() if self.remote is not None else contextlib.nullcontext()

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()
        source = self.cache.source if self.cache is not None else None
        if isinstance(source, _MixedSource):
            source.close()
        super().close()

    def __repr__(self) -> str:
        return f"MixedReader({self.stream_names}, shards={self.num_shards}, samples={self.num_samples}, fields={self.fields})"


def open_mixed(
    sources: Sequence[Any],
    names: Sequence[str],
    custom_fields: Mapping[str, type[Field]] | None = None,
    *,
    bounded: bool = False,
    storage_options: Sequence[Mapping[str, Any] | None] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit: int | None = None,
    verify: bool = True,
    ahead: int | None = None,
    cache_shared: bool = False,
) -> MixedReader:
    """Open every dataset of a mix and read them as one.

    Args:
        sources: each dataset: what :func:`~stoker.dataset.sharded.open_dataset` takes (a file, a folder, a glob,
            a list of files, a URL).
        names: each dataset's name (for messages).
        custom_fields: field name -> Field class (as for ``Reader``).
        bounded: read local data through the bounded cache (``os_cache=False``); a mix with a URL always is.
        storage_options: per dataset, for a URL: credentials and endpoint.
        cache_dir: the cache folder the URLs share (default: :func:`stoker.dataset._remote.default_cache_dir`).
        cache_limit: the most disk the shared cache takes [bytes] (default: as for one dataset, a fraction of the
            free disk: see :class:`~stoker.dataset._remote.RemoteShards`).
        verify: check every downloaded shard against its CRCs, and every data block a batch reads once per process
            (the Loader's ``verify``).
        ahead: shards downloaded ahead of the batches (default 4).
        cache_shared: ``cache_dir`` is shared with other users on purpose.

    Raises:
        DatasetFormatError: a dataset that cannot be opened, or whose fields differ from the first's (names the
            dataset and the field).
        RemoteError: a URL whose store or manifest cannot be read.
        UnsafeCacheError: ``cache_dir`` belongs to another user or others can write it (and not ``cache_shared``).
        StokerError: a ``cache_limit`` (or the default) smaller than the largest shard in object storage.
        ValueError: ``cache_dir``/``cache_limit``/... for a mix with no URL.
    """
    urls = [s for s in sources if _is_url(s)]
    if not urls:
        given = [k for k, v in (("storage_options", any(storage_options or [])), ("cache_dir", cache_dir),
                                ("cache_limit", cache_limit), ("download_ahead", ahead), ("cache_shared", cache_shared)) if v]  # fmt: skip
        if given:
            raise ValueError(f"{', '.join(given)} are for datasets in object storage (a URL such as s3://bucket/train/); no stream is one")
    check_limit_arg(cache_limit)
    options = list(storage_options) if storage_options is not None else [None] * len(sources)
    files: list[list[Path] | None] = []
    parts: list[RemoteManifest] = []
    where: list[Any] = []
    for source, opts in zip(sources, options):
        if _is_url(source):
            part = RemoteManifest(source, opts)
            parts.append(part)
            files.append(None)
            where.append(part.url)
        else:
            if opts:
                raise ValueError(f"storage_options are for a dataset in object storage (a URL); got the local {source!r}")
            found = open_files(source, lambda found: list(found))
            files.append(found)
            where.append(source if isinstance(source, (str, os.PathLike)) else found[0])
    remote = MixedShards(parts, cache_dir, cache_limit, verify, ahead, cache_shared) if parts else None
    try:
        if remote is not None:
            check_limit(remote)
        return MixedReader(names, where, files, remote, custom_fields, bounded)
    except BaseException:
        if remote is not None:
            remote.close()
        raise
