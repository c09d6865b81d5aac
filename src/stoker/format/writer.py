"""Write stoker files: :class:`DatasetWriter`.

The writer encodes samples in parallel processes, writes them to a temporary
file next to the destination, computes the checksums, fsyncs and renames. The
destination only ever holds a complete file: an error, Ctrl-C, SIGTERM or
SIGKILL leaves nothing there (after SIGKILL, a temporary that the next write
to the same destination deletes).

A value is written only if the field's dtype holds it: an int64 200 given for
an ``int8`` array, a float64 1e300 for a ``float32`` one or a uint64 2**63 for
an ``IntField`` is refused with a :class:`~stoker.errors.SampleError` naming
the sample, never stored as -56, infinity or -2**63.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stoker._progress import progress_bar
from stoker._threads import available_cpus
from stoker.errors import SampleError
from stoker.fields import Field, FloatField, IntField, NDArrayField
from stoker.fields.base import unfit_mask
from stoker.format import spec
from stoker.format._durable import create_temporary, replace_durably, sigterm_unwinds
from stoker.format._sink import WriteBehind
from stoker.format._workers import IN_FLIGHT_PER_WORKER, Chunk, Source, Workers, Written
from stoker.format.reader import field_table_bytes, metadata_dtype

__all__ = ["IN_FLIGHT_PER_WORKER", "DatasetWriter", "encode_chunk"]


def _sample_values(sample: Any, index: int, names: list[str]) -> Sequence[Any]:
    """The values of ``sample`` in field order: a tuple (or list) in that order, a dict by field name, or one bare value."""
    if isinstance(sample, Mapping) and (len(names) > 1 or set(sample) == set(names)):
        missing, extra = [n for n in names if n not in sample], [k for k in sample if k not in names]
        if missing or extra:
            raise SampleError(
                index,
                None,
                f"a dict sample needs exactly the field names as keys, {names}; missing {missing}, unexpected {[str(k) for k in extra]}",
            )
        return [sample[n] for n in names]
    if len(names) == 1 and not (isinstance(sample, tuple) and len(sample) == 1):
        return (sample,)  # a bare value (a list may be the value itself: JSON, ragged; a dict: JSON)
    if not isinstance(sample, (tuple, list)):
        raise SampleError(index, None, f"expected a tuple of {len(names)} values ({', '.join(names)}); got {type(sample).__name__}")
    if len(sample) != len(names):
        raise SampleError(index, None, f"expected a tuple of {len(names)} values ({', '.join(names)}); got {len(sample)} values")
    return sample


def encode_chunk(dataset: Any, fields: dict[str, Field], indices: np.ndarray) -> Chunk:
    """Encode the samples ``dataset[i] for i in indices``.

    Returns:
        ``(rows, columns, heap)``: metadata rows whose heap pointers are
        relative to the start of the chunk's heap, each column's bytes, and the
        heap payloads of the chunk's samples in order (written one after the
        other, never joined into one buffer).

    Raises:
        SampleError: naming the sample index, the field and the problem.
    """

    def samples() -> Iterator[tuple[int, Any]]:
        for index in indices.tolist():
            try:
                sample = dataset[index]
            except Exception as exc:
                err = SampleError(index, None, f"dataset[{index}] raised {type(exc).__name__}: {exc}")
                err.add_note("".join(traceback.format_exception(exc)))
                raise err from exc
            yield index, sample

    return encode_samples(samples(), len(indices), fields)


def encode_samples(samples: Iterable[tuple[int, Any]], count: int, fields: dict[str, Field]) -> Chunk:
    """Encode ``count`` ``(index, sample)`` pairs (``index`` names the sample in errors, and draws ``proportion``'s choice).

    A sample is a tuple of values in field order, a dict by field name, or a
    bare value when there is one field. Returns what :func:`encode_chunk` does.

    Raises:
        SampleError: naming the sample index, the field and the problem.
    """
    names = list(fields)
    rows = np.zeros(count, dtype=metadata_dtype(fields))
    cols = {name: bytearray(count * f.column_itemsize) for name, f in fields.items() if f.storage == "column"}
    heap: list[bytes] = []
    heap_pos = 0
    for j, (index, sample) in enumerate(samples):
        values = _sample_values(sample, index, names)
        for (name, field), value in zip(fields.items(), values):
            try:
                meta, payload = field.encode(value, index)
            except (TypeError, ValueError, OverflowError) as exc:
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
                if type(payload) is not bytes:  # a copy: the bytes are written later (a bytearray may change), and
                    payload = memoryview(payload).tobytes()  # counted in bytes (len() of a float32 view counts items)
                rows[f"{name}/ptr"][j] = heap_pos
                rows[f"{name}/size"][j] = len(payload)
                heap.append(payload)
                heap_pos += len(payload)
    return rows, {k: bytes(v) for k, v in cols.items()}, heap


class IndexedSource:
    """What writer workers encode for :meth:`DatasetWriter.from_indexed_dataset`: a task is an array of indices."""

    def __init__(self, dataset: Any, fields: dict[str, Field]) -> None:
        self.dataset = dataset
        self.fields = fields

    def encode(self, task: np.ndarray) -> Iterator[Chunk]:
        """One chunk: the samples ``dataset[i] for i in task``."""
        yield encode_chunk(self.dataset, self.fields, task)


class Columns:
    """Equally long columns (arrays or lists), one per field, as an indexed dataset of tuples."""

    def __init__(self, arrays: list[Any]) -> None:
        self.arrays = arrays

    def __len__(self) -> int:
        return len(self.arrays[0])

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        return tuple(a[i] for a in self.arrays)


def check_arrays(fields: Mapping[str, Field], arrays: Mapping[str, Any]) -> int:
    """The number of samples in ``arrays`` (field name -> one array per field, sample ``i`` at ``[i]``).

    Raises:
        ValueError: missing or extra names, or arrays of different lengths.
    """
    missing, extra = set(fields) - set(arrays), set(arrays) - set(fields)
    if missing or extra:
        raise ValueError(
            f"arrays must have exactly the fields' names {list(fields)}; missing {sorted(missing)}, unexpected {sorted(extra)}"
        )
    lengths = {name: len(arrays[name]) for name in fields}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"every array must have the same length; got {lengths}")
    return next(iter(lengths.values()), 0)


def _checked_chunk(name: str, field: Field, array: Any, pos: int, stop: int) -> np.ndarray:
    """``array[pos:stop]`` as one array that stores as ``field`` (an Int, Float or NDArrayField) without changing a value.

    Checks a whole chunk at once; when it fails, finds the first failing
    sample and raises the error that encoding it alone raises.

    Raises:
        SampleError: naming the first sample (index in ``array``) that is refused.
    """
    if isinstance(field, NDArrayField):
        target, shape, kinds = field.dtype, field.shape, None
        expected = f"an array of shape {(stop - pos, *shape)} that casts to {target}"
    else:
        target, shape = np.dtype("<i8") if isinstance(field, IntField) else np.dtype("<f8"), ()
        kinds = "iu" if isinstance(field, IntField) else "iuf"
        expected = f"a 1-D array of {'integers' if isinstance(field, IntField) else 'real numbers'}"
    first = pos
    try:
        chunk = np.asarray(array[pos:stop])
    except (TypeError, ValueError) as exc:  # ragged nested lists
        problem = f"expected {expected}; the values do not form one array ({exc})"
    else:
        problem = f"expected {expected}; got dtype {chunk.dtype}, shape {chunk.shape}"
        fits = chunk.dtype.kind in kinds if kinds else np.can_cast(chunk.dtype, target, casting="same_kind")
        if chunk.shape[1:] == shape and chunk.ndim == 1 + len(shape) and fits:
            mask = unfit_mask(chunk, target)
            if mask is None or not mask.any():
                return chunk
            first = pos + int(np.argmax(mask.any(axis=tuple(range(1, mask.ndim)))))
    for i in range(first, stop):  # the exact sample, with the message that encoding it alone gives
        try:
            field.encode(array[i], i)
        except (TypeError, ValueError, OverflowError) as exc:
            raise SampleError(i, name, str(exc)) from exc
    raise SampleError(first, name, problem)


class BlockCrcs:
    """CRC-32 of each ``block``-byte block of a file region starting at ``start``, from the bytes as they are written.

    :meth:`feed` takes each write (its offset and bytes). While the writes come
    one after the other from ``start``, every block's checksum is computed from
    the bytes in hand; a write anywhere else stops that, and :meth:`result`
    then reads back from the file the blocks not yet complete. Bytes of a
    region are written once, so a block completed in order stays right.
    """

    def __init__(self, start: int, block: int) -> None:
        self.start, self.block = start, block
        self.pos = start  # where the next write must start for streaming to go on
        self.crc = 0  # of the current block so far
        self.done: list[int] = []  # every complete block, in order
        self.streaming = True

    def feed(self, offset: int, data: bytes) -> None:
        """Account for ``data`` written at ``offset``."""
        if not self.streaming or not data:
            return
        if offset != self.pos:
            self.streaming = False
            return
        size = len(data)
        if size < self.block - (self.pos - self.start) % self.block:  # within the current block: the common case
            self.crc = spec.crc32(data, self.crc)
            self.pos += size
            return
        view = memoryview(data)
        while view:
            room = self.block - (self.pos - self.start) % self.block
            piece = view[:room]
            self.crc = spec.crc32(piece, self.crc)
            self.pos += len(piece)
            view = view[len(piece) :]
            if (self.pos - self.start) % self.block == 0:
                self.done.append(self.crc & 0xFFFFFFFF)
                self.crc = 0

    def result(self, fd: int, end: int) -> list[int]:
        """The checksum of every block of ``[start, end)``; the last one may be short."""
        size = end - self.start
        count = -(-size // self.block) if size > 0 else 0
        crcs = self.done[:count]
        if self.streaming and self.pos == end:
            if len(crcs) < count:  # the last, short block
                crcs.append(self.crc & 0xFFFFFFFF)
            return crcs
        for k in range(len(crcs), count):  # read back what was not streamed
            begin = self.start + k * self.block
            crcs.append(DatasetWriter._crc_range(fd, begin, min(self.block, end - begin)))
        return crcs


class DatasetWriter:
    """Write a stoker dataset file.

    Args:
        fname: destination path. Written only when complete (temporary file,
            fsync, atomic rename).
        fields: field name -> :class:`~stoker.fields.Field`, in the order of
            the dataset's tuples.
        num_workers: encoding processes; ``-1`` for one per CPU this process
            may use (its affinity set, capped by its cgroup's CPU quota), ``0``/``1``
            to encode in this process. The count chosen is the attribute ``num_workers``.
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
            problem = field.write_problem()
            if problem is not None:
                raise ValueError(f"field {name!r}: {problem}")
        if num_workers == -1:
            num_workers = available_cpus()
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
        seed: int | None = None,
    ) -> None:
        """Write ``dataset[i]`` for each ``i`` in ``indices`` (default: all, in order).

        Args:
            dataset: anything with ``__len__`` and ``__getitem__`` returning a
                tuple of values in field order (or a single value for one field).
            indices: which samples to write, in the order to write them.
            chunksize: samples per task sent to a worker.
            shuffle_indices: write the samples in a random order (FFCV's option).
            seed: the seed of that order: the same seed gives the same file;
                ``None`` (the default) draws a fresh order each time.

        Raises:
            SampleError: a sample failed; names its index, the field and what
                was expected. Nothing is left at the destination.
        """
        if chunksize < 1:
            raise ValueError(f"chunksize must be >= 1; got {chunksize}")
        idx = np.arange(len(dataset), dtype=np.int64) if indices is None else np.asarray(indices, dtype=np.int64).reshape(-1)
        if shuffle_indices:
            idx = np.random.default_rng(seed).permutation(idx)
        if len(idx) and (idx.min() < 0 or idx.max() >= len(dataset)):
            bad = int(idx[(idx < 0) | (idx >= len(dataset))][0])
            raise IndexError(f"indices must lie in [0, {len(dataset)}); got {bad}")
        tasks: list[tuple[int, Any]] = [(pos, idx[pos : pos + chunksize]) for pos in range(0, len(idx), chunksize)]
        self._write(len(idx), lambda: self._encoded(IndexedSource(dataset, self.fields), tasks))

    def from_webdataset(
        self,
        shards: Sequence[str | os.PathLike[str]] | str | os.PathLike[str],
        pipeline: Callable[[Any], Iterable[Any]] | None = None,
        *,
        keys: Mapping[str, str] | None = None,
        chunksize: int = 100,
    ) -> None:
        """Write the samples of WebDataset tar shards, shard after shard, in order (FFCV's ``from_webdataset``).

        Needs the ``webdataset`` package (``pip install 'stoker[webdataset]'``).

        Args:
            shards: the tar files, in the order to write them.
            pipeline: as in FFCV, a function from a ``webdataset.WebDataset`` of
                one shard to an iterable of samples (tuples in field order, or
                dicts by field name), like ``lambda ds: ds.decode("rgb8").to_tuple("jpg", "cls")``.
                It runs twice per shard (to count, then to write), so it must
                give the same samples each time. With worker processes started
                fresh (see :mod:`stoker.format._workers`) it must pickle: a
                function of a module, not a lambda.
            keys: instead of ``pipeline``, the WebDataset key of each field,
                ``{"image": "jpg;png", "label": "cls"}`` (``"a;b"``: the first
                present). Values go through WebDataset's basic decoders (``cls``
                to ``int``, ``json``, ``txt``, ``npy``, ...); images stay the
                files' bytes, which :class:`~stoker.fields.RGBImageField` reads
                (and stores as they are when they are JPEGs it can keep).
                Without ``pipeline`` and ``keys``, each field's key is its name.
            chunksize: samples per chunk that a worker sends back.

        Raises:
            ImportError: ``webdataset`` is not installed (says how to install it).
            ValueError: both ``pipeline`` and ``keys``, or ``keys`` that do not
                name exactly the fields.
            FileNotFoundError: a shard does not exist.
            SampleError: a sample failed or the pipeline gave other samples the
                second time; names the sample's index in the file (and the shard).
        """
        from stoker.format import _webdataset as web

        paths, pipeline = web.resolve(self.fields, shards, pipeline, keys, chunksize)
        counts = web.count_samples(paths, pipeline, threads=self.num_workers)
        firsts = np.concatenate([[0], np.cumsum(counts)]).astype(int).tolist()
        tasks: list[tuple[int, Any]] = [(firsts[i], (path, firsts[i], counts[i])) for i, path in enumerate(paths) if counts[i]]
        self._write(firsts[-1], lambda: self._encoded(web.ShardSource(pipeline, self.fields, chunksize), tasks))

    def from_arrays(self, arrays: Mapping[str, Any], chunksize: int = 4096) -> None:
        """Write samples given as arrays, one per field, sample ``i`` being ``arrays[name][i]``.

        When every field is an ``IntField``, ``FloatField`` or ``NDArrayField``
        the arrays are checked and copied a chunk at a time (vectorised);
        otherwise samples are encoded one by one, in parallel. Both accept and
        refuse the same values.

        Raises:
            ValueError: missing or extra names, or arrays of different lengths.
            SampleError: a value has the wrong shape or dtype, or does not fit
                in the field's dtype (names the index of the first such sample).
        """
        n = check_arrays(self.fields, arrays)
        ordered = [arrays[name] for name in self.fields]
        if not all(type(f) in (IntField, FloatField, NDArrayField) for f in self.fields.values()):
            self.from_indexed_dataset(Columns(ordered), chunksize=max(1, chunksize // 16))
            return
        self._write(n, lambda: self._vectorised(ordered, n, chunksize))

    # ---- encoding sources ------------------------------------------------------------------
    def _encoded(self, source: Source, tasks: list[tuple[int, Any]]) -> Generator[Written, None, None]:
        if self.num_workers <= 1 or len(tasks) <= 1:
            for pos, task in tasks:
                for rows, cols, heap in source.encode(task):
                    yield pos, rows, cols, heap
                    pos += len(rows)
            return
        workers = Workers(min(self.num_workers, len(tasks)), source)
        try:
            yield from workers.ordered(tasks)
        finally:
            workers.close()

    def _vectorised(self, arrays: list[Any], n: int, chunksize: int) -> Generator[Written, None, None]:
        dtype = metadata_dtype(self.fields)
        for pos in range(0, n, chunksize):
            stop = min(n, pos + chunksize)
            rows = np.zeros(stop - pos, dtype=dtype)
            cols: dict[str, bytes] = {}
            for (name, field), array in zip(self.fields.items(), arrays):
                chunk = _checked_chunk(name, field, array, pos, stop)
                if field.storage == "meta":
                    rows[f"{name}/value"] = chunk
                else:
                    cols[name] = np.ascontiguousarray(chunk, dtype=field.dtype).tobytes()  # type: ignore[attr-defined]
            yield pos, rows, cols, []

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

    def _write(self, n: int, chunks: Callable[[], Generator[Written, None, None]]) -> None:
        path = self.path
        if path.is_dir():
            raise IsADirectoryError(f"{path} is a directory; give a file path for the dataset")
        if not path.parent.exists():
            raise FileNotFoundError(f"the folder {path.parent} does not exist")
        with sigterm_unwinds():  # SIGTERM, like Ctrl-C, goes through the clean-up below
            tmp, fd = create_temporary(path)
            source = chunks()
            try:
                self._fill(fd, n, source)
                os.fsync(fd)
                os.close(fd)
                fd = -1
                replace_durably(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)  # first: the quickest, and what must happen even if a signal interrupts the rest
                if fd >= 0:
                    os.close(fd)
                source.close()  # stops the worker processes now, not when the traceback is freed
                raise

    def _fill(self, fd: int, n: int, source: Iterator[Written]) -> None:
        """Write the encoded chunks at their offsets, then the field table, checksums and header."""
        meta_off, data_off, columns, heap_off, table = self._layout(n)
        row_size = metadata_dtype(self.fields).itemsize
        heap_fields = [name for name, f in self.fields.items() if f.storage == "heap"]
        heap_end = heap_off
        # checksums of what is written, as it is written: no second read of the file when the writes come in order
        meta_crcs = BlockCrcs(meta_off, spec.METADATA_BLOCK_SIZE)
        data_crcs = BlockCrcs(data_off, spec.DATA_BLOCK_SIZE)
        sink = WriteBehind(fd)  # writes and flushes on its own thread while the next chunks are encoded
        try:
            with progress_bar(n, "samples", f"writing {self.path.name}", self.progress) as bar:
                for pos, rows, cols, heap in source:
                    for name in heap_fields:
                        rows[f"{name}/ptr"] += np.uint64(heap_end)
                    # checksums here, on bytes just encoded (still in cache; isal's CRC-32 is fast), writes on the sink's thread
                    raw_rows = rows.tobytes()
                    meta_crcs.feed(meta_off + pos * row_size, raw_rows)
                    sink.write(raw_rows, meta_off + pos * row_size)
                    for name, raw in cols.items():
                        offset = columns[name] + pos * self.fields[name].column_itemsize
                        data_crcs.feed(offset, raw)
                        sink.write(raw, offset)
                    if heap:  # the samples' payloads, one after the other: written as they are, never joined
                        start = heap_end
                        for piece in heap:
                            data_crcs.feed(heap_end, piece)
                            heap_end += len(piece)
                        sink.write(heap, start)
                    bar.update(len(rows))
            sink.close()
        except BaseException:
            sink.abort()  # before the caller closes fd: no write of the thread may land on a reused descriptor
            raise
        self._finish(fd, n, table, meta_off, row_size, data_off, heap_off, heap_end, (meta_crcs, data_crcs))

    def _finish(
        self,
        fd: int,
        n: int,
        table: bytes,
        meta_off: int,
        row_size: int,
        data_off: int,
        heap_off: int,
        heap_end: int,
        streamed: tuple[BlockCrcs, BlockCrcs],
    ) -> None:
        """Write the field table, checksum table and header of a fully written body."""
        data_size = heap_end - data_off
        os.ftruncate(fd, heap_end)  # materialise the sparse tail (empty heap, zero columns)
        os.pwrite(fd, table, spec.HEADER_SIZE)
        meta_crcs, data_crcs = streamed
        crcs = meta_crcs.result(fd, meta_off + n * row_size) + data_crcs.result(fd, heap_end)
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
            crc = spec.crc32(buf, crc)
            done += len(buf)
        return crc & 0xFFFFFFFF
