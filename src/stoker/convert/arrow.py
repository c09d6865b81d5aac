"""Convert Arrow data (tables, record batches, Parquet folders, Hugging Face datasets) into stoker shards.

Every entry point ends in the same two steps: :func:`infer_fields` picks a
stoker field per column (or checks the fields you give against the Arrow
schema), and :func:`write_shard` writes one table as one stoker file with
:class:`~stoker.format.DatasetWriter`. :func:`write_arrow` cuts a stream of
tables into shards of ``rows_per_shard`` rows, written as one transaction of
the folder (:class:`stoker.dataset._transaction.FolderTransaction`: new shard
names, the manifest renamed into place last, the previous dataset's shards
deleted after it), so that ``Loader("folder/")`` reads the shards as one
dataset, in order, and a failed write leaves the previous dataset as it was.
:mod:`stoker.convert.ray` writes the shards of a Ray dataset in parallel
through the same :func:`write_shard` and the same transaction.

Inferred fields (pass ``fields=`` to choose others, or a subset of columns):

============================================  ===================================
Arrow type                                    stoker field
============================================  ===================================
integer, bool                                 ``IntField``
floating point                                ``FloatField``
fixed-shape tensor (Arrow's, Ray's, HF's      ``NDArrayField(shape, dtype)``
``ArrayND``), fixed-size list of numbers
list of numbers                               ``RaggedArrayField(dtype)``
binary, string (stored as UTF-8)              ``BytesField``
============================================  ===================================

Images are never guessed: give ``RGBImageField()`` for a column of HWC
``uint8`` tensors, of encoded image bytes (JPEG, PNG: decoded with Pillow)
or of Hugging Face ``Image()`` values. ``JSONField()`` takes any column.
Null values, and nulls inside list values, are refused (the error names the column and row).

``pyarrow`` is imported when a function is called, not with this module.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from stoker.convert._arrow_types import (
    is_bytes,
    is_image_struct,
    is_list,
    is_number,
    no_nulls,
    require_pyarrow,
    tensor_shape,
)
from stoker.dataset._remote_transaction import RemoteTransaction, finish_shard, open_transaction
from stoker.errors import SampleError
from stoker.fields import BytesField, Field, FloatField, IntField, JSONField, NDArrayField, RaggedArrayField, RGBImageField
from stoker.format import DatasetWriter
from stoker.format.writer import Columns

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["from_huggingface", "from_parquet", "infer_fields", "write_arrow", "write_shard"]

#: rows per shard when not given
ROWS_PER_SHARD = 100_000


def _infer_one(name: str, t: Any) -> Field:
    pa = require_pyarrow()
    if pa.types.is_integer(t) or pa.types.is_boolean(t):
        return IntField()
    if pa.types.is_floating(t):
        return FloatField()
    tensor = tensor_shape(t)
    if tensor is not None:
        return NDArrayField(shape=tensor[0], dtype=tensor[1])
    if is_list(t) and is_number(t.value_type):
        return RaggedArrayField(np.dtype(t.value_type.to_pandas_dtype()))
    if is_bytes(t):
        return BytesField()
    hint = "RGBImageField() for images" if is_image_struct(t) or isinstance(t, pa.BaseExtensionType) else "JSONField() for any value"
    raise TypeError(f"column {name!r} has Arrow type {t}, which no stoker field is inferred from: pass fields={{{name!r}: ...}} ({hint})")


def _check_compatible(name: str, field: Field, t: Any) -> None:
    """Refuse a field that cannot hold the column's Arrow type, before anything is written."""
    pa = require_pyarrow()
    tensor = tensor_shape(t)
    ok: bool
    if type(field) is IntField:
        ok = bool(pa.types.is_integer(t) or pa.types.is_boolean(t))
    elif type(field) is FloatField:
        ok = bool(pa.types.is_floating(t) or pa.types.is_integer(t))
    elif isinstance(field, NDArrayField):
        want = int(np.prod(field.shape, dtype=np.int64))
        ok = tensor is not None and int(np.prod(tensor[0], dtype=np.int64)) == want
        if tensor is not None and not ok:
            raise TypeError(
                f"column {name!r} holds arrays of shape {tensor[0]}, the field {field!r} wants shape {field.shape} "
                f"({want} elements): pass fields={{{name!r}: NDArrayField(shape={tensor[0]}, ...)}}"
            )
        ok = ok or ((pa.types.is_integer(t) or pa.types.is_floating(t)) and want == 1)
    elif isinstance(field, BytesField) and not isinstance(field, JSONField):
        ok = is_bytes(t)
    elif isinstance(field, RaggedArrayField):
        ok = is_list(t) or isinstance(t, pa.BaseExtensionType)
    elif isinstance(field, RGBImageField):
        ok = is_bytes(t) or is_image_struct(t) or isinstance(t, pa.BaseExtensionType) or pa.types.is_list(t)
    else:  # JSONField and fields of other types: values as Python objects, the field decides
        ok = True
    if not ok:
        raise TypeError(
            f"column {name!r} has Arrow type {t}, which the field {field!r} cannot hold: "
            f"pass another field for it (or leave it out of fields= to infer one)"
        )


def infer_fields(schema: pa.Schema, fields: Mapping[str, Field] | None = None) -> dict[str, Field]:
    """The stoker fields for an Arrow schema: ``fields`` checked against it, or one inferred per column.

    Args:
        schema: the Arrow schema of the data.
        fields: column name -> Field, the columns to write in this order (other
            columns are left out); ``None``: every column, fields inferred
            (see the module's table).

    Raises:
        KeyError: ``fields`` names a column the schema does not have.
        TypeError: a field cannot hold its column's type, or no field is
            inferred for a column (the message says what to pass).
    """
    names = list(schema.names)
    if fields is None:
        return {name: _infer_one(name, schema.field(name).type) for name in names}
    if not fields:
        raise ValueError("fields must name at least one column; got an empty mapping")
    out: dict[str, Field] = {}
    for name, field in fields.items():
        if name not in names:
            raise KeyError(f"fields name column {name!r}, which the data does not have; its columns are {names}")
        if not isinstance(field, Field):
            raise TypeError(f"fields[{name!r}] must be a stoker Field instance; got {type(field).__name__}")
        _check_compatible(name, field, schema.field(name).type)
        out[name] = field
    return out


# ---- columns as values ---------------------------------------------------------------------------
def _tensor_numpy(column: Any) -> np.ndarray:
    """A fixed-shape tensor column as one ``(rows, *shape)`` array, or an object array of arrays for varying shapes."""
    pa = require_pyarrow()
    parts = []
    for chunk in column.chunks:
        if isinstance(chunk.type, pa.FixedSizeListType):
            shape, _ = tensor_shape(chunk.type) or ((), None)
            flat = chunk.flatten()
            while isinstance(flat.type, pa.FixedSizeListType):
                flat = flat.flatten()
            parts.append(flat.to_numpy(zero_copy_only=False).reshape(len(chunk), *shape))
        elif hasattr(chunk, "to_numpy_ndarray"):  # Arrow's FixedShapeTensorArray
            parts.append(chunk.to_numpy_ndarray())
        else:  # Ray's tensor arrays, Hugging Face's ArrayND arrays
            parts.append(np.asarray(chunk.to_numpy(zero_copy_only=False)))
    if not parts:
        return np.zeros(0)
    if any(p.dtype == object for p in parts):
        return np.concatenate([p if p.dtype == object else _objects(p) for p in parts])
    return np.concatenate(parts)


def _objects(arr: np.ndarray) -> np.ndarray:
    out = np.empty(len(arr), dtype=object)
    for i in range(len(arr)):
        out[i] = arr[i]
    return out


def _ragged(column: Any, dtype: np.dtype) -> list[np.ndarray]:
    """A list column as one array per row (slices of the flat values, no Python lists)."""
    out: list[np.ndarray] = []
    for chunk in column.chunks:
        offsets = chunk.offsets.to_numpy()
        values = chunk.flatten().to_numpy(zero_copy_only=False).astype(dtype, copy=False) if len(chunk) else np.zeros(0, dtype)
        base = offsets[0]
        out.extend(values[a - base : b - base] for a, b in itertools.pairwise(offsets))
    return out


class _Images:
    """Encoded images (bytes, or Hugging Face ``{"bytes", "path"}`` dicts) decoded with Pillow when a row is read."""

    def __init__(self, name: str, values: list[Any]) -> None:
        self.name, self.values = name, values

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, i: int) -> Any:
        from PIL import Image

        value = self.values[i]
        data, path = (value.get("bytes"), value.get("path")) if isinstance(value, dict) else (value, None)
        data = data.encode("utf-8") if isinstance(data, str) else data  # a string column's values are bytes, never paths
        source: Any = io.BytesIO(data) if data is not None else path
        try:
            image = Image.open(source)
            image.load()
        except Exception:  # Pillow raises many types: the field decodes the bytes (or the path) again
            return data if data is not None else path  # and raises a ValueError, which names the row and column
        return image


def _column_values(name: str, field: Field, column: Any) -> Any:
    """The values of one column, indexable by row, in the form ``field.encode`` takes."""
    pa = require_pyarrow()
    t = column.type
    no_nulls(name, column, deep=not isinstance(field, JSONField))  # JSON keeps a null inside a value: null
    if type(field) in (IntField, FloatField):
        values = column.to_numpy()
        return values.astype(np.int64) if values.dtype == np.bool_ else values
    if isinstance(field, NDArrayField):
        arr = _tensor_numpy(column) if tensor_shape(t) is not None else column.to_numpy()
        return arr.reshape(len(arr), *field.shape) if arr.dtype != object else arr
    if isinstance(field, RaggedArrayField) and is_list(t):
        return _ragged(column, field.dtype)
    if isinstance(field, RGBImageField):
        if is_bytes(t) or is_image_struct(t):
            return _Images(name, column.to_pylist())
        if is_list(t):
            return [np.asarray(v, dtype=np.uint8) for v in column.to_pylist()]
        return _tensor_numpy(column)
    if isinstance(field, BytesField) and not isinstance(field, JSONField):
        return [v.encode("utf-8") if isinstance(v, str) else v for v in column.to_pylist()]
    if isinstance(t, pa.BaseExtensionType):
        return _tensor_numpy(column)
    return column.to_pylist()


def _as_table(data: Any) -> pa.Table:
    pa = require_pyarrow()
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    raise TypeError(f"expected a pyarrow Table or RecordBatch; got {type(data).__name__}")


def write_shard(table: pa.Table | pa.RecordBatch, path: str | os.PathLike[str], fields: Mapping[str, Field], first_row: int = 0) -> int:
    """Write one Arrow table as one stoker file (atomically, by :class:`~stoker.format.DatasetWriter`).

    Args:
        table: the rows; must have every column named in ``fields``.
        path: the stoker file to write.
        fields: column name -> Field (see :func:`infer_fields`).
        first_row: the dataset position of the table's first row, for error messages.

    Returns:
        The number of rows written.

    Raises:
        KeyError: a field names a column the table does not have.
        SampleError: a value the field refuses or a null; names the row
            (``first_row`` + its position in the table) and the column.
    """
    table = _as_table(table)
    fields = dict(fields)
    missing = [name for name in fields if name not in table.column_names]
    if missing:
        raise KeyError(f"fields name columns {missing}, which the data does not have; its columns are {table.column_names}")
    writer = DatasetWriter(path, fields, num_workers=1, progress=False)
    try:
        columns = [_column_values(name, f, table.column(name)) for name, f in fields.items()]
        if all(type(f) in (IntField, FloatField, NDArrayField) for f in fields.values()) and all(
            isinstance(c, np.ndarray) and c.dtype != object for c in columns
        ):
            writer.from_arrays(dict(zip(fields, columns)), chunksize=1 << 16)
        else:
            writer.from_indexed_dataset(Columns(columns), chunksize=256)
    except SampleError as exc:
        if first_row == 0:
            raise
        raise SampleError(first_row + exc.index, exc.field, exc.problem) from exc
    return table.num_rows


def _batches(data: Any) -> Iterator[pa.Table]:
    pa = require_pyarrow()
    if isinstance(data, (pa.Table, pa.RecordBatch)):
        yield _as_table(data)
        return
    if isinstance(data, pa.RecordBatchReader):
        data = iter(data)
    for item in data:
        yield _as_table(item)


def write_arrow(
    data: pa.Table | pa.RecordBatch | pa.RecordBatchReader | Iterable[pa.Table | pa.RecordBatch],
    directory: str | os.PathLike[str],
    fields: Mapping[str, Field] | None = None,
    rows_per_shard: int = ROWS_PER_SHARD,
    *,
    overwrite: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> Path | str:
    """Write Arrow data into a folder of stoker shards and its manifest (written last, atomically).

    Rows keep their order: shard ``k`` holds rows ``k * rows_per_shard`` onwards,
    and ``Loader(directory)`` reads them in the order given. At most one
    shard's rows are held in memory (as Arrow data) at a time.

    Args:
        data: a table, a record batch, a record batch reader or an iterable
            of tables or batches (all with the same schema).
        directory: the folder of the dataset (created if needed), or the URL
            of an object store prefix (``s3://bucket/train/``): each shard is
            uploaded once written, the manifest last.
        fields: column name -> Field, the columns to write; ``None``: every
            column, fields inferred from the schema (see the module's table).
        rows_per_shard: rows per shard (the last one may have fewer).
        overwrite: replace a stoker dataset already in ``directory`` (its
            shards are deleted once the new manifest is in place; other files
            are left alone); otherwise refuse it. A failed write leaves the
            previous dataset as it was.
        storage_options: for a URL: credentials, endpoint, retries (see
            :func:`stoker.remote.open_store`).

    Returns:
        The manifest's path (for a URL: the manifest's URL).

    Raises:
        ValueError: ``rows_per_shard`` < 1, or no rows at all.
        KeyError, TypeError: see :func:`infer_fields`.
        SampleError: a value a field refuses, naming the row (position in
            ``data``) and the column.
        FileExistsError: ``directory`` holds a dataset and not ``overwrite``.
    """
    if isinstance(rows_per_shard, bool) or not isinstance(rows_per_shard, (int, np.integer)) or rows_per_shard < 1:
        raise ValueError(f"rows_per_shard must be an int >= 1; got {rows_per_shard!r}")
    pa = require_pyarrow()
    resolved: dict[str, Field] | None = None
    pending: list[Any] = []  # Arrow tables
    shards: list[Path] = []
    pending_rows, written = 0, 0
    tx = open_transaction(directory, overwrite=overwrite, storage_options=storage_options)

    def flush(rows: int) -> None:
        nonlocal pending, pending_rows, written
        table = pa.concat_tables(pending) if len(pending) > 1 else pending[0]
        head, rest = table.slice(0, rows), table.slice(rows)
        path = tx.shard_path(len(shards))
        assert resolved is not None  # noqa: S101
        write_shard(head, path, resolved, first_row=written)
        finish_shard(tx, path)  # a URL's: uploaded now, the local file deleted
        shards.append(path)
        written += rows
        pending, pending_rows = ([rest] if rest.num_rows else []), rest.num_rows

    with contextlib.ExitStack() as stack:
        for table in _batches(data):
            if resolved is None:
                resolved = infer_fields(table.schema, fields)
                stack.enter_context(tx)  # the folder is touched once the fields are known to fit
            if table.num_rows == 0:
                continue
            pending.append(table.select(list(resolved)))
            pending_rows += table.num_rows
            while pending_rows >= rows_per_shard:
                flush(rows_per_shard)
        if pending_rows:
            flush(pending_rows)
        if not shards:
            raise ValueError(f"no rows to write into {directory}: the data is empty")
        manifest = tx.commit(shards)
    return tx.url + manifest.name if isinstance(tx, RemoteTransaction) else manifest


def from_parquet(
    source: str | os.PathLike[str],
    directory: str | os.PathLike[str],
    fields: Mapping[str, Field] | None = None,
    rows_per_shard: int = ROWS_PER_SHARD,
    *,
    overwrite: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> Path | str:
    """Convert a Parquet file or folder of Parquet files (read in sorted order) into stoker shards.

    Arguments, return value and errors as for :func:`write_arrow`; the rows are
    read a batch at a time (``pyarrow.dataset``), only the columns written.

    Example:
        >>> from_parquet("train-parquet/", "train-stoker/", {"image": RGBImageField(), "label": IntField()})  # doctest: +SKIP
    """
    require_pyarrow()
    import pyarrow.dataset as pads

    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"no Parquet file or folder at {path}")
    dataset = pads.dataset(str(path), format="parquet")
    if not dataset.files:
        raise FileNotFoundError(f"{path} holds no Parquet files")
    dataset = pads.dataset(sorted(dataset.files), format="parquet", schema=dataset.schema)
    resolved = infer_fields(dataset.schema, fields)
    batches = dataset.to_batches(columns=list(resolved), batch_size=min(int(rows_per_shard), 65536))
    return write_arrow(batches, directory, resolved, rows_per_shard, overwrite=overwrite, storage_options=storage_options)


def from_huggingface(
    dataset: Any,
    directory: str | os.PathLike[str],
    fields: Mapping[str, Field] | None = None,
    rows_per_shard: int = ROWS_PER_SHARD,
    *,
    overwrite: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> Path | str:
    """Convert a Hugging Face ``datasets.Dataset`` (its Arrow data, in its order) into stoker shards.

    ``Image()`` columns need ``fields={"image": RGBImageField(...)}``;
    ``ClassLabel`` columns are integers. A shuffled or selected dataset is
    written in its current order. Arguments, return value and errors as for
    :func:`write_arrow`.

    Example:
        >>> from_huggingface(load_dataset("cifar10", split="train"), "cifar-train/",  # doctest: +SKIP
        ...                  {"img": RGBImageField(), "label": IntField()})
    """
    if not (hasattr(dataset, "with_format") and hasattr(dataset, "features")):
        raise TypeError(f"expected a datasets.Dataset (Hugging Face); got {type(dataset).__name__}")
    arrow = dataset.with_format("arrow")
    step = min(int(rows_per_shard), 65536) if isinstance(rows_per_shard, (int, np.integer)) and rows_per_shard >= 1 else 1
    batches = (arrow[i : i + step] for i in range(0, len(arrow), step))
    return write_arrow(batches, directory, fields, rows_per_shard, overwrite=overwrite, storage_options=storage_options)
