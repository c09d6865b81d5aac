"""The one way stoker moves batches to a CUDA device: a stream of its own, one event per slot, and the cross-stream rules.

Used by the Loader (pipelines ending in ``ToDevice``: a slot is a batch slot,
its page-locked memory written by producer threads, its device memory
allocated once) and by :func:`~stoker.device.prefetch` (a slot holds one batch
read ahead: its page-locked staging buffers and the device memory PyTorch's
allocator gave it). :func:`~stoker.device.to_device` copies on the current
stream and keeps its staging buffers with :func:`keep_until_done`.

One batch, slot ``s``::

    loop (or prefetch)                        transfer's stream                      consumer's stream
    reuse(s): host waits for the last copy   ..copy(s, batch b-N) ─ event[s] ──┐
      out of s only if it has not completed                                    │
    (the slot's host memory is written)                                        │
    release(s): marks = an event on each                                       │
      consumer stream, recorded now ──────── waits for the marks ──────────┐   │
    begin(s) ... the batch's copies ──────── copy(s, batch b) ─ event[s] ──┼───┼─> hand_over(s): waits for
    end(s, outputs): event[s] recorded;      (queued as soon as the batch  │   │   event[s] (no host wait);
      outputs record the transfer's stream    is made, batches ahead of the │   │   the outputs record this
                                              loop: never behind its step) │   └── stream
                                                                           └── (the memory's last user)

The rules PyTorch documents for memory used on several streams, and where they are met:

* Work that reads what another stream wrote waits for an event, on the
  device: the consumer's stream waits for ``event[s]`` (:meth:`hand_over`); the
  host never waits for a copy it hands over.
* Memory is reused only once every stream that used it is done: before a
  slot's host memory is written again, its last copy must have completed
  (:meth:`reuse`: the host waits only if it has not, and that wait is counted
  as the device's time, not the loader's); before the transfer's stream writes
  a slot's device memory again, it waits for *marks*, events recorded on every
  stream that used the slot's batches at the moment the slot was given back
  (:meth:`release`: the caller has checked that nothing refers to the old batch
  any more, so all the work queued on it comes before the marks).
* Memory allocated on one stream and used on another records that stream
  (``Tensor.record_stream``): outputs record the transfer's stream when its
  copies are queued (:meth:`end`) and the consumer's when handed over
  (:meth:`hand_over`), so PyTorch's caching allocator gives none of it to
  anyone else, once freed, before both are done with it.

``ahead=False`` keeps the Loader's earlier behaviour, for comparison: the copy
is queued when the loop takes the batch, behind everything the consumer's
stream had queued then (:meth:`begin` waits for the consumer streams
themselves, not for marks).

The bookkeeping (states, events, marks, host waits) is :class:`~stoker.device._book.SlotBook`;
the CUDA calls go through a *backend* (:class:`CudaBackend`; tests give a fake one).
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

from stoker.device._book import SlotBook


class CudaBackend:
    """The CUDA calls a :class:`StreamTransfer` makes, on one device."""

    def __init__(self, device: Any) -> None:
        import torch

        self.torch = torch
        self.device = device

    def new_stream(self) -> Any:
        return self.torch.cuda.Stream(device=self.device)

    def new_event(self) -> Any:
        return self.torch.cuda.Event()

    def current_stream(self) -> Any:
        return self.torch.cuda.current_stream(self.device)

    def stream_context(self, stream: Any) -> Any:
        return self.torch.cuda.stream(stream)

    def record_stream(self, outputs: Any, stream: Any) -> None:
        """``record_stream(stream)`` on every CUDA tensor of ``stream``'s device among ``outputs`` (a flat sequence or mapping)."""
        tensor = self.torch.Tensor
        for value in outputs.values() if isinstance(outputs, Mapping) else outputs:
            if isinstance(value, tensor) and value.is_cuda and value.device == stream.device:
                value.record_stream(stream)


class StreamTransfer:
    """Copies batches to one CUDA device on a stream of its own, through a ring of slots (see the module).

    Args:
        device: the CUDA device.
        num_slots: slots in the ring.
        ahead: copy ahead of the consumer, waiting only for the marks of the
            slot's last user (``False``: behind everything the consumer's
            stream has queued when the copy is issued).
        backend: the CUDA calls (default :class:`CudaBackend` on ``device``).
    """

    def __init__(self, device: Any, num_slots: int, ahead: bool = True, backend: Any = None) -> None:
        self.backend = backend if backend is not None else CudaBackend(device)
        self.device = device
        self.ahead = ahead
        self.stream = self.backend.new_stream()
        self.book = SlotBook(num_slots)
        self._events = [self.backend.new_event() for _ in range(num_slots)]  # event[s]: re-recorded for each copy
        self._marks: list[dict[Any, Any]] = [{} for _ in range(num_slots)]  # per slot, stream -> its reused mark event
        # the streams that used the slots' memory: the one current now (memory allocated on it next), and every stream
        # a batch was handed to; a tuple, replaced whole
        self._consumers: tuple[Any, ...] = (self.backend.current_stream(),)
        self._held: list[Any] = [None] * num_slots  # what the slot's copy reads, kept until the slot is reused

    @property
    def num_slots(self) -> int:
        return self.book.num_slots

    def _streams(self) -> tuple[Any, ...]:
        current = self.backend.current_stream()
        return self._consumers if current in self._consumers else (*self._consumers, current)

    # ---- the slot ring -------------------------------------------------------------------------
    def reuse(self, slot: int) -> int:
        """Before the slot's host memory is written (or freed) again: wait for its last copy if still running.

        Returns:
            Nanoseconds the host waited (0 in steady state).
        """
        waited = self.book.reuse(slot)
        self._held[slot] = None
        return waited

    def release(self, slot: int, marks: bool = True) -> None:
        """The slot's last batch is no longer referenced: record the marks its next copy waits for.

        Args:
            slot: the slot.
            marks: record an event on every consumer stream now (slot memory
                that the next copy writes again); ``False`` for memory that is
                fresh for each batch (prefetch's), which PyTorch's allocator orders.
        """
        if not (marks and self.ahead):
            self.book.release(slot, None)
            return
        events = []
        slot_marks = self._marks[slot]
        for stream in self._streams():
            event = slot_marks.get(stream)
            if event is None:
                event = slot_marks[stream] = self.backend.new_event()
            event.record(stream)
            events.append(event)
        self.book.release(slot, events)

    def free(self, slot: int) -> int:
        """:meth:`reuse` then :meth:`release` (nothing to check in between); returns the nanoseconds waited."""
        waited = self.reuse(slot)
        self.release(slot)
        return waited

    def begin(self, slot: int) -> None:
        """Before the slot's copies are queued: the transfer's stream waits for what the memory's last users did."""
        marks = self.book.begin(slot)
        stream = self.stream
        if self.ahead:
            for event in marks:
                stream.wait_event(event)
        else:  # the earlier behaviour: behind all the work the consumers have queued now
            for other in self._streams():
                stream.wait_stream(other)

    def on_stream(self) -> Any:
        """A context in which tensor operations run on the transfer's stream (the copies, and what follows them)."""
        return self.backend.stream_context(self.stream)

    def end(self, slot: int, outputs: Any = None, held: Any = None) -> None:
        """The slot's copies are queued: record its event; ``outputs`` record the transfer's stream.

        Args:
            slot: the slot.
            outputs: the batch on the device (CUDA tensors among them, a flat sequence or mapping).
            held: host memory the copies read (staging buffers), kept until the slot is reused.
        """
        event = self._events[slot]
        event.record(self.stream)
        self.book.end(slot, event)
        self._held[slot] = held
        if outputs is not None:
            self.backend.record_stream(outputs, self.stream)

    def hand_over(self, slot: int, outputs: Any = None) -> None:
        """The batch goes to the consumer: its current stream waits for the slot's event (on the device).

        Args:
            slot: the slot.
            outputs: the batch (CUDA tensors among them record the consumer's stream).
        """
        event = self.book.hand_over(slot)
        stream = self.backend.current_stream()
        stream.wait_event(event)
        if stream not in self._consumers:
            self._consumers = (*self._consumers, stream)
        if outputs is not None:
            self.backend.record_stream(outputs, stream)

    # ---- counters ----------------------------------------------------------------------------
    @property
    def host_waits(self) -> int:
        """Times the host waited for a copy before reusing a slot."""
        return self.book.host_waits

    @property
    def waited_ns(self) -> int:
        """Nanoseconds the host waited for copies in all."""
        return self.book.waited_ns


@contextlib.contextmanager
def issuing(transfer: StreamTransfer, slot: int, outputs: list[Any], held: Any = None) -> Iterator[None]:
    """``begin``, the body on the transfer's stream, then ``end`` with ``outputs`` (also when the body raises)."""
    transfer.begin(slot)
    try:
        with transfer.on_stream():
            yield
    finally:
        transfer.end(slot, outputs, held)


# ---- to_device on the current stream: staging buffers kept until their copies are done ---------------------------
# Host buffers read by asynchronous copies that may not have finished, each with an event recorded after its copy:
# a buffer stays referenced (so neither freed nor reused) until its event has completed.
_IN_FLIGHT: deque[tuple[Any, list[Any]]] = deque()
_IN_FLIGHT_LOCK = threading.Lock()


def keep_until_done(host: list[Any], stream: Any) -> None:
    """Keep ``host`` buffers referenced until the work queued so far on ``stream`` (their copies) has completed."""
    import torch

    done = torch.cuda.Event()
    done.record(stream)
    with _IN_FLIGHT_LOCK:
        while _IN_FLIGHT and _IN_FLIGHT[0][0].query():
            _IN_FLIGHT.popleft()
        _IN_FLIGHT.append((done, host))


def copy_into(dst: Any, src: Any, non_blocking: bool = True) -> Any:
    """Copy ``src`` into the CUDA tensor ``dst`` on the current stream (``dst`` cut to ``src``'s first dimension).

    ``dst`` records the current stream (it may have been allocated on another:
    the allocator must not give it away, once freed, before this copy is done).
    """
    import torch

    if dst.shape != src.shape:  # a last batch smaller than the others
        dst = dst[: src.shape[0]]
    dst.copy_(src, non_blocking=non_blocking)
    dst.record_stream(torch.cuda.current_stream(dst.device))
    return dst
