"""The compiled producer loop (``stoker.loader._engine``): used where it applies, same batches as a numpy model.

Each test first checks which path ran (a test of the compiled loop that ran
the Python producers would prove nothing).
"""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.decoders import IntDecoder, NDArrayDecoder
from stoker.errors import LoaderError
from stoker.format import Reader
from stoker.loader import Loader, OrderOption, _engine, _producers
from stoker.loader._engine import CompiledEpoch
from stoker.loader._epoch import _Producers
from stoker.loader._ring import LOOP_CLAIM
from stoker.loader.loader import default_batches_ahead
from stoker.pipeline import linking, native
from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.compiler import serial_twin
from stoker.pipeline.operation import Operation
from stoker.pipeline.random import COPIES_PER_STEP
from stoker.pipeline.state import State
from stoker.transforms import ToTensor

from .._profile import examples
from .conftest import loader_threads, other_loaders_threads

pytestmark = pytest.mark.skipif(not native.available(), reason="the compiled producer loop needs Linux")


def _table(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with Reader(path) as r:
        return np.array(r.column("x")), np.array(r.metadata["y/value"]).astype(np.int64)


def _check_epoch(loader: Loader, X: np.ndarray, y: np.ndarray, first: int = 0) -> None:
    """The loader's next epoch (resumed at batch ``first``) equals the numpy model, batch by batch.

    Compared as they come: a batch kept would get fresh memory, which is not what is tested here.
    """
    epoch = loader._next_epoch
    it = iter(loader)
    assert isinstance(it, CompiledEpoch)
    reference = _reference_batches(loader, epoch, X, y)[first:]
    seen = 0
    for (xb, yb), (xr, yr) in zip(it, reference):
        np.testing.assert_array_equal(xb.numpy(), xr, err_msg=f"epoch {epoch} batch {first + seen}: x")
        np.testing.assert_array_equal(yb.numpy().reshape(-1), yr, err_msg=f"epoch {epoch} batch {first + seen}: y")
        seen += 1
    assert seen == len(reference) and next(it, None) is None


def test_plain_pipelines_run_the_compiled_loop_and_the_switch_turns_it_off(table_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with Loader(table_path, batch_size=64, num_workers=2) as loader:
        it = iter(loader)
        assert isinstance(it, CompiledEpoch)
        list(it)
        stats = loader.stats()
        assert stats["x"]["compiled[NDArrayDecoder()]"] > 0 and stats["y"]["compiled[IntDecoder()]"] > 0
        assert stats["x"]["ToTensor()"] > 0
    monkeypatch.setenv("STOKER_COMPILED_EPOCH", "0")
    with Loader(table_path, batch_size=64, num_workers=2) as loader:
        it = iter(loader)
        assert isinstance(it, CompiledEpoch) and it._plan.loop is None and loader._plan.why == "STOKER_COMPILED_EPOCH=0"
        list(it)


@settings(max_examples=examples(ci=5, long=30), deadline=None)
@given(
    batch_size=st.integers(1, 300),
    num_workers=st.integers(1, 3),
    ahead=st.integers(1, 5),
    order=st.sampled_from([OrderOption.SEQUENTIAL, OrderOption.RANDOM, OrderOption.QUASI_RANDOM]),
    drop_last=st.booleans(),
    skip=st.integers(0, 4),
    seed=st.integers(0, 2**32 - 1),
    repeats=st.booleans(),
    cpus=st.sampled_from([1, 2, 3, 64]),
)
def test_batches_equal_the_numpy_model(
    table_path: Path,
    batch_size: int,
    num_workers: int,
    ahead: int,
    order: OrderOption,
    drop_last: bool,
    skip: int,
    seed: int,
    repeats: bool,
    cpus: int,
) -> None:
    """Sizes, thread, CPU and slot counts, orders, a resumed epoch, samples drawn twice: the rows of the epoch's indices."""
    X, y = _table(table_path)
    indices = np.r_[np.arange(0, 1000, 3), np.arange(0, 1000, 7)] if repeats else None
    kwargs: dict[str, Any] = dict(batch_size=batch_size, num_workers=num_workers, batches_ahead=ahead, order=order, seed=seed)
    with pytest.MonkeyPatch.context() as m, Loader(table_path, drop_last=drop_last, indices=indices, **kwargs) as loader:
        m.setattr(_engine, "_cpus", lambda: cpus)
        skip = _resume_after(loader, skip)
        _check_epoch(loader, X, y, first=skip)  # epoch 0, resumed
        _check_epoch(loader, X, y)  # epoch 1


@pytest.mark.parametrize(
    ("num_workers", "pool", "loop_works", "cpus", "started"),
    [
        (2, 2, True, 2, 1),  # 2 CPUs: 1 producer and the loop
        (3, 2, True, 2, 1),
        (2, 2, True, 1, 1),
        (2, 2, True, 3, 2),  # a CPU to spare: every producer
        (3, 2, True, 3, 2),
        (16, 2, True, 16, 2),
        (2, 2, False, 2, 2),  # the loop never makes batches: every producer
        (1, 1, True, 1, 1),
    ],
)
def test_producers_beside_the_loop(num_workers: int, pool: int, loop_works: bool, cpus: int, started: int) -> None:
    assert _producers.producers_beside_loop(num_workers, pool, loop_works, cpus) == started


@pytest.mark.parametrize(("cpus", "reentrant", "started"), [(2, True, 1), (64, True, 2), (2, False, 2)])
def test_an_epoch_on_two_cpus_leaves_one_to_the_loop(
    table_path: Path, monkeypatch: pytest.MonkeyPatch, cpus: int, reentrant: bool, started: int
) -> None:
    """2 workers on 2 CPUs: one producer makes batches beside the loop, with the tokens of both (as many batches
    ahead); the other gets no job. With a CPU to spare, or a loop that never makes batches, both run."""
    X, y = _table(table_path)
    monkeypatch.setattr(_engine, "_cpus", lambda: cpus)
    monkeypatch.setattr(_engine, "MAKE_WHEN_WAITING", reentrant)
    jobs: list[int] = []
    real = _Producers.submit
    monkeypatch.setattr(_Producers, "submit", lambda self, t, job: (jobs.append(t), real(self, t, job))[1])
    with Loader(table_path, batch_size=16, num_workers=2, order=OrderOption.RANDOM, seed=3) as loader:
        assert loader._producers == 2
        it = iter(loader)
        assert isinstance(it, CompiledEpoch)
        s = it._ring
        assert s.producers == started and s.producers * s.ahead == 2 * loader._tokens_per_producer
        it.close()
        for _ in range(2):
            _check_epoch(loader, X, y)
        assert sorted(set(jobs)) == list(range(started))
        made = loader.stats()["loader"]["batches_made_by_loop"]
        assert (0 < made < 3 * len(loader)) if reentrant else made == 0


def _idle_compiled_producers(m: pytest.MonkeyPatch) -> None:
    """Producer threads get no compiled job: every batch of a compiled epoch is one the loop has to make itself
    (the Python producers an epoch may go on with still run)."""
    real = _Producers.submit
    m.setattr(_Producers, "submit", lambda self, t, job: None if isinstance(job, _producers._Job) else real(self, t, job))


def _made_by_loop(loader: Loader) -> float:
    return loader.stats()["loader"]["batches_made_by_loop"]


@settings(max_examples=examples(ci=4, long=20), deadline=None)
@given(
    batch_size=st.integers(1, 300),
    num_workers=st.integers(1, 3),
    ahead=st.integers(1, 5),
    order=st.sampled_from([OrderOption.SEQUENTIAL, OrderOption.RANDOM]),
    drop_last=st.booleans(),
    skip=st.integers(0, 4),
    seed=st.integers(0, 2**32 - 1),
)
def test_batches_the_loop_makes_itself_equal_the_numpy_model(
    table_path: Path, batch_size: int, num_workers: int, ahead: int, order: OrderOption, drop_last: bool, skip: int, seed: int
) -> None:
    """With no producer running, the loop makes every batch (none is ever ready): same rows, counted in stats()."""
    X, y = _table(table_path)
    with pytest.MonkeyPatch.context() as m:
        _idle_compiled_producers(m)
        kwargs: dict[str, Any] = dict(batch_size=batch_size, num_workers=num_workers, batches_ahead=ahead, order=order, seed=seed)
        with Loader(table_path, drop_last=drop_last, **kwargs) as loader:
            skip = _resume_after(loader, skip)
            made = _made_by_loop(loader)
            _check_epoch(loader, X, y, first=skip)
            _check_epoch(loader, X, y)
            assert _made_by_loop(loader) - made == 2 * len(loader) - skip


def test_producers_and_the_loop_share_an_epoch_without_making_a_batch_twice(table_path: Path) -> None:
    """Producers slower than the loop: the loop makes some batches, producers skip those and make the rest, in order."""
    X, y = _table(table_path)
    with Loader(table_path, batch_size=7, num_workers=2, batches_ahead=2, order=OrderOption.RANDOM, seed=9) as loader:
        made, n = _made_by_loop(loader), 0
        for _ in range(5):
            _check_epoch(loader, X, y)
            n += len(loader)
        by_loop = _made_by_loop(loader) - made
        assert 5 <= by_loop < n  # at least each epoch's first batch; not all of them
        it = iter(loader)
        assert isinstance(it, CompiledEpoch)
        for _ in it:
            pass
        # every batch was claimed once (by a producer or the loop) and made
        assert np.isin(it._ring.claims, (1, LOOP_CLAIM)).all() and (it._ring.status == _engine.DONE).all()


def test_with_the_loop_never_making_batches_producers_make_them_all(table_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    X, y = _table(table_path)
    monkeypatch.setattr(_engine, "MAKE_WHEN_WAITING", False)
    with Loader(table_path, batch_size=33, num_workers=2, order=OrderOption.RANDOM, seed=2) as loader:
        _check_epoch(loader, X, y)
        _check_epoch(loader, X, y)
        assert _made_by_loop(loader) == 0


@settings(max_examples=examples(ci=5, long=25), deadline=None)
@given(
    steps=st.lists(
        st.one_of(
            st.just(("epoch", 0)),
            st.tuples(st.just("break after"), st.integers(0, 6)),
            st.tuples(st.just("set_epoch"), st.integers(0, 3)),
            st.tuples(st.just("seed"), st.integers(0, 3)),
        ),
        min_size=1,
        max_size=6,
    ),
    batch_size=st.integers(1, 200),
    num_workers=st.integers(1, 2),
)
def test_orders_prepared_an_epoch_ahead_are_the_epochs_orders(
    table_path: Path, steps: list[tuple[str, int]], batch_size: int, num_workers: int
) -> None:
    """Producers shuffle the next epoch's order while they wait: whole epochs, epochs broken off (the order half
    shuffled), set_epoch and a new seed in between, each epoch still loads epoch_order's samples."""
    X, y = _table(table_path)
    with Loader(table_path, batch_size=batch_size, num_workers=num_workers, order=OrderOption.RANDOM, seed=4) as loader:
        for what, k in [*steps, ("epoch", 0)]:
            if what == "set_epoch":
                loader.set_epoch(k)
            elif what == "seed":
                loader.seed = 100 + k
            elif what == "epoch":
                _check_epoch(loader, X, y)
            else:
                it = iter(loader)
                assert isinstance(it, CompiledEpoch)
                reference = _reference_batches(loader, loader._position[0], X, y)
                for (xb, _), (xr, _) in zip(it, reference[:k]):
                    np.testing.assert_array_equal(xb.numpy(), xr)
                del it


class _DeclaresATypeAndATorchDtype(Operation):
    """Memory declared with a numpy type (``np.float32``, not ``np.dtype``) and a second with a torch dtype."""

    reentrant = True

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        return previous_state, AllocationQuery(previous_state.shape, np.float32)

    def generate_code(self) -> Callable[..., Any]:
        def copy(batch, dst):  # type: ignore[no-untyped-def]
            dst[:] = batch
            return dst

        return copy


def test_slot_bytes_of_memory_declared_with_a_numpy_type_or_a_torch_dtype(table_path: Path, python_producers_unless_long: None) -> None:
    # (its subject is the slots' memory: under ``ci`` no producer loop is compiled for this one-off operation)
    import torch

    X, _ = _table(table_path)
    pipelines = {"x": [NDArrayDecoder(), _DeclaresATypeAndATorchDtype(), ToTensor()], "y": None}
    with Loader(table_path, batch_size=16, num_workers=2, pipelines=pipelines) as loader:
        (pipeline,) = loader.pipelines
        assert pipeline.slot_bytes(16) == 2 * 16 * X.shape[1] * 4  # the decoder's and the operation's float32 rows
        assert loader.batches_ahead == default_batches_ahead(pipeline.slot_bytes(16), loader._producers)
        _check_epoch_x(loader, X)
        step = pipeline.steps[1]
        step.query = AllocationQuery(step.query.shape, torch.float64)  # type: ignore[union-attr]
        assert pipeline.slot_bytes(16) == 16 * X.shape[1] * (4 + 8)


def _check_epoch_x(loader: Loader, X: np.ndarray) -> None:
    reference = _reference_batches(loader, loader._next_epoch, X, X[:, 0])
    for (xb,), (xr, _) in zip(loader, reference, strict=True):
        np.testing.assert_array_equal(xb.numpy(), xr)


def test_default_batches_ahead_grows_for_small_batches_within_its_memory(table_path: Path) -> None:
    sizes = [1, 100, 300_000, 524_288, 524_289, 1 << 20, 1 << 22, 1 << 30]
    ahead = [default_batches_ahead(b) for b in sizes]
    assert ahead[:4] == [8, 8, 8, 8] and ahead[4] == 7 and ahead[-3:] == [4, 3, 3]
    assert all(3 <= a <= 8 for a in ahead) and ahead == sorted(ahead, reverse=True)
    assert all(a == 3 or a * b <= 4 << 20 for a, b in zip(ahead, sizes, strict=True))
    two = [default_batches_ahead(b, 2) for b in sizes]  # per producer: twice the batches within twice the memory
    assert two[:4] == [16, 16, 16, 16] and two[-3:] == [8, 3, 3]
    assert all(3 <= a <= 16 and (a == 3 or a * b <= 8 << 20) for a, b in zip(two, sizes, strict=True))
    with (
        Loader(table_path, batch_size=64, num_workers=1) as small,
        Loader(table_path, batch_size=64, num_workers=2) as small2,
        Loader(table_path, batch_size=1000) as big,
        Loader(table_path, batch_size=64, batches_ahead=2) as given_,
    ):
        for loader in (small, small2, big):
            loader._allocate()
            slot = sum(p.slot_bytes(loader.batch_size) for p in loader.pipelines)
            assert slot == sum(v.nbytes for p in loader.pipelines for v in p._views[0] if v is not None)
            assert loader.batches_ahead == default_batches_ahead(slot, loader._producers)
        assert small.batches_ahead == 8 and small2._producers == 2 and small2.batches_ahead == 16 and given_.batches_ahead == 2


def _resume_after(loader: Loader, skip: int) -> int:
    """Take ``skip`` batches of epoch 0 (at most all but one), then resume there from a state_dict; returns the batches taken."""
    skip = min(skip, len(loader) - 1)
    if skip:
        it = iter(loader)
        for _ in range(skip):
            next(it)
        state = loader.state_dict()
        del it
        loader.load_state_dict(state)
    return skip


def _reference_batches(loader: Loader, epoch: int, X: np.ndarray, y: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    idx = loader.epoch_indices(epoch)
    bs = loader.batch_size
    return [(X[idx[b : b + bs]], y[idx[b : b + bs]]) for b in range(0, len(idx), bs)]


@settings(max_examples=examples(ci=3, long=15), deadline=None)
@given(keep_every=st.integers(1, 4), num_workers=st.integers(1, 2), ahead=st.integers(1, 3))
def test_kept_batches_are_never_overwritten(table_path: Path, keep_every: int, num_workers: int, ahead: int) -> None:
    """Batches kept across the epoch (and the next) keep their values: their slots get fresh memory."""
    X, y = _table(table_path)
    with Loader(table_path, batch_size=50, num_workers=num_workers, batches_ahead=ahead, order=OrderOption.RANDOM, seed=1) as loader:
        it = iter(loader)
        assert isinstance(it, CompiledEpoch)
        kept = [batch for b, batch in enumerate(it) if b % keep_every == 0]
        _check_epoch(loader, X, y)  # another epoch reuses every slot
        reference = _reference_batches(loader, 0, X, y)[::keep_every]
        for (xb, yb), (xr, yr) in zip(kept, reference, strict=True):
            np.testing.assert_array_equal(xb.numpy(), xr)
            np.testing.assert_array_equal(yb.numpy().reshape(-1), yr)
        assert loader.stats()["loader"]["kept_batches"] > 0


class _OwnMemory(Operation):
    """An operation with memory of its input's shape and dtype (keeping no state: reentrant)."""

    reentrant = True

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        return previous_state, AllocationQuery(previous_state.shape, previous_state.dtype)


class _KeepsState(_OwnMemory):
    """A copy, declared not reentrant (as an operation with a handle or buffer per thread of a batch)."""

    reentrant = False

    def generate_code(self) -> Callable[..., Any]:
        def copy(batch, dst):  # type: ignore[no-untyped-def]
            dst[:] = batch
            return dst

        return copy


@pytest.mark.parametrize("num_workers", [1, 2])
def test_the_loop_never_makes_a_batch_of_an_operation_that_is_not_reentrant(table_path: Path, num_workers: int) -> None:
    """Two threads on two batches at once would share its per-thread state (a JPEG decoder's handle): only the producer makes them."""
    X, y = _table(table_path)
    pipelines = {"x": [NDArrayDecoder(), _KeepsState(), ToTensor()], "y": None}
    with Loader(table_path, batch_size=16, num_workers=num_workers, order=OrderOption.RANDOM, seed=8, pipelines=pipelines) as loader:
        for epoch in range(3):
            it = iter(loader)
            assert isinstance(it, CompiledEpoch)
            reference = _reference_batches(loader, epoch, X, y)
            for (xb,), (xr, _) in zip(it, reference, strict=True):
                np.testing.assert_array_equal(xb.numpy(), xr)
        assert _made_by_loop(loader) == 0


class _SlowOn(_OwnMemory):
    """A copy that takes ``ms`` milliseconds longer on the batch whose first row's first value is ``marker`` (on every
    batch if ``marker`` is NaN)."""

    def __init__(self, marker: float, ms: int) -> None:
        self.marker, self.ms = marker, ms

    def generate_code(self) -> Callable[..., Any]:
        marker, ns, every = self.marker, self.ms * 1_000_000, bool(np.isnan(self.marker))
        clock = native.monotonic_ns

        def slow(batch, dst):  # type: ignore[no-untyped-def]
            if every or (batch.shape[0] > 0 and batch[0, 0] == marker):
                end = clock() + ns
                while clock() < end:
                    pass
            for i in range(batch.shape[0]):
                for j in range(batch.shape[1]):
                    dst[i, j] = batch[i, j]
            return dst

        return slow


@pytest.mark.parametrize("ahead", [2, 4])
def test_while_a_producer_makes_the_batch_waited_for_the_loop_makes_the_next_ones(
    table_path: Path, ahead: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop waits for batch 1 (a producer's, slow): meanwhile it makes the batches after it that no producer has
    started, only those whose slots are free (fewer than ``ahead`` past it), and then hands every batch over in order."""
    X, y = _table(table_path)
    bs = 10
    events: list[tuple[str, int]] = []
    real = CompiledEpoch._make_here

    def spy(self: CompiledEpoch, c: int) -> None:
        events.append(("made", c))
        real(self, c)

    monkeypatch.setattr(CompiledEpoch, "_make_here", spy)
    pipelines = {"x": [NDArrayDecoder(), _SlowOn(float(X[bs, 0]), 300), ToTensor()], "y": None}
    with Loader(table_path, batch_size=bs, num_workers=1, batches_ahead=ahead, order=OrderOption.SEQUENTIAL, pipelines=pipelines) as loader:
        it = iter(loader)
        assert isinstance(it, CompiledEpoch)
        reference = _reference_batches(loader, 0, X, y)
        for b, ((xb,), (xr, _)) in enumerate(zip(it, reference, strict=True)):
            np.testing.assert_array_equal(xb.numpy(), xr, err_msg=f"batch {b}")
            events.append(("got", b))
            if b == 0:  # let the producer start batch 1 (the slow one) before the loop asks for it
                while it._ring.claims[1] == 0:
                    time.sleep(0.001)
    before = {c for kind, c in events[: events.index(("got", 1))] if kind == "made"}
    assert before == {0, *range(2, 1 + ahead)}


@settings(max_examples=examples(ci=2, long=12), deadline=None)
@given(
    num_workers=st.integers(1, 2),
    ahead=st.integers(1, 6),
    slow=st.integers(1, 9),
    keep_every=st.sampled_from([0, 2, 3]),
    stop_after=st.one_of(st.none(), st.integers(1, 10)),
)
def test_batches_made_ahead_while_waiting_equal_the_numpy_model(
    table_path: Path, num_workers: int, ahead: int, slow: int, keep_every: int, stop_after: int | None
) -> None:
    """A producer is slow on one batch: the loop makes later batches meanwhile. Batches kept (their slots renewed),
    an epoch broken off, the next epoch: every batch has the model's rows, every batch made once."""
    X, y = _table(table_path)
    bs = 25  # 40 batches
    pipelines = {"x": [NDArrayDecoder(), _SlowOn(float(X[slow * bs, 0]), 30), ToTensor()], "y": [IntDecoder(), ToTensor()]}
    kwargs: dict[str, Any] = dict(batch_size=bs, num_workers=num_workers, batches_ahead=ahead, pipelines=pipelines)
    with Loader(table_path, order=OrderOption.SEQUENTIAL, **kwargs) as loader:
        it = iter(loader)
        assert isinstance(it, CompiledEpoch)
        reference = _reference_batches(loader, 0, X, y)
        kept = []
        for b, ((xb, yb), (xr, yr)) in enumerate(zip(it, reference, strict=True)):
            np.testing.assert_array_equal(xb.numpy(), xr, err_msg=f"batch {b}")
            np.testing.assert_array_equal(yb.numpy().reshape(-1), yr, err_msg=f"batch {b}")
            if keep_every and b % keep_every == 0:
                kept.append((b, xb))
            if stop_after is not None and b + 1 == stop_after:
                break
        else:  # the whole epoch: every batch claimed once (by a producer or the loop) and made
            assert np.isin(it._ring.claims, (1, LOOP_CLAIM)).all() and (it._ring.status == _engine.DONE).all()
        del it
        _check_epoch(loader, X, y)
        for b, xb in kept:  # still the rows they had
            np.testing.assert_array_equal(xb.numpy(), reference[b][0], err_msg=f"kept batch {b}")


def test_the_loop_stops_working_ahead_once_its_own_call_failed(table_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure of the loop's own call (not an operation's) is not tried again on the next batches: the loop waits
    for the batch it needs, and the failure reaches the user's loop at the batch it hit."""
    X, _ = _table(table_path)
    bs = 10
    tried: list[int] = []
    real = CompiledEpoch._make_here

    def fails_ahead(self: CompiledEpoch, c: int) -> None:
        if c == 0:
            real(self, c)
            return
        tried.append(c)
        self._own_error = RuntimeError("the loop's call failed")

    monkeypatch.setattr(CompiledEpoch, "_make_here", fails_ahead)
    pipelines = {"x": [NDArrayDecoder(), _SlowOn(float(X[bs, 0]), 200), ToTensor()], "y": None}
    with Loader(table_path, batch_size=bs, num_workers=1, batches_ahead=4, order=OrderOption.SEQUENTIAL, pipelines=pipelines) as loader:
        it = iter(loader)
        assert isinstance(it, CompiledEpoch)
        next(it)
        while it._ring.claims[1] == 0:  # the producer is making batch 1 (slow)
            time.sleep(0.001)
        next(it)  # batch 1, from the producer, after one failed try at batch 2
        with pytest.raises(LoaderError, match="the loop's call failed"):
            next(it)
    assert tried == [2]


def test_memory_renewed_outside_an_epoch_gets_its_new_addresses(table_path: Path) -> None:
    """The slot address table is kept from one epoch to the next: slots given new memory in between (here by hand)
    are looked up again, so producers write where the loop reads."""
    X, y = _table(table_path)
    with Loader(table_path, batch_size=64, num_workers=2, order=OrderOption.RANDOM, seed=5) as loader:
        _check_epoch(loader, X, y)
        old = [p.slot_memory(slot) for p in loader.pipelines for slot in range(loader._num_slots)]  # kept alive
        for p in loader.pipelines:
            for slot in range(loader._num_slots):
                p.renew_slot(slot)
        _check_epoch(loader, X, y)
        _check_epoch(loader, X, y)
        del old


@pytest.mark.compiled_loop
def test_a_producer_that_never_waits_still_prepares_the_next_order(table_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next epoch's shuffle is spread over a producer's batches: a piece done with each, even when the producer
    never waits for a token (so never shuffles while it waits) and has batches left to make."""
    X, y = _table(table_path)
    monkeypatch.setattr(_engine, "MAKE_WHEN_WAITING", False)  # the producer makes every batch
    pipelines = {"x": [NDArrayDecoder(), _SlowOn(float("nan"), 20), ToTensor()], "y": None}
    with Loader(
        table_path, batch_size=200, num_workers=1, batches_ahead=64, order=OrderOption.RANDOM, seed=3, pipelines=pipelines
    ) as loader:
        for epoch in range(2):
            it = iter(loader)  # a token for every batch: the producer never waits
            assert isinstance(it, CompiledEpoch)
            prepared = loader._prepared_order
            assert prepared is not None
            work = len(prepared.values) - 1 + -(-len(prepared.values) // COPIES_PER_STEP)  # (the copy, then the steps)
            reference = _reference_batches(loader, epoch, X, y)
            for b, ((xb,), (xr, _)) in enumerate(zip(it, reference, strict=True)):
                np.testing.assert_array_equal(xb.numpy(), xr)
                if b == 0:  # the producer is making batch 1 (20 ms a batch): it did a piece before batch 0
                    assert prepared.left() <= work - -(-work // len(loader))
        it = iter(loader)  # the prepared orders were the epochs' orders
        for (xb,), (xr, _) in zip(it, _reference_batches(loader, 2, X, y), strict=True):
            np.testing.assert_array_equal(xb.numpy(), xr)


class _Fails(_OwnMemory):
    """A compiled operation that raises on the row whose first value is ``bad``."""

    def __init__(self, bad: float) -> None:
        self.bad = bad

    def generate_code(self) -> Callable[..., Any]:
        bad = self.bad

        def fails(batch, dst):  # type: ignore[no-untyped-def]
            for i in range(batch.shape[0]):
                if batch[i, 0] == bad:
                    raise ValueError("a bad row")
                for j in range(batch.shape[1]):
                    dst[i, j] = batch[i, j]
            return dst

        return fails


class _ReturnsItsInput(_OwnMemory):
    """A compiled operation that doubles its input in place and returns it, not its own memory."""

    def generate_code(self) -> Callable[..., Any]:
        def doubles(batch, dst):  # type: ignore[no-untyped-def]
            for i in range(batch.shape[0]):
                for j in range(batch.shape[1]):
                    batch[i, j] = batch[i, j] * 2
            return batch

        return doubles


class _Scale(_OwnMemory):
    """A compiled operation multiplying by ``factor`` (read when its code is generated)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def generate_code(self) -> Callable[..., Any]:
        factor = self.factor

        def scale(batch, dst):  # type: ignore[no-untyped-def]
            for i in range(batch.shape[0]):
                for j in range(batch.shape[1]):
                    dst[i, j] = batch[i, j] * factor
            return dst

        return scale


class _ReturnsACount(_OwnMemory):
    """A compiled operation whose result is not an array (the rows it saw): valid, but not for the compiled loop."""

    def generate_code(self) -> Callable[..., Any]:
        def count(batch, dst):  # type: ignore[no-untyped-def]
            return batch.shape[0]

        return count


@pytest.mark.parametrize("num_workers", [1, 2])
@pytest.mark.parametrize("producers_run", [True, False])
def test_an_operation_failing_in_the_compiled_loop_names_the_sample(
    table_path: Path, num_workers: int, producers_run: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not producers_run:  # the loop makes the failing batch itself
        _idle_compiled_producers(monkeypatch)
    others = other_loaders_threads()
    bad_sample = 617
    pipelines = {"x": [NDArrayDecoder(), _Fails(bad_sample * 100.0), ToTensor()], "y": None}
    loader = Loader(table_path, batch_size=32, num_workers=num_workers, order=OrderOption.RANDOM, seed=3, pipelines=pipelines)
    it = iter(loader)
    assert isinstance(it, CompiledEpoch)
    with pytest.raises(LoaderError) as caught:
        for _ in it:
            pass
    assert caught.value.index == bad_sample and "a bad row" in str(caught.value)
    assert "_Fails" in str(caught.value)
    del it
    gc.collect()
    assert not [t for t in loader_threads() if t not in others], "a failed epoch leaves no thread behind"


@pytest.mark.parametrize("producers_run", [True, False])
def test_an_operation_returning_other_memory_goes_on_in_python(
    table_path: Path, producers_run: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop checks where each output is; other memory makes the epoch go on with the Python producers, same values."""
    if not producers_run:
        _idle_compiled_producers(monkeypatch)
    X, y = _table(table_path)
    pipelines = {"x": [NDArrayDecoder(), _ReturnsItsInput(), ToTensor()], "y": None}
    with Loader(table_path, batch_size=100, num_workers=2, order=OrderOption.RANDOM, seed=5, pipelines=pipelines) as loader:
        it = iter(loader)
        assert isinstance(it, CompiledEpoch)
        batches = [x.numpy().copy() for (x,) in it]
        assert loader._plan is not None and loader._plan.loop is None
        assert iter(loader)._plan.loop is None
        reference = _reference_batches(loader, 0, X, y)
        assert len(batches) == len(reference)
        for xb, (xr, _) in zip(batches, reference, strict=True):
            np.testing.assert_array_equal(xb, xr * 2)


@pytest.mark.parametrize("make_when_waiting", [True, False])
def test_a_loop_that_does_not_compile_goes_on_in_python(table_path: Path, make_when_waiting: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop cannot check where a non-array result is: it fails to compile, and the epoch runs in Python from its start.

    The compile error comes from the producers' threads or, making the first batch itself, from the loop's.
    """
    monkeypatch.setattr(_engine, "MAKE_WHEN_WAITING", make_when_waiting)
    pipelines = {"x": [NDArrayDecoder(), _ReturnsACount(), ToTensor()], "y": None}
    with Loader(table_path, batch_size=300, num_workers=2, pipelines=pipelines) as loader:
        it = iter(loader)
        assert isinstance(it, CompiledEpoch)
        assert [x for (x,) in it] == [300, 300, 300, 100]
        assert loader._plan is not None and loader._plan.loop is None and [x for (x,) in loader] == [300, 300, 300, 100]


def test_recompile_builds_the_loop_again_with_the_changed_operation(table_path: Path) -> None:
    X, _ = _table(table_path)
    scale = _Scale(2.0)
    with Loader(table_path, batch_size=1000, recompile=True, pipelines={"x": [NDArrayDecoder(), scale, ToTensor()], "y": None}) as loader:
        it = iter(loader)
        assert isinstance(it, CompiledEpoch)
        np.testing.assert_array_equal(next(it)[0].numpy(), X * 2)
        del it
        scale.factor = 3.0
        it = iter(loader)
        assert isinstance(it, CompiledEpoch)
        np.testing.assert_array_equal(next(it)[0].numpy(), X * 3)


def test_breaking_out_and_dropping_the_iterator_stops_the_epoch(table_path: Path) -> None:
    """The producers hold nothing of the loop's side: dropping it mid-epoch frees it (no finalizer runs: a Ctrl-C
    handled inside one would be lost); its producers make what they have tokens for and wait, and the next epoch
    stops them first and is whole."""
    X, y = _table(table_path)
    with Loader(table_path, batch_size=10, num_workers=2, order=OrderOption.RANDOM, seed=2) as loader:
        for _ in range(5):
            it = iter(loader)
            assert isinstance(it, CompiledEpoch)
            next(it)
            gone = weakref.ref(it)
            del it  # no close()
            assert gone() is None and loader._active is not None and loader._active() is None
            _check_epoch(loader, X, y)
        assert loader._pool is not None and not loader._pool.busy()


def test_exit_with_an_epoch_in_flight(table_path: Path) -> None:
    code = (
        "import sys\n"
        "from stoker.loader import Loader\n"
        "from stoker.loader._engine import CompiledEpoch\n"
        "loader = Loader(sys.argv[1], batch_size=4, num_workers=2, batches_ahead=2)\n"
        "it = iter(loader)\n"
        "assert isinstance(it, CompiledEpoch)\n"
        "next(it)\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(table_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


# ---- the primitives ---------------------------------------------------------------------------


@numba.njit(nogil=True)
def _producer(tokens: int, ready: int, addresses: np.ndarray, n: int, times: np.ndarray) -> None:
    for b in range(n):
        native.sem_wait(tokens)
        times[b] = native.monotonic_ns()
        out = numba.carray(native.address_as_pointer(addresses[b % addresses.shape[0]]), (4, 3), np.float32)
        for i in range(4):
            for j in range(3):
                out[i, j] = b * 10 + i + j
        native.sem_post(ready)


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_semaphores_hand_memory_between_compiled_and_python_threads(slots: int) -> None:
    """A compiled producer writes slot ``b % slots`` only after the Python side gave it a token: the values seen are batch b's."""
    sems = native.Semaphores([slots, 0])
    buffers = [np.zeros((4, 3), np.float32) for _ in range(slots)]
    addresses = np.array([b.ctypes.data for b in buffers], dtype=np.int64)
    n = 2000
    times = np.zeros(n, dtype=np.int64)
    thread = threading.Thread(target=_producer, args=(sems.address(0), sems.address(1), addresses, n, times))
    thread.start()
    expected = np.arange(4)[:, None] + np.arange(3)
    for b in range(n):
        sems.wait(1)
        np.testing.assert_array_equal(buffers[b % slots], b * 10 + expected)
        sems.post(0)
    thread.join()
    assert (np.diff(times) >= 0).all() and times[-1] > times[0]
    assert not sems.try_wait(1)
    with pytest.raises(IndexError):
        sems.address(2)


@numba.njit(nogil=True, parallel=True)
def _parallel_sum(a: np.ndarray) -> float:
    total = 0.0
    for i in numba.prange(a.shape[0]):
        total += a[i]
    return total


def test_serial_twin_is_a_separate_serial_function() -> None:
    twin = serial_twin(_parallel_sum)
    assert twin is not _parallel_sum and serial_twin(_parallel_sum) is twin
    assert not twin.targetoptions.get("parallel") and twin.py_func.__qualname__ == "_parallel_sum_serial"
    a = np.arange(1000, dtype=np.float64)
    assert twin(a) == _parallel_sum(a) == a.sum()
    assert serial_twin(twin) is twin  # not parallel: itself
    assert serial_twin(len) is len  # not compiled: itself


@pytest.mark.compiled_loop
@pytest.mark.parametrize("num_workers", [1, 2, 4])
def test_producers_with_one_thread_each_call_the_serial_twins(table_path: Path, num_workers: int) -> None:
    """One thread per producer: the loop calls the serial twins; more threads each: the parallel functions."""
    with Loader(table_path, batch_size=64, num_workers=num_workers) as loader:
        list(loader)
        plan = loader._plan
        assert plan is not None and plan.loop is not None
        called = plan.loop.py_func.__globals__["f0"]  # type: ignore[union-attr]
        serial = num_workers // loader._producers == 1
        code = loader.pipelines[0].compiled_code(serial=serial)
        # the loop calls the head by symbol: the stand-in of that function (see stoker.pipeline.linking)
        assert called is linking.swap(code)
        assert bool(code.targetoptions.get("parallel")) is not serial


@numba.njit(nogil=True)
def _count_with_cas(counter: np.ndarray, n: int) -> int:
    """Add 1 to ``counter[0]`` ``n`` times, each by compare-and-swap retried until it lands; returns the retries."""
    retries = 0
    address = counter.ctypes.data
    for _ in range(n):
        while True:
            seen = native.compare_and_swap(address, -1, -1)  # an atomic read (the counter is never -1)
            if native.compare_and_swap(address, seen, seen + 1) == seen:
                break
            retries += 1
    return retries


def test_compare_and_swap_is_atomic_between_threads() -> None:
    """Two threads add to one counter by compare-and-swap: no addition is lost (a plain read-then-write loses many)."""
    n = 2_000_000
    _count_with_cas(np.zeros(1, np.int32), 1)  # compiled before the race
    contended = False
    for _ in range(10):  # until the two threads have run at the same time at least once (a busy machine may serialise them)
        counter = np.zeros(1, np.int32)
        retries = [0, 0]

        def add(t: int, counter: np.ndarray = counter, retries: list[int] = retries) -> None:
            retries[t] = _count_with_cas(counter, n)

        threads = [threading.Thread(target=add, args=(t,)) for t in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert int(counter[0]) == 2 * n
        contended = sum(retries) > 0
        if contended:
            break
    assert contended, "the threads never contended: nothing was tested"
    flags = np.zeros(3, np.int32)
    assert native.claim(flags, 1) and not native.claim(flags, 1) and list(flags) == [0, 1, 0]
    with pytest.raises(IndexError):
        native.claim(flags, 3)


@settings(max_examples=60, deadline=None)
@given(flags=st.lists(st.integers(0, 1), max_size=12), data=st.data())
def test_claim_first_claims_the_first_unclaimed_in_its_range(flags: list[int], data: st.DataObject) -> None:
    lo = data.draw(st.integers(0, len(flags)))
    hi = data.draw(st.integers(lo, len(flags)))
    array = np.array(flags, dtype=np.int32)
    free = [k for k in range(lo, hi) if flags[k] == 0]
    k = native.claim_first(array, lo, hi)
    expected = list(flags)
    if free:
        expected[free[0]] = 1
    assert k == (free[0] if free else -1) and list(array) == expected
    with pytest.raises(IndexError):
        native.claim_first(array, 0, len(flags) + 1)
