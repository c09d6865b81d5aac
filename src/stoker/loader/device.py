"""CUDA side of the loader: its own stream, events for the copies, and waits on the streams that use the batches.

One batch slot on CUDA::

    producer thread                           loader's stream                       your stream
    before_slot(s): host waits for the last   ..copy(s, batch b-N) ─ event ──┐
      copy out of slot s's pinned memory                                    │
    reference check / fresh memory for s                                    │
    stream_context(): the loader's stream ──> wait for every stream that    │
      waits (once per batch)                  used the batches (yours, the  │
                                              allocating ones), as queued   │
                                              now                           │
    fields run: copies on the loader's stream ─ copy(s, batch b) ─ event ───┼─> hand_over: waits
    after_batch(s): event; outputs record                                   │   for the event; the
      the loader's stream                                                   │   outputs record your
                                                                            └─  stream

The rules PyTorch documents for tensors that cross streams, and how they are met:

* Work on one stream that reads what another wrote waits for an event: your
  stream waits for the copy's event (``hand_over``), never the host.
* Memory is only reused once every stream that used it is done: before a
  slot's memory is written again, the host waits for the copy that last read
  its pinned memory (``before_slot``), and the loader's stream waits for your
  stream *as queued at that moment* (``stream_context``). That moment comes
  after the loader found that nothing refers to the slot any more, so all the
  work you queued on that batch is before it, whether you moved on with
  ``next()`` or held the batch a little longer (a wrapper that reads ahead,
  such as ``prefetch``). The loader's stream also waits for the stream that
  allocated the slots (current when the epoch started) and the default
  stream (on which producers allocate fresh memory for a slot whose batch you
  kept), so that it never writes into memory whose earlier user is still at
  work.
* Memory allocated on one stream and used on another records that stream
  (``Tensor.record_stream``), so that PyTorch's caching allocator does not give
  it to someone else, once freed, before that stream is done with it: given
  the outputs, ``after_batch`` records the loader's stream on every CUDA
  tensor of the batch, and ``hand_over`` records yours.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any


class CudaSync:
    """Orders the loader's copies against the streams that use the batches, per batch slot.

    Args:
        device: the CUDA device of the pipelines.
        num_slots: batch slots of the loader.
    """

    def __init__(self, device: Any, num_slots: int) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.copied: list[Any] = [None] * num_slots
        # streams whose work must be done before the loader's stream writes into memory again: the one current
        # now (the slots are allocated on it next), the default one (fresh memory for kept batches), and every
        # stream a batch was handed to. A tuple, replaced whole, so that producers read it without a lock.
        self._waits: tuple[Any, ...] = tuple(dict.fromkeys([torch.cuda.current_stream(device), torch.cuda.default_stream(device)]))
        self._pending = threading.local()  # per producer thread: the waits still to issue for its batch

    def before_slot(self, slot: int) -> None:
        """Producer: wait (host) until the copy out of slot ``slot``'s pinned memory is done; the stream waits follow.

        Call it before the slot's memory is written, renewed or freed.
        """
        copied = self.copied[slot]
        if copied is not None:
            copied.synchronize()
        self._pending.waits = True

    def wait_copied(self, slot: int) -> None:
        """Loop: wait (host) until the copy out of slot ``slot``'s pinned memory is done, before producers may write it."""
        copied = self.copied[slot]
        if copied is not None:
            copied.synchronize()

    @contextlib.contextmanager
    def stream_context(self) -> Iterator[None]:
        """Producer: run the batch's tensor operations on the loader's stream.

        The first time for a batch (after :meth:`before_slot`), the loader's
        stream first waits for every stream that used the batches, as queued now.
        """
        with self.torch.cuda.stream(self.stream):
            if getattr(self._pending, "waits", False):
                self._pending.waits = False
                for stream in self._waits:
                    self.stream.wait_stream(stream)
            yield

    def after_batch(self, slot: int, outputs: Any = None) -> Any:
        """Producer: record the end of the batch's copies; returns the event.

        Args:
            slot: the batch's slot.
            outputs: the batch's fields; CUDA tensors among them record the
                loader's stream, so that their memory is not reused, once
                freed, before the loader's work on them is done.
        """
        event = self.torch.cuda.Event()
        event.record(self.stream)
        self.copied[slot] = event
        if outputs is not None:
            _record(outputs, self.stream)
        return event

    def hand_over(self, event: Any, outputs: Any = None) -> None:
        """Consumer: make the user's current stream wait for the batch (no host synchronisation).

        Args:
            event: the event :meth:`after_batch` returned.
            outputs: the batch's fields; CUDA tensors among them record the
                user's stream, so that memory the loader's stream allocated is
                not given back to it, once freed, before the work the user
                queued on it is done.
        """
        stream = self.torch.cuda.current_stream(self.device)
        stream.wait_event(event)
        if stream not in self._waits:
            self._waits = (*self._waits, stream)
        if outputs is not None:
            _record(outputs, stream)

    def release(self, slot: int) -> None:
        """Consumer: the user moved on from slot ``slot``.

        Nothing to do: the producer makes the loader's stream wait for the
        user's stream when it is about to write into the slot again (see
        :meth:`stream_context`), which is later than this.
        """


def _record(outputs: Any, stream: Any) -> None:
    """``record_stream(stream)`` on every CUDA tensor among ``outputs`` (a sequence or mapping of fields)."""
    import torch

    values = outputs.values() if isinstance(outputs, dict) else outputs
    for value in values:
        if isinstance(value, torch.Tensor) and value.is_cuda and value.device == stream.device:
            value.record_stream(stream)
