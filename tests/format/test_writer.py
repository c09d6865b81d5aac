"""DatasetWriter: layout, determinism across worker counts, and bad samples."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from stoker.errors import SampleError
from stoker.fields import BytesField, Field, FloatField, IntField, JSONField, NDArrayField, RaggedArrayField, RGBImageField
from stoker.format import DatasetWriter, Reader, spec
from stoker.writer import DatasetWriter as FFCVPathWriter


class Mixed:
    """Every field type; values depend only on the index."""

    fields: ClassVar[dict[str, Field]] = {
        "x": NDArrayField((3, 2), np.float32),
        "label": IntField(),
        "weight": FloatField(),
        "blob": BytesField(),
        "meta": JSONField(),
        "tokens": RaggedArrayField(np.int32),
        "image": RGBImageField(write_mode="proportion", compress_probability=0.5),
    }

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        rng = np.random.default_rng(i)
        y, x = np.mgrid[0 : 4 + i % 9, 0 : 3 + i % 11]
        image = np.stack([(x * 20 + i) % 256, (y * 15) % 256, (x + y) * 7 % 256], axis=-1).astype(np.uint8)
        return (
            rng.standard_normal((3, 2)).astype(np.float32),
            i % 10,
            i / 7,
            rng.bytes(i % 13),
            {"i": i, "name": f"échantillon {i}"},
            np.arange(i % 6, dtype=np.int32),
            image,
        )


def write(path: Path, dataset: Any, fields: dict[str, Any], num_workers: int = 1, **kwargs: Any) -> None:
    DatasetWriter(path, fields, num_workers=num_workers, progress=False).from_indexed_dataset(dataset, **kwargs)


def test_mixed_roundtrip_and_layout(tmp_path: Path) -> None:
    data = Mixed(250)
    path = tmp_path / "d.stoker"
    write(path, data, Mixed.fields, chunksize=32)
    raw = path.read_bytes()
    with Reader(path) as reader:
        reader.verify()
        assert reader.version == spec.FORMAT_VERSION
        assert raw[:8] == spec.MAGIC
        assert reader.file_size == len(raw)
        for offset in (reader.field_table_offset, reader.metadata_offset, reader.data_offset):
            assert offset % spec.ALIGNMENT == 0
        assert reader.column("x").ctypes.data % spec.ALIGNMENT == reader.storage.ctypes.data % spec.ALIGNMENT
        table = json.loads(raw[reader.field_table_offset : reader.field_table_offset + reader.field_table_size])
        assert [f["name"] for f in table["fields"]] == list(Mixed.fields)
        assert [f["type"] for f in table["fields"]] == [f.TYPE_NAME for f in Mixed.fields.values()]
        assert "column_offset" in table["fields"][0] and all("column_offset" not in f for f in table["fields"][1:])
        for i in (0, 1, 77, 249):
            got, want = reader.read(i), data[i]
            np.testing.assert_array_equal(got[0], want[0])
            assert (got[1], got[2], got[4]) == (want[1], want[2], want[4])
            assert got[3].tobytes() == want[3]
            np.testing.assert_array_equal(got[5], want[5])
            assert got[6].shape == want[6].shape
        sizes = reader.field_sizes()
        assert sizes["x"] == 250 * 24 and sizes["label"] == 250 * 8
        assert sizes["blob"] == 250 * 16 + sum(i % 13 for i in range(250))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("ref") / "ref.stoker"
    write(path, Mixed(120), Mixed.fields, num_workers=1, chunksize=1000)
    return path.read_bytes()


@pytest.mark.parametrize("chunksize", [1, 7, 100])
def test_two_workers_write_the_same_bytes_as_one(tmp_path: Path, chunksize: int, reference: bytes) -> None:
    data = Mixed(120)
    write(tmp_path / "one.stoker", data, Mixed.fields, num_workers=1, chunksize=chunksize)
    write(tmp_path / "two.stoker", data, Mixed.fields, num_workers=2, chunksize=chunksize)
    assert (tmp_path / "one.stoker").read_bytes() == (tmp_path / "two.stoker").read_bytes() == reference


def test_indices_select_and_order(tmp_path: Path) -> None:
    data = Mixed(50)
    write(tmp_path / "d.stoker", data, Mixed.fields, indices=[40, 3, 3, 17])
    with Reader(tmp_path / "d.stoker") as reader:
        assert len(reader) == 4
        assert [reader.read(i)[4]["i"] for i in range(4)] == [40, 3, 3, 17]
        assert reader.read(-1)[4]["i"] == 17
        with pytest.raises(IndexError):
            reader.read(4)
    with pytest.raises(IndexError, match=r"\[0, 50\)"):
        write(tmp_path / "e.stoker", data, Mixed.fields, indices=[0, 50])


def test_shuffle_indices_writes_every_sample_once(tmp_path: Path) -> None:
    DatasetWriter(tmp_path / "d.stoker", {"i": IntField()}, num_workers=1, progress=False).from_indexed_dataset(
        list(range(100)), shuffle_indices=True
    )
    with Reader(tmp_path / "d.stoker") as reader:
        values = reader.metadata["i/value"].tolist()
    assert sorted(values) == list(range(100))


def test_empty_dataset(tmp_path: Path) -> None:
    write(tmp_path / "d.stoker", Mixed(0), Mixed.fields)
    with Reader(tmp_path / "d.stoker") as reader:
        reader.verify()
        assert len(reader) == 0
        assert reader.column("x").shape == (0, 3, 2)
        with pytest.raises(IndexError):
            reader.read(0)


def test_ffcv_import_path_and_page_size() -> None:
    assert FFCVPathWriter is DatasetWriter
    writer = DatasetWriter("x.stoker", {"i": IntField()}, page_size=1 << 21, num_workers=1)
    assert writer.page_size == 1 << 21


def test_overwrites_an_existing_destination(tmp_path: Path) -> None:
    path = tmp_path / "d.stoker"
    path.write_text("old contents")
    write(path, list(range(10)), {"i": IntField()})
    with Reader(path) as reader:
        assert len(reader) == 10
    assert [p.name for p in tmp_path.iterdir()] == ["d.stoker"]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"fields": {}}, ValueError, "at least one field"),
        ({"fields": {"a/b": IntField()}}, ValueError, "without '/'"),
        ({"fields": {"": IntField()}}, ValueError, "non-empty"),
        ({"fields": {"a": int}}, TypeError, "Field instance"),
        ({"num_workers": -2}, ValueError, "num_workers"),
    ],
)
def test_writer_arguments_are_validated(tmp_path: Path, kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    args: dict[str, Any] = {"fields": {"i": IntField()}, "num_workers": 1} | kwargs
    with pytest.raises(error, match=message):
        DatasetWriter(tmp_path / "d.stoker", **args)


def test_destination_folder_problems(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        write(tmp_path / "missing" / "d.stoker", [1], {"i": IntField()})
    with pytest.raises(IsADirectoryError):
        write(tmp_path, [1], {"i": IntField()})
    with pytest.raises(ValueError, match="chunksize"):
        write(tmp_path / "d.stoker", [1], {"i": IntField()}, chunksize=0)


# ---- bad samples --------------------------------------------------------------------------------
class BadAt:
    """A dataset of (array, label) pairs whose sample ``k`` is broken in one way."""

    def __init__(self, n: int, k: int, kind: str) -> None:
        self.n, self.k, self.kind = n, k, kind

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        x, y = np.full(4, i, dtype=np.float32), i
        if i == self.k:
            if self.kind == "shape":
                x = np.zeros(5, dtype=np.float32)
            elif self.kind == "dtype":
                x = np.array(["a", "b", "c", "d"])
            elif self.kind == "label":
                y = "seven"
            elif self.kind == "arity":
                return (x,)
            elif self.kind == "raise":
                raise KeyError(f"no sample {i} in the source")
        return x, y


FIELDS = {"x": NDArrayField((4,), np.float32), "y": IntField()}


@pytest.mark.parametrize("num_workers", [1, 2])
@pytest.mark.parametrize(
    ("kind", "field", "message"),
    [
        ("shape", "x", "expected an array of shape (4,); got shape (5,)"),
        ("dtype", "x", "expected dtype float32; got <U1"),
        ("label", "y", "expected an integer; got str"),
        ("arity", None, "expected a tuple of 2 values (x, y); got 1 values"),
        ("raise", None, "dataset[37] raised KeyError"),
    ],
)
def test_bad_sample_names_index_and_field_and_leaves_nothing(
    tmp_path: Path, num_workers: int, kind: str, field: str | None, message: str
) -> None:
    path = tmp_path / "d.stoker"
    with pytest.raises(SampleError) as info:
        write(path, BadAt(100, 37, kind), FIELDS, num_workers=num_workers, chunksize=10)
    err = info.value
    assert err.index == 37
    assert err.field == field
    assert message in str(err)
    assert str(err).startswith("sample 37" + (f", field '{field}'" if field else ""))
    assert list(tmp_path.iterdir()) == []  # no file, no temporary


def test_bad_sample_with_indices_reports_the_dataset_index(tmp_path: Path) -> None:
    with pytest.raises(SampleError) as info:
        write(tmp_path / "d.stoker", BadAt(100, 37, "shape"), FIELDS, indices=[5, 37, 6])
    assert info.value.index == 37
    assert list(tmp_path.iterdir()) == []


def test_bad_sample_leaves_an_existing_destination_untouched(tmp_path: Path) -> None:
    path = tmp_path / "d.stoker"
    write(path, BadAt(10, -1, "none"), FIELDS)
    before = path.read_bytes()
    with pytest.raises(SampleError):
        write(path, BadAt(100, 50, "shape"), FIELDS, num_workers=2)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["d.stoker"]


def test_column_payload_of_the_wrong_size_is_rejected(tmp_path: Path) -> None:
    class Short(NDArrayField):
        def encode(self, value: Any, index: int) -> tuple[dict[str, Any], bytes | None]:
            return {}, b"\x00" * (3 if index == 4 else self.column_itemsize)

    with pytest.raises(SampleError, match=r"Short\.encode returned 3 bytes; the column needs 16 bytes") as info:
        write(tmp_path / "d.stoker", [np.zeros(4, np.float32)] * 10, {"x": Short((4,), np.float32)})
    assert (info.value.index, info.value.field) == (4, "x")
    assert list(tmp_path.iterdir()) == []


def test_shuffle_indices_seed_makes_the_order_reproducible(tmp_path: Path) -> None:
    def shuffled(name: str, seed: int | None) -> bytes:
        DatasetWriter(tmp_path / name, {"i": IntField()}, num_workers=1, progress=False).from_indexed_dataset(
            list(range(100)), shuffle_indices=True, seed=seed
        )
        return (tmp_path / name).read_bytes()

    assert shuffled("a.stoker", 7) == shuffled("b.stoker", 7)
    assert shuffled("c.stoker", 8) != shuffled("a.stoker", 7)
    assert shuffled("d.stoker", None) != shuffled("e.stoker", None)  # 100! orders: equal by chance with probability 1e-158


# ---- worker processes ----------------------------------------------------------------------------
class SlowFirstChunk:
    """Sample 0 waits (up to 2 s) while the other workers encode whatever they were given; it records how many they encoded."""

    def __init__(self, n: int) -> None:
        import multiprocessing as mp

        self.n = n
        self.encoded = mp.get_context("fork").Value("i", 0)
        self.seen = mp.get_context("fork").Value("i", -1)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == 0:
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and self.encoded.value < self.n - 1:
                time.sleep(0.01)
            self.seen.value = self.encoded.value
        else:
            with self.encoded.get_lock():
                self.encoded.value += 1
        return i


@pytest.mark.skipif(sys.platform == "win32", reason="fork start method")
def test_chunks_in_flight_are_bounded(tmp_path: Path) -> None:
    """While the first chunk is slow, the others cannot all be encoded and wait in memory: a few per worker at most."""
    from stoker.format import writer

    data = SlowFirstChunk(60)
    write(tmp_path / "d.stoker", data, {"i": IntField()}, num_workers=2, chunksize=1)
    bound = writer.IN_FLIGHT_PER_WORKER * 2
    assert 0 <= data.seen.value <= bound - 1  # chunk 0 itself is one of those in flight
    with Reader(tmp_path / "d.stoker") as reader:
        assert reader.metadata["i/value"].tolist() == list(range(60))


class DiesAt:
    def __len__(self) -> int:
        return 50

    def __getitem__(self, i: int) -> int:
        if i == 33:
            os._exit(3)  # a worker killed (out of memory, a crash in native code)
        return i


def test_a_worker_that_dies_is_an_error_not_a_hang(tmp_path: Path) -> None:
    with pytest.raises(ChildProcessError, match=r"a writer worker process \(pid \d+\) died with exit code 3"):
        write(tmp_path / "d.stoker", DiesAt(), {"i": IntField()}, num_workers=2, chunksize=4)
    assert list(tmp_path.iterdir()) == []
