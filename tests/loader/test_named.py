"""Named batches: ``Loader(..., named=True)`` yields dicts, field name -> output; skipped fields do not shift anything."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from stoker import to_device
from stoker.decoders import IntDecoder, NDArrayDecoder
from stoker.loader import Loader, OrderOption
from stoker.transforms import Squeeze, ToTensor

from .conftest import MIXED_FIELDS


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return bool(a == b)


def _snapshot(batch: object) -> object:
    """A copy of a batch that outlives the loader's memory reuse (tensors cloned)."""
    if isinstance(batch, dict):
        return {k: _snapshot(v) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(_snapshot(v) for v in batch)
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, np.ndarray):
        return batch.copy()
    return batch


# under ``make test`` Python producers make the batches: naming, not the loop, is the subject (tests/_profile.py)
pytestmark = pytest.mark.usefixtures("python_producers_unless_long")


@pytest.mark.parametrize("skip", [[], ["y"], ["x", "b"], [name for name in MIXED_FIELDS if name != "img"]])
def test_named_batches_match_the_tuples_with_skipped_fields(mixed_path: Path, skip: list[str]) -> None:
    pipelines = dict.fromkeys(skip)
    kwargs = {"batch_size": 50, "order": OrderOption.RANDOM, "seed": 3, "num_workers": 2, "pipelines": pipelines}
    tuples = [_snapshot(b) for b in Loader(mixed_path, **kwargs)]
    loader = Loader(mixed_path, named=True, **kwargs)
    names = [name for name in MIXED_FIELDS if name not in skip]
    assert loader.fields == names
    named = [_snapshot(b) for b in loader]
    assert len(named) == len(tuples) == len(loader)
    for b, (as_dict, as_tuple) in enumerate(zip(named, tuples)):
        assert isinstance(as_dict, dict) and isinstance(as_tuple, tuple)
        assert list(as_dict) == names, f"batch {b}: keys in the file's field order, skipped fields absent"
        assert len(as_tuple) == len(names)
        for name, value in zip(names, as_tuple):
            assert _equal(as_dict[name], value), f"batch {b}, field {name!r}"


def test_named_with_custom_pipelines_and_indices(table_path: Path) -> None:
    pipes = {"x": [NDArrayDecoder(), ToTensor()], "y": [IntDecoder(), ToTensor(), Squeeze()]}
    loader = Loader(table_path, batch_size=32, indices=np.arange(10, 200), pipelines=pipes, named=True)
    rows = []
    for batch in loader:
        assert set(batch) == {"x", "y"}
        x, y = batch["x"], batch["y"]
        assert x.shape == (len(y), 5) and y.ndim == 1
        torch.testing.assert_close(x[:, 0], y.to(torch.float32) * 100)  # x[i] = i * 100 + column
        rows.extend(y.tolist())
    assert rows == list(range(10, 200))


def test_default_is_tuples(table_path: Path) -> None:
    loader = Loader(table_path, batch_size=100)
    assert loader.named is False
    batch = next(iter(loader))
    assert isinstance(batch, tuple) and len(batch) == 2
    loader.close()


@pytest.mark.parametrize("bad", ["dict", 1, None])
def test_named_must_be_a_bool(table_path: Path, bad: object) -> None:
    with pytest.raises(ValueError, match="named must be True"):
        Loader(table_path, batch_size=10, named=bad)  # type: ignore[arg-type]


def test_named_resume_and_early_break(table_path: Path) -> None:
    loader = Loader(table_path, batch_size=64, order=OrderOption.RANDOM, seed=1, named=True)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    rest = [b["y"].clone() for b in it]
    again = Loader(table_path, batch_size=64, order=OrderOption.RANDOM, seed=1, named=True)
    again.load_state_dict(state)
    for a, b in zip(rest, again, strict=True):
        assert torch.equal(a, b["y"])
    for i, _ in enumerate(again):
        if i == 2:
            break
    assert isinstance(next(iter(again)), dict)  # the broken-off epoch freed the way for the next
    again.close()
    loader.close()


def test_named_batches_go_through_to_device(table_path: Path) -> None:
    loader = Loader(table_path, batch_size=100, named=True)
    for batch in loader:
        moved = to_device(batch, "cpu")
        assert moved is batch  # already there: nothing copied, nothing rebuilt
        meta = to_device(batch, "meta")
        assert list(meta) == ["x", "y"] and all(t.device.type == "meta" for t in meta.values())
        assert meta["x"].shape == batch["x"].shape
