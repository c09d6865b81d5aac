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
  (``Tensor.record_stream``): every CUDA tensor of the outputs, at any depth
  (tuples of dicts of lists...: the walk of ``_tree``), records the transfer's
  stream when its copies are queued (:meth:`end`) and the consumer's when
  handed over (:meth:`hand_over`), so PyTorch's caching allocator gives none
  of it to anyone else, once freed, before both are done with it.
* A stream that was never current at a hand-over (a side stream the user
  launched work on) is unknown to the transfer: the user declares it with
  :func:`record_stream` (PyTorch's rule, extended to the memory stoker reuses
  itself). It records the stream on every CUDA tensor of the batch, and the
  slot that handed out that memory (matched by storage address) records a mark
  on that stream too when it is given back (:meth:`used_on`), once.

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
import weakref
from collections import deque
from collections.abc import Collection, Iterator
from typing import Any

from stoker.device._book import SlotBook
from stoker.device._tree import tree_tensors

# the transfers alive, for record_stream (a user's batch names no transfer: the one that handed out its memory is found
# by the memory's addresses)
_LIVE: weakref.WeakSet[StreamTransfer] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


def _record_tensors(tree: Any, stream: Any) -> frozenset[int]:
    """``record_stream(stream)`` on every CUDA tensor of ``stream``'s device in ``tree``, at any depth; their storage addresses."""
    import torch

    device = stream.device
    keys = set()
    tensor = torch.Tensor
    # (once per batch: the Loader's flat list of field outputs goes without the walk; what is nested is walked)
    for item in tree if type(tree) is list or type(tree) is tuple else (tree,):
        for value in (item,) if isinstance(item, tensor) else tree_tensors(item):
            if value.is_cuda and value.device == device:
                value.record_stream(stream)
                keys.add(value.untyped_storage().data_ptr())
    return frozenset(keys)


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

    def record_stream(self, outputs: Any, stream: Any) -> frozenset[int]:
        """``record_stream(stream)`` on every CUDA tensor of ``stream``'s device in ``outputs``, at any depth.

        Args:
            outputs: a tensor or nested containers of them (``stoker.device._tree``: tuples of dicts of lists...).
            stream: the stream that uses them.

        Returns:
            The storage addresses of the tensors recorded (what :meth:`StreamTransfer.used_on` matches).
        """
        return _record_tensors(outputs, stream)


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
        # per slot: the storage addresses of the batch it last handed over (no reference: the Loader counts them), and
        # the streams record_stream declared for that batch, marked (or waited for) once when the slot is given back
        self._handed: list[frozenset[Any]] = [frozenset()] * num_slots
        self._extra: list[tuple[Any, ...]] = [()] * num_slots
        self._extra_lock = threading.Lock()
        with _LIVE_LOCK:
            _LIVE.add(self)

    @property
    def num_slots(self) -> int:
        return self.book.num_slots

    def _streams(self) -> tuple[Any, ...]:
        current = self.backend.current_stream()
        return self._consumers if current in self._consumers else (*self._consumers, current)

    def _take_extra(self, slot: int) -> tuple[Any, ...]:
        """The streams declared for the slot's last batch (:meth:`used_on`), forgotten."""
        with self._extra_lock:
            extra, self._extra[slot] = self._extra[slot], ()
        return extra

    def used_on(self, keys: Collection[Any], stream: Any) -> bool:
        """Work on ``stream`` uses memory at ``keys``: a slot whose last batch had memory there waits for ``stream`` too.

        When such a slot is given back (:meth:`release`), a mark is also recorded
        on ``stream``, and the slot's next copy waits for it (without ``ahead``:
        for ``stream`` itself when the copy is queued). Once: the slot's next
        batch is protected only if it is declared again.

        Args:
            keys: storage addresses (what :meth:`CudaBackend.record_stream` returns).
            stream: the stream whose work reads or writes that memory.

        Returns:
            Whether a slot of this transfer handed out memory at ``keys``.
        """
        found = False
        with self._extra_lock:
            for slot, handed in enumerate(self._handed):
                if handed and not handed.isdisjoint(keys):
                    found = True
                    if stream not in self._extra[slot]:
                        self._extra[slot] = (*self._extra[slot], stream)
        return found

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
            if not marks:  # (memory fresh for each batch: PyTorch's allocator honours Tensor.record_stream)
                self._take_extra(slot)
            self.book.release(slot, None)
            return
        streams = self._streams()
        extra = self._take_extra(slot)
        if extra:
            streams = (*streams, *(s for s in extra if s not in streams))
        events = []
        slot_marks = self._marks[slot]
        for stream in streams:
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
        else:  # the earlier behaviour: behind all the work the consumers (and streams declared for the slot) queued now
            streams = self._streams()
            for other in (*streams, *(s for s in self._take_extra(slot) if s not in streams)):
                stream.wait_stream(other)

    def on_stream(self) -> Any:
        """A context in which tensor operations run on the transfer's stream (the copies, and what follows them)."""
        return self.backend.stream_context(self.stream)

    def end(self, slot: int, outputs: Any = None, held: Any = None) -> None:
        """The slot's copies are queued: record its event; ``outputs`` record the transfer's stream.

        Args:
            slot: the slot.
            outputs: the batch on the device (CUDA tensors among them, at any depth).
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
            outputs: the batch (CUDA tensors among them, at any depth, record the consumer's stream; their
                addresses are kept, for :meth:`used_on`).
        """
        event = self.book.hand_over(slot)
        stream = self.backend.current_stream()
        stream.wait_event(event)
        if stream not in self._consumers:
            self._consumers = (*self._consumers, stream)
        keys = self.backend.record_stream(outputs, stream) if outputs is not None else None
        self._handed[slot] = frozenset(keys) if keys else frozenset()

    # ---- counters ----------------------------------------------------------------------------
    @property
    def host_waits(self) -> int:
        """Times the host waited for a copy before reusing a slot."""
        return self.book.host_waits

    @property
    def waited_ns(self) -> int:
        """Nanoseconds the host waited for copies in all."""
        return self.book.waited_ns


def record_stream(batch: Any, stream: Any) -> None:
    """Declare that work queued on ``stream`` uses ``batch``: its memory is not reused before ``stream`` has done it.

    PyTorch's rule for a tensor used on a stream other than the one it was
    handed over on is ``Tensor.record_stream``; this applies it to every CUDA
    tensor of a nested batch (tuples, dicts, lists, named tuples, dataclasses,
    at any depth), and extends it to the memory stoker reuses itself, which
    PyTorch's allocator never sees freed: a Loader's batch slots
    (``ToDevice("cuda")``). When the Loader gives the batch's slot back (you
    hold no reference to the batch any more), it records an event on
    ``stream`` and its next copy into the slot waits for it: the work you
    queued on ``stream`` before dropping the batch is done before the slot is
    written again. Without it, the Loader waits only for the streams that were
    current at a ``next()``. Memory from ``prefetch`` and ``to_device`` is
    PyTorch's allocator's: ``Tensor.record_stream`` is what protects it, and
    this function does that too.

    Call it while you hold the batch, once per batch and stream (a slot's next
    batch is protected only if declared again). The other sound way is to join
    the side stream back before you drop the batch:
    ``torch.cuda.current_stream().wait_stream(side)``.

    Args:
        batch: the batch (or any part of it), as the Loader or ``prefetch`` yielded it.
        stream: the ``torch.cuda.Stream`` whose queued work reads or writes the batch.

    Raises:
        TypeError: ``stream`` is not a CUDA stream (it has no ``device``).

    Example:
        >>> side = torch.cuda.Stream()  # doctest: +SKIP
        >>> for images, labels in loader:  # doctest: +SKIP
        ...     side.wait_stream(torch.cuda.current_stream())  # the batch is ready on the current stream
        ...     with torch.cuda.stream(side):
        ...         ema_stats.update(images)  # reads the batch on the side stream
        ...     stoker.device.record_stream((images, labels), side)
        ...     loss = model(images, labels)
    """
    if getattr(stream, "device", None) is None:
        raise TypeError(
            f"record_stream: stream must be a torch.cuda.Stream (the stream whose work uses the batch); got {type(stream).__name__}"
        )
    with _LIVE_LOCK:
        transfers = list(_LIVE)
    keys = _record_tensors(batch, stream)
    if keys:
        for transfer in transfers:
            transfer.used_on(keys, stream)


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
