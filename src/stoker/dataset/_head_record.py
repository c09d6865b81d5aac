"""A shard's head as its manifest records it: what a dataset in a store is planned from before the head is read.

Opening a dataset in object storage reads its manifest and the head of its
first shard (the field table); the Loader and its decoders then plan from the
whole metadata table (the largest value of a bytes or ragged field, the
largest images for the decoders' scratch, whether any image is a JPEG). The
manifest's optional per-shard key ``head`` (written by every stoker writer
since issue 44; a manifest without it reads as before: every head at open)
records what that plan needs of a shard, so that its head is read only when a
batch first needs it, or in the background::

    "head": {"data_offset": 4096, "data_size": 1048576, "data_block_size": 16777216,
             "columns": {"x": 4096},
             "samples": [0, 17, 933],
             "values": {"image/size": [...], "image/height": [...], "image/width": [...], "image/mode": [...]}}

``columns`` are the column fields' offsets in the file; ``samples`` are a few
of the shard's samples (local indices, increasing) and ``values`` their
metadata values of every sub-column of the heap fields but ``ptr``. The
samples are those the plan's figures come from: for each such sub-column, the
first sample of its largest and of its smallest value; for each image field
(sub-columns ``height`` and ``width``), every sample whose size no other image
of the shard exceeds in both sides (the *front* of the sizes), among all
images and among the images of each ``mode`` (each monotone figure of the
sides, such as a decoder's scratch, has its maximum on the front). A shard
whose front is longer than :data:`MAX_FRONT` (or of more than :data:`MAX_MODES`
modes, or with a non-finite value) gets no record: its head is read at open.

Until its head is read, a shard is a :class:`PendingHead`: its rows of the
reader's metadata table hold these samples' values at their places and the
first one's everywhere else (every figure the planners take, a maximum, a
minimum, ``any``, a monotone function's maximum, is the same as the whole
table's). A batch that reads the shard waits for its head; the head is checked
when it is read (:func:`check_record`: its record, made again from it, must be
the manifest's, exactly), then its rows replace the stand-ins.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from stoker.errors import DatasetFormatError
from stoker.fields import Field
from stoker.format import spec
from stoker.format.reader import Reader

__all__ = ["MAX_FRONT", "MAX_MODES", "PendingHead", "check_record", "head_record", "plan_columns", "record_problem"]

#: the most samples of one image field's front (of one group: all, or one mode) a record holds
MAX_FRONT = 64
#: the most distinct modes of an image field a record holds fronts of
MAX_MODES = 8
#: the most samples a record may list (every limit above together, with room)
_MAX_SAMPLES = 4096


def plan_columns(fields: Mapping[str, Field]) -> list[str]:
    """The metadata columns a record holds: every sub-column of the heap fields but ``ptr``, in the fields' order."""
    return [f"{name}/{sub}" for name, f in fields.items() if f.storage == "heap" for sub, _ in f.metadata_columns() if sub != "ptr"]


def _front(h: np.ndarray, w: np.ndarray, among: np.ndarray) -> np.ndarray:
    """The samples of ``among`` whose ``(h, w)`` no other's exceeds in both (one per size: the first)."""
    if len(among) == 0:
        return among
    order = among[np.lexsort((among, -w[among], -h[among]))]  # tallest first, then widest, then first sample
    ws = w[order].astype(np.float64)
    best = np.maximum.accumulate(ws)
    on = np.ones(len(order), dtype=bool)
    on[1:] = ws[1:] > best[:-1]
    return order[on]


def head_record(reader: Reader) -> dict[str, Any] | None:
    """The manifest's record of ``reader``'s shard (see the module), or ``None`` when it would be too long.

    ``reader`` is a shard or its head, its metadata validated.
    """
    meta = reader.metadata
    n = int(reader.num_samples)
    cols = plan_columns(reader.fields)
    picks: set[int] = set()
    if n:
        for c in cols:
            values = np.asarray(meta[c])
            if values.ndim != 1 or (values.dtype.kind == "f" and not np.isfinite(values).all()):
                return None
            picks.update((int(np.argmax(values)), int(np.argmin(values))))
        for name, field in reader.fields.items():
            if field.storage != "heap" or f"{name}/height" not in cols or f"{name}/width" not in cols:
                continue
            h, w = np.asarray(meta[f"{name}/height"]), np.asarray(meta[f"{name}/width"])
            groups = [np.arange(n)]
            if f"{name}/mode" in cols:
                modes = np.asarray(meta[f"{name}/mode"])
                kinds = np.unique(modes)
                if len(kinds) > MAX_MODES:
                    return None
                groups += [np.flatnonzero(modes == m) for m in kinds.tolist()]
            for among in groups:
                front = _front(h, w, among)
                if len(front) > MAX_FRONT:
                    return None
                picks.update(front.tolist())
    samples = sorted(picks)
    return {
        "data_offset": int(reader.data_offset),
        "data_size": int(reader.data_size),
        "data_block_size": int(reader.data_block_size),
        "columns": {name: int(offset) for name, offset in reader._columns.items()},
        "samples": samples,
        "values": {c: np.asarray(meta[c])[samples].tolist() for c in cols},
    }


def _int_in(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def record_problem(record: object, num_samples: int, file_size: int) -> str | None:
    """Why ``record`` is not a well-formed ``head`` record of a shard of ``num_samples`` samples and ``file_size``
    bytes (``None``: it is one). Its values are checked against the shard's fields when it is used (:class:`PendingHead`)."""
    if not isinstance(record, dict):
        return f"expected an object; got {type(record).__name__}"
    for key in ("data_offset", "data_size", "data_block_size", "columns", "samples", "values"):
        if key not in record:
            return f"{key!r} is missing"
    offset, size, block = record["data_offset"], record["data_size"], record["data_block_size"]
    if not _int_in(offset, spec.HEADER_SIZE, file_size):
        return f"data_offset: expected an int from {spec.HEADER_SIZE} to the file_size {file_size}; got {offset!r:.40}"
    if not _int_in(size, 0, file_size - offset):
        return f"data_size: expected an int from 0 to {file_size - offset} (the file's end); got {size!r:.40}"
    if not _int_in(block, 1, 1 << 48):
        return f"data_block_size: expected an int >= 1; got {block!r:.40}"
    columns = record["columns"]
    if not isinstance(columns, dict) or not all(isinstance(k, str) and _int_in(v, offset, offset + size) for k, v in columns.items()):
        return f"columns: expected field name -> offset inside the data region ({offset}..{offset + size}); got {columns!r:.80}"
    samples = record["samples"]
    if not isinstance(samples, list) or len(samples) > _MAX_SAMPLES or not all(_int_in(s, 0, num_samples - 1) for s in samples):
        return f"samples: expected at most {_MAX_SAMPLES} sample indices below num_samples={num_samples}; got {samples!r:.80}"
    if any(a >= b for a, b in itertools.pairwise(samples)):
        return f"samples: expected increasing sample indices; got {samples!r:.80}"
    values = record["values"]
    if not isinstance(values, dict):
        return f"values: expected column -> list of values; got {type(values).__name__}"
    for col, vals in values.items():
        if not isinstance(col, str) or not isinstance(vals, list) or len(vals) != len(samples):
            return f"values[{col!r:.40}]: expected a list of {len(samples)} values (one per sample); got {vals!r:.80}"
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            return f"values[{col!r:.40}]: expected numbers; got {vals!r:.80}"
    if num_samples and values and not samples:
        return "samples: empty, but the shard has samples and values are recorded"
    return None


def check_record(reader: Reader, record: Mapping[str, Any], where: str) -> None:
    """Refuse a head (``reader``, its metadata validated) whose record is not the manifest's ``record``: the plan made
    from the manifest would not hold for its samples.

    Raises:
        DatasetFormatError: naming the shard's URL (``where``) and the first key that differs.
    """
    mine = head_record(reader)
    if mine is not None:
        mine = json.loads(json.dumps(mine))  # (as a manifest holds it)
    if mine == dict(record):
        return
    if mine is None:
        problem = f"its samples' sizes make no record (a front of more than {MAX_FRONT} image sizes, or another value out of range)"
    else:
        key = next((k for k in mine if mine[k] != record.get(k)), "?")
        problem = f"its {key!r} is {mine.get(key)!r:.120}, the manifest's record says {record.get(key)!r:.120}"
    raise DatasetFormatError(
        where,
        f"its head differs from the manifest's record of it (shards[].head): {problem}; the dataset was planned from the "
        "manifest, so the shard cannot be read (the shard was rewritten after the manifest, or the manifest was edited: write "
        "the dataset again)",
    )


class PendingHead:
    """A shard whose head is not read yet, as the reader plans from it (see the module): its layout and a stand-in
    metadata table from its manifest ``record``, the fields of its dataset's ``first`` head.

    Args:
        first: the head of the dataset's first shard (its fields).
        record: the manifest's ``head`` record of this shard.
        num_samples, file_size, header_crc: the manifest's record of the shard.
        where: the manifest's URL, for errors.
        path: where the head will be in the cache.

    Raises:
        DatasetFormatError: the record does not fit the fields (a column or value unknown to them, a value out of its
            column's range): names the manifest.
    """

    head = True

    def __init__(
        self, first: Reader, record: Mapping[str, Any], num_samples: int, file_size: int, header_crc: int, where: str, path: Path
    ) -> None:
        self.record = dict(record)
        self.path = path
        self.num_samples, self.file_size, self.header_crc = int(num_samples), int(file_size), int(header_crc)
        self.fields: dict[str, Field] = dict(first.fields)
        self.row_dtype = first.row_dtype
        self.metadata_row_size = first.metadata_row_size
        self.data_offset, self.data_size = int(record["data_offset"]), int(record["data_size"])
        self.data_block_size = int(record["data_block_size"])
        self._where = where
        self._columns: dict[str, int] = dict(record["columns"])
        self._data_crcs = np.zeros(spec.num_blocks(self.data_size, self.data_block_size), dtype="<u4")  # (the head's, when read)
        self._metadata_valid = True  # (its head is validated when it is read, before any batch reads its rows)
        want = sorted(n for n, f in self.fields.items() if f.storage == "column")
        if sorted(self._columns) != want or sorted(record["values"]) != sorted(plan_columns(self.fields)):
            raise DatasetFormatError(
                where,
                f"the head record's columns {sorted(self._columns)} and values {sorted(record['values'])} are not those of the "
                f"dataset's fields (columns {want}, values {sorted(plan_columns(self.fields))}): not a manifest of these shards",
            )

    def __len__(self) -> int:
        return self.num_samples

    @property
    def metadata(self) -> np.ndarray:
        """The stand-in table: the recorded samples' values at their places, the first one's in every other row."""
        rows = np.zeros(self.num_samples, dtype=self.row_dtype)
        samples = np.asarray(self.record["samples"], dtype=np.int64)
        for col, vals in self.record["values"].items():
            column = rows[col]
            given = np.asarray(vals)
            typed = given.astype(column.dtype)
            if len(given) and not np.array_equal(typed, given):
                raise DatasetFormatError(
                    self._where, f"the head record's values of {col!r} do not fit its type {column.dtype}: {vals!r:.80}"
                )
            if len(typed):
                column[:] = typed[0]
                column[samples] = typed
        for name, field in self.fields.items():
            if field.storage == "heap":
                rows[f"{name}/ptr"] = self.data_offset  # (inside the shard: no batch reads a stand-in row)
        return rows

    def validate_metadata(self, lazy: bool = False) -> None:
        """Nothing to validate: the head is, when it is read."""

    def close(self) -> None:
        """Nothing is open."""

    def _record_key(self) -> str:
        return f"pending-head:{self._where}:{self.header_crc:08x}"

    def __repr__(self) -> str:
        return f"PendingHead({str(self.path)!r}, samples={self.num_samples})"
