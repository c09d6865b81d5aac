"""Each epoch's samples on this rank: the epoch's order, this rank's share of it, its batches; the next epoch.

The order comes from :mod:`stoker.loader.order` (a mix's from :class:`~stoker.loader._mix.Mix`); a ``RANDOM`` one
small enough is prepared ahead, shuffled by producers while they wait for the epoch before to end. This rank's share
comes from :mod:`stoker.loader.distributed`, after the positions an elastic resume says earlier runs handed out
(``Loader._seen``). ``set_epoch`` and ``set_weights`` choose what the next epoch is. Functions of the Loader
(:class:`~stoker.loader._view.LoaderView`); its methods of the same names call them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from stoker.errors import StokerError
from stoker.loader._view import LoaderView
from stoker.loader.distributed import elastic_share, samples_per_rank, share_batches
from stoker.loader.order import PREPARED_ORDER_MAX, OrderOption, PreparedOrder, epoch_order

#: no global position of an epoch handed out before this run (intervals ``[start, stop)``, one per row)
NOTHING_SEEN = np.zeros((0, 2), dtype=np.int64)


def positions(loader: LoaderView, epoch: int) -> int:
    """The global positions of ``epoch`` (every rank together): the samples used, or a mix's epoch length."""
    return loader._num_indices if loader._mix is None else loader._mix.length(epoch)


def seen_in(loader: LoaderView, epoch: int) -> np.ndarray:
    """The global positions of ``epoch`` handed out before this run (elastic resume), as intervals; usually none."""
    if loader._seen is not None and loader._seen[0] == epoch:
        return loader._seen[1]
    return NOTHING_SEEN


def batches_in(loader: LoaderView, epoch: int) -> int:
    """This rank's batches in ``epoch`` (in a resumed one: of its share of the positions left)."""
    return share_batches(positions(loader, epoch), seen_in(loader, epoch), loader.world_size, loader.batch_size, loader.drop_last)


def epoch_share(loader: LoaderView, epoch: int, prepared: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """This rank's samples of ``epoch`` and their global positions (``Share.runs``: the augmentation keys).

    An epoch resumed on another number of ranks: this rank's share of the positions left (``distributed.elastic_share``).

    ``prepared``: the epoch is starting (no producer is running): use the order prepared for it, if any.
    """
    order = _take_prepared_order(loader, epoch) if prepared else None
    if order is not None and loader.world_size == 1 and len(seen_in(loader, epoch)) == 0:  # (the common case, no copy)
        # elastic_share's answer for one rank and nothing seen: the order's first samples, one run of keys from 0
        return order[: samples_per_rank(len(order), 1, loader.batch_size, loader.drop_last)], np.zeros((1, 2), dtype=np.int64)
    if loader._mix is not None:  # the streams' samples, laid out in exact proportions (loader.mixing)
        order = loader._mix.order(epoch, loader.seed, loader.order, loader.chunk_size, loader.window_chunks, loader.window_shards)
    if order is None:
        shards = getattr(loader.reader, "shard_starts", None)  # QUASI_RANDOM windows stay within shards
        order = epoch_order(loader.order, loader.indices, loader.seed, epoch, loader.chunk_size, loader.window_chunks, shards,
                            loader.window_shards)  # fmt: skip
    share = elastic_share(len(order), seen_in(loader, epoch), loader.rank, loader.world_size, loader.batch_size, loader.drop_last)
    return share.samples(order), share.runs()


def _order_args(loader: LoaderView, epoch: int) -> tuple[Any, ...]:
    """What ``epoch_order(RANDOM, ...)`` depends on (the indices by identity: they are never changed in place)."""
    return (loader.order, loader.seed, epoch, id(loader.indices), len(loader.indices))


def prepare_order(loader: LoaderView, epoch: int) -> PreparedOrder | None:
    """Start ``epoch``'s order, for producers to shuffle while they wait (``RANDOM``, small enough); else ``None``.

    The producer that shuffles it copies the indices first, a piece at a time too (:func:`~stoker.pipeline.random.order_steps`);
    with no producer, the loop does it all when the epoch starts (:meth:`PreparedOrder.finish`).

    Called as an epoch starts, after :func:`epoch_share` took its order: the memory of the epoch before's order is
    reused (``loader._order_buffers``, see :func:`_take_prepared_order`).
    """
    if loader.order is not OrderOption.RANDOM or loader._num_indices > PREPARED_ORDER_MAX or loader._mix is not None:
        return None
    buffers = loader._order_buffers
    free, buffers[1] = buffers[1], None
    # (the copy of the indices is left to the producer that shuffles it, in pieces: off the epoch's start)
    loader._prepared_order = PreparedOrder.start(loader.indices, loader.seed, epoch, _order_args(loader, epoch), free)
    return loader._prepared_order


def _take_prepared_order(loader: LoaderView, epoch: int) -> np.ndarray | None:
    """The order prepared for ``epoch``, finished; ``None`` if none was, or for other arguments (one use only).

    Called as an epoch starts, when no producer runs (``_iteration`` stops those of an epoch left by ``break``
    before it starts the next one) and the epoch before has ended (its loop hands out no batch, hence reads no
    index, once another epoch starts; the extras and a store's schedule copy what they take). So the prepared
    order of the epoch before (``_order_buffers[0]``) is free now: it becomes the memory the next prepared order
    reuses (``_order_buffers[1]``), and the one returned here is the running epoch's until the next call. Two
    arrays in turn, never a new 8 bytes a sample per epoch.
    """
    prepared, loader._prepared_order = loader._prepared_order, None
    buffers = loader._order_buffers
    running, buffers[0] = buffers[0], None
    if prepared is None or prepared.args != _order_args(loader, epoch):
        buffers[1] = prepared.values if prepared is not None else running  # (no producer shuffles it any more)
        return None
    buffers[0], buffers[1] = prepared.values, running
    return prepared.finish()


def set_epoch(loader: LoaderView, epoch: Any) -> None:
    """``Loader.set_epoch``: the next iteration runs ``epoch`` from its start."""
    if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
        raise ValueError(f"epoch must be an int >= 0; got {epoch!r}")
    loader._next_epoch, loader._skip_batches = int(epoch), 0
    loader._position = (int(epoch), 0)
    loader._seen = None


def set_weights(loader: LoaderView, weights: Sequence[float], samples_per_epoch: int | None) -> None:
    """``Loader.set_weights``: a mix's new weights, from the next epoch that starts from its beginning on."""
    if loader._mix is None:
        raise StokerError("set_weights is for a mix of datasets: Loader([Stream(...), Stream(...)], ...)")
    if loader._still_iterating():
        epoch, consumed = loader._position
        raise StokerError(
            f"set_weights was called within epoch {epoch} (after {consumed} of its {batches_in(loader, epoch)} batches): the weights of an "
            "epoch never change while it runs. Call it between epochs (after the for loop over the loader); it then applies "
            "from the next epoch"
        )
    at_start = loader._skip_batches == 0 and len(seen_in(loader, loader._next_epoch)) == 0
    loader._mix.set_weights(weights, samples_per_epoch, loader._next_epoch if at_start else loader._next_epoch + 1)
