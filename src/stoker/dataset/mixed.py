"""Several datasets read as one: the streams of a mix (:mod:`stoker.loader.mixing`) behind the API of a ShardedReader.

:func:`open_mixed` opens each dataset (a file, a folder of shards, a glob, a
list of files, or a URL), checks that they have the same fields, and returns a
:class:`MixedReader`: the reader of shards from stores
(:class:`~stoker.dataset._store_reader.StoreReader`, the one a single dataset in
object storage uses too) over every shard of every dataset, laid end to end.
``stream_starts`` holds each stream's first global index (and, last, the
total); ``stream_shards`` each stream's first shard.

Datasets in object storage share one cache (:class:`MixedShards`): one folder
of ``cache_dir`` and one ``cache_limit`` for all of them (the default limit
when none is given), their shards and heads named by what they hold, the
shards of every stream downloaded in the order the epoch first needs them,
whichever stream they belong to (the schedule of
:class:`~stoker.dataset._remote.RemoteShards`, over the union of their shards).
A mix with any dataset in object storage reads all of its data through the
bounded page cache (as ``os_cache=False``).

The open reads the datasets' manifests at once, then each one's first shard's
head; the heads their manifests record (:mod:`stoker.dataset._head_record`)
are read as batches need them or in the background, by the one reader of
shards from stores (``lazy_heads``, as for one dataset).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from stoker._threads import block_interrupts
from stoker.dataset._remote import DOWNLOAD_THREADS, RemoteManifest, RemoteShards, check_limit, check_limit_arg
from stoker.dataset._remote_heads import said_if_slow
from stoker.dataset._store_reader import StoreReader
from stoker.dataset.shards import open_files
from stoker.fields import Field
from stoker.remote._store import is_url, open_store, printable_url

if TYPE_CHECKING:
    from stoker.remote._store import Store

__all__ = ["MixedReader", "MixedShards", "open_mixed"]

#: the longest cache key built from a shard's URL; a longer URL is keyed by a hash of its dataset's URL (file names: 255 bytes)
_MAX_KEY = 200


class _StoreSet:
    """Several stores behind the one store a :class:`~stoker.remote.ShardCache` downloads from: a key is a shard's URL
    (a :class:`~stoker.dataset._remote_schedule.ShardStore`, as a :class:`~stoker.remote.Store` is)."""

    url = ""  # keys are whole URLs: the cache's messages name them as they are

    def __init__(self, stores: Sequence[Store]) -> None:
        self.stores = list(stores)
        self._route: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()
        #: per store: its downloads and bytes downloaded (ints), and the seconds spent downloading (a float)
        self.per_store: list[dict[str, int | float]] = [{"downloads": 0, "bytes_downloaded": 0, "download_s": 0.0} for _ in self.stores]

    def key(self, s: int, name: str) -> str:
        """The cache key of object ``name`` of store ``s`` (registered for :meth:`download`)."""
        url = self.stores[s].url
        key = url + name
        if len(quote(key, safe="")) > _MAX_KEY:
            key = f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-{name}"
        self._route[key] = (s, name)
        return key

    def download(self, key: str, dest: Path, size: int | None = None) -> int:
        """Download the object of cache key ``key`` (see :meth:`key`) from its store into ``dest``."""
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

    def stats(self) -> dict[str, int | float]:
        """The stores' :meth:`stoker.remote.Store.stats` summed (counts stay ints)."""
        out: dict[str, int | float] = {}
        for store in self.stores:
            for k, v in store.stats().items():
                out[k] = out.get(k, 0) + v
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
        cache_dir: the cache's folder (default :func:`stoker.remote.default_cache_dir`).
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
        self._stores = stores = _StoreSet([p.store for p in parts])
        self.url = ""  # (the shards' keys are their URLs)
        keys = [stores.key(i, name) for i, p in enumerate(parts) for name in p.names]
        self._setup(stores, parts, keys, cache_dir, cache_limit, verify, ahead, download_threads, cache_shared)

    def part_stats(self) -> list[dict[str, int | float]]:
        """Per part (dataset): its downloads, bytes, seconds spent downloading [s] (a float), and its store's requests and
        retries (the counts: ints)."""
        out = []
        for part, counts in zip(self.parts, self._stores.per_store):
            row = dict(counts)
            store = part.store.stats()
            row["requests"], row["retries"] = int(store.get("requests", 0)), int(store.get("retries", 0))
            out.append(row)
        return out

    def __repr__(self) -> str:
        return f"MixedShards({[p.url for p in self.parts]}, shards={len(self.entries)}, cache_dir={str(self.cache_dir)!r}, cache_limit={self.limit})"


class MixedReader(StoreReader):
    """The shards of several datasets read as one dataset (see :mod:`stoker.dataset.mixed`); made by :func:`open_mixed`.

    The arguments and attributes are :class:`~stoker.dataset._store_reader.StoreReader`'s (``remote``: the datasets'
    :class:`MixedShards`); the heads its manifests record are read later (``lazy_heads``, as for one dataset in a
    store): the open reads each dataset's manifest and its first shard's head.
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
        super().__init__(names, where, files, remote, custom_fields, bounded, max_gap, lazy_heads=True)

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
        cache_dir: the cache folder the URLs share (default: :func:`stoker.remote.default_cache_dir`).
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
    urls = [s for s in sources if is_url(s)]
    if not urls:
        given = [k for k, v in (("storage_options", any(storage_options or [])), ("cache_dir", cache_dir),
                                ("cache_limit", cache_limit), ("download_ahead", ahead), ("cache_shared", cache_shared)) if v]  # fmt: skip
        if given:
            raise ValueError(f"{', '.join(given)} are for datasets in object storage (a URL such as s3://bucket/train/); no stream is one")
    check_limit_arg(cache_limit)
    options = list(storage_options) if storage_options is not None else [None] * len(sources)
    said = (
        said_if_slow(f"downloading the manifests and first heads of {[printable_url(u) for u in urls]} (a mix)")
        if urls
        else contextlib.nullcontext()
    )
    with said:
        return _open_all(sources, names, options, custom_fields, bounded, cache_dir, cache_limit, verify, ahead, cache_shared)


def _manifests(sources: Sequence[Any], options: Sequence[Mapping[str, Any] | None]) -> dict[int, RemoteManifest]:
    """The manifest of every dataset in object storage (by its place in ``sources``), all read at once; the first
    failure in the order of ``sources`` is raised."""
    remote = [i for i, s in enumerate(sources) if is_url(s)]
    stores = [open_store(sources[i] if sources[i].endswith("/") else sources[i] + "/", options[i]) for i in remote]  # (no request)
    if len(remote) <= 1:
        return {i: RemoteManifest(sources[i], store=store) for i, store in zip(remote, stores)}
    with ThreadPoolExecutor(len(remote), thread_name_prefix="stoker-manifests", initializer=block_interrupts) as pool:
        return dict(zip(remote, pool.map(lambda i, store: RemoteManifest(sources[i], store=store), remote, stores)))


def _open_all(
    sources: Sequence[Any],
    names: Sequence[str],
    options: Sequence[Mapping[str, Any] | None],
    custom_fields: Mapping[str, type[Field]] | None,
    bounded: bool,
    cache_dir: str | os.PathLike[str] | None,
    cache_limit: int | None,
    verify: bool,
    ahead: int | None,
    cache_shared: bool,
) -> MixedReader:
    """:func:`open_mixed`'s work: the manifests (read at once), the local files, the shared cache, the reader."""
    for source, opts in zip(sources, options):
        if opts and not is_url(source):
            raise ValueError(f"storage_options are for a dataset in object storage (a URL); got the local {source!r}")
    manifests = _manifests(sources, options)
    files: list[list[Path] | None] = []
    parts: list[RemoteManifest] = []
    where: list[Any] = []
    for i, source in enumerate(sources):
        if i in manifests:
            part = manifests[i]
            parts.append(part)
            files.append(None)
            where.append(part.url)
        else:
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
