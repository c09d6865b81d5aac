"""Sample orders: pure functions of (indices, seed, epoch)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from stoker.pipeline.random import SHUFFLE_BLOCK, order_steps, permutation_key, shuffle


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
    window_shards: int = 1,
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

    ``window_shards=k > 1`` (shards only) mixes ``k`` shards in each window
    instead: the shards are shuffled (``rng.permutation(number of shards)``)
    and taken ``k`` at a time as groups; group after group, the group's
    chunks (step 1) are shuffled (``rng.permutation``), cut into windows of
    ``window_chunks`` chunks, and each window's samples are shuffled. A group's
    shards are read during one stretch of the epoch, so a cache of a little
    more than ``2 * k`` shards streams it (see ``docs/remote.md``).

    Args:
        boundaries: the index of each shard's first sample and, last, the
            number of samples (``ShardedReader.shard_starts``); ``None`` for a single file.
        window_shards: shards whose chunks a ``QUASI_RANDOM`` window mixes (1: a window stays in its shard).
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
        if window_shards > 1:
            return _quasi_random_groups(rng, ordered, np.asarray(boundaries), chunk_size, window_chunks, window_shards)
        return _quasi_random_shards(rng, ordered, np.asarray(boundaries), chunk_size, window_chunks)
    raise ValueError(f"order must be an OrderOption; got {order!r}")


def _chunk_spans(ordered: np.ndarray, boundaries: np.ndarray, chunk_size: int) -> list[tuple[int, int, int]]:
    """Step 1 of :func:`epoch_order`: ``(shard, start, stop)`` of each chunk of the sorted ``ordered``."""
    cuts = np.searchsorted(ordered, boundaries, side="left")
    cuts[0], cuts[-1] = 0, len(ordered)
    return [
        (k, a, min(a + chunk_size, int(hi)))
        for k, (lo, hi) in enumerate(itertools.pairwise(cuts))
        for a in range(int(lo), int(hi), chunk_size)
    ]


def _quasi_random_groups(rng: np.random.Generator, ordered: np.ndarray, boundaries: np.ndarray, chunk_size: int,
                         window_chunks: int, window_shards: int) -> np.ndarray:  # fmt: skip
    """``QUASI_RANDOM`` with windows over groups of ``window_shards`` shards (see :func:`epoch_order`)."""
    spans = _chunk_spans(ordered, boundaries, chunk_size)
    if not spans:
        return ordered
    n_shards = len(boundaries) - 1
    group = np.empty(n_shards, dtype=np.int64)
    group[rng.permutation(n_shards)] = np.arange(n_shards) // window_shards
    by_group: list[list[tuple[int, int, int]]] = [[] for _ in range(int(group.max()) + 1)]
    for span in spans:
        by_group[int(group[span[0]])].append(span)
    out = []
    for chunks in by_group:
        if not chunks:
            continue
        shuffled = [chunks[c] for c in rng.permutation(len(chunks)).tolist()]
        for w in range(0, len(shuffled), window_chunks):
            window = np.concatenate([ordered[a:b] for _, a, b in shuffled[w : w + window_chunks]])
            out.append(rng.permutation(window))
    return np.concatenate(out)


def _quasi_random_shards(rng: np.random.Generator, ordered: np.ndarray, boundaries: np.ndarray, chunk_size: int,
                         window_chunks: int) -> np.ndarray:  # fmt: skip
    """``QUASI_RANDOM`` over shards (steps 1-4 of :func:`epoch_order`)."""
    spans = _chunk_spans(ordered, boundaries, chunk_size)
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
    """The ``RANDOM`` order of a coming epoch, made a piece at a time by whichever thread has time for it.

    ``values`` becomes a copy of the indices (``source``), then is shuffled:
    ``state`` is :func:`~stoker.pipeline.random.order_steps`'s (``state[1]``
    values copied, then ``state[0]`` the next step of the shuffle; both done:
    ``[0, len(values), ...]``). Only one thread at a time may advance it: producer 0,
    a piece with each of its batches and while it waits for a token (the copy
    first, a piece at a time too: its first batches do not wait for it), then
    the loop (:meth:`finish`) once the producers are idle.
    """

    args: tuple[Any, ...]
    values: np.ndarray
    key: np.uint64
    state: np.ndarray
    #: the indices ``values`` is a shuffled copy of (never written; the loader's are replaced, not changed)
    source: np.ndarray

    @classmethod
    def start(cls, indices: np.ndarray, seed: int, epoch: int, args: tuple[Any, ...], buffer: np.ndarray | None = None) -> PreparedOrder:
        """Nothing made yet: ``finish()`` alone gives ``epoch_order(RANDOM, indices, seed, epoch, ...)``.

        Args:
            buffer: memory to reuse for ``values`` (an int64 array of ``len(indices)``, else ignored), overwritten:
                the caller vouches that nothing reads it any more (a page-faulted new array costs more than the copy).
        """
        if buffer is not None and buffer.dtype == np.int64 and buffer.shape == (len(indices),) and buffer.flags.writeable:
            values = buffer
        else:
            values = np.empty(len(indices), dtype=np.int64)
        state = np.zeros(2 + SHUFFLE_BLOCK, dtype=np.int64)  # (the steps' scratch after the two counts: order_steps)
        state[0] = max(0, len(values) - 1)
        return cls(args, values, permutation_key(seed, epoch), state, np.ascontiguousarray(indices, dtype=np.int64))

    def left(self) -> int:
        """The work left, in shuffle steps (0: ``values`` is the order)."""
        return int(order_steps(self.values, self.source, self.state, self.key, 0))

    def finish(self) -> np.ndarray:
        """Do the work left (none if a producer did it all) and return the order."""
        left = self.left()
        if left > 0:
            order_steps(self.values, self.source, self.state, self.key, left)
        return self.values


def shuffle_quality(order: np.ndarray, batch_size: int, shard_starts: np.ndarray | None = None) -> dict[str, float]:
    """How well an epoch's order mixes the dataset within a batch, against a full shuffle (1.0) and no shuffle (0.0).

    Figures (over the full batches; a single partial batch if there is no full one):

    * ``neighbour_distance``: the mean ``|a - b|`` of the original indices of neighbours in a batch,
      divided by the mean distance of two samples drawn at random from the same indices (what
      ``RANDOM`` gives). ``SEQUENTIAL``: about ``1 / (n / 3)``, i.e. 0; ``RANDOM``: about 1.
      ``QUASI_RANDOM``: neighbours come from the same chunk with probability about
      ``1 / window_chunks``, so about ``1 - 1 / window_chunks`` in a single file when windows are
      full: raise ``window_chunks`` (memory: a window's samples are read together). With shards a
      window stays within a shard, which caps the figure at about ``1 / number of shards``.
    * ``shards_per_batch`` and ``shard_mixing`` (with ``shard_starts``): the mean number of
      distinct shards a batch reads, and that number divided by its expected value for a full
      shuffle. ``QUASI_RANDOM``'s windows never cross a shard, so its batches read one or two
      shards whatever the window: if the data was written in an order that matters (sorted by
      class, by source), write smaller shards or shuffle before writing.

    Args:
        order: the original (dataset) indices in the order loaded (``Loader.epoch_indices``).
        batch_size: samples per batch.
        shard_starts: the index of each shard's first sample and, last, the number of samples
            (``ShardedReader.shard_starts``); ``None`` for no shard figures.

    Returns:
        ``{"neighbour_distance": ..., }`` and, with ``shard_starts``, ``"shards_per_batch"`` and ``"shard_mixing"``.

    Raises:
        ValueError: ``batch_size`` < 2 (a batch needs neighbours) or an empty ``order``.

    Example:
        >>> import numpy as np
        >>> shuffle_quality(np.arange(1000), 10)["neighbour_distance"] < 0.01
        True
        >>> 0.9 < shuffle_quality(np.random.default_rng(0).permutation(1000), 10)["neighbour_distance"] < 1.1
        True
    """
    order = np.asarray(order, dtype=np.int64)
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 2:
        raise ValueError(f"batch_size must be an int >= 2 (a batch needs neighbours); got {batch_size!r}")
    m = len(order)
    if m < 2:
        raise ValueError(f"order must hold at least 2 samples; got {m}")
    full = m // batch_size * batch_size
    batches = order[:full].reshape(-1, batch_size) if full else order[None, :]
    values = np.sort(order).astype(np.float64)
    ranks = 2 * np.arange(m, dtype=np.float64) - (m - 1)
    pair_mean = 2 * float(values @ ranks) / (m * (m - 1))  # mean |a - b| over all pairs of distinct entries
    distance = float(np.abs(np.diff(batches, axis=1)).mean())
    out = {"neighbour_distance": distance / pair_mean if pair_mean > 0 else 0.0}
    if shard_starts is not None:
        starts = np.asarray(shard_starts, dtype=np.int64)
        shard = np.searchsorted(starts, batches, side="right") - 1
        shard.sort(axis=1)
        distinct = 1 + (np.diff(shard, axis=1) != 0).sum(axis=1)
        sizes = np.bincount(np.searchsorted(starts, order, side="right") - 1, minlength=len(starts) - 1).astype(np.float64)
        b = batches.shape[1]  # expected distinct shards in b samples drawn without replacement: sum of P(shard drawn)
        steps = np.arange(b, dtype=np.float64)
        missed = np.exp(np.log(np.maximum(m - sizes[:, None] - steps, 0) + 1e-300).sum(axis=1) - np.log(m - steps).sum())
        expected = float((1 - missed).sum())
        out["shards_per_batch"] = float(distinct.mean())
        out["shard_mixing"] = float(distinct.mean()) / expected
    return out
