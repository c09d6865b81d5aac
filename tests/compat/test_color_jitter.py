"""RandomBrightness, RandomContrast, RandomSaturation against a numpy model of FFCV's formulas."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from stoker.fields import IntField, RGBImageField
from stoker.fields.decoders import IntDecoder, SimpleRGBImageDecoder
from stoker.loader import Loader, OrderOption
from stoker.pipeline.compiler import Compiler
from stoker.pipeline.random import uniform
from stoker.pipeline.state import State
from stoker.transforms import NormalizeImage, ToTensor
from stoker.transforms.color_jitter import RandomBrightness, RandomContrast, RandomSaturation
from stoker.writer import DatasetWriter

OPS = [RandomBrightness, RandomContrast, RandomSaturation]
HWC = State(True, None, (9, 7, 3), np.dtype(np.uint8), layout="HWC")


def reference(op: RandomBrightness, images: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """FFCV's ``color_jitter`` formulas in numpy, with the draws taken from ``seeds``."""
    out = images.copy()
    low, high = max(0.0, 1.0 - op.magnitude), 1.0 + op.magnitude
    for i, seed in enumerate(seeds):
        if not uniform(seed, 0) < op.p:
            continue
        f = low + (high - low) * uniform(seed, 1)
        img = images[i]
        r, g, b = img[:, :, 0], img[:, :, 1], img[:, :, 2]
        grey = (0.2989 * r + 0.587 * g + 0.114 * b).astype(np.uint8)
        if isinstance(op, RandomSaturation):
            other: np.ndarray | float = np.repeat(grey[:, :, None], 3, axis=2)
        elif isinstance(op, RandomContrast):
            other = grey.mean()
        else:
            other = 0
        out[i] = (f * img + (1 - f) * other).clip(0, 255).astype(np.uint8)
    return out


@pytest.fixture(params=[True, False], ids=["compiled", "python"])
def compiled(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.mark.parametrize("op_type", OPS)
@pytest.mark.parametrize(("magnitude", "p"), [(0.4, 0.5), (1.5, 1.0), (0.0, 1.0), (0.8, 0.0)])
def test_matches_numpy_model(op_type: type[RandomBrightness], magnitude: float, p: float, compiled: bool) -> None:
    rng = np.random.default_rng(5)
    images = rng.integers(0, 256, (24, 9, 7, 3), dtype=np.uint8)
    seeds = rng.integers(0, 2**63, 24, dtype=np.int64).astype(np.uint64)
    op = op_type(magnitude, p=p)
    state, memory = op.declare_state_and_memory(HWC)
    assert state == HWC and memory is None
    with Compiler.enabled(compiled):
        fn = op.generate_code()
    batch = images.copy()
    out = fn(batch, None, np.arange(24), seeds)
    expected = reference(op, images, seeds)
    np.testing.assert_array_equal(out, expected)
    changed = (out != images).any(axis=(1, 2, 3))
    if p == 0.0 or magnitude == 0.0:
        assert not changed.any()
    if p == 1.0 and magnitude > 1.0:
        assert changed.all()
    if p == 0.5:
        assert 0 < changed.sum() < 24


@pytest.mark.parametrize("op_type", OPS)
@pytest.mark.parametrize(
    ("state", "match"),
    [
        (replace(HWC, dtype=np.dtype(np.float32)), "uint8 images"),
        (replace(HWC, shape=(3, 9, 7), layout="CHW"), "uint8 images"),
        (replace(HWC, shape=(9, 7, 4)), "3 channels"),
        (replace(HWC, layout=None), "expects image samples"),
        (replace(HWC, jit_mode=False), "compiled operation on numpy batches"),
    ],
)
def test_refuses_what_it_cannot_change(op_type: type[RandomBrightness], state: State, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        op_type(0.5).declare_state_and_memory(state)


@pytest.mark.parametrize("op_type", OPS)
@pytest.mark.parametrize(("magnitude", "p"), [(-0.1, 0.5), (0.5, -0.1), (0.5, 1.5), (float("nan"), 0.5), (0.5, float("nan"))])
def test_bad_arguments(op_type: type[RandomBrightness], magnitude: float, p: float) -> None:
    with pytest.raises(ValueError, match="must"):
        op_type(magnitude, p=p)


@pytest.mark.long  # three loaders of the three operations fused, serial and parallel (TEST_SPLIT.md)
def test_in_a_loader_the_draws_follow_the_seed(tmp_path: Path) -> None:
    images = np.random.default_rng(6).integers(0, 256, (20, 9, 7, 3), dtype=np.uint8)
    path = tmp_path / "colour.stoker"
    fields = {"img": RGBImageField(), "label": IntField()}
    DatasetWriter(path, fields, num_workers=1, progress=False).from_indexed_dataset([(images[i], i) for i in range(20)])

    def epoch(seed: int, num_workers: int) -> np.ndarray:
        ops = [SimpleRGBImageDecoder(), RandomBrightness(0.5), RandomContrast(0.5), RandomSaturation(0.5, p=1.0), ToTensor()]
        pipelines = {"img": ops, "label": [IntDecoder(), ToTensor()]}
        loader = Loader(path, batch_size=8, order=OrderOption.RANDOM, seed=seed, num_workers=num_workers, pipelines=pipelines)
        out, labels = zip(*((img.numpy(), label.numpy()[:, 0]) for img, label in loader), strict=True)
        return np.concatenate(out)[np.argsort(np.concatenate(labels))]

    first = epoch(0, 1)
    assert first.shape == images.shape and first.dtype == np.uint8
    assert (first != images).any(axis=(1, 2, 3)).all()  # saturation with p=1 changes every random image
    np.testing.assert_array_equal(epoch(0, 2), first)
    assert not np.array_equal(epoch(1, 1), first)


def test_after_normalize_image_it_is_refused() -> None:
    state = NormalizeImage(np.zeros(3), np.ones(3), np.float32).declare_state_and_memory(HWC)[0]
    with pytest.raises(ValueError, match="before NormalizeImage"):
        RandomBrightness(0.5).declare_state_and_memory(state)
