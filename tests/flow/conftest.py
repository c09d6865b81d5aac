"""Fixtures of the flow tests: no thread may outlive a test."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest


def flow_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("stoker-flow")]


def wait_no_flow_threads(timeout: float = 10.0) -> list[threading.Thread]:
    """The flow threads still alive after waiting up to ``timeout`` (a bound on a hang, not a speed check)."""
    deadline = time.monotonic() + timeout
    while flow_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return flow_threads()


@pytest.fixture(autouse=True)
def no_thread_left() -> Iterator[None]:
    assert flow_threads() == [], "a flow thread from an earlier test is alive"
    before = set(threading.enumerate())
    yield
    assert flow_threads() == [], f"flow threads left running: {flow_threads()}"
    extra = [t for t in set(threading.enumerate()) - before if t.is_alive()]
    assert extra == [], f"threads left running: {extra}"
