"""Write stoker files: :class:`DatasetWriter`.

The writer encodes samples in parallel processes, writes them to a temporary
file next to the destination, computes the checksums, fsyncs and renames. The
destination only ever holds a complete file: an error, Ctrl-C or SIGKILL
leaves nothing there.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import sys
import traceback
import uuid
import zlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stoker.errors import SampleError
from stoker.fields import Field
from stoker.format import spec
from stoker.format.reader import field_table_bytes, metadata_dtype

_TMP_MARK = ".stoker-tmp-"

# Worker-process globals, set by _init_worker (fork inherits them, spawn pickles them).
_WORKER: dict[str, Any] = {}


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when the writer process dies."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):  # an exotic libc: no parent-death signal
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _init_worker(dataset: Any, fields: dict[str, Field]) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    _WORKER["dataset"] = dataset
    _WORKER["fields"] = fields


def _sample_values(sample: Any, index: int, names: list[str]) -> Sequence[Any]:
    if len(names) == 1 and not (isinstance(sample, tuple) and len(sample) == 1):
        return (sample,)  # a bare value (a list may be the value itself: JSON, ragged)
    if not isinstance(sample, (tuple, list)):
        raise SampleError(index, None, f"expected a tuple of {len(names)} values ({', '.join(names)}); got {type(sample).__name__}")
    if len(sample) != len(names):
        raise SampleError(index, None, f"expected a tuple of {len(names)} values ({', '.join(names)}); got {len(sample)} values")
    return sample


def encode_chunk(dataset: Any, fields: dict[str, Field], indices: np.ndarray) -> tuple[np.ndarray, dict[str, bytes], bytes]:
    """Encode the samples ``dataset[i] for i in indices``.

    Returns:
        ``(rows, columns, heap)``: metadata rows whose heap pointers are
        relative to the start of ``heap``, each column's bytes, and the heap
        bytes of the chunk.

    Raises:
        SampleError: naming the sample index, the field and the problem.
    """
    names = list(fields)
    n = len(indices)
    rows = np.zeros(n, dtype=metadata_dtype(fields))
    cols = {name: bytearray(n * f.column_itemsize) for name, f in fields.items() if f.storage == "column"}
    heap: list[bytes] = []
    heap_pos = 0
    for j, index in enumerate(indices.tolist()):
        try:
            sample = dataset[index]
        except Exception as exc:
            err = SampleError(index, None, f"dataset[{index}] raised {type(exc).__name__}: {exc}")
            err.add_note("".join(traceback.format_exception(exc)))
            raise err from exc
        values = _sample_values(sample, index, names)
        for (name, field), value in zip(fields.items(), values):
            try:
                meta, payload = field.encode(value, index)
            except (TypeError, ValueError) as exc:
                raise SampleError(index, name, str(exc)) from exc
            for sub, v in meta.items():
                rows[f"{name}/{sub}"][j] = v
            if field.storage == "column":
                size = field.column_itemsize
                if payload is None or len(payload) != size:  # a bytearray slice would silently resize
                    got = "no payload" if payload is None else f"{len(payload)} bytes"
                    raise SampleError(index, name, f"{type(field).__name__}.encode returned {got}; the column needs {size} bytes")
                cols[name][j * size : (j + 1) * size] = payload
            elif field.storage == "heap":
                assert payload is not None  # noqa: S101 - heap fields always return a payload
                rows[f"{name}/ptr"][j] = heap_pos
                rows[f"{name}/size"][j] = len(payload)
                heap.append(payload)
                heap_pos += len(payload)
    return rows, {k: bytes(v) for k, v in cols.items()}, b"".join(heap)


def _encode_in_worker(task: tuple[int, np.ndarray]) -> tuple[int, np.ndarray, dict[str, bytes], bytes]:
    pos, indices = task
    return (pos, *encode_chunk(_WORKER["dataset"], _WORKER["fields"], indices))


class _Arrays:
    """Adapter: a dict of equally long arrays as an indexed dataset."""

    def __init__(self, arrays: list[Any]) -> None:
        self.arrays = arrays

    def __len__(self) -> int:
        return len(self.arrays[0])

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        return tuple(a[i] for a in self.arrays)


def _clean_stale_temporaries(path: Path) -> None:
    """Remove temporaries of earlier writers to ``path`` whose process is gone."""
    for tmp in path.parent.glob(f".{path.name}{_TMP_MARK}*"):
        try:
            pid = int(tmp.name.rsplit(_TMP_MARK, 1)[1].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except (ValueError, PermissionError, OSError):
            continue


class DatasetWriter:
    """Write a stoker dataset file.

    Args:
        fname: destination path. Written only when complete (temporary file,
            fsync, atomic rename).
        fields: field name -> :class:`~stoker.fields.Field`, in the order of
            the dataset's tuples.
        num_workers: encoding processes; ``-1`` for one per CPU, ``0``/``1``
            to encode in this process.
        progress: show a progress bar; ``None`` shows it only on a terminal.

    Example:
        >>> from stoker.fields import NDArrayField, IntField
        >>> writer = DatasetWriter("data.stoker", {  # doctest: +SKIP
        ...     "x": NDArrayField(shape=(93,), dtype=np.dtype("float32")),
        ...     "y": IntField()}, num_workers=2)
        >>> writer.from_indexed_dataset(dataset)  # doctest: +SKIP
    """

    def __init__(
        self,
        fname: str | os.PathLike[str],
        fields: Mapping[str, Field],
        num_workers: int = -1,
        progress: bool | None = None,
        page_size: int | None = None,
    ) -> None:
        if not fields:
            raise ValueError("fields must name at least one field; got an empty mapping")
        for name, field in fields.items():
            if not isinstance(name, str) or not name or "/" in name or len(name) > 255:
                raise ValueError(f"field names must be non-empty strings of at most 255 characters without '/'; got {name!r}")
            if not isinstance(field, Field):
                raise TypeError(f"field {name!r} must be a stoker Field instance; got {type(field).__name__}")
        if num_workers == -1:
            num_workers = os.cpu_count() or 1
        if num_workers < 0:
            raise ValueError(f"num_workers must be -1 (one per CPU) or >= 0; got {num_workers}")
        self.path = Path(fname)
        self.fields: dict[str, Field] = dict(fields)
        self.num_workers = num_workers
        self.progress = progress
        # page_size is accepted for FFCV compatibility: stoker has no pages, any sample size works.
        self.page_size = page_size

    # ---- public entry points -------------------------------------------------------------
    def from_indexed_dataset(
        self,
        dataset: Any,
        indices: Sequence[int] | np.ndarray | None = None,
        chunksize: int = 100,
        shuffle_indices: bool = False,
    ) -> None:
        """Write ``dataset[i]`` for each ``i`` in ``indices`` (default: all, in order).

        Args:
            dataset: anything with ``__len__`` and ``__getitem__`` returning a
                tuple of values in field order (or a single value for one field).
            indices: which samples to write, in the order to write them.
            chunksize: samples per task sent to a worker.
            shuffle_indices: write the samples in a random order (FFCV's option).

        Raises:
            SampleError: a sample failed; names its index, the field and what
                was expected. Nothing is left at the destination.
        """
        if chunksize < 1:
            raise ValueError(f"chunksize must be >= 1; got {chunksize}")
        idx = np.arange(len(dataset), dtype=np.int64) if indices is None else np.asarray(indices, dtype=np.int64).reshape(-1)
        if shuffle_indices:
            idx = np.random.default_rng().permutation(idx)
        if len(idx) and (idx.min() < 0 or idx.max() >= len(dataset)):
            bad = int(idx[(idx < 0) | (idx >= len(dataset))][0])
            raise IndexError(f"indices must lie in [0, {len(dataset)}); got {bad}")
        tasks = [(pos, idx[pos : pos + chunksize]) for pos in range(0, len(idx), chunksize)]
        self._write(len(idx), lambda: self._encoded(dataset, tasks))

    def from_arrays(self, arrays: Mapping[str, Any], chunksize: int = 4096) -> None:
        """Write samples given as arrays, one per field, sample ``i`` being ``arrays[name][i]``.

        Fixed-size fields (int, float, ndarray) are written with vectorised
        copies; others are encoded per sample in parallel.

        Raises:
            ValueError: missing or extra names, or arrays of different lengths.
            SampleError: a value has the wrong shape or dtype (names the index).
        """
        missing, extra = set(self.fields) - set(arrays), set(arrays) - set(self.fields)
        if missing or extra:
            raise ValueError(
                f"arrays must have exactly the fields' names {list(self.fields)}; missing {sorted(missing)}, unexpected {sorted(extra)}"
            )
        lengths = {name: len(arrays[name]) for name in self.fields}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"every array must have the same length; got {lengths}")
        ordered = [arrays[name] for name in self.fields]
        if any(f.storage == "heap" for f in self.fields.values()):
            self.from_indexed_dataset(_Arrays(ordered), chunksize=max(1, chunksize // 16))
            return
        n = next(iter(lengths.values()))
        self._write(n, lambda: self._vectorised(ordered, n, chunksize))

    # ---- encoding sources ------------------------------------------------------------------
    def _encoded(self, dataset: Any, tasks: list[tuple[int, np.ndarray]]) -> Iterator[tuple[int, np.ndarray, dict[str, bytes], bytes]]:
        if self.num_workers <= 1 or len(tasks) <= 1:
            for pos, chunk in tasks:
                yield (pos, *encode_chunk(dataset, self.fields, chunk))
            return
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        ctx = mp.get_context(method)
        with ctx.Pool(self.num_workers, initializer=_init_worker, initargs=(dataset, self.fields)) as pool:
            yield from pool.imap(_encode_in_worker, tasks)

    def _vectorised(self, arrays: list[Any], n: int, chunksize: int) -> Iterator[tuple[int, np.ndarray, dict[str, bytes], bytes]]:
        dtype = metadata_dtype(self.fields)
        for pos in range(0, n, chunksize):
            stop = min(n, pos + chunksize)
            rows = np.zeros(stop - pos, dtype=dtype)
            cols: dict[str, bytes] = {}
            for (name, field), array in zip(self.fields.items(), arrays):
                chunk = np.asarray(array[pos:stop])
                if field.storage == "meta":
                    kind = "iub" if field.TYPE_NAME == "int" else "iuf"
                    if chunk.ndim != 1 or chunk.dtype.kind not in kind:
                        raise SampleError(
                            pos,
                            name,
                            f"expected a 1-D array of {'integers' if kind == 'iub' else 'real numbers'}; got dtype {chunk.dtype}, shape {chunk.shape}",
                        )
                    rows[f"{name}/value"] = chunk
                else:
                    shape, fdtype = field.shape, field.dtype  # type: ignore[attr-defined]
                    if chunk.shape[1:] != shape:
                        raise SampleError(pos, name, f"expected an array of shape {shape}; got shape {chunk.shape[1:]}")
                    if chunk.dtype != fdtype and not np.can_cast(chunk.dtype, fdtype, casting="same_kind"):
                        raise SampleError(pos, name, f"expected dtype {fdtype}; got {chunk.dtype}, which does not cast safely")
                    cols[name] = np.ascontiguousarray(chunk, dtype=fdtype).tobytes()
            yield pos, rows, cols, b""

    # ---- the file ---------------------------------------------------------------------------
    def _layout(self, n: int) -> tuple[int, int, dict[str, int], int, bytes]:
        columns = {name: 0 for name, f in self.fields.items() if f.storage == "column"}
        reserve = len(field_table_bytes(self.fields, columns)) + 20 * len(columns)
        meta_off = spec.align(spec.HEADER_SIZE + reserve)
        row_size = metadata_dtype(self.fields).itemsize
        data_off = spec.align(meta_off + n * row_size)
        pos = data_off
        for name in columns:
            columns[name] = pos
            pos = spec.align(pos + n * self.fields[name].column_itemsize)
        table = field_table_bytes(self.fields, columns)
        return meta_off, data_off, columns, pos, table

    def _write(self, n: int, chunks: Any) -> None:
        from tqdm.auto import tqdm

        path = self.path
        if path.is_dir():
            raise IsADirectoryError(f"{path} is a directory; give a file path for the dataset")
        if not path.parent.exists():
            raise FileNotFoundError(f"the folder {path.parent} does not exist")
        _clean_stale_temporaries(path)
        tmp = path.parent / f".{path.name}{_TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        meta_off, data_off, columns, heap_off, table = self._layout(n)
        row_size = metadata_dtype(self.fields).itemsize
        heap_fields = [name for name, f in self.fields.items() if f.storage == "heap"]
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            heap_end = heap_off
            with tqdm(
                total=n, unit="samples", desc=f"writing {path.name}", disable=None if self.progress is None else not self.progress
            ) as bar:
                for pos, rows, cols, heap in chunks():
                    for name in heap_fields:
                        rows[f"{name}/ptr"] += np.uint64(heap_end)
                    os.pwrite(fd, rows.tobytes(), meta_off + pos * row_size)
                    for name, raw in cols.items():
                        os.pwrite(fd, raw, columns[name] + pos * self.fields[name].column_itemsize)
                    if heap:
                        os.pwrite(fd, heap, heap_end)
                        heap_end += len(heap)
                    bar.update(len(rows))
            self._finish(fd, n, table, meta_off, row_size, data_off, heap_off, heap_end)
            os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(tmp, path)
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            tmp.unlink(missing_ok=True)
            raise

    def _finish(self, fd: int, n: int, table: bytes, meta_off: int, row_size: int, data_off: int, heap_off: int, heap_end: int) -> None:
        """Write the field table, checksum table and header of a fully written body."""
        data_size = heap_end - data_off
        os.ftruncate(fd, heap_end)  # materialise the sparse tail (empty heap, zero columns)
        os.pwrite(fd, table, spec.HEADER_SIZE)
        meta_size = n * row_size
        crcs = [
            self._crc_range(fd, meta_off + s, min(spec.METADATA_BLOCK_SIZE, meta_size - s))
            for s in range(0, meta_size, spec.METADATA_BLOCK_SIZE)
        ]
        crcs += [
            self._crc_range(fd, data_off + s, min(spec.DATA_BLOCK_SIZE, data_size - s)) for s in range(0, data_size, spec.DATA_BLOCK_SIZE)
        ]
        checksums = np.asarray(crcs, dtype="<u4").tobytes()
        os.pwrite(fd, checksums, heap_end)
        header = spec.pack_header(
            {
                "num_samples": n,
                "num_fields": len(self.fields),
                "file_size": heap_end + len(checksums),
                "field_table_offset": spec.HEADER_SIZE,
                "field_table_size": len(table),
                "metadata_offset": meta_off,
                "metadata_row_size": row_size,
                "data_offset": data_off,
                "data_size": data_size,
                "heap_offset": heap_off,
                "checksum_offset": heap_end,
                "metadata_block_size": spec.METADATA_BLOCK_SIZE,
                "data_block_size": spec.DATA_BLOCK_SIZE,
                "field_table_crc": spec.crc32(table),
                "checksum_table_crc": spec.crc32(checksums),
            }
        )
        os.pwrite(fd, header, 0)

    @staticmethod
    def _crc_range(fd: int, start: int, length: int) -> int:
        crc, done = 0, 0
        while done < length:
            buf = os.pread(fd, min(length - done, 8 << 20), start + done)
            if not buf:  # pragma: no cover - the file is ours and complete
                raise OSError(f"short read at {start + done}")
            crc = zlib.crc32(buf, crc)
            done += len(buf)
        return crc & 0xFFFFFFFF
