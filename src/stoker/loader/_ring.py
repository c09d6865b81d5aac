"""The batch-slot ring: how an epoch's batches travel from producers to the loop, and how the epoch ends.

One object holds the protocol that producers (compiled or Python) and the loop
(the consumer) follow for one epoch::

    producer t (batches skip+t, skip+t+P, ...)          the loop (batch c, in order)
      b < CONSUMED + P*ahead? else spin, then sleep       status[c] set? else make c itself or wait
      stop set? return                                    status[c]: DONE -> the batch; else the end
      claim(b) (0 -> 1): lost -> skip b (the loop has it) free_slot(c + P*ahead): renew memory still held
      make b into slot(b) ── status[b] = DONE/FAILED      CONSUMED = c + 1; wake producers asleep and due
      post ready[t] if the loop sleeps for b

* **Slots**: batch ``b`` is made in slot ``(slot_base + b - skip) % num_slots``;
  slots continue from one epoch to the next. Before a producer may write a
  slot, the loop checks that no batch the user kept still uses its memory
  (:meth:`SlotRing.free_slot`); if one does, the slot gets fresh memory and the
  address table (what compiled producers write through) its new addresses.
* **Tokens**: a counter, no system call per batch. Batch ``b`` may be made once
  ``b < CONSUMED + P*ahead`` (``CONSUMED``: the batches the loop took, a word of
  :attr:`SlotRing.ctl`, stored after the slot of batch ``CONSUMED - 1 + P*ahead``
  is checked). A producer with nothing to make spins briefly (:data:`SPIN_NS`), then
  sleeps on its ``tokens[t]`` semaphore: it sets ``WAKE_AT[t]`` (half the batches
  ahead later: one wake per ``P*ahead/2`` batches, not per batch), then
  ``SLEEPING[t] = 1`` with a full fence, then reads ``CONSUMED`` again before
  ``sem_wait``. The loop posts ``tokens[t]`` only when ``SLEEPING[t]`` is set and
  ``CONSUMED >= WAKE_AT[t]``. A wake missed because the loop's ``CONSUMED`` store
  and its read of ``SLEEPING[t]`` passed each other (no fence on the loop's side)
  is posted by the loop's next batch, or, if the loop has no batch to take, by
  its fenced wake of every sleeper before it waits (:meth:`SlotRing.wait_ready`):
  no deadlock. A post that finds the producer awake leaves a count that makes one
  later ``sem_wait`` return at once; the producer checks its condition again.
* **Hand-over**: a batch is ready once its ``status`` is set (a release store
  after its memory is written): the loop reads it. A producer posts its
  ``ready[t]`` semaphore after a batch only when the loop announced it sleeps
  for that batch (``LOOP_WAITS``, set with a full fence before the loop reads
  the status again and sleeps; the producer fences between its status store and
  its read of ``LOOP_WAITS``).
* **Claims**: a producer or the loop claims a batch with an atomic
  compare-and-swap before making it, so that exactly one makes it.
* **The end**: every way an epoch ends (the last batch, :meth:`close` from any
  thread, a failed batch, an interrupt) sets one end marker (:attr:`end`),
  stops the producers and wakes the loop; the loop turns the marker into
  ``StopIteration`` or an exception, in one place.

Kept from one epoch to the next (:class:`RingMemory`): the semaphores and the
address table; a ring is made per epoch over them.
"""

from __future__ import annotations

import platform
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from stoker.pipeline import native

if TYPE_CHECKING:
    from stoker.loader._graph import FieldPipeline

PENDING, DONE, FAILED, FALLBACK = 0, 1, 2, 3

#: a batch's claim by the loop's own run of the compiled loop over several batches (producers and single claims: 1)
LOOP_CLAIM = 2

#: words of :attr:`SlotRing.ctl` (int64, one cache line each): the batches the loop took, the batch it sleeps for
#: (-1: none), and per producer ``t`` whether it sleeps and from which ``CONSUMED`` on it wants to be woken
CONSUMED, LOOP_WAITS = 0, 8


def SLEEPING(t: int) -> int:
    """The word of :attr:`SlotRing.ctl` that says producer ``t`` sleeps (or is about to) on its semaphore."""
    return 16 + 16 * t


def WAKE_AT(t: int) -> int:
    """The word of :attr:`SlotRing.ctl` with the ``CONSUMED`` from which sleeping producer ``t`` wants to be woken."""
    return 24 + 16 * t


#: how long a producer with nothing to make spins (checking ``CONSUMED``) before it sleeps [ns]
SPIN_NS = 20_000

#: the loop's plain stores of ``CONSUMED`` (a memoryview) are seen in program order by the producers: x86-64's
#: total store order; elsewhere the loop stores through :func:`stoker.pipeline.native.store` (a fence first)
_STRONG_ORDER = platform.machine().lower() in {"x86_64", "amd64", "i686", "i386"}


def wake_after(b: int, span: int) -> int:
    """The ``CONSUMED`` from which a producer sleeping for batch ``b`` wants to be woken: when half of the batches
    ahead are left (``span = P*ahead``), so that a sleeping producer is woken once per ``span/2`` batches."""
    return b - span + 1 + max(0, span // 2 - 1)


@dataclass(frozen=True)
class End:
    """Why an epoch ended.

    Attributes:
        kind: ``"exhausted"`` (every batch handed out), ``"closed"`` (:meth:`SlotRing.close`),
            ``"failed"`` (an error reaches the loop) or ``"interrupted"`` (a ``BaseException``
            such as ``KeyboardInterrupt`` left ``next()``).
        error: the error of a failed epoch, else ``None``.
        by_other_thread: ``close()`` was called from a thread other than the loop's.
    """

    kind: str
    error: BaseException | None = None
    by_other_thread: bool = False


class RingMemory:
    """What one loader's epochs keep from one to the next: semaphores and the slot address table.

    Args:
        num_slots: batch slots.
        width: columns of the address table (one per memory a compiled producer writes; 0: none).
        producers: producers per epoch (at most).
    """

    def __init__(self, num_slots: int, width: int, producers: int) -> None:
        self.num_slots, self.width, self.producers = num_slots, width, producers
        self.addresses = np.zeros((num_slots, max(1, width)), dtype=np.int64)
        self.generations: tuple[int, ...] = ()  # each pipeline's memory generation the table holds (none yet)
        self.sems: Any = native.Semaphores([0] * (2 * producers)) if native.available() else PySemaphores(2 * producers)
        #: the next epoch's first batch, made ahead into one of these slots (``stoker.loader._producers.Ahead``), or None
        self.ahead: Any = None
        #: epochs whose first batch was made ahead and handed over as it was (tests, benchmarks)
        self.firsts_ahead = 0
        #: the fields' time of a batch the loop made, compiled (the last one alone, or a run's mean) [ns] (0: not yet
        #: timed): how many batches its run at an epoch's start makes in one call (``CompiledEpoch._make_run``)
        self.loop_batch_ns = 0

    def fits(self, num_slots: int, width: int, producers: int) -> bool:
        return (self.num_slots, self.width, self.producers) == (num_slots, width, producers)


class SlotRing:
    """One epoch's slots, tokens, claims, statuses and end marker (see the module).

    Args:
        memory: the kept semaphores and address table.
        pipelines: the loader's pipelines (their slot memory is checked and renewed here).
        set_addresses: ``(slot) -> None``: writes slot ``slot``'s memory addresses into ``memory.addresses``
            (``None`` when no compiled producer writes through addresses).
        n_batches: batches in the epoch.
        skip: the first batch (a resumed epoch starts later).
        slot_base: the slot of batch ``skip``.
        producers: producer threads ``P``.
        ahead: batches each producer may be ahead of the loop.
        held: the loader's count of batches kept by the user (``[count]``, added to).
        forgiven: slots whose memory the loop variables of the previous epoch may still hold
            (renewed if so, not counted as kept batches).
        before_free: ``(slot) -> None``, called before a slot is checked and handed to a producer (CUDA: the
            copy out of its page-locked memory has completed).
        after_free: ``(slot) -> None``, called once the slot is checked (and renewed): nothing of the batch
            it held is referred to any more (CUDA: the streams that used it are marked).
    """

    def __init__(
        self,
        memory: RingMemory,
        pipelines: list[FieldPipeline],
        set_addresses: Callable[[int], None] | None,
        n_batches: int,
        skip: int,
        slot_base: int,
        producers: int,
        ahead: int,
        held: list[int],
        forgiven: frozenset[int] = frozenset(),
        before_free: Callable[[int], Any] | None = None,
        after_free: Callable[[int], Any] | None = None,
    ) -> None:
        if producers > memory.producers:
            raise ValueError(f"{producers} producers on a ring made for {memory.producers}")
        self.memory = memory
        self.pipelines = pipelines
        self._set_addresses = set_addresses
        self._before_free = before_free
        self._after_free = after_free
        self.n_batches, self.skip, self.slot_base = n_batches, skip, slot_base
        self.num_slots = memory.num_slots
        self.producers, self.ahead = producers, ahead
        if producers * ahead + 2 > self.num_slots:
            raise ValueError(f"{producers} producers {ahead} batches ahead need more than {self.num_slots} slots")
        self.held = held
        self._forgiven = set(forgiven)
        self.status = np.zeros(max(1, n_batches), dtype=np.int8)
        self.ctl = np.zeros(32 + 16 * producers, dtype=np.int64)  # CONSUMED, LOOP_WAITS, SLEEPING(t), WAKE_AT(t)
        self.ctl[CONSUMED] = skip
        # (through the fenced exchange the loop uses when it waits: compiled, or loaded from the cache, now, before the
        # first batch, not in the middle of an epoch)
        native.exchange(self.ctl, LOOP_WAITS, -1)
        self.ctl_view = self.ctl.data  # (a memoryview: the loop's reads and stores, ~60 ns each)
        self.span = producers * ahead
        self.claims = np.zeros(max(1, n_batches), dtype=np.int32)
        self.stop = np.zeros(1, dtype=np.int64)  # read by compiled producers: nonzero once the epoch ends
        self.errors: dict[int, BaseException] = {}  # batch -> the error of a Python producer that failed it
        self.producer_errors: list[BaseException | None] = [None] * producers
        self.end: End | None = None
        self._end_lock = threading.Lock()
        self.sems = memory.sems
        # each producer's wake-up (one semaphore per producer of the kept memory), then its ready batches
        self.sems.reset([0] * (2 * memory.producers))
        if set_addresses is not None and memory.generations != self.generations():
            for slot in range(self.num_slots):  # memory changed since the table was filled (or never filled)
                set_addresses(slot)
            memory.generations = self.generations()
        # each producer may make its first `ahead` batches at once: their slots must be free of kept batches
        for b in range(skip, min(n_batches, skip + producers * ahead)):
            self.free_slot(b)

    # ---- slots -------------------------------------------------------------------------------
    def slot(self, b: int) -> int:
        """The slot of batch ``b``."""
        return (self.slot_base + b - self.skip) % self.num_slots

    def producer_of(self, b: int) -> int:
        """The producer that makes batch ``b`` (unless the loop claims it first)."""
        return (b - self.skip) % self.producers

    def generations(self) -> tuple[int, ...]:
        return tuple(p.memory_generation for p in self.pipelines)

    def free_slot(self, b: int) -> None:
        """Before batch ``b`` may be made: give its slot fresh memory where a batch the user kept still uses it.

        Counts one kept batch per slot renewed, except for a slot the previous epoch's
        loop variables may still hold (``forgiven``, once).
        """
        slot = self.slot(b)
        if self._before_free is not None:  # (CUDA: the copy out of the slot's pinned memory is done)
            self._before_free(slot)
        renewed = False
        for p in self.pipelines:
            if p.slot_in_use(slot):
                p.renew_slot(slot)
                renewed = True
        forgiven = slot in self._forgiven
        self._forgiven.discard(slot)
        if renewed:
            if not forgiven:
                self.held[0] += 1
            if self._set_addresses is not None:
                self._set_addresses(slot)
                self.memory.generations = self.generations()
        if self._after_free is not None:  # (CUDA: the streams that used the slot's batch are marked, after the check)
            self._after_free(slot)

    # ---- the producers' side (Python producers; compiled ones do the same in compiled code) ---
    def take_token(self, t: int, b: int, soonest: bool = False) -> bool:
        """Producer ``t``: wait until batch ``b`` may be made (its slot is free); whether to go on (``False``: the epoch
        is over). Sleeps as compiled producers do (see the module), without the spin; ``soonest``: woken as soon as
        ``b`` may be made (not when half of the batches ahead are left)."""
        ctl, span = self.ctl, self.span
        while b >= ctl[CONSUMED] + span and self.stop[0] == 0:
            ctl[WAKE_AT(t)] = b - span + 1 if soonest else wake_after(b, span)
            # (plain stores and loads: this producer and the loop's publish() both run them holding the GIL, which orders
            # them as written; the loop reads SLEEPING after it stored CONSUMED, this one CONSUMED after SLEEPING)
            ctl[SLEEPING(t)] = 1
            if b < ctl[CONSUMED] + span or self.stop[0] != 0:
                ctl[SLEEPING(t)] = 0
                break
            self.sems.wait(t)
            ctl[SLEEPING(t)] = 0
        return self.stop[0] == 0

    def claim(self, b: int) -> bool:
        """Claim batch ``b`` (a producer or the loop); whether this call got it."""
        return bool(native.claim(self.claims, b))

    def finish(self, b: int, status: int, error: BaseException | None = None) -> None:
        """Batch ``b`` is made (``DONE``) or failed (``FAILED``, with ``error``); tells the loop if a producer made it."""
        if error is not None:
            self.errors[b] = error
        self.status[b] = status

    def ready_index(self, t: int) -> int:
        """The semaphore producer ``t`` posts per batch made."""
        return self.memory.producers + t

    def post_ready(self, t: int) -> None:
        """Wake the loop if it sleeps for producer ``t``'s batch (a failure with no status: always posted)."""
        self.sems.post(self.ready_index(t))

    def made(self, t: int, b: int) -> None:
        """Producer ``t`` set batch ``b``'s status: wake the loop if it sleeps for ``b`` (``LOOP_WAITS`` read holding the
        GIL, as the loop's wait_ready() stores it: ordered after the status store)."""
        if self.ctl[LOOP_WAITS] == b:
            self.sems.post(self.ready_index(t))

    # ---- the loop's side -----------------------------------------------------------------------
    def try_ready(self, b: int) -> bool:
        """Whether batch ``b`` is made or failed (its status set), or its producer failed."""
        return bool(self.status[b] != PENDING or self.producer_errors[self.producer_of(b)] is not None)

    def wait_ready(self, b: int) -> None:
        """Wait for batch ``b`` (or for the end: :meth:`close` wakes this); every producer asleep is woken first."""
        t = self.producer_of(b)
        ctl = self.ctl
        while not self.try_ready(b) and self.end is None:
            native.exchange(ctl, LOOP_WAITS, b)  # (a full fence: the sleepers and the status are read after it)
            for p in range(self.producers):
                if ctl[SLEEPING(p)]:
                    ctl[SLEEPING(p)] = 0
                    self.sems.post(p)
            if not self.try_ready(b) and self.end is None:
                self.sems.wait(self.ready_index(t))
        ctl[LOOP_WAITS] = -1

    def give_token(self, c: int) -> None:
        """The loop took batch ``c``: free the slot of the batch ``CONSUMED = c + 1`` lets a producer make, store
        ``CONSUMED``, wake the producers asleep and due."""
        nxt = c + self.span
        if nxt < self.n_batches:
            self.free_slot(nxt)
        self.publish(c + 1)

    def publish(self, consumed: int) -> None:
        """``CONSUMED = consumed`` (after the slots it frees are checked), then wake the producers asleep and due."""
        ctl = self.ctl_view
        if _STRONG_ORDER:
            ctl[CONSUMED] = consumed
        else:  # pragma: no cover - x86-64 here
            native.store(self.ctl, CONSUMED, consumed)
        for t in range(self.producers):
            if ctl[SLEEPING(t)] and consumed >= ctl[WAKE_AT(t)]:
                ctl[SLEEPING(t)] = 0
                self.sems.post(t)

    # ---- the end -------------------------------------------------------------------------------
    def close(self) -> None:
        """End the epoch as closed (an epoch dropped without ``close()``, stopped by the next one, ``close()`` or exit)."""
        self.set_end(End("closed"))

    def set_end(self, end: End) -> End:
        """Record why the epoch ends (the first reason wins) and stop the producers; returns the reason recorded."""
        with self._end_lock:
            if self.end is None:
                self.end = end
            if self.stop[0] != 0:  # stopped already: its wake-ups were posted once (the semaphores may serve a later epoch now)
                return self.end
            self.stop[0] = 1
        for t in range(self.producers):
            self.sems.post(t)  # a producer waiting for a token sees the stop and returns
            self.sems.post(self.ready_index(t))  # a loop waiting for a batch wakes and sees the end
        return self.end


class PySemaphores:
    """:class:`~stoker.pipeline.native.Semaphores`' Python interface over ``threading.Semaphore`` (where POSIX
    semaphores are not available: only Python producers run there)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._sems = [threading.Semaphore(0) for _ in range(count)]

    def reset(self, initial: list[int]) -> None:
        self._sems = [threading.Semaphore(v) for v in initial]

    def address(self, k: int) -> int:  # pragma: no cover - compiled producers need native semaphores
        raise NotImplementedError("Python semaphores have no address")

    def wait(self, k: int) -> None:
        self._sems[k].acquire()

    def try_wait(self, k: int) -> bool:
        return self._sems[k].acquire(blocking=False)

    def post(self, k: int) -> None:
        self._sems[k].release()
