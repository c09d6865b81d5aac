"""ImageMixup and LabelMixup: the same pairs and weights in both fields, Beta-distributed weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stoker.decoders import IntDecoder, SimpleRGBImageDecoder
from stoker.errors import PipelineError
from stoker.loader import Loader
from stoker.pipeline.random import sample_seeds
from stoker.transforms import ImageMixup, LabelMixup, ToTensor
from stoker.transforms.mixup import beta

from .conftest import images, run

BATCH = 16


@pytest.mark.parametrize("same_lambda", [False, True], ids=["per-sample", "same-lambda"])
def test_images_and_labels_are_mixed_alike(images_path: Path, compiled: bool, same_lambda: bool) -> None:
    epochs = run(
        images_path,
        [SimpleRGBImageDecoder(), ImageMixup(0.4, same_lambda), ToTensor()],
        [IntDecoder(), LabelMixup(0.4, same_lambda), ToTensor()],
        compiled=compiled,
        batch_size=BATCH,
    )
    lambdas = []
    for out, mixed in epochs:
        assert mixed.shape == (60, 3) and mixed.dtype == np.float64
        own, partner, lam = mixed[:, 0].astype(int), mixed[:, 1].astype(int), mixed[:, 2]
        assert ((lam >= 0) & (lam <= 1)).all()
        expected = lam[:, None, None, None] * images()[own] + (1 - lam[:, None, None, None]) * images()[partner]
        assert np.abs(out - expected).max() <= 1, "each image is lam * image + (1 - lam) * partner's image, rounded"
        for start in range(0, 60, BATCH):
            rows = slice(start, start + BATCH)
            assert sorted(partner[rows]) == sorted(own[rows]), "partners are a permutation of the batch"
            assert (partner[rows] != own[rows]).any()
            assert (len(set(lam[rows])) == 1) == same_lambda
        lambdas.append(lam[np.argsort(own)])
    assert not np.array_equal(lambdas[0], lambdas[1]), "each epoch draws new weights"


@pytest.mark.parametrize("alpha", [0.2, 1.0, 4.0])
def test_weights_follow_beta(alpha: float) -> None:
    seeds = sample_seeds(0, 0, np.arange(20_000), 1)
    draws = np.array([beta(s, alpha) for s in seeds])
    assert ((draws >= 0) & (draws <= 1)).all()
    assert abs(draws.mean() - 0.5) < 0.01
    assert abs(draws.var() / (1 / (4 * (2 * alpha + 1))) - 1) < 0.05, "the variance of Beta(alpha, alpha)"
    if alpha == 1.0:  # Beta(1, 1) is uniform: Kolmogorov-Smirnov at the 1% level (seed 5 happens to fall in that 1%)
        ecdf = np.arange(1, len(draws) + 1) / len(draws)
        assert np.abs(ecdf - np.sort(draws)).max() < 1.63 / np.sqrt(len(draws))


@pytest.mark.parametrize("alpha", [0.0, -1.0])
def test_bad_alpha(alpha: float) -> None:
    with pytest.raises(ValueError, match="alpha must be > 0"):
        ImageMixup(alpha, False)
    with pytest.raises(ValueError, match="alpha must be > 0"):
        LabelMixup(alpha, True)


def test_label_mixup_needs_one_label_per_sample(images_path: Path) -> None:
    with pytest.raises(PipelineError, match="one label per sample"):
        Loader(images_path, batch_size=4, pipelines={"img": [SimpleRGBImageDecoder(), LabelMixup(1.0, False)]})
