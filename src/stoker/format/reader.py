"""Open, validate and read a stoker file without loading it.

Opening reads the 256-byte header, the field table and the checksum table
only, whatever the number of samples; the rest is memory-mapped.
:meth:`Reader.validate_metadata` checks the metadata table (checksums and every
heap pointer) in vectorised chunks, once per file: a success on a big table is
recorded in the cache folder (:mod:`stoker.format._validated`). For tables
above :data:`LAZY_VALIDATION_BYTES` the loader validates lazily instead:
:meth:`Reader.validate_samples` checks each checksum block the first time a
batch needs it, before compiled code touches any offset in it.
:meth:`Reader.verify` checks everything, the data region's checksums too.

A *head* (``Reader(path, head=True)``) is a file that holds everything of a
stoker file but its data region: its bytes ``[0, data_offset)`` then
``[checksum_offset, file_size)``, as the cache of a dataset in object storage
keeps them. It is opened and validated as the whole file
would be (header, field table, checksum table, metadata), without following a
link, and mapped at once; its data is read from elsewhere.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from stoker import _cache_roots
from stoker.errors import DatasetFormatError, DatasetNotFoundError
from stoker.fields import FIELD_TYPES, Field
from stoker.format import _validated, spec

_VALIDATE_ROWS = 1 << 16  # metadata rows checked per vectorised step
_JPEG_MAX_SIDE = 65535  # the largest JPEG side libjpeg decodes
#: metadata tables larger than this [bytes] are validated block by block, as batches reach them, when
#: :meth:`Reader.validate_metadata` is asked to be lazy (as the loader does)
LAZY_VALIDATION_BYTES = 64 << 20
#: a successful full validation of a metadata table at least this large [bytes] is recorded in the cache folder
RECORD_VALIDATION_BYTES = 16 << 20
#: the largest checksum block a file may declare [bytes] (stoker writes 1 MiB and 16 MiB): far above any real one, far
#: below what would overflow the 64-bit offsets compiled code computes from it
MAX_BLOCK_SIZE = 1 << 40
#: the longest field name (FORMAT.md)
MAX_NAME_LENGTH = 255


def metadata_dtype(fields: dict[str, Field]) -> np.dtype:
    """The packed structured dtype of one metadata row for these fields."""
    cols = [(f"{name}/{sub}", dt) for name, field in fields.items() for sub, dt in field.metadata_columns()]
    return np.dtype(cols) if cols else np.dtype([("_empty", "u1")])


def field_table_bytes(fields: dict[str, Field], columns: dict[str, int]) -> bytes:
    """Serialise the field table (UTF-8 JSON); ``columns`` maps names to column offsets."""
    table = [
        {"name": name, "type": f.TYPE_NAME, "args": f.to_args(), **({"column_offset": columns[name]} if name in columns else {})}
        for name, f in fields.items()
    ]
    return json.dumps({"fields": table}, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


class Reader:
    """A validated, memory-mapped view of a stoker file.

    Args:
        path: the file to open.
        custom_fields: field name -> Field class, for fields of types that
            this stoker does not know (FFCV's ``custom_fields``).
        head: ``path`` is a head (see the module): the file without its data
            region. Its metadata reads as the whole file's; :meth:`verify`,
            :meth:`read` and :meth:`column` need the data and are refused.

    Raises:
        DatasetFormatError: the file is not a stoker file, is of another format
            version, is truncated, or its header or field table is corrupt or
            points outside the file.

    Example:
        >>> reader = Reader("data.stoker")  # doctest: +SKIP
        >>> len(reader), list(reader.fields)  # doctest: +SKIP
        (61878, ['x', 'y'])
    """

    # the header's values, set by _parse_header
    version: int
    num_samples: int
    num_fields: int
    file_size: int
    field_table_offset: int
    field_table_size: int
    metadata_offset: int
    metadata_row_size: int
    data_offset: int
    data_size: int
    heap_offset: int
    checksum_offset: int
    metadata_block_size: int
    data_block_size: int
    field_table_crc: int
    checksum_table_crc: int

    def __init__(self, path: str | os.PathLike[str], custom_fields: Mapping[str, type[Field]] | None = None, *, head: bool = False) -> None:
        self.path = Path(path)
        self._custom_fields = dict(custom_fields or {})
        self.head = bool(head)
        self._head_map: np.ndarray | None = None
        try:
            # a head is in a cache: not through a link, and mapped from the descriptor that was checked
            with open(_cache_roots.open_file(self.path), "rb") if head else open(self.path, "rb") as fh:
                self._stat = os.fstat(fh.fileno())
                actual_size = self._stat.st_size
                first = fh.read(spec.HEADER_SIZE)
                self._parse_header(first, actual_size)
                fh.seek(self.field_table_offset)
                table = fh.read(self.field_table_size)
                fh.seek(self._checksums_at)
                checksums = fh.read(actual_size - self._checksums_at)
                if head:
                    self._head_map = np.memmap(fh, dtype=np.uint8, mode="r")
        except FileNotFoundError as exc:  # (a FileNotFoundError too: `except FileNotFoundError` catches it)
            raise DatasetNotFoundError(path, f"cannot be read: {exc.strerror or 'No such file or directory'}") from exc
        except IsADirectoryError as exc:
            raise DatasetFormatError(
                path,
                "cannot be read: it is a folder; a Reader opens one file (open a sharded dataset with stoker.dataset.open_dataset(path))",
            ) from exc
        except OSError as exc:
            raise DatasetFormatError(path, f"cannot be read: {exc.strerror or exc}") from exc
        self._parse_field_table(table)
        self._parse_checksums(checksums)
        self._metadata_valid = False
        self._blocks_done: np.ndarray | None = None  # lazy validation: per metadata block, checked
        self._blocks_left = 0
        self._crcs_done = np.zeros(0, dtype=bool)  # lazy validation: per metadata block, its CRC checked
        self._blocks_lock = threading.Lock()

    # ---- parsing -----------------------------------------------------------------
    def _fail(self, problem: str) -> DatasetFormatError:
        return DatasetFormatError(self.path, problem)

    def _parse_header(self, head: bytes, actual_size: int) -> None:
        if not head:
            raise self._fail("not a stoker dataset: the file is empty (0 bytes)")
        if len(head) < len(spec.MAGIC) and spec.MAGIC.startswith(head):
            raise self._fail(f"truncated: {actual_size} bytes, shorter than the {spec.HEADER_SIZE}-byte header")
        if head[: len(spec.MAGIC)] != spec.MAGIC:
            raise self._fail(f"not a stoker dataset: the file does not start with the stoker magic number ({actual_size} bytes)")
        if len(head) < spec.HEADER_SIZE:
            raise self._fail(f"truncated: {actual_size} bytes, shorter than the {spec.HEADER_SIZE}-byte header")
        h = np.frombuffer(head, dtype=spec.HEADER_DTYPE)[0]
        version = int(h["version"])
        crc_ok = spec.crc32(head[:252]) == int(h["header_crc"])
        if version != spec.FORMAT_VERSION and crc_ok:
            raise self._fail(
                f"format version {version}; this stoker reads version {spec.FORMAT_VERSION} (re-convert the dataset with this version)"
            )
        if not crc_ok:
            claims = "" if version == spec.FORMAT_VERSION else f" (it claims format version {version})"
            raise self._fail(f"corrupt header: its checksum does not match{claims}")
        if int(h["header_size"]) != spec.HEADER_SIZE:
            raise self._fail(f"corrupt header: header_size {int(h['header_size'])}, version {version} has {spec.HEADER_SIZE}")
        self.version = version
        self.header_crc = int(h["header_crc"])
        self.num_samples = int(h["num_samples"])
        self.file_size = int(h["file_size"])
        expected = self.file_size if not self.head else int(h["data_offset"]) + self.file_size - int(h["checksum_offset"])
        if not self.head and self.file_size != actual_size:
            state = "truncated" if actual_size < self.file_size else "has trailing bytes"
            raise self._fail(f"{state}: the header says {self.file_size} bytes, the file has {actual_size}")
        for key in ("field_table_offset", "field_table_size", "metadata_offset", "metadata_row_size", "data_offset",
                    "data_size", "heap_offset", "checksum_offset", "metadata_block_size", "data_block_size",
                    "field_table_crc", "checksum_table_crc", "num_fields"):  # fmt: skip
            setattr(self, key, int(h[key]))
        size = self.file_size
        sections = [
            ("field table", self.field_table_offset, self.field_table_size),
            ("metadata table", self.metadata_offset, self.num_samples * self.metadata_row_size),
            ("data region", self.data_offset, self.data_size),
        ]
        previous_end = spec.HEADER_SIZE
        for name, start, length in sections:
            if start < spec.HEADER_SIZE or start + length > size:
                raise self._fail(f"corrupt header: the {name} ({start}..{start + length}) lies outside the file (0..{size})")
            if start < previous_end:
                raise self._fail(
                    f"corrupt header: the {name} starts at {start}, inside the previous section (which ends at {previous_end})"
                )
            previous_end = start + length
        if not self.data_offset <= self.heap_offset <= self.data_offset + self.data_size:
            raise self._fail("corrupt header: the heap lies outside the data region")
        if not self.data_offset + self.data_size <= self.checksum_offset <= size:
            raise self._fail("corrupt header: the checksum table lies outside the file")
        if self.metadata_block_size < 1 or self.data_block_size < 1:
            raise self._fail("corrupt header: zero checksum block size")
        for key in ("metadata_block_size", "data_block_size"):
            if getattr(self, key) > MAX_BLOCK_SIZE:
                raise self._fail(f"corrupt header: {key} {getattr(self, key)}, more than the largest block size ({MAX_BLOCK_SIZE}, 1 TiB)")
        #: where the checksum table starts in this file (a head lacks the data region before it)
        self._checksums_at = self.checksum_offset - (self.checksum_offset - self.data_offset if self.head else 0)
        if self.head and actual_size != expected:
            raise self._fail(f"a head of {actual_size} bytes; its header's sections make {expected}: truncated or not a head")

    def _parse_field_table(self, raw: bytes) -> None:
        if spec.crc32(raw) != self.field_table_crc:
            raise self._fail("corrupt field table: its checksum does not match")
        try:
            table = json.loads(raw.decode("utf-8"))["fields"]
            if not isinstance(table, list):
                raise TypeError(f"'fields' is a {type(table).__name__}, not a list")
            fields: dict[str, Field] = {}
            self._columns: dict[str, int] = {}
            for k, entry in enumerate(table):
                name = self._entry_name(k, entry, fields)
                if not isinstance(entry.get("type"), str) or not isinstance(entry.get("args"), dict):
                    raise self._fail(f"corrupt field table: field {name!r} needs a 'type' string and an 'args' object")
                cls = self._custom_fields.get(name) or FIELD_TYPES.get(entry["type"])
                if cls is None:
                    raise self._fail(f"unknown field type {entry['type']!r} for field {name!r} (written by a newer stoker?)")
                fields[name] = field = cls.from_args(entry["args"])
                self._check_stored_args(name, field, entry["args"])
                if cls.storage == "column":
                    offset = entry["column_offset"]
                    if type(offset) is not int:
                        raise self._fail(f"corrupt field table: the column_offset of field {name!r} is {offset!r}, not a whole number")
                    self._columns[name] = offset
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise self._fail(f"corrupt field table: {exc}") from exc
        if len(fields) != self.num_fields:
            raise self._fail(f"corrupt field table: {len(fields)} fields, the header says {self.num_fields}")
        self.fields: dict[str, Field] = fields
        #: the field table as stored (``{"name", "type", "args", ...}`` per field), for its hash (``fields_sha256``)
        self.field_table: list[dict[str, Any]] = table
        self.row_dtype = metadata_dtype(fields)
        if self.row_dtype.itemsize != self.metadata_row_size:
            raise self._fail(f"corrupt header: metadata rows of {self.metadata_row_size} bytes, the fields need {self.row_dtype.itemsize}")
        data_end = self.data_offset + self.data_size
        expected = self.data_offset  # (FORMAT.md: the first column at data_offset, each next at the aligned end of the one before)
        for name, offset in self._columns.items():
            end = offset + self.num_samples * fields[name].column_itemsize
            if offset < self.data_offset or end > self.heap_offset or end > data_end:
                raise self._fail(f"corrupt field table: the column of field {name!r} lies outside the data region")
            if offset != expected:
                raise self._fail(
                    f"corrupt field table: the column of field {name!r} starts at byte {offset}; the format puts it at {expected}"
                )
            expected = spec.align(end)

    def _entry_name(self, k: int, entry: Any, fields: Mapping[str, Field]) -> str:
        """Entry ``k`` of the field table's name, checked: a non-empty string of at most 255 characters, no ``/``, unique."""
        if not isinstance(entry, dict):
            raise self._fail(f"corrupt field table: entry {k} is a {type(entry).__name__}, not an object")
        name = entry.get("name")
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME_LENGTH or "/" in name:
            raise self._fail(
                f"corrupt field table: entry {k} is named {name!r}; a name is a string of 1 to {MAX_NAME_LENGTH} characters without '/'"
            )
        if name in fields:
            raise self._fail(f"corrupt field table: two fields are named {name!r}")
        return name

    def _check_stored_args(self, name: str, field: Field, args: Mapping[str, Any]) -> None:
        """A field as stored must be one stoker reads back as written: its elements' dtype little-endian or byte-order free
        (a big-endian one would be read as little-endian: other values), and one a loader turns into tensors."""
        dtype = args.get("dtype")
        if isinstance(dtype, str) and np.dtype(dtype).byteorder == ">":
            raise self._fail(f"corrupt field table: field {name!r} is stored as {dtype!r}; stoker files are little-endian")
        problem = field.write_problem()
        if problem is not None:
            raise self._fail(f"corrupt field table: field {name!r}: {problem}")

    def _parse_checksums(self, raw: bytes) -> None:
        n_meta = spec.num_blocks(self.num_samples * self.metadata_row_size, self.metadata_block_size)
        n_data = spec.num_blocks(self.data_size, self.data_block_size)
        if len(raw) != 4 * (n_meta + n_data):
            raise self._fail(f"corrupt checksum table: {len(raw)} bytes, expected {4 * (n_meta + n_data)}")
        if spec.crc32(raw) != self.checksum_table_crc:
            raise self._fail("corrupt checksum table: its checksum does not match")
        crcs = np.frombuffer(raw, dtype="<u4")
        self._metadata_crcs, self._data_crcs = crcs[:n_meta], crcs[n_meta:]

    # ---- memory maps -----------------------------------------------------------------
    def __len__(self) -> int:
        return self.num_samples

    @cached_property
    def storage(self) -> np.ndarray:
        """The whole file as a read-only ``uint8`` memory map (a head: the head, mapped at open; its metadata at the file's offsets)."""
        if self._head_map is not None:
            return self._head_map
        return np.memmap(self.path, dtype=np.uint8, mode="r")

    def load_into_memory(self) -> None:
        """Serve :attr:`storage` (and the columns and metadata read through it from now on) from a copy of the file in
        this process's memory, page-aligned, in an allocation the kernel may back with transparent huge pages (numpy
        advises them for large arrays on Linux); a head keeps its map.

        Random reads of rows (a table's shuffled batches) then miss the TLB far less than through the file's 4 KiB
        page-cache pages (Otto's 23 MB, 60 random batches of 1024 rows gathered by a compiled loop: 1.35 ms against
        1.77 ms through the memory map, and against 1.78 ms in memory without huge pages). The file's bytes are read once,
        now; the copy is what the reader checks and serves (the file rewritten afterwards changes nothing read here).

        Raises:
            DatasetFormatError: the file changed since it was opened and validated (its copy would not be what was
                checked).
        """
        if self.head:
            return
        mapped = self.storage
        raw = np.empty(len(mapped) + 4096, dtype=np.uint8)
        start = -raw.ctypes.data % 4096  # (the file's offsets keep their alignment: the map starts on a page)
        copy = raw[start : start + len(mapped)]
        copy[:] = mapped
        copy.flags.writeable = False
        was, now = self._stat, os.stat(self.path)
        if (now.st_dev, now.st_ino, now.st_size, now.st_mtime_ns) != (was.st_dev, was.st_ino, was.st_size, was.st_mtime_ns):
            raise self._fail("changed while it was opened (rewritten in place?): open it again once it is written")
        self.__dict__["storage"] = copy
        self.__dict__.pop("metadata", None)

    def _needs_data(self, what: str) -> None:
        if self.head:
            raise self._fail(f"is a head (the file without its data region): {what} needs the whole file")

    @cached_property
    def metadata(self) -> np.ndarray:
        """The metadata table: a structured array, one row per sample (memory-mapped)."""
        raw = self.storage[self.metadata_offset : self.metadata_offset + self.num_samples * self.metadata_row_size]
        return raw.view(self.row_dtype)

    def column(self, name: str) -> np.ndarray:
        """The dense ``(num_samples, *shape)`` column of a fixed-size field (memory-mapped)."""
        self._needs_data("column()")
        field = self.fields[name]
        offset = self._columns[name]
        raw = self.storage[offset : offset + self.num_samples * field.column_itemsize]
        return raw.view(field.dtype).reshape((self.num_samples, *field.shape))  # type: ignore[attr-defined,arg-type]

    # ---- validation ----------------------------------------------------------------------
    def _record_key(self) -> str:
        return _validated.identity_key(self.path, self._stat, self.header_crc, self.checksum_table_crc)

    def validate_metadata(self, lazy: bool = False) -> None:
        """Check the metadata checksums and that every heap pointer lies in the heap.

        Runs once per reader (vectorised, about the speed of reading the table).
        A successful full validation of a table of at least
        :data:`RECORD_VALIDATION_BYTES` is recorded in the cache folder (see
        :mod:`stoker.format._validated`), keyed by the file's identity (path,
        device, inode, size, mtime, header and checksum-table CRCs): opening
        the same, unchanged file again skips the work.

        Args:
            lazy: for a metadata table larger than :data:`LAZY_VALIDATION_BYTES`
                without a recorded validation, check only the padding now and
                let :meth:`validate_samples` check each checksum block when a
                sample stored in it is first asked for. The caller must then
                call :meth:`validate_samples` before reading any sample's
                metadata. Smaller tables are validated in full at once.

        Raises:
            DatasetFormatError: naming the first corrupt block or sample.
        """
        if self._metadata_valid:
            return
        recordable = self.num_samples * self.metadata_row_size >= RECORD_VALIDATION_BYTES
        if recordable and _validated.is_recorded(self._record_key()):
            self._metadata_valid = True
            return
        if lazy and self.num_samples * self.metadata_row_size > LAZY_VALIDATION_BYTES:
            if self._blocks_done is None:
                self._check_padding()
                self._blocks_done = np.zeros(len(self._metadata_crcs), dtype=bool)
                self._crcs_done = np.zeros(len(self._metadata_crcs), dtype=bool)
                self._blocks_left = len(self._metadata_crcs)
            return
        self._validate_all(recordable)

    def _validate_all(self, recordable: bool) -> None:
        self._metadata_valid = False
        try:
            self._check_padding()
            raw = self._metadata_raw()
            for b in range(len(self._metadata_crcs)):
                if not self._block_crc_ok(raw, b):
                    first = b * self.metadata_block_size // max(self.metadata_row_size, 1)
                    raise self._fail(f"corrupt metadata table: checksum mismatch in block {b} (samples from {first})")
            self._check_rows(0, self.num_samples)
        except DatasetFormatError:
            if recordable:
                _validated.forget(self._record_key())
            raise
        self._metadata_valid = True
        if recordable:
            _validated.record(self._record_key())

    def _metadata_raw(self) -> np.ndarray:
        return self.storage[self.metadata_offset : self.metadata_offset + self.num_samples * self.metadata_row_size]

    def _block_crc_ok(self, raw: np.ndarray, b: int) -> bool:
        bs = self.metadata_block_size
        return spec.crc32(raw[b * bs : (b + 1) * bs]) == int(self._metadata_crcs[b])

    def _check_padding(self) -> None:
        meta_end = self.metadata_offset + self.num_samples * self.metadata_row_size
        gaps = [
            ("field table", self.field_table_offset + self.field_table_size, self.metadata_offset),
            ("metadata table", meta_end, self.data_offset),
        ]
        if not self.head:  # (a head has no data region; the whole file's padding is checked by verify())
            gaps.append(("data region", self.data_offset + self.data_size, self.checksum_offset))
        for name, lo, hi in gaps:  # alignment padding, covered by no checksum: must be zero
            if self.storage[lo:hi].any():
                raise self._fail(f"corrupt padding after the {name} (bytes {lo}..{hi} must be zero)")

    def _check_rows(self, first: int, stop: int) -> None:
        """Check the heap pointers and sizes of samples ``first .. stop - 1`` (their blocks' CRCs already checked)."""
        heap_lo, heap_hi = self.heap_offset, self.data_offset + self.data_size
        meta = self.metadata
        for name, field in self.fields.items():
            if field.storage != "heap":
                continue
            for start in range(first, stop, _VALIDATE_ROWS):
                end = min(stop, start + _VALIDATE_ROWS)
                ptr = meta[f"{name}/ptr"][start:end].astype(np.uint64)
                size = meta[f"{name}/size"][start:end].astype(np.uint64)
                outside = (ptr < heap_lo) | (ptr > heap_hi) | (size > heap_hi - np.minimum(ptr, heap_hi))
                bad = outside | self._extra_invalid(name, field, start, end)
                if bad.any():
                    j = int(np.argmax(bad))
                    what = "points outside the heap" if outside[j] else "has a size that disagrees with its other metadata"
                    raise self._fail(
                        f"corrupt metadata: sample {start + j}, field {name!r} {what} (ptr {int(ptr[j])}, size {int(size[j])})"
                    )

    def validate_samples(self, indices: np.ndarray | Sequence[int]) -> None:
        """Validate, once each, the metadata checksum blocks that hold the rows of samples ``indices``.

        After :meth:`validate_metadata` with ``lazy=True`` left a big table to
        check block by block, the loader calls this for each batch before
        compiled code reads the batch's metadata: a block is checked (its CRC,
        then the heap pointers of the rows that start in it) the first time a
        sample stored in it is asked for. When every block has been checked
        the table is valid, the result is recorded (as by a full validation)
        and this returns at once. Without a lazy :meth:`validate_metadata`
        before, it validates the whole table. Safe to call from several
        threads (a block may then be checked twice).

        Args:
            indices: sample indices in ``[0, num_samples)``.

        Raises:
            DatasetFormatError: a block's checksum does not match (names the
                block, its samples and the sample of ``indices`` that needs it)
                or a sample's metadata is invalid (names the sample).
        """
        if self._metadata_valid:
            return
        done = self._blocks_done
        if done is None:
            self.validate_metadata()
            return
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        rows, bs = self.metadata_row_size, self.metadata_block_size
        starts = idx * rows // bs  # the block where each sample's row starts
        for b in np.unique(starts[~done[starts]]).tolist():
            self._validate_block(b, idx, int(idx[np.argmax(starts == b)]))
            with self._blocks_lock:
                if not done[b]:
                    done[b] = True
                    self._blocks_left -= 1
                    finished = self._blocks_left == 0
                else:
                    finished = False
            if finished:
                self._metadata_valid = True
                if self.num_samples * self.metadata_row_size >= RECORD_VALIDATION_BYTES:
                    _validated.record(self._record_key())

    def _validate_block(self, b: int, idx: np.ndarray, sample: int) -> None:
        """Check block ``b`` for sample ``sample`` of batch ``idx``: the CRCs of the blocks its rows span, then their pointers."""
        rows, bs, n = self.metadata_row_size, self.metadata_block_size, self.num_samples
        lo, hi = -(-(b * bs) // rows), min(n, -(-((b + 1) * bs) // rows))  # the rows that start in block b
        last = max(b, (hi * rows - 1) // bs) if hi > lo else b
        raw = self._metadata_raw()
        for c in range(b, min(last, len(self._metadata_crcs) - 1) + 1):
            if self._crcs_done[c]:
                continue
            if not self._block_crc_ok(raw, c):
                first, stop = c * bs // rows, min(n, -(-((c + 1) * bs) // rows))
                inside = idx[(idx >= first) & (idx < stop)]  # the batch's samples stored in block c, if any
                who = int(inside[0]) if len(inside) else sample
                raise self._fail(
                    f"corrupt metadata table: checksum mismatch in block {c} (the rows of samples {first}..{stop - 1}), "
                    f"found when sample {who} was first read; the file is damaged: copy or convert it again"
                )
            self._crcs_done[c] = True
        self._check_rows(lo, hi)

    def _extra_invalid(self, name: str, field: Field, start: int, stop: int) -> np.ndarray:
        """Per-field consistency of sizes (ragged lengths, raw image sizes) of samples ``start .. stop - 1``."""
        # Divide rather than multiply: a product of corrupt counts can wrap around 2**64.
        meta = self.metadata[start:stop]
        size = meta[f"{name}/size"].astype(np.uint64)
        row_bytes = getattr(field, "row_bytes", None)
        if row_bytes is not None:
            if row_bytes == 0:
                return size != 0
            rb = np.uint64(row_bytes)
            return (size % rb != 0) | (size // rb != meta[f"{name}/length"].astype(np.uint64))
        if field.TYPE_NAME == "rgb_image":
            height, width = meta[f"{name}/height"].astype(np.uint64), meta[f"{name}/width"].astype(np.uint64)
            row = np.maximum(width, np.uint64(1)) * np.uint64(3)  # < 2**34
            raw_bad = (size % row != 0) | (size // row != height)
            mode = meta[f"{name}/mode"]
            jpeg_bad = (mode == 1) & ((height > _JPEG_MAX_SIDE) | (width > _JPEG_MAX_SIDE))  # libjpeg's limit
            return ((mode == 0) & raw_bad) | jpeg_bad | (mode > 1) | (height == 0) | (width == 0)
        return np.zeros(len(meta), dtype=bool)

    def verify(self) -> None:
        """Check every checksum: header, field table, metadata and data.

        Unlike :meth:`validate_metadata`, this always reads the metadata table
        again, even when a validation of the unchanged file was recorded.

        Raises:
            DatasetFormatError: naming the first corrupt section or block (or: this is a head).
        """
        self._needs_data("verify()")
        self._validate_all(self.num_samples * self.metadata_row_size >= RECORD_VALIDATION_BYTES)
        data = self.storage[self.data_offset : self.data_offset + self.data_size]
        bs = self.data_block_size
        for b, expected in enumerate(self._data_crcs):
            if spec.crc32(data[b * bs : (b + 1) * bs]) != int(expected):
                start = self.data_offset + b * bs
                end = min(start + bs, self.data_offset + self.data_size)
                raise self._fail(f"corrupt data region: checksum mismatch in block {b} (bytes {start}..{end})")

    # ---- reading -----------------------------------------------------------------------------
    def read(self, index: int) -> tuple[Any, ...]:
        """Decode sample ``index`` in Python, one value per field (slow; for tests and inspection)."""
        if not -self.num_samples <= index < self.num_samples:
            raise IndexError(f"sample index {index} out of range for {self.num_samples} samples")
        self._needs_data("read()")
        index %= max(self.num_samples, 1)
        self.validate_samples(np.array([index]))
        row = self.metadata[index]
        out = []
        for name, field in self.fields.items():
            payload: Any = None
            if field.storage == "column":
                size = field.column_itemsize
                off = self._columns[name] + index * size
                payload = self.storage[off : off + size]
            elif field.storage == "heap":
                ptr, size = int(row[f"{name}/ptr"]), int(row[f"{name}/size"])
                payload = self.storage[ptr : ptr + size]
            sub = {s: row[f"{name}/{s}"] for s, _ in field.metadata_columns()}
            out.append(field.read_one(sub, payload))  # type: ignore[arg-type]
        return tuple(out)

    def sample_extents(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The byte ranges ``[start, end)`` of the file that samples ``indices`` occupy (metadata row, columns, heap values).

        Ranges are not sorted or merged. Call after :meth:`validate_metadata` (or
        :meth:`validate_samples` of these samples).
        """
        idx = np.asarray(indices, dtype=np.uint64)
        rows = np.uint64(self.metadata_row_size)
        starts = [np.uint64(self.metadata_offset) + idx * rows]
        ends = [starts[0] + rows]
        meta = self.metadata
        for name, field in self.fields.items():
            if field.storage == "column":
                size = np.uint64(field.column_itemsize)
                s = np.uint64(self._columns[name]) + idx * size
                starts.append(s)
                ends.append(s + size)
            elif field.storage == "heap":
                s = meta[f"{name}/ptr"][idx.astype(np.int64)].astype(np.uint64)
                starts.append(s)
                ends.append(s + meta[f"{name}/size"][idx.astype(np.int64)].astype(np.uint64))
        return np.concatenate(starts), np.concatenate(ends)

    def field_sizes(self) -> dict[str, int]:
        """Bytes stored per field (metadata columns + column or heap payloads)."""
        sizes = {}
        meta = self.metadata
        for name, field in self.fields.items():
            n = self.num_samples * sum(np.dtype(dt).itemsize for _, dt in field.metadata_columns())
            if field.storage == "column":
                n += self.num_samples * field.column_itemsize
            elif field.storage == "heap":
                n += int(meta[f"{name}/size"].sum(dtype=np.uint64))
            sizes[name] = n
        return sizes

    def close(self) -> None:
        """Drop the memory maps (arrays already handed out stay valid; a head's stays with the reader: its file may be gone)."""
        self.__dict__.pop("metadata", None)
        self.__dict__.pop("storage", None)

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Reader({str(self.path)!r}, samples={self.num_samples}, fields={self.fields})"
