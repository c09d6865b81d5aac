"""``prefetch``: the same batches as its source, in order; early breaks and errors behave as the Loader's.

The CPU path reads ahead as the CUDA path does (only the copy differs); the
look-ahead machinery is tested here too, with a transfer that records what it
is asked to do. Resuming and held batches: test_prefetch_resume.py.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import stoker
from stoker.device import PrefetchIterator, prefetch
from stoker.errors import StokerError
from stoker.loader import Loader, OrderOption

from ..loader.conftest import loader_threads, table_path

__all__ = ["table_path"]


class Source:
    """A generator of numbered batches that records how far it was read and whether it was closed."""

    def __init__(self, n: int, fail_at: int | None = None, error: BaseException | None = None) -> None:
        self.n, self.fail_at = n, fail_at
        self.error = error if error is not None else ValueError(f"batch {fail_at} is broken")
        self.pulled = 0
        self.closed = False

    def __iter__(self) -> Iterator[Any]:
        try:
            for i in range(self.n):
                if i == self.fail_at:
                    raise self.error
                self.pulled += 1
                yield {"i": i, "x": torch.full((2,), float(i)), "nested": [(torch.tensor(i), f"s{i}")]}
        finally:
            self.closed = True


class Recorder:
    """A transfer that issues and delivers nothing but notes: what the look-ahead asked, and when."""

    def __init__(self, source: Source, fail_issue_at: int | None = None) -> None:
        self.source = source
        self.fail_issue_at = fail_issue_at
        self.issued: list[int] = []
        self.delivered: list[int] = []
        self.pulled_when_delivered: list[int] = []

    def issue(self, batch: Any) -> Any:
        if batch["i"] == self.fail_issue_at:
            raise RuntimeError("CUDA out of memory (pretend)")
        self.issued.append(batch["i"])
        return ("issued", batch)

    def deliver(self, item: Any) -> Any:
        tag, batch = item
        assert tag == "issued"
        self.delivered.append(batch["i"])
        self.pulled_when_delivered.append(self.source.pulled)
        return batch


def _ahead(source: Source, depth: int, **kwargs: Any) -> tuple[PrefetchIterator, Recorder]:
    recorder = Recorder(source, **kwargs)
    return PrefetchIterator(iter(source), recorder, depth), recorder


# ---- the CPU path ---------------------------------------------------------------------------------


def test_cpu_reads_ahead_as_cuda_does() -> None:
    source = Source(5)
    expected = list(Source(5))
    got = []
    for k, batch in enumerate(prefetch(source, "cpu")):
        assert source.pulled == min(5, k + 1 + 2), "after handing over batch k, batches k+1..k+depth are read"
        got.append(batch)
    assert [b["i"] for b in got] == list(range(5))
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a["x"], b["x"])
        assert a["nested"][0][1] == b["nested"][0][1]
    assert source.closed


def test_cpu_batches_are_the_source_objects() -> None:
    batches = [{"x": torch.ones(3)}, (torch.zeros(1), "a"), None, 7]
    out = list(prefetch(batches, "cpu"))
    assert len(out) == len(batches) and all(a is b for a, b in zip(out, batches)), "None is a batch like any other"


def test_a_loader_as_source(table_path: Path) -> None:
    kwargs = {"batch_size": 64, "order": OrderOption.RANDOM, "seed": 5}
    reference = Loader(table_path, **kwargs)
    expected = [[y.clone() for _, y in reference] for _ in range(2)]
    loader = Loader(table_path, **kwargs)
    wrapped = prefetch(loader, "cpu")
    assert len(wrapped) == len(loader)
    for epoch in range(2):  # each pass over the prefetcher is one epoch of the loader
        got = [y.clone() for _, y in wrapped]
        assert len(got) == len(expected[epoch])
        for a, b in zip(got, expected[epoch]):
            assert torch.equal(a, b)


def test_a_named_loader_as_source(table_path: Path) -> None:
    for batch in prefetch(Loader(table_path, batch_size=100, named=True), torch.device("cpu")):
        assert list(batch) == ["x", "y"]


def test_break_closes_the_source() -> None:
    source = Source(10)
    generator = iter(source)  # held here: only prefetch's close() can close it
    for k, _ in enumerate(prefetch(generator, "cpu")):
        if k == 2:
            break
    assert source.closed and source.pulled == 3 + 2, "read up to depth batches further than the loop saw"


def test_break_stops_the_loader(table_path: Path) -> None:
    loader = Loader(table_path, batch_size=10, num_workers=2)
    wrapped = prefetch(loader, "cpu")
    for _ in range(3):
        for k, _batch in enumerate(wrapped):
            if k == 1:
                break  # the loader's epoch ends here: the next pass may start
    assert sum(1 for _ in wrapped) == len(loader)
    loader.close()
    gc.collect()
    assert loader_threads() == []


def test_an_error_reaches_the_loop_at_its_position() -> None:
    source = Source(10, fail_at=3)
    it = iter(prefetch(source, "cpu"))
    assert [next(it)["i"] for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="batch 3 is broken") as info:
        next(it)
    assert info.value is source.error
    assert source.closed
    with pytest.raises(StopIteration):
        next(it)


def test_a_loader_error_reaches_the_loop(table_path: Path) -> None:
    def broken(batch: torch.Tensor) -> torch.Tensor:
        if int(batch[0]) >= 500:
            raise RuntimeError("bad row")
        return batch

    from stoker.decoders import IntDecoder
    from stoker.errors import LoaderError
    from stoker.transforms import ToTensor

    loader = Loader(table_path, batch_size=100, pipelines={"y": [IntDecoder(), ToTensor(), broken]})
    seen = []
    with pytest.raises(LoaderError, match="bad row"):
        for _, y in prefetch(loader, "cpu"):
            seen.append(int(y[0]))
    assert seen == [0, 100, 200, 300, 400]


def test_context_manager_and_close() -> None:
    source = Source(10)
    generator = iter(source)
    with iter(prefetch(generator, "cpu")) as it:
        next(it)
    assert source.closed
    it.close()  # again: nothing happens
    with pytest.raises(StopIteration):
        next(it)
    other = Source(10)
    wrapped = prefetch(generator := iter(other), "cpu")
    running = iter(wrapped)
    next(running)
    wrapped.close()
    assert other.closed
    del generator


@pytest.mark.parametrize("depth", [0, -1, True, 1.5, "2"])
def test_depth_must_be_a_positive_int(depth: Any) -> None:
    with pytest.raises(ValueError, match="depth must be an int >= 1"):
        prefetch([], "cpu", depth=depth)


def test_source_must_be_iterable() -> None:
    with pytest.raises(TypeError, match="iterable of batches"):
        prefetch(42, "cpu")  # type: ignore[arg-type]


def test_len_of_a_source_without_one() -> None:
    with pytest.raises(TypeError):
        len(prefetch(iter([]), "cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(StokerError, match="CUDA is not available"):
        iter(prefetch([], "cuda"))


def test_exported_from_stoker() -> None:
    assert stoker.prefetch is prefetch


# ---- the look-ahead (what runs on CUDA), with a recording transfer ---------------------------------------


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_lookahead_order_and_distance(depth: int) -> None:
    n = 9
    source = Source(n)
    it, rec = _ahead(source, depth)
    got = [b["i"] for b in it]
    assert got == list(range(n))
    assert rec.issued == list(range(n)) and rec.delivered == list(range(n))
    for k, pulled in enumerate(rec.pulled_when_delivered):
        # when batch k is handed over, batches up to k + depth have been issued (not more)
        assert pulled <= min(n, k + 1 + depth)
    assert rec.pulled_when_delivered[0] == 1, "the first batch is handed over as soon as it is issued"
    assert source.closed


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_lookahead_keeps_depth_batches_in_flight(depth: int) -> None:
    source = Source(20)
    it, _ = _ahead(source, depth)
    for k in range(10):
        assert next(it)["i"] == k
        assert source.pulled == k + 1 + depth, "after handing over batch k, batches k+1..k+depth are issued"
        assert len(it._ahead) == depth
    it.close()


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_lookahead_error_comes_after_the_batches_before_it(depth: int) -> None:
    source = Source(10, fail_at=4)
    it, _ = _ahead(source, depth)
    got = []
    with pytest.raises(ValueError, match="batch 4 is broken"):
        for b in it:
            got.append(b["i"])
    assert got == [0, 1, 2, 3]
    assert source.closed and len(it._ahead) == 0
    with pytest.raises(StopIteration):
        next(it)


def test_lookahead_error_of_the_copy_comes_at_its_position() -> None:
    source = Source(10)
    it, _ = _ahead(source, 3, fail_issue_at=5)
    got = []
    with pytest.raises(RuntimeError, match="out of memory"):
        for b in it:
            got.append(b["i"])
    assert got == [0, 1, 2, 3, 4]
    assert source.closed


def test_lookahead_break_closes_the_source_and_drops_the_batches_ahead() -> None:
    source = Source(10)
    generator = iter(source)
    it = PrefetchIterator(generator, Recorder(source), 3)
    for b in it:
        if b["i"] == 1:
            break
    assert len(it._ahead) == 3 and not source.closed
    del it, b
    assert source.closed


def test_lookahead_keyboard_interrupt_closes_the_source() -> None:
    source = Source(10, fail_at=2, error=KeyboardInterrupt())
    it, _ = _ahead(source, 1)
    assert next(it)["i"] == 0
    with pytest.raises(KeyboardInterrupt):
        next(it)  # reading batch 2 ahead raises: not an error of a batch, it stops everything at once
    assert source.closed
    with pytest.raises(StopIteration):
        next(it)
