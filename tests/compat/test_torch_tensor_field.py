"""TorchTensorField: torch tensors written as an NDArrayField, read back as arrays."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from stoker.fields import NDArrayField
from stoker.fields.decoders import NDArrayDecoder
from stoker.fields.ndarray import TorchTensorField
from stoker.loader import Loader
from stoker.transforms import ToTensor
from stoker.writer import DatasetWriter


@pytest.mark.parametrize(
    ("torch_dtype", "numpy_dtype"),
    [(torch.float32, np.float32), (torch.int16, np.int16), (torch.uint8, np.uint8), (torch.float64, np.float64)],
)
def test_torch_dtypes_become_numpy_dtypes(torch_dtype: torch.dtype, numpy_dtype: type) -> None:
    field = TorchTensorField(torch_dtype, (2, 3))
    assert isinstance(field, NDArrayField)
    assert field.dtype == np.dtype(numpy_dtype) and field.shape == (2, 3)


def test_dtype_without_numpy_twin() -> None:
    with pytest.raises(TypeError, match="no numpy equivalent"):
        TorchTensorField(torch.bfloat16, (2,))


def test_tensors_round_trip(tmp_path: Path) -> None:
    tensors = torch.randn(13, 2, 3, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "tensors.stoker"
    DatasetWriter(path, {"x": TorchTensorField(torch.float32, (2, 3))}, num_workers=1, progress=False).from_indexed_dataset(
        [(tensors[i],) for i in range(13)]
    )
    loader = Loader(path, batch_size=5, pipelines={"x": [NDArrayDecoder(), ToTensor()]})
    out = torch.cat([x for (x,) in loader])
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, tensors, rtol=0, atol=0)
