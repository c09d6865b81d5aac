"""RandomResizedCrop on decoded images: the same crops as RandomResizedCropRGBImageDecoder, from the same seeds."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from stoker.fields import IntField, RGBImageField
from stoker.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder, SimpleRGBImageDecoder
from stoker.loader import Loader, OrderOption
from stoker.pipeline.compiler import Compiler
from stoker.pipeline.operation import Operation
from stoker.pipeline.state import State
from stoker.transforms import ToTensor
from stoker.transforms.random_resized_crop import RandomResizedCrop
from stoker.writer import DatasetWriter

N, H, W = 24, 30, 41
HWC = State(True, None, (H, W, 3), np.dtype(np.uint8), layout="HWC")


@pytest.fixture(scope="module")
def raw_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    images = np.random.default_rng(9).integers(0, 256, (N, H, W, 3), dtype=np.uint8)
    path = tmp_path_factory.mktemp("rrc") / "raw.stoker"
    fields = {"img": RGBImageField(write_mode="raw"), "label": IntField()}
    DatasetWriter(path, fields, num_workers=1, progress=False).from_indexed_dataset([(images[i], i) for i in range(N)])
    return path


def epoch(path: Path, ops: list[Operation], compiled: bool) -> np.ndarray:
    with Compiler.enabled(compiled):
        loader = Loader(
            path,
            batch_size=10,
            order=OrderOption.RANDOM,
            seed=4,
            num_workers=2,
            pipelines={"img": [*ops, ToTensor()], "label": [IntDecoder(), ToTensor()]},
        )
    return np.concatenate([img.numpy() for img, _ in loader])


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
@pytest.mark.parametrize(
    ("scale", "ratio", "size"), [((0.08, 1.0), (3 / 4, 4 / 3), 16), ((0.5, 0.5), (0.2, 5.0), (20, 12)), ((1.0, 1.0), (1.0, 1.0), 48)]
)
def test_same_crops_as_the_decoder(
    raw_path: Path, compiled: bool, scale: tuple[float, float], ratio: tuple[float, float], size: int | tuple[int, int]
) -> None:
    decoder = RandomResizedCropRGBImageDecoder(size, scale=scale, ratio=ratio)
    transform = RandomResizedCrop(scale=scale, ratio=ratio, size=size)
    decoder.seed_salt = transform.seed_salt = 77  # type: ignore[attr-defined]  # the same seeds for both
    by_decoder = epoch(raw_path, [decoder], compiled)
    by_transform = epoch(raw_path, [SimpleRGBImageDecoder(), transform], compiled)
    oh, ow = (size, size) if isinstance(size, int) else size
    assert by_transform.shape == (N, oh, ow, 3) and by_transform.dtype == np.uint8
    np.testing.assert_array_equal(by_transform, by_decoder)


def test_crops_differ_between_samples() -> None:
    same = np.random.default_rng(0).integers(0, 256, (1, H, W, 3), dtype=np.uint8).repeat(8, axis=0)
    op = RandomResizedCrop((0.08, 1.0), (3 / 4, 4 / 3), 16)
    op.declare_state_and_memory(HWC)
    seeds = np.arange(8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    out = op.generate_code()(same, np.empty((8, 16, 16, 3), np.uint8), np.arange(8), seeds)
    assert len({o.tobytes() for o in out}) == 8


@pytest.mark.parametrize(
    ("state", "match"),
    [
        (replace(HWC, dtype=np.dtype(np.float32)), "uint8 RGB images"),
        (replace(HWC, shape=(3, H, W), layout="CHW"), "uint8 RGB images"),
        (replace(HWC, shape=(H, W, 1)), "uint8 RGB images"),
        (replace(HWC, layout=None), "expects image samples"),
    ],
)
def test_refuses_other_batches(state: State, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RandomResizedCrop((0.08, 1.0), (3 / 4, 4 / 3), 16).declare_state_and_memory(state)


@pytest.mark.parametrize(
    ("scale", "ratio", "size", "match"),
    [
        ((0.0, 1.0), (1.0, 1.0), 8, "scale"),
        ((0.5, 0.4), (1.0, 1.0), 8, "scale"),
        ((0.5, 1.0), (2.0, 1.0), 8, "ratio"),
        ((0.5, 1.0), (1.0, 1.0), 0, "size"),
        ((0.5, 1.0), (1.0, 1.0), (8,), "size"),
    ],
)
def test_bad_arguments(scale: tuple[float, float], ratio: tuple[float, float], size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RandomResizedCrop(scale, ratio, size)
