"""NormalizeImage on CUDA tensors (after ToDevice): torch operations on the GPU. Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from stoker.decoders import SimpleRGBImageDecoder
from stoker.loader import Loader, OrderOption
from stoker.transforms import NormalizeImage, RandomHorizontalFlip, ToDevice, ToTensor, ToTorchImage

from ..transforms.conftest import H, W, images, images_path

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

__all__ = ["images_path"]

MEAN = np.array([0.485, 0.456, 0.406]) * 255
STD = np.array([0.229, 0.224, 0.225]) * 255
TOLERANCE = {np.float32: 1e-5, np.float16: 1e-2}


def batches(path: Path, img_ops: list) -> list[tuple[torch.Tensor, np.ndarray]]:
    loader = Loader(path, batch_size=16, order=OrderOption.RANDOM, seed=0, pipelines={"img": img_ops})
    out = []
    for img, label in loader:
        assert img.is_cuda and img.is_contiguous()
        out.append((img.clone(), label.numpy()[:, 0].copy()))
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize(
    "layout",
    [[], [ToTorchImage()], [ToTorchImage(channels_last=False)]],
    ids=["nhwc", "nchw-view", "nchw-contiguous"],
)
def test_normalize_on_the_gpu_matches_numpy(images_path: Path, layout: list, dtype: type) -> None:
    ops = [SimpleRGBImageDecoder(), ToTensor(), ToDevice("cuda"), *layout, NormalizeImage(MEAN, STD, dtype)]
    for img, labels in batches(images_path, ops):
        assert img.shape == (len(labels), 3, H, W) and img.dtype == {np.float32: torch.float32, np.float16: torch.float16}[dtype]
        x = images()[labels].astype(np.float32)
        want = ((x - MEAN.astype(np.float32)) / STD.astype(np.float32)).transpose(0, 3, 1, 2)
        np.testing.assert_allclose(img.float().cpu().numpy(), want, rtol=0, atol=TOLERANCE[dtype])


def test_gpu_and_cpu_paths_agree(images_path: Path) -> None:
    flip = RandomHorizontalFlip
    gpu = batches(images_path, [SimpleRGBImageDecoder(), flip(), ToTensor(), ToDevice("cuda"), NormalizeImage(MEAN, STD, np.float32)])
    cpu = batches(images_path, [SimpleRGBImageDecoder(), flip(), NormalizeImage(MEAN, STD, np.float32), ToTensor(), ToDevice("cuda")])
    for (a, la), (b, lb) in zip(gpu, cpu, strict=True):
        np.testing.assert_array_equal(la, lb)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
