"""Scalar fields stored in the metadata row: :class:`IntField`, :class:`FloatField`."""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from stoker.fields._compat import reexport
from stoker.fields.base import Field


def _short(value: object) -> str:
    """``str(value)``, cut in the middle when long (a 400-digit integer)."""
    text = str(value)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-8:]} ({len(text)} characters)"


def _is_infinite(value: numbers.Real) -> bool:
    """Whether ``value`` itself is an infinity (as opposed to a finite number too large for a float64)."""
    if isinstance(value, numbers.Integral):
        return False
    if isinstance(value, np.floating):
        return bool(np.isinf(value))
    try:
        return math.isinf(value)
    except OverflowError:
        return False


class IntField(Field):
    """One signed 64-bit integer per sample (class labels, ids).

    Accepts Python and numpy integers (not ``bool``, not floats, even integral
    ones) within the int64 range.
    """

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
            raise ValueError(f"expected an integer that fits in int64, [-2**63, 2**63 - 1]; got {_short(value)}")
        return {"value": int(value)}, None

    def read_one(self, meta: np.void, payload: Any) -> int:
        return int(meta["value"])

    def default_decoder(self) -> Any:
        from stoker.fields.decoders import IntDecoder

        return IntDecoder()


class FloatField(Field):
    """One 64-bit float per sample (regression targets, weights).

    Accepts real numbers (not ``bool``); a finite number too large for a
    float64 (a huge Python ``int``, a ``longdouble``) is refused, not stored as
    infinity. NaN and infinities are stored as given.
    """

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
        try:
            stored = float(value)
        except OverflowError:  # a Python int or Fraction beyond 1.8e308
            stored = math.inf
        if math.isinf(stored) and not _is_infinite(value):
            raise ValueError(f"expected a real number that fits in float64 (largest finite magnitude 1.8e308); got {_short(value)}")
        return {"value": stored}, None

    def read_one(self, meta: np.void, payload: Any) -> float:
        return float(meta["value"])

    def default_decoder(self) -> Any:
        from stoker.fields.decoders import FloatDecoder

        return FloatDecoder()


#: FFCV's decoders of this module, defined in the pipeline layer and re-exported lazily (see :mod:`stoker.fields._compat`)
_REEXPORTS = {
    "FloatDecoder": "stoker.fields.decoders",
    "IntDecoder": "stoker.fields.decoders",
}


def __getattr__(name: str) -> Any:
    """``from stoker.fields.basics import FloatDecoder`` as in FFCV: the decoder class itself, imported on first use."""
    return reexport(__name__, name, _REEXPORTS)
