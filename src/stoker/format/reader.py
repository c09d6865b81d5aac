"""Open, validate and read a stoker file without loading it.

Opening reads the 256-byte header and the field table only, whatever the
number of samples; the rest is memory-mapped. :meth:`Reader.validate_metadata`
checks the metadata table (checksums and every heap pointer) in vectorised
chunks; the loader calls it once before compiled code touches any offset.
:meth:`Reader.verify` also checks the data region's checksums.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from stoker.errors import DatasetFormatError
from stoker.fields import FIELD_TYPES, Field
from stoker.format import spec

_VALIDATE_ROWS = 1 << 16  # metadata rows checked per vectorised step
_JPEG_MAX_SIDE = 65535  # the largest JPEG side libjpeg decodes


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

    def __init__(self, path: str | os.PathLike[str], custom_fields: Mapping[str, type[Field]] | None = None) -> None:
        self.path = Path(path)
        self._custom_fields = dict(custom_fields or {})
        try:
            actual_size = self.path.stat().st_size
            with open(self.path, "rb") as fh:
                head = fh.read(spec.HEADER_SIZE)
                self._parse_header(head, actual_size)
                fh.seek(self.field_table_offset)
                table = fh.read(self.field_table_size)
                fh.seek(self.checksum_offset)
                checksums = fh.read(actual_size - self.checksum_offset)
        except OSError as exc:
            raise DatasetFormatError(path, f"cannot be read: {exc.strerror or exc}") from exc
        self._parse_field_table(table)
        self._parse_checksums(checksums)
        self._metadata_valid = False

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
        self.version = version
        self.num_samples = int(h["num_samples"])
        self.file_size = int(h["file_size"])
        if self.file_size != actual_size:
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

    def _parse_field_table(self, raw: bytes) -> None:
        if spec.crc32(raw) != self.field_table_crc:
            raise self._fail("corrupt field table: its checksum does not match")
        try:
            table = json.loads(raw.decode("utf-8"))["fields"]
            fields: dict[str, Field] = {}
            self._columns: dict[str, int] = {}
            for entry in table:
                cls = self._custom_fields.get(entry["name"]) or FIELD_TYPES.get(entry["type"])
                if cls is None:
                    raise self._fail(f"unknown field type {entry['type']!r} for field {entry['name']!r} (written by a newer stoker?)")
                fields[entry["name"]] = cls.from_args(entry["args"])
                if cls.storage == "column":
                    self._columns[entry["name"]] = int(entry["column_offset"])
        except (ValueError, KeyError, TypeError) as exc:
            raise self._fail(f"corrupt field table: {exc}") from exc
        if len(fields) != self.num_fields:
            raise self._fail(f"corrupt field table: {len(fields)} fields, the header says {self.num_fields}")
        self.fields: dict[str, Field] = fields
        self.row_dtype = metadata_dtype(fields)
        if self.row_dtype.itemsize != self.metadata_row_size:
            raise self._fail(f"corrupt header: metadata rows of {self.metadata_row_size} bytes, the fields need {self.row_dtype.itemsize}")
        data_end = self.data_offset + self.data_size
        for name, offset in self._columns.items():
            end = offset + self.num_samples * fields[name].column_itemsize
            if offset < self.data_offset or end > self.heap_offset or end > data_end:
                raise self._fail(f"corrupt field table: the column of field {name!r} lies outside the data region")

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
        """The whole file as a read-only ``uint8`` memory map."""
        return np.memmap(self.path, dtype=np.uint8, mode="r")

    @cached_property
    def metadata(self) -> np.ndarray:
        """The metadata table: a structured array, one row per sample (memory-mapped)."""
        raw = self.storage[self.metadata_offset : self.metadata_offset + self.num_samples * self.metadata_row_size]
        return raw.view(self.row_dtype)

    def column(self, name: str) -> np.ndarray:
        """The dense ``(num_samples, *shape)`` column of a fixed-size field (memory-mapped)."""
        field = self.fields[name]
        offset = self._columns[name]
        raw = self.storage[offset : offset + self.num_samples * field.column_itemsize]
        return raw.view(field.dtype).reshape((self.num_samples, *field.shape))  # type: ignore[attr-defined,arg-type]

    # ---- validation ----------------------------------------------------------------------
    def validate_metadata(self) -> None:
        """Check the metadata checksums and that every heap pointer lies in the heap.

        Runs once per reader (vectorised, about the speed of reading the table).

        Raises:
            DatasetFormatError: naming the first corrupt block or sample.
        """
        if self._metadata_valid:
            return
        raw = self.storage[self.metadata_offset : self.metadata_offset + self.num_samples * self.metadata_row_size]
        bs = self.metadata_block_size
        for b, expected in enumerate(self._metadata_crcs):
            if spec.crc32(raw[b * bs : (b + 1) * bs]) != int(expected):
                first = b * bs // max(self.metadata_row_size, 1)
                raise self._fail(f"corrupt metadata table: checksum mismatch in block {b} (samples from {first})")
        meta_end = self.metadata_offset + self.num_samples * self.metadata_row_size
        gaps = [
            ("field table", self.field_table_offset + self.field_table_size, self.metadata_offset),
            ("metadata table", meta_end, self.data_offset),
            ("data region", self.data_offset + self.data_size, self.checksum_offset),
        ]
        for name, lo, hi in gaps:  # alignment padding, covered by no checksum: must be zero
            if self.storage[lo:hi].any():
                raise self._fail(f"corrupt padding after the {name} (bytes {lo}..{hi} must be zero)")
        heap_lo, heap_hi = self.heap_offset, self.data_offset + self.data_size
        meta = self.metadata
        for name, field in self.fields.items():
            if field.storage != "heap":
                continue
            for start in range(0, self.num_samples, _VALIDATE_ROWS):
                ptr = meta[f"{name}/ptr"][start : start + _VALIDATE_ROWS].astype(np.uint64)
                size = meta[f"{name}/size"][start : start + _VALIDATE_ROWS].astype(np.uint64)
                outside = (ptr < heap_lo) | (ptr > heap_hi) | (size > heap_hi - np.minimum(ptr, heap_hi))
                bad = outside | self._extra_invalid(name, field, start)
                if bad.any():
                    j = int(np.argmax(bad))
                    what = "points outside the heap" if outside[j] else "has a size that disagrees with its other metadata"
                    raise self._fail(
                        f"corrupt metadata: sample {start + j}, field {name!r} {what} (ptr {int(ptr[j])}, size {int(size[j])})"
                    )
        self._metadata_valid = True

    def _extra_invalid(self, name: str, field: Field, start: int) -> np.ndarray:
        """Per-field consistency of sizes (ragged lengths, raw image sizes)."""
        # Divide rather than multiply: a product of corrupt counts can wrap around 2**64.
        meta = self.metadata[start : start + _VALIDATE_ROWS]
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

        Raises:
            DatasetFormatError: naming the first corrupt section or block.
        """
        self.validate_metadata()
        data = self.storage[self.data_offset : self.data_offset + self.data_size]
        bs = self.data_block_size
        for b, expected in enumerate(self._data_crcs):
            if spec.crc32(data[b * bs : (b + 1) * bs]) != int(expected):
                start = self.data_offset + b * bs
                raise self._fail(f"corrupt data region: checksum mismatch in block {b} (bytes {start}..{start + bs})")

    # ---- reading -----------------------------------------------------------------------------
    def read(self, index: int) -> tuple[Any, ...]:
        """Decode sample ``index`` in Python, one value per field (slow; for tests and inspection)."""
        if not -self.num_samples <= index < self.num_samples:
            raise IndexError(f"sample index {index} out of range for {self.num_samples} samples")
        index %= max(self.num_samples, 1)
        self.validate_metadata()
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

        Ranges are not sorted or merged. Call after :meth:`validate_metadata`.
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
        """Drop the memory maps (arrays already handed out stay valid)."""
        self.__dict__.pop("metadata", None)
        self.__dict__.pop("storage", None)

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Reader({str(self.path)!r}, samples={self.num_samples}, fields={self.fields})"
