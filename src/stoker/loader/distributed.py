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
