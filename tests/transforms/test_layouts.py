"""Image layouts: every order of the image operations, on non-square images, against the numpy model.

The state carries each sample's layout ("HWC" from the decoders, "CHW" after
``NormalizeImage`` or ``ToTorchImage``); every image operation reads it
instead of guessing from the shape. The images are 9x7 and 5x3: with a width
of 3, a layout read from the shape (``last dimension == channels``) is wrong.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from stoker.decoders import IntDecoder, NDArrayDecoder, SimpleRGBImageDecoder
from stoker.errors import PipelineError
from stoker.fields import IntField, NDArrayField, RGBImageField
from stoker.loader import Loader, OrderOption
from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.operation import Operation
from stoker.pipeline.state import State
from stoker.transforms import (
    Cutout,
    ImageMixup,
    NormalizeImage,
    RandomHorizontalFlip,
    RandomTranslate,
    ToTensor,
    ToTorchImage,
)
from stoker.writer import DatasetWriter

from . import reference as ref

N = 21  # two full batches of 8 and one of 5
SIZES = [(9, 7), (5, 3)]
BATCH = 8
SEED = 5
IMG_FIELD = 1  # the image field's position among the file's fields: its operations' seeds are salted 1000 + position
MEAN, STD = (120.0, 110.0, 100.0), (60.0, 55.0, 50.0)


def pictures(h: int, w: int) -> np.ndarray:
    return np.random.default_rng(h * 100 + w).integers(0, 256, (N, h, w, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], Path]:
    """Per image size: ``label`` (the index), ``img`` (raw RGB), ``arr`` (the same pixels as an NDArrayField)."""
    out = {}
    for h, w in SIZES:
        path = tmp_path_factory.mktemp("layouts") / f"images_{h}x{w}.stoker"
        fields = {"label": IntField(), "img": RGBImageField(), "arr": NDArrayField(shape=(h, w, 3), dtype=np.dtype("u1"))}
        samples = [(i, img, img) for i, img in enumerate(pictures(h, w))]
        DatasetWriter(path, fields, num_workers=1, progress=False).from_indexed_dataset(samples)
        out[h, w] = path
    return out


def loader(path: Path, img_ops: Sequence[Any], *, compiled: bool = True, **kwargs: Any) -> Loader:
    pipelines = {"label": [IntDecoder(), ToTensor()], "img": list(img_ops), "arr": None}
    return Loader(path, batch_size=BATCH, order=OrderOption.SEQUENTIAL, seed=SEED, num_workers=1, pipelines=pipelines, compile=compiled)


def expected(ops: Sequence[ref.Op], images: np.ndarray, epoch: int) -> list[np.ndarray]:
    """The model's batches of one epoch (SEQUENTIAL order: the position of a sample is its index)."""
    out = []
    for start in range(0, len(images), BATCH):
        positions = np.arange(start, min(start + BATCH, len(images)))
        seeds = [ref.sample_seeds(SEED, epoch, positions, ref.salt(IMG_FIELD, k + 1)) for k in range(len(ops))]
        out.append(ref.run(ops, images[positions], seeds).x)
    return out


def as_numpy(x: Any) -> np.ndarray:
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def check_against_model(path: Path, ops: Sequence[ref.Op], images: np.ndarray, compiled: bool) -> None:
    ld = loader(path, [SimpleRGBImageDecoder(), *(ref.stoker_op(op) for op in ops)], compiled=compiled)
    for epoch in range(2):
        batches = list(ld)
        want = expected(ops, images, epoch)
        assert len(batches) == len(want)
        for b, ((label, got), exp) in enumerate(zip(batches, want)):
            np.testing.assert_array_equal(label.numpy()[:, 0], np.arange(b * BATCH, b * BATCH + len(exp)))
            got_np = as_numpy(got)
            assert got_np.shape == exp.shape and got_np.dtype == exp.dtype, f"batch {b}: {got_np.shape} {got_np.dtype}"
            np.testing.assert_array_equal(got_np, exp, err_msg=f"epoch {epoch}, batch {b}, pipeline {ops}")


def valid_orders() -> list[list[ref.Op]]:
    """Every order of flip, translate, cutout, normalize and ToTorchImage that a loader accepts.

    The numpy operations (flip, translate, cutout) go before ToTensor, ToTorchImage after it;
    NormalizeImage goes anywhere: before, between or after the others, on numpy batches or on tensors.
    """
    numpy_ops: list[ref.Op] = [ref.Flip(0.5), ref.Translate(2, (10, 20, 30)), ref.Cutout(3, (7, 8, 9))]
    orders = []
    for perm in itertools.permutations(numpy_ops):
        for place in range(len(perm) + 3):
            tail: list[ref.Op] = [ref.Tensor(), ref.TorchImage()]
            head = list(perm)
            if place <= len(perm):
                head.insert(place, ref.Normalize(MEAN, STD))
            else:
                tail.insert(place - len(perm), ref.Normalize(MEAN, STD))
            orders.append(head + tail)
    return orders


def name(ops: Sequence[ref.Op]) -> str:
    return "-".join(type(op).__name__ for op in ops)


ORDERS = valid_orders()


# compiling a pipeline takes seconds: every order runs uncompiled, and these compiled, which between them give
# each compiled kernel both layouts (and both dtypes) and NormalizeImage and ToTorchImage each input layout
COMPILED_ORDERS = [
    [ref.Flip(0.5), ref.Translate(2, (10, 20, 30)), ref.Cutout(3, (7, 8, 9)), ref.Tensor(), ref.TorchImage(), ref.Normalize(MEAN, STD)],
    [ref.Normalize(MEAN, STD), ref.Cutout(3, (7, 8, 9)), ref.Translate(2, (10, 20, 30)), ref.Flip(0.5), ref.Tensor(), ref.TorchImage()],
    [ref.Translate(2, (10, 20, 30)), ref.Flip(0.5), ref.Cutout(3, (7, 8, 9)), ref.Tensor(), ref.Normalize(MEAN, STD), ref.TorchImage()],
]


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("ops", ORDERS, ids=[name(o) for o in ORDERS])
def test_every_order_matches_the_model(datasets: dict, ops: list[ref.Op], size: tuple[int, int]) -> None:
    check_against_model(datasets[size], ops, pictures(*size), compiled=False)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("ops", COMPILED_ORDERS, ids=[name(o) for o in COMPILED_ORDERS])
def test_compiled_orders_match_the_model(datasets: dict, ops: list[ref.Op], size: tuple[int, int]) -> None:
    assert ops in ORDERS
    check_against_model(datasets[size], ops, pictures(*size), compiled=True)


@pytest.mark.parametrize(
    "ops",
    [
        [ref.Normalize(MEAN, STD), ref.Flip(1.0), ref.Tensor()],  # the FFCV pipeline of issue 7
        [ref.Normalize(MEAN, STD), ref.Tensor(), ref.TorchImage()],
        [ref.Tensor(), ref.TorchImage(), ref.Normalize(MEAN, STD)],
        [ref.Tensor(), ref.TorchImage(channels_last=False), ref.Normalize(MEAN, STD)],
        [ref.Normalize(MEAN, STD), ref.Translate(12, (0.5, -1.0, 2.0)), ref.Cutout(20, (1.5, 0.0, -3.0)), ref.Tensor()],
    ],
    ids=["normalize-flip", "normalize-torchimage", "torchimage-normalize", "contiguous-normalize", "float-fill"],
)
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_ffcv_pipelines(datasets: dict, ops: list[ref.Op], compiled: bool, size: tuple[int, int]) -> None:
    check_against_model(datasets[size], ops, pictures(*size), compiled=compiled)


def test_states_carry_the_layout(datasets: dict) -> None:
    ops = [SimpleRGBImageDecoder(), RandomHorizontalFlip(), NormalizeImage(np.array(MEAN), np.array(STD), np.float32), ToTensor()]
    ld = loader(datasets[9, 7], ops)
    assert ld.pipelines[1].final_state.layout == "CHW" and ld.pipelines[1].final_state.shape == (3, 9, 7)
    ld = loader(datasets[5, 3], [SimpleRGBImageDecoder(), ToTensor(), ToTorchImage()])
    assert ld.pipelines[1].final_state.layout == "CHW" and ld.pipelines[1].final_state.shape == (3, 5, 3)
    assert ld.pipelines[0].final_state.layout is None, "labels are not images"


@pytest.mark.parametrize("channels_last", [True, False])
def test_to_torch_image_memory(datasets: dict, channels_last: bool) -> None:
    """HWC: an NCHW view of channels-last memory (as FFCV), or a contiguous copy; CHW: NCHW contiguous either way."""
    ld = loader(datasets[9, 7], [SimpleRGBImageDecoder(), ToTensor(), ToTorchImage(channels_last)])
    (_, x), *_ = list(ld)
    assert x.shape == (BATCH, 3, 9, 7)
    assert x.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    norm = NormalizeImage(np.array(MEAN), np.array(STD), np.float32)
    ld = loader(datasets[9, 7], [SimpleRGBImageDecoder(), norm, ToTensor(), ToTorchImage(channels_last)])
    (_, x), *_ = list(ld)
    assert x.shape == (BATCH, 3, 9, 7) and x.is_contiguous()


# ---- pipelines that must be refused when the loader is built --------------------------------------
def normalize() -> NormalizeImage:
    return NormalizeImage(np.array(MEAN), np.array(STD), np.float32)


@pytest.mark.parametrize(
    ("ops", "message"),
    [
        ([ToTensor(), RandomHorizontalFlip()], "before ToTensor"),
        ([ToTensor(), RandomTranslate(1)], "before ToTensor"),
        ([ToTensor(), Cutout(2)], "before ToTensor"),
        ([ToTorchImage(), ToTensor()], "after ToTensor"),
        ([normalize(), normalize()], "uint8"),
        ([normalize(), ImageMixup(0.5, False)], "uint8"),
    ],
    ids=["flip-tensor", "translate-tensor", "cutout-tensor", "torchimage-numpy", "normalize-twice", "mixup-float"],
)
def test_misplaced_operations_are_refused(datasets: dict, ops: list, message: str) -> None:
    with pytest.raises(PipelineError, match=message):
        loader(datasets[9, 7], [SimpleRGBImageDecoder(), *ops])


@pytest.mark.parametrize(
    "op",
    [RandomHorizontalFlip(), RandomTranslate(1), Cutout(2), normalize(), ImageMixup(0.5, False)],
    ids=lambda op: type(op).__name__,
)
def test_image_operations_refuse_labels(datasets: dict, op: Operation) -> None:
    pipelines = {"label": [IntDecoder(), op], "img": None, "arr": None}
    with pytest.raises(PipelineError, match=rf"{type(op).__name__} expects image samples.*shape \(1,\), layout None"):
        Loader(datasets[9, 7], batch_size=4, pipelines=pipelines)


@pytest.mark.parametrize(
    "ops",
    [
        [ToTensor(), ToTorchImage()],
        [RandomHorizontalFlip()],
        [RandomTranslate(1)],
        [Cutout(2)],
        [normalize()],
        [ImageMixup(0.5, False)],
        [ToTensor(), normalize()],
    ],
    ids=["ToTorchImage", "flip", "translate", "cutout", "normalize", "mixup", "normalize-tensor"],
)
def test_unknown_layout_is_an_error_not_a_guess(datasets: dict, ops: list) -> None:
    """An NDArrayField of (h, w, 3) arrays has no declared layout: image operations say so and how to declare it."""
    pipelines = {"label": None, "img": None, "arr": [NDArrayDecoder(), *ops]}
    with pytest.raises(PipelineError, match=r"layout of these samples is unknown.*layout='HWC'"):
        Loader(datasets[5, 3], batch_size=4, pipelines=pipelines)


# ---- operations written by users ------------------------------------------------------------------
class DeclareHWC(Operation):
    """What the layout error tells users to write: declare that these arrays are (height, width, channels) images."""

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        return replace(previous_state, layout="HWC"), None

    def generate_code(self) -> Callable[..., Any]:
        return lambda batch, dst: batch


class CropTop(Operation):
    """An FFCV-style operation: ``replace(previous_state, shape=...)`` keeps the layout it does not mention."""

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        h, w, c = previous_state.shape
        return replace(previous_state, shape=(h - 1, w, c)), AllocationQuery((h - 1, w, c), np.dtype("u1"))

    def generate_code(self) -> Callable[..., Any]:
        def crop_top(batch: np.ndarray, dst: np.ndarray) -> np.ndarray:
            dst[:] = batch[:, 1:]
            return dst

        return crop_top


class ToCHW(Operation):
    """A user operation that changes the layout, and says so."""

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        h, w, c = previous_state.image_size(self)
        return replace(previous_state, shape=(c, h, w), layout="CHW"), AllocationQuery((c, h, w), np.dtype(previous_state.dtype))

    def generate_code(self) -> Callable[..., Any]:
        def to_chw(batch: np.ndarray, dst: np.ndarray) -> np.ndarray:
            n, h, w, c = batch.shape
            for i in range(n):
                for k in range(c):
                    for y in range(h):
                        for x in range(w):
                            dst[i, k, y, x] = batch[i, y, x, k]
            return dst

        return to_chw


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_normalize_reads_chw_numpy_batches(datasets: dict, dtype: type, compiled: bool) -> None:
    ops = [SimpleRGBImageDecoder(), ToCHW(), NormalizeImage(np.array(MEAN), np.array(STD), dtype), ToTensor(), ToTorchImage()]
    ld = loader(datasets[5, 3], ops, compiled=compiled)
    (_, got), *_ = list(ld)
    x = pictures(5, 3)[:BATCH].astype(np.float32)
    mean, std = np.array(MEAN, np.float32), np.array(STD, np.float32)
    if dtype == np.float32:
        want = (x - mean) * (np.float32(1.0) / std)
    else:
        want = ((x - mean) / std).astype(np.float16)  # float16 looks each value up in a table computed so
    np.testing.assert_array_equal(got.numpy(), want.transpose(0, 3, 1, 2))


def test_declared_layout_and_custom_operations(datasets: dict) -> None:
    pipelines = {
        "label": None,
        "img": None,
        "arr": [NDArrayDecoder(), DeclareHWC(), CropTop(), RandomHorizontalFlip(1.0), ToTensor(), ToTorchImage()],
    }
    (x,) = next(iter(Loader(datasets[9, 7], batch_size=4, num_workers=1, pipelines=pipelines, compile=False)))
    np.testing.assert_array_equal(x.numpy(), pictures(9, 7)[:4, 1:, ::-1].transpose(0, 3, 1, 2))


def test_state_layout_field() -> None:
    cpu = torch.device("cpu")
    old_style = State(True, cpu, (4, 5, 3), np.dtype("u1"))  # FFCV's four positional fields still work
    assert old_style.layout is None
    image = State(True, cpu, (4, 5, 3), np.dtype("u1"), layout="HWC")
    assert replace(image, shape=(2, 5, 3)).layout == "HWC", "replace keeps the layout it does not mention"
    assert replace(image, shape=(60,)).layout is None, "a layout describes 3-d samples only"
    assert image.image_size() == (4, 5, 3) and replace(image, shape=(3, 4, 5), layout="CHW").image_size() == (4, 5, 3)
    with pytest.raises(ValueError, match="layout must be 'HWC', 'CHW' or None; got 'NHWC'"):
        State(True, cpu, (4, 5, 3), np.dtype("u1"), layout="NHWC")
