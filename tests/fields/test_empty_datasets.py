"""0-row files: every field type opens, and a Loader over them is an epoch of no batches (docs/misuse.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from stoker.decoders.rgb_image import CenterCropRGBImageDecoder, RandomResizedCropRGBImageDecoder
from stoker.fields import (
    BytesField,
    Field,
    FloatField,
    IntField,
    JSONField,
    NDArrayField,
    RaggedArrayField,
    RGBImageField,
    TorchTensorField,
)
from stoker.format import DatasetWriter, Reader
from stoker.loader import Loader, OrderOption

FIELDS: dict[str, Field] = {
    "int": IntField(),
    "float": FloatField(),
    "ndarray": NDArrayField(shape=(3, 4), dtype=np.dtype("float32")),
    "ndarray_empty_rows": NDArrayField(shape=(0,), dtype=np.dtype("uint8")),
    "torch_tensor": TorchTensorField(torch.int16, (2,)),
    "bytes": BytesField(),
    "json": JSONField(),
    "ragged": RaggedArrayField(dtype=np.dtype("int32")),
    "jpeg": RGBImageField(write_mode="jpg"),
    "raw": RGBImageField(write_mode="raw"),
}


def empty_file(path: Path, fields: dict[str, Field]) -> Path:
    DatasetWriter(path, fields, num_workers=1, progress=False).from_indexed_dataset([])
    return path


@pytest.mark.parametrize("indices", [None, []], ids=["all", "indices=[]"])
@pytest.mark.parametrize("order", list(OrderOption), ids=lambda o: o.name)
@pytest.mark.parametrize("name", list(FIELDS))
def test_a_loader_over_a_0_row_file_has_no_batches(tmp_path: Path, name: str, order: OrderOption, indices: list[int] | None) -> None:
    path = empty_file(tmp_path / f"{name}.stoker", {name: FIELDS[name]})
    loader = Loader(path, batch_size=4, num_workers=1, order=order, indices=indices, seed=0)
    assert len(loader) == 0
    assert list(loader) == []
    assert list(loader) == []  # a second epoch too


@pytest.mark.long
def test_every_field_type_opens_in_one_0_row_file(tmp_path: Path) -> None:
    path = empty_file(tmp_path / "all.stoker", FIELDS)
    with Reader(path) as reader:
        assert len(reader) == 0 and list(reader.fields) == list(FIELDS)  # a TorchTensorField is stored as an NDArrayField
        reader.verify()
        reader.validate_samples([])
        assert reader.field_sizes() == dict.fromkeys(FIELDS, 0)
        assert [len(a) for a in reader.sample_extents(np.zeros(0, np.int64))] == [0, 0]
        assert reader.column("ndarray").shape == (0, 3, 4)
    for order in OrderOption:
        loader = Loader(path, batch_size=3, num_workers=1, order=order, drop_last=True)
        assert len(loader) == 0 and list(loader) == []
    crops = {"jpeg": [CenterCropRGBImageDecoder((8, 8))], "raw": [RandomResizedCropRGBImageDecoder((8, 8))]}
    loader = Loader(path, batch_size=3, num_workers=1, pipelines=crops)
    assert len(loader) == 0 and list(loader) == []


def test_ndarray_rows_of_no_elements_load(tmp_path: Path) -> None:
    """The same reshape that failed on 0 rows failed on rows of 0 elements."""
    path = tmp_path / "z.stoker"
    field = NDArrayField(shape=(2, 0), dtype=np.dtype("float32"))
    DatasetWriter(path, {"z": field, "y": IntField()}, num_workers=1, progress=False).from_indexed_dataset(
        [(np.zeros((2, 0), np.float32), i) for i in range(5)]
    )
    batches = list(Loader(path, batch_size=2, num_workers=1))
    assert [tuple(z.shape) for z, _ in batches] == [(2, 2, 0), (2, 2, 0), (1, 2, 0)]
    assert torch.cat([y for _, y in batches]).ravel().tolist() == [0, 1, 2, 3, 4]
