"""Every dtype the writer accepts for an array field loads back through the Loader's default pipeline, unchanged.

A reference model in plain numpy (the values written), driven by hypothesis: the
dtype (either byte order), the shapes, the number of samples, the batch size and
whether the pipelines are compiled. Dtypes that no pipeline could load are
refused by the writer, naming the field and the dtype.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from stoker.dataset.shards import write_shards
from stoker.fields import NDArrayField, RaggedArrayField
from stoker.fields.ndarray import LOADABLE_DTYPES
from stoker.loader import Loader
from stoker.pipeline.compiler import Compiler
from stoker.writer import DatasetWriter

from .._profile import examples

#: what the writer accepts: every numeric dtype torch has a twin of, in either byte order
ACCEPTED = [np.dtype(code) for code in ("?", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16")]

#: what it refuses: no tensor holds them (or, for the long doubles, not the same bits on every machine)
REFUSED = ["longdouble", "clongdouble", "datetime64[s]", "timedelta64[ns]", "S4", "U2", "V8"]


def test_the_accepted_dtypes_are_the_loadable_ones() -> None:
    assert sorted(LOADABLE_DTYPES, key=str) == sorted(ACCEPTED, key=str)


def _load(path: Path, batch_size: int, compiled: bool) -> dict[str, np.ndarray]:
    with Compiler.enabled(compiled):
        loader = Loader(path, batch_size=batch_size, num_workers=1, named=True)
    batches = [{k: v.numpy().copy() for k, v in batch.items()} for batch in loader]  # tensors: the default pipelines end in ToTensor
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def _arrays(dtype: np.dtype, shape: tuple[int, ...]) -> st.SearchStrategy[np.ndarray]:
    """Arrays of any bits (NaNs with payloads, subnormals, infinities); booleans only ``False``/``True``."""
    if dtype.kind == "b":
        return hnp.arrays(dtype, shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return st.binary(min_size=nbytes, max_size=nbytes).map(lambda raw: np.frombuffer(raw, dtype=dtype).reshape(shape))


def _same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    return got.dtype == want.dtype.newbyteorder("=") and got.tobytes() == np.ascontiguousarray(want, got.dtype).tobytes()


@st.composite
def datasets(draw: st.DrawFn) -> tuple[np.dtype, tuple[int, ...], list[np.ndarray], tuple[int, ...], list[np.ndarray]]:
    dtype = draw(st.sampled_from(ACCEPTED))
    dtype = dtype.newbyteorder(draw(st.sampled_from("<>"))) if dtype.itemsize > 1 else dtype
    n = draw(st.integers(1, 9))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=2, min_side=1, max_side=3))
    fixed = list(draw(_arrays(dtype, (n, *shape))))
    inner = draw(hnp.array_shapes(min_dims=0, max_dims=1, min_side=1, max_side=3))
    ragged = [draw(_arrays(dtype, (draw(st.integers(0, 3)), *inner))) for _ in range(n)]
    return dtype, shape, fixed, inner, ragged


@settings(max_examples=examples(ci=5, long=30), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=datasets(), batch_size=st.integers(1, 4), compiled=st.booleans())
def test_every_accepted_dtype_loads_back(data: tuple[Any, ...], batch_size: int, compiled: bool) -> None:
    dtype, shape, fixed, inner, ragged = data
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "d.stoker"
        fields = {"x": NDArrayField(shape, dtype), "r": RaggedArrayField(dtype, inner)}
        DatasetWriter(path, fields, num_workers=0, progress=False).from_indexed_dataset(list(zip(fixed, ragged)))
        out = _load(path, batch_size, compiled)
    want = dtype.newbyteorder("=")
    assert out["x"].dtype == want and out["x"].shape == (len(fixed), *shape)
    assert _same_bits(out["x"], np.stack(fixed))
    longest = max(len(v) for v in ragged)
    assert out["r"].dtype == want and out["r"].shape == (len(ragged), longest, *inner)
    for got, value in zip(out["r"], ragged):
        assert _same_bits(got[: len(value)], value)
        assert not got[len(value) :].any()  # zero-padded past the sample's length


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "shards"])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_float16_loads_back_bit_for_bit(tmp_path: Path, compiled: bool, sharded: bool) -> None:
    bits = np.arange(0, 2**16, 7, dtype=np.uint16)  # every class of half: zeros, subnormals, normals, infinities, NaNs
    values = bits[: len(bits) // 12 * 12].view(np.float16).reshape(-1, 4, 3)
    fields = {"x": NDArrayField((4, 3), np.float16)}
    if sharded:  # the decoder reads each shard's column inside the reader's storage
        path = tmp_path / "shards"
        write_shards(path, fields, {"x": values}, samples_per_shard=100, num_workers=0, progress=False)
    else:
        path = tmp_path / "d.stoker"
        DatasetWriter(path, fields, num_workers=0, progress=False).from_arrays({"x": values})
    out = _load(path, 64, compiled)["x"]
    assert out.dtype == np.float16  # from torch.float16 tensors
    np.testing.assert_array_equal(out.view(np.uint16), values.view(np.uint16))


@pytest.mark.parametrize("field_type", [NDArrayField, RaggedArrayField])
@pytest.mark.parametrize("dtype", REFUSED)
def test_writer_refuses_dtypes_that_cannot_load(tmp_path: Path, field_type: type, dtype: str) -> None:
    field = NDArrayField((2,), dtype) if field_type is NDArrayField else RaggedArrayField(dtype)
    with pytest.raises(ValueError, match=rf"field 'v': {field_type.__name__} dtype .*; got {re.escape(str(field.dtype))}"):
        DatasetWriter(tmp_path / "d.stoker", {"ok": NDArrayField((2,), np.float32), "v": field}, num_workers=0, progress=False)
    assert list(tmp_path.iterdir()) == []
