"""The loader's ``CudaSync`` protocol, with fake streams and events (no GPU): who waits for whom, and when.

The GPU tests (tests/gpu/test_prefetch_cuda.py) check the effect; these check
the order of the calls, which a GPU test can only catch when a race happens.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from stoker.loader.device import CudaSync

calls: list[tuple[Any, ...]] = []


class FakeEvent:
    count = 0

    def __init__(self) -> None:
        FakeEvent.count += 1
        self.name = f"event{FakeEvent.count}"
        self.stream: FakeStream | None = None

    def record(self, stream: FakeStream) -> None:
        self.stream = stream
        calls.append(("record", self.name, stream.name))

    def synchronize(self) -> None:
        calls.append(("host waits", self.name))


class FakeStream:
    def __init__(self, name: str = "loader", device: Any = None) -> None:
        self.name = name
        self.device = device

    def wait_stream(self, other: FakeStream) -> None:
        calls.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: FakeEvent) -> None:
        calls.append(("wait_event", self.name, event.name))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeStream) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)


STREAMS = {"current": FakeStream("user"), "default": FakeStream("default")}


@contextmanager
def fake_stream_context(stream: FakeStream) -> Iterator[None]:
    calls.append(("enter", stream.name))
    yield
    calls.append(("exit", stream.name))


@pytest.fixture
def sync(monkeypatch: pytest.MonkeyPatch) -> CudaSync:
    calls.clear()
    STREAMS["current"] = FakeStream("user")
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream("loader", device))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: STREAMS["current"])
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: STREAMS["default"])
    monkeypatch.setattr(torch.cuda, "stream", fake_stream_context)
    return CudaSync("cuda:0", num_slots=3)


def _batch(sync: CudaSync, slot: int, fields: int = 2) -> FakeEvent:
    """What a producer does for one batch (after its reference check)."""
    sync.before_slot(slot)
    for _ in range(fields):
        with sync.stream_context():
            calls.append(("copy", slot))
    event: FakeEvent = sync.after_batch(slot)
    return event


def test_the_loader_stream_waits_once_per_batch_before_its_copies(sync: CudaSync) -> None:
    _batch(sync, 0)
    assert calls == [
        ("enter", "loader"),
        ("wait_stream", "loader", "user"),  # the stream current when the slots were allocated
        ("wait_stream", "loader", "default"),  # where producers allocate fresh memory for kept batches
        ("copy", 0),
        ("exit", "loader"),
        ("enter", "loader"),  # the second field: no second wait
        ("copy", 0),
        ("exit", "loader"),
        ("record", "event1", "loader"),
    ]


def test_the_consumer_waits_for_the_event_and_is_waited_for(sync: CudaSync) -> None:
    event = _batch(sync, 0)
    STREAMS["current"] = FakeStream("training")  # the user's loop runs on a stream of its own
    sync.hand_over(event)
    assert calls[-1] == ("wait_event", "training", event.name)
    sync.release(0)
    calls.clear()
    _batch(sync, 1)
    waits = [entry for entry in calls if entry[0] == "wait_stream"]
    assert ("wait_stream", "loader", "training") in waits, "the stream batches were handed to is waited for"
    assert calls.index(("wait_stream", "loader", "training")) < calls.index(("copy", 1)), "before the copy"


def test_a_slot_is_rewritten_only_after_its_last_copy(sync: CudaSync) -> None:
    first = _batch(sync, 0)
    _batch(sync, 1)
    calls.clear()
    sync.before_slot(0)
    assert calls == [("host waits", first.name)], "the host waits for the copy out of the slot's pinned memory"
    sync.before_slot(2)
    assert calls == [("host waits", first.name)], "a slot never used: nothing to wait for"


def test_the_waits_come_after_before_slot_not_in_it(sync: CudaSync) -> None:
    """``before_slot`` may run before the reference check: the stream waits must come later, when the fields run.

    A batch the user drops after ``before_slot`` but before the check may have
    work queued on it: a wait issued in ``before_slot`` would not cover that work.
    """
    sync.before_slot(0)
    assert not any(entry[0] == "wait_stream" for entry in calls)
    with sync.stream_context():
        pass
    assert any(entry[0] == "wait_stream" for entry in calls)


def test_each_producer_thread_waits_for_its_own_batch(sync: CudaSync) -> None:
    sync.before_slot(0)  # this thread's batch
    seen: list[list[tuple[Any, ...]]] = []

    def other_producer() -> None:
        start = len(calls)
        with sync.stream_context():  # its before_slot has not run: no wait
            pass
        seen.append(calls[start:])

    thread = threading.Thread(target=other_producer)
    thread.start()
    thread.join()
    assert seen == [[("enter", "loader"), ("exit", "loader")]]
    with sync.stream_context():
        pass
    assert ("wait_stream", "loader", "user") in calls
