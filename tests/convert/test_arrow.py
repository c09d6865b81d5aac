"""Arrow input: Parquet folders and Hugging Face datasets into stoker shards; errors."""

from __future__ import annotations

import io
import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stoker.convert.arrow import from_huggingface, from_parquet, infer_fields, write_arrow
from stoker.dataset.shards import MANIFEST_NAME
from stoker.errors import SampleError
from stoker.fields import BytesField, FloatField, IntField, JSONField, NDArrayField, RaggedArrayField, RGBImageField
from tests.convert._readback import loader_ids, read_shards

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

N = 2500


def image_of(i: int) -> np.ndarray:
    return ((np.arange(4 * 5 * 3).reshape(4, 5, 3) * 7 + i) % 256).astype(np.uint8)


def table(start: int, stop: int) -> Any:
    ids = np.arange(start, stop)
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "score": pa.array(ids / 4, pa.float32()),
            "vec": pa.FixedSizeListArray.from_arrays(pa.array((ids[:, None] * np.array([1, -1, 2])).astype(np.int16).reshape(-1)), 3),
            "tokens": pa.array([list(range(i % 5)) for i in ids], pa.list_(pa.int32())),
            "text": pa.array([f"row {i}" for i in ids]),
            "flag": pa.array(ids % 3 == 0),
        }
    )


@pytest.fixture(scope="module")
def parquet_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("parquet")
    bounds = [0, 700, 1900, N]  # three files of different sizes, row groups of 300
    for k, (a, b) in enumerate(itertools.pairwise(bounds)):
        pq.write_table(table(a, b), folder / f"part-{k}.parquet", row_group_size=300)
    return folder


def check_row(row: tuple, i: int) -> None:
    ident, score, vec, tokens, text, flag = row
    assert ident == i
    assert score == np.float32(i / 4)
    np.testing.assert_array_equal(vec, np.array([i, -i, 2 * i], dtype=np.int16))
    np.testing.assert_array_equal(tokens, np.arange(i % 5, dtype=np.int32))
    assert bytes(text) == f"row {i}".encode()
    assert flag == int(i % 3 == 0)


def test_inferred_fields() -> None:
    fields = infer_fields(table(0, 3).schema)
    assert fields == {
        "id": IntField(),
        "score": FloatField(),
        "vec": NDArrayField((3,), np.int16),
        "tokens": RaggedArrayField(np.int32),
        "text": BytesField(),
        "flag": IntField(),
    }


def test_arrows_own_fixed_shape_tensor_column(tmp_path: Path) -> None:
    """``pa.fixed_shape_tensor`` (a ``BaseExtensionType``, not an ``ExtensionType``): inferred and written, in two chunks."""
    values = (np.arange(5 * 2 * 3) * 1.5).astype(np.float32).reshape(5, 2, 3)
    chunks = [pa.FixedShapeTensorArray.from_numpy_ndarray(values[:2]), pa.FixedShapeTensorArray.from_numpy_ndarray(values[2:])]
    data = pa.table({"t": pa.chunked_array(chunks), "id": pa.array(np.arange(5))})
    assert infer_fields(data.schema) == {"t": NDArrayField((2, 3), np.float32), "id": IntField()}
    write_arrow(data, tmp_path / "s")
    rows = read_shards(tmp_path / "s")[1]
    np.testing.assert_array_equal(np.stack([r[0] for r in rows]), values)
    assert [r[1] for r in rows] == list(range(5))


def test_parquet_folder_every_row_once_and_equal(parquet_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "shards"
    manifest = from_parquet(parquet_folder, out, rows_per_shard=1000)
    assert manifest == out / MANIFEST_NAME
    sizes, rows = read_shards(out)
    assert sizes == [1000, 1000, 500]
    assert len(rows) == N
    for i, row in enumerate(rows):
        check_row(row, i)
    np.testing.assert_array_equal(loader_ids(out, "id"), np.arange(N))


def test_parquet_selected_columns_in_the_given_order(parquet_folder: Path, tmp_path: Path) -> None:
    fields = {"text": JSONField(), "id": IntField()}  # a string column as JSON; other columns left out
    from_parquet(parquet_folder, tmp_path / "s", fields, rows_per_shard=N)
    sizes, rows = read_shards(tmp_path / "s")
    assert sizes == [N]
    assert rows[17] == ("row 17", 17)


def test_huggingface_dataset_with_images(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    from PIL import Image

    def png(i: int) -> bytes:
        buf = io.BytesIO()
        Image.fromarray(image_of(i)).save(buf, format="PNG")
        return buf.getvalue()

    n = 300
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=7), "id": datasets.Value("int64")})
    ds = datasets.Dataset.from_dict(
        {"image": [{"bytes": png(i), "path": None} for i in range(n)], "label": [i % 7 for i in range(n)], "id": list(range(n))},
        features=features,
    )
    ds = ds.select(list(range(n))[::-1])  # an indices mapping: written in the dataset's current order
    from_huggingface(ds, tmp_path / "hf", {"image": RGBImageField(), "label": IntField(), "id": IntField()}, rows_per_shard=128)
    sizes, rows = read_shards(tmp_path / "hf")
    assert sizes == [128, 128, 44]
    for k, (image, label, ident) in enumerate(rows):
        i = n - 1 - k
        assert ident == i and label == i % 7
        np.testing.assert_array_equal(image, image_of(i))


def test_huggingface_inferred_fields(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({"x": datasets.Array2D((1, 2), "float32"), "y": datasets.Value("int8")})
    ds = datasets.Dataset.from_dict({"x": [[[1.0, 2.0]], [[3.0, 4.0]], [[5.0, 6.0]]], "y": [0, 1, 2]}, features=features)
    assert infer_fields(ds.data.schema) == {"x": NDArrayField((1, 2), np.float32), "y": IntField()}
    from_huggingface(ds, tmp_path / "hf")
    _, rows = read_shards(tmp_path / "hf")
    assert [int(r[1]) for r in rows] == [0, 1, 2]
    np.testing.assert_array_equal(rows[2][0], np.array([[5.0, 6.0]], np.float32))


# ---- errors ------------------------------------------------------------------------------------
def test_unknown_column_is_named(parquet_folder: Path, tmp_path: Path) -> None:
    with pytest.raises(KeyError, match=r"column 'label', which the data does not have; its columns are \['id', 'score'"):
        from_parquet(parquet_folder, tmp_path / "s", {"id": IntField(), "label": IntField()})
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    ("column", "field", "message"),
    [
        ("text", IntField(), r"column 'text' has Arrow type string, which the field IntField\(\) cannot hold"),
        ("score", IntField(), r"column 'score' has Arrow type float, which the field IntField\(\) cannot hold"),
        ("vec", NDArrayField((4,), np.int16), r"column 'vec' holds arrays of shape \(3,\), the field .* wants shape \(4,\)"),
        ("id", BytesField(), r"column 'id' has Arrow type int64, which the field BytesField\(\) cannot hold"),
    ],
)
def test_mismatched_fields_are_refused_before_writing(column: str, field: object, message: str, tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=message):
        write_arrow(table(0, 10), tmp_path / "s", {column: field})  # type: ignore[dict-item]
    assert not (tmp_path / "s").exists()


def test_a_column_without_an_inferred_field_says_what_to_pass(tmp_path: Path) -> None:
    t = pa.table({"meta": pa.array([{"a": 1}, {"a": 2}])})
    with pytest.raises(TypeError, match=r"column 'meta' has Arrow type struct<a: int64>.*pass fields=\{'meta': ...\} \(JSONField\(\)"):
        write_arrow(t, tmp_path / "s")
    write_arrow(t, tmp_path / "s", {"meta": JSONField()})
    assert read_shards(tmp_path / "s")[1] == [({"a": 1},), ({"a": 2},)]


def test_null_and_refused_values_name_the_row(tmp_path: Path) -> None:
    t = pa.table({"id": pa.array([1, 2, None, 4], pa.int64())})
    with pytest.raises(SampleError, match=r"sample 6, field 'id': the value is null"):
        write_arrow([table(0, 4).select(["id"]), t], tmp_path / "s", rows_per_shard=5)
    assert not list((tmp_path / "s").glob("*"))  # no shard and no manifest left behind
    big = pa.table({"id": pa.array([1, 2**63 + 5], pa.uint64())})
    with pytest.raises(SampleError, match=r"sample 3, field 'id'"):
        write_arrow([table(0, 2).select(["id"]), big], tmp_path / "s2", rows_per_shard=2)


def test_an_existing_dataset_is_kept_unless_overwrite(tmp_path: Path) -> None:
    write_arrow(table(0, 10), tmp_path / "s", {"id": IntField()}, rows_per_shard=3)
    assert len(list((tmp_path / "s").glob("shard-*.stoker"))) == 4
    with pytest.raises(FileExistsError, match="already holds a stoker dataset"):
        write_arrow(table(0, 10), tmp_path / "s", {"id": IntField()})
    write_arrow(table(5, 10), tmp_path / "s", {"id": IntField()}, overwrite=True)
    sizes, rows = read_shards(tmp_path / "s")
    assert sizes == [5] and [r[0] for r in rows] == [5, 6, 7, 8, 9]
    assert len(list((tmp_path / "s").glob("shard-*.stoker"))) == 1


def test_a_failed_overwrite_keeps_the_previous_dataset(tmp_path: Path) -> None:
    """Issue 23 finding 2: overwrite=True deleted the old dataset first, and a failed write left an empty folder."""
    out = tmp_path / "s"
    write_arrow(table(0, 10), out, {"id": IntField()}, rows_per_shard=3)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    big = pa.table({"id": pa.array([1, 2**63 + 5], pa.uint64())})  # row 5 does not fit in an IntField: the third shard fails
    with pytest.raises(SampleError, match=r"sample 5, field 'id'"):
        write_arrow([table(0, 4).select(["id"]), big], out, {"id": IntField()}, rows_per_shard=2, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the old dataset, nothing of the failed write
    assert [r[0] for r in read_shards(out)[1]] == list(range(10))
    np.testing.assert_array_equal(loader_ids(out, "id"), np.arange(10))


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="rows_per_shard must be an int >= 1; got 0"):
        write_arrow(table(0, 3), tmp_path / "s", rows_per_shard=0)
    with pytest.raises(ValueError, match="the data is empty"):
        write_arrow(table(0, 3).slice(0, 0), tmp_path / "e")
    with pytest.raises(FileNotFoundError, match="no Parquet file or folder"):
        from_parquet(tmp_path / "missing", tmp_path / "s")
    with pytest.raises(TypeError, match=r"expected a datasets\.Dataset"):
        from_huggingface([1, 2], tmp_path / "s")
