"""Raw images, flip and FFCV's NormalizeImage after ToTensor: one pass over each sample, the same batches.

FFCV's users write ``[SimpleRGBImageDecoder(), RandomHorizontalFlip(), ToTensor(), ToTorchImage(),
NormalizeImage(mean, std, np.float32)]``: the normalisation after ``ToTensor``, on the tensor. The loader
moves its work before ``ToTensor``, into the producers' loop over samples (fused with the decoder's copy and
the flip), and ``NormalizeImage`` on the tensor computes what the compiled kernel does. Hypothesis draws image
sizes, flips, places of the normalisation, orders, thread counts, batch sizes and seeds: the fused batches
(``STOKER_FUSE=1``), the batches of the pipeline as written (``STOKER_FUSE=0``) and a numpy model
(``tests/transforms/reference.py``'s seeds and draws) are equal, bit for bit. The mean, std and flip probability
are compiled into a fused loop as constants (each new value compiles it anew, seconds): the fused test keeps
``test_fusion.py``'s, and a second test draws means and stds for the pipelines as written, whose kernels take them
as arguments. Python producers run the pipelines (no producer loop compiled per example);
``tests/pipeline/test_fusion.py`` checks the compiled loop's twin.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stoker.decoders import IntDecoder, SimpleRGBImageDecoder
from stoker.fields import IntField, RGBImageField
from stoker.loader import Loader, OrderOption
from stoker.transforms import NormalizeImage, RandomHorizontalFlip, ToTensor, ToTorchImage
from stoker.writer import DatasetWriter

from .._profile import examples
from ..transforms import reference as ref

N = 11  # not a multiple of the batch sizes drawn
MEAN, STD = np.array([0.485, 0.456, 0.406]) * 255, np.array([0.229, 0.224, 0.225]) * 255  # test_fusion.py's: compiled once
IMAGE_FIELD = 0  # the image field's position among the file's fields (its operations' seeds are salted by it)
#: where the normalisation is: FFCV's places (after ToTensor, with or without ToTorchImage) and stoker's (before it)
ENDINGS = ("tensor", "view", "contiguous", "numpy")


@contextmanager
def _env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _pipeline(ending: str, flip: float | None, mean: np.ndarray, std: np.ndarray) -> list[Any]:
    ops: list[Any] = [SimpleRGBImageDecoder()]
    if flip is not None:
        ops.append(RandomHorizontalFlip(flip))
    normalize = NormalizeImage(mean, std, np.float32)
    if ending == "numpy":
        return [*ops, normalize, ToTensor(), ToTorchImage()]
    ops.append(ToTensor())
    if ending != "tensor":
        ops.append(ToTorchImage(channels_last=ending == "view"))
    return [*ops, normalize]


def _write(folder: Path, images: np.ndarray) -> Path:
    path = folder / "images.stoker"
    fields = {"image": RGBImageField(write_mode="raw"), "label": IntField()}
    DatasetWriter(path, fields, num_workers=1, progress=False).from_indexed_dataset([(im, i) for i, im in enumerate(images)])
    return path


def _epoch(path: Path, make: Callable[[], list[Any]], fuse: bool, **options: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    with _env(STOKER_FUSE="1" if fuse else "0"):
        loader = Loader(path, pipelines={"image": make(), "label": [IntDecoder(), ToTensor()]}, **options)
    try:
        out = []
        for x, y in loader:
            assert x.is_contiguous() and x.dtype.is_floating_point, (x.dtype, x.stride())
            out.append((x.numpy().copy(), y.numpy()[:, 0].copy()))
        return out
    finally:
        loader.close()


def _model(
    images: np.ndarray, labels: np.ndarray, start: int, flip: float | None, mean: np.ndarray, std: np.ndarray, seed: int
) -> np.ndarray:
    """The numpy model's batch: ``images[labels]``, flipped by their seeds' first draw, ``(x - mean) * (1 / std)`` in float32, NCHW."""
    b = ref.Batch(images[labels].copy())
    if flip is not None:
        positions = np.arange(start, start + len(labels))  # a sample's seed follows its position in the epoch's order
        b = ref.Flip(flip)(b, ref.sample_seeds(seed, 0, positions, ref.salt(IMAGE_FIELD, 1)))
    return ref.Normalize(tuple(mean), tuple(std))(b, np.zeros(0, np.uint64)).x


def _agree(
    path: Path, images: np.ndarray, ending: str, flip: float | None, mean: np.ndarray, std: np.ndarray, fuse: list[bool], **options: Any
) -> None:
    """Each of the loaders (fused or not) gives the model's batches, bit for bit."""
    bs, seed = options["batch_size"], options["seed"]
    for f in fuse:
        batches = _epoch(path, lambda: _pipeline(ending, flip, mean, std), f, **options)
        assert len(batches) == -(-N // bs)
        for k, (x, y) in enumerate(batches):
            want = _model(images, y, k * bs, flip, mean, std, seed)
            assert x.shape == want.shape and x.dtype == want.dtype == np.float32, (x.shape, x.dtype, want.shape)
            where = "fused" if f else "as written"
            assert np.array_equal(x, want), f"batch {k}: the pipeline ({ending}, {where}) differs from the model"


common = {
    "size": st.tuples(st.integers(1, 12), st.integers(1, 12)),
    "order": st.sampled_from([OrderOption.SEQUENTIAL, OrderOption.RANDOM]),
    "workers": st.sampled_from([1, 2]),
    "batch_size": st.sampled_from([3, 4]),
    "seed": st.integers(0, 2**31),
}


@settings(max_examples=examples(ci=4, long=30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ending=st.sampled_from(ENDINGS), flip=st.sampled_from([None, 0.5]), **common)
def test_fused_unfused_and_the_model_agree(
    size: tuple[int, int], ending: str, flip: float | None, order: OrderOption, workers: int, batch_size: int, seed: int
) -> None:
    images = np.random.default_rng(seed).integers(0, 256, (N, *size, 3), dtype=np.uint8)
    options = {"batch_size": batch_size, "order": order, "seed": seed, "num_workers": workers}
    with tempfile.TemporaryDirectory() as folder, _env(STOKER_COMPILED_EPOCH="0"):
        _agree(_write(Path(folder), images), images, ending, flip, MEAN, STD, [True, False], **options)


@settings(max_examples=examples(ci=4, long=30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ending=st.sampled_from(["tensor", "view", "contiguous"]),
    mean=st.lists(st.floats(0, 255, width=32), min_size=3, max_size=3),
    std=st.lists(st.floats(0.5, 128, width=32), min_size=3, max_size=3),
    **common,
)
def test_normalize_on_tensors_computes_the_kernels_values(
    size: tuple[int, int], ending: str, mean: list[float], std: list[float], order: OrderOption, workers: int, batch_size: int, seed: int
) -> None:
    """Any mean and std: NormalizeImage on uint8 CPU tensors (as written) gives the model's float32 values, bit for bit."""
    images = np.random.default_rng(seed).integers(0, 256, (N, *size, 3), dtype=np.uint8)
    options = {"batch_size": batch_size, "order": order, "seed": seed, "num_workers": workers}
    with tempfile.TemporaryDirectory() as folder, _env(STOKER_COMPILED_EPOCH="0"):
        path = _write(Path(folder), images)
        _agree(path, images, ending, None, np.array(mean, np.float32), np.array(std, np.float32), [False], **options)


@pytest.mark.parametrize(
    "ending",
    ["tensor", "view", "contiguous"],
)
def test_ffcv_normalize_runs_in_the_producers_pass(ending: str, tmp_path: Path) -> None:
    """FFCV's pipeline, fused: decoder, flip and normalisation are one loop over samples; nothing left on the tensor but views."""
    path = _write(tmp_path, np.random.default_rng(0).integers(0, 256, (N, 5, 7, 3), dtype=np.uint8))
    with _env(STOKER_FUSE="1", STOKER_COMPILED_EPOCH="0"):
        loader = Loader(path, batch_size=4, pipelines={"image": _pipeline(ending, 0.5, MEAN, STD), "label": [IntDecoder(), ToTensor()]})
    try:
        image = loader.pipelines[0]
        names = [type(s.op).__name__ for s in image.jit_steps]
        assert image.per_sample and names[0] == "SimpleRGBImageDecoder" and names[-1] == "NormalizeImage", names
        assert names[1] == "RandomHorizontalFlip", names
        x, _ = next(iter(loader))
        assert tuple(x.shape) == (4, 3, 5, 7) and x.is_contiguous()
    finally:
        loader.close()
