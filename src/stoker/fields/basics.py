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


def _scalar(value: Any) -> Any:
    """A one-element numpy array or torch tensor as the Python number it holds; anything else unchanged."""
    if isinstance(value, np.ndarray):
        return value.item() if value.size == 1 and value.dtype.kind in "biuf" else value
    if type(value).__module__.startswith("torch") and callable(getattr(value, "numel", None)):  # a tensor, torch not imported here
        return value.item() if value.numel() == 1 and not value.is_complex() else value
    return value


def _kind(value: Any) -> str:
    """How to name ``value``'s type in an error: ``float 2.5``, ``float32 tensor 2.5``."""
    return f"{type(value).__name__} {value!r:.60}"


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

    Accepts Python and numpy integers, and one-element integer arrays and
    tensors (a ``TensorDataset``'s 0-d labels), within the int64 range; not
    ``bool``, and not floats, even integral ones: a float is refused rather
    than truncated.
    """

    TYPE_NAME = "int"
    storage = "meta"

    def metadata_columns(self) -> list[tuple[str, str]]:
        return [("value", "<i8")]

    def to_args(self) -> dict[str, Any]:
        return {}

    def encode(self, value: Any, index: int) -> tuple[dict[str, Any], bytes | None]:
        given, value = value, _scalar(value)
        if isinstance(value, numbers.Real) and not isinstance(value, (numbers.Integral, bool)):
            source = f"{type(given).__name__} holding {value!r:.60}" if given is not value else _kind(value)
            raise TypeError(
                f"expected an integer; got {source}: IntField does not round or truncate floats "
                "(convert with int(), or .long() for a tensor, if that is what you want; or use a FloatField)"
            )
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"expected an integer; got {_kind(value)}")  # a one-element array: its element
        if not -(2**63) <= int(value) < 2**63:
            raise ValueError(f"expected an integer that fits in int64, [-2**63, 2**63 - 1]; got {_short(value)}")
        return {"value": int(value)}, None

    def read_one(self, meta: np.void, payload: Any) -> int:
        return int(meta["value"])

    def default_decoder(self) -> Any:
        from stoker.decoders import IntDecoder

        return IntDecoder()


class FloatField(Field):
    """One 64-bit float per sample (regression targets, weights).

    Accepts real numbers (not ``bool``), numpy scalars, and one-element
    arrays and tensors (a ``TensorDataset``'s 0-d targets); a finite number
    too large for a float64 (a huge Python ``int``, a ``longdouble``) is
    refused, not stored as infinity. NaN and infinities are stored as given.
    """

    TYPE_NAME = "float"
    storage = "meta"

    def metadata_columns(self) -> list[tuple[str, str]]:
        return [("value", "<f8")]

    def to_args(self) -> dict[str, Any]:
        return {}

    def encode(self, value: Any, index: int) -> tuple[dict[str, Any], bytes | None]:
        value = _scalar(value)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"expected a real number; got {_kind(value)}")
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
        from stoker.decoders import FloatDecoder

        return FloatDecoder()


#: FFCV's decoders of this module, defined in the pipeline layer and re-exported lazily (see :mod:`stoker.fields._compat`)
_REEXPORTS = {
    "FloatDecoder": "stoker.decoders.arrays",
    "IntDecoder": "stoker.decoders.arrays",
}


def __getattr__(name: str) -> Any:
    """``from stoker.fields.basics import FloatDecoder`` as in FFCV: the decoder class itself, imported on first use."""
    return reexport(__name__, name, _REEXPORTS)
