"""The :class:`Field` base class: how a value is stored and read back.

A field stores each sample's value in one of three places (``Field.storage``):

* ``"meta"``: inside the sample's metadata row (ints, floats);
* ``"column"``: in a dense per-field array of fixed-size items (``NDArrayField``);
* ``"heap"``: in the heap, addressed from the metadata row by a 64-bit
  ``(ptr, size)`` pair (bytes, JSON, images, ragged arrays).

Values given in another dtype than the field's are converted only when that
keeps them: :func:`fit_problem` says why a value does not fit.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Literal, Protocol

import numpy as np

Storage = Literal["meta", "column", "heap"]

#: the metadata sub-columns that every heap field has, in this order
HEAP_POINTER: list[tuple[str, str]] = [("ptr", "<u8"), ("size", "<u8")]


class StoredArrays(Protocol):
    """What :meth:`Field.loader_arrays` reads: a :class:`~stoker.format.Reader`'s columns and metadata.

    A protocol, so that the schema names no class of the format above it (issue 31: layers point one way).
    """

    @property
    def metadata(self) -> np.ndarray: ...

    def column(self, name: str) -> np.ndarray: ...


class Field(ABC):
    """A typed column of a stoker dataset.

    Subclasses set ``TYPE_NAME`` (written to the field table) and ``storage``.
    """

    TYPE_NAME: ClassVar[str]
    storage: ClassVar[Storage]

    # ---- layout -------------------------------------------------------------
    def metadata_columns(self) -> list[tuple[str, str]]:
        """``(sub_name, dtype)`` pairs this field adds to the metadata row."""
        return HEAP_POINTER if self.storage == "heap" else []

    @property
    def column_itemsize(self) -> int:
        """Bytes per sample in this field's column (``"column"`` storage only)."""
        raise NotImplementedError(f"{type(self).__name__} has no column")

    # ---- (de)serialisation of the field's arguments -------------------------
    @abstractmethod
    def to_args(self) -> dict[str, Any]:
        """The arguments written to the field table (JSON-serialisable)."""

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> Field:
        """Rebuild the field from the arguments stored in the field table."""
        return cls(**args)

    # ---- writing --------------------------------------------------------------
    def write_problem(self) -> str | None:
        """Why a file holding this field could not be loaded back, or ``None`` when it can.

        :class:`~stoker.format.DatasetWriter` refuses a field with a problem
        before it writes anything, naming the field.
        """
        return None

    @abstractmethod
    def encode(self, value: Any, index: int) -> tuple[dict[str, Any], bytes | None]:
        """Turn one value into ``(metadata values, payload)``.

        ``payload`` goes to the column (exactly ``column_itemsize`` bytes) or to
        the heap; the writer fills ``ptr``/``size`` for heap fields. Raises
        ``ValueError``/``TypeError`` with a message saying what was expected.
        """

    # ---- reading ----------------------------------------------------------------
    @abstractmethod
    def read_one(self, meta: np.void, payload: memoryview | np.ndarray | None) -> Any:
        """Decode one stored value in Python (for inspection and tests)."""

    def default_decoder(self) -> Any:
        """The decoder (a :class:`~stoker.pipeline.Operation`) a loader uses when no pipeline is given for this field."""
        raise NotImplementedError(f"{type(self).__name__} has no default decoder")

    def loader_arrays(self, reader: StoredArrays, name: str) -> tuple[np.ndarray, ...]:
        """The arrays a compiled decoder reads for this field (views, no copies)."""
        if self.storage == "column":
            return (reader.column(name),)
        meta = reader.metadata
        return tuple(meta[f"{name}/{sub}"] for sub, _ in self.metadata_columns())

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.to_args() == other.to_args()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), repr(sorted(self.to_args().items()))))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.to_args().items())
        return f"{type(self).__name__}({args})"


def expect_bytes(value: Any) -> bytes:
    """Accept bytes-like values and 1-D uint8 arrays; raise ``TypeError`` otherwise."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, np.ndarray):
        if value.dtype != np.uint8 or value.ndim != 1:
            raise TypeError(f"expected bytes or a 1-D uint8 array; got an array of dtype {value.dtype} and shape {value.shape}")
        return value.tobytes()
    raise TypeError(f"expected bytes or a 1-D uint8 array; got {type(value).__name__}")


def unfit_mask(values: np.ndarray, dtype: np.dtype) -> np.ndarray | None:
    """The elements of ``values`` that converting to ``dtype`` would change beyond rounding.

    The conversion itself must be a ``same_kind`` cast (checked by the caller).
    An element does not fit when it is an integer outside ``dtype``'s range, or a
    finite number that would become infinite (``1e300`` into float32). NaN and
    infinities stay what they are; losing precision (float64 to float32, int64
    to float64) is rounding, and allowed.

    Returns:
        A boolean array of ``values``' shape, or ``None`` when no value of
        ``values.dtype`` can fail to fit.
    """
    src, dst = values.dtype, np.dtype(dtype)
    numeric = src.kind in "biufc" and dst.kind in "biufc"
    if src == dst or (numeric and np.can_cast(src, dst, casting="safe")):
        return None  # every value of src is a value of dst, up to rounding
    with np.errstate(all="ignore"):
        if not numeric:  # strings, dates: the value must survive the round trip
            back = values.astype(dst).astype(src)
            bad = np.asarray(back != values)
            return bad & ~np.isnat(values) if src.kind in "mM" else bad
        if dst.kind in "iu":  # from integers (other kinds do not cast same_kind to integers)
            have, room = np.iinfo(src), np.iinfo(dst)
            bad = np.zeros(values.shape, dtype=bool)
            if have.min < room.min:
                bad |= values < room.min
            if have.max > room.max:
                bad |= values > room.max
            return bad
        out = values.astype(dst)
        if dst.kind == "c" and src.kind == "c":
            return (np.isinf(out.real) & np.isfinite(values.real)) | (np.isinf(out.imag) & np.isfinite(values.imag))
        return np.isinf(out.real) & np.isfinite(values)


def fit_problem(values: np.ndarray, dtype: np.dtype) -> str | None:
    """Why ``values`` cannot be stored as ``dtype`` without changing a value, or ``None`` when it can.

    The message names the first element that does not fit, its position and
    the rule (see :func:`unfit_mask`).
    """
    dst = np.dtype(dtype)
    mask = unfit_mask(values, dst)
    if mask is None or not mask.any():
        return None
    where = tuple(int(i) for i in np.unravel_index(int(np.argmax(mask)), mask.shape))
    value = values[where].item() if values.ndim else values.item()
    at = f" at {where}" if values.ndim else ""
    if dst.kind in "iu":
        room = np.iinfo(dst)
        rule = f"outside the range of {dst}, [{room.min}, {room.max}]"
    elif dst.kind in "fc":
        rule = f"which overflows {dst} to infinity (largest finite magnitude {np.finfo(dst).max})"
    else:
        rule = f"which {dst} cannot hold unchanged"
    return f"expected values that fit in {dst}; got {value!r}{at}, {rule}"
