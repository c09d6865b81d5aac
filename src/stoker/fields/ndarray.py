"""Fixed-shape arrays stored as a dense column: :class:`NDArrayField`."""

from __future__ import annotations

from typing import Any

import numpy as np

from stoker.fields._compat import reexport
from stoker.fields.base import Field, fit_problem


def _looks_like_shape(value: Any) -> bool:
    return isinstance(value, (tuple, list, int, np.integer))


#: the element dtypes an array field can be loaded back in (little-endian; given big-endian, values are swapped when
#: written): those with a torch twin for ``ToTensor``. Long doubles have none (nor the same bits on every machine),
#: and dates, strings and raw bytes make no tensor.
LOADABLE_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(code) for code in ("?", "<i1", "<i2", "<i4", "<i8", "<u1", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8", "<c8", "<c16")
)


def dtype_problem(kind: str, dtype: np.dtype) -> str | None:
    """Why a ``kind`` field (its class name) of elements ``dtype`` could not be loaded back, or ``None`` when it can."""
    if dtype.newbyteorder("<") in LOADABLE_DTYPES:
        return None
    allowed = ", ".join(str(d) for d in LOADABLE_DTYPES)
    return (
        f"{kind} dtype must be one the loader reads back ({allowed}); got {dtype} "
        "(store dates as int64 with .view('int64'), text as a BytesField or JSONField)"
    )


def convert(arr: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``arr`` as ``dtype``, refusing conversions that would change a value.

    The dtypes must cast ``same_kind`` (int64 to int8 or float64 to float32
    may; float to int or signed to unsigned may not), and each element must fit:
    integers within the range, finite floats staying finite (rounding is fine).

    Raises:
        TypeError: the dtypes do not cast ``same_kind``.
        ValueError: an element does not fit; names it, its position and the range.
    """
    if arr.dtype == dtype:
        return arr
    if not np.can_cast(arr.dtype, dtype, casting="same_kind"):
        raise TypeError(f"expected dtype {dtype}; got {arr.dtype}, which does not cast safely")
    problem = fit_problem(arr, dtype)
    if problem is not None:
        raise ValueError(problem)
    return arr.astype(dtype)


class NDArrayField(Field):
    """A numpy array of one fixed shape and dtype per sample.

    Values are stored back to back in a dense column, so reading a batch is a
    plain gather of rows. FFCV's positional order ``NDArrayField(dtype, shape)``
    is accepted too.

    Args:
        shape: the shape of every value, e.g. ``(93,)``.
        dtype: the numpy dtype of every value (stored little-endian); the
            writer takes those of :data:`LOADABLE_DTYPES`, which load back as
            tensors of their torch twin (``float16`` included).

    Values of another dtype are converted when numpy's ``same_kind`` casting
    allows it and every element keeps its value (see :func:`convert`).
    """

    TYPE_NAME = "ndarray"
    storage = "column"

    def __init__(self, shape: tuple[int, ...] | int, dtype: Any) -> None:
        if not _looks_like_shape(shape) and _looks_like_shape(dtype):
            shape, dtype = dtype, shape  # FFCV's order: NDArrayField(dtype, shape)
        if isinstance(shape, (int, np.integer)):
            shape = (int(shape),)
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"NDArrayField shape must have non-negative sizes; got {shape}")
        dt = np.dtype(dtype)
        if dt.hasobject or dt.fields is not None or dt.subdtype is not None:
            raise ValueError(f"NDArrayField dtype must be a plain numeric dtype; got {dt}")
        self.shape: tuple[int, ...] = shape
        self.dtype: np.dtype = dt.newbyteorder("<") if dt.byteorder == ">" else dt

    @property
    def column_itemsize(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def to_args(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype.str}

    def write_problem(self) -> str | None:
        return dtype_problem(type(self).__name__, self.dtype)

    def encode(self, value: Any, index: int) -> tuple[dict[str, Any], bytes | None]:
        if hasattr(value, "numpy") and not isinstance(value, np.ndarray):  # torch tensor
            value = value.detach().cpu().numpy()
        arr = np.asarray(value)
        if arr.shape != self.shape:
            raise ValueError(f"expected an array of shape {self.shape}; got shape {arr.shape}")
        return {}, np.ascontiguousarray(convert(arr, self.dtype)).tobytes()

    def read_one(self, meta: np.void, payload: Any) -> np.ndarray:
        return np.frombuffer(payload, dtype=self.dtype).reshape(self.shape).copy()

    def default_decoder(self) -> Any:
        from stoker.decoders import NDArrayDecoder

        return NDArrayDecoder()


#: FFCV's names of this module defined elsewhere, re-exported lazily (see :mod:`stoker.fields._compat`): the
#: decoder is in the pipeline layer, and ``TorchTensorField`` (a subclass of NDArrayField) in its own module
_REEXPORTS = {
    "NDArrayDecoder": "stoker.decoders.arrays",
    "TorchTensorField": "stoker.fields.torch_tensor",
}


def __getattr__(name: str) -> Any:
    """``from stoker.fields.ndarray import NDArrayDecoder, TorchTensorField`` as in FFCV: the classes themselves, imported on first use."""
    return reexport(__name__, name, _REEXPORTS)
