"""shuffle_quality: SEQUENTIAL ~0, RANDOM ~1, QUASI_RANDOM in between and rising with the window."""

from __future__ import annotations

import numpy as np
import pytest

from stoker.loader.order import OrderOption, epoch_order, shuffle_quality

N = 20_000


def test_sequential_is_zero_and_random_is_one() -> None:
    indices = np.arange(N)
    starts = np.linspace(0, N, 9).astype(np.int64)
    sequential = shuffle_quality(indices, 64, starts)
    assert sequential["neighbour_distance"] < 1e-3
    assert sequential["shards_per_batch"] < 1.1
    shuffled = shuffle_quality(epoch_order(OrderOption.RANDOM, indices, 3, 0, 1, 1), 64, starts)
    assert shuffled["neighbour_distance"] == pytest.approx(1.0, abs=0.03)
    assert shuffled["shard_mixing"] == pytest.approx(1.0, abs=0.03)


def test_a_subset_with_repeats_is_measured_against_its_own_shuffle() -> None:
    indices = np.repeat(np.arange(0, 3 * N, 3), 2)  # every third sample, twice
    assert shuffle_quality(np.random.default_rng(0).permutation(indices), 32)["neighbour_distance"] == pytest.approx(1.0, abs=0.03)


def test_quasi_random_rises_with_the_window() -> None:
    indices = np.arange(N)
    figures = [shuffle_quality(epoch_order(OrderOption.QUASI_RANDOM, indices, 0, 0, 128, w), 64)["neighbour_distance"]
               for w in (1, 2, 4, 8, 32)]  # fmt: skip
    assert figures == sorted(figures), figures
    assert figures[0] < 0.05 and figures[-1] > 0.9
    assert figures[2] == pytest.approx(1 - 1 / 4, abs=0.05)  # neighbours from the same chunk one time in window_chunks


def test_quasi_random_over_shards_reads_few_shards_per_batch() -> None:
    indices = np.arange(N)
    starts = np.linspace(0, N, 17).astype(np.int64)
    quasi = shuffle_quality(epoch_order(OrderOption.QUASI_RANDOM, indices, 0, 0, 128, 8, starts), 64, starts)
    assert quasi["shards_per_batch"] < 1.5 < shuffle_quality(np.random.default_rng(1).permutation(N), 64, starts)["shards_per_batch"]


@pytest.mark.parametrize(("order", "batch_size", "words"), [(np.arange(10), 1, "batch_size must be an int >= 2"),
                                                             (np.arange(1), 4, "at least 2 samples")])  # fmt: skip
def test_invalid_arguments_are_refused(order: np.ndarray, batch_size: int, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        shuffle_quality(order, batch_size)
