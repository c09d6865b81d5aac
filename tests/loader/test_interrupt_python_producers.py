"""Ctrl-C while the loop's own thread makes a batch with Python calls (a fresh process's first epoch, before the
producer loop is compiled): a signal that arrives during a compiled call comes back from Numba as a ``SystemError``
caused by the ``KeyboardInterrupt``; it must leave ``next()`` as the ``KeyboardInterrupt``, not as a failed batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stoker.errors import LoaderError
from stoker.loader import Loader, OrderOption
from stoker.loader._graph import FieldPipeline


def _interrupt_at(calls: int, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``FieldPipeline.run_head`` raises as a compiled call interrupted by SIGINT does, at its ``calls``-th call."""
    real = FieldPipeline.run_head
    seen = [0]

    def run_head(self: FieldPipeline, *args: Any, **kwargs: Any) -> Any:
        seen[0] += 1
        if seen[0] == calls:
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt as interrupt:
                raise SystemError("CPUDispatcher(<function f>) returned a result with an exception set") from interrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FieldPipeline, "run_head", run_head)
    return seen


@pytest.mark.parametrize("calls", [1, 2, 7])
def test_ctrl_c_in_a_compiled_call_of_the_loops_own_batch_leaves_next_as_itself(
    table_path: Path, monkeypatch: pytest.MonkeyPatch, calls: int
) -> None:
    monkeypatch.setenv("STOKER_COMPILED_EPOCH", "0")  # (Python producers, as while the loop compiles)
    with Loader(table_path, batch_size=50, num_workers=1, order=OrderOption.RANDOM, seed=3) as loader:
        expected = [y.numpy().copy() for _, y in loader]
        loader._tuner.force = lambda epoch, limits: (0, 1)  # no producer: the loop's thread makes every batch
        seen = _interrupt_at(calls, monkeypatch)
        got = []
        with pytest.raises(KeyboardInterrupt):
            for _, y in loader:
                got.append(y.numpy().copy())
        assert seen[0] == calls and len(got) == (calls - 1) // 2  # (two fields: two heads a batch)
        monkeypatch.undo()
        monkeypatch.setenv("STOKER_COMPILED_EPOCH", "0")
        after = [y.numpy().copy() for _, y in loader]  # the loader goes on: the next epoch is whole
    assert len(after) == len(expected)


def test_another_system_error_is_the_batchs_failure(table_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """(The other side: a ``SystemError`` not caused by an interrupt names the field, as any operation's error.)"""
    monkeypatch.setenv("STOKER_COMPILED_EPOCH", "0")
    real = FieldPipeline.run_head

    def run_head(self: FieldPipeline, *args: Any, **kwargs: Any) -> Any:
        if self.name == "y":
            raise SystemError("broken")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FieldPipeline, "run_head", run_head)
    with Loader(table_path, batch_size=50, num_workers=1, order=OrderOption.RANDOM, seed=3) as loader:
        loader._tuner.force = lambda epoch, limits: (0, 1)
        with pytest.raises(LoaderError, match="'y'"):
            for _ in loader:
                pass
