"""Several stoker files ("shards") with the same fields, read as one dataset.

:func:`open_dataset` names a dataset by a file, a folder (read through its
manifest, see :mod:`stoker.dataset.shards`), a glob pattern or a list of files.
It returns a :class:`~stoker.format.reader.Reader` for a single file and a
:class:`ShardedReader` otherwise (or when ``bounded=True``). Both map (or
open) every file when they are made, inside :func:`~stoker.dataset.shards.open_files`:
a write that replaces the folder's dataset afterwards deletes files that
stay readable to them, and one that commits while they open is retried, so a
reader holds the dataset it opened, old or new, never a mix.

A :class:`ShardedReader` has the reading API of a ``Reader`` over one virtual
file: global sample ``i`` is sample ``i - shard_starts[k]`` of shard ``k``;
``storage`` is one ``uint8`` array in which shard ``k`` starts at ``bases[k]``
(page-aligned); ``metadata`` is the shards' metadata tables concatenated in
memory, with every heap pointer moved by its shard's base. Column fields are
not contiguous across shards: :meth:`ShardedReader.column_offsets` gives each
shard's column inside ``storage``.

With ``bounded=True``, ``storage`` is a :class:`~stoker.dataset._vstore.PageCache`
instead of a memory map: nothing of the data is resident until
:meth:`ShardedReader.acquire` reads a batch's bytes, and
:meth:`ShardedReader.release` frees them (the loader's ``os_cache=False``).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from stoker.dataset import _vstore
from stoker.dataset.shards import open_files
from stoker.errors import DatasetFormatError
from stoker.fields import Field
from stoker.format.reader import Reader

__all__ = ["ShardedReader", "open_dataset"]

Source = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


def open_dataset(
    source: Source, custom_fields: Mapping[str, type[Field]] | None = None, *, bounded: bool = False, **remote: Any
) -> Reader | ShardedReader:
    """Open a dataset named by a file, a folder of shards, a glob pattern, a list of files or a URL.

    Args:
        source: what :func:`~stoker.dataset.shards.resolve_dataset` accepts, or
            the URL of a dataset folder in object storage (``s3://``, ``gs://``,
            ``az://``, ``https://``): see :func:`stoker.dataset._remote.open_remote`.
        custom_fields: field name -> Field class (as for ``Reader``).
        bounded: read the data through a bounded cache (:class:`ShardedReader`
            with ``bounded=True``), even for a single file (a URL always is).
        remote: for a URL: ``storage_options``, ``cache_dir``, ``cache_limit``,
            ``verify``, ``ahead`` (refused for a local dataset).

    Returns:
        A ``Reader`` for a single file without ``bounded``; a ``ShardedReader`` otherwise.

    Raises:
        DatasetFormatError: a missing, corrupt or mismatched file (names it).
        RemoteError: a URL whose store or manifest cannot be read.
    """
    from stoker.remote._store import is_url

    if is_url(source):
        from stoker.dataset._remote import open_remote

        return open_remote(source, custom_fields, **remote)
    given = sorted(k for k, v in remote.items() if v is not None)
    if given:
        raise ValueError(
            f"{', '.join(given)} are for a dataset in object storage (a URL such as s3://bucket/train/); got the local {source!r}"
        )
    if not bounded:

        def one_file(paths: list[Path]) -> Reader | None:
            if len(paths) != 1:
                return None
            reader = Reader(paths[0], custom_fields=custom_fields)
            _ = reader.storage  # mapped now: the file stays readable if a write replaces the dataset
            return reader

        reader = open_files(source, one_file)
        if reader is not None:
            return reader
    return ShardedReader(source, custom_fields=custom_fields, bounded=bounded)


class ShardedReader:
    """Shards read as one dataset, with the reading API of :class:`~stoker.format.reader.Reader`.

    Args:
        source: a folder (its manifest's shards; a folder without one is
            refused), a glob pattern, or a list of files, in order.
        custom_fields: field name -> Field class, for fields of unknown types.
        bounded: keep the data in a bounded cache (:meth:`acquire` /
            :meth:`release`) instead of memory-mapping the files.
        max_gap: with ``bounded``, needed pages at most this many pages apart
            are read in one call.

    Raises:
        DatasetFormatError: a shard is missing or corrupt, or its fields differ
            from the first shard's (names both and the fields); a folder
            without a manifest.

    Example:
        >>> reader = ShardedReader("data/")  # doctest: +SKIP
        >>> len(reader), reader.num_shards  # doctest: +SKIP
        (30000, 3)
    """

    def __init__(
        self,
        source: Source,
        custom_fields: Mapping[str, type[Field]] | None = None,
        *,
        bounded: bool = False,
        max_gap: int = 8,
    ) -> None:
        self.bounded = bool(bounded)
        self.paths, self.shards, self.cache, mapped = open_files(
            source, lambda paths: self._open(paths, custom_fields, self.bounded, max_gap)
        )
        self._setup(Path(os.fspath(source)) if isinstance(source, (str, os.PathLike)) else self.paths[0], mapped)

    def _setup(self, path: Any, mapped: np.ndarray | None) -> None:
        """What the opened shards give: fields, sample counts, layout (``path``: how errors name the dataset)."""
        self.path = path
        first = self.shards[0]
        self.fields: dict[str, Field] = dict(first.fields)
        self.row_dtype = first.row_dtype
        self.metadata_row_size = first.metadata_row_size
        counts = [len(s) for s in self.shards]
        #: global index of each shard's first sample, then the total
        self.shard_starts = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        self.num_samples = int(self.shard_starts[-1])
        self.file_size = sum(s.file_size for s in self.shards)
        sizes = [s.file_size for s in self.shards]
        self.bases = self.cache.bases if self.cache is not None else _vstore.layout(sizes)[0]
        if mapped is not None and self.cache is None:
            self.__dict__["storage"] = mapped  # the cached property, mapped already
        self._metadata_valid = False

    @staticmethod
    def _open(
        paths: list[Path], custom_fields: Mapping[str, type[Field]] | None, bounded: bool, max_gap: int
    ) -> tuple[list[Path], list[Reader], _vstore.PageCache | None, np.ndarray | None]:
        """Open and map every shard now (so that a write replacing the dataset later cannot take a file away).

        One shard: its ``Reader``'s memory map. Several: one mapping of all
        of them (``_vstore.map_files``, no descriptor kept per file), whose
        parts become the shards' ``storage``. ``bounded``: the page cache too
        (a descriptor per file).
        """
        shards = [Reader(p, custom_fields=custom_fields) for p in paths]
        ShardedReader._same_fields(shards)
        first = shards[0]
        sizes = [s.file_size for s in shards]
        mapped = None
        if len(shards) == 1:
            _ = first.storage
        else:
            mapped, bases = _vstore.map_files(paths, sizes)
            for shard, base, size in zip(shards, bases.tolist(), sizes):
                shard.__dict__["storage"] = mapped[base : base + size]  # Reader.storage, a cached property: this part
        cache = _vstore.PageCache(paths, sizes, max_gap=max_gap) if bounded else None
        return paths, shards, cache, mapped

    @staticmethod
    def _same_fields(shards: Sequence[Reader]) -> None:
        """Refuse shards whose fields differ from the first shard's (names both)."""
        first = shards[0]
        for shard in shards[1:]:
            if list(shard.fields.items()) != list(first.fields.items()):
                raise DatasetFormatError(
                    shard.path,
                    f"shard has other fields than the first shard {first.path}: {shard.fields} vs {first.fields} "
                    "(every shard of a dataset must be written with the same fields, in the same order)",
                )

    # ---- shape -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.num_samples

    @property
    def num_shards(self) -> int:
        """The number of shard files."""
        return len(self.shards)

    def locate(self, indices: np.ndarray | Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The shard of each global sample index, and its index inside that shard."""
        idx = np.asarray(indices, dtype=np.int64)
        shard = np.searchsorted(self.shard_starts, idx, side="right") - 1
        return shard, idx - self.shard_starts[shard]

    # ---- storage -----------------------------------------------------------------------------
    @cached_property
    def storage(self) -> np.ndarray:
        """Every shard at its base in one read-only ``uint8`` array (memory-mapped, or the bounded cache)."""
        if self.cache is not None:
            return self.cache.storage
        if self.num_shards == 1:
            return self.shards[0].storage.view(np.ndarray)
        return _vstore.map_files(self.paths, [s.file_size for s in self.shards])[0]  # after close(): mapped again

    @cached_property
    def metadata(self) -> np.ndarray:
        """One row per sample; heap pointers are offsets in :attr:`storage`.

        One shard: its memory-mapped table. Several: the tables concatenated
        in memory (``num_samples * metadata_row_size`` bytes), each shard
        validated first.
        """
        if self.num_shards == 1:
            return self.shards[0].metadata
        self.validate_metadata()
        parts = []
        heap_columns = [f"{name}/ptr" for name, f in self.fields.items() if f.storage == "heap"]
        for shard, base in zip(self.shards, self.bases.tolist()):
            part = np.array(shard.metadata)
            for col in heap_columns:
                part[col] += np.uint64(base)
            parts.append(part)
            if self.cache is not None:
                shard.close()  # the rows are copied, the data is read through the cache: drop the file's mapping
        return np.concatenate(parts) if parts else np.zeros(0, dtype=self.row_dtype)

    def column(self, name: str) -> np.ndarray:
        """The dense ``(num_samples, *shape)`` column of a fixed-size field (one shard only).

        Raises:
            DatasetFormatError: with several shards, whose columns are not
                contiguous; use :meth:`column_offsets`, or each shard's
                ``shards[k].column(name)``.
        """
        field = self.fields[name]
        if self.num_shards > 1:
            raise DatasetFormatError(
                self.path,
                f"field {name!r} is stored in {self.num_shards} shards, whose columns are not one array: read "
                f"reader.shards[k].column({name!r}) per shard, or use reader.column_offsets({name!r}) with reader.storage",
            )
        offset = self.shards[0]._columns[name]
        raw = self.storage[offset : offset + self.num_samples * field.column_itemsize]
        return raw.view(field.dtype).reshape((self.num_samples, *field.shape))  # type: ignore[attr-defined,arg-type]

    def column_offsets(self, name: str) -> np.ndarray:
        """Where each shard's column of field ``name`` starts in :attr:`storage` [bytes], int64."""
        return np.array([int(b) + s._columns[name] for s, b in zip(self.shards, self.bases)], dtype=np.int64)

    # ---- validation ---------------------------------------------------------------------------
    def validate_metadata(self, lazy: bool = False) -> None:
        """Validate every shard's metadata (see :meth:`Reader.validate_metadata`).

        ``lazy`` is honoured for a single shard; several shards are validated
        in full, since their tables are copied.
        """
        if self._metadata_valid:
            return
        if self.num_shards == 1:
            self.shards[0].validate_metadata(lazy=lazy)
            return
        for shard in self.shards:
            shard.validate_metadata()
        self._metadata_valid = True

    def validate_samples(self, indices: np.ndarray | Sequence[int]) -> None:
        """Validate the metadata that samples ``indices`` use (see :meth:`Reader.validate_samples`)."""
        if self.num_shards == 1:
            self.shards[0].validate_samples(indices)
        else:
            self.validate_metadata()

    def verify(self) -> None:
        """Check every checksum of every shard (reads every file)."""
        for shard in self.shards:
            shard.verify()

    # ---- reading --------------------------------------------------------------------------------
    def read(self, index: int) -> tuple[Any, ...]:
        """Decode sample ``index`` in Python (from its shard's file)."""
        if not -self.num_samples <= index < self.num_samples:
            raise IndexError(f"sample index {index} out of range for {self.num_samples} samples")
        shard, local = self.locate([index % self.num_samples])
        return self.shards[int(shard[0])].read(int(local[0]))

    def sample_extents(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The byte ranges ``[start, end)`` of :attr:`storage` that samples ``indices`` occupy (metadata rows included)."""
        idx = np.asarray(indices, dtype=np.int64)
        shard, local = self.locate(idx)
        starts, ends = [], []
        for k in np.unique(shard).tolist():
            s, e = self.shards[k].sample_extents(local[shard == k])
            starts.append(s + np.uint64(self.bases[k]))
            ends.append(e + np.uint64(self.bases[k]))
        if not starts:
            return np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.uint64)
        return np.concatenate(starts), np.concatenate(ends)

    def data_extents(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ranges of :attr:`storage` holding samples ``indices``' column items and heap values (int64)."""
        idx = np.asarray(indices, dtype=np.int64)
        shard, local = self.locate(idx)
        starts, ends = [], []
        meta = self.metadata
        for name, field in self.fields.items():
            if field.storage == "column":
                size = field.column_itemsize
                s = self.column_offsets(name)[shard] + local * size
                starts.append(s)
                ends.append(s + size)
            elif field.storage == "heap":
                rows = meta[idx]
                s = rows[f"{name}/ptr"].astype(np.int64)
                starts.append(s)
                ends.append(s + rows[f"{name}/size"].astype(np.int64))
        if not starts:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return np.concatenate(starts), np.concatenate(ends)

    def local(self, indices: np.ndarray) -> bool:
        """Whether :meth:`acquire` of samples ``indices`` would not wait for a download (shards on a local disk: always)."""
        return True

    def acquire(self, indices: np.ndarray) -> list[int]:
        """``bounded``: read what samples ``indices`` store into the cache; returns a ticket for :meth:`release`.

        Call after :meth:`validate_samples` of these samples.

        Raises:
            DatasetFormatError: a shard cannot be read or became shorter.
        """
        if self.cache is None:
            return []
        return self.cache.acquire(*self.data_extents(indices))

    def release(self, ticket: list[int]) -> None:
        """``bounded``: free the cached pages of :meth:`acquire` that no running batch needs.

        With one shard, whose metadata is read through the file's memory map,
        this process's mapping of the metadata table is dropped too (the
        page cache keeps it; the next read maps it again).
        """
        if self.cache is None:
            return
        self.cache.release(ticket)
        if self.num_shards == 1:
            shard = self.shards[0]
            mm = getattr(shard.storage, "_mmap", None)
            if mm is not None and hasattr(mm, "madvise"):
                lo = shard.metadata_offset // mmap.PAGESIZE * mmap.PAGESIZE
                hi = min(len(mm), _vstore.align_up(shard.metadata_offset + shard.num_samples * shard.metadata_row_size))
                if hi > lo:
                    mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def cache_bound(self, batch_size: int, batches: int = 3) -> int:
        """The most bytes the bounded cache can hold while ``batches`` batches of ``batch_size`` samples run [bytes].

        Each sample's value of each column or heap field spans at most
        ``ceil(largest value / page) + 1`` pages, and coalescing may add up to
        ``max_gap`` pages before it; the loader runs at most 3 batches at once
        (one per producer thread, and one your loop's thread makes while it
        waits for a batch no producer has started). The pages kept for later batches
        (``cache.keep_bytes``) come on top. Reads the heap fields' sizes once.
        """
        page = _vstore.PAGE
        gap = self.cache.max_gap if self.cache is not None else 0
        per_sample = 0
        for name, field in self.fields.items():
            if field.storage == "column":
                largest = field.column_itemsize
            elif field.storage == "heap":
                sizes = self.metadata[f"{name}/size"]
                largest = int(sizes.max()) if len(sizes) else 0
            else:
                continue
            per_sample += (-(-largest // page) + 1 + gap) * page
        return int(batches) * int(batch_size) * per_sample + (self.cache.keep_bytes if self.cache is not None else 0)

    def window_bytes(self, samples: int) -> int:
        """About the bytes that ``samples`` consecutive samples span in the data region [bytes].

        The mean data bytes per sample times ``samples``, plus two pages per
        column and heap field: what a ``QUASI_RANDOM`` window of that many
        samples reads.
        """
        data = sum(s.data_size for s in self.shards)
        stores = sum(f.storage in ("column", "heap") for f in self.fields.values())
        mean = data / max(self.num_samples, 1)
        return _vstore.align_up(int(mean * samples) + 2 * stores * _vstore.PAGE)

    def keep_for_window(self, samples: int) -> int:
        """The pages worth keeping for ``QUASI_RANDOM`` windows of ``samples`` samples [bytes].

        When a sample takes less than a page on average, the batches of a
        window share pages: keeping :meth:`window_bytes` saves reading them
        again and again. Larger samples share (almost) no page: 0.
        """
        data = sum(s.data_size for s in self.shards)
        return self.window_bytes(samples) if data < _vstore.PAGE * max(self.num_samples, 1) else 0

    def field_sizes(self) -> dict[str, int]:
        """Bytes stored per field, summed over the shards."""
        total: dict[str, int] = dict.fromkeys(self.fields, 0)
        for shard in self.shards:
            for name, n in shard.field_sizes().items():
                total[name] += n
        return total

    def close(self) -> None:
        """Drop the shards' memory maps and this reader's arrays (arrays already handed out stay valid)."""
        for shard in self.shards:
            shard.close()
        self.__dict__.pop("metadata", None)
        self.__dict__.pop("storage", None)

    def __enter__(self) -> ShardedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = ", bounded" if self.bounded else ""
        return f"ShardedReader({str(self.path)!r}, shards={self.num_shards}, samples={self.num_samples}{mode}, fields={self.fields})"
