"""The Loader's batch memory: how many batches are prepared ahead, by how many producers, in how many slots.

Sizes are decided when the pipelines are built (:func:`sizes`, :func:`slots_needed`); memory is allocated at the
first epoch and again when the slot count changes (:func:`allocate`), page-locked where a pipeline copies to a CUDA
device (:mod:`stoker.device._stream`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from stoker.errors import StokerError
from stoker.loader._graph import FieldPipeline
from stoker.loader._view import LoaderView

#: the default ``batches_ahead``: at least this many batches ahead, at most ``_MOST_AHEAD``, within ``_AHEAD_BYTES``
_LEAST_AHEAD, _MOST_AHEAD, _AHEAD_BYTES = 3, 8, 4 << 20


def default_batches_ahead(batch_bytes: int, producers: int = 1) -> int:
    """``batches_ahead`` when none is given: 3, up to 8 per producer thread for batches small enough
    that they take at most 4 MiB per producer.

    Handing a batch from a producer thread to your loop costs a thread wake-up (tens of
    microseconds on a virtual machine) whatever the batch's size; with small batches
    (a table's rows) more of them queued keeps the producers from waiting for tokens.
    Measured on Otto (batch 1024, 389 KB): 3 -> 8 ahead made an epoch 13-15% faster, 32 slower
    (one producer); with two producers 16 ahead was 3-6% faster than 8, 32 slower.
    """
    producers = max(1, producers)
    if batch_bytes <= 0:
        return _MOST_AHEAD * producers
    return max(_LEAST_AHEAD, min(_MOST_AHEAD * producers, _AHEAD_BYTES * producers // batch_bytes))


def sizes(pipelines: list[FieldPipeline], num_workers: int, batches_ahead: int | None, slot_batch: int) -> tuple[bool, int, int, int]:
    """Whether the pipelines' heads are reentrant, the producer threads, ``batches_ahead`` (``None``: the default)
    and the tokens (batches ahead) of each producer.

    Pipelines whose operations keep no per-thread state can prepare several batches at once: one producer thread per
    worker (at most two), each running its batches' compiled code on one thread. Otherwise one producer spreads each
    batch's samples over the workers. Only the heads count: the tails run on the loop's thread, one batch at a time.
    """
    reentrant = all(getattr(s.op, "reentrant", False) for p in pipelines for s in p.steps[: p.head])
    producers = max(1, min(num_workers, 2)) if reentrant else 1
    if batches_ahead is None:
        batches_ahead = default_batches_ahead(sum(p.slot_bytes(slot_batch) for p in pipelines), producers)
    return reentrant, producers, batches_ahead, max(1, -(-batches_ahead // producers))


def slots_needed(producers: int, tokens_per_producer: int, consumer_holds: int) -> int:
    """Batches in flight: the two the loop may hold, those a bounded consumer holds, the queued ones, one per producer."""
    return producers * (tokens_per_producer + 1) + 2 + consumer_holds


def expect_held(loader: LoaderView, batches: Any) -> None:
    """``Loader.expect_held``: room for ``batches`` more batches held by the consumer, from the next epoch on."""
    if isinstance(batches, bool) or not isinstance(batches, (int, np.integer)) or batches < 0:
        raise ValueError(f"expect_held needs an int >= 0 (the batches the consumer holds); got {batches!r}")
    if int(batches) > loader._consumer_holds:
        loader._consumer_holds = int(batches)
        needed = slots_needed(loader._producers, loader._tokens_per_producer, loader._consumer_holds)
        if needed != loader._num_slots:  # a new slot count from the next epoch on (memory is allocated again then)
            loader._num_slots = needed
            loader._allocated = False
            loader._plan = None


def allocate(pipelines: list[FieldPipeline], num_slots: int, slot_batch: int, copy_ahead: bool) -> Any:
    """Give every pipeline memory for ``num_slots`` batches of ``slot_batch`` samples; the CUDA transfer of pipelines
    ending in ``ToDevice('cuda')`` (a :class:`~stoker.device._stream.StreamTransfer`, its slots page-locked), else ``None``.

    Raises:
        StokerError: pipelines copy to several CUDA devices, or to one without CUDA available.
    """
    cuda_devices = {s.op.device for p in pipelines for s in p.steps if getattr(s.op, "is_cuda", False)}  # type: ignore[attr-defined]
    transfer = None
    if len(cuda_devices) > 1:
        raise StokerError(
            f"pipelines copy to several CUDA devices {sorted(map(str, cuda_devices))}; one Loader feeds one device "
            "(make one Loader per device)"
        )
    if cuda_devices:
        import torch

        if not torch.cuda.is_available():
            raise StokerError(f"a pipeline has ToDevice({sorted(map(str, cuda_devices))}) but CUDA is not available")
        from stoker.device._stream import StreamTransfer

        transfer = StreamTransfer(next(iter(cuda_devices)), num_slots, ahead=copy_ahead)
    for p in pipelines:
        p.allocate(num_slots, slot_batch, transfer is not None and p.wants_pinned)
    return transfer
