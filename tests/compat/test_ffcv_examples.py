"""The data sections of FFCV's public CIFAR-10 and ImageNet training examples, run with ``ffcv`` -> ``stoker``.

The pipelines and loader arguments are those of FFCV's ``examples/cifar/train_cifar.py``
and ``examples/imagenet/train_imagenet.py`` (imports included, from the same
module paths), over small generated datasets: 64 random 32x32 images for CIFAR,
40 one-colour 64x80 JPEG images for ImageNet. ``ToDevice`` targets the CPU and
``distributed`` is False; everything else is as in the examples.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from stoker.fields import IntField, RGBImageField
from stoker.fields.basics import IntDecoder
from stoker.fields.decoders import SimpleRGBImageDecoder
from stoker.fields.rgb_image import CenterCropRGBImageDecoder, RandomResizedCropRGBImageDecoder
from stoker.loader import Loader, OrderOption
from stoker.pipeline.operation import Operation
from stoker.transforms import (
    Convert,
    Cutout,
    NormalizeImage,
    RandomHorizontalFlip,
    RandomTranslate,
    Squeeze,
    ToDevice,
    ToTensor,
    ToTorchImage,
)
from stoker.transforms.common import Squeeze as CommonSqueeze
from stoker.writer import DatasetWriter

CIFAR_N = 64
CIFAR_MEAN = [125.307, 122.961, 113.8575]
CIFAR_STD = [51.5865, 50.847, 51.255]

IMAGENET_N, IMAGENET_H, IMAGENET_W = 40, 64, 80
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406]) * 255
IMAGENET_STD = np.array([0.229, 0.224, 0.225]) * 255
DEFAULT_CROP_RATIO = 224 / 256
RES = 32


def cifar_images() -> np.ndarray:
    """The CIFAR-shaped dataset's images, ``(64, 32, 32, 3)`` uint8; sample ``i`` has label ``i``."""
    return np.random.default_rng(10).integers(0, 256, (CIFAR_N, 32, 32, 3), dtype=np.uint8)


def imagenet_colours() -> np.ndarray:
    """One RGB colour per ImageNet-shaped sample, ``(40, 3)`` uint8: any crop, resize or flip of the image keeps it."""
    return np.random.default_rng(11).integers(0, 256, (IMAGENET_N, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def cifar_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cifar") / "cifar_train.stoker"
    images = cifar_images()
    dataset = [(images[i], i) for i in range(CIFAR_N)]
    writer = DatasetWriter(path, {"image": RGBImageField(), "label": IntField()}, num_workers=1, progress=False)
    writer.from_indexed_dataset(dataset)
    return path


@pytest.fixture(scope="module")
def imagenet_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("imagenet") / "imagenet_train.stoker"
    colours = imagenet_colours()
    dataset = [(np.broadcast_to(colours[i], (IMAGENET_H, IMAGENET_W, 3)).copy(), i) for i in range(IMAGENET_N)]
    fields = {
        "image": RGBImageField(write_mode="jpg", max_resolution=64, compress_probability=1.0, jpeg_quality=90),
        "label": IntField(),
    }
    DatasetWriter(path, fields, num_workers=1, progress=False).from_indexed_dataset(dataset)
    return path


class _Normalize(torch.nn.Module):
    """``torchvision.transforms.Normalize(mean, std)`` on NCHW batches (torchvision is not a dependency)."""

    def __init__(self, mean: list[float], std: list[float]) -> None:
        super().__init__()
        self.mean = torch.tensor(mean).view(1, 3, 1, 1)
        self.std = torch.tensor(std).view(1, 3, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean.to(x.dtype)) / self.std.to(x.dtype)


def cifar_loader(path: Path, name: str, batch_size: int) -> Loader:
    """``make_dataloaders`` of FFCV's CIFAR-10 example, for one split."""
    device = torch.device("cpu")
    label_pipeline: list[Operation] = [IntDecoder(), ToTensor(), ToDevice(device), CommonSqueeze()]
    image_pipeline: list[Operation] = [SimpleRGBImageDecoder()]
    if name == "train":
        image_pipeline.extend(
            [
                RandomHorizontalFlip(),
                RandomTranslate(padding=2, fill=tuple(map(int, CIFAR_MEAN))),
                Cutout(4, tuple(map(int, CIFAR_MEAN))),
            ]
        )
    image_pipeline.extend(
        [
            ToTensor(),
            ToDevice(device, non_blocking=True),
            ToTorchImage(),
            Convert(torch.float16),
            _Normalize(CIFAR_MEAN, CIFAR_STD),  # type: ignore[list-item]
        ]
    )
    ordering = OrderOption.RANDOM if name == "train" else OrderOption.SEQUENTIAL
    return Loader(
        path,
        batch_size=batch_size,
        num_workers=2,
        order=ordering,
        drop_last=(name == "train"),
        pipelines={"image": image_pipeline, "label": label_pipeline},
        seed=0,
    )


def imagenet_loader(path: Path, name: str, batch_size: int) -> Loader:
    """``create_train_loader`` / ``create_val_loader`` of FFCV's ImageNet example."""
    device = torch.device("cpu")
    decoder = (
        RandomResizedCropRGBImageDecoder((RES, RES)) if name == "train" else CenterCropRGBImageDecoder((RES, RES), ratio=DEFAULT_CROP_RATIO)
    )
    image_pipeline: list[Operation] = [decoder]
    if name == "train":
        image_pipeline.append(RandomHorizontalFlip())
    image_pipeline.extend(
        [
            ToTensor(),
            ToDevice(device, non_blocking=True),
            ToTorchImage(),
            NormalizeImage(IMAGENET_MEAN, IMAGENET_STD, np.float16),
        ]
    )
    label_pipeline: list[Operation] = [IntDecoder(), ToTensor(), Squeeze(), ToDevice(device, non_blocking=True)]
    return Loader(
        path,
        batch_size=batch_size,
        num_workers=2,
        order=OrderOption.RANDOM if name == "train" else OrderOption.SEQUENTIAL,
        os_cache=True,
        drop_last=(name == "train"),
        pipelines={"image": image_pipeline, "label": label_pipeline},
        distributed=False,
        seed=0,
    )


def _normalised(images: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """``(x - mean) / std`` of NHWC uint8 images, as NCHW float64."""
    return ((images.astype(np.float64) - mean) / std).transpose(0, 3, 1, 2)


def test_cifar_train_epoch(cifar_path: Path) -> None:
    loader = cifar_loader(cifar_path, "train", batch_size=12)
    batches = list(loader)
    assert len(batches) == len(loader) == CIFAR_N // 12  # drop_last
    labels = torch.cat([label for _, label in batches])
    assert len(set(labels.tolist())) == len(labels) == (CIFAR_N // 12) * 12
    assert set(labels.tolist()) <= set(range(CIFAR_N))
    low = (0.0 - np.array(CIFAR_MEAN)) / np.array(CIFAR_STD)
    high = (255.0 - np.array(CIFAR_MEAN)) / np.array(CIFAR_STD)
    fill = (np.array(tuple(map(int, CIFAR_MEAN))) - np.array(CIFAR_MEAN)) / np.array(CIFAR_STD)
    for images, label in batches:
        assert images.shape == (12, 3, 32, 32) and images.dtype == torch.float16 and images.device.type == "cpu"
        assert label.shape == (12,) and label.dtype == torch.int64
        values = images.float().numpy()
        for c in range(3):
            assert values[:, c].min() >= low[c] - 0.01 and values[:, c].max() <= high[c] + 0.01
        # Cutout(4) leaves a patch of at least 2x2 fill pixels in every image
        is_fill = np.all(np.abs(values - fill.reshape(1, 3, 1, 1)) < 0.01, axis=1)
        assert (is_fill.sum(axis=(1, 2)) >= 4).all()
    # each image is its source image, moved and partly covered: its pixels are source pixels or the fill colour
    source = cifar_images()
    images, label = batches[0]
    for img, i in zip(images.float().numpy(), label.tolist(), strict=True):
        pixels = {tuple(p) for p in source[i].reshape(-1, 3).tolist()} | {tuple(map(int, CIFAR_MEAN))}
        back = np.rint(img.transpose(1, 2, 0) * np.array(CIFAR_STD) + np.array(CIFAR_MEAN)).astype(int)
        assert all(tuple(p) in pixels for p in back.reshape(-1, 3).tolist())


def test_cifar_test_epoch_is_the_normalised_dataset(cifar_path: Path) -> None:
    loader = cifar_loader(cifar_path, "test", batch_size=24)
    batches = list(loader)
    assert [len(label) for _, label in batches] == [24, 24, 16]  # no drop_last
    images = torch.cat([image for image, _ in batches]).float().numpy()
    labels = torch.cat([label for _, label in batches]).numpy()
    np.testing.assert_array_equal(labels, np.arange(CIFAR_N))
    expected = _normalised(cifar_images(), np.array(CIFAR_MEAN), np.array(CIFAR_STD))
    np.testing.assert_allclose(images, expected, atol=0.01)


@pytest.mark.parametrize("name", ["train", "val"])
def test_imagenet_epoch(imagenet_path: Path, name: str) -> None:
    batch_size = 16
    loader = imagenet_loader(imagenet_path, name, batch_size)
    batches = list(loader)
    sizes = [len(label) for _, label in batches]
    assert sizes == ([16, 16] if name == "train" else [16, 16, 8])
    colours = imagenet_colours()
    for images, label in batches:
        assert images.shape == (len(label), 3, RES, RES) and images.dtype == torch.float16
        assert label.shape == (len(label),) and label.dtype == torch.int64
        # one-colour images: whatever the crop, every pixel is the sample's normalised colour (JPEG error aside)
        expected = (colours[label.numpy()].astype(np.float64) - IMAGENET_MEAN) / IMAGENET_STD
        np.testing.assert_allclose(images.float().numpy(), np.broadcast_to(expected[:, :, None, None], images.shape), atol=0.1)
    labels = torch.cat([label for _, label in batches]).tolist()
    if name == "val":
        assert labels == list(range(IMAGENET_N))
    else:
        assert len(set(labels)) == len(labels)
        assert labels != sorted(labels)
