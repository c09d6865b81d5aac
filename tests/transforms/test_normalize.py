"""NormalizeImage: (x - mean) / std in float32, NCHW out, compiled on numpy batches and with torch on tensors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from stoker.decoders import SimpleRGBImageDecoder
from stoker.errors import PipelineError
from stoker.loader import Loader
from stoker.transforms import NormalizeImage, ToTensor, ToTorchImage

from .conftest import H, W, images, run

MEAN = np.array([0.485, 0.456, 0.406]) * 255
STD = np.array([0.229, 0.224, 0.225]) * 255
TOLERANCE = {np.float32: 1e-5, np.float16: 1e-2}


def reference(labels: np.ndarray) -> np.ndarray:
    x = images()[labels[:, 0]].astype(np.float32)
    return ((x - MEAN.astype(np.float32)) / STD.astype(np.float32)).transpose(0, 3, 1, 2)


def check(out: np.ndarray, labels: np.ndarray, dtype: type) -> None:
    assert out.shape == (len(labels), 3, H, W) and out.dtype == dtype
    np.testing.assert_allclose(out.astype(np.float32), reference(labels), rtol=0, atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_on_numpy_batches(images_path: Path, compiled: bool, dtype: type) -> None:
    ((out, labels),) = run(
        images_path, [SimpleRGBImageDecoder(), NormalizeImage(MEAN, STD, dtype), ToTensor()], epochs=1, compiled=compiled
    )
    check(out, labels, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize(
    "layout",
    [[], [ToTorchImage()], [ToTorchImage(channels_last=False)]],
    ids=["nhwc", "nchw-view", "nchw-contiguous"],
)
def test_on_cpu_tensors(images_path: Path, layout: list, dtype: type) -> None:
    ops = [SimpleRGBImageDecoder(), ToTensor(), *layout, NormalizeImage(MEAN, STD, dtype)]
    ((out, labels),) = run(images_path, ops, epochs=1)
    check(out, labels, dtype)


@pytest.mark.parametrize("before", [[], [ToTensor()]], ids=["numpy", "tensor"])
def test_output_is_already_nchw_and_contiguous(images_path: Path, before: list) -> None:
    """The decision documented on NormalizeImage: its output is NCHW, so ToTorchImage does not follow it."""
    tail = [] if before else [ToTensor()]
    loader = Loader(
        images_path,
        batch_size=16,
        pipelines={"img": [SimpleRGBImageDecoder(), *before, NormalizeImage(MEAN, STD, np.float32), *tail], "label": None},
    )
    assert loader.pipelines[0].final_state.shape == (3, H, W)
    for (x,) in loader:
        assert isinstance(x, torch.Tensor) and x.shape[1:] == (3, H, W) and x.is_contiguous()


@pytest.mark.parametrize(
    ("mean", "std", "dtype", "message"),
    [
        ([1.0, 2.0], [1.0, 2.0, 3.0], np.float32, "one value per channel"),
        ([1.0, 2.0, 3.0], [1.0, 0.0, 3.0], np.float32, "std must be > 0"),
        ([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], np.int32, "float dtype"),
    ],
)
def test_bad_arguments(mean: list, std: list, dtype: type, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NormalizeImage(np.array(mean), np.array(std), dtype)


@pytest.mark.parametrize("before", [[], [ToTensor()]], ids=["numpy", "tensor"])
def test_channel_count_must_match(images_path: Path, before: list) -> None:
    op = NormalizeImage(np.zeros(4), np.ones(4), np.float32)
    with pytest.raises(PipelineError, match="4 channel values"):
        Loader(images_path, batch_size=4, pipelines={"img": [SimpleRGBImageDecoder(), *before, op]})
