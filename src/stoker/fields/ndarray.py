"""Fixed-shape arrays stored as a dense column: :class:`NDArrayField`."""

from __future__ import annotations

from typing import Any

import numpy as np

from stoker.fields.base import Field


def _looks_like_shape(value: Any) -> bool:
    return isinstance(value, (tuple, list, int, np.integer))


class NDArrayField(Field):
    """A numpy array of one fixed shape and dtype per sample.

    Values are stored back to back in a dense column, so reading a batch is a
    plain gather of rows. FFCV's positional order ``NDArrayField(dtype, shape)``
    is accepted too.

    Args:
        shape: the shape of every value, e.g. ``(93,)``.
        dtype: the numpy dtype of every value (stored little-endian).
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

    def encode(self, value: Any, index: int) -> tuple[dict[str, Any], bytes | None]:
        if hasattr(value, "numpy") and not isinstance(value, np.ndarray):  # torch tensor
            value = value.detach().cpu().numpy()
        arr = np.asarray(value)
        if arr.shape != self.shape:
            raise ValueError(f"expected an array of shape {self.shape}; got shape {arr.shape}")
        if arr.dtype != self.dtype:
            if not np.can_cast(arr.dtype, self.dtype, casting="same_kind"):
                raise TypeError(f"expected dtype {self.dtype}; got {arr.dtype}, which does not cast safely")
            arr = arr.astype(self.dtype)
        return {}, np.ascontiguousarray(arr, dtype=self.dtype).tobytes()

    def read_one(self, meta: np.void, payload: Any) -> np.ndarray:
        return np.frombuffer(payload, dtype=self.dtype).reshape(self.shape).copy()

    def default_decoder(self) -> Any:
        from stoker.fields.decoders import NDArrayDecoder

        return NDArrayDecoder()
