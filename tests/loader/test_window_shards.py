"""QUASI_RANDOM windows over groups of shards (``window_shards``): a permutation, local in time, better mixed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker import Loader, OrderOption
from stoker.dataset.shards import write_shards
from stoker.errors import StokerError
from stoker.fields import IntField
from stoker.loader.order import epoch_order, shuffle_quality


def _boundaries(sizes: list[int]) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 60), min_size=1, max_size=12),
    chunk=st.integers(1, 20),
    window=st.integers(1, 6),
    k=st.integers(2, 5),
    seed=st.integers(0, 2**64 - 1),
    epoch=st.integers(0, 5),
)
def test_a_permutation_whose_shard_groups_are_read_one_after_another(
    sizes: list[int], chunk: int, window: int, k: int, seed: int, epoch: int
) -> None:
    bounds = _boundaries(sizes)
    n = int(bounds[-1])
    order = epoch_order(OrderOption.QUASI_RANDOM, np.arange(n), seed, epoch, chunk, window, bounds, window_shards=k)
    assert np.array_equal(np.sort(order), np.arange(n))  # every sample once
    shard = np.searchsorted(bounds, order, side="right") - 1
    # the shards form groups of at most k, each read during one stretch of the epoch: once a group's last sample
    # has passed, none of its shards comes back
    first_seen: dict[int, int] = {}
    groups: list[set[int]] = []
    for s in shard.tolist():
        if s not in first_seen:
            first_seen[s] = len(first_seen)
            if not groups or len(groups[-1]) == k or any(s in g for g in groups[:-1]):
                groups.append(set())
            groups[-1].add(s)
    assert all(len(g) <= k for g in groups)
    stretch = {s: i for i, g in enumerate(groups) for s in g}
    assert np.all(np.diff([stretch[s] for s in shard.tolist()]) >= 0)  # group stretches never interleave
    again = epoch_order(OrderOption.QUASI_RANDOM, np.arange(n), seed, epoch, chunk, window, bounds, window_shards=k)
    assert np.array_equal(order, again)  # a pure function


def test_one_shard_per_window_is_the_default_order() -> None:
    bounds = _boundaries([100, 50, 80])
    one = epoch_order(OrderOption.QUASI_RANDOM, np.arange(230), 3, 1, 16, 4, bounds, window_shards=1)
    default = epoch_order(OrderOption.QUASI_RANDOM, np.arange(230), 3, 1, 16, 4, bounds)
    assert np.array_equal(one, default)


def test_more_shards_per_window_mix_batches_more() -> None:
    """64 shards written in class order: window_shards raises the shards a batch reads and the neighbour distance."""
    bounds = _boundaries([1000] * 64)
    figures = []
    for k in (1, 4, 16):
        order = epoch_order(OrderOption.QUASI_RANDOM, np.arange(64_000), 0, 0, 256, 16, bounds, window_shards=k)
        figures.append(shuffle_quality(order, 256, bounds))
    mixing = [f["shards_per_batch"] for f in figures]
    distance = [f["neighbour_distance"] for f in figures]
    assert mixing[0] < 2.5 < mixing[1] < mixing[2]
    assert distance[0] < distance[1] < distance[2]


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    write_shards(tmp_path / "ds", {"y": IntField()}, {"y": np.arange(600)}, samples_per_shard=50, num_workers=1, progress=False)
    return tmp_path / "ds"


def test_the_loader_yields_the_order_and_its_state_records_window_shards(shards: Path) -> None:
    kw = {"batch_size": 32, "order": OrderOption.QUASI_RANDOM, "seed": 4, "chunk_size": 20, "window_chunks": 3, "num_workers": 1}
    with Loader(str(shards), window_shards=3, **kw) as loader:  # type: ignore[arg-type]
        got = np.concatenate([y.numpy().ravel() for (y,) in loader])
        want = epoch_order(OrderOption.QUASI_RANDOM, np.arange(600), 4, 0, 20, 3, loader.reader.shard_starts, window_shards=3)
        assert np.array_equal(got, want)
        it = iter(loader)
        next(it)
        state = loader.state_dict()
        del it
    with Loader(str(shards), window_shards=3, **kw) as again:  # type: ignore[arg-type]
        again.load_state_dict(state)
    for other in (1, 2):
        with Loader(str(shards), window_shards=other, **kw) as loader, pytest.raises(StokerError, match="window_shards"):  # type: ignore[arg-type]
            loader.load_state_dict(state)


def test_window_shards_must_be_a_positive_int(shards: Path) -> None:
    with pytest.raises(ValueError, match="window_shards must be an int >= 1; got int 0"):
        Loader(str(shards), batch_size=8, window_shards=0)
