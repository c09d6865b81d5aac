"""Cutout: an exact square of fill, centred anywhere in the image, clipped at the borders."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stoker.decoders import SimpleRGBImageDecoder
from stoker.errors import PipelineError
from stoker.loader import Loader
from stoker.transforms import Cutout, ToTensor

from .conftest import H, W, images, run

FILL = (7, 8, 9)


def cut(image: np.ndarray, cy: int, cx: int, size: int) -> np.ndarray:
    out = image.copy()
    y0, x0 = cy - size // 2, cx - size // 2
    out[max(y0, 0) : max(y0 + size, 0), max(x0, 0) : max(x0 + size, 0)] = FILL
    return out


@pytest.mark.parametrize("size", [4, 3, 20])
def test_squares_are_exact_and_centred_anywhere(images_path: Path, compiled: bool, size: int) -> None:
    epochs = run(images_path, [SimpleRGBImageDecoder(), Cutout(size, fill=FILL), ToTensor()], compiled=compiled)
    centres = []
    for out, labels in epochs:
        found = []
        for image, label in zip(out, labels[:, 0]):
            src = images()[label]
            matches = [(cy, cx) for cy in range(H) for cx in range(W) if np.array_equal(image, cut(src, cy, cx, size))]
            assert matches, f"sample {label} is not its image with a {size}x{size} square of {FILL} centred in it"
            found.append(matches[0])
        centres.append([found[k] for k in np.argsort(labels[:, 0])])
    if size == 20:  # larger than the image: everything is erased
        assert (epochs[0][0] == np.array(FILL, np.uint8)).all()
    else:
        assert {cy for cy, _ in centres[0] + centres[1]} == set(range(H)), "centres are drawn over every row"
        assert {cx for _, cx in centres[0] + centres[1]} == set(range(W)), "centres are drawn over every column"
        assert centres[0] != centres[1], "each epoch draws new squares"


@pytest.mark.parametrize("size", [0, -3, 2.5])
def test_bad_crop_size(size: float) -> None:
    with pytest.raises(ValueError, match="crop_size must be an integer >= 1"):
        Cutout(size)  # type: ignore[arg-type]


def test_fill_needs_one_value_per_channel(images_path: Path) -> None:
    with pytest.raises(PipelineError, match="one value per channel"):
        Loader(images_path, batch_size=4, pipelines={"img": [SimpleRGBImageDecoder(), Cutout(2, fill=(1, 2, 3, 4))]})
