"""Fused pipelines (one loop over samples) give the batches the unfused ones give, bit for bit.

A hypothesis strategy draws built-in operation combinations (decoder, image operations in
any valid order, a normalisation, ``ToTorchImage``), orders, thread counts and seeds; each
is run fused (``STOKER_FUSE=1``: the head's per-sample loop, and ``ToTorchImage``'s copy moved
into it) and unfused (``STOKER_FUSE=0``: each step over the whole batch, as written), and
every batch of an epoch must be equal. Python producers run the fused function (no producer
loop to compile per example); a last test runs one combination through the compiled
producer loop, whose serial twin of the fused function is the same loop without threads.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stoker.decoders import CenterCropRGBImageDecoder, IntDecoder, RandomResizedCropRGBImageDecoder, SimpleRGBImageDecoder
from stoker.fields import IntField, RGBImageField
from stoker.loader import Loader, OrderOption
from stoker.transforms import (
    Cutout,
    NormalizeImage,
    RandomBrightness,
    RandomContrast,
    RandomHorizontalFlip,
    RandomSaturation,
    RandomTranslate,
    ToTensor,
    ToTorchImage,
)
from stoker.writer import DatasetWriter

from .._profile import examples

N = 23  # not a multiple of the batch sizes drawn
MEAN, STD = np.array([0.485, 0.456, 0.406]) * 255, np.array([0.229, 0.224, 0.225]) * 255


def _image(i: int, h: int, w: int) -> np.ndarray:
    rng = np.random.default_rng(i)
    yy, xx = np.mgrid[0:h, 0:w]
    smooth = 128 + 60 * np.sin(xx / (3 + i % 4)) + 40 * np.cos(yy / 5)
    return np.clip(smooth[..., None] + rng.normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Images of one size (raw and JPEG) and of several sizes (JPEG, for the crop decoders)."""
    folder = tmp_path_factory.mktemp("fusion")
    out = {}
    for name, mode, sized in (("raw", "raw", True), ("jpg", "jpg", True), ("photos", "jpg", False)):
        samples = [(_image(i, 10 if sized else 14 + i % 5, 13 if sized else 17 + i % 4), i) for i in range(N)]
        out[name] = folder / f"{name}.stoker"
        fields = {"image": RGBImageField(write_mode=mode, jpeg_quality=90), "label": IntField()}
        DatasetWriter(out[name], fields, num_workers=1, progress=False).from_indexed_dataset(samples)
    return out


# the operations that work on uint8 HWC images, and those that also work after NormalizeImage (CHW float32)
HWC_ONLY: list[Callable[[], Any]] = [
    lambda: RandomBrightness(0.4, p=0.7),
    lambda: RandomContrast(0.4, p=0.7),
    lambda: RandomSaturation(0.4, p=0.7),
]
ANY_LAYOUT: list[Callable[[], Any]] = [
    lambda: RandomHorizontalFlip(0.5),
    lambda: Cutout(3),
    lambda: RandomTranslate(2),
]


@st.composite
def pipelines(draw: st.DrawFn) -> tuple[str, Callable[[], list[Any]]]:
    """A dataset and a built-in image pipeline over it (made anew for each loader: operations hold per-loader state)."""
    decoder = draw(st.sampled_from(["simple-raw", "simple-jpg", "centre", "rrc"]))
    before = draw(st.lists(st.sampled_from(HWC_ONLY + ANY_LAYOUT), max_size=3))
    normalize = draw(st.booleans())
    after = draw(st.lists(st.sampled_from(ANY_LAYOUT), max_size=2)) if normalize else []
    ending = draw(st.sampled_from(["tensor", "chw", "channels_last"]))
    dataset = {"simple-raw": "raw", "simple-jpg": "jpg"}.get(decoder, "photos")

    def make() -> list[Any]:
        first = {
            "simple-raw": SimpleRGBImageDecoder,
            "simple-jpg": SimpleRGBImageDecoder,
            "centre": lambda: CenterCropRGBImageDecoder((8, 9), ratio=0.8),
            "rrc": lambda: RandomResizedCropRGBImageDecoder((9, 8)),
        }[decoder]()
        ops = [first, *(f() for f in before)]
        if normalize:
            ops.append(NormalizeImage(MEAN, STD, np.float32))
        ops += [f() for f in after]
        ops.append(ToTensor())
        if ending != "tensor":
            ops.append(ToTorchImage(channels_last=ending == "channels_last"))
        return ops

    return dataset, make


def _epoch(path: Path, make: Callable[[], list[Any]], fuse: bool, **options: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    with _env(STOKER_FUSE="1" if fuse else "0"):
        loader = Loader(path, pipelines={"image": make(), "label": [IntDecoder(), ToTensor()]}, **options)
    try:
        image = loader.pipelines[0]
        assert image.per_sample == (fuse and len(image.jit_steps) >= 2), [s.name for s in image.jit_steps]
        return [(x.numpy().copy(), y.numpy().copy()) for x, y in loader]
    finally:
        loader.close()


class _env:
    def __init__(self, **values: str) -> None:
        self.values = values
        self.old: dict[str, str | None] = {}

    def __enter__(self) -> None:
        for k, v in self.values.items():
            self.old[k] = os.environ.get(k)
            os.environ[k] = v

    def __exit__(self, *exc: object) -> None:
        for k, v in self.old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def python_producers() -> Iterator[None]:
    with _env(STOKER_COMPILED_EPOCH="0"):
        yield


@settings(max_examples=examples(ci=2, long=12), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pipeline=pipelines(),
    order=st.sampled_from([OrderOption.SEQUENTIAL, OrderOption.RANDOM]),
    workers=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**31),
    batch_size=st.sampled_from([4, 7]),
)
def test_fused_batches_are_the_unfused_ones(
    datasets: dict[str, Path], python_producers: None, pipeline: Any, order: OrderOption, workers: int, seed: int, batch_size: int
) -> None:
    dataset, make = pipeline
    options = {"batch_size": batch_size, "order": order, "seed": seed, "num_workers": workers}
    fused = _epoch(datasets[dataset], make, True, **options)
    unfused = _epoch(datasets[dataset], make, False, **options)
    assert len(fused) == len(unfused) == -(-N // batch_size)
    for k, ((xf, yf), (xu, yu)) in enumerate(zip(fused, unfused, strict=True)):
        assert xf.dtype == xu.dtype and xf.shape == xu.shape, (k, xf.dtype, xu.dtype, xf.shape, xu.shape)
        assert np.array_equal(xf, xu), f"batch {k}: the fused pipeline's images differ from the unfused one's"
        assert np.array_equal(yf, yu)


def test_the_pipelines_that_should_fuse_do(datasets: dict[str, Path]) -> None:
    """A decoder and image operations become one loop over samples, and ToTorchImage's copy moves into it."""
    ops = [RandomResizedCropRGBImageDecoder((9, 8)), RandomHorizontalFlip(), ToTensor(), ToTorchImage(channels_last=False)]
    loader = Loader(datasets["photos"], batch_size=5, pipelines={"image": ops, "label": [IntDecoder(), ToTensor()]})
    try:
        image = loader.pipelines[0]
        assert image.per_sample, "decoder + flip + ToTorchImage's copy should fuse into one pass"
        assert [type(s.op).__name__ for s in image.jit_steps] == ["RandomResizedCropRGBImageDecoder", "RandomHorizontalFlip", "ToCHW"]
        x, _ = next(iter(loader))
        assert x.is_contiguous() and tuple(x.shape) == (5, 3, 9, 8)
    finally:
        loader.close()


@pytest.mark.compiled_loop
def test_the_compiled_producer_loop_runs_the_fused_loop_serially(datasets: dict[str, Path]) -> None:
    """Through the compiled producer loop (one thread per producer: the serial twin of the fused loop), the same batches."""
    make = lambda: [SimpleRGBImageDecoder(), RandomHorizontalFlip(), NormalizeImage(MEAN, STD, np.float32), Cutout(3), ToTensor()]  # noqa: E731
    options = {"batch_size": 6, "order": OrderOption.RANDOM, "seed": 5, "num_workers": 1}
    with _env(STOKER_FUSE="1"):
        loader = Loader(datasets["raw"], pipelines={"image": make(), "label": [IntDecoder(), ToTensor()]}, **options)
    try:
        fused = [(x.numpy().copy(), y.numpy().copy()) for x, y in loader]
        assert loader._plan is not None and loader._plan.loop is not None, loader._plan
        assert loader.pipelines[0].per_sample
    finally:
        loader.close()
    unfused = _epoch(datasets["raw"], make, False, **options)
    for (xf, yf), (xu, yu) in zip(fused, unfused, strict=True):
        assert np.array_equal(xf, xu) and np.array_equal(yf, yu)
