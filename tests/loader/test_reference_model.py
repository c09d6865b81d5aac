"""The Loader against a pure-numpy model of the same (seed, epoch, position) stream: identical batches.

Hypothesis draws a pipeline of the built-in image operations (in any order,
valid or not), a batch size, a slot count (``batches_ahead``), a thread count,
an order, ``drop_last``, ``indices`` with repeats, a seed and a first epoch.
The model (``tests/transforms/reference.py``) re-derives everything from the
documented contract: the epoch's order (:func:`stoker.loader.order.epoch_order`),
``drop_last``, the batches, each sample's seeds
(``sample_seeds(seed, epoch, position, field_position * 1000 + op_position)``,
the position being the sample's place in the epoch's order) and each
operation, in numpy. Every batch of two epochs must be equal, bit for bit; a
pipeline the model refuses must be refused when the Loader is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from stoker.decoders import IntDecoder, SimpleRGBImageDecoder
from stoker.errors import PipelineError
from stoker.fields import IntField, RGBImageField
from stoker.loader import Loader, OrderOption
from stoker.loader.order import epoch_order
from stoker.transforms import ToTensor
from stoker.writer import DatasetWriter

from .._profile import examples
from ..transforms import reference as ref

pytestmark = pytest.mark.compiled_loop  # (the compiled producer loop: tests/conftest.py)

N, H, W = 23, 12, 17
FIELDS = {"label": IntField(), "skipped": IntField(), "img": RGBImageField()}
IMG_FIELD = 2  # every field counts in the salt, skipped ones too
MEAN, STD = (125.3, 122.9, 113.8), (63.0, 62.1, 66.7)

# a few fixed variants of each operation: pipelines repeat, and their compiled code is cached
OPERATIONS: list[ref.Op] = [
    ref.Flip(0.5),
    ref.Flip(1.0),
    ref.Translate(3, (125, 123, 114)),
    ref.Cutout(5, (7, 8, 9)),
    ref.Normalize(MEAN, STD),
    ref.Tensor(),
    ref.TorchImage(True),
    ref.TorchImage(False),
]
NUMPY_OPS = [ref.Flip(0.5), ref.Translate(3, (125, 123, 114)), ref.Cutout(5, (7, 8, 9))]


def images() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, (N, H, W, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reference_model") / "images.stoker"
    samples = [(i, -i, img) for i, img in enumerate(images())]
    DatasetWriter(out, FIELDS, num_workers=1, progress=False).from_indexed_dataset(samples)
    return out


@st.composite
def pipelines(draw: st.DrawFn) -> list[ref.Op]:
    """Mostly valid pipelines: numpy operations (NormalizeImage at most once among them), ToTensor, tensor operations;
    one in five is any sequence of the operations, which the loader must usually refuse."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.lists(st.sampled_from(OPERATIONS), max_size=5))
    head = draw(st.lists(st.sampled_from(NUMPY_OPS), max_size=3))
    if draw(st.integers(0, 2)):
        head.insert(draw(st.integers(0, len(head))), ref.Normalize(MEAN, STD))
    tail = draw(st.lists(st.sampled_from([ref.TorchImage(True), ref.TorchImage(False), ref.Normalize(MEAN, STD)]), max_size=2))
    return [*head, ref.Tensor(), *tail]


@st.composite
def index_lists(draw: st.DrawFn) -> list[int] | None:
    """None (every sample), or indices with repeats: runs ``[i] * k`` mixed with single indices."""
    if draw(st.booleans()):
        return None
    runs = draw(st.lists(st.tuples(st.integers(0, N - 1), st.integers(1, 4)), max_size=12))
    return [i for i, k in runs for _ in range(k)]


def expected_epoch(ops: list[ref.Op], loader_args: dict[str, Any], indices: np.ndarray, epoch: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The model's (labels, images) batches of ``epoch``."""
    bs, seed = loader_args["batch_size"], loader_args["seed"]
    order = epoch_order(loader_args["order"], indices, seed, epoch, loader_args["chunk_size"], loader_args["window_chunks"])
    if loader_args["drop_last"]:
        order = order[: len(order) // bs * bs]
    pictures = images()
    out = []
    for lo in range(0, len(order), bs):
        positions = np.arange(lo, min(lo + bs, len(order)))
        batch = order[positions]
        seeds = [ref.sample_seeds(seed, epoch, positions, ref.salt(IMG_FIELD, k + 1)) for k in range(len(ops))]
        out.append((batch, ref.run(ops, pictures[batch], seeds).x))
    return out


@settings(max_examples=examples(ci=2, long=35), deadline=None, database=None)
@given(
    ops=pipelines(),
    batch_size=st.integers(1, 9),
    batches_ahead=st.integers(1, 4),
    num_workers=st.sampled_from([1, 2]),
    order=st.sampled_from(list(OrderOption)),
    drop_last=st.booleans(),
    indices=index_lists(),
    seed=st.integers(0, 2**64 - 1),
    first_epoch=st.sampled_from([0, 0, 5]),
    chunk_size=st.integers(1, 10),
    window_chunks=st.integers(1, 3),
)
@example(  # FFCV's order, with the flip, translate and cutout of issue 7 on the normalised CHW batch
    ops=[ref.Normalize(MEAN, STD), *NUMPY_OPS, ref.Tensor(), ref.TorchImage(True)],
    batch_size=4,
    batches_ahead=2,
    num_workers=2,
    order=OrderOption.RANDOM,
    drop_last=True,
    indices=[3, 3, 3, 0, 5, 5, 22, 1, 3, 9, 9, 9, 9, 14],
    seed=2**63 + 5,
    first_epoch=5,
    chunk_size=4,
    window_chunks=2,
)
@example(
    ops=[*NUMPY_OPS[::-1], ref.Tensor(), ref.TorchImage(False), ref.Normalize(MEAN, STD)],
    batch_size=5,
    batches_ahead=3,
    num_workers=1,
    order=OrderOption.QUASI_RANDOM,
    drop_last=False,
    indices=None,
    seed=11,
    first_epoch=0,
    chunk_size=3,
    window_chunks=2,
)
def test_batches_equal_the_model(
    path: Path,
    ops: list[ref.Op],
    batch_size: int,
    batches_ahead: int,
    num_workers: int,
    order: OrderOption,
    drop_last: bool,
    indices: list[int] | None,
    seed: int,
    first_epoch: int,
    chunk_size: int,
    window_chunks: int,
) -> None:
    args: dict[str, Any] = dict(
        batch_size=batch_size,
        batches_ahead=batches_ahead,
        num_workers=num_workers,
        order=order,
        drop_last=drop_last,
        seed=seed,
        chunk_size=chunk_size,
        window_chunks=window_chunks,
    )
    pipelines = {
        "label": [IntDecoder(), ToTensor()],
        "skipped": None,
        "img": [SimpleRGBImageDecoder(), *(ref.stoker_op(op) for op in ops)],
    }
    try:
        ref.check(ops)
    except ref.Invalid:
        event("pipeline refused")
        with pytest.raises(PipelineError):
            Loader(path, pipelines=pipelines, indices=indices, **args)
        return
    event("pipeline run")
    loader = Loader(path, pipelines=pipelines, indices=indices, **args)
    if first_epoch:
        loader.set_epoch(first_epoch)
    all_indices = np.arange(N) if indices is None else np.array(indices, dtype=np.int64)
    for epoch in (first_epoch, first_epoch + 1):
        want = expected_epoch(ops, args, all_indices, epoch)
        got = [(label.numpy()[:, 0].copy(), as_numpy(img)) for label, img in loader]
        assert len(got) == len(want) == len(loader), f"epoch {epoch}: {len(got)} batches, the model has {len(want)}"
        for b, ((labels, img), (want_labels, want_img)) in enumerate(zip(got, want)):
            where = f"epoch {epoch}, batch {b} of pipeline {ops}"
            np.testing.assert_array_equal(labels, want_labels, err_msg=where)
            assert img.shape == want_img.shape and img.dtype == want_img.dtype, f"{where}: {img.shape} {img.dtype}"
            np.testing.assert_array_equal(img, want_img, err_msg=where)


def as_numpy(x: Any) -> np.ndarray:
    """A copy: the loader may reuse the batch's memory once it is released."""
    return x.numpy().copy() if isinstance(x, torch.Tensor) else np.array(x)
