"""Arrays whose first dimension varies per sample: :class:`RaggedArrayField`."""

from __future__ import annotations

from typing import Any

import numpy as np

from stoker.fields.base import Field
from stoker.fields.ndarray import convert, dtype_problem


class RaggedArrayField(Field):
    """A ``(length, *inner_shape)`` array per sample, ``length`` free (0 allowed).

    For token sequences (``inner_shape=()``) or bounding boxes
    (``inner_shape=(4,)``).

    Args:
        dtype: the numpy dtype of the elements (those the writer takes: see
            :data:`~stoker.fields.ndarray.LOADABLE_DTYPES`).
        inner_shape: the shape of one row; every sample shares it.

    Values of another dtype are converted as by :class:`NDArrayField`: only
    when each element keeps its value.
    """

    TYPE_NAME = "ragged"
    storage = "heap"

    def __init__(self, dtype: Any, inner_shape: tuple[int, ...] = ()) -> None:
        dt = np.dtype(dtype)
        if dt.hasobject or dt.fields is not None or dt.subdtype is not None:
            raise ValueError(f"RaggedArrayField dtype must be a plain numeric dtype; got {dt}")
        self.dtype: np.dtype = dt.newbyteorder("<") if dt.byteorder == ">" else dt
        self.inner_shape: tuple[int, ...] = tuple(int(s) for s in inner_shape)
        if any(s < 0 for s in self.inner_shape):
            raise ValueError(f"RaggedArrayField inner_shape must be non-negative; got {self.inner_shape}")

    def metadata_columns(self) -> list[tuple[str, str]]:
        return [("ptr", "<u8"), ("size", "<u8"), ("length", "<u8")]

    @property
    def row_bytes(self) -> int:
        """Bytes in one row of ``inner_shape``."""
        return int(np.prod(self.inner_shape, dtype=np.int64)) * self.dtype.itemsize

    def to_args(self) -> dict[str, Any]:
        return {"dtype": self.dtype.str, "inner_shape": list(self.inner_shape)}

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> RaggedArrayField:
        return cls(args["dtype"], tuple(args["inner_shape"]))

    def write_problem(self) -> str | None:
        return dtype_problem(type(self).__name__, self.dtype)

    def encode(self, value: Any, index: int) -> tuple[dict[str, Any], bytes | None]:
        if hasattr(value, "numpy") and not isinstance(value, np.ndarray):
            value = value.detach().cpu().numpy()
        arr = np.asarray(value)
        if arr.ndim == 1 and arr.size == 0 and self.inner_shape:
            arr = arr.reshape((0, *self.inner_shape))
        if arr.ndim != 1 + len(self.inner_shape) or arr.shape[1:] != self.inner_shape:
            expected = "(length" + "".join(f", {s}" for s in self.inner_shape) + ")"
            raise ValueError(f"expected an array of shape {expected}; got shape {arr.shape}")
        # an empty value has no element to convert: [] (float64 to numpy) fits any dtype
        arr = arr.astype(self.dtype) if arr.size == 0 else convert(arr, self.dtype)
        return {"length": arr.shape[0]}, np.ascontiguousarray(arr).tobytes()

    def read_one(self, meta: np.void, payload: Any) -> np.ndarray:
        shape = (int(meta["length"]), *self.inner_shape)
        return np.frombuffer(bytes(payload), dtype=self.dtype).reshape(shape)

    def default_decoder(self) -> Any:
        from stoker.decoders import RaggedArrayDecoder

        return RaggedArrayDecoder()
