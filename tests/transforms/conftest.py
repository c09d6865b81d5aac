"""A small image dataset (``img``: random 9x7 RGB, ``label``: the sample's index) and a helper to run pipelines over it."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from stoker.fields import IntField, RGBImageField
from stoker.loader import Loader, OrderOption
from stoker.pipeline.compiler import Compiler
from stoker.writer import DatasetWriter

from .._profile import python_producers_unless_long

N, H, W = 60, 9, 7  # an odd, non-square size catches transposed and off-by-one kernels


@lru_cache(maxsize=1)
def images() -> np.ndarray:
    """The dataset's images, ``(N, H, W, 3)`` uint8."""
    return np.random.default_rng(1234).integers(0, 256, (N, H, W, 3), dtype=np.uint8)


@pytest.fixture(autouse=True)
def _python_producers_unless_long(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``make test`` (profile ``ci``) the batches are made by Python producers (``tests/_profile.py``)."""
    python_producers_unless_long(monkeypatch)


@pytest.fixture(scope="session")
def images_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("transforms") / "images.stoker"
    samples = [(images()[i], i) for i in range(N)]
    DatasetWriter(path, {"img": RGBImageField(), "label": IntField()}, num_workers=1, progress=False).from_indexed_dataset(samples)
    return path


@pytest.fixture(params=[True, False], ids=["compiled", "python"])
def compiled(request: pytest.FixtureRequest) -> bool:
    """Run the test with the pipelines compiled by Numba, then in plain Python."""
    return bool(request.param)


def run(
    path: Path,
    img_ops: Sequence[Any] | None,
    label_ops: Sequence[Any] | None = None,
    *,
    epochs: int = 2,
    seed: int = 0,
    num_workers: int = 1,
    compiled: bool = True,
    batch_size: int = 16,
) -> list[tuple[np.ndarray, ...]]:
    """Per epoch: each kept field's output for the whole epoch (batches concatenated), in field order (img, label)."""
    from stoker.decoders import IntDecoder
    from stoker.transforms import ToTensor

    pipelines = {"img": img_ops, "label": [IntDecoder(), ToTensor()] if label_ops is None else label_ops}
    with Compiler.enabled(compiled):
        loader = Loader(path, batch_size=batch_size, order=OrderOption.RANDOM, seed=seed, num_workers=num_workers, pipelines=pipelines)
    assert compiled or all(p.fused is None for p in loader.pipelines), "Compiler.enabled(False) builds uncompiled pipelines"
    epochs_out = []
    for _ in range(epochs):
        batches = [[t.cpu().numpy().copy() if isinstance(t, torch.Tensor) else np.array(t) for t in batch] for batch in loader]
        epochs_out.append(tuple(np.concatenate(parts) for parts in zip(*batches)))
    return epochs_out
