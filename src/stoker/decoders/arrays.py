"""Decoders: the first operation of a field's pipeline, reading stored values into a batch.

``from stoker.decoders.arrays import IntDecoder, NDArrayDecoder, ...`` as in FFCV.
Every kernel is compiled once (``nogil``, cached on disk) and loops over the
batch with a parallel range.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numba
import numpy as np

from stoker import _numba_cache
from stoker.decoders._base import _check_type, _Decoder
from stoker.image._copy import copy, fill
from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.compiler import Compiler
from stoker.pipeline.state import State

_numba_cache.register()  # before its cache=True kernels: their compiled code is kept in stoker's private folder only

# ---- kernels: (indices, dst, arrays, storage, seeds) -----------------------------------


@numba.njit(nogil=True, parallel=True, cache=True)
def _decode_scalar(indices, dst, arrays, storage, seeds):  # type: ignore[no-untyped-def]
    values = arrays[0]
    for i in numba.prange(indices.shape[0]):
        dst[i, 0] = values[indices[i]]
    return dst


@numba.njit(nogil=True, parallel=True, cache=True)
def _decode_rows(indices, dst, arrays, storage, seeds):  # type: ignore[no-untyped-def]
    column = arrays[0]  # (num_samples, k)
    k = column.shape[1]
    out = dst.reshape((dst.shape[0], k))
    for i in numba.prange(indices.shape[0]):
        copy(out[i], 0, column[indices[i]], 0, k)
    return dst


@numba.njit(nogil=True, parallel=True, cache=True)
def _decode_rows_sharded(indices, dst, arrays, storage, seeds):  # type: ignore[no-untyped-def]
    # arrays: (shard_starts (k + 1,), each shard's column offset in storage (k,), [elements per row])
    starts, offsets = arrays[0], arrays[1]
    k = arrays[2][0]
    out = dst.reshape((dst.shape[0], k)).view(np.uint8)
    width = out.shape[1]
    for i in numba.prange(indices.shape[0]):
        j = indices[i]
        s = np.searchsorted(starts, j, side="right") - 1
        copy(out[i], 0, storage, offsets[s] + (j - starts[s]) * width, width)
    return dst


@numba.njit(nogil=True, parallel=True, cache=True)
def _decode_bytes(indices, dst, arrays, storage, seeds):  # type: ignore[no-untyped-def]
    ptrs, sizes = arrays[0], arrays[1]
    out = dst.reshape((dst.shape[0], -1)).view(np.uint8)
    width = out.shape[1]
    for i in numba.prange(indices.shape[0]):
        j = indices[i]
        start = ptrs[j]
        n = min(sizes[j], width)
        copy(out[i], 0, storage, start, n)
        fill(out[i], n, width - n, 0)
    return dst


# ---- element dtypes that Numba cannot type --------------------------------------------------


def _bit_twin(dtype: np.dtype) -> np.dtype | None:
    """The unsigned integer whose bits the kernels copy in place of ``dtype``'s, for a dtype Numba has no type for
    (``float16``: Numba has none on the CPU); ``None`` for the others."""
    return np.dtype(np.uint16) if dtype.kind == "f" and dtype.itemsize == 2 else None


def _declare(previous_state: State, shape: tuple[int, ...], dtype: np.dtype) -> tuple[State, AllocationQuery]:
    """An array decoder's output: ``(batch, *shape)`` of ``dtype``; in Python mode for a dtype with a bit twin (see
    :func:`_through_bits`), so that no compiled operation follows (Numba could not compile it)."""
    state = replace(previous_state, jit_mode=_bit_twin(dtype) is None, shape=shape, dtype=dtype)
    return state, AllocationQuery(shape, dtype)


def _through_bits(kernel: Callable[..., Any], dtype: np.dtype, column: bool) -> Callable[..., Any]:
    """``kernel``, or, for a ``dtype`` with a bit twin, a Python function that calls it compiled on twin views.

    Args:
        kernel: a decoder kernel that only copies elements (or bytes) of ``dtype``.
        dtype: the elements' dtype.
        column: whether ``arrays[0]`` is the field's column, of ``dtype`` too.
    """
    twin = _bit_twin(dtype)
    if twin is None:
        return kernel
    compiled = Compiler.compile(kernel)  # (the pipeline compiles only compiled-mode operations itself)

    def decode_bits(
        indices: np.ndarray, dst: np.ndarray, arrays: tuple[np.ndarray, ...], storage: np.ndarray, seeds: np.ndarray
    ) -> np.ndarray:
        if column:
            arrays = (arrays[0].view(twin), *arrays[1:])
        compiled(indices, dst.view(twin), arrays, storage, seeds)
        return dst

    return decode_bits


class IntDecoder(_Decoder):
    """Decodes an :class:`~stoker.fields.IntField` to ``(batch, 1)`` int64."""

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        _check_type(self, "int")
        return replace(previous_state, jit_mode=True, shape=(1,), dtype=np.dtype("<i8")), AllocationQuery((1,), np.dtype("<i8"))

    def generate_code(self) -> Callable[..., Any]:
        return _decode_scalar


class FloatDecoder(_Decoder):
    """Decodes a :class:`~stoker.fields.FloatField` to ``(batch, 1)`` float64."""

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        _check_type(self, "float")
        return replace(previous_state, jit_mode=True, shape=(1,), dtype=np.dtype("<f8")), AllocationQuery((1,), np.dtype("<f8"))

    def generate_code(self) -> Callable[..., Any]:
        return _decode_scalar


class NDArrayDecoder(_Decoder):
    """Decodes an :class:`~stoker.fields.NDArrayField` to ``(batch, *shape)`` of its dtype."""

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        field = _check_type(self, "ndarray")
        return _declare(previous_state, field.shape, field.dtype)

    def _sharded(self) -> bool:
        return getattr(self.reader, "num_shards", 1) > 1

    def loader_arrays(self) -> tuple[np.ndarray, ...]:
        if self._sharded():  # the column is one array per shard, inside the reader's storage
            reader: Any = self.reader
            elements = int(np.prod(self.field.shape, dtype=np.int64))  # type: ignore[union-attr]
            return (reader.shard_starts, reader.column_offsets(self.field_name), np.array([elements], dtype=np.int64))
        (column,) = super().loader_arrays()
        elements = int(np.prod(self.field.shape, dtype=np.int64))  # type: ignore[union-attr]
        return (column.reshape(column.shape[0], elements),)  # not -1: numpy cannot infer it from 0 rows or 0-element rows

    def generate_code(self) -> Callable[..., Any]:
        sharded = self._sharded()
        return _through_bits(_decode_rows_sharded if sharded else _decode_rows, self.field.dtype, column=not sharded)  # type: ignore[union-attr]


def _max_of(decoder: _Decoder, sub: str) -> int:
    assert decoder.reader is not None  # noqa: S101
    values = decoder.reader.metadata[f"{decoder.field_name}/{sub}"]
    largest = int(values.max()) if len(values) else 0
    if largest > len(decoder.reader.storage):  # only corrupt metadata (not yet validated: lazy) says so
        decoder.reader.validate_metadata()  # raises, naming the sample
    return largest


class BytesDecoder(_Decoder):
    """Decodes a :class:`~stoker.fields.BytesField` or :class:`~stoker.fields.JSONField`.

    Output: ``(batch, max_size)`` uint8, each value zero-padded to the largest
    value in the dataset (FFCV's layout). ``JSONField.unpack(batch)`` turns
    JSON batches back into Python values.
    """

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        _check_type(self, "bytes", "json")
        width = _max_of(self, "size")
        return replace(previous_state, jit_mode=True, shape=(width,), dtype=np.dtype("u1")), AllocationQuery((width,), np.dtype("u1"))

    def generate_code(self) -> Callable[..., Any]:
        return _decode_bytes


class RaggedArrayDecoder(_Decoder):
    """Decodes a :class:`~stoker.fields.RaggedArrayField` to ``(batch, max_length, *inner_shape)``.

    Rows past a sample's length are zero. The lengths themselves are in the
    field's metadata (``reader.metadata[name + '/length']``).

    Args:
        max_length: pad/crop to this length; default: the longest sample.
    """

    def __init__(self, max_length: int | None = None) -> None:
        if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer)) or max_length < 0):
            raise ValueError(f"max_length must be an int >= 0 (rows kept per sample) or None (the longest sample); got {max_length!r}")
        self.max_length = max_length

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        field = _check_type(self, "ragged")
        length = _max_of(self, "length") if self.max_length is None else int(self.max_length)
        return _declare(previous_state, (length, *field.inner_shape), field.dtype)

    def loader_arrays(self) -> tuple[np.ndarray, ...]:
        ptr, size, _length = super().loader_arrays()
        return (ptr, size)

    def generate_code(self) -> Callable[..., Any]:
        return _through_bits(_decode_bytes, self.field.dtype, column=False)  # type: ignore[union-attr]


__all__ = [
    "BytesDecoder",
    "FloatDecoder",
    "IntDecoder",
    "NDArrayDecoder",
    "RaggedArrayDecoder",
]
