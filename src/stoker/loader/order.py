"""Sample orders: pure functions of (indices, seed, epoch)."""

from __future__ import annotations

import enum

import numpy as np


class OrderOption(enum.Enum):
    """How a loader walks through the dataset in an epoch.

    * ``SEQUENTIAL``: the indices in the order given.
    * ``RANDOM``: a full permutation, new every epoch.
    * ``QUASI_RANDOM``: for data larger than RAM. The file is cut into chunks
      of consecutive samples; chunks are shuffled, grouped into windows of a
      few chunks, and samples are shuffled within each window, so reads stay
      within a bounded region of the file at any time.
    """

    SEQUENTIAL = 1
    RANDOM = 2
    QUASI_RANDOM = 3


def epoch_order(
    order: OrderOption,
    indices: np.ndarray,
    seed: int,
    epoch: int,
    chunk_size: int,
    window_chunks: int,
) -> np.ndarray:
    """The sample indices of one epoch, in the order they are loaded.

    A pure function of its arguments: the same (seed, epoch) gives the same
    order in any process, which makes resuming and sharding exact.
    """
    if order is OrderOption.SEQUENTIAL:
        return indices
    rng = np.random.default_rng([seed & 0xFFFFFFFF, seed >> 32 & 0xFFFFFFFF, epoch])
    if order is OrderOption.RANDOM:
        return rng.permutation(indices)
    if order is OrderOption.QUASI_RANDOM:
        ordered = np.sort(indices)
        n_chunks = max(1, -(-len(ordered) // chunk_size))
        chunks = [ordered[c * chunk_size : (c + 1) * chunk_size] for c in rng.permutation(n_chunks)]
        out = []
        for w in range(0, n_chunks, window_chunks):
            window = np.concatenate(chunks[w : w + window_chunks])
            out.append(rng.permutation(window))
        return np.concatenate(out) if out else ordered
    raise ValueError(f"order must be an OrderOption; got {order!r}")
