"""RandomHorizontalFlip: exact flips, their probability, their dependence on the epoch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stoker.decoders import IntDecoder, SimpleRGBImageDecoder
from stoker.errors import PipelineError
from stoker.loader import Loader
from stoker.transforms import RandomHorizontalFlip, ToTensor

from .conftest import images, run


def flipped(out: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Whether each output image is its source flipped (asserting it is the source or its mirror)."""
    src = images()[labels[:, 0]]
    same = (out == src).all(axis=(1, 2, 3))
    mirror = (out == src[:, :, ::-1]).all(axis=(1, 2, 3))
    assert (same | mirror).all(), "every image must be its source or the source flipped left-right"
    assert not (same & mirror).any(), "random images are not symmetric"
    return mirror


def test_flips_are_exact_and_about_as_frequent_as_asked(images_path: Path, compiled: bool) -> None:
    epochs = run(images_path, [SimpleRGBImageDecoder(), RandomHorizontalFlip(0.25), ToTensor()], epochs=3, compiled=compiled)
    by_index = []
    for out, labels in epochs:
        flips = flipped(out, labels)
        by_index.append(flips[np.argsort(labels[:, 0])])
    rate = np.mean(by_index)
    assert 0.13 < rate < 0.37, f"flip_prob=0.25 flipped {rate:.0%} of 180 images"
    assert not np.array_equal(by_index[0], by_index[1]), "each epoch draws new flips"


def test_probabilities_zero_and_one(images_path: Path, compiled: bool) -> None:
    ops = [SimpleRGBImageDecoder(), RandomHorizontalFlip(1.0), RandomHorizontalFlip(0.0), ToTensor()]
    ((out, labels),) = run(images_path, ops, epochs=1, compiled=compiled)
    assert flipped(out, labels).all()


@pytest.mark.parametrize("flip_prob", [-0.1, 1.5, float("nan")])
def test_bad_probability(flip_prob: float) -> None:
    with pytest.raises(ValueError, match="flip_prob must lie in"):
        RandomHorizontalFlip(flip_prob)


def test_needs_images(images_path: Path) -> None:
    with pytest.raises(PipelineError, match="height, width, channels"):
        Loader(images_path, batch_size=4, pipelines={"img": None, "label": [IntDecoder(), RandomHorizontalFlip()]})


def test_goes_before_to_tensor(images_path: Path) -> None:
    with pytest.raises(PipelineError, match="before ToTensor"):
        Loader(images_path, batch_size=4, pipelines={"img": [SimpleRGBImageDecoder(), ToTensor(), RandomHorizontalFlip()]})
