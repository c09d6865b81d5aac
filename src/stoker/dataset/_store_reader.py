"""The one reader of shards from stores: the shards of one or several datasets, local files or in object storage,
read as one :class:`~stoker.dataset.sharded.ShardedReader`.

Every shard of every dataset is laid end to end::

    global index:  0 .......... n_0 - 1 | n_0 ......... n_0 + n_1 - 1 | ...
    dataset:       dataset 0's samples   | dataset 1's samples         | ...
    shards:        dataset 0's shards    | dataset 1's shards          | ...

A dataset in object storage is read through its shards' cache and schedule
(:class:`StoreShards`: a :class:`~stoker.dataset._remote.RemoteShards` of one
dataset, or a :class:`~stoker.dataset.mixed.MixedShards` of a mix's): its
shards' heads hold the metadata, and the data comes, through the bounded page
cache, from the downloaded shards and the local files (:class:`_PageSource`).
With ``verify``, every data block a batch reads is checked before use, once per
process: a local file's as for any local file, a cached shard's per block
unless this process downloaded and checked it whole (:meth:`StoreReader.check_data`).

:class:`~stoker.dataset._remote.RemoteReader` is this reader over one dataset in
a store; :class:`~stoker.dataset.mixed.MixedReader` over a mix's datasets.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from stoker.dataset import _vstore
from stoker.dataset.sharded import ShardedReader
from stoker.errors import DatasetFormatError
from stoker.fields import Field
from stoker.format._verify import DataCheck
from stoker.format.reader import Reader

__all__ = ["StoreReader", "StoreShards", "check_fields"]


class StoreShards(Protocol):
    """What the reader needs of the shards of its datasets in object storage (their cache and schedule: see
    :class:`stoker.dataset._remote.RemoteShards`): shard ``k`` is their ``k``-th, ``part_sizes`` their number per dataset."""

    part_sizes: list[int]

    def open_heads(self, custom_fields: Mapping[str, type[Field]] | None = None) -> tuple[list[Path], list[Reader]]: ...

    def schedule(self, shard_of_sample: np.ndarray, batch_size: int, skip: int = 0) -> None: ...

    def local(self, shards: Iterable[int]) -> bool: ...

    def begin(self, k: int) -> None: ...

    def check(self, k: int, check: DataCheck, indices: np.ndarray, at: int | None = None) -> None: ...

    def done(self, k: int) -> None: ...

    def fd(self, k: int) -> int: ...

    def shard_url(self, k: int) -> str: ...

    def cached_path(self, k: int) -> Path: ...

    def read_sample(self, k: int, local: int, custom_fields: Mapping[str, type[Field]] | None) -> tuple[Any, ...]: ...

    def downloads_stopped(self) -> contextlib.AbstractContextManager[None]: ...

    def close(self) -> None: ...


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


class _PageSource:
    """Where the page cache and the data check read shard ``k``'s bytes: a downloaded shard (object storage; the
    reader's ``paths[k]`` is its head), or the local file (a descriptor opened with the reader, closed with it)."""

    def __init__(self, remote: StoreShards, remote_shard: np.ndarray, paths: Sequence[Path]) -> None:
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


class StoreReader(ShardedReader):
    """The shards of one or several datasets, local files or in object storage, read as one dataset (see
    :mod:`stoker.dataset._store_reader`): what :class:`~stoker.dataset._remote.RemoteReader` and
    :class:`~stoker.dataset.mixed.MixedReader` are.

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
        remote: the shared cache and schedule of the datasets in object storage (:class:`StoreShards`), or ``None``.
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
        remote: StoreShards | None,
        custom_fields: Mapping[str, type[Field]] | None,
        bounded: bool,
        max_gap: int = 8,
    ) -> None:
        self.stream_names = list(names)
        self.remote: StoreShards | None = remote
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
        remote_sizes = iter(remote.part_sizes if remote is not None else [])
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
        source = _PageSource(remote, self.remote_shard, self.paths)
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
        if isinstance(source, _PageSource):
            source.close()
        super().close()
