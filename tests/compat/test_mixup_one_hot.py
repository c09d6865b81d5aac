"""MixupToOneHot: LabelMixup's rows as soft one-hot targets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from stoker.fields import IntField
from stoker.fields.decoders import IntDecoder
from stoker.loader import Loader, OrderOption
from stoker.pipeline.state import State
from stoker.transforms import LabelMixup, ToTensor
from stoker.transforms.mixup_one_hot import MixupToOneHot
from stoker.writer import DatasetWriter

ROWS = State(False, torch.device("cpu"), (3,), torch.float64)


def one_hot_reference(rows: np.ndarray, num_classes: int) -> np.ndarray:
    out = np.zeros((len(rows), num_classes))
    for i, (a, b, lam) in enumerate(rows):
        out[i, int(a)] += lam
        out[i, int(b)] += 1 - lam
    return out


def test_rows_become_soft_targets() -> None:
    op = MixupToOneHot(4)
    state, memory = op.declare_state_and_memory(ROWS)
    assert state.shape == (4,) and memory is not None and memory.shape == (4,) and memory.dtype == torch.float64
    rows = torch.tensor([[0, 3, 0.25], [2, 2, 0.7], [1, 0, 1.0], [3, 1, 0.5]], dtype=torch.float64)
    dst = torch.full((6, 4), 9.0, dtype=torch.float64)  # a slot larger than the batch, holding an older batch
    out = op.generate_code()(rows, dst)
    assert out.shape == (4, 4)
    np.testing.assert_allclose(out.numpy(), one_hot_reference(rows.numpy(), 4))
    np.testing.assert_allclose(out.sum(dim=1).numpy(), 1.0)


@pytest.mark.parametrize("num_classes", [0, -2, 2.5, True])
def test_bad_num_classes(num_classes: int) -> None:
    with pytest.raises(ValueError, match="num_classes must be an int >= 1"):
        MixupToOneHot(num_classes)


@pytest.mark.parametrize(
    ("state", "match"),
    [
        (State(True, None, (3,), np.dtype(np.float64)), "after LabelMixup and ToTensor"),
        (State(False, torch.device("cpu"), (1,), torch.int64), r"sample shape \(3,\)"),
    ],
)
def test_refuses_other_batches(state: State, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MixupToOneHot(3).declare_state_and_memory(state)


def test_in_a_loader_it_follows_label_mixup(tmp_path: Path) -> None:
    path = tmp_path / "labels.stoker"
    fields = {"label": IntField(), "same_label": IntField()}
    DatasetWriter(path, fields, num_workers=1, progress=False).from_indexed_dataset([(i % 5, i % 5) for i in range(37)])
    pipelines = {
        "label": [IntDecoder(), LabelMixup(0.4, False), ToTensor(), MixupToOneHot(5)],
        "same_label": [IntDecoder(), LabelMixup(0.4, False), ToTensor()],  # the same seeds: the same rows
    }
    loader = Loader(path, batch_size=8, order=OrderOption.RANDOM, seed=2, num_workers=2, pipelines=pipelines)
    batches = list(loader)
    assert [len(t) for t, _ in batches] == [8, 8, 8, 8, 5]
    for targets, rows in batches:
        assert targets.shape == (len(rows), 5) and targets.dtype == torch.float64
        np.testing.assert_allclose(targets.numpy(), one_hot_reference(rows.numpy(), 5))
    assert not all(np.array_equal(r[:, 0], r[:, 1]) for _, r in batches), "some samples are mixed with another"
