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

With ``lazy_heads`` (one dataset in object storage, :class:`~stoker.dataset._remote.RemoteReader`),
a shard whose manifest records its head (:mod:`stoker.dataset._head_record`)
is a :class:`~stoker.dataset._head_record.PendingHead` until its head is read:
a batch that reads it reads (or waits for) its head first
(:meth:`StoreReader.read_heads`, from :meth:`~StoreReader.validate_samples`
and :meth:`~StoreReader.acquire`), and after the first batch
:data:`BACKGROUND_HEADS` threads read the others in the order of their first
use this epoch. A head read is checked against the manifest, then its rows
replace the stand-ins of the metadata table (and its CRCs the data check's).

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
from concurrent.futures import Executor, Future
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np

from stoker._threads import DaemonPool
from stoker.dataset import _vstore
from stoker.dataset._head_record import PendingHead, check_record
from stoker.dataset.sharded import ShardedReader
from stoker.errors import DatasetFormatError, StokerError
from stoker.fields import Field
from stoker.format._verify import DataCheck
from stoker.format.reader import Reader

__all__ = ["BACKGROUND_HEADS", "StoreReader", "StoreShards", "check_fields"]

#: threads that read the heads no batch has asked for yet, after the first batch (0: only as batches need them)
BACKGROUND_HEADS = 2
#: threads that read the heads a batch needs, at once
_HEAD_THREADS = 16


class StoreShards(Protocol):
    """What the reader needs of the shards of its datasets in object storage (their cache and schedule: see
    :class:`stoker.dataset._remote.RemoteShards`): shard ``k`` is their ``k``-th, ``part_sizes`` their number per dataset."""

    part_sizes: list[int]

    def open_heads(
        self, custom_fields: Mapping[str, type[Field]] | None = None, lazy: bool = False
    ) -> tuple[list[Path], list[Reader | PendingHead]]: ...

    def head(
        self, k: int, custom_fields: Mapping[str, type[Field]] | None = None, tails: Executor | None = None
    ) -> tuple[Path, Reader]: ...

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

    def stopped(self) -> bool: ...

    def start_worker(self, target: Any, name: str) -> threading.Thread | None: ...

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
        lazy_heads: read the heads the manifest records later, as batches need them (see the module).

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
        lazy_heads: bool = False,
    ) -> None:
        self.stream_names = list(names)
        self.remote: StoreShards | None = remote
        self.bounded = bool(bounded) or remote is not None
        self._custom_fields = custom_fields
        self.data_check: DataCheck | None = None
        self._heads_lock = threading.RLock()  # a head's rows and CRCs put in place; the metadata table and data check made
        heads, head_readers = remote.open_heads(custom_fields, lazy=lazy_heads) if remote is not None else ([], [])
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
        #: the shards whose heads are not read yet (PendingHead), and what reads them
        self._pending: set[int] = {k for k, s in enumerate(self.shards) if isinstance(s, PendingHead)}
        self._head_reads: dict[int, Future[None]] = {}
        self._head_order: list[int] = sorted(self._pending)  # the order the background reads them in
        self._pools: tuple[DaemonPool, DaemonPool] | None = None
        self._feeders: list[threading.Thread] = []
        self._closing = False

    def _open_streams(
        self,
        names: Sequence[str],
        where: Sequence[Any],
        files: Sequence[Sequence[Path] | None],
        heads: list[Path],
        head_readers: list[Reader | PendingHead],
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
                self._same_fields(cast("list[Reader]", head_readers[j : j + n]))  # (a PendingHead has its dataset's fields)
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
                self.shards += cast("list[Reader]", head_readers[j : j + n])  # (PendingHeads until read: see read_heads)
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
        with self._heads_lock:  # (a head read meanwhile puts its CRCs in the check made here)
            if self.data_check is None and self.cache is not None:
                self.data_check = DataCheck(self, fields, source=self.cache.source)

    def schedule(self, order: np.ndarray, batch_size: int, skip: int = 0) -> None:
        """The coming epoch's samples (this rank's, in order): download the shards in object storage ahead, by first use
        (and read the heads not read yet in that order, after the first batch)."""
        if self.remote is None:
            return
        shard = self.locate(order)[0]
        self.remote.schedule(self.remote_shard[shard], batch_size, skip)
        if self._pending:
            coming = shard[max(0, int(skip)) * int(batch_size) :]
            used, first = np.unique(coming, return_index=True)
            by_use = used[np.argsort(first, kind="stable")].tolist()
            with self._heads_lock:
                self._head_order = [k for k in by_use if k in self._pending] + sorted(self._pending.difference(by_use))

    def local(self, indices: np.ndarray) -> bool:
        """Whether :meth:`acquire` of samples ``indices`` would not wait for a download (their shards in object storage,
        if any, all in the cache now, and their heads read)."""
        if self.remote is None:
            return True
        shard = self.locate(np.asarray(indices, dtype=np.int64))[0]
        if self._pending and not self._pending.isdisjoint(np.unique(shard).tolist()):
            return False
        remote = self.remote_shard[shard]
        return self.remote.local(np.unique(remote[remote >= 0]).tolist())

    # ---- heads read later (lazy_heads) ----------------------------------------------------------
    def heads_read(self) -> list[int]:
        """The shards whose heads are read (every shard but those a manifest's record let the open leave for later)."""
        with self._heads_lock:
            return [k for k in range(self.num_shards) if k not in self._pending]

    def read_heads(self, shards: Iterable[int] | None = None) -> None:
        """Read the heads of ``shards`` (the reader's numbering; ``None``: every shard) that are not read yet, at once, or
        wait for those being read; a head that failed is read again by the next call that needs it.

        Raises:
            DatasetFormatError: a head is corrupt or differs from the manifest (names the shard's URL).
            RemoteError: the store failed.
        """
        if not self._pending:
            return
        with self._heads_lock:
            if self._closing:
                raise StokerError(f"the reader of {self.path} is closed: its shards' heads are not read any more")
            wanted = sorted(self._pending if shards is None else self._pending.intersection(int(k) for k in shards))
            reads = []
            for k in wanted:
                read = self._head_reads.get(k)
                if read is None:
                    read = self._head_reads[k] = Future()
                    self._head_pools()[0].submit(self._read_head, k, read)
                reads.append(read)
        for read in reads:
            read.result()

    def _head_pools(self) -> tuple[DaemonPool, DaemonPool]:
        """The threads that read heads, and those that read their last bytes beside their first (made once; daemon
        threads: the end of the process does not wait for a head read in flight, its exit handler stops the store)."""
        if self._pools is None:
            self._pools = (DaemonPool(_HEAD_THREADS, "stoker-heads"), DaemonPool(_HEAD_THREADS, "stoker-head-tails"))
        return self._pools

    def _read_head(self, k: int, read: Future[None]) -> None:
        """Read shard ``k``'s head and put it in place; ``read`` says how it went (failed: forgotten, to be read again)."""
        if not read.set_running_or_notify_cancel():
            return
        try:
            self._put_head(k)
        except BaseException as exc:
            with self._heads_lock:
                if self._head_reads.get(k) is read:
                    del self._head_reads[k]
            read.set_exception(exc)
        else:
            read.set_result(None)

    def _put_head(self, k: int) -> None:
        """Read shard ``k``'s head, check it against the manifest's record, and put its rows (and CRCs) in place."""
        assert self.remote is not None  # noqa: S101 - only remote shards are pending
        j = int(self.remote_shard[k])
        where = self.remote.shard_url(j)
        with self._heads_lock:
            pending = self.shards[k]
        assert isinstance(pending, PendingHead)  # noqa: S101
        path, reader = self.remote.head(j, self._custom_fields, self._head_pools()[1])
        try:
            if list(reader.fields.items()) != list(self.fields.items()):
                raise DatasetFormatError(where, f"has other fields than the dataset's first shard: {reader.fields} vs {self.fields}")
            reader.validate_metadata()
            check_record(reader, pending.record, where)
            with self._heads_lock:
                meta = self.__dict__.get("metadata")
                if meta is not None:  # (the table is made: the head's rows replace the stand-ins)
                    part = np.array(reader.metadata)
                    for name, field in self.fields.items():
                        if field.storage == "heap":
                            part[f"{name}/ptr"] += np.uint64(self.bases[k])
                    meta[int(self.shard_starts[k]) : int(self.shard_starts[k + 1])] = part
                    reader.close()
                check = self.data_check
                if check is not None:
                    check.crcs[int(check.block_base[k]) : int(check.block_base[k + 1])] = reader._data_crcs
                    check.shards[k] = reader
                self.paths[k] = path
                self.shards[k] = reader
                self._pending.discard(k)
        except BaseException:
            reader.close()
            raise

    def _read_ahead(self) -> None:
        """A background thread: read the heads no batch has asked for, in the order of their first use."""
        failed: set[int] = set()
        remote = self.remote
        assert remote is not None  # noqa: S101 - only remote shards are pending
        while not self._closing and not remote.stopped():  # (a loader's close stops it: see ShardSchedule.start_worker)
            with self._heads_lock:
                k = next((k for k in self._head_order if k in self._pending and k not in self._head_reads and k not in failed), None)
                if k is None:
                    return
                read = self._head_reads[k] = Future()
            self._read_head(k, read)
            if read.exception() is not None:
                failed.add(k)  # (a batch that needs it reads it again, and gets the error)

    def _start_reading_ahead(self) -> None:
        """Start the background readers of the heads not read yet, unless they run (again after a loader's close)."""
        with self._heads_lock:
            if self.remote is None or self._closing or not self._pending or any(t.is_alive() for t in self._feeders):
                return
            started = (self.remote.start_worker(self._read_ahead, f"stoker-heads-ahead-{i}") for i in range(BACKGROUND_HEADS))
            self._feeders = [t for t in started if t is not None]

    @cached_property
    def metadata(self) -> np.ndarray:
        """As :attr:`ShardedReader.metadata`; a shard whose head is not read yet has its stand-in rows (see the module)."""
        with self._heads_lock:  # (in place before the lock is let go: a head read next puts its rows in it)
            table = self.__dict__["metadata"] = ShardedReader.metadata.func(self)  # type: ignore[attr-defined]
            return table

    def validate_samples(self, indices: np.ndarray | Sequence[int]) -> None:
        """Read the heads of the shards of samples ``indices`` that are not read yet, then validate as a ``ShardedReader``."""
        if self._pending:
            self.read_heads(np.unique(self.locate(indices)[0]).tolist())
        super().validate_samples(indices)

    def sample_extents(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self._pending:
            self.read_heads(np.unique(self.locate(indices)[0]).tolist())
        return super().sample_extents(indices)

    def data_extents(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self._pending:
            self.read_heads(np.unique(self.locate(indices)[0]).tolist())
        return super().data_extents(indices)

    def field_sizes(self) -> dict[str, int]:
        self.read_heads()
        return super().field_sizes()

    def verify(self) -> None:
        self.read_heads()
        super().verify()

    def acquire(self, indices: np.ndarray) -> list[int]:
        """Read what samples ``indices`` store into the page cache, their data blocks checked first (:meth:`check_data`);
        a shard in object storage is downloaded, or waited for, and pinned while its blocks are checked and its pages
        read. Returns the pages, for :meth:`release`. Times each dataset's part."""
        if self.cache is None:
            return []
        idx = np.asarray(indices, dtype=np.int64)
        shard = self.locate(idx)[0]
        if self._pending:
            self.read_heads(np.unique(shard).tolist())
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
        if self._pending and BACKGROUND_HEADS > 0:
            self._start_reading_ahead()  # (after the first batch's bytes: the other heads in the background)
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
        with self._heads_lock:
            self._closing = True
            feeders, pools = self._feeders, self._pools
        if self.remote is not None:
            self.remote.close()
        for thread in feeders:  # (each ends after the head it reads)
            thread.join()
        if pools is not None:
            for pool in pools:
                pool.shutdown(wait=True, cancel_futures=True)
        with self._heads_lock:
            for read in self._head_reads.values():  # (reads cancelled with their pool: no one waits for ever)
                if not read.done():
                    read.set_exception(StokerError(f"the reader of {self.path} was closed while a head was read"))
        source = self.cache.source if self.cache is not None else None
        if isinstance(source, _PageSource):
            source.close()
        super().close()
