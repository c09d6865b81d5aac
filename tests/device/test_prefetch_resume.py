"""``prefetch`` and resuming: the state counts the batches the loop received, not those read ahead; held batches are declared.

The CPU path runs the same look-ahead as CUDA, so these catch on any machine what
a CUDA run would do: ``loader.state_dict()`` taken under a prefetch records batches the
loop never saw, and a resume from it skips them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from stoker.device import Prefetcher, PrefetchIterator, prefetch
from stoker.errors import StokerError
from stoker.loader import Loader, OrderOption

from ..loader.conftest import table_path

__all__ = ["table_path"]

KWARGS: dict[str, Any] = {"batch_size": 64, "order": OrderOption.RANDOM, "seed": 5, "num_workers": 1}
EPOCH = 16  # batches per epoch: 1000 rows of 64
DEPTH = 3


Batch = list[int]  # a batch's y, as plain ints (cheap to compare, and to print when a test fails)


def ys(batch: Any) -> Batch:
    return [int(v) for v in batch[1].reshape(-1)]


@pytest.fixture(scope="module")
def reference(table_path: Path) -> list[Batch]:
    """The ``y`` of every batch of three epochs, in order, without prefetch."""
    loader = Loader(table_path, **KWARGS)
    out = [ys(b) for _ in range(3) for b in loader]
    loader.close()
    assert len(out) == 3 * EPOCH
    return out


def take(wrapped: Prefetcher, k: int) -> tuple[list[Batch], Iterator[Any]]:
    """The first ``k`` batches' ``y`` through ``wrapped``, a new pass at each epoch's end; the pass in progress stays alive."""
    got: list[Batch] = []
    it = iter(wrapped)
    while len(got) < k:
        try:
            got.append(ys(next(it)))
        except StopIteration:
            it = iter(wrapped)
    return got, it


def rest(loader: Loader, n: int) -> list[Batch]:
    """The next ``n`` batches' ``y`` from ``loader`` (its next epochs, as many as needed)."""
    out: list[Batch] = []
    while len(out) < n:
        out.extend(ys(b) for b in loader)
    loader.close()
    return out[:n]


# ---- resuming a Loader through prefetch ------------------------------------------------------------


# within an epoch, its last batches (read-ahead reaching the end), exactly at its end, and in the next epoch
@pytest.mark.parametrize("k", [0, 1, 5, EPOCH - DEPTH, EPOCH - 2, EPOCH - 1, EPOCH, EPOCH + 1, EPOCH + 7])
def test_resume_continues_after_the_last_batch_the_loop_received(table_path: Path, reference: list[Batch], k: int) -> None:
    loader = Loader(table_path, **KWARGS)
    wrapped = prefetch(loader, "cpu", depth=DEPTH)
    got, it = take(wrapped, k)
    assert got == reference[:k]
    state = wrapped.state_dict()  # during the pass (it is still alive), with up to DEPTH batches read ahead
    del it
    wrapped.close()
    loader.close()
    resumed = Loader(table_path, **KWARGS)
    resumed.load_state_dict(state)
    assert rest(resumed, EPOCH + 3) == reference[k : k + EPOCH + 3], "the batches read ahead come again, none is skipped"


def test_the_loaders_own_state_skips_the_batches_read_ahead(table_path: Path) -> None:
    """What ``prefetch`` fixes: the loader itself counts every batch it handed out, read ahead or not."""
    loader = Loader(table_path, **KWARGS)
    wrapped = prefetch(loader, "cpu", depth=DEPTH)
    _got, it = take(wrapped, 5)
    assert loader.state_dict()["batches_consumed"] == 5 + DEPTH
    assert wrapped.state_dict()["batches_consumed"] == 5
    del it
    loader.close()


def test_resume_after_a_break(table_path: Path, reference: list[Batch]) -> None:
    """A state saved inside the loop, before ``break``, resumes after its batch; one saved after ``break`` is where the
    next pass starts (the next epoch, as the loader's next ``for``): the batches ahead went with the epoch."""
    loader = Loader(table_path, **KWARGS)
    wrapped = prefetch(loader, "cpu", depth=DEPTH)
    for step, _batch in enumerate(wrapped):
        if step == 6:
            inside = wrapped.state_dict()  # with DEPTH batches read ahead, left out
            break  # the pass is dropped (and closed) here, its DEPTH batches ahead with it
    assert inside["batches_consumed"] == 7
    after = wrapped.state_dict()
    assert (after["epoch"], after["batches_consumed"]) == (1, 0), "the epoch left by break is over"
    again = prefetch(Loader(table_path, **KWARGS), "cpu", depth=DEPTH)
    again.load_state_dict(inside)
    got, it = take(again, EPOCH)
    del it
    assert got == reference[7 : 7 + EPOCH]
    later = prefetch(Loader(table_path, **KWARGS), "cpu", depth=DEPTH)
    later.load_state_dict(after)
    got, it = take(later, EPOCH)
    del it
    expect, it = take(wrapped, EPOCH)  # the original's next pass
    del it
    assert got == expect == reference[EPOCH : 2 * EPOCH]
    loader.close()


def test_resume_through_the_iterator(table_path: Path, reference: list[Batch]) -> None:
    loader = Loader(table_path, **KWARGS)
    it = iter(prefetch(loader, "cpu", depth=DEPTH))
    for _ in range(4):
        next(it)
    state = it.state_dict()
    with pytest.raises(StokerError, match="running"):
        it.load_state_dict(state)
    it.close()
    after = it.state_dict()
    assert (after["epoch"], after["batches_consumed"]) == (1, 0), "closing ends the pass and the epoch: the next starts"
    it.load_state_dict(state)  # to the loader: its next epoch continues there
    assert rest(loader, 3) == reference[4:7]


def test_load_state_dict_is_refused_while_a_pass_runs(table_path: Path) -> None:
    loader = Loader(table_path, **KWARGS)
    wrapped = prefetch(loader, "cpu", depth=DEPTH)
    it = iter(wrapped)
    next(it)
    state = wrapped.state_dict()
    with pytest.raises(StokerError, match="while a pass over prefetch"):
        wrapped.load_state_dict(state)
    it.close()
    wrapped.load_state_dict(state)
    assert wrapped.state_dict() == state
    loader.close()


# ---- any source ------------------------------------------------------------------------------------


class Counted:
    """A resumable source of numbered batches: its state is the next number to hand out, less ``unseen``."""

    def __init__(self, n: int, takes_unseen: bool = True) -> None:
        self.n, self.takes_unseen = n, takes_unseen
        self.start = 0
        self.handed_out = 0
        self.held: list[int] = []

    def __iter__(self) -> Iterator[int]:
        for i in range(self.start, self.n):
            self.handed_out = i + 1
            yield i

    def state_dict(self, **kwargs: int) -> dict[str, int]:
        if kwargs and not self.takes_unseen:
            raise AssertionError("state_dict(unseen=...) asked of a source that takes no unseen")
        return {"next": self.handed_out - kwargs.get("unseen", 0)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = self.handed_out = state["next"]

    def expect_held(self, batches: int) -> None:
        self.held.append(batches)


class PlainState(Counted):
    """A source whose ``state_dict`` takes no ``unseen`` (torchdata's, for one)."""

    def state_dict(self) -> dict[str, int]:  # type: ignore[override]
        return {"next": self.handed_out}


class FailingCopy:
    """A transfer whose copy of batch ``bad`` fails."""

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def issue(self, batch: int) -> int:
        if batch == self.bad:
            raise RuntimeError("CUDA out of memory (pretend)")
        return batch

    def deliver(self, item: int) -> int:
        return item


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_state_of_any_source_with_unseen(depth: int) -> None:
    source = Counted(20)
    wrapped = prefetch(source, "cpu", depth=depth)
    it = iter(wrapped)
    for k in range(8):
        assert next(it) == k
        assert source.handed_out == k + 1 + depth
        assert wrapped.state_dict() == it.state_dict() == {"next": k + 1}
    assert source.held == [depth], "the source is told how many batches prefetch holds"


def test_a_source_without_state_dict_is_a_clear_type_error() -> None:
    wrapped = prefetch([torch.zeros(1)] * 3, "cpu")
    with pytest.raises(TypeError, match="a list, has no state_dict"):
        wrapped.state_dict()
    with pytest.raises(TypeError, match="a list, has no load_state_dict"):
        wrapped.load_state_dict({})


def test_a_state_dict_without_unseen_is_refused_while_batches_are_ahead() -> None:
    source = PlainState(10)
    wrapped = prefetch(source, "cpu", depth=2)
    it = iter(wrapped)
    next(it)
    with pytest.raises(TypeError, match=r"PlainState.state_dict\(\) takes no unseen= argument, and prefetch holds 2 batches"):
        wrapped.state_dict()
    assert list(it) == list(range(1, 10))
    assert wrapped.state_dict() == {"next": 10}, "nothing ahead: the source's own state is right"


def test_a_batch_whose_copy_failed_is_unseen() -> None:
    source = Counted(10)
    it = PrefetchIterator(iter(source), FailingCopy(bad=4), 2, stateful=source)
    got = []
    with pytest.raises(RuntimeError, match="out of memory"):
        for batch in it:
            got.append(batch)
    assert got == [0, 1, 2, 3]
    assert it.state_dict() == {"next": 4}, "batch 4 reached neither the loop nor the device: a resume yields it"


def test_the_read_ahead_stops_at_the_end_the_source_announces() -> None:
    """A list's iterator says how many items are left: the end is read when the loop asks for it, not ahead."""

    class Ends(Counted):
        def __iter__(self) -> Iterator[int]:
            return _Announced(self)

    source = Ends(4)
    it = iter(prefetch(source, "cpu", depth=5))
    assert next(it) == 0
    assert source.handed_out == 4
    inner = it._source
    assert isinstance(inner, _Announced) and not inner.ended
    assert list(it) == [1, 2, 3]
    assert inner.ended


class _Announced(Iterator[int]):
    def __init__(self, source: Counted) -> None:
        self.source, self.i, self.ended = source, 0, False

    def __len__(self) -> int:
        return self.source.n - self.i

    def __next__(self) -> int:
        if self.i == self.source.n:
            self.ended = True
            raise StopIteration
        self.i += 1
        self.source.handed_out = self.i
        return self.i - 1


# ---- held batches: sized for, not warned -----------------------------------------------------------------


def test_prefetch_holds_no_batch_the_loader_did_not_expect(table_path: Path) -> None:
    # few slots (one producer, one batch ahead): without expect_held, the DEPTH batches ahead are kept
    # batches the loader gives fresh memory, and past HELD_BATCHES_WARNING of them, a HeldBatchesWarning (an error here)
    loader = Loader(table_path, batch_size=4, num_workers=1, batches_ahead=1)
    wrapped = prefetch(loader, "cpu", depth=DEPTH)
    for _ in range(3):
        n = sum(1 for _ in wrapped)
        assert n == len(loader)
    assert loader.stats()["loader"]["kept_batches"] == 0
    loader.close()
