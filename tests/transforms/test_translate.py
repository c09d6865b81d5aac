"""RandomTranslate: exact shifts with fill, over the whole range of offsets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stoker.decoders import SimpleRGBImageDecoder
from stoker.errors import PipelineError
from stoker.loader import Loader
from stoker.transforms import RandomTranslate, ToTensor

from .conftest import H, W, images, run

FILL = (10, 20, 30)


def all_shifts(image: np.ndarray, padding: int) -> np.ndarray:
    """``out[padding + dy, padding + dx]``: ``image`` moved ``dy`` down and ``dx`` right, uncovered pixels set to FILL."""
    padded = np.empty((H + 2 * padding, W + 2 * padding, 3), np.uint8)
    padded[:] = FILL
    padded[padding : padding + H, padding : padding + W] = image
    windows = np.lib.stride_tricks.sliding_window_view(padded, (H, W, 3))[:, :, 0]  # [a, b] = padded[a : a + H, b : b + W]
    return windows[::-1, ::-1]  # a = padding - dy


def offsets(out: np.ndarray, labels: np.ndarray, padding: int) -> list[tuple[int, int]]:
    """The (dy, dx) of each output image; asserts that each is its source shifted within [-padding, padding]."""
    found = []
    for image, label in zip(out, labels[:, 0]):
        matches = np.argwhere((all_shifts(images()[label], padding) == image).all(axis=(2, 3, 4)))
        assert len(matches), f"sample {label} is not its image shifted by at most {padding} pixels with fill {FILL}"
        found.append((int(matches[0, 0]) - padding, int(matches[0, 1]) - padding))
    return found


@pytest.mark.parametrize("padding", [2, 12])
def test_shifts_are_exact_and_cover_the_range(images_path: Path, compiled: bool, padding: int) -> None:
    epochs = run(images_path, [SimpleRGBImageDecoder(), RandomTranslate(padding, fill=FILL), ToTensor()], compiled=compiled)
    per_epoch = []
    for out, labels in epochs:
        assert out.shape == (60, H, W, 3) and out.dtype == np.uint8
        found = offsets(out, labels, padding)
        per_epoch.append([found[k] for k in np.argsort(labels[:, 0])])
    if padding == 2:
        dys = {dy for epoch in per_epoch for dy, _ in epoch}
        dxs = {dx for epoch in per_epoch for _, dx in epoch}
        assert dys == dxs == set(range(-2, 3)), "both ends of [-padding, padding] are drawn"
    else:
        blank = np.empty((H, W, 3), np.uint8)
        blank[:] = FILL
        assert any(np.array_equal(img, blank) for img in epochs[0][0]), "shifts past the border leave only fill"
    assert per_epoch[0] != per_epoch[1], "each epoch draws new offsets"


def test_padding_zero_is_the_identity(images_path: Path) -> None:
    ((out, labels),) = run(images_path, [SimpleRGBImageDecoder(), RandomTranslate(0), ToTensor()], epochs=1, compiled=False)
    np.testing.assert_array_equal(out, images()[labels[:, 0]])


@pytest.mark.parametrize("padding", [-1, 1.5])
def test_bad_padding(padding: float) -> None:
    with pytest.raises(ValueError, match="padding must be an integer >= 0"):
        RandomTranslate(padding)  # type: ignore[arg-type]


def test_fill_needs_one_value_per_channel(images_path: Path) -> None:
    with pytest.raises(PipelineError, match="one value per channel"):
        Loader(images_path, batch_size=4, pipelines={"img": [SimpleRGBImageDecoder(), RandomTranslate(1, fill=(0, 0))]})
