"""The transfer's bookkeeping, per slot: which copy is in flight, when host memory may be written again, what a copy waits for.

A *slot* is memory a batch travels through: page-locked host memory that a
producer writes (or that holds a batch's staging buffers), the device memory
the copy fills, and one event recorded after the copy. Each slot goes round::

            reuse(slot)                release(slot, marks)          begin(slot) -> marks
    ... ─────────────────> REUSED ─────────────────────> FREE ─────────────────────> COPYING
    (host memory may be written     (the device memory's last user      (the copy waits for the marks
     once the last copy out of       is done with it as of the marks:   on the device, never the host)
     it has completed: the host      events on the streams that used            │
     waits only if it has not)       it, recorded now)                          │ end(slot, event)
                                                                                v
    ... <──────────────────────── HANDED <─────────────────────────────────── ISSUED
             (the slot comes round again)      hand_over(slot) -> event (the consumer's
                                               stream waits for it, on the device)

* ``reuse`` is the only place the host may wait, and it waits only when the
  slot's last copy has not completed (``event.query()`` is false): a loop that
  stays within its slots never waits. The waits are counted (:attr:`host_waits`,
  :attr:`waited_ns`): that time is the device's, not the loader's.
* ``release`` keeps the marks for the next ``begin`` of that slot, which hands
  each mark out once; ``release`` without marks (``None``) means the copy waits
  for nothing recorded here (fresh memory, or a caller that orders its streams
  another way).
* Slots start ``REUSED``: the first copy into a slot also follows a ``release``.
* A slot may also be reused straight from ``ISSUED`` (a batch copied ahead that
  was never handed over: the epoch was closed) or from ``REUSED``/``FREE`` (the
  slot was given back again before any copy). A copy that raised still ends
  (``end`` in a ``finally``), so its slot never stays ``COPYING``.

Events are anything with ``query() -> bool`` and ``synchronize()``
(``torch.cuda.Event``; fakes in the tests): this module imports no torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

REUSED, FREE, COPYING, ISSUED, HANDED = "reused", "free", "copying", "issued", "handed"


class TransferProtocolError(RuntimeError):
    """A slot was used out of the order ``reuse -> release -> begin -> end -> hand_over`` (a bug in the caller)."""


class SlotBook:
    """Per-slot state, copy events and release marks of one transfer (see the module's docstring).

    Args:
        num_slots: slots in the ring.
        clock: ``() -> int`` nanoseconds (for the host waits' time).
    """

    def __init__(self, num_slots: int, clock: Callable[[], int] = time.perf_counter_ns) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1; got {num_slots}")
        self.num_slots = num_slots
        self._clock = clock
        self.state: list[str] = [REUSED] * num_slots  # (a copy begins only after a release: the first one too)
        self.copy: list[Any] = [None] * num_slots  # the event recorded after the slot's last copy
        self.marks: list[Sequence[Any] | None] = [None] * num_slots  # what the slot's next copy waits for
        #: times the host waited for a copy before reusing a slot, and how long [ns] in all
        self.host_waits = 0
        self.waited_ns = 0

    def _expect(self, slot: int, allowed: tuple[str, ...], what: str) -> None:
        if not 0 <= slot < self.num_slots:
            raise TransferProtocolError(f"{what}: slot {slot} is not in [0, {self.num_slots})")
        if self.state[slot] not in allowed:
            raise TransferProtocolError(f"{what}: slot {slot} is {self.state[slot]}, expected {' or '.join(allowed)}")

    def in_flight(self) -> list[int]:
        """The slots whose last copy has not completed (queries each event; no wait)."""
        return [s for s in range(self.num_slots) if self.copy[s] is not None and not self.copy[s].query()]

    def may_reuse(self, slot: int) -> bool:
        """Whether slot ``slot``'s host memory may be written now without waiting (its last copy has completed)."""
        event = self.copy[slot]
        return event is None or bool(event.query())

    def reuse(self, slot: int) -> int:
        """The slot goes back to whoever writes its host memory: wait (host) for its last copy if it is still running.

        Returns:
            The nanoseconds the host waited (0 when the copy had completed, or there was none).
        """
        self._expect(slot, (HANDED, ISSUED, REUSED, FREE), "reuse")
        event = self.copy[slot]
        waited = 0
        if event is not None and not event.query():
            t0 = self._clock()
            event.synchronize()
            waited = max(0, self._clock() - t0)
            self.host_waits += 1
            self.waited_ns += waited
        self.copy[slot] = None
        self.state[slot] = REUSED
        return waited

    def release(self, slot: int, marks: Sequence[Any] | None) -> None:
        """The slot's device memory is no longer used by its last batch, as of ``marks`` (kept for the next copy)."""
        self._expect(slot, (REUSED, FREE), "release")
        self.marks[slot] = None if marks is None else list(marks)
        self.state[slot] = FREE

    def begin(self, slot: int) -> list[Any]:
        """A copy into the slot is about to be queued: the marks it must wait for (each handed out once)."""
        self._expect(slot, (FREE,), "begin")
        marks, self.marks[slot] = self.marks[slot], None
        self.state[slot] = COPYING
        return list(marks) if marks is not None else []

    def end(self, slot: int, event: Any) -> None:
        """The copy is queued; ``event`` was recorded after it."""
        self._expect(slot, (COPYING,), "end")
        self.copy[slot] = event
        self.state[slot] = ISSUED

    def hand_over(self, slot: int) -> Any:
        """The slot's batch goes to the consumer: the event its stream must wait for."""
        self._expect(slot, (ISSUED,), "hand_over")
        self.state[slot] = HANDED
        return self.copy[slot]
