"""Decoders: the first operation of a field's pipeline, reading stored values into a batch.

``from stoker.fields.decoders import IntDecoder, NDArrayDecoder, ...`` as in FFCV.
Every kernel is compiled once (``nogil``, cached on disk) and loops over the
batch with a parallel range.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numba
import numpy as np

from stoker.fields._copy import copy, fill
from stoker.fields._decoder_base import _check_type, _Decoder
from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.state import State

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
        return replace(previous_state, jit_mode=True, shape=field.shape, dtype=field.dtype), AllocationQuery(field.shape, field.dtype)

    def loader_arrays(self) -> tuple[np.ndarray, ...]:
        (column,) = super().loader_arrays()
        return (column.reshape(column.shape[0], -1),)

    def generate_code(self) -> Callable[..., Any]:
        return _decode_rows


def _max_of(decoder: _Decoder, sub: str) -> int:
    assert decoder.reader is not None  # noqa: S101
    values = decoder.reader.metadata[f"{decoder.field_name}/{sub}"]
    return int(values.max()) if len(values) else 0


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
        self.max_length = max_length

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        field = _check_type(self, "ragged")
        length = _max_of(self, "length") if self.max_length is None else int(self.max_length)
        shape = (length, *field.inner_shape)
        return replace(previous_state, jit_mode=True, shape=shape, dtype=field.dtype), AllocationQuery(shape, field.dtype)

    def loader_arrays(self) -> tuple[np.ndarray, ...]:
        ptr, size, _length = super().loader_arrays()
        return (ptr, size)

    def generate_code(self) -> Callable[..., Any]:
        return _decode_bytes


from stoker.fields.rgb_image_decoders import CenterCropRGBImageDecoder, RandomResizedCropRGBImageDecoder, SimpleRGBImageDecoder  # noqa: E402

__all__ = [
    "BytesDecoder",
    "CenterCropRGBImageDecoder",
    "FloatDecoder",
    "IntDecoder",
    "NDArrayDecoder",
    "RaggedArrayDecoder",
    "RandomResizedCropRGBImageDecoder",
    "SimpleRGBImageDecoder",
]
