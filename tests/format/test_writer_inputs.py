"""Inputs users already have: a torch TensorDataset, dict samples, PIL images and image paths, written without a wrapper."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from stoker.errors import SampleError
from stoker.fields import FloatField, IntField, JSONField, NDArrayField, RGBImageField
from stoker.format import DatasetWriter, Reader

from .._profile import examples


def write(path: Path, fields: dict[str, Any], dataset: Any, num_workers: int = 1) -> None:
    DatasetWriter(path, fields, num_workers=num_workers, progress=False).from_indexed_dataset(dataset, chunksize=7)


def columns(path: Path) -> list[tuple[Any, ...]]:
    with Reader(path) as reader:
        return [reader.read(i) for i in range(len(reader))]


@settings(max_examples=examples(ci=8, long=20), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    labels=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=40),
    dtype=st.sampled_from([torch.int64, torch.int32, torch.int16, torch.uint8]),
    num_workers=st.sampled_from([1, 2]),
)
def test_tensor_dataset(tmp_path_factory: pytest.TempPathFactory, labels: list[int], dtype: torch.dtype, num_workers: int) -> None:
    info = torch.iinfo(dtype)
    y = torch.tensor([min(max(v, info.min), info.max) for v in labels], dtype=dtype)
    x = torch.arange(len(labels) * 3, dtype=torch.float32).reshape(-1, 3) / 7
    w = (torch.arange(len(labels), dtype=torch.float16) / 3).to(torch.bfloat16)  # no numpy dtype: read with .item()
    dataset = torch.utils.data.TensorDataset(x, y, w)
    path = tmp_path_factory.mktemp("tensors") / "d.stoker"
    write(path, {"x": NDArrayField((3,), np.float32), "y": IntField(), "w": FloatField()}, dataset, num_workers)
    got = columns(path)
    assert [r[1] for r in got] == y.tolist() and all(type(r[1]) is int for r in got)
    assert [r[2] for r in got] == [float(v) for v in w.tolist()]
    np.testing.assert_array_equal(np.stack([r[0] for r in got]), x.numpy())


@pytest.mark.parametrize(
    "value",
    [2.0, 2.5, np.float32(3.0), np.array(1.5), torch.tensor(2.0), torch.tensor([4.5], dtype=torch.float16)],
    ids=["float", "fraction", "np.float32", "0-d array", "0-d tensor", "1-element half tensor"],
)
def test_floats_are_refused_for_ints_not_truncated(tmp_path: Path, value: Any) -> None:
    with pytest.raises(SampleError, match=r"sample 1, field 'y': expected an integer; got .*does not round or truncate floats") as info:
        write(tmp_path / "d.stoker", {"y": IntField()}, [1, value, 3])
    assert info.value.index == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", [True, torch.tensor(True), np.array([True]), "3", torch.tensor([1, 2]), torch.tensor(1j)])
def test_other_values_are_refused(tmp_path: Path, value: Any) -> None:
    for field in (IntField(), FloatField()):
        with pytest.raises(SampleError, match=r"sample 0, field 'v': expected an? (integer|real number); got"):
            write(tmp_path / "d.stoker", {"v": field}, [value])


names = st.text("abcdefgh", min_size=1, max_size=4)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    order=st.permutations(["label", "weight", "meta"]),
    rows=st.lists(st.tuples(st.integers(-100, 100), st.floats(allow_nan=False), st.dictionaries(names, st.integers())), max_size=30),
)
def test_dict_samples_by_field_name(
    tmp_path_factory: pytest.TempPathFactory, order: list[str], rows: list[tuple[int, float, dict]]
) -> None:
    """A dict's keys are the field names, in any order; the file is the one its tuple form gives."""
    fields = {"label": IntField(), "weight": FloatField(), "meta": JSONField()}
    as_dicts = [{key: dict(zip(fields, row))[key] for key in order} for row in rows]
    folder = tmp_path_factory.mktemp("dicts")
    write(folder / "dicts.stoker", fields, as_dicts)
    write(folder / "tuples.stoker", fields, rows)
    assert (folder / "dicts.stoker").read_bytes() == (folder / "tuples.stoker").read_bytes()
    assert columns(folder / "dicts.stoker") == [tuple(r) for r in rows]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(keys=st.sets(st.sampled_from(["label", "weight", "extra", "Label", "other"]), min_size=1), bad=st.integers(0, 9))
def test_dict_with_other_keys_names_the_sample_and_the_keys(tmp_path_factory: pytest.TempPathFactory, keys: set[str], bad: int) -> None:
    fields = {"label": IntField(), "weight": FloatField()}
    if keys == set(fields):
        return
    samples: list[Any] = [{"label": i, "weight": 0.5} for i in range(10)]
    samples[bad] = dict.fromkeys(keys, 1)
    folder = tmp_path_factory.mktemp("keys")
    with pytest.raises(SampleError) as info:
        write(folder / "d.stoker", fields, samples, num_workers=1)
    assert info.value.index == bad
    missing, extra = sorted(set(fields) - keys), sorted(keys - set(fields))
    message = str(info.value)
    assert f"sample {bad}: a dict sample needs exactly the field names as keys, ['label', 'weight']" in message
    assert f"missing {[k for k in fields if k in missing]}" in message
    assert all(repr(k) in message.split("unexpected", 1)[1] for k in extra)
    assert list(folder.iterdir()) == []


def test_one_json_field_still_takes_a_dict_as_its_value(tmp_path: Path) -> None:
    write(tmp_path / "d.stoker", {"meta": JSONField()}, [{"a": 1}, {"meta": 2}, {}])
    assert columns(tmp_path / "d.stoker") == [({"a": 1},), (2,), ({},)]  # a dict of the field's name is by name


def png(image: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(image).save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize("num_workers", [1, 2])
def test_pil_images_paths_and_file_bytes(tmp_path: Path, num_workers: int) -> None:
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (5 + i, 9 - i % 4, 3), dtype=np.uint8) for i in range(12)]
    for i, image in enumerate(images):
        (tmp_path / f"{i}.png").write_bytes(png(image))
    gray = rng.integers(0, 256, (6, 7), dtype=np.uint8)
    (tmp_path / "gray.png").write_bytes(png(gray))
    values: list[Any] = [
        *[Image.fromarray(im) for im in images[:4]],
        *[tmp_path / f"{i}.png" for i in range(4, 8)],  # pathlib paths and str paths
        *[str(tmp_path / f"{i}.png") for i in range(8, 10)],
        *[png(im) for im in images[10:]],  # the file's bytes
        tmp_path / "gray.png",
    ]
    expected = [*images, np.repeat(gray[..., None], 3, axis=2)]
    write(tmp_path / "d.stoker", {"image": RGBImageField(write_mode="raw")}, values, num_workers)
    for (got,), want in zip(columns(tmp_path / "d.stoker"), expected):
        np.testing.assert_array_equal(got, want)


def test_unreadable_image_values_name_the_sample_and_file(tmp_path: Path) -> None:
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(SampleError, match=r"sample 1, field 'image': cannot decode .*broken\.png: not an image that Pillow can identify"):
        write(tmp_path / "d.stoker", {"image": RGBImageField()}, [np.zeros((2, 2, 3), np.uint8), tmp_path / "broken.png"])
    with pytest.raises(SampleError, match=r"sample 0, field 'image': cannot read the image file .*missing\.jpg'?: No such file"):
        write(tmp_path / "d.stoker", {"image": RGBImageField()}, [tmp_path / "missing.jpg"])
    with pytest.raises(SampleError, match=r"sample 0, field 'image': cannot decode the image bytes"):
        write(tmp_path / "d.stoker", {"image": RGBImageField()}, [b"not an image"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.png"]
