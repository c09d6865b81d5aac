"""Several datasets read as one: the streams of a mix (:mod:`stoker.loader.mixing`) behind the API of a ShardedReader.

:func:`open_mixed` opens each dataset (a file, a folder of shards, a glob, a
list of files, or a URL), checks that they have the same fields, and returns a
:class:`MixedReader`: a :class:`~stoker.format.sharded.ShardedReader` over every
shard of every dataset, laid end to end::

    global index:  0 .......... n_0 - 1 | n_0 ......... n_0 + n_1 - 1 | ...
    dataset:       stream 0's samples   | stream 1's samples          | ...
    shards:        stream 0's shards    | stream 1's shards           | ...

``stream_starts`` holds each stream's first global index (and, last, the
total); ``stream_shards`` each stream's first shard.

Datasets in object storage share one cache (:class:`MixedShards`): one folder
of ``cache_dir`` and one ``cache_limit`` for all of them, the shards of every
stream downloaded in the order the epoch first needs them, whichever stream they
belong to (the schedule of :class:`~stoker.format._remote.RemoteShards`, over
the union of their shards). A mix with any dataset in object storage reads all
of its data through the bounded page cache (as ``os_cache=False``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import quote

import numpy as np

from stoker.errors import DatasetFormatError, StokerError
from stoker.fields import Field
from stoker.format._remote import DEFAULT_AHEAD, RemoteShards
from stoker.format.reader import Reader
from stoker.format.sharded import ShardedReader
from stoker.format.shards import open_files

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

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for store in self.stores:
            for k, v in store.stats().items():
                out[k] = out.get(k, 0.0) + float(v)
        return out


class MixedShards(RemoteShards):
    """The shards of several datasets in object storage, in one cache, on one schedule.

    The shards of every part are laid end to end (part 0's, then part 1's ...);
    one :class:`~stoker.remote.ShardCache` holds them, keyed by their URLs, in
    one folder of ``cache_dir`` under one ``cache_limit``; the schedule
    (:meth:`RemoteShards.schedule`) downloads them in the order of their first
    use in the epoch, whichever dataset they belong to.

    Args:
        parts: each dataset's :class:`RemoteShards` (their manifests, stores and stubs; not their caches).
        cache_limit: the most bytes of shards the shared cache holds [bytes]; ``None``: no limit.
        ahead: shards downloaded ahead of the batches (default 4).
    """

    def __init__(self, parts: Sequence[RemoteShards], cache_limit: int | None, ahead: int | None) -> None:
        from stoker.remote._cache import ShardCache

        first = parts[0]
        self.parts = list(parts)
        stores = _StoreSet([p.store for p in parts])
        self.store = stores  # type: ignore[assignment]
        self.url = ""
        self.entries = [e for p in parts for e in p.entries]
        self.names = [stores.key(i, name) for i, p in enumerate(parts) for name in p.names]
        self.sizes = [size for p in parts for size in p.sizes]
        self.stubs = [stub for p in parts for stub in p.stubs]
        self.cache_dir = first.cache_dir
        self.limit = None if cache_limit is None else int(cache_limit)
        self.ahead = DEFAULT_AHEAD if ahead is None else max(1, int(ahead))
        self.download_threads = first.download_threads
        self.verify = first.verify
        self.heads_dir = first.heads_dir
        self.cache = ShardCache(stores, self.cache_dir, self.limit, check=self._check)  # type: ignore[arg-type]
        self._init_schedule()

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
    """Where the page cache reads shard ``k``'s bytes: a downloaded shard (object storage) or the local file."""

    def __init__(self, reader: MixedReader) -> None:
        self.reader = reader

    def fd(self, k: int) -> int:
        j = int(self.reader.remote_shard[k])
        if j >= 0:
            return self.reader.remote.fd(j)  # type: ignore[union-attr]
        return self.reader.cache._fds[k]  # type: ignore[union-attr]

    def name(self, k: int) -> str:
        j = int(self.reader.remote_shard[k])
        return self.reader.remote.shard_url(j) if j >= 0 else str(self.reader.paths[k])  # type: ignore[union-attr]


class MixedReader(ShardedReader):
    """The shards of several datasets read as one dataset (see :mod:`stoker.format.mixed`); made by :func:`open_mixed`.

    Attributes:
        stream_names: each dataset's name.
        stream_starts: each dataset's first global sample index, then the total.
        stream_shards: each dataset's first shard, then the number of shards.
        remote: the shared cache and schedule of the datasets in object storage
            (:class:`MixedShards`), or ``None``.
        remote_shard: per shard, its index in ``remote`` (``-1``: a local file).
        read_seconds: per dataset, the time batches spent making its bytes present
            (downloads waited for, reads into the bounded cache) [s]; bounded readers only.
    """

    def __init__(
        self,
        names: Sequence[str],
        where: Sequence[Any],
        paths: Sequence[Sequence[Path]],
        remote_parts: Sequence[RemoteShards | None],
        custom_fields: Mapping[str, type[Field]] | None,
        bounded: bool,
        cache_limit: int | None = None,
        ahead: int | None = None,
        max_gap: int = 8,
    ) -> None:
        self.stream_names = list(names)
        self.bounded = bool(bounded) or any(p is not None for p in remote_parts)
        self._custom_fields = custom_fields
        counts = [len(p) for p in paths]
        self.stream_shards = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        remote_of = np.full(int(self.stream_shards[-1]), -1, dtype=np.int64)
        parts = [p for p in remote_parts if p is not None]
        self.remote: RemoteShards | None = MixedShards(parts, cache_limit, ahead) if parts else None
        j = 0
        for s, part in enumerate(remote_parts):
            if part is not None:
                lo = int(self.stream_shards[s])
                remote_of[lo : lo + len(part.stubs)] = np.arange(j, j + len(part.stubs))
                j += len(part.stubs)
        self.remote_shard = remote_of
        flat = [p for group in paths for p in group]
        self.paths, self.shards, self.cache, mapped = self._open(flat, custom_fields, self.bounded, max_gap)
        self._setup("[" + ", ".join(str(w) for w in where) + "]", mapped)
        self.stream_starts = self.shard_starts[self.stream_shards]
        if self.remote is not None:
            assert self.cache is not None  # noqa: S101 - bounded
            self.cache.source = _MixedSource(self)
        self.read_seconds = np.zeros(len(names), dtype=np.float64)
        self._read_lock = threading.Lock()
        self._stream_of_shard = np.repeat(np.arange(len(names)), counts)

    @property
    def num_streams(self) -> int:
        """The number of datasets."""
        return len(self.stream_names)

    def stream_of(self, indices: np.ndarray) -> np.ndarray:
        """The dataset of each global sample index."""
        return np.searchsorted(self.stream_starts, np.asarray(indices, dtype=np.int64), side="right") - 1

    def schedule(self, order: np.ndarray, batch_size: int, skip: int = 0) -> None:
        """The coming epoch's samples (this rank's, in order): download the shards in object storage ahead, by first use."""
        if self.remote is not None:
            self.remote.schedule(self.remote_shard[self.locate(order)[0]], batch_size, skip)

    def acquire(self, indices: np.ndarray) -> list[int]:
        """Read what samples ``indices`` store into the page cache (a shard in object storage is downloaded, or waited
        for, and pinned while its pages are read); returns the pages, for :meth:`release`. Times each dataset's part."""
        if self.cache is None:
            return []
        idx = np.asarray(indices, dtype=np.int64)
        shard = self.locate(idx)[0]
        stream = self._stream_of_shard[shard]
        remote = self.remote_shard[shard]
        pages: list[int] = []
        try:
            for s in np.unique(stream).tolist():
                t0 = time.perf_counter()
                mine = stream == s
                local = mine & (remote < 0)
                if local.any():
                    pages += self.cache.acquire(*self.data_extents(idx[local]))
                for j in np.unique(remote[mine & (remote >= 0)]).tolist():
                    assert self.remote is not None  # noqa: S101 - only remote shards have j >= 0
                    self.remote.begin(j)
                    try:
                        pages += self.cache.acquire(*self.data_extents(idx[mine & (remote == j)]))
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

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()
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
) -> MixedReader:
    """Open every dataset of a mix and read them as one.

    Args:
        sources: each dataset: what :func:`~stoker.format.sharded.open_dataset` takes (a file, a folder, a glob,
            a list of files, a URL).
        names: each dataset's name (for messages).
        custom_fields: field name -> Field class (as for ``Reader``).
        bounded: read local data through the bounded cache (``os_cache=False``); a mix with a URL always is.
        storage_options: per dataset, for a URL: credentials and endpoint.
        cache_dir: the cache folder the URLs share (default: :func:`stoker.format._remote.default_cache_dir`).
        cache_limit: the most bytes of shards the shared cache holds [bytes] (default: no limit).
        verify: check every downloaded shard against its CRCs.
        ahead: shards downloaded ahead of the batches (default 4).

    Raises:
        DatasetFormatError: a dataset that cannot be opened, or whose fields differ from the first's (names the
            dataset and the field).
        RemoteError: a URL whose store or manifest cannot be read.
        ValueError: ``cache_dir``/``cache_limit``/... for a mix with no URL.
    """
    urls = [s for s in sources if _is_url(s)]
    if not urls:
        given = [k for k, v in (("storage_options", any(storage_options or [])), ("cache_dir", cache_dir),
                                ("cache_limit", cache_limit), ("download_ahead", ahead)) if v]  # fmt: skip
        if given:
            raise ValueError(f"{', '.join(given)} are for datasets in object storage (a URL such as s3://bucket/train/); no stream is one")
    if cache_limit is not None and (isinstance(cache_limit, bool) or not isinstance(cache_limit, (int, np.integer)) or cache_limit <= 0):
        raise ValueError(f"cache_limit must be a number of bytes > 0, or None for no limit; got {cache_limit!r}")
    options = list(storage_options) if storage_options is not None else [None] * len(sources)
    paths: list[list[Path]] = []
    remote_parts: list[RemoteShards | None] = []
    where: list[Any] = []
    fields: list[Mapping[str, Field]] = []
    try:
        for source, opts in zip(sources, options):
            if _is_url(source):
                part = RemoteShards(source, opts, cache_dir, cache_limit, verify, ahead)
                remote_parts.append(part)
                paths.append(list(part.stubs))
                where.append(part.url)
            else:
                if opts:
                    raise ValueError(f"storage_options are for a dataset in object storage (a URL); got the local {source!r}")
                files = open_files(source, lambda found: list(found))
                remote_parts.append(None)
                paths.append(files)
                where.append(source if isinstance(source, (str, os.PathLike)) else files[0])
            with Reader(paths[-1][0], custom_fields=custom_fields) as first:
                fields.append(dict(first.fields))
        check_fields(names, where, fields)
        limit_check = [p for p in remote_parts if p is not None]
        if cache_limit is not None and limit_check:
            largest = max(max(p.sizes) for p in limit_check)
            if cache_limit < largest:
                raise StokerError(
                    f"cache_limit={cache_limit} bytes is smaller than the largest shard of the mix's datasets in object storage "
                    f"({largest} bytes): shards are cached whole; give a cache_limit of a few shards of every such dataset"
                )
        return MixedReader(names, where, paths, remote_parts, custom_fields, bounded, cache_limit, ahead)
    except BaseException:
        for opened in remote_parts:
            if opened is not None:
                opened.close()
        raise
