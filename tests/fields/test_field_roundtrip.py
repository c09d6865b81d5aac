"""Every non-image field type, written with DatasetWriter and read back with Reader.read."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.errors import SampleError
from stoker.fields import FIELD_TYPES, BytesField, Field, FloatField, IntField, JSONField, NDArrayField, RaggedArrayField
from stoker.format import DatasetWriter, Reader, spec

from .._profile import examples


def roundtrip(path: Path, fields: dict[str, Field], samples: list[Any], **kwargs: Any) -> list[tuple[Any, ...]]:
    DatasetWriter(path, fields, num_workers=kwargs.pop("num_workers", 1), progress=False).from_indexed_dataset(samples, **kwargs)
    with Reader(path) as reader:
        reader.verify()
        assert len(reader) == len(samples)
        assert reader.fields == fields
        return [reader.read(i) for i in range(len(reader))]


def test_int_and_float(tmp_path: Path) -> None:
    ints = [0, 1, -1, 2**63 - 1, -(2**63), np.int32(7), np.uint8(255), np.array(3)]
    floats = [0.0, -0.0, 1.5, 1e300, float("inf"), float("-inf"), np.float32(0.25), 3]
    out = roundtrip(tmp_path / "d.stoker", {"i": IntField(), "f": FloatField()}, list(zip(ints, floats)))
    assert [o[0] for o in out] == [int(v) for v in ints]
    assert [o[1] for o in out] == [float(v) for v in floats]
    assert all(type(o[0]) is int and type(o[1]) is float for o in out)


def test_float_nan(tmp_path: Path) -> None:
    (value,) = roundtrip(tmp_path / "d.stoker", {"f": FloatField()}, [float("nan")])[0]
    assert np.isnan(value)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (IntField(), 1.5, "expected an integer"),
        (IntField(), True, "expected an integer"),
        (IntField(), 2**63, "fits in int64"),
        (FloatField(), "1.0", "expected a real number"),
        (JSONField(), float("nan"), "JSON-serialisable"),
        (JSONField(), {1, 2}, "JSON-serialisable"),
        (BytesField(), "text", "expected bytes"),
        (BytesField(), np.zeros(3, dtype=np.int16), "1-D uint8"),
        (NDArrayField((3,), np.float32), np.zeros(4), "shape (3,)"),
        (NDArrayField((3,), np.int32), np.zeros(3), "does not cast safely"),
        (RaggedArrayField(np.int64, (4,)), np.zeros((2, 3)), "shape (length, 4)"),
        (RaggedArrayField(np.int64), np.zeros(2), "does not cast safely"),
    ],
)
def test_invalid_value_names_index_and_field(tmp_path: Path, field: Field, value: Any, message: str) -> None:
    good: Any = {IntField: 0, FloatField: 0.0, JSONField: 0, BytesField: b""}.get(type(field))
    if isinstance(field, NDArrayField):
        good = np.zeros(field.shape, dtype=field.dtype)
    if isinstance(field, RaggedArrayField):
        good = np.zeros((0, *field.inner_shape), dtype=field.dtype)
    samples = [(good,), (good,), (value,)]
    path = tmp_path / "d.stoker"
    with pytest.raises(SampleError, match=re.escape(message)) as info:
        DatasetWriter(path, {"v": field}, num_workers=1, progress=False).from_indexed_dataset(samples)
    assert info.value.index == 2
    assert info.value.field == "v"
    assert "sample 2, field 'v'" in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_bytes_empty_and_varied(tmp_path: Path) -> None:
    values = [b"", b"\x00", bytes(range(256)), bytearray(b"abc"), memoryview(b"xyz"), np.frombuffer(b"ffcv", dtype=np.uint8), b""]
    out = roundtrip(tmp_path / "d.stoker", {"b": BytesField()}, [(v,) for v in values])
    for (got,), want in zip(out, values):
        assert isinstance(got, np.ndarray) and got.dtype == np.uint8
        assert got.tobytes() == bytes(want)


def test_sample_larger_than_a_data_checksum_block(tmp_path: Path) -> None:
    big = np.random.default_rng(0).integers(0, 256, spec.DATA_BLOCK_SIZE + 12345, dtype=np.uint8).tobytes()
    out = roundtrip(tmp_path / "d.stoker", {"i": IntField(), "b": BytesField()}, [(0, b"a"), (1, big), (2, b"")])
    assert out[1][1].tobytes() == big
    assert out[0][1].tobytes() == b"a" and out[2][1].tobytes() == b""
    with Reader(tmp_path / "d.stoker") as reader:
        assert reader.data_size > spec.DATA_BLOCK_SIZE
        assert spec.num_blocks(reader.data_size, reader.data_block_size) == 2


def test_json_values(tmp_path: Path) -> None:
    values = [
        {"caption": "Ein Hund läuft über die Straße", "ja": "犬が走る", "emoji": "🐕"},
        [1, 2.5, None, True, "x"],
        "naïve",
        0,
        {},
        {"nested": {"deep": [[], {"ß": "ü"}]}},
    ]
    out = roundtrip(tmp_path / "d.stoker", {"j": JSONField()}, values)
    assert [o[0] for o in out] == values
    with Reader(tmp_path / "d.stoker") as reader:  # stored as UTF-8, not \\u escapes
        assert "Straße".encode() in reader.storage.tobytes()


def test_json_unpack_of_padded_batch() -> None:
    raw = [b'{"a":1}', b'"\xc3\xa9"']
    batch = np.zeros((2, 10), dtype=np.uint8)
    for row, data in zip(batch, raw):
        row[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    assert JSONField.unpack(batch) == [{"a": 1}, "é"]


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((3,), np.float32),
        ((2, 3, 4), np.uint8),
        ((), np.int64),
        ((5,), np.float16),
        ((2, 2), np.complex64),
        ((4,), np.bool_),
        ((0,), np.float64),
    ],
)
def test_ndarray(tmp_path: Path, shape: tuple[int, ...], dtype: Any) -> None:
    rng = np.random.default_rng(1)
    values = [(rng.standard_normal(shape) * 10).astype(dtype) for _ in range(7)]
    out = roundtrip(tmp_path / "d.stoker", {"x": NDArrayField(shape, dtype)}, values)
    for (got,), want in zip(out, values):
        assert got.shape == shape and got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got, want)


def test_ndarray_ffcv_positional_order_and_casts() -> None:
    assert NDArrayField(np.dtype("float32"), (93,)) == NDArrayField(shape=(93,), dtype=np.float32)
    assert NDArrayField("int16", 5) == NDArrayField((5,), np.int16)
    assert NDArrayField(np.float64, (2, 2)).shape == (2, 2)
    assert NDArrayField((3,), ">f4").dtype == np.dtype("<f4")
    with pytest.raises(ValueError, match="non-negative"):
        NDArrayField((-1,), np.float32)
    with pytest.raises(ValueError, match="plain numeric dtype"):
        NDArrayField((1,), object)


def test_ndarray_casts_same_kind_and_torch(tmp_path: Path) -> None:
    import torch

    values = [np.arange(3, dtype=np.float64), [1.0, 2.0, 3.0], torch.arange(3, dtype=torch.float32)]
    out = roundtrip(tmp_path / "d.stoker", {"x": NDArrayField(np.float32, (3,))}, [(v,) for v in values])
    np.testing.assert_array_equal(out[0][0], [0, 1, 2])
    np.testing.assert_array_equal(out[1][0], [1, 2, 3])
    np.testing.assert_array_equal(out[2][0], [0, 1, 2])


def test_ragged_zero_length_rows_and_inner_shape(tmp_path: Path) -> None:
    boxes = [np.zeros((0, 4), np.float32), np.arange(8, dtype=np.float32).reshape(2, 4), [], np.ones((1, 4), np.float64), np.zeros((0, 4))]
    tokens = [np.array([], dtype=np.int32), np.arange(5, dtype=np.int32), np.array([7], np.int16), [1, 2], np.zeros(0)]
    fields = {"boxes": RaggedArrayField(np.float32, inner_shape=(4,)), "tokens": RaggedArrayField(np.int32)}
    out = roundtrip(tmp_path / "d.stoker", fields, list(zip(boxes, tokens)))
    for (got_b, got_t), want_b, want_t in zip(out, boxes, tokens):
        assert got_b.dtype == np.float32 and got_b.shape == (len(want_b), 4)
        assert got_t.dtype == np.int32 and got_t.shape == (len(want_t),)
        np.testing.assert_array_equal(got_b, np.asarray(want_b).reshape(-1, 4))
        np.testing.assert_array_equal(got_t, want_t)
    with Reader(tmp_path / "d.stoker") as reader:
        np.testing.assert_array_equal(reader.metadata["boxes/length"], [0, 2, 0, 1, 0])
        np.testing.assert_array_equal(reader.metadata["boxes/size"], [0, 32, 0, 16, 0])


def test_single_field_list_values_are_values(tmp_path: Path) -> None:
    """A one-field dataset may return a list as the value (JSON, ragged), or a 1-tuple."""
    out = roundtrip(tmp_path / "j.stoker", {"j": JSONField()}, [[1, 2], [3], ([4],), []])
    assert [o[0] for o in out] == [[1, 2], [3], [4], []]
    out = roundtrip(tmp_path / "r.stoker", {"r": RaggedArrayField(np.int64)}, [[5], [1, 2, 3]])
    assert [o[0].tolist() for o in out] == [[5], [1, 2, 3]]


@settings(max_examples=examples(ci=10, long=25), deadline=None, database=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=3, max_size=3), max_size=6),
            st.binary(max_size=300),
            st.text(max_size=20),
        ),
        min_size=1,
        max_size=30,
    ),
    st.sampled_from([1, 2]),
)
def test_property_ragged_bytes_json(samples: list[tuple[list[list[int]], bytes, str]], num_workers: int) -> None:
    fields = {"r": RaggedArrayField(np.int32, (3,)), "b": BytesField(), "s": JSONField()}
    data = [(np.asarray(r, dtype=np.int32).reshape(-1, 3), b, {"s": s}) for r, b, s in samples]
    with tempfile.TemporaryDirectory() as tmp:
        out = roundtrip(Path(tmp) / "d.stoker", fields, data, num_workers=num_workers, chunksize=7)
    for (r, b, s), (want_r, want_b, want_s) in zip(out, data):
        np.testing.assert_array_equal(r, want_r)
        assert r.shape == want_r.shape
        assert b.tobytes() == want_b
        assert s == want_s


def test_fields_args_roundtrip_through_the_field_table() -> None:
    fields: list[Field] = [
        IntField(),
        FloatField(),
        BytesField(),
        JSONField(),
        NDArrayField((2, 3), np.uint16),
        RaggedArrayField(np.float32, (4,)),
    ]
    for field in fields:
        cls = FIELD_TYPES[field.TYPE_NAME]
        assert cls.from_args(field.to_args()) == field
        assert hash(cls.from_args(field.to_args())) == hash(field)


def test_from_arrays_fixed_size_matches_from_indexed_dataset(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1000, 5)).astype(np.float32)
    y = rng.integers(0, 9, 1000)
    w = rng.random(1000)
    fields = {"x": NDArrayField((5,), np.float32), "y": IntField(), "w": FloatField()}
    DatasetWriter(tmp_path / "a.stoker", fields, num_workers=1, progress=False).from_arrays({"x": x, "y": y, "w": w}, chunksize=300)
    DatasetWriter(tmp_path / "b.stoker", fields, num_workers=1, progress=False).from_indexed_dataset(list(zip(x, y, w)))
    assert (tmp_path / "a.stoker").read_bytes() == (tmp_path / "b.stoker").read_bytes()
    with Reader(tmp_path / "a.stoker") as reader:
        reader.verify()
        np.testing.assert_array_equal(reader.column("x"), x)
        np.testing.assert_array_equal(reader.metadata["y/value"], y)
        got = reader.read(123)
        np.testing.assert_array_equal(got[0], x[123])
        assert got[1:] == (int(y[123]), float(w[123]))


def test_from_arrays_mixed_with_heap_fields(tmp_path: Path) -> None:
    n = 300
    x = np.arange(n * 2, dtype=np.int16).reshape(n, 2)
    blobs = [bytes([i % 256]) * (i % 5) for i in range(n)]
    ragged = [np.arange(i % 4, dtype=np.float64) for i in range(n)]
    fields = {"x": NDArrayField((2,), np.int16), "b": BytesField(), "r": RaggedArrayField(np.float64), "y": IntField()}
    DatasetWriter(tmp_path / "d.stoker", fields, num_workers=2, progress=False).from_arrays(
        {"x": x, "b": blobs, "r": ragged, "y": np.arange(n)}
    )
    with Reader(tmp_path / "d.stoker") as reader:
        reader.verify()
        for i in (0, 1, 4, 150, n - 1):
            gx, gb, gr, gy = reader.read(i)
            np.testing.assert_array_equal(gx, x[i])
            assert gb.tobytes() == blobs[i]
            np.testing.assert_array_equal(gr, ragged[i])
            assert gy == i


def test_from_arrays_rejects_bad_input(tmp_path: Path) -> None:
    fields = {"x": NDArrayField((2,), np.float32), "y": IntField()}
    writer = DatasetWriter(tmp_path / "d.stoker", fields, num_workers=1, progress=False)
    with pytest.raises(ValueError, match="missing"):
        writer.from_arrays({"x": np.zeros((3, 2))})
    with pytest.raises(ValueError, match="same length"):
        writer.from_arrays({"x": np.zeros((3, 2)), "y": np.zeros(4, dtype=int)})
    with pytest.raises(SampleError, match="shape") as info:
        writer.from_arrays({"x": np.zeros((3, 3)), "y": np.zeros(3, dtype=int)})
    assert info.value.field == "x"
    with pytest.raises(SampleError, match="expected an integer") as info:
        writer.from_arrays({"x": np.zeros((3, 2)), "y": np.zeros(3)})
    assert info.value.field == "y"
    assert list(tmp_path.iterdir()) == []
