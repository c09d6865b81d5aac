"""Ranks: which part of an epoch's global order each rank of a distributed job loads.

Every rank computes the same global order from the same ``(seed, epoch)``
(:func:`stoker.loader.order.epoch_order`), then takes a contiguous block of it:

    global order  | rank 0 | rank 1 | ... | rank W-1 |      (padded or cut to W equal blocks)
    positions       0 .. S-1, S .. 2S-1, ...              (S samples per rank)

* without ``drop_last`` the order is padded to a multiple of ``W`` by repeating
  its first ``pad <= W - 1`` samples; the last batch of a rank may be partial;
* with ``drop_last`` it is cut to ``W * B * batch_size`` samples, where ``B``
  (batches per rank) is ``len(order) // (W * batch_size)``: only full batches,
  the dropped samples are the tail of the global order.

Every rank has the same number of batches (a rank with one batch more would
deadlock DDP). A sample keeps its position in the global order, so random
augmentations, keyed by that position, do not depend on ``W``. Contiguous
blocks (rather than every ``W``-th sample) keep each rank's reads within its
own part of the file: a stream for ``SEQUENTIAL``, its own windows for
``QUASI_RANDOM``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int; got {type(value).__name__} {value!r}")
    return int(value)


def resolve_rank(distributed: bool, rank: Any, world_size: Any) -> tuple[int, int]:
    """``(rank, world_size)`` of this process.

    Args:
        distributed: ``Loader(distributed=...)``.
        rank: this process's rank, or ``None`` to take it from ``torch.distributed``.
        world_size: the number of ranks, or ``None`` to take it from ``torch.distributed``.

    Returns:
        ``(0, 1)`` when not distributed; the explicit values when both are given;
        otherwise those of the initialized default process group.

    Raises:
        TypeError: ``rank`` or ``world_size`` is not an int.
        ValueError: only one of them is given, they are given without
            ``distributed=True``, or not ``0 <= rank < world_size``.
        RuntimeError: ``distributed=True`` without them and without an
            initialized ``torch.distributed`` process group.
    """
    if not distributed:
        if rank is not None or world_size is not None:
            raise ValueError(
                f"rank and world_size are for distributed=True; got rank={rank!r}, world_size={world_size!r} with "
                "distributed=False (pass distributed=True, or leave them out)"
            )
        return 0, 1
    if (rank is None) != (world_size is None):
        raise ValueError(
            f"rank and world_size go together: pass both, or neither to take them from torch.distributed; "
            f"got rank={rank!r}, world_size={world_size!r}"
        )
    if rank is None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "distributed=True takes rank and world size from torch.distributed, whose default process group is not "
                "initialized: call torch.distributed.init_process_group(...) before building the Loader, or pass "
                "rank= and world_size="
            )
        rank, world_size = dist.get_rank(), dist.get_world_size()
    rank, world_size = _check_int("rank", rank), _check_int("world_size", world_size)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must lie in [0, world_size) = [0, {world_size}); got {rank}")
    return rank, world_size


def samples_per_rank(n: int, world_size: int, batch_size: int, drop_last: bool) -> int:
    """Samples each rank loads in an epoch of ``n`` samples (the same on every rank)."""
    if drop_last:
        return n // (world_size * batch_size) * batch_size
    return -(-n // world_size)


def rank_share(order: np.ndarray, rank: int, world_size: int, batch_size: int, drop_last: bool) -> tuple[np.ndarray, int]:
    """Rank ``rank``'s block of the global ``order``, and the global position of its first sample.

    The block's samples sit at global positions ``first, first + 1, ...``.
    """
    share = samples_per_rank(len(order), world_size, batch_size, drop_last)
    total = share * world_size
    if total > len(order):  # pad by repeating the first samples (fewer than world_size of them)
        order = np.concatenate([order, np.resize(order, total - len(order))])
    first = rank * share
    return order[first : first + share], first


# ---- elastic resume: the rest of an epoch after ranks handed out some of it --------------------------------------------

_NO_INTERVALS = np.zeros((0, 2), dtype=np.int64)


def check_intervals(value: Any, n: int, name: str = "seen") -> np.ndarray:
    """``value`` as a ``(k, 2)`` int64 array of sorted, disjoint ``[start, stop)`` intervals within ``[0, n)``.

    Args:
        value: a sequence of ``(start, stop)`` pairs of ints (a state's ``"seen"``).
        n: the number of positions of the epoch.
        name: what ``value`` is, for the error message.

    Raises:
        ValueError: not pairs of ints, an empty or reversed interval, intervals out of
            order or overlapping, or positions outside ``[0, n)``.
    """
    try:
        pairs = [(_check_int(name, a), _check_int(name, b)) for a, b in value]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a list of [start, stop) pairs of ints; got {value!r} ({exc})") from None
    out = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    prev = 0
    for a, b in pairs:
        if not prev <= a < b <= n:
            raise ValueError(
                f"{name} must hold sorted, disjoint, non-empty intervals [start, stop) within [0, {n}) (the epoch's "
                f"positions); got [{a}, {b}) after position {prev} (save the state again with this loader's state_dict())"
            )
        prev = b
    return out


def _merge(intervals: np.ndarray) -> np.ndarray:
    """Sorted, disjoint intervals covering the same positions (touching ones joined)."""
    iv = intervals[intervals[:, 1] > intervals[:, 0]]
    if len(iv) <= 1:
        return iv.astype(np.int64, copy=True).reshape(-1, 2)
    iv = iv[np.argsort(iv[:, 0], kind="stable")]
    reach = np.maximum.accumulate(iv[:, 1])
    starts_new = np.empty(len(iv), dtype=bool)
    starts_new[0] = True
    starts_new[1:] = iv[1:, 0] > reach[:-1]
    first = np.flatnonzero(starts_new)
    last = np.append(first[1:], len(iv)) - 1
    return np.stack([iv[first, 0], reach[last]], axis=1).astype(np.int64)


def _complement(n: int, seen: np.ndarray) -> np.ndarray:
    """``[0, n)`` minus ``seen`` (sorted, disjoint), as intervals."""
    if len(seen) == 0:
        return np.array([[0, n]], dtype=np.int64) if n > 0 else _NO_INTERVALS
    bounds = np.concatenate([[0], seen.ravel(), [n]]).reshape(-1, 2)
    return bounds[bounds[:, 1] > bounds[:, 0]].astype(np.int64)


def _slice(intervals: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Items ``lo .. hi-1`` of the list the intervals spell out, in order, as intervals."""
    lengths = intervals[:, 1] - intervals[:, 0]
    ends = np.cumsum(lengths)
    starts = ends - lengths
    a, b = np.maximum(starts, lo), np.minimum(ends, hi)
    keep = a < b
    return np.stack([intervals[keep, 0] + a[keep] - starts[keep], intervals[keep, 0] + b[keep] - starts[keep]], axis=1)


def _items(intervals: np.ndarray, which: np.ndarray) -> np.ndarray:
    """Items ``which`` of the list the intervals spell out."""
    lengths = intervals[:, 1] - intervals[:, 0]
    ends = np.cumsum(lengths)
    j = np.searchsorted(ends, which, side="right")
    return intervals[j, 0] + which - (ends[j] - lengths[j])


@dataclass(frozen=True)
class Share:
    """One rank's samples of an epoch (or of what is left of it), as global positions.

    Attributes:
        real: ``(k, 2)`` intervals ``[start, stop)`` of global positions, in the order loaded.
        padding: the global positions whose samples are loaded again, after ``real``, so that
            every rank has as many samples (fewer than ``world_size``).
        first_pad: the augmentation key of the first padding sample (``n + j`` for the
            ``j``-th padding sample of the epoch's padded list; keys of real samples are their positions).
    """

    real: np.ndarray
    padding: np.ndarray
    first_pad: int

    def __len__(self) -> int:
        return int((self.real[:, 1] - self.real[:, 0]).sum()) + len(self.padding)

    def samples(self, order: np.ndarray) -> np.ndarray:
        """The share's sample indices, taken from the epoch's global ``order`` (a view when it is one block)."""
        if len(self.real) == 1 and len(self.padding) == 0:
            return order[self.real[0, 0] : self.real[0, 1]]
        return np.concatenate([order[a:b] for a, b in self.real.tolist()] + [order[self.padding]]).astype(order.dtype, copy=False)

    def runs(self) -> np.ndarray:
        """``(R, 2)`` int64 ``[offset in the share, augmentation key]`` at the start of each run of consecutive keys.

        :func:`positions_of` turns it back into each sample's key.
        """
        lengths = self.real[:, 1] - self.real[:, 0]
        rows = np.stack([np.cumsum(lengths) - lengths, self.real[:, 0]], axis=1)
        if len(self.padding):
            rows = np.concatenate([rows, [[int(lengths.sum()), self.first_pad]]])
        if len(rows) == 0:
            return np.zeros((1, 2), dtype=np.int64)
        keep = np.ones(len(rows), dtype=bool)  # a run that continues the previous one's keys is not a new run
        keep[1:] = rows[1:, 1] - rows[:-1, 1] != rows[1:, 0] - rows[:-1, 0]
        return np.ascontiguousarray(rows[keep], dtype=np.int64)


def positions_of(runs: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """The augmentation keys (global positions) of items ``lo .. hi-1`` of a share with ``runs`` (:meth:`Share.runs`)."""
    i = np.arange(lo, hi, dtype=np.int64)
    j = np.searchsorted(runs[:, 0], i, side="right") - 1
    return runs[j, 1] + i - runs[j, 0]


def _split(n: int, seen: np.ndarray, world_size: int, batch_size: int, drop_last: bool) -> tuple[np.ndarray, int, int]:
    """The positions left, their number and the samples per rank (``rank_share``'s rules over them)."""
    left = _complement(n, seen)
    count = n - int((seen[:, 1] - seen[:, 0]).sum()) if len(seen) else n
    return left, count, samples_per_rank(count, world_size, batch_size, drop_last)


def elastic_share(n: int, seen: np.ndarray, rank: int, world_size: int, batch_size: int, drop_last: bool) -> Share:
    """Rank ``rank``'s share of the positions of an epoch of ``n`` not in ``seen``.

    The positions left, in global order, are split as :func:`rank_share` splits a
    whole epoch: ``world_size`` equal contiguous blocks, padded by repeating the
    first positions left (without ``drop_last``) or cut to full batches (with it).
    With ``seen`` empty this is :func:`rank_share` itself.
    """
    left, count, share = _split(n, seen, world_size, batch_size, drop_last)
    lo, hi = rank * share, (rank + 1) * share
    real = _slice(left, lo, min(hi, count))
    pad = np.arange(max(lo, count) - count, max(hi - count, 0), dtype=np.int64)  # j-th padding: the j-th position left again
    padding = _items(left, pad % count) if len(pad) else np.zeros(0, dtype=np.int64)
    return Share(real.astype(np.int64), padding, n + int(pad[0]) if len(pad) else n)


def share_batches(n: int, seen: np.ndarray, world_size: int, batch_size: int, drop_last: bool) -> int:
    """Batches each rank loads from the positions of an epoch of ``n`` not in ``seen``."""
    count = n - int((seen[:, 1] - seen[:, 0]).sum()) if len(seen) else n
    share = samples_per_rank(count, world_size, batch_size, drop_last)
    return share // batch_size if drop_last else -(-share // batch_size)


def seen_after(n: int, seen: np.ndarray, world_size: int, batch_size: int, drop_last: bool, consumed: Sequence[int]) -> np.ndarray:
    """``seen`` and the positions rank ``r`` of a run over the rest of the epoch handed out in its first ``consumed[r]`` batches.

    Padding is never counted as seen (its samples are seen, or will be, at their own positions).
    """
    left, count, share = _split(n, seen, world_size, batch_size, drop_last)
    parts = [seen]
    for rank, k in enumerate(consumed):
        lo = rank * share
        parts.append(_slice(left, lo, min(lo + min(k * batch_size, share), count)))
    return _merge(np.concatenate(parts).astype(np.int64).reshape(-1, 2))


def _positions(state: Mapping[str, Any], epoch: int) -> int:
    """The global positions of ``epoch`` in the job that saved ``state``: its samples, or a mix's epoch length."""
    if isinstance(state.get("mix"), Mapping):  # a mix (stoker.loader.mixing): the counts of each epoch
        from stoker.loader.mixing import Schedule

        phases = state["mix"].get("phases")
        return Schedule.from_list(phases, len(phases[0][1]) if phases else 0).length(epoch)
    return int(state["config"]["indices"]["count"])


#: the keys of a rank's state that combine_states merges (the rest must be the same on every rank)
_RANK_KEYS = ("rank", "batches_consumed", "epoch", "seen")


def combine_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One state from the ``Loader.state_dict()`` of every rank, for ranks that did not step in lockstep.

    In DDP every rank hands out as many batches as the others, so every rank's
    state describes the same global position and any one of them (rank 0's)
    resumes the whole job. When ranks may stand at different batches (a loader
    used outside DDP's lockstep, or states saved at different moments), gather
    every rank's state on rank 0 (``torch.distributed.gather_object``) and
    combine them: the result records every global position any rank handed
    out (``"seen"``) and ``batches_consumed == 0``; load it on every rank of
    the new job, with any number of ranks.

    Args:
        states: the state of every rank of one job, one per rank, in any order.

    Returns:
        A state for ``Loader.load_state_dict`` on any number of ranks.

    Raises:
        ValueError: no states, states of another version or without the ranks'
            fields, states of several jobs (another seed, configuration, world size
            or history), a rank missing or given twice, or epochs more than one apart.

    Example:
        >>> import torch.distributed as dist  # doctest: +SKIP
        >>> states = [None] * dist.get_world_size() if dist.get_rank() == 0 else None  # doctest: +SKIP
        >>> dist.gather_object(loader.state_dict(), states, dst=0)  # doctest: +SKIP
        >>> state = [combine_states(states) if dist.get_rank() == 0 else None]  # doctest: +SKIP
        >>> dist.broadcast_object_list(state, src=0)  # doctest: +SKIP
    """
    if not states:
        raise ValueError("combine_states needs the state of every rank (gather them on rank 0); got none")
    for state in states:
        if not isinstance(state, Mapping) or any(key not in state for key in (*_RANK_KEYS, "world_size", "config", "seed")):
            got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(
                f"combine_states needs the dicts Loader.state_dict() returns (keys {sorted((*_RANK_KEYS, 'world_size'))} "
                f"and more); got {got} (save each rank's state with this stoker's state_dict())"
            )
    first = states[0]
    for state in states[1:]:
        differ = [key for key in first if key not in _RANK_KEYS and state.get(key) != first[key]]
        if differ:
            raise ValueError(
                f"combine_states combines the states of the ranks of one job, which differ only in {list(_RANK_KEYS)}; "
                f"these differ in {differ} (pass the states of one job, saved by its loaders)"
            )
    world_size = _check_int("world_size", first["world_size"])
    ranks = sorted(_check_int("rank", s["rank"]) if s["rank"] is not None else -1 for s in states)
    if ranks != list(range(world_size)):
        raise ValueError(
            f"combine_states needs one state from each of the {world_size} ranks 0..{world_size - 1}; got ranks {ranks} "
            "(gather every rank's state, e.g. with torch.distributed.gather_object)"
        )
    epochs = sorted({_check_int("epoch", s["epoch"]) for s in states})
    epoch = epochs[0]
    if len(epochs) > 2 or epochs[-1] > epoch + 1:
        raise ValueError(
            f"combine_states: the ranks' states must be in one epoch, or the next one for ranks that finished it; got epochs {epochs}"
        )
    config = first["config"]
    n, batch_size, drop_last = _positions(first, epoch), int(config["batch_size"]), bool(config["drop_last"])
    current = [s for s in states if s["epoch"] == epoch]
    if len(epochs) == 2 and any(s["batches_consumed"] != 0 for s in states if s["epoch"] != epoch):
        raise ValueError(
            f"combine_states: a rank in epoch {epoch + 1} has handed out batches of it while another is still in epoch "
            f"{epoch}; the ranks of one job cannot be that far apart (save the states at one step)"
        )
    histories = {tuple(map(tuple, s["seen"])) for s in current}
    if len(histories) != 1:
        raise ValueError(
            f"combine_states: the ranks' states of epoch {epoch} record different earlier runs ('seen'); got {sorted(histories)}"
        )
    seen = check_intervals(current[0]["seen"], n)
    full = share_batches(n, seen, world_size, batch_size, drop_last)
    consumed = [full] * world_size  # ranks already in the next epoch handed out their whole share
    for s in current:
        k = _check_int("batches_consumed", s["batches_consumed"])
        if not 0 <= k <= full:
            raise ValueError(f"combine_states: batches_consumed must lie in [0, {full}] (the batches of each rank's share); got {k}")
        consumed[int(s["rank"])] = k
    out = dict(first)
    if all(k == full for k in consumed):
        out.update(epoch=epoch + 1, batches_consumed=0, seen=[], rank=None)
    else:
        merged = seen_after(n, seen, world_size, batch_size, drop_last, consumed)
        out.update(epoch=epoch, batches_consumed=0, seen=merged.tolist(), rank=None)
    return out
