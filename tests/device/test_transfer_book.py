"""The transfer's bookkeeping (``SlotBook``) against a reference model, and the transfer on a simulated GPU.

1. ``SlotBook`` alone: random sequences of calls, legal or not, and of GPU
   progress; the model says which calls are legal, what each returns, which
   slots have a copy in flight and when the host must wait.
2. ``StreamTransfer`` over a simulated GPU (``tests/device/_gpu_sim.py``),
   driven as the Loader drives it (a slot given back as a batch is handed over,
   the producer writing its host memory at once, copies issued ahead or at
   hand-over, the consumer's work queued on its stream), with the GPU running
   the streams' work in random orders: a copy must read the batch its host
   memory was written with, the consumer must read the batch its copy wrote.
   Page-locked memory reused before its copy ran, or a copy into memory the
   consumer had not finished reading, shows as a wrong batch.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.device._book import COPYING, FREE, HANDED, ISSUED, REUSED, SlotBook, TransferProtocolError
from stoker.device._stream import StreamTransfer, issuing
from tests.device._gpu_sim import SimGPU, SimStream

# ---- 1. the book against a model --------------------------------------------------------------


class Ev:
    """An event the test completes (``done``); ``synchronize`` completes it (a host wait)."""

    def __init__(self, name: int) -> None:
        self.name, self.done, self.syncs = name, False, 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.syncs += 1
        self.done = True


#: the states from which each call is legal
LEGAL = {"reuse": (HANDED, ISSUED, REUSED, FREE), "release": (REUSED, FREE), "begin": (FREE,), "end": (COPYING,), "hand_over": (ISSUED,)}


class Model:
    """What the book must do."""

    def __init__(self, n: int) -> None:
        self.state = [REUSED] * n
        self.copy: list[Ev | None] = [None] * n
        self.marks: list[Any] = [None] * n
        self.waits = 0


OPS = ["reuse", "release", "begin", "end", "hand_over", "gpu"]


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 4), ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 4), st.booleans()), max_size=80))
def test_the_book_follows_the_model(n: int, ops: list[tuple[str, int, bool]]) -> None:
    ticks = iter(range(0, 10**9, 7))
    book, model = SlotBook(n, clock=lambda: next(ticks)), Model(n)
    pending: list[Ev] = []  # events recorded, in order; the GPU completes them in order
    for k, (op, slot, flag) in enumerate(ops):
        if op == "gpu":  # the GPU passes the oldest copies
            for ev in pending[: slot + 1]:
                ev.done = True
            continue
        if slot >= n or model.state[slot] not in LEGAL[op]:
            before = list(book.state)
            with pytest.raises(TransferProtocolError):
                getattr(book, op)(*((slot,) if op in ("reuse", "begin", "hand_over") else (slot, None)))
            assert book.state == before, "a refused call changes nothing"
            continue
        if op == "reuse":
            ev = model.copy[slot]
            must_wait = ev is not None and not ev.done
            waited = book.reuse(slot)
            assert (waited > 0) == must_wait and (ev is None or ev.done), "the host waits exactly when the copy still runs"
            model.waits += must_wait
            model.copy[slot], model.state[slot] = None, REUSED
        elif op == "release":
            marks = [f"mark{k}"] if flag else None
            book.release(slot, marks)
            model.marks[slot], model.state[slot] = marks, FREE
        elif op == "begin":
            assert book.begin(slot) == (model.marks[slot] or []), "the copy waits for the marks of the last release, once"
            model.marks[slot], model.state[slot] = None, COPYING
        elif op == "end":
            ev = Ev(k)
            pending.append(ev)
            book.end(slot, ev)
            model.copy[slot], model.state[slot] = ev, ISSUED
        else:
            assert book.hand_over(slot) is model.copy[slot]
            model.state[slot] = HANDED
        assert book.state == model.state
        assert book.in_flight() == [s for s in range(n) if model.copy[s] is not None and not model.copy[s].done]  # type: ignore[union-attr]
        assert all(book.may_reuse(s) == (model.copy[s] is None or model.copy[s].done) for s in range(n))  # type: ignore[union-attr]
        assert book.host_waits == model.waits and book.waited_ns == 7 * model.waits


# ---- 2. the transfer on a simulated GPU ----------------------------------------------------------


class Run:
    """Drives a :class:`StreamTransfer` as the Loader does, batch ``b`` in slot ``b % slots``."""

    def __init__(self, slots: int, lead: int, ahead: bool, n: int, gpu: SimGPU) -> None:
        self.slots, self.lead, self.n, self.gpu = slots, lead, n, gpu
        self.t = StreamTransfer("sim", slots, ahead=ahead, backend=gpu)
        self.host: list[int | None] = [None] * slots  # page-locked memory: the batch the producer wrote
        self.dev: list[int | None] = [None] * slots  # device memory: the batch the last copy wrote
        self.issued = 0  # batches whose copies are queued
        self.read: list[int] = []  # batches the consumer's work read, in the order the GPU ran it
        self.copied: list[int] = []

    def give_back(self, b: int) -> None:
        """Batch ``b``'s slot goes to the producer, which writes it at once (as the ring's free_slot, then a producer)."""
        s = b % self.slots
        self.t.reuse(s)
        self.host[s] = b
        self.t.release(s)

    def issue(self) -> None:
        b, s = self.issued, self.issued % self.slots
        self.issued += 1

        def copy() -> None:
            assert self.host[s] == b, f"the copy of batch {b} read batch {self.host[s]}: its page-locked memory was reused first"
            self.dev[s] = b
            self.copied.append(b)

        with issuing(self.t, s, []):
            self.gpu.current_stream().run(copy, f"copy {b}")

    def consume(self, c: int, work: int) -> None:
        s = c % self.slots
        self.t.hand_over(s)

        def step() -> None:
            assert self.dev[s] == c, f"the step of batch {c} read batch {self.dev[s]} (copied: {self.copied})"
            self.read.append(c)

        for _ in range(work):
            self.gpu.current_stream().run(step, f"step {c}")


@settings(max_examples=120, deadline=None)
@given(
    slots=st.integers(2, 6),
    lead=st.integers(1, 5),
    ahead=st.booleans(),
    n=st.integers(0, 25),
    user_stream=st.booleans(),
    data=st.data(),
)
def test_on_a_simulated_gpu_every_copy_and_every_read_sees_its_own_batch(
    slots: int, lead: int, ahead: bool, n: int, user_stream: bool, data: st.DataObject
) -> None:
    lead = min(lead, slots - 1)
    gpu = SimGPU()
    if user_stream:  # the loop runs on a stream of its own, not the one current when the transfer was made
        gpu.current = SimStream(gpu, "training")
    run = Run(slots, lead, ahead, n, gpu)

    def gpu_runs() -> None:
        for k in data.draw(st.lists(st.integers(0, 3), max_size=6)):
            gpu.step(k)

    for b in range(min(lead, n)):
        run.give_back(b)
    for c in range(n):
        if ahead:  # copies issued as soon as the producer made the batch: any time after it was given back
            upto = data.draw(st.integers(run.issued, min(n, c + lead)))
            while run.issued < upto:
                run.issue()
                gpu_runs()
        while run.issued <= c:  # at the latest when the loop takes it
            run.issue()
        run.consume(c, data.draw(st.integers(1, 3)))
        gpu_runs()
        if c + lead < n:
            run.give_back(c + lead)
        gpu_runs()
    gpu.drain()
    assert sorted(set(run.read)) == list(range(n)) and run.copied == list(range(n))


def _stream_alone(gpu: SimGPU, stream: SimStream) -> None:
    """Run ``stream``'s work as far as it can go without any other stream running."""
    while stream.ready():
        stream.step()


@pytest.mark.parametrize("ahead", [True, False])
def test_a_copy_ahead_does_not_wait_for_the_step_queued_after_its_slot_was_given_back(ahead: bool) -> None:
    """The loop gives slot 0 back, then queues its next step (long work on its stream); batch 2's copy into slot 0
    is queued after that. Ahead, the copy waits only for what the stream had queued when the slot was given back;
    the earlier behaviour waits for the step too (the copy behind the user's step)."""
    gpu = SimGPU()
    run = Run(slots=2, lead=1, ahead=ahead, n=3, gpu=gpu)
    run.give_back(0)
    run.issue()
    run.consume(0, 1)
    run.give_back(1)  # (slot 1)
    run.issue()
    gpu.drain()
    run.consume(1, 1)
    gpu.drain()  # the GPU has run everything so far
    run.give_back(2)  # slot 0: marks recorded now...
    _stream_alone(gpu, gpu.user)  # ...and passed (all the work before them is done)
    gpu.user.run(lambda: None, "the next step: queued after the slot was given back")
    run.issue()  # batch 2's copy
    _stream_alone(gpu, run.t.stream)
    assert (2 in run.copied) is ahead
    assert gpu.host_syncs == 0


def test_the_host_waits_for_the_gpu_only_when_a_slot_comes_round_before_its_copy_ran() -> None:
    gpu = SimGPU()
    run = Run(slots=3, lead=2, ahead=True, n=9, gpu=gpu)
    for b in range(2):
        run.give_back(b)
    for c in range(9):  # the GPU keeps up: it has run everything before each slot comes round
        while run.issued <= min(8, c + 1):
            run.issue()
        run.consume(c, 2)
        gpu.drain()
        if c + 2 < 9:
            run.give_back(c + 2)
    assert gpu.host_syncs == 0 and run.t.host_waits == 0
    gpu2 = SimGPU()
    late = Run(slots=3, lead=2, ahead=True, n=4, gpu=gpu2)
    late.give_back(0)
    late.give_back(1)
    late.issue()
    late.issue()
    late.consume(0, 1)
    late.give_back(2)
    late.issue()
    late.consume(1, 1)
    late.give_back(3)  # slot 0 again: batch 0's copy never ran (the GPU is behind): the host waits for it
    assert late.t.host_waits == 1 and gpu2.host_syncs == 1 and 0 in late.copied
