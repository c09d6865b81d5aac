"""The start of an epoch: the prepared order's memory reused, the order taken without copies, the same batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.loader import Loader, OrderOption
from stoker.loader._engine import CompiledEpoch
from stoker.loader.distributed import elastic_share
from stoker.loader.order import epoch_order
from stoker.pipeline import native
from stoker.pipeline.random import permutation_key

from .._profile import examples
from .test_shuffle import _reference as _fisher_yates

pytestmark = pytest.mark.skipif(not native.available(), reason="the compiled producer loop needs Linux")

N = 1000  # the table's samples: x[i] = i * 100 + column, y[i] = i (conftest.table_path)


def _reference_order(order: OrderOption, seed: int, epoch: int) -> np.ndarray:
    """The epoch's order, from plain numpy (``RANDOM``: the SplitMix Fisher-Yates of ``test_shuffle``)."""
    if order is OrderOption.SEQUENTIAL:
        return np.arange(N)
    if order is OrderOption.RANDOM:
        return _fisher_yates(np.arange(N, dtype=np.int64), permutation_key(seed, epoch))
    return epoch_order(order, np.arange(N), seed, epoch, 50, 3)  # (QUASI_RANDOM's own tests check this function)


@settings(max_examples=examples(ci=3, long=25), deadline=None)
@given(
    order=st.sampled_from(list(OrderOption)),
    num_workers=st.integers(1, 2),
    batch_size=st.sampled_from([64, 100, 333]),
    drop_last=st.booleans(),
    # per iter(): the epoch set first (None: the next one), and the batch after which the loop breaks (None: none)
    runs=st.lists(st.tuples(st.one_of(st.none(), st.integers(0, 3)), st.one_of(st.none(), st.integers(0, 5))), min_size=3, max_size=6),
)
def test_batches_over_epochs_with_breaks_and_set_epoch(
    table_path: Path, order: OrderOption, num_workers: int, batch_size: int, drop_last: bool, runs: list[tuple[int | None, int | None]]
) -> None:
    """Every batch of every epoch is the numpy model's, whatever the epochs before did (a break leaves its producers
    mid-shuffle of the next order; ``set_epoch`` makes the prepared order the wrong one), and the epoch's indices and
    augmentation keys are ``elastic_share``'s for one rank."""
    seed = 5
    with Loader(table_path, batch_size=batch_size, num_workers=num_workers, order=order, seed=seed, drop_last=drop_last,
                chunk_size=50, window_chunks=3) as loader:  # fmt: skip
        for set_to, break_at in runs:
            if set_to is not None:
                loader.set_epoch(set_to)
            epoch = loader._next_epoch
            idx = _reference_order(order, seed, epoch)
            share = elastic_share(N, np.zeros((0, 2), dtype=np.int64), 0, 1, batch_size, drop_last)
            it = iter(loader)
            assert isinstance(it, CompiledEpoch)
            np.testing.assert_array_equal(it._order, share.samples(idx))
            np.testing.assert_array_equal(it._runs, share.runs())
            for b, (x, y) in enumerate(it):
                want = share.samples(idx)[b * batch_size : (b + 1) * batch_size]
                np.testing.assert_array_equal(y.numpy().reshape(-1), want)
                np.testing.assert_array_equal(x.numpy()[:, 0], want * 100.0)
                if b == break_at:
                    break
            del it


@pytest.mark.compiled_loop
def test_the_prepared_order_reuses_the_memory_of_the_epoch_before(table_path: Path) -> None:
    """``RANDOM``: two arrays in turn hold the prepared orders, never a new one per epoch (8 bytes a sample)."""
    with Loader(table_path, batch_size=100, num_workers=1, order=OrderOption.RANDOM, seed=2) as loader:
        prepared = []
        for epoch in range(5):
            it = iter(loader)
            assert loader._prepared_order is not None
            prepared.append(loader._prepared_order.values)  # (kept here: the loader does not look at who else holds it)
            for (_, y), want in zip(it, np.array_split(_reference_order(OrderOption.RANDOM, 2, epoch), 10), strict=True):
                np.testing.assert_array_equal(y.numpy().reshape(-1), want)
        assert prepared[1] is not prepared[2]
        assert prepared[3] is prepared[1] and prepared[4] is prepared[2]


def test_producers_start_as_the_first_batch_is_handed_over(table_path: Path) -> None:
    """The loop makes the first batch; the producers are woken as the first ``next()`` returns it, not in ``iter()``
    (where each one's Python start would take the GIL from that batch). An epoch closed before it never starts them."""
    with Loader(table_path, batch_size=100, num_workers=2, batches_ahead=1, order=OrderOption.RANDOM, seed=1) as loader:
        for epoch in range(2):
            it = iter(loader)
            assert loader._pool is not None and not loader._pool.busy()  # no producer woken yet
            batches = [next(it)]
            assert loader._pool.busy()  # (they wait for tokens: one batch ahead each, ten batches)
            batches += list(it)
            for (_, y), want in zip(batches, np.array_split(_reference_order(OrderOption.RANDOM, 1, epoch), 10), strict=True):
                np.testing.assert_array_equal(y.numpy().reshape(-1), want)
        it = iter(loader)
        it.close()
        assert not loader._pool.busy()
        for (_, y), want in zip(iter(loader), np.array_split(_reference_order(OrderOption.RANDOM, 1, 3), 10), strict=True):
            np.testing.assert_array_equal(y.numpy().reshape(-1), want)
