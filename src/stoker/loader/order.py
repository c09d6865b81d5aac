"""Sample orders: pure functions of (indices, seed, epoch)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from stoker.pipeline.random import permutation_key, shuffle, shuffle_steps


class OrderOption(enum.Enum):
    """How a loader walks through the dataset in an epoch.

    * ``SEQUENTIAL``: the indices in the order given.
    * ``RANDOM``: a full permutation, new every epoch.
    * ``QUASI_RANDOM``: for data larger than RAM. The file is cut into chunks
      of consecutive samples; chunks are shuffled, grouped into windows of a
      few chunks, and samples are shuffled within each window, so reads stay
      within a bounded region of the file at any time. With shards, chunks
      and windows never cross a shard boundary (see :func:`epoch_order`).
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
    boundaries: np.ndarray | None = None,
) -> np.ndarray:
    """The sample indices of one epoch, in the order they are loaded.

    A pure function of its arguments: the same (seed, epoch) gives the same
    order in any process, which makes resuming and sharding exact.

    ``RANDOM``: the indices shuffled by a compiled Fisher-Yates whose draws
    come from SplitMix64 keyed by ``(seed, epoch)``
    (:func:`stoker.pipeline.random.shuffle`; three times as fast as numpy's
    ``permutation``, which an epoch of a small table noticeably paid).

    ``QUASI_RANDOM``, from a generator seeded with ``(seed low 32 bits, seed
    high 32 bits, epoch)``:

    1. the sorted indices are cut into chunks of ``chunk_size`` consecutive
       samples, shard by shard: a chunk never crosses a boundary, so the last
       chunk of each shard may be shorter;
    2. the chunks are shuffled (``rng.permutation(number of chunks)``);
    3. walking the shuffled chunks, each chunk joins the open window of its
       shard; a window is closed when it holds ``window_chunks`` chunks (the
       next chunk of that shard opens a new one). Windows come in the order in
       which their first chunk appears;
    4. each window's samples are shuffled (``rng.permutation``), window after window.

    Without ``boundaries`` (or with a single shard) this is the order of a
    single file: consecutive shuffled chunks form the windows.

    Args:
        boundaries: the index of each shard's first sample and, last, the
            number of samples (``ShardedReader.shard_starts``); ``None`` for a single file.
    """
    if order is OrderOption.SEQUENTIAL:
        return indices
    if order is OrderOption.RANDOM:
        shuffled = np.array(indices, dtype=np.int64)  # a copy: the loader's indices stay as they are
        shuffle(shuffled, permutation_key(seed, epoch))
        return shuffled
    rng = np.random.default_rng([seed & 0xFFFFFFFF, seed >> 32 & 0xFFFFFFFF, epoch])
    if order is OrderOption.QUASI_RANDOM:
        ordered = np.sort(indices)
        if boundaries is None or len(boundaries) <= 2:
            n_chunks = max(1, -(-len(ordered) // chunk_size))
            chunks = [ordered[c * chunk_size : (c + 1) * chunk_size] for c in rng.permutation(n_chunks)]
            out = []
            for w in range(0, n_chunks, window_chunks):
                window = np.concatenate(chunks[w : w + window_chunks])
                out.append(rng.permutation(window))
            return np.concatenate(out) if out else ordered
        return _quasi_random_shards(rng, ordered, np.asarray(boundaries), chunk_size, window_chunks)
    raise ValueError(f"order must be an OrderOption; got {order!r}")


def _quasi_random_shards(rng: np.random.Generator, ordered: np.ndarray, boundaries: np.ndarray, chunk_size: int,
                         window_chunks: int) -> np.ndarray:  # fmt: skip
    """``QUASI_RANDOM`` over shards (steps 1-4 of :func:`epoch_order`)."""
    cuts = np.searchsorted(ordered, boundaries, side="left")
    cuts[0], cuts[-1] = 0, len(ordered)
    spans = [
        (k, a, min(a + chunk_size, int(hi)))
        for k, (lo, hi) in enumerate(itertools.pairwise(cuts))
        for a in range(int(lo), int(hi), chunk_size)
    ]
    if not spans:
        return ordered
    windows: list[list[np.ndarray]] = []
    open_window: dict[int, list[np.ndarray]] = {}
    for c in rng.permutation(len(spans)).tolist():
        shard, a, b = spans[c]
        window = open_window.get(shard)
        if window is None or len(window) == window_chunks:
            window = open_window[shard] = []
            windows.append(window)
        window.append(ordered[a:b])
    return np.concatenate([rng.permutation(np.concatenate(w)) for w in windows])


#: ``RANDOM`` orders of at most this many samples are prepared an epoch ahead (an extra 8 bytes a sample)
PREPARED_ORDER_MAX = 1 << 22


@dataclass
class PreparedOrder:
    """The ``RANDOM`` order of a coming epoch, shuffled a piece at a time by whichever thread has time for it.

    ``values`` starts as a copy of the indices; ``at[0]`` is the next step of the
    shuffle (:func:`~stoker.pipeline.random.shuffle_steps`), 0 once it is done.
    Only one thread at a time may advance it: producer 0, a piece with each of
    its batches and while it waits for a token, then the loop (:meth:`finish`)
    once the producers are idle.
    """

    args: tuple[Any, ...]
    values: np.ndarray
    key: np.uint64
    at: np.ndarray

    @classmethod
    def start(cls, indices: np.ndarray, seed: int, epoch: int, args: tuple[Any, ...]) -> PreparedOrder:
        """Nothing shuffled yet: ``finish()`` alone gives ``epoch_order(RANDOM, indices, seed, epoch, ...)``."""
        values = np.array(indices, dtype=np.int64)
        return cls(args, values, permutation_key(seed, epoch), np.array([max(0, len(values) - 1)], dtype=np.int64))

    def finish(self) -> np.ndarray:
        """Do the steps left (none if a producer did them all) and return the order."""
        at = int(self.at[0])
        if at > 0:
            self.at[0] = shuffle_steps(self.values, self.key, at, at)
        return self.values
