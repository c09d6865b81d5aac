"""Orders: every index exactly once per epoch; determinism by (seed, epoch)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stoker.loader import Loader, OrderOption
from stoker.loader.order import epoch_order

ORDERS = list(OrderOption)


# under ``make test`` Python producers make the batches: the orders, not the loop, is the subject (tests/_profile.py)
pytestmark = pytest.mark.usefixtures("python_producers_unless_long")


def _labels(loader: Loader) -> list[np.ndarray]:
    return [y.numpy().reshape(-1).copy() for _, y in loader]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("num_workers", [1, 2, 3, 4])
def test_each_index_once_per_epoch(table_path: Path, order: OrderOption, drop_last: bool, num_workers: int) -> None:
    loader = Loader(
        table_path, batch_size=64, order=order, drop_last=drop_last, num_workers=num_workers, seed=3, chunk_size=50, window_chunks=3
    )
    for _epoch in range(2):
        batches = _labels(loader)
        assert len(batches) == len(loader)
        seen = np.concatenate(batches)
        if drop_last:
            assert len(seen) == 1000 // 64 * 64
            assert all(len(b) == 64 for b in batches)
        else:
            assert len(seen) == 1000
        assert len(np.unique(seen)) == len(seen), "an index was loaded twice in one epoch"
        assert set(seen.tolist()) <= set(range(1000))


def test_sequential_is_in_order(table_path: Path) -> None:
    seen = np.concatenate(_labels(Loader(table_path, batch_size=100)))
    np.testing.assert_array_equal(seen, np.arange(1000))


@pytest.mark.parametrize("order", [OrderOption.RANDOM, OrderOption.QUASI_RANDOM])
def test_epochs_differ_and_seed_determines_them(table_path: Path, order: OrderOption) -> None:
    a = Loader(table_path, batch_size=100, order=order, seed=11, chunk_size=50)
    b = Loader(table_path, batch_size=100, order=order, seed=11, chunk_size=50)
    a0, a1 = np.concatenate(_labels(a)), np.concatenate(_labels(a))
    b0, b1 = np.concatenate(_labels(b)), np.concatenate(_labels(b))
    assert not np.array_equal(a0, a1), "two epochs gave the same order"
    np.testing.assert_array_equal(a0, b0)
    np.testing.assert_array_equal(a1, b1)
    c0 = np.concatenate(_labels(Loader(table_path, batch_size=100, order=order, seed=12, chunk_size=50)))
    assert not np.array_equal(a0, c0), "another seed gave the same order"


@pytest.mark.parametrize("order", ORDERS)
def test_same_seed_same_batches_whatever_num_workers(table_path: Path, order: OrderOption) -> None:
    runs = []
    for workers in (1, 2, 4):
        loader = Loader(table_path, batch_size=50, order=order, seed=5, num_workers=workers)
        runs.append([(x.clone(), y.clone()) for x, y in loader])
    for other in runs[1:]:
        for (x0, y0), (x1, y1) in zip(runs[0], other, strict=True):
            assert np.array_equal(x0.numpy(), x1.numpy()) and np.array_equal(y0.numpy(), y1.numpy())


def test_quasi_random_stays_within_windows() -> None:
    indices = np.arange(10_000)
    order = epoch_order(OrderOption.QUASI_RANDOM, indices, seed=1, epoch=0, chunk_size=100, window_chunks=4)
    assert sorted(order.tolist()) == indices.tolist()
    for w in range(0, 10_000, 400):  # each window of 4 chunks covers at most 4 distinct chunks of the file
        chunks = np.unique(order[w : w + 400] // 100)
        assert len(chunks) <= 4
    assert not np.array_equal(order, indices)


def test_indices_subset(table_path: Path) -> None:
    subset = np.array([5, 17, 900, 3, 42])
    loader = Loader(table_path, batch_size=2, indices=subset, order=OrderOption.RANDOM, seed=0)
    seen = np.concatenate(_labels(loader))
    assert sorted(seen.tolist()) == sorted(subset.tolist())
    assert len(loader) == 3
