"""``StreamTransfer``'s protocol with a fake CUDA backend (no GPU): who waits for whom, and when.

The GPU tests (tests/gpu/) check the effect; these check the order of the calls,
which a GPU test can only catch when a race happens.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from stoker.device._book import TransferProtocolError
from stoker.device._stream import StreamTransfer, issuing


class FakeEvent:
    def __init__(self, log: list[tuple[Any, ...]], name: str) -> None:
        self.log, self.name = log, name
        self.done = True  # (an event never recorded has completed, as CUDA's)

    def record(self, stream: FakeStream) -> None:
        self.done = False
        self.log.append(("record", self.name, stream.name))

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.log.append(("host waits", self.name))
        self.done = True


class FakeStream:
    def __init__(self, log: list[tuple[Any, ...]], name: str) -> None:
        self.log, self.name, self.device = log, name, "cuda:0"

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait_event", self.name, event.name))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeStream) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)


class FakeBackend:
    """The calls :class:`StreamTransfer` makes, logged; ``current`` is the consumer's current stream."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.current = FakeStream(self.log, "user")
        self.events = 0

    def new_stream(self) -> FakeStream:
        return FakeStream(self.log, "transfer")

    def new_event(self) -> FakeEvent:
        self.events += 1
        return FakeEvent(self.log, f"e{self.events}")

    def current_stream(self) -> FakeStream:
        return self.current

    @contextmanager
    def stream_context(self, stream: FakeStream) -> Iterator[None]:
        self.log.append(("enter", stream.name))
        yield
        self.log.append(("exit", stream.name))

    def record_stream(self, outputs: Any, stream: FakeStream) -> None:
        for value in outputs:
            self.log.append(("record_stream", value, stream.name))


def _transfer(ahead: bool = True, slots: int = 3) -> tuple[StreamTransfer, FakeBackend]:
    backend = FakeBackend()
    return StreamTransfer("cuda:0", slots, ahead=ahead, backend=backend), backend


def _copy(t: StreamTransfer, backend: FakeBackend, slot: int, fields: int = 2) -> None:
    outputs: list[Any] = []
    with issuing(t, slot, outputs):
        for f in range(fields):
            backend.log.append(("copy", slot, f))
            outputs.append(f"x{slot}.{f}")


def _slot_event(t: StreamTransfer, slot: int) -> str:
    return str(t._events[slot].name)


def test_ahead_the_copy_waits_for_the_marks_of_the_slots_last_use_not_for_the_consumer_now() -> None:
    t, b = _transfer()
    t.free(0)
    b.log.clear()
    _copy(t, b, 0)
    mark = t._marks[0][b.current].name
    assert b.log == [
        ("wait_event", "transfer", mark),  # recorded on the user's stream when the slot was given back: once per batch
        ("enter", "transfer"),
        ("copy", 0, 0),
        ("copy", 0, 1),
        ("exit", "transfer"),
        ("record", _slot_event(t, 0), "transfer"),
        ("record_stream", "x0.0", "transfer"),
        ("record_stream", "x0.1", "transfer"),
    ]
    assert not any(entry[0] == "wait_stream" for entry in b.log), "never behind whatever the consumer queued since"


def test_the_marks_are_recorded_on_every_stream_the_batches_were_handed_to_when_the_slot_is_released() -> None:
    t, b = _transfer()
    t.free(0)
    _copy(t, b, 0)
    b.current = FakeStream(b.log, "training")  # the loop runs on a stream of its own
    t.hand_over(0, ["x0.0"])
    assert b.log[-2:] == [("wait_event", "training", _slot_event(t, 0)), ("record_stream", "x0.0", "training")]
    b.log.clear()
    t.reuse(0)  # (its copy has not completed in the fake: the host waits, once)
    assert b.log == [("host waits", _slot_event(t, 0))]
    b.log.clear()
    t.release(0)
    recorded = sorted(entry[2] for entry in b.log if entry[0] == "record")
    assert recorded == ["training", "user"], "the stream current when the slots were allocated, and the one used"
    b.log.clear()
    _copy(t, b, 0)
    waits = [entry[2] for entry in b.log if entry[0] == "wait_event"]
    assert waits == [t._marks[0][FakeStream(b.log, "user")].name, t._marks[0][b.current].name]
    assert b.log.index(("wait_event", "transfer", waits[-1])) < b.log.index(("copy", 0, 0)), "before the copy"


def test_without_ahead_the_copy_waits_for_the_consumer_streams_as_queued_now() -> None:
    t, b = _transfer(ahead=False)
    t.free(1)
    assert not any(entry[0] == "record" for entry in b.log), "no marks: the streams themselves are waited for"
    b.log.clear()
    _copy(t, b, 1, fields=1)
    assert b.log[:2] == [("wait_stream", "transfer", "user"), ("enter", "transfer")]


def test_the_host_waits_only_for_a_copy_still_running_and_counts_it() -> None:
    t, b = _transfer()
    for slot in range(3):
        t.free(slot)
        _copy(t, b, slot)
        t.hand_over(slot)
    t._events[0].done = True  # the GPU passed the first copy, not the second
    b.log.clear()
    assert t.reuse(0) == 0 and t.host_waits == 0 and b.log == []
    t.reuse(1)
    assert t.host_waits == 1 and b.log == [("host waits", _slot_event(t, 1))]
    assert t.book.in_flight() == [2]


def test_a_copy_that_raises_still_records_its_event_and_the_slot_can_be_reused() -> None:
    t, b = _transfer()
    t.free(2)
    with pytest.raises(ValueError, match="boom"), issuing(t, 2, []):
        raise ValueError("boom")
    assert ("record", _slot_event(t, 2), "transfer") in b.log
    t.free(2)  # the next epoch gives the slot back: allowed (the copy it waits for is the one that raised)
    _copy(t, b, 2)


@pytest.mark.parametrize(
    "steps",
    [["begin"], ["free", "free", "end"], ["free", "begin", "begin"], ["free", "hand_over"], ["free", "begin", "free"]],
    ids=lambda s: "-".join(s),
)
def test_out_of_order_calls_are_refused(steps: list[str]) -> None:
    t, _ = _transfer()
    calls = {"free": lambda: t.free(0), "begin": lambda: t.begin(0), "end": lambda: t.end(0), "hand_over": lambda: t.hand_over(0)}
    with pytest.raises(TransferProtocolError):
        for step in steps:
            calls[step]()
