"""Arrow types as stoker reads them (tensors, lists, bytes, Hugging Face images) and the check that refuses nulls.

Private to :mod:`stoker.convert.arrow`; ``pyarrow`` is imported when a function is called, not with this module.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from stoker.errors import SampleError

_INSTALL = "pip install pyarrow"


def require_pyarrow() -> Any:
    try:
        import pyarrow
    except ImportError as exc:  # pragma: no cover - pyarrow is a dependency of every caller's data
        raise ImportError(f"stoker.convert.arrow needs pyarrow: {_INSTALL}") from exc
    return pyarrow


# ---- Arrow types ---------------------------------------------------------------------------------
def tensor_shape(t: Any) -> tuple[tuple[int, ...], np.dtype] | None:
    """``(shape, dtype)`` of a fixed-shape tensor type (Arrow, Ray or Hugging Face), else ``None``."""
    pa = require_pyarrow()
    if isinstance(t, pa.FixedSizeListType):
        shape: list[int] = []
        while isinstance(t, pa.FixedSizeListType):
            shape.append(t.list_size)
            t = t.value_type
        return (tuple(shape), np.dtype(t.to_pandas_dtype())) if is_number(t) else None
    if not isinstance(t, pa.BaseExtensionType):
        return None
    shape_attr = getattr(t, "shape", None)
    if shape_attr is None or any(s is None for s in shape_attr):
        return None
    for attr in ("value_type", "scalar_type"):  # Arrow's and Ray's: a pyarrow type; Hugging Face's: a dtype name
        value = getattr(t, attr, None)
        if isinstance(value, pa.DataType) and is_number(value):
            return tuple(int(s) for s in shape_attr), np.dtype(value.to_pandas_dtype())
        if isinstance(value, str):
            return tuple(int(s) for s in shape_attr), np.dtype(value)
    return None


def is_number(t: Any) -> bool:
    pa = require_pyarrow()
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t))


def is_bytes(t: Any) -> bool:
    pa = require_pyarrow()
    return bool(
        pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_fixed_size_binary(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
    )


def is_list(t: Any) -> bool:
    pa = require_pyarrow()
    return bool(pa.types.is_list(t) or pa.types.is_large_list(t))


def is_image_struct(t: Any) -> bool:
    """Hugging Face's ``Image()`` storage: ``struct<bytes: binary, path: string>``."""
    pa = require_pyarrow()
    return bool(pa.types.is_struct(t) and t.get_field_index("bytes") >= 0)


# ---- nulls ---------------------------------------------------------------------------------------
def null_rows(arr: Any, deep: bool) -> np.ndarray:
    """The sorted positions of ``arr``'s values that are null or (``deep``) hold a null in their lists at any depth.

    Read from Arrow's validity before any value is converted (``to_numpy`` turns a
    null into NaN or an arbitrary integer); only an array whose validity counts
    nulls is looked at value by value, and then with numpy, not in Python.
    """
    pa = require_pyarrow()
    if isinstance(arr.type, pa.BaseExtensionType):
        arr = arr.storage
    rows = np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False)) if arr.null_count else np.zeros(0, np.intp)
    t = arr.type
    fixed = isinstance(t, pa.FixedSizeListType)
    if not deep or not len(arr) or not (fixed or is_list(t)):
        return rows
    if fixed:  # .values ignores the array's slice (its offset); a list array's offsets point into it
        start, stop = arr.offset * t.list_size, (arr.offset + len(arr)) * t.list_size
    else:
        offsets = arr.offsets.to_numpy()
        start, stop = int(offsets[0]), int(offsets[-1])
    inner = null_rows(arr.values.slice(start, stop - start), deep)
    if not len(inner):
        return rows
    parents = inner // t.list_size if fixed else np.searchsorted(offsets, inner + start, side="right") - 1
    return np.union1d(rows, parents)


def null_where(arr: Any, row: int) -> str:
    """Where value ``row`` of ``arr`` (one that :func:`null_rows` found) holds its first null: ``""`` (it is null), ``[1]``, ``[0][2]``."""
    pa = require_pyarrow()
    path = ""
    while True:
        if isinstance(arr.type, pa.BaseExtensionType):
            arr = arr.storage
        if not arr[row].is_valid:
            return path
        arr = arr[row].values
        row = int(null_rows(arr, True)[0])
        path += f"[{row}]"


def no_nulls(name: str, column: Any, deep: bool) -> None:
    """Refuse a column with a null value or (``deep``) a null inside a list value: the first such row is named."""
    first = 0
    for chunk in column.chunks:
        rows = null_rows(chunk, deep)
        if len(rows):
            where = null_where(chunk, int(rows[0]))
            problem = f"the value holds a null at position {where}" if where else "the value is null"
            raise SampleError(first + int(rows[0]), name, f"{problem}; stoker fields hold no nulls: fill or drop them first")
        first += len(chunk)
