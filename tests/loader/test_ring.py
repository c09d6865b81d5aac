"""The batch-slot ring's protocol (``stoker.loader._ring``) against a reference model, with Python producers.

Producers follow the protocol exactly as the compiled ones do (wait until the loop's
count of batches taken lets them make the next one, sleeping on their semaphore, claim,
make into the batch's slot, status, a wake for the loop if it sleeps for that batch); the consumer takes batches in
order, holds up to ``k`` of them, may make a batch itself, and the epoch may end
early (``set_end`` from another thread, a failed batch, an interrupt). The model:
batch ``b`` holds ``b``; a held batch is never overwritten; each batch is made
once; every end reaches the consumer and no producer is left waiting.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.loader._ring import DONE, FAILED, End, RingMemory, SlotRing


class _Field:
    """A pipeline's slot memory as the ring sees it: an owner array per slot, in use while referenced elsewhere."""

    def __init__(self, num_slots: int, width: int = 4) -> None:
        self.width = width
        self.memory_generation = 0
        self._views = [np.zeros(width, dtype=np.int64) for _ in range(num_slots)]
        self._baseline = [self._count(s) for s in range(num_slots)]
        self.renewed = 0

    def _count(self, slot: int) -> int:
        import sys

        return sys.getrefcount(self._views[slot])

    def slot_in_use(self, slot: int) -> bool:
        return self._count(slot) != self._baseline[slot]

    def renew_slot(self, slot: int) -> None:
        self._views[slot] = np.zeros(self.width, dtype=np.int64)
        self._baseline[slot] = self._count(slot)
        self.memory_generation += 1
        self.renewed += 1


def _producer(ring: SlotRing, field: _Field, t: int, fail_at: int | None) -> None:
    for b in range(ring.skip + t, ring.n_batches, ring.producers):
        if not ring.take_token(t, b):
            return
        if not ring.claim(b):
            continue
        _make(ring, field, b, fail_at)
        ring.made(t, b)
        if ring.status[b] != DONE:
            return


def _make(ring: SlotRing, field: _Field, b: int, fail_at: int | None) -> None:
    if b == fail_at:
        ring.finish(b, FAILED, ValueError(f"batch {b}"))
        return
    field._views[ring.slot(b)][:] = b
    ring.finish(b, DONE)


@settings(max_examples=60, deadline=None)
@given(
    n_batches=st.integers(0, 40),
    producers=st.integers(1, 3),
    ahead=st.integers(1, 4),
    holds=st.integers(0, 5),
    extra=st.integers(0, 3),
    skip=st.integers(0, 5),
    make_here=st.booleans(),
    end_at=st.one_of(st.none(), st.integers(0, 40)),
    end_kind=st.sampled_from(["closed", "failed", "interrupted"]),
    data=st.data(),
)
def test_the_ring_hands_every_batch_once_in_order_and_every_end_reaches_the_loop(
    n_batches: int, producers: int, ahead: int, holds: int, extra: int, skip: int, make_here: bool, end_at: int | None,
    end_kind: str, data: st.DataObject,
) -> None:  # fmt: skip
    skip = min(skip, n_batches)
    num_slots = producers * ahead + 2 + holds + extra
    field = _Field(num_slots)
    held_count = [0]
    memory = RingMemory(num_slots, 0, producers)
    ring = SlotRing(memory, [field], None, n_batches, skip, 0, producers, ahead, held_count)  # type: ignore[list-item]
    fail_at = end_at if end_kind == "failed" else None
    threads = [threading.Thread(target=_producer, args=(ring, field, t, fail_at)) for t in range(producers)]
    for thread in threads:
        thread.start()
    kept: list[np.ndarray] = []  # the consumer holds its last `holds` batches (as prefetch would)
    seen: list[int] = []
    ended: End | None = None
    try:
        for c in range(skip, n_batches):
            if end_kind == "closed" and c == end_at:  # another thread ends the epoch while the loop is at c
                closer = threading.Thread(target=ring.set_end, args=(End("closed", by_other_thread=True),))
                closer.start()
                closer.join()
            if make_here and data.draw(st.booleans()) and ring.claim(c):
                _make(ring, field, c, fail_at)
            elif not ring.try_ready(c):
                ring.wait_ready(c)
            if ring.end is not None:
                ended = ring.end
                break
            if ring.status[c] != DONE:
                ended = ring.set_end(End("failed", ring.errors[c]))
                break
            batch = field._views[ring.slot(c)]
            ring.give_token(c)
            assert (batch == c).all(), f"batch {c} holds {batch[0]}: a slot was written while the loop held it"
            for i in range(len(kept)):  # (no loop variable left holding a batch: the consumer holds what `kept` holds)
                assert (kept[i] == seen[i - len(kept)]).all(), f"a held batch ({seen[i - len(kept)]}) was overwritten"
            seen.append(c)
            kept.append(batch)
            if len(kept) > holds + 1:
                kept.pop(0)
            if end_kind == "interrupted" and c == end_at:
                ended = ring.set_end(End("interrupted"))
                break
        else:
            ended = ring.set_end(End("exhausted"))
    finally:
        ring.set_end(End("closed"))
        for thread in threads:
            thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a producer was left waiting"
    expected_end = end_at if end_at is not None and skip <= end_at < n_batches else None
    if expected_end is None:
        assert ended == End("exhausted") and seen == list(range(skip, n_batches))
    else:
        last = expected_end + 1 if end_kind == "interrupted" else expected_end
        assert seen == list(range(skip, last))
        assert ended is not None and ended.kind == end_kind
        if end_kind == "failed":
            assert isinstance(ended.error, ValueError) and str(ended.error) == f"batch {expected_end}"
    # each batch made at most once, and every batch handed over was claimed
    assert all(ring.claims[b] == 1 for b in seen)
    # the slots were big enough for what the consumer held: never renewed
    assert field.renewed == 0 and held_count[0] == 0


def test_a_kept_batch_gets_its_slot_renewed_and_counted_once() -> None:
    num_slots, producers, ahead = 5, 1, 2
    field = _Field(num_slots)
    held = [0]
    ring = SlotRing(RingMemory(num_slots, 0, producers), [field], None, 20, 0, 0, producers, ahead, held)  # type: ignore[list-item]
    thread = threading.Thread(target=_producer, args=(ring, field, 0, None))
    thread.start()
    kept = []
    try:
        for c in range(20):
            if not ring.try_ready(c):
                ring.wait_ready(c)
            batch = field._views[ring.slot(c)]
            ring.give_token(c)
            assert (batch == c).all()
            if c < 3:
                kept.append(batch)  # kept for good: their slots come round again
    finally:
        ring.set_end(End("closed"))
        thread.join(timeout=60)
    assert [int(k[0]) for k in kept] == [0, 1, 2]
    assert held[0] == 3 and field.renewed == 3


def test_the_previous_epochs_loop_variables_are_renewed_but_not_counted() -> None:
    field = _Field(6)
    held = [0]
    kept = field._views[0]  # what `for x in loader: ... break` leaves in x
    ring = SlotRing(RingMemory(6, 0, 1), [field], None, 10, 0, 0, 1, 3, held, forgiven=frozenset({0}))  # type: ignore[list-item]
    assert field.renewed == 1 and held[0] == 0 and kept is not field._views[0]
    ring.set_end(End("closed"))


@pytest.mark.parametrize("producers", [1, 2])
def test_set_end_wakes_a_loop_waiting_for_a_batch_no_producer_makes(producers: int) -> None:
    field = _Field(8)
    ring = SlotRing(RingMemory(8, 0, producers), [field], None, 10, 0, 0, producers, 2, [0])  # type: ignore[list-item]
    woke = threading.Event()

    def loop() -> None:
        ring.wait_ready(0)  # batch 0 will never be made: only the end wakes it
        woke.set()

    waiter = threading.Thread(target=loop)
    waiter.start()
    ring.set_end(End("closed", by_other_thread=True))
    waiter.join(timeout=60)
    assert woke.is_set() and ring.end == End("closed", by_other_thread=True)
    assert ring.set_end(End("exhausted")).kind == "closed"  # the first reason wins
