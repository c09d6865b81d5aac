"""Compiles nothing waits for take only the CPU time training leaves (``stoker.pipeline._fork.lower_priority``).

A loader's producer loop compiles in a child process while Python producers make the batches; where those batches are
heavy (photo crops) the producers are about as fast as the loop would be, and the child is set to the lowest
priority, its session's share too (Linux's autogroups: a child in a session of its own otherwise gets as much CPU as
the training process's whole session); light batches (tables) keep it at normal priority, since the loop is what
makes them fast.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from stoker.pipeline import _fork, warm

pytestmark = pytest.mark.skipif(not hasattr(os, "getpriority"), reason="no process priorities on this platform")


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    """A process in a session of its own (as a compile child is), running until its standard input is closed."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, start_new_session=True)
    try:
        yield proc
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(60)


def _autogroup_nice(pid: int) -> int | None:
    group = Path(f"/proc/{pid}/autogroup")
    return int(group.read_text().split()[-1]) if group.exists() else None


def test_lower_priority_sets_the_process_and_its_session_and_never_raises_them(child: subprocess.Popen[bytes]) -> None:
    before = os.getpriority(os.PRIO_PROCESS, child.pid)
    _fork.lower_priority(_fork.BACKGROUND_NICE, child.pid)
    assert os.getpriority(os.PRIO_PROCESS, child.pid) == max(before, 19)
    assert _autogroup_nice(child.pid) in (None, 19)
    _fork.lower_priority(5, child.pid)  # (a higher priority is never asked for)
    assert os.getpriority(os.PRIO_PROCESS, child.pid) == max(before, 19)


def test_a_compile_behind_heavy_batches_gets_the_lowest_priority_and_behind_light_ones_keeps_its_own(
    child: subprocess.Popen[bytes],
) -> None:
    before = os.getpriority(os.PRIO_PROCESS, child.pid)
    group = _autogroup_nice(child.pid)
    compiling = warm.Background(object(), (), "a test's loop")  # (never started: the child stands for its process)
    compiling.pid = child.pid
    compiling.batches_take(warm.LOW_PRIORITY_FROM_S / 2)  # light batches: the loop is worth its CPU now
    assert os.getpriority(os.PRIO_PROCESS, child.pid) == before and _autogroup_nice(child.pid) == group
    compiling.batches_take(warm.LOW_PRIORITY_FROM_S * 2)  # heavy ones: the Python producers are about as fast
    assert os.getpriority(os.PRIO_PROCESS, child.pid) == max(before, 19)
    assert _autogroup_nice(child.pid) in (None, 19)


def test_a_compile_that_has_ended_is_left_alone(child: subprocess.Popen[bytes]) -> None:
    before = os.getpriority(os.PRIO_PROCESS, child.pid)
    compiling = warm.Background(object(), (), "a test's loop")
    compiling.pid = child.pid
    compiling._done.set()  # (reaped: its pid may be another process's by now)
    compiling.batches_take(1.0)
    assert os.getpriority(os.PRIO_PROCESS, child.pid) == before
