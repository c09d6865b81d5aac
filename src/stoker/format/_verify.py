"""Data-region checksums, checked as samples are first read: every byte once per process.

A stoker file stores a CRC-32 per ``data_block_size`` block of its data region
(columns and heap, see ``docs/FORMAT.md``). :class:`DataCheck` checks, for a
batch of sample indices, every data block the samples' loaded fields touch that
has not been checked yet in this process, and marks it checked in a bitmap:

* the bitmap (``uint8`` per block) and a count of the CRCs computed are kept
  per dataset identity (every file's path, device, inode, size, mtime, header
  and checksum-table CRCs) for the life of the process, so several readers of
  the same unchanged dataset (a training and an evaluation Loader) share them;
* which blocks a sample touches: a column field's item by arithmetic
  (``column_offset + i * itemsize``), heap fields by a table of each sample's
  first and last block, computed vectorially from the metadata once (or per
  batch while the metadata is validated lazily);
* :func:`check_samples` is compiled (``nogil``) so that a compiled producer
  loop calls it for each batch before the batch's decoders read any data; the
  CRC-32 itself is python-isal's SIMD one (called by name from compiled code),
  or a table-driven one where python-isal has no wheel. Once a block is marked,
  a sample costs a few loads and compares;
* until the kernel is compiled in the process or in a disk cache (a fresh
  install's first batches: it took seconds to compile), :meth:`DataCheck.check`
  runs :func:`check_samples_numpy` instead, numpy and zlib, with the kernel's
  verdict, marks and errors; the kernel compiles with the producer loop (in its
  child process) and is used once it is cached.

Layout of the dataset seen by the kernel (one ``Reader``: one shard at base 0;
a ``ShardedReader``: shard ``k`` at ``bases[k]`` of one storage): global
block ``g`` of shard ``k`` is block ``g - block_base[k]`` of that shard.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numba
import numpy as np
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from stoker import _numba_cache
from stoker.errors import DatasetFormatError
from stoker.format import spec

_numba_cache.register()  # before its cache=True kernels: their compiled code is kept in stoker's private folder only

_HAVE_ISAL = importlib.util.find_spec("isal") is not None
_LOADED = False
_LOAD_LOCK = threading.Lock()


def _crc_table() -> np.ndarray:
    """Slice-by-8 tables of the reflected CRC-32 polynomial 0xEDB88320 (zlib's)."""
    t = np.zeros((8, 256), dtype=np.uint32)
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0xEDB88320 if c & 1 else c >> 1
        t[0, n] = c
    for n in range(256):
        c = int(t[0, n])
        for k in range(1, 8):
            c = int(t[0, c & 0xFF]) ^ (c >> 8)
            t[k, n] = c
    return t


_TABLE = _crc_table()


@numba.njit(nogil=True, cache=True)
def crc32_table(data: np.ndarray, start: int, stop: int) -> np.uint32:
    """zlib's CRC-32 of ``data[start:stop]`` (a ``uint8`` array), slice-by-8 in compiled code (about 1.2 GB/s)."""
    table = _TABLE
    c = np.uint32(0xFFFFFFFF)
    i = start
    while i + 8 <= stop:
        lo = c ^ (np.uint32(data[i]) | (np.uint32(data[i + 1]) << 8) | (np.uint32(data[i + 2]) << 16) | (np.uint32(data[i + 3]) << 24))
        c = (
            table[7, lo & 0xFF]
            ^ table[6, (lo >> 8) & 0xFF]
            ^ table[5, (lo >> 16) & 0xFF]
            ^ table[4, lo >> 24]
            ^ table[3, data[i + 4]]
            ^ table[2, data[i + 5]]
            ^ table[1, data[i + 6]]
            ^ table[0, data[i + 7]]
        )
        i += 8
    while i < stop:
        c = table[0, (c ^ data[i]) & 0xFF] ^ (c >> 8)
        i += 1
    return c ^ np.uint32(0xFFFFFFFF)


@intrinsic
def _isal_crc32(typingctx: Any, crc: Any, address: Any, length: Any) -> Any:
    """isa-l's ``crc32_gzip_refl(crc, buf, len)`` (zlib's CRC-32), by name: python-isal's module must be loaded first."""
    sig = types.uint32(types.uint32, types.int64, types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i32, i64 = cgutils.ir.IntType(32), cgutils.ir.IntType(64)
        fnty = cgutils.ir.FunctionType(i32, [i32, cgutils.voidptr_t, i64])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "crc32_gzip_refl")
        return builder.call(fn, [args[0], builder.inttoptr(args[1], cgutils.voidptr_t), args[2]])

    return sig, codegen


@numba.njit(nogil=True, cache=True)
def crc32_isal(data: np.ndarray, start: int, stop: int) -> np.uint32:
    """zlib's CRC-32 of ``data[start:stop]`` by python-isal's SIMD code (about 20 GB/s); call :func:`kernel` first."""
    if stop <= start:
        return np.uint32(0)
    return _isal_crc32(np.uint32(0), data.ctypes.data + start, stop - start)  # type: ignore[call-arg]


# the CRC the kernel calls: chosen once per installation (the kernel is cached on disk with it)
_crc = crc32_isal if _HAVE_ISAL else crc32_table


@numba.njit(nogil=True, cache=True)
def _ensure(g0: int, g1: int, block_base: np.ndarray, data_start: np.ndarray, data_end: np.ndarray, block_size: np.ndarray,
            crcs: np.ndarray, verified: np.ndarray, counts: np.ndarray, storage: np.ndarray, compute: bool) -> int:  # fmt: skip
    for g in range(g0, g1 + 1):
        if verified[g] != 0:
            continue
        if not compute:
            return g
        k = np.searchsorted(block_base, g, side="right") - 1
        start = data_start[k] + (g - block_base[k]) * block_size[k]
        stop = min(start + block_size[k], data_end[k])
        counts[0] += 1
        if _crc(storage, start, stop) != crcs[g]:
            return g
        verified[g] = 1
    return -1


@numba.njit(nogil=True, cache=True)
def check_samples(idx: np.ndarray, by_position: bool, shard_starts: np.ndarray, col_base: np.ndarray, col_size: np.ndarray,
                  heap_blocks: np.ndarray, block_base: np.ndarray, data_start: np.ndarray, data_end: np.ndarray,
                  block_size: np.ndarray, crcs: np.ndarray, verified: np.ndarray, counts: np.ndarray, storage: np.ndarray,
                  compute: bool) -> int:  # fmt: skip
    """Check the data blocks samples ``idx`` touch that are not marked in ``verified``; mark those that match.

    Args:
        idx: global sample indices.
        by_position: ``heap_blocks`` has a row per entry of ``idx`` (else per sample of the dataset).
        shard_starts: ``(K + 1,)`` global index of each shard's first sample, then the total.
        col_base: ``(C, K)`` where each column field's column starts in ``storage``, per shard.
        col_size: ``(C,)`` bytes per item of each column field.
        heap_blocks: ``(rows, 2)`` first and last global block of each sample's heap values (``-1``: none).
        block_base: ``(K + 1,)`` global number of each shard's first data block, then the total.
        data_start, data_end, block_size: ``(K,)`` each shard's data region in ``storage`` and its block size.
        crcs: ``(G,)`` the stored CRC-32 of every data block; ``verified``: ``(G,)`` 1 where checked.
        counts: ``counts[0]`` counts the CRCs computed.
        storage: the bytes.
        compute: ``False``: compute nothing, return the first unchecked block.

    Returns:
        -1 when every block is checked and matched; else the first block whose
        CRC does not match (or, without ``compute``, the first unchecked one).
    """
    n_cols = col_size.shape[0]
    k = 0
    for s in range(idx.shape[0]):
        i = idx[s]
        if shard_starts.shape[0] > 2:
            k = np.searchsorted(shard_starts, i, side="right") - 1
        j = i - shard_starts[k]
        for c in range(n_cols):
            size = col_size[c]
            if size == 0:
                continue
            lo = col_base[c, k] + j * size - data_start[k]
            g0 = block_base[k] + lo // block_size[k]
            g1 = block_base[k] + (lo + size - 1) // block_size[k]
            if verified[g0] == 0 or verified[g1] == 0 or g1 > g0 + 1:
                g = _ensure(g0, g1, block_base, data_start, data_end, block_size, crcs, verified, counts, storage, compute)
                if g >= 0:
                    return g
        if heap_blocks.shape[0] > 0:
            r = s if by_position else i
            g0 = heap_blocks[r, 0]
            if g0 >= 0:
                g1 = heap_blocks[r, 1]
                if verified[g0] == 0 or verified[g1] == 0 or g1 > g0 + 1:
                    g = _ensure(g0, g1, block_base, data_start, data_end, block_size, crcs, verified, counts, storage, compute)
                    if g >= 0:
                        return g
    return -1


#: seconds between two questions to the disk cache whether :func:`check_samples` is in it yet (see DataCheck.check)
_PROBE_EVERY = 0.5
#: always call the kernel (compiling it first if needed), never :func:`check_samples_numpy` (tests)
_FORCE_KERNEL = False


def check_samples_numpy(idx: np.ndarray, by_position: bool, shard_starts: np.ndarray, col_base: np.ndarray,
                        col_size: np.ndarray, heap_blocks: np.ndarray, block_base: np.ndarray, data_start: np.ndarray,
                        data_end: np.ndarray, block_size: np.ndarray, crcs: np.ndarray, verified: np.ndarray,
                        counts: np.ndarray, storage: np.ndarray, compute: bool) -> int:  # fmt: skip
    """:func:`check_samples` in numpy and Python (zlib's CRC): the same verdict, the same blocks marked, the same block
    returned, and nothing to compile: what the first batches of a process whose kernel is in no cache yet run.

    The blocks the samples touch are listed in the kernel's order (sample by sample, the column fields, then the heap
    values), and the unchecked ones are checked in the order of their first appearance, as the kernel does.
    """
    idx = np.asarray(idx, dtype=np.int64)
    n = idx.shape[0]
    if n == 0:
        return -1
    k = np.searchsorted(shard_starts, idx, side="right") - 1 if shard_starts.shape[0] > 2 else np.zeros(n, dtype=np.int64)
    j = idx - shard_starts[k]
    base, start, size_of_block = block_base[k], data_start[k], block_size[k]
    first: list[np.ndarray] = []  # (n,) per column field then the heap: each sample's first and last block, -1: none
    last: list[np.ndarray] = []
    for c in range(col_size.shape[0]):
        size = int(col_size[c])
        if size == 0:
            continue
        lo = col_base[c][k] + j * size - start
        first.append(base + lo // size_of_block)
        last.append(base + (lo + size - 1) // size_of_block)
    if heap_blocks.shape[0] > 0:
        rows = heap_blocks[np.arange(n) if by_position else idx].astype(np.int64)
        first.append(rows[:, 0])
        last.append(rows[:, 1])
    if not first:
        return -1
    g0 = np.stack(first, axis=1).ravel()  # (the kernel's order: sample by sample, its ranges in turn)
    g1 = np.stack(last, axis=1).ravel()
    keep = g0 >= 0
    g0, g1 = g0[keep], g1[keep]
    keep = (verified[g0] == 0) | (verified[g1] == 0) | (g1 > g0 + 1)  # (the kernel's test: most ranges, once checked)
    g0, g1 = g0[keep], g1[keep]
    lengths = g1 - g0 + 1
    offsets = np.repeat(np.cumsum(lengths) - lengths, lengths)
    blocks = np.repeat(g0, lengths) + (np.arange(int(lengths.sum()), dtype=np.int64) - offsets)
    blocks = blocks[verified[blocks] == 0]
    if blocks.shape[0] == 0:
        return -1
    _, at = np.unique(blocks, return_index=True)
    for g in blocks[np.sort(at)].tolist():
        if verified[g] != 0:
            continue
        if not compute:
            return int(g)
        s = int(np.searchsorted(block_base, g, side="right") - 1)
        lo = int(data_start[s]) + (g - int(block_base[s])) * int(block_size[s])
        hi = min(lo + int(block_size[s]), int(data_end[s]))
        counts[0] += 1
        if spec.crc32(storage[lo:hi]) != int(crcs[g]):
            return int(g)
        verified[g] = 1
    return -1


def kernel_state(argtypes: tuple[Any, ...]) -> str:
    """``"ready"`` (compiled in this process), ``"cached"`` (in its disk cache, or among the prebuilt kernels) or
    ``"missing"``: whether calling :func:`check_samples` with arguments of ``argtypes`` would compile it.

    Reads the caches' indexes only. A cache this Numba cannot be asked about counts as ``"cached"`` (the kernel is
    then called, as before this question existed).
    """
    fn: Any = check_samples
    if argtypes in fn.overloads:
        return "ready"
    cache: Any = getattr(fn, "_cache", None)
    try:
        from numba.core.caching import NullCache

        if cache is None or isinstance(cache, NullCache):
            return "missing"
        sig, magic, hashes = cache._index_key(argtypes, fn.targetctx.codegen())
        if (sig, magic, hashes) in cache._cache_file._load_index():
            return "cached"
        in_prebuilt = getattr(cache, "in_prebuilt", None)  # (stoker.pipeline.prebuilt's layer: its shipped entries)
        if in_prebuilt is not None and in_prebuilt(argtypes, fn.targetctx.codegen()):
            return "cached"
        return "missing"
    except Exception:  # another Numba's internals: no way to tell
        return "cached"


def kernel() -> Any:
    """:func:`check_samples`, ready to call or to compile into other code (loads python-isal's CRC for compiled code once)."""
    global _LOADED
    if _HAVE_ISAL and not _LOADED:
        with _LOAD_LOCK:
            if not _LOADED:
                import isal.isal_zlib
                import llvmlite.binding

                llvmlite.binding.load_library_permanently(isal.isal_zlib.__file__)
                _LOADED = True
    return check_samples


def prepare_kernels() -> None:
    """What compiling this module's kernels in a new process needs first: python-isal's CRC loaded (:func:`kernel`)."""
    kernel()


class _Marks:
    """What the process knows of one dataset's data blocks: checked (1) or not, the CRCs computed, and (for shards
    whose data is read from other files than their own: a cache) which file each shard's marks are about."""

    def __init__(self, n_blocks: int) -> None:
        self.verified = np.zeros(max(n_blocks, 1), dtype=np.uint8)
        self.counts = np.zeros(1, dtype=np.int64)
        self.files: dict[int, object] = {}
        self.lock = threading.Lock()


_MARKS: dict[tuple[str, ...], _Marks] = {}
_MARKS_LOCK = threading.Lock()


def _marks(key: tuple[str, ...], n_blocks: int) -> _Marks:
    with _MARKS_LOCK:
        marks = _MARKS.get(key)
        if marks is None or len(marks.verified) != max(n_blocks, 1):
            marks = _MARKS[key] = _Marks(n_blocks)
        return marks


def env_enabled() -> bool:
    """Whether ``STOKER_VERIFY`` leaves the check on (anything but ``0``)."""
    return os.environ.get("STOKER_VERIFY", "1") != "0"


class DataCheck:
    """The data-block check of one dataset (a ``Reader`` or a ``ShardedReader``) for some of its fields.

    Args:
        reader: the dataset.
        fields: the names of the fields whose data is read (fields stored in
            the metadata have none).
        source: where shard ``k``'s data is read from instead of its file (a
            cache of downloaded shards): an object with ``fd(k)``, a
            descriptor to read blocks from, and ``name(k)``, how errors name
            it. Each shard's marks then hold for one file: see :meth:`bind`.

    Example:
        >>> check = DataCheck(reader, ["image", "label"])  # doctest: +SKIP
        >>> check.check(np.arange(512))  # raises DatasetFormatError on a damaged block  # doctest: +SKIP
    """

    def __init__(self, reader: Any, fields: Sequence[str], source: Any = None) -> None:
        self.reader = reader
        self.source = source
        shards = list(getattr(reader, "shards", [reader]))
        self.shards = shards
        bases = np.asarray(getattr(reader, "bases", [0]), dtype=np.int64)[: len(shards)]
        counts = [len(s._data_crcs) for s in shards]
        self.shard_starts = np.asarray(getattr(reader, "shard_starts", [0, reader.num_samples]), dtype=np.int64)
        self.block_base = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        self.data_start = np.array([b + s.data_offset for b, s in zip(bases.tolist(), shards)], dtype=np.int64)
        self.data_end = self.data_start + np.array([s.data_size for s in shards], dtype=np.int64)
        self.block_size = np.array([s.data_block_size for s in shards], dtype=np.int64)
        self.crcs = np.concatenate([s._data_crcs for s in shards] + [np.zeros(0, "<u4")]).astype(np.uint32)
        self.n_blocks = int(self.block_base[-1])
        cols = [n for n in fields if reader.fields[n].storage == "column"]
        self.heap = [n for n in fields if reader.fields[n].storage == "heap"]
        self.col_base = np.array([[b + s._columns[n] for b, s in zip(bases.tolist(), shards)] for n in cols], dtype=np.int64).reshape(
            len(cols), len(shards)
        )
        self.col_size = np.array([reader.fields[n].column_itemsize for n in cols], dtype=np.int64)
        self.cols = cols
        marks = _marks(tuple(s._record_key() for s in shards), self.n_blocks)
        self._marks = marks
        self.verified, self.counts = marks.verified, marks.counts
        self._heap_table: np.ndarray | None = None
        self._shard_blocks: dict[int, np.ndarray] = {}  # shard -> the global blocks its loaded fields' values lie in
        self._lock = threading.Lock()
        self._ready: set[tuple[Any, ...]] = set()  # argument kinds the kernel is compiled or cached for (see check())
        self._probed: dict[tuple[Any, ...], float] = {}

    def bind(self, k: int, file: object, checked: bool = False) -> None:
        """Shard ``k``'s data is now read from ``file`` (an identity: device, inode, size, mtime): if its marks were about
        another file, they are dropped (its blocks will be checked again), or all set when ``checked`` (the file was
        checked whole, e.g. when it was downloaded)."""
        marks = self._marks
        with marks.lock:
            if marks.files.get(k) == file:
                return
            marks.files[k] = file
            marks.verified[self.block_base[k] : self.block_base[k + 1]] = 1 if checked else 0

    def shard_checked(self, k: int) -> bool:
        """Whether every data block of shard ``k`` that the loaded fields' values lie in is checked (its blocks are
        found once, from the metadata): then a batch of this shard needs no check at all."""
        blocks = self._shard_blocks.get(k)
        if blocks is None:
            blocks = self._shard_blocks[k] = self._blocks_of(k)
        return bool(self.verified[blocks].all())

    def _blocks_of(self, k: int) -> np.ndarray:
        base, n = int(self.block_base[k]), int(self.block_base[k + 1] - self.block_base[k])
        lo, hi = int(self.shard_starts[k]), int(self.shard_starts[k + 1])
        covered = np.zeros(n + 1, dtype=np.int64)  # +1 at a range's first block, -1 after its last: ranges by a running sum
        bs, ds = int(self.block_size[k]), int(self.data_start[k])
        for c in range(len(self.cols)):
            size = int(self.col_size[c])
            if size and hi > lo:
                start = int(self.col_base[c, k]) - ds
                covered[start // bs] += 1
                covered[min(n, (start + (hi - lo) * size - 1) // bs + 1)] -= 1
        if self.heap and hi > lo:
            table = self.heap_blocks(np.arange(lo, hi, dtype=np.int64))
            has = table[:, 0] >= 0
            np.add.at(covered, table[has, 0] - base, 1)
            np.add.at(covered, np.minimum(n, table[has, 1] - base + 1), -1)
        return base + np.flatnonzero(np.cumsum(covered[:n]) > 0)

    @property
    def reads_data(self) -> bool:
        """Whether the fields read anything of the data region."""
        return self.n_blocks > 0 and (len(self.cols) > 0 or len(self.heap) > 0)

    def all_verified(self) -> bool:
        """Whether every data block has been checked in this process."""
        return not self.reads_data or bool(self.verified[: self.n_blocks].all())

    def heap_blocks(self, indices: np.ndarray | None = None) -> np.ndarray:
        """``(n, 2)`` first and last global data block of samples ``indices``' heap values (all samples: ``None``); -1: none.

        Reads ``ptr`` and ``size`` of the heap fields from the metadata (heap
        pointers in storage coordinates); blocks are clipped to the sample's
        shard (pointers outside the heap are refused by the metadata validation).
        """
        rows = self.reader.num_samples if indices is None else len(indices)
        dtype = np.int32 if self.n_blocks < 2**31 - 1 else np.int64
        out = np.full((rows if self.heap else 0, 2), -1, dtype=dtype)
        if not self.heap:
            return out
        meta = self.reader.metadata
        step = 1 << 20
        for lo in range(0, rows, step):
            hi = min(rows, lo + step)
            sel = np.arange(lo, hi) if indices is None else np.asarray(indices[lo:hi], dtype=np.int64)
            k = np.searchsorted(self.shard_starts, sel, side="right") - 1
            start = np.full(hi - lo, np.iinfo(np.int64).max, dtype=np.int64)
            end = np.full(hi - lo, -1, dtype=np.int64)
            for name in self.heap:
                ptr = meta[f"{name}/ptr"][sel].astype(np.int64)
                size = meta[f"{name}/size"][sel].astype(np.int64)
                has = size > 0
                start = np.where(has, np.minimum(start, ptr), start)
                end = np.where(has, np.maximum(end, ptr + size - 1), end)
            has = end >= 0
            base, ds, bs = self.block_base[k], self.data_start[k], self.block_size[k]
            last = self.block_base[k + 1] - 1
            g0 = np.clip(base + (np.where(has, start, ds) - ds) // bs, base, last)
            g1 = np.clip(base + (np.where(has, end, ds) - ds) // bs, base, last)
            out[lo:hi, 0] = np.where(has, g0, -1)
            out[lo:hi, 1] = np.where(has, g1, -1)
        return out

    def table(self) -> np.ndarray:
        """Every sample's heap blocks (:meth:`heap_blocks`), computed once; needs the validated metadata."""
        with self._lock:
            if self._heap_table is None:
                self._heap_table = self.heap_blocks()
            return self._heap_table

    def kernel_args(self) -> tuple[Any, ...]:
        """The arguments of :func:`check_samples` after ``idx`` and ``by_position`` and before ``compute``, all samples' table."""
        return (
            self.shard_starts, self.col_base, self.col_size, self.table(), self.block_base, self.data_start, self.data_end,
            self.block_size, self.crcs, self.verified, self.counts, self._storage(),
        )  # fmt: skip

    def _storage(self) -> np.ndarray:
        """The dataset's bytes as the kernel always sees them: a read-only ``uint8`` array (one compiled type)."""
        storage = self.reader.storage.view(np.ndarray)
        if storage.flags.writeable:
            storage = storage.view()
            storage.flags.writeable = False
        return storage

    def check(self, indices: np.ndarray | Sequence[int], lazy: bool = False, bounded: bool = False) -> None:
        """Check every data block samples ``indices`` touch, once per process (see :func:`check_samples`).

        Args:
            indices: global sample indices.
            lazy: the metadata is validated per batch: compute these samples' heap
                blocks from it now rather than the whole table's.
            bounded: the storage holds only acquired pages: read unchecked
                blocks from the files instead.

        Raises:
            DatasetFormatError: a block's CRC does not match (see :meth:`error`).
        """
        if not self.reads_data:
            return
        idx = np.ascontiguousarray(indices, dtype=np.int64)
        fn = kernel()
        by_position = lazy or bounded
        heap = self.heap_blocks(idx) if by_position else self.table()
        storage = _no_storage() if bounded else self._storage()
        args = (self.shard_starts, self.col_base, self.col_size, heap, self.block_base, self.data_start, self.data_end,
                self.block_size, self.crcs, self.verified, self.counts, storage)  # fmt: skip
        if not self._kernel_ready(idx, by_position, args, bounded):
            fn = check_samples_numpy  # (the kernel is compiled in no cache yet: the first batches wait for no compiler)
        while True:
            g = fn(idx, by_position, *args, not bounded)
            if g < 0:
                return
            if not bounded or not self._read_block_ok(g):
                raise self.error(g, idx)

    def _kernel_ready(self, idx: np.ndarray, by_position: bool, args: tuple[Any, ...], bounded: bool) -> bool:
        """Whether :func:`check_samples` is compiled for these arguments in this process or in a disk cache (asked at most
        every :data:`_PROBE_EVERY` seconds, then remembered): until then :meth:`check` runs :func:`check_samples_numpy`."""
        heap = args[3]
        key = (by_position, bounded, heap.dtype.str, heap.ndim, bool(heap.flags.c_contiguous), bool(args[-1].flags.c_contiguous))
        if key in self._ready:
            return True
        now = time.monotonic()
        if not _FORCE_KERNEL and now - self._probed.get(key, -1e9) < _PROBE_EVERY:
            return False
        self._probed[key] = now
        ready = _FORCE_KERNEL or kernel_state(tuple(numba.typeof(a) for a in (idx, by_position, *args, not bounded))) != "missing"
        if ready:
            self._ready.add(key)
        return ready

    def blocks_in(self, k: int, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """The global data blocks of shard ``k`` that the byte ranges ``[starts[i], ends[i])`` of the storage overlap
        (sorted, each once): e.g. the whole pages a page cache reads, whose ends may hold a neighbouring block's bytes."""
        ds, de, bs, base = int(self.data_start[k]), int(self.data_end[k]), int(self.block_size[k]), int(self.block_base[k])
        s = np.maximum(np.asarray(starts, dtype=np.int64), ds)
        e = np.minimum(np.asarray(ends, dtype=np.int64), de)
        keep = e > s
        if not keep.any():
            return np.zeros(0, dtype=np.int64)
        first, last = (s[keep] - ds) // bs, (e[keep] - 1 - ds) // bs
        covered = np.zeros(int(self.block_base[k + 1]) - base + 1, dtype=np.int64)
        np.add.at(covered, first, 1)
        np.add.at(covered, last + 1, -1)
        return base + np.flatnonzero(np.cumsum(covered[:-1]) > 0)

    def check_blocks(self, blocks: np.ndarray, indices: np.ndarray | Sequence[int], bounded: bool = True) -> None:
        """Check global data blocks ``blocks`` not checked yet (read from their files when ``bounded``), once per process.

        Raises:
            DatasetFormatError: a block's CRC does not match (see :meth:`error`; ``indices``: the batch's samples).
        """
        for g in np.asarray(blocks, dtype=np.int64)[self.verified[blocks] == 0].tolist():
            if bounded:
                ok = self._read_block_ok(g)
            else:
                k = int(np.searchsorted(self.block_base, g, side="right") - 1)
                start = int(self.data_start[k]) + (g - int(self.block_base[k])) * int(self.block_size[k])
                stop = min(start + int(self.block_size[k]), int(self.data_end[k]))
                self.counts[0] += 1
                ok = spec.crc32(self._storage()[start:stop]) == int(self.crcs[g])
                if ok:
                    self.verified[g] = 1
            if not ok:
                raise self.error(g, indices)

    def _read_block_ok(self, g: int) -> bool:
        """Read block ``g`` from its file and check its CRC; mark it when it matches."""
        k = int(np.searchsorted(self.block_base, g, side="right") - 1)
        shard = self.shards[k]
        local = g - int(self.block_base[k])
        start = shard.data_offset + local * shard.data_block_size
        length = min(shard.data_block_size, shard.data_offset + shard.data_size - start)
        if self.source is not None:  # (a descriptor its owner keeps open while the shard is read)
            data = os.pread(self.source.fd(k), length, start)
        else:
            fd = os.open(shard.path, os.O_RDONLY)
            try:
                data = os.pread(fd, length, start)
            finally:
                os.close(fd)
        self.counts[0] += 1
        if len(data) != length or spec.crc32(data) != int(self.crcs[g]):
            return False
        self.verified[g] = 1
        return True

    def error(self, g: int, indices: np.ndarray | Sequence[int]) -> DatasetFormatError:
        """The error for corrupt block ``g`` (global), found for samples ``indices``: the file, the block, its bytes and samples."""
        k = int(np.searchsorted(self.block_base, g, side="right") - 1)
        shard = self.shards[k]
        local = g - int(self.block_base[k])
        start = shard.data_offset + local * shard.data_block_size
        end = min(start + shard.data_block_size, shard.data_offset + shard.data_size)
        first, last = self._samples_in(g, k)
        idx = np.asarray(indices, dtype=np.int64)
        who = idx[(idx >= first) & (idx <= last)] if last >= first else idx[:0]
        stored = f"samples {first}..{last}" if last >= first else "no loaded field's samples"
        found = f"; found when sample {int(who[0])} was first read" if len(who) else ""
        return DatasetFormatError(
            shard.path if self.source is None else self.source.name(k),
            f"corrupt data region: checksum mismatch in data block {local} (bytes {start}..{end} of the file), which holds "
            f"{stored} of the dataset{found}. The file is damaged: copy or convert it again "
            "(Loader(check_data=False) or STOKER_VERIFY=0 reads without this check)",
        )

    def _samples_in(self, g: int, k: int) -> tuple[int, int]:
        """The first and last global sample with loaded data in global block ``g`` (of shard ``k``); (0, -1): none."""
        lo, hi = int(self.shard_starts[k]), int(self.shard_starts[k + 1])
        j = np.arange(hi - lo, dtype=np.int64)
        touch = np.zeros(hi - lo, dtype=bool)
        bs, ds, base = int(self.block_size[k]), int(self.data_start[k]), int(self.block_base[k])
        for c in range(len(self.cols)):
            size = int(self.col_size[c])
            if size:
                off = int(self.col_base[c, k]) + j * size - ds
                touch |= (base + off // bs <= g) & (base + (off + size - 1) // bs >= g)
        if self.heap:
            heap = self.heap_blocks(np.arange(lo, hi, dtype=np.int64))
            touch |= (heap[:, 0] >= 0) & (heap[:, 0] <= g) & (heap[:, 1] >= g)
        found = np.flatnonzero(touch)
        return (lo + int(found[0]), lo + int(found[-1])) if len(found) else (0, -1)


def _no_storage() -> np.ndarray:
    """A read-only byte: the type of every storage the kernel gets (a new type would compile the kernel, and the
    producer loop that calls it, again)."""
    out = np.zeros(1, dtype=np.uint8)
    out.flags.writeable = False
    return out


def empty_args() -> tuple[Any, ...]:
    """Arguments of :func:`check_samples` (as :meth:`DataCheck.kernel_args`) that check nothing: when the check is off."""
    z64 = np.zeros(1, dtype=np.int64)
    return (
        np.zeros(2, dtype=np.int64), np.zeros((0, 1), dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros((0, 2), dtype=np.int32),
        z64, z64, z64, np.ones(1, dtype=np.int64), np.zeros(1, dtype=np.uint32), np.ones(1, dtype=np.uint8), np.zeros(1, dtype=np.int64),
        _no_storage(),
    )  # fmt: skip
