"""Scalar fields stored in the metadata row: :class:`IntField`, :class:`FloatField`."""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from stoker.fields.base import Field


class IntField(Field):
    """One signed 64-bit integer per sample (class labels, ids)."""

    TYPE_NAME = "int"
    storage = "meta"

    def metadata_columns(self) -> list[tuple[str, str]]:
        return [("value", "<i8")]

    def to_args(self) -> dict[str, Any]:
        return {}

    def encode(self, value: Any, index: int) -> tuple[dict[str, Any], bytes | None]:
        if isinstance(value, np.ndarray) and value.size == 1 and value.dtype.kind in "iub":
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"expected an integer; got {type(value).__name__} {value!r:.60}")
        if not -(2**63) <= int(value) < 2**63:
            raise ValueError(f"expected an integer that fits in int64; got {value}")
        return {"value": int(value)}, None

    def read_one(self, meta: np.void, payload: Any) -> int:
        return int(meta["value"])

    def default_decoder(self) -> Any:
        from stoker.fields.decoders import IntDecoder

        return IntDecoder()


class FloatField(Field):
    """One 64-bit float per sample (regression targets, weights)."""

    TYPE_NAME = "float"
    storage = "meta"

    def metadata_columns(self) -> list[tuple[str, str]]:
        return [("value", "<f8")]

    def to_args(self) -> dict[str, Any]:
        return {}

    def encode(self, value: Any, index: int) -> tuple[dict[str, Any], bytes | None]:
        if isinstance(value, np.ndarray) and value.size == 1 and value.dtype.kind in "iuf":
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"expected a real number; got {type(value).__name__} {value!r:.60}")
        return {"value": float(value)}, None

    def read_one(self, meta: np.void, payload: Any) -> float:
        return float(meta["value"])

    def default_decoder(self) -> Any:
        from stoker.fields.decoders import FloatDecoder

        return FloatDecoder()
