"""A simulated GPU for the transfer's tests: streams that run queued work in order, events, cross-stream waits.

The host queues work (:meth:`SimStream.run`) and waits; the GPU runs it only when
the test says so (:meth:`SimGPU.step`, :meth:`SimGPU.drain`), in any order
across streams that their waits allow. A wait on an event waits for the
record it saw when it was queued (CUDA's rule), so re-recorded events behave
as CUDA's do. ``synchronize`` runs the GPU until the event has completed (a
host wait). What the work reads and writes is the test's: a copy queued
before its host memory was safe to reuse sees a later batch there, a read
queued before its copy sees an earlier one.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class SimEvent:
    def __init__(self, gpu: SimGPU, name: str) -> None:
        self.gpu, self.name = gpu, name
        self.recorded = 0  # records queued
        self.reached = 0  # records the GPU has run

    def record(self, stream: SimStream) -> None:
        self.recorded += 1
        gen = self.recorded
        stream.queue.append(("record", self, gen))
        self.gpu.queued()

    def query(self) -> bool:
        return self.reached >= self.recorded

    def synchronize(self) -> None:
        self.gpu.host_syncs += 1
        if self.gpu.sync_seconds:
            time.sleep(self.gpu.sync_seconds)
        self.gpu.run_until(lambda: self.query())


class SimStream:
    def __init__(self, gpu: SimGPU, name: str) -> None:
        self.gpu, self.name = gpu, name
        self.device: Any = "sim"  # (a test may give its streams a torch.device)
        self.queue: deque[tuple[Any, ...]] = deque()
        gpu.streams.append(self)

    def run(self, fn: Callable[[], None], what: str = "") -> None:
        """Queue ``fn`` (the work: a copy, a kernel) on this stream."""
        self.queue.append(("fn", fn, what))
        self.gpu.queued()

    def wait_event(self, event: SimEvent) -> None:
        self.queue.append(("wait", event, event.recorded))
        self.gpu.queued()

    def wait_stream(self, other: SimStream) -> None:
        event = SimEvent(self.gpu, f"{other.name}@now")
        event.record(other)
        self.wait_event(event)

    def ready(self) -> bool:
        if not self.queue:
            return False
        head = self.queue[0]
        return head[0] != "wait" or head[1].reached >= head[2]

    def step(self) -> None:
        kind, a, b = self.queue.popleft()
        if kind == "record":
            a.reached = max(a.reached, b)
        elif kind == "fn":
            a()

    def __repr__(self) -> str:
        return f"SimStream({self.name})"


class SimGPU:
    """The streams and events of one simulated device, and the backend a :class:`StreamTransfer` takes.

    Args:
        eager: run all the work as soon as it is queued (a GPU that is never behind).
        sync_seconds: what a host wait costs (a GPU that is behind: the host sleeps this long).
    """

    def __init__(self, eager: bool = False, sync_seconds: float = 0.0) -> None:
        self.eager, self.sync_seconds = eager, sync_seconds
        self.streams: list[SimStream] = []
        self.events = 0
        self.host_syncs = 0
        self.user = SimStream(self, "user")
        self.current = self.user

    # ---- the GPU -----------------------------------------------------------------------------
    def queued(self) -> None:
        if self.eager:
            self.drain()

    def runnable(self) -> list[SimStream]:
        return [s for s in self.streams if s.ready()]

    def step(self, k: int) -> bool:
        """Run the head of the ``k``-th runnable stream (modulo their count); whether anything ran."""
        streams = self.runnable()
        if not streams:
            return False
        streams[k % len(streams)].step()
        return True

    def run_until(self, done: Callable[[], bool]) -> None:
        while not done():
            if not self.step(0):
                raise AssertionError("deadlock: the host waits for work that no stream can run")

    def drain(self) -> None:
        self.run_until(lambda: not any(s.queue for s in self.streams))

    # ---- the backend (stoker.device._stream.CudaBackend's interface) ------------------------------
    def new_stream(self) -> SimStream:
        return SimStream(self, "transfer")

    def new_event(self) -> SimEvent:
        self.events += 1
        return SimEvent(self, f"e{self.events}")

    def current_stream(self) -> SimStream:
        return self.current

    @contextmanager
    def stream_context(self, stream: SimStream) -> Iterator[None]:
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def record_stream(self, outputs: Any, stream: SimStream) -> None:
        """(Slot memory is fixed here: nothing for the allocator to order.)"""
