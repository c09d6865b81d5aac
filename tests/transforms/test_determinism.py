"""Every transform at once: the same seed gives the same batches whatever the threads and with the compiler on or off."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stoker.decoders import IntDecoder, SimpleRGBImageDecoder
from stoker.transforms import Cutout, ImageMixup, LabelMixup, NormalizeImage, RandomHorizontalFlip, RandomTranslate, ToTensor

from .conftest import run


def everything(path: Path, seed: int = 3, **kwargs: object) -> list[tuple[np.ndarray, ...]]:
    img = [
        SimpleRGBImageDecoder(),
        RandomHorizontalFlip(),
        RandomTranslate(2, fill=(1, 2, 3)),
        Cutout(3),
        ImageMixup(0.5, False),
        NormalizeImage(np.array([120.0, 110, 100]), np.array([60.0, 55, 50]), np.float32),
        ToTensor(),
    ]
    return run(path, img, [IntDecoder(), LabelMixup(0.5, False), ToTensor()], seed=seed, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def reference(images_path: Path) -> list[tuple[np.ndarray, ...]]:
    return everything(images_path, num_workers=1)


def assert_same(a: list[tuple[np.ndarray, ...]], b: list[tuple[np.ndarray, ...]]) -> None:
    for epoch_a, epoch_b in zip(a, b, strict=True):
        for x, y in zip(epoch_a, epoch_b, strict=True):
            np.testing.assert_array_equal(x, y)


def test_two_threads_give_the_same_batches(images_path: Path, reference: list) -> None:
    assert_same(everything(images_path, num_workers=2), reference)


def test_the_compiler_off_gives_the_same_batches(images_path: Path, reference: list) -> None:
    assert_same(everything(images_path, compiled=False), reference)


def test_epochs_and_seeds_change_the_draws(images_path: Path, reference: list) -> None:
    (img0, lab0), (img1, lab1) = reference
    assert not np.array_equal(img0[np.argsort(lab0[:, 0])], img1[np.argsort(lab1[:, 0])])
    other = everything(images_path, seed=4, epochs=1, compiled=False)
    assert not np.array_equal(other[0][1], lab0)
