"""Values that do not fit the field's dtype are refused, never narrowed, on every path of the writer."""

from __future__ import annotations

import math
import re
import struct
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import from_dtype

from stoker.errors import SampleError
from stoker.fields import Field, FloatField, IntField, NDArrayField, RaggedArrayField
from stoker.format import DatasetWriter, Reader


def write(path: Path, fields: dict[str, Field], samples: list[Any], num_workers: int = 1, **kwargs: Any) -> None:
    DatasetWriter(path, fields, num_workers=num_workers, progress=False).from_indexed_dataset(samples, **kwargs)


def read_all(path: Path) -> list[tuple[Any, ...]]:
    with Reader(path) as reader:
        reader.verify()
        return [reader.read(i) for i in range(len(reader))]


# ---- per sample (from_indexed_dataset), in this process and through worker processes -----------
NOT_FITTING = [
    # field, the bad value, (words of) the message
    (NDArrayField((), np.int8), np.int64(200), "got 200, outside the range of int8, [-128, 127]"),
    (NDArrayField((3,), np.int8), np.array([1, -129, 3]), "got -129 at (1,), outside the range of int8, [-128, 127]"),
    (NDArrayField((2,), np.uint8), np.array([5, 300], np.uint16), "got 300 at (1,), outside the range of uint8, [0, 255]"),
    (NDArrayField((1,), np.int64), np.array([2**63], np.uint64), "got 9223372036854775808 at (0,), outside the range of int64"),
    (NDArrayField((2,), np.int32), [1, 2**40], "got 1099511627776 at (1,), outside the range of int32"),
    (NDArrayField((2,), np.float32), np.array([0.5, 1e300]), "got 1e+300 at (1,), which overflows float32 to infinity"),
    (NDArrayField((2,), np.float32), np.array([-3.5e38, 0.0]), "got -3.5e+38 at (0,), which overflows float32"),
    (NDArrayField((1,), np.float16), np.array([70000]), "got 70000 at (0,), which overflows float16"),
    (NDArrayField((1,), np.complex64), np.array([1 + 1e300j]), "which overflows complex64"),
    (NDArrayField((2,), np.int8), np.array([1.0, 2.5]), "expected dtype int8; got float64, which does not cast safely"),
    (NDArrayField((1,), np.int32), np.array([np.nan]), "expected dtype int32; got float64, which does not cast safely"),
    (NDArrayField((1,), np.int32), np.array([np.inf]), "expected dtype int32; got float64, which does not cast safely"),
    (NDArrayField((1,), np.uint8), np.array([3]), "expected dtype uint8; got int64, which does not cast safely"),
    (NDArrayField((1,), np.bool_), np.array([1]), "expected dtype bool; got int64, which does not cast safely"),
    (RaggedArrayField(np.int8), np.array([1, 2, 200]), "got 200 at (2,), outside the range of int8"),
    (RaggedArrayField(np.float32, (2,)), np.array([[0, 0], [0, 1e39]]), "got 1e+39 at (1, 1), which overflows float32"),
    (IntField(), 2**63, "expected an integer that fits in int64, [-2**63, 2**63 - 1]; got 9223372036854775808"),
    (IntField(), -(2**63) - 1, "fits in int64"),
    (IntField(), 10**100, "got 10000000000000000000...00000000 (101 characters)"),
    (IntField(), np.uint64(2**63), "fits in int64"),
    (IntField(), 2.5, "expected an integer; got float 2.5"),
    (IntField(), 2.0, "expected an integer; got float 2.0"),
    (IntField(), float("nan"), "expected an integer; got float nan"),
    (IntField(), float("inf"), "expected an integer; got float inf"),
    (IntField(), True, "expected an integer; got bool True"),
    (IntField(), np.True_, "expected an integer; got bool"),
    (IntField(), np.array([True]), "expected an integer; got bool True"),
    (FloatField(), 10**400, "expected a real number that fits in float64 (largest finite magnitude 1.8e308); got 1000000000"),
    (FloatField(), -(10**400), "fits in float64"),
    (FloatField(), Fraction(10**400, 3), "fits in float64"),
    (FloatField(), np.longdouble("1e4000") if np.finfo(np.longdouble).max > 1e308 else 10**309, "fits in float64"),
    (FloatField(), False, "expected a real number; got bool False"),
]


@pytest.mark.parametrize("num_workers", [1, 2])
@pytest.mark.parametrize(("field", "value", "message"), NOT_FITTING)
def test_a_value_that_does_not_fit_names_sample_and_field(tmp_path: Path, num_workers: int, field: Field, value: Any, message: str) -> None:
    good: Any = {IntField: 0, FloatField: 0.0}.get(type(field))
    if isinstance(field, NDArrayField):
        good = np.zeros(field.shape, dtype=field.dtype)
    if isinstance(field, RaggedArrayField):
        good = np.zeros((1, *field.inner_shape), dtype=field.dtype)
    samples = [(good, i) for i in range(30)]
    samples[23] = (value, 23)
    with pytest.raises(SampleError, match=re.escape(message)) as info:
        write(tmp_path / "d.stoker", {"v": field, "i": IntField()}, samples, num_workers=num_workers, chunksize=4)
    assert (info.value.index, info.value.field) == (23, "v")
    assert str(info.value).startswith("sample 23, field 'v': ")
    assert list(tmp_path.iterdir()) == []


def test_the_index_is_that_of_the_source_dataset(tmp_path: Path) -> None:
    samples = [np.full(2, i, np.int64) for i in range(100)]
    samples[61][1] = 40000
    with pytest.raises(SampleError, match="got 40000 at") as info:
        write(tmp_path / "d.stoker", {"x": NDArrayField((2,), np.int16)}, samples, indices=[5, 61, 7], num_workers=2, chunksize=1)
    assert info.value.index == 61


def test_values_that_fit_are_kept(tmp_path: Path) -> None:
    """NaN and infinities stay what they are; float64 -> float32 rounds; the extremes of a range fit."""
    fields = {
        "f32": NDArrayField((5,), np.float32),
        "i8": NDArrayField((2,), np.int8),
        "u64": NDArrayField((1,), np.uint64),
        "i": IntField(),
        "f": FloatField(),
        "r": RaggedArrayField(np.uint8),
    }
    f32 = np.array([np.nan, np.inf, -np.inf, 0.1, 3.4e38])
    samples = [
        (f32, np.array([-128, 127]), np.array([2**64 - 1], np.uint64), np.uint64(2**63 - 1), 1e308, np.array([0, 255], np.uint16)),
        (f32, [True, False], np.array([0], np.uint8), -(2**63), float("-inf"), []),
        (np.arange(5, dtype=np.int64), np.array([5], np.int64).repeat(2), np.array([7], np.uint32), 3, 10**308, np.zeros(0)),
    ]
    write(tmp_path / "d.stoker", fields, samples)
    out = read_all(tmp_path / "d.stoker")
    np.testing.assert_array_equal(out[0][0], f32.astype(np.float32))
    assert np.isnan(out[0][0][0]) and out[0][0][1] == np.inf and out[0][0][2] == -np.inf
    assert out[0][0][3] == np.float32(0.1) and np.isfinite(out[0][0][4])
    np.testing.assert_array_equal(out[0][1], [-128, 127])
    assert int(out[0][2][0]) == 2**64 - 1
    assert (out[0][3], out[1][3], out[2][3]) == (2**63 - 1, -(2**63), 3)
    assert (out[0][4], out[1][4], out[2][4]) == (1e308, -math.inf, 1e308)
    np.testing.assert_array_equal(out[0][5], [0, 255])
    np.testing.assert_array_equal(out[1][1], [1, 0])
    assert out[2][5].shape == (0,)


# ---- vectorised (from_arrays) -----------------------------------------------------------------
def from_arrays(path: Path, fields: dict[str, Field], arrays: dict[str, Any], chunksize: int = 64) -> None:
    DatasetWriter(path, fields, num_workers=1, progress=False).from_arrays(arrays, chunksize=chunksize)


@pytest.mark.parametrize(
    ("field", "column", "bad", "message"),
    [
        (NDArrayField((2,), np.int8), np.zeros((300, 2), np.int64), 200, "got 200 at (1,), outside the range of int8"),
        (NDArrayField((2,), np.float32), np.zeros((300, 2)), 1e300, "got 1e+300 at (1,), which overflows float32"),
        (NDArrayField((2,), np.uint16), np.zeros((300, 2), np.uint64), 2**16, "got 65536 at (1,), outside the range of uint16"),
        (IntField(), np.zeros(300, np.uint64), 2**63, "fits in int64, [-2**63, 2**63 - 1]; got 9223372036854775808"),
        (IntField(), np.zeros(300, np.uint64), 2**64 - 1, "got 18446744073709551615"),
    ],
)
def test_from_arrays_names_the_exact_first_sample_that_does_not_fit(
    tmp_path: Path, field: Field, column: np.ndarray, bad: Any, message: str
) -> None:
    column.reshape(300, -1)[203, -1] = bad  # in the 4th chunk of 64, not at its start
    column.reshape(300, -1)[250, -1] = bad  # a later one is not the one named
    fields = {"v": field, "i": IntField()}
    with pytest.raises(SampleError, match=re.escape(message)) as info:
        from_arrays(tmp_path / "d.stoker", fields, {"v": column, "i": np.arange(300)})
    assert (info.value.index, info.value.field) == (203, "v")
    assert list(tmp_path.iterdir()) == []
    # the per-sample path refuses the same sample with the same message
    with pytest.raises(SampleError) as per_sample:
        write(tmp_path / "d.stoker", fields, list(zip(column, range(300))))
    assert (per_sample.value.index, str(per_sample.value)) == (203, str(info.value))


@pytest.mark.parametrize(
    ("field", "values", "bad_at", "message"),
    [
        # a list whose chunk turns into another dtype because of one value
        (IntField(), [*range(150), "seven", *range(49)], 150, "expected an integer; got str 'seven'"),
        (IntField(), [*range(100), 2.5, *range(99)], 100, "expected an integer; got float 2.5"),
        (NDArrayField((2,), np.float32), [[0.0, 0.0]] * 130 + [[0.0, 0.0, 0.0]] + [[0.0, 0.0]] * 69, 130, "shape (2,); got shape (3,)"),
        (NDArrayField((2,), np.float32), [[0.0, 0.0]] * 140 + [["a", "b"]] + [[0.0, 0.0]] * 59, 140, "got <U1, which does not cast"),
        # a whole array of a refused dtype: its first sample is the first refused
        (IntField(), np.zeros(200, bool), 0, "expected an integer; got bool"),
        (IntField(), np.zeros(200), 0, "expected an integer; got float64"),
        (FloatField(), np.zeros(200, complex), 0, "expected a real number; got complex128"),
    ],
)
def test_from_arrays_dtype_and_shape_errors_name_the_exact_sample(
    tmp_path: Path, field: Field, values: Any, bad_at: int, message: str
) -> None:
    with pytest.raises(SampleError, match=re.escape(message)) as info:
        from_arrays(tmp_path / "d.stoker", {"v": field}, {"v": values})
    assert (info.value.index, info.value.field) == (bad_at, "v")
    assert list(tmp_path.iterdir()) == []


def test_from_arrays_longdouble_overflowing_float64(tmp_path: Path) -> None:
    if np.finfo(np.longdouble).max <= np.finfo(np.float64).max:
        pytest.skip("longdouble is float64 on this platform")
    values = np.zeros(100, np.longdouble)
    values[77] = np.longdouble("1e400")
    with pytest.raises(SampleError, match="fits in float64") as info:
        from_arrays(tmp_path / "d.stoker", {"v": FloatField()}, {"v": values})
    assert info.value.index == 77


def test_from_arrays_and_per_sample_write_the_same_bytes_for_fitting_values(tmp_path: Path) -> None:
    n = 500
    fields = {"x": NDArrayField((3,), np.int8), "y": IntField(), "w": FloatField(), "f": NDArrayField((2,), np.float16)}
    x = np.arange(3 * n, dtype=np.int64).reshape(n, 3) % 256 - 128
    y = np.arange(n, dtype=np.uint64) + np.uint64(2**63 - 1 - n)
    w = np.linspace(-1e300, 1e300, n)
    f = np.stack([np.linspace(-65504, 65504, n), np.full(n, np.nan)], axis=1)
    from_arrays(tmp_path / "a.stoker", fields, {"x": x, "y": y, "w": w, "f": f}, chunksize=77)
    write(tmp_path / "b.stoker", fields, list(zip(x, y, w, f)))
    assert (tmp_path / "a.stoker").read_bytes() == (tmp_path / "b.stoker").read_bytes()
    with Reader(tmp_path / "a.stoker") as reader:
        assert reader.metadata["y/value"].tolist() == [int(v) for v in y]


# ---- property: accepted if and only if the value round-trips ---------------------------------------
NUMERIC = ["i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8"]


def fits(value: Any, dst: np.dtype) -> bool:
    """The reference: plain Python arithmetic, independent of numpy's casts."""
    if dst.kind in "iu":
        info = np.iinfo(dst)
        return info.min <= int(value) <= info.max
    x = float(value)
    if not math.isfinite(x) or dst.itemsize == 8:
        return True
    try:
        struct.pack({2: "<e", 4: "<f"}[dst.itemsize], x)  # raises OverflowError when x rounds to infinity
    except OverflowError:
        return False
    return True


@st.composite
def value_and_dtypes(draw: st.DrawFn) -> tuple[Any, np.dtype, np.dtype, int]:
    src, dst = np.dtype(draw(st.sampled_from(NUMERIC))), np.dtype(draw(st.sampled_from(NUMERIC)))
    assume(src != dst and np.can_cast(src, dst, casting="same_kind"))
    edges = []
    if src.kind in "iu" and dst.kind in "iu":
        info = np.iinfo(dst)
        edges = [v for v in (info.min - 1, info.min, info.max, info.max + 1) if np.iinfo(src).min <= v <= np.iinfo(src).max]
    value = draw(st.one_of(from_dtype(src), *(st.just(src.type(v)) for v in edges)) if edges else from_dtype(src))
    return value, src, dst, draw(st.integers(0, 4))


@settings(max_examples=300, deadline=None, database=None)
@given(value_and_dtypes())
def test_property_accepted_iff_the_value_fits(case: tuple[Any, np.dtype, np.dtype, int]) -> None:
    value, src, dst, at = case
    field = NDArrayField((5,), dst)
    arr = np.zeros(5, dtype=src)
    arr[at] = value
    ok = fits(value, dst)
    if ok:
        _, payload = field.encode(arr, 0)
        stored = np.frombuffer(payload, dtype=dst)
        if dst.kind in "iu":
            assert int(stored[at]) == int(value)
        elif math.isnan(float(value)):
            assert np.isnan(stored[at])
        else:
            assert np.isfinite(stored[at]) or not math.isfinite(float(value))
    else:
        with pytest.raises(ValueError, match=rf"at \({at},\)"):
            field.encode(arr, 0)
    # the vectorised path agrees, and names the sample
    column = np.zeros((4, 5), dtype=src)
    column[2] = arr
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "d.stoker"
        if ok:
            from_arrays(path, {"x": field}, {"x": column}, chunksize=3)
            with Reader(path) as reader:
                assert reader.read(2)[0].tobytes() == payload
        else:
            with pytest.raises(SampleError) as info:
                from_arrays(path, {"x": field}, {"x": column}, chunksize=3)
            assert info.value.index == 2


@settings(max_examples=200, deadline=None, database=None)
@given(st.one_of(st.integers(-(2**70), 2**70), st.integers(-(2**1100), 2**1100), st.floats(allow_nan=False)))
def test_property_int_and_float_fields(value: int | float) -> None:
    try:
        IntField().encode(value, 0)
        int_ok = True
    except (TypeError, ValueError):
        int_ok = False
    assert int_ok == (isinstance(value, int) and -(2**63) <= value < 2**63)
    try:
        (meta, _) = FloatField().encode(value, 0)
        float_ok = True
    except ValueError:
        float_ok = False
    # an int converts to the nearest float64; from half an ulp above the largest finite one it would round to infinity
    assert float_ok == (isinstance(value, float) or abs(value) < 2**1024 - 2**970)
    if float_ok:
        assert meta["value"] == float(value)
