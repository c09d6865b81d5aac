"""Arrow input: a null anywhere in a value (inside a list, a fixed-size list, nested lists) is refused, naming the row and
the column; image bytes that do not decode name the column. Lists without nulls round-trip exactly through the Loader."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from stoker.convert.arrow import write_arrow
from stoker.errors import SampleError
from stoker.fields import JSONField, NDArrayField, RaggedArrayField, RGBImageField
from tests._profile import examples
from tests.convert._readback import read_shards

pa: Any = pytest.importorskip("pyarrow")

NO_NULLS = "; stoker fields hold no nulls: fill or drop them first"


class Tensor(pa.ExtensionType):
    """A fixed-shape tensor type as Ray's: ``shape`` and ``value_type`` attributes, a fixed-size list as storage."""

    def __init__(self) -> None:
        self.shape, self.value_type = (2,), pa.int64()
        super().__init__(pa.list_(pa.int64(), 2), "stoker.test.tensor")

    def __arrow_ext_serialize__(self) -> bytes:
        return b""

    @classmethod
    def __arrow_ext_deserialize__(cls, storage_type: Any, serialized: bytes) -> Tensor:
        return cls()


def refusal(row: int, column: str, path: str) -> str:
    problem = f"the value holds a null at position {path}" if path else "the value is null"
    return f"sample {row}, field '{column}': {problem}{NO_NULLS}"


def expect_refused(data: Any, out: Path, message: str, **kwargs: Any) -> None:
    """``write_arrow`` raises exactly ``message``, converts no null into a value on the way (no NaN cast warning) and leaves nothing behind."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's "invalid value encountered in cast": a null turned into a number
        with pytest.raises(SampleError) as caught:
            write_arrow(data, out, **kwargs)
    assert str(caught.value) == message
    assert not list(out.glob("*"))  # no shard and no manifest left behind


@pytest.mark.parametrize(
    ("values", "arrow_type", "fields", "row", "path"),
    [
        ([[1, None], [3]], None, None, 0, "[1]"),  # QA's B1: stored as -2**63
        ([[1.5, 2.0], [3.0, None, 4.0]], pa.list_(pa.float32()), None, 1, "[1]"),  # QA's B2: stored as NaN
        ([[1], [], [2, 3, None]], pa.large_list(pa.int16()), None, 2, "[2]"),
        ([[1, 2], [3, None]], pa.list_(pa.int64(), 2), None, 1, "[1]"),  # said "got float64", naming row 0
        ([[[1, 2], [3, 4]], [[5, 6], [None, 8]]], pa.list_(pa.list_(pa.int64(), 2), 2), None, 1, "[1][0]"),
        ([[[1, 2], [3, 4]], [[5, 6], None]], pa.list_(pa.list_(pa.int64(), 2), 2), None, 1, "[1]"),
        ([[1, 2], [3, None]], pa.list_(pa.uint8()), {"c": RGBImageField()}, 1, "[1]"),  # was a bare TypeError
        ([[[[1, 2, 3]]], [[[4, 5, 6]], [[7, None, 9]]]], pa.list_(pa.list_(pa.list_(pa.uint8()))), {"c": RGBImageField()}, 1, "[1][0][1]"),
        ([[1, 2], [None, 4]], pa.list_(pa.int32()), {"c": RaggedArrayField(np.int64)}, 1, "[0]"),
        ([[1, 2], None], pa.list_(pa.int64()), None, 1, ""),  # the list itself: as before
    ],
)
def test_a_null_inside_a_list_is_refused_naming_row_column_and_position(
    values: list[Any], arrow_type: Any, fields: Any, row: int, path: str, tmp_path: Path
) -> None:
    expect_refused(pa.table({"c": pa.array(values, arrow_type)}), tmp_path / "s", refusal(row, "c", path), fields=fields)


def test_the_row_named_is_the_position_in_the_data(tmp_path: Path) -> None:
    """Rows of earlier shards and earlier tables count: the row named is the null's position in all the data given."""
    head = pa.table({"l": pa.array([[7], [8, 9], []] * 2, pa.list_(pa.int64()))})
    tail = pa.table({"l": pa.array([[1], [2, 3, None]], pa.list_(pa.int64()))})
    expect_refused([head, tail], tmp_path / "s", refusal(7, "l", "[2]"), rows_per_shard=4)
    expect_refused(pa.concat_tables([head, tail]), tmp_path / "t", refusal(7, "l", "[2]"), rows_per_shard=100)


def test_a_null_inside_a_fixed_shape_tensor_is_refused(tmp_path: Path) -> None:
    storage = pa.array([[1, 2], [3, 4], [5, None]], pa.list_(pa.int64(), 2))
    tensors = pa.ExtensionArray.from_storage(Tensor(), storage)
    expect_refused(pa.table({"t": tensors}), tmp_path / "s", refusal(2, "t", "[1]"))
    write_arrow(pa.table({"t": tensors.slice(0, 2)}), tmp_path / "t")
    assert [r[0].tolist() for r in read_shards(tmp_path / "t")[1]] == [[1, 2], [3, 4]]


def test_nulls_outside_the_rows_written_are_not_refused(tmp_path: Path) -> None:
    """A slice's child array (``.values``) holds the values of rows outside it: those are not the data's."""
    lists = pa.array([[None], [1, 2], [3], None, [None, 5]], pa.list_(pa.int64())).slice(1, 2)
    fixed = pa.array([[None, 1], [2, 3], [4, 5], [6, None]], pa.list_(pa.int64(), 2)).slice(1, 2)
    write_arrow(pa.table({"l": lists, "f": fixed}), tmp_path / "s")
    rows = read_shards(tmp_path / "s")[1]
    np.testing.assert_array_equal(rows[0][0], [1, 2])
    np.testing.assert_array_equal(rows[1][0], [3])
    np.testing.assert_array_equal(np.stack([r[1] for r in rows]), [[2, 3], [4, 5]])


def test_json_keeps_a_null_inside_a_value(tmp_path: Path) -> None:
    """JSON has null: a JSONField stores a null inside a value as it is (a null value itself is still refused)."""
    write_arrow(pa.table({"j": pa.array([[1, None], [2]], pa.list_(pa.int64()))}), tmp_path / "s", {"j": JSONField()})
    assert read_shards(tmp_path / "s")[1] == [([1, None],), ([2],)]
    expect_refused(pa.table({"j": pa.array([[1], None])}), tmp_path / "t", refusal(1, "j", ""), fields={"j": JSONField()})


def test_image_bytes_that_do_not_decode_name_the_column(tmp_path: Path) -> None:
    """QA's A13: 'sample 0: dataset[0] raised UnidentifiedImageError: cannot identify image file <_io.BytesIO object at 0x...>'."""
    for k, column in enumerate([pa.array([b"notanimage"]), pa.array([{"bytes": b"notanimage", "path": None}])]):
        out = tmp_path / f"s{k}"
        with pytest.raises(SampleError) as caught:
            write_arrow(pa.table({"im": column}), out, {"im": RGBImageField()})
        assert str(caught.value) == "sample 0, field 'im': cannot decode the image bytes: not an image that Pillow can identify"
        assert not list(out.glob("*"))


# ---- property: nulls at random places of random list columns ---------------------------------------
KINDS = {  # name: (Arrow type of a column, the shape of a value: None for a ragged list)
    "list_i64": (pa.list_(pa.int64()), None),
    "large_list_f32": (pa.large_list(pa.float32()), None),
    "list_i16": (pa.list_(pa.int16()), None),
    "fixed3_i32": (pa.list_(pa.int32(), 3), (3,)),
    "fixed2x2_f64": (pa.list_(pa.list_(pa.float64(), 2), 2), (2, 2)),
}


@st.composite
def list_values(draw: st.DrawFn, kind: str, nulls: bool) -> Any:
    """One value of a column of ``kind``: a list (of lists); with ``nulls``, a null here and there (or none)."""
    shape = KINDS[kind][1]
    number = st.integers(-100, 100)
    if nulls:
        number = st.one_of(number, st.none())

    def build(dims: tuple[int, ...] | None) -> Any:
        if dims is None:
            return draw(st.lists(number, max_size=5))
        if len(dims) == 1:
            return [draw(number) for _ in range(dims[0])]
        return [None if nulls and draw(st.integers(0, 9)) == 0 else build(dims[1:]) for _ in range(dims[0])]

    return None if nulls and draw(st.integers(0, 9)) == 0 else build(shape)


def first_null(value: Any) -> str | None:
    """The position of the first null in a value, depth first (``""``: the value is null); ``None`` when it holds none."""
    if value is None:
        return ""
    if isinstance(value, list):
        for i, item in enumerate(value):
            inner = first_null(item)
            if inner is not None:
                return f"[{i}]{inner}"
    return None


@st.composite
def columns(draw: st.DrawFn, nulls: bool) -> tuple[dict[str, str], dict[str, list[Any]], int]:
    """Column name -> kind, column name -> values, the number of rows."""
    rows = draw(st.integers(1, 12))
    kinds = draw(st.lists(st.sampled_from(sorted(KINDS)), min_size=1, max_size=3))
    names = {f"c{k}": kind for k, kind in enumerate(kinds)}
    values = {name: draw(st.lists(list_values(kind, nulls), min_size=rows, max_size=rows)) for name, kind in names.items()}
    return names, values, rows


def arrow_table(draw: Callable[[st.SearchStrategy[Any]], Any], names: dict[str, str], values: dict[str, list[Any]]) -> Any:
    """The columns as Arrow data: each cut into chunks, each chunk a slice of a longer array (with nulls around it)."""
    out = {}
    for name, kind in names.items():
        cuts = sorted(draw(st.lists(st.integers(0, len(values[name])), max_size=3)))
        chunks = []
        for a, b in itertools.pairwise([0, *cuts, len(values[name])]):
            before = draw(st.lists(list_values(kind, True), max_size=2))  # nulls around a slice are not the data's
            after = draw(st.lists(list_values(kind, True), max_size=2))
            chunks.append(pa.array(before + values[name][a:b] + after, KINDS[kind][0]).slice(len(before), b - a))
        out[name] = pa.chunked_array(chunks, KINDS[kind][0])
    return pa.table(out)


def leaf_dtype(arrow_type: Any) -> np.dtype:
    while pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or pa.types.is_fixed_size_list(arrow_type):
        arrow_type = arrow_type.value_type
    return np.dtype(arrow_type.to_pandas_dtype())


@given(st.data(), columns(nulls=True), st.integers(1, 12))
def test_nulls_at_random_places_are_refused_naming_row_column_and_position(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject, drawn: Any, rows_per_shard: int
) -> None:
    names, values, rows = drawn
    table = arrow_table(data.draw, names, values)
    out = tmp_path_factory.mktemp("nulls") / "s"
    # the first shard with a null; in it, the first column with one (a shard's columns are converted in order); its first row
    for start in range(0, rows, rows_per_shard):
        shard = range(start, min(start + rows_per_shard, rows))
        found = [(name, row, path) for name in names for row in shard if (path := first_null(values[name][row])) is not None]
        if found:
            name, row, path = found[0]
            expect_refused(table, out, refusal(row, name, path), rows_per_shard=rows_per_shard)
            event("refused")
            return
    event("no null drawn: written")
    write_arrow(table, out, rows_per_shard=rows_per_shard)
    stored = read_shards(out)[1]
    for k, name in enumerate(names):
        assert [r[k].tolist() for r in stored] == values[name]


@settings(max_examples=examples(8, 100))  # each runs Loaders (8 in the suite: ~3 s; the long profile 100)
@given(st.data(), columns(nulls=False), st.integers(1, 12))
def test_lists_without_nulls_round_trip_exactly_through_the_loader(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject, drawn: Any, rows_per_shard: int
) -> None:
    from stoker.loader.loader import Loader

    names, values, rows = drawn
    out = tmp_path_factory.mktemp("lists") / "s"
    write_arrow(arrow_table(data.draw, names, values), out, rows_per_shard=rows_per_shard)
    for name, kind in names.items():  # a Loader per column: a pipeline compiled per kind, not per combination of kinds
        with Loader(out, batch_size=rows, num_workers=1, pipelines={other: None for other in names if other != name}) as loader:
            ((tensor,),) = list(loader)
        arrow_type, shape = KINDS[kind]
        if shape is None:  # a ragged field: rows padded with zeros to the longest; the lengths are in the metadata
            assert isinstance(loader.reader.fields[name], RaggedArrayField)
            want = np.zeros((rows, max(len(v) for v in values[name])), leaf_dtype(arrow_type))
            for i, v in enumerate(values[name]):
                want[i, : len(v)] = v
        else:
            assert isinstance(loader.reader.fields[name], NDArrayField)
            want = np.array(values[name], leaf_dtype(arrow_type)).reshape(rows, *shape)
        got = np.asarray(tensor)
        assert (got.dtype, got.shape) == (want.dtype, want.shape), name
        np.testing.assert_array_equal(got, want)
    sizes, stored = read_shards(out)
    assert sizes == [len(range(s, min(s + rows_per_shard, rows))) for s in range(0, rows, rows_per_shard)]
    for k, (name, kind) in enumerate(names.items()):
        if KINDS[kind][1] is None:
            assert [len(r[k]) for r in stored] == [len(v) for v in values[name]]
