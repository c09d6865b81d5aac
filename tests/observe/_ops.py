"""Operations and stages that take a known time, for the accounting tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from stoker.pipeline import native
from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.operation import Operation
from stoker.pipeline.state import State


class Spin(Operation):
    """A compiled operation that spins ``ms`` milliseconds per batch (on the CPU: a slow compiled stage), then copies."""

    reentrant = True

    def __init__(self, ms: float) -> None:
        self.ns = int(ms * 1e6)

    def generate_code(self) -> Callable[..., Any]:
        ns = self.ns
        clock = native.monotonic_ns

        def spin(batch: Any, dst: Any) -> Any:
            t0 = clock()
            while clock() - t0 < ns:
                pass
            dst[:] = batch
            return dst

        return spin

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        return previous_state, AllocationQuery(previous_state.shape, previous_state.dtype)


def sleepy(seconds: float) -> Callable[[Any], Any]:
    """A Python stage that sleeps ``seconds`` per call (named ``sleepy``)."""

    def sleepy(batch: Any) -> Any:
        time.sleep(seconds)
        return batch

    return sleepy
