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

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import sys
import traceback
import zlib
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from stoker.errors import SampleError
from stoker.fields import Field, FloatField, IntField, NDArrayField
from stoker.fields.base import unfit_mask
from stoker.format import spec
from stoker.format._durable import create_temporary, replace_durably, sigterm_unwinds
from stoker.format.reader import field_table_bytes, metadata_dtype

#: chunks handed to each worker process and not yet written: results that come back before an
#: earlier chunk's wait in memory, so this bounds the writer's memory to a few chunks per worker
IN_FLIGHT_PER_WORKER = 2

_Chunk = tuple[int, np.ndarray, dict[str, bytes], bytes]
_Task = tuple[int, np.ndarray]


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when the writer process dies."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):  # an exotic libc: no parent-death signal
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _worker_main(conn: Connection, dataset: Any, fields: dict[str, Field]) -> None:
    """A writer worker process: encode each task received on ``conn``, send back ``(ok, chunk or exception)``."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's handler (fork copies it): terminate() ends the worker
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        try:
            result: tuple[bool, Any] = (True, (task[0], *encode_chunk(dataset, fields, task[1])))
        except Exception as exc:
            if not isinstance(exc, SampleError):  # a bug, say in a custom field: keep where it happened
                exc.add_note("in a writer worker process:\n" + "".join(traceback.format_exception(exc)))
            result = (False, exc)
        try:
            conn.send(result)
        except Exception as exc:  # an exception that does not pickle
            conn.send((False, RuntimeError(f"a writer worker failed with {type(result[1]).__name__}: {result[1]} ({exc})")))


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
                rows[f"{name}/ptr"][j] = heap_pos
                rows[f"{name}/size"][j] = len(payload)
                heap.append(payload)
                heap_pos += len(payload)
    return rows, {k: bytes(v) for k, v in cols.items()}, b"".join(heap)


class _Arrays:
    """Adapter: a dict of equally long arrays as an indexed dataset."""

    def __init__(self, arrays: list[Any]) -> None:
        self.arrays = arrays

    def __len__(self) -> int:
        return len(self.arrays[0])

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        return tuple(a[i] for a in self.arrays)


class _Workers:
    """Worker processes that encode chunks, each with a pipe of its own.

    No lock is shared between processes, so terminating the workers at any
    moment cannot block the writer (``multiprocessing.Pool.terminate`` can
    hang when a worker dies holding its result queue's lock). Each worker
    encodes its tasks in the order received; :meth:`ordered` hands every
    worker at most ``IN_FLIGHT_PER_WORKER`` chunks that are not yet consumed.
    """

    def __init__(self, num_workers: int, dataset: Any, fields: dict[str, Field]) -> None:
        ctx: Any = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        try:
            for _ in range(num_workers):
                parent_end, child_end = ctx.Pipe()
                proc = ctx.Process(target=_worker_main, args=(child_end, dataset, fields), daemon=True, name="stoker-writer")
                proc.start()
                child_end.close()  # the worker holds it: recv() raises EOFError if the worker dies
                self.procs.append(proc)
                self.conns.append(parent_end)
        except BaseException:
            self.close()
            raise

    def ordered(self, tasks: Iterable[_Task]) -> Iterator[_Chunk]:
        """Encode ``tasks`` and yield the results in the order of ``tasks``."""
        todo = iter(tasks)
        load = [0] * len(self.procs)
        pending: deque[int] = deque()  # the worker of each chunk submitted and not yet yielded, in order

        def submit() -> None:
            task = next(todo, None)
            if task is not None:
                worker = min(range(len(load)), key=load.__getitem__)
                try:
                    self.conns[worker].send(task)
                except OSError:
                    raise self._died(worker) from None
                load[worker] += 1
                pending.append(worker)

        for _ in range(IN_FLIGHT_PER_WORKER * len(self.procs)):
            submit()
        while pending:
            worker = pending.popleft()
            try:
                ok, value = self.conns[worker].recv()
            except (EOFError, OSError):  # OSError: ECONNRESET when it died with a task unread
                raise self._died(worker) from None
            load[worker] -= 1
            if not ok:
                raise value
            yield value
            submit()  # after the consumer is done with the chunk: at most IN_FLIGHT_PER_WORKER per worker exist

    def _died(self, worker: int) -> ChildProcessError:
        proc = self.procs[worker]
        proc.join(1.0)
        return ChildProcessError(f"a writer worker process (pid {proc.pid}) died with exit code {proc.exitcode}; nothing was written")

    def close(self) -> None:
        """End the workers (SIGTERM, then SIGKILL after 5 s) and close the pipes."""
        for proc in self.procs:
            if proc.exitcode is None:
                proc.terminate()
        for proc in self.procs:
            proc.join(5.0)
            if proc.exitcode is None:  # pragma: no cover - a worker stuck in uninterruptible I/O
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()


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
        tasks = [(pos, idx[pos : pos + chunksize]) for pos in range(0, len(idx), chunksize)]
        self._write(len(idx), lambda: self._encoded(dataset, tasks))

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
        missing, extra = set(self.fields) - set(arrays), set(arrays) - set(self.fields)
        if missing or extra:
            raise ValueError(
                f"arrays must have exactly the fields' names {list(self.fields)}; missing {sorted(missing)}, unexpected {sorted(extra)}"
            )
        lengths = {name: len(arrays[name]) for name in self.fields}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"every array must have the same length; got {lengths}")
        ordered = [arrays[name] for name in self.fields]
        if not all(type(f) in (IntField, FloatField, NDArrayField) for f in self.fields.values()):
            self.from_indexed_dataset(_Arrays(ordered), chunksize=max(1, chunksize // 16))
            return
        n = next(iter(lengths.values()))
        self._write(n, lambda: self._vectorised(ordered, n, chunksize))

    # ---- encoding sources ------------------------------------------------------------------
    def _encoded(self, dataset: Any, tasks: list[tuple[int, np.ndarray]]) -> Generator[_Chunk, None, None]:
        if self.num_workers <= 1 or len(tasks) <= 1:
            for pos, chunk in tasks:
                yield (pos, *encode_chunk(dataset, self.fields, chunk))
            return
        workers = _Workers(min(self.num_workers, len(tasks)), dataset, self.fields)
        try:
            yield from workers.ordered(tasks)
        finally:
            workers.close()

    def _vectorised(self, arrays: list[Any], n: int, chunksize: int) -> Generator[_Chunk, None, None]:
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

    def _write(self, n: int, chunks: Callable[[], Generator[_Chunk, None, None]]) -> None:
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

    def _fill(self, fd: int, n: int, source: Iterator[_Chunk]) -> None:
        """Write the encoded chunks at their offsets, then the field table, checksums and header."""
        from tqdm.auto import tqdm

        meta_off, data_off, columns, heap_off, table = self._layout(n)
        row_size = metadata_dtype(self.fields).itemsize
        heap_fields = [name for name, f in self.fields.items() if f.storage == "heap"]
        heap_end = heap_off
        disable = None if self.progress is None else not self.progress
        with tqdm(total=n, unit="samples", desc=f"writing {self.path.name}", disable=disable) as bar:
            for pos, rows, cols, heap in source:
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
