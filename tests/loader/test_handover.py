"""The loop's fast hand-over (``stoker.loader._handover``) and the ring's counter of batches taken (issue 45).

* Against a numpy model of the epoch (``loader.epoch_indices``): every batch right, a batch
  the user holds never overwritten, ``break``, a failing tail and Ctrl-C in a tail ending
  the epoch safely, the next epoch whole, the accounting counting every batch; hypothesis
  over producers (1-2), batches ahead, held batches, where the epoch stops and how.
* The fast path is the one taken once a batch is ready (waiting for its status, never
  for a time), and gives what the slow path gives.
* The counter of batches taken (``CONSUMED``) with producers that sleep: a producer asleep
  is woken once the loop has taken enough (hysteresis), never makes a batch whose slot the
  loop may still hold, and no wake is missed (a consumer that waits, holds, breaks, and an
  end from another thread: every thread returns).
"""

from __future__ import annotations

import functools
import os
import threading
import time
import traceback
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from stoker.decoders import IntDecoder
from stoker.errors import LoaderError
from stoker.fields import IntField
from stoker.loader import Loader, OrderOption, _engine, _epoch, _handover, _producers
from stoker.loader._ring import CONSUMED, DONE, LOOP_CLAIM, SLEEPING, WAKE_AT, End, RingMemory, SlotRing, wake_after
from stoker.observe._recorder import BLOCKED, LOOP_MADE, MAKER, ROWS, STEP_FIXED, T_ENTER, T_EXIT, T_READY
from stoker.pipeline import native
from stoker.pipeline.operation import Operation
from stoker.transforms import Squeeze, ToTensor
from stoker.writer import DatasetWriter

from .._profile import examples

pytestmark = [pytest.mark.skipif(not native.available(), reason="the compiled producer loop needs Linux"), pytest.mark.compiled_loop]

N = 300
#: a generous bound on any wait for another thread (the test fails with a message past it, it never times anything)
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def ints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``y`` = ``0 ... N-1`` (seed 003's data, smaller)."""
    path = tmp_path_factory.mktemp("handover") / "ints.stoker"
    DatasetWriter(path, {"y": IntField()}, num_workers=1, progress=False).from_indexed_dataset([(i,) for i in range(N)])
    return path


def _until(cond: Any, what: str) -> None:
    """Wait for another thread's progress (a condition, not a time: the bound only turns a hang into a failure)."""
    end = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < end, f"no {what} within {DEADLINE_S} s"
        time.sleep(0.0005)


class _Trip:
    """A tail step (a callable) that raises ``error`` on its ``at``-th call, else returns its input."""

    def __init__(self, at: int | None, error: type[BaseException]) -> None:
        self.at, self.error, self.calls = at, error, 0

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            raise self.error("tripped")
        return t


@settings(max_examples=examples(10, 60), deadline=None)
@example(num_workers=1, batch_size=16, squeeze=True, ahead=2, holds=8, stop_at=None, how="break")  # more than the spare slots
@given(
    num_workers=st.integers(1, 2),
    batch_size=st.sampled_from([7, 16, 50]),
    squeeze=st.booleans(),
    ahead=st.integers(1, 4),
    holds=st.integers(0, 8),
    stop_at=st.one_of(st.none(), st.integers(0, 45)),
    how=st.sampled_from(["break", "error", "interrupt"]),
)
def test_the_fast_hand_over_against_the_model(
    ints: Path, num_workers: int, batch_size: int, squeeze: bool, ahead: int, holds: int, stop_at: int | None, how: str
) -> None:  # fmt: skip
    trip = _Trip(None, ValueError)
    tail: list[Any] = [ToTensor()] + ([Squeeze()] if squeeze else [])
    if stop_at is not None and how != "break":
        trip = _Trip(stop_at + 1, ValueError if how == "error" else KeyboardInterrupt)
        tail.append(trip)
    with Loader(ints, batch_size=batch_size, num_workers=num_workers, order=OrderOption.RANDOM, seed=5,
                batches_ahead=ahead, pipelines={"y": [IntDecoder(), *tail]}) as loader:  # fmt: skip
        rec = loader._recorder
        epoch = loader._next_epoch
        order = loader.epoch_indices(epoch)
        it = iter(loader)
        assert it._fast is not None, "the fast hand-over applies to this pipeline"  # type: ignore[attr-defined]
        count0 = rec.count if rec is not None else 0
        kept: list[tuple[int, torch.Tensor, np.ndarray]] = []  # (batch, the tensor as handed out, its values then)
        handed = 0
        raised: BaseException | None = None
        try:
            for b, (y,) in enumerate(it):
                idx = order[b * batch_size : (b + 1) * batch_size]
                assert y.shape == ((len(idx),) if squeeze else (len(idx), 1)) and y.dtype == torch.int64
                np.testing.assert_array_equal(y.reshape(-1).numpy(), idx)
                handed += 1
                kept.append((b, y, y.numpy().copy()))
                if len(kept) > holds:
                    kept.pop(0)
                del y
                if how == "break" and b == stop_at:
                    break
        except (LoaderError, KeyboardInterrupt) as exc:
            raised = exc
        for b, y, values in kept:  # held while later batches were made: never overwritten
            np.testing.assert_array_equal(y.numpy(), values, err_msg=f"held batch {b} was overwritten")
        n_batches = -(-N // batch_size)
        stopped = stop_at is not None and stop_at < n_batches
        if stopped and how == "error":
            assert isinstance(raised, LoaderError) and "tripped" in str(raised), raised
        elif stopped and how == "interrupt":
            assert isinstance(raised, KeyboardInterrupt)
        else:
            assert raised is None
        assert handed == (stop_at + (how == "break") if stopped else n_batches)
        if rec is not None:  # the accounting counted every batch handed over (either path)
            assert rec.count - count0 == handed
        assert it._fast.hits <= handed  # type: ignore[attr-defined]
        del it, kept
        trip.at = None
        # the next epoch: whole and right, whatever ended this one
        order = loader.epoch_indices(loader._next_epoch)
        got = np.concatenate([y.reshape(-1).numpy().copy() for (y,) in loader])
        np.testing.assert_array_equal(got, order)
        assert loader._pool is None or not loader._pool.busy()


@pytest.mark.parametrize("num_workers", [1, 2])
@pytest.mark.parametrize("squeeze", [False, True])
def test_a_ready_batch_takes_the_fast_path_and_gives_what_the_slow_path_gives(
    ints: Path, num_workers: int, squeeze: bool, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    """The loop waits until each batch's status is set (a condition, not a time), then takes it: every full batch but
    the loop's own first goes through the fast hand-over; the same loader with the fast path off gives equal batches."""
    tail: list[Any] = [ToTensor()] + ([Squeeze()] if squeeze else [])

    def epoch_batches(fast: bool) -> tuple[list[np.ndarray], int]:
        with Loader(ints, batch_size=32, num_workers=num_workers, order=OrderOption.RANDOM, seed=11,
                    pipelines={"y": [IntDecoder(), *tail]}) as loader:  # fmt: skip
            it = iter(loader)
            if not fast:
                it._fast = None  # type: ignore[attr-defined]
            out = []
            ring = it._ring  # type: ignore[attr-defined]
            own_first = it._first_claimed  # type: ignore[attr-defined]
            for c in range(len(it)):
                if not (c == ring.skip and own_first):  # (the loop makes its first batch itself: the slow path)
                    _until(lambda c=c, ring=ring: ring.status[c] == DONE, f"batch {c} made")
                (y,) = next(it)
                out.append(y.numpy().copy())
            hits = it._fast.hits + int(own_first) if fast else 0  # type: ignore[attr-defined]
            with pytest.raises(StopIteration):
                next(it)
            return out, hits

    fast, hits = epoch_batches(True)
    slow, _ = epoch_batches(False)
    full = N // 32
    assert hits == full, f"{hits} of {full} ready full batches took the fast path (the loop's own first counted)"
    assert len(fast) == len(slow) == -(-N // 32)
    for a, b in zip(fast, slow, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("num_workers", [1, 2])
def test_compiled_producers_that_sleep_every_batch_are_woken_and_batches_stay_right(
    ints: Path, num_workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    """No spin: after each batch the loop waits until every producer with a batch left sleeps (a condition); then the
    next batches wake them (hysteresis, or the loop's fenced wake before it waits). Every batch right, no hang."""
    monkeypatch.setattr(_producers, "SPIN_NS", 0)
    monkeypatch.setattr(_engine, "MAKE_WHEN_WAITING", False)  # every batch made by a producer
    with Loader(ints, batch_size=10, num_workers=num_workers, order=OrderOption.RANDOM, seed=2, batches_ahead=2,
                pipelines={"y": [IntDecoder(), ToTensor(), Squeeze()]}) as loader:  # fmt: skip
        for _ in range(2):
            order = loader.epoch_indices(loader._next_epoch)
            it = iter(loader)
            ring = it._ring  # type: ignore[attr-defined]
            sleeps = 0
            for c in range(len(it)):
                (y,) = next(it)
                np.testing.assert_array_equal(y.numpy(), order[c * 10 : (c + 1) * 10])
                for t in range(ring.producers):  # a producer whose next batch may not be made yet must fall asleep

                    def left(t: int = t, ring: Any = ring) -> list[int]:
                        return [b for b in range(ring.skip + t, ring.n_batches, ring.producers) if ring.status[b] != DONE]

                    # (first every batch the ring lets it make: on a busy machine a producer may still be behind)
                    _until(lambda left=left, ring=ring: not left() or left()[0] >= ring.ctl[CONSUMED] + ring.span,
                           f"producer {t} made the batches the ring lets it make")  # fmt: skip
                    if left():
                        _until(lambda t=t, ring=ring: ring.ctl[SLEEPING(t)] == 1, f"producer {t} asleep before batch {left()[0]}")
                        sleeps += 1
            assert sleeps > 0
            with pytest.raises(StopIteration):
                next(it)
            del it


class _SleepEach(Operation):
    """A compiled copy that takes ``ms`` milliseconds longer for every batch (a producer slower than the loop)."""

    reentrant = True

    def __init__(self, ms: int) -> None:
        self.ms = ms

    def declare_state_and_memory(self, previous_state: Any) -> Any:
        from stoker.pipeline.allocation_query import AllocationQuery

        return previous_state, AllocationQuery(previous_state.shape, previous_state.dtype)

    def generate_code(self) -> Any:
        ns, clock = self.ms * 1_000_000, native.monotonic_ns

        def slow(batch, dst):  # type: ignore[no-untyped-def]
            end = clock() + ns
            while clock() < end:
                pass
            dst[:] = batch
            return dst

        return slow


class _Gated:
    """A producer's job that starts once ``gate`` is set (or its epoch has ended): the producers of an epoch that are
    still starting (a thread waking up, its GIL)."""

    def __init__(self, job: Any, gate: threading.Event) -> None:
        self.job, self.gate = job, gate

    def run(self) -> None:
        ring = self.job.batches.ring
        _until(lambda: self.gate.is_set() or ring.end is not None, "the gate opened or the epoch ended")
        self.job.run()


def _gated_submit(gate: threading.Event) -> Any:
    """A patch of the producers' ``submit``: each job waits for ``gate`` (or the epoch's end) before it runs."""
    real = _epoch._Producers.submit
    return mock.patch.object(_epoch._Producers, "submit", lambda self, t, job: real(self, t, _Gated(job, gate)))


@settings(max_examples=examples(8, 40), deadline=None)
@example(num_workers=1, ahead=1, gate_after=6, holds=2, stop_at=None)  # one batch ahead: made one at a time
@given(
    num_workers=st.integers(1, 2),
    ahead=st.integers(1, 5),
    gate_after=st.integers(1, 25),
    holds=st.integers(0, 6),
    stop_at=st.one_of(st.none(), st.integers(0, 30)),
)
def test_before_the_producers_start_the_loop_makes_the_next_batches_in_one_call(
    ints: Path, num_workers: int, ahead: int, gate_after: int, holds: int, stop_at: int | None
) -> None:  # fmt: skip
    """The producers of an epoch start late (held here until batch ``gate_after`` is handed over): the loop makes the
    batches itself meanwhile, those after the one it needs in the same compiled call (claimed ``LOOP_CLAIM``, handed
    over by the fast path as the loop's in the accounting, never spun for), then the producers make the rest. Every
    batch the model's, held batches never overwritten, ``break`` safe, the next epoch whole."""
    gate = threading.Event()
    gated = _gated_submit(gate)
    # (runs as long as the slots allow, whatever this machine's load makes a batch take: the bound by time has its own
    # test, test_the_loops_run_at_an_epochs_start_is_bounded_by_its_batches_time)
    unbounded = mock.patch.object(_engine, "MAKE_RUN_NS", 10**15)
    bs = 10
    with gated, unbounded, mock.patch.dict(os.environ, AS_SET), Loader(ints, batch_size=bs, num_workers=num_workers, order=OrderOption.RANDOM,
                                                     seed=7, batches_ahead=ahead,
                                                     pipelines={"y": [IntDecoder(), ToTensor(), Squeeze()]}) as loader:  # fmt: skip
        rec = loader._recorder
        assert rec is not None
        order = loader.epoch_indices(loader._next_epoch)
        it = iter(loader)
        ring, fast, base = it._ring, it._fast, it._rec_base  # type: ignore[attr-defined]
        assert fast is not None
        span = ring.producers * ring.ahead
        kept: list[tuple[int, torch.Tensor, np.ndarray]] = []
        for b, (y,) in enumerate(it):
            np.testing.assert_array_equal(y.numpy(), order[b * bs : (b + 1) * bs], err_msg=f"batch {b}")
            kept.append((b, y, y.numpy().copy()))
            if len(kept) > holds:
                kept.pop(0)
            del y
            if b + 1 == gate_after:  # no producer has run: every batch so far the loop's
                assert fast.spins == 0 and not fast.running
                assert all(ring.claims[c] in (1, LOOP_CLAIM) for c in range(b + 1))
                if span >= 2 and b >= 2:  # (batch 1 made alone, 2 with it in one call)
                    assert ring.claims[2] == LOOP_CLAIM
                for c in range(b + 1):
                    assert rec.steps[(base + c) % ROWS][MAKER] == LOOP_MADE, (c, rec.steps[(base + c) % ROWS])
                gate.set()
            if b == stop_at:
                break
        for b, y, values in kept:  # held while later batches were made: never overwritten
            np.testing.assert_array_equal(y.numpy(), values, err_msg=f"held batch {b} was overwritten")
        del it, kept
        gate.set()
        order = loader.epoch_indices(loader._next_epoch)
        got = np.concatenate([y.numpy().copy() for (y,) in loader])
        np.testing.assert_array_equal(got, order)


@pytest.mark.parametrize("batch_ms", [0, 2])
def test_the_loops_run_at_an_epochs_start_is_bounded_by_its_batches_time(
    ints: Path, batch_ms: int, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    """The batches the loop makes in one call at an epoch's start (the one it needs, then the next ones no producer has
    started) take about ``MAKE_RUN_NS`` at most, by the time its last batch took: batches of 2 ms, a bound of 3 ms, and
    each call makes one batch (the one the loop needs waits for no other); batches of microseconds under a bound of
    1,000 s (whatever a busy machine makes them take), several."""
    monkeypatch.setattr(_engine, "MAKE_RUN_NS", 3_000_000 if batch_ms else 10**12)
    gate = threading.Event()
    steps: list[Any] = [IntDecoder(), _SleepEach(batch_ms)] if batch_ms else [IntDecoder()]
    with _gated_submit(gate), mock.patch.dict(os.environ, AS_SET), Loader(ints, batch_size=10, num_workers=1, order=OrderOption.RANDOM, seed=3,
                                                     batches_ahead=8, pipelines={"y": [*steps, ToTensor(), Squeeze()]}) as loader:  # fmt: skip
        order = loader.epoch_indices(loader._next_epoch)
        it = iter(loader)
        ring = it._ring  # type: ignore[attr-defined]
        for b in range(8):  # the producers held back: the loop makes every batch
            (y,) = next(it)
            np.testing.assert_array_equal(y.numpy(), order[b * 10 : (b + 1) * 10])
        claimed = [int(ring.claims[b]) for b in range(8)]
        gate.set()
        assert ring.memory.loop_batch_ns >= batch_ms * 1_000_000  # (its fields' time)
        if batch_ms:
            assert LOOP_CLAIM not in claimed, f"2 ms batches made several to a call under a 3 ms bound: {claimed}"
        else:
            assert claimed.count(LOOP_CLAIM) >= 6, f"batches of microseconds made one to a call: {claimed}"
        del y
        it.close()  # type: ignore[attr-defined]


def _take(it: Any, order: np.ndarray, bs: int, b: int, kept: list[tuple[int, torch.Tensor, np.ndarray]], holds: int) -> None:
    """``next(it)``: batch ``b`` of ``order``, checked; kept (with a copy of its values) among the last ``holds``."""
    (y,) = next(it)
    np.testing.assert_array_equal(y.numpy(), order[b * bs : (b + 1) * bs], err_msg=f"batch {b}")
    kept.append((b, y, y.numpy().copy()))
    if len(kept) > holds:
        kept.pop(0)


@settings(max_examples=examples(6, 30), deadline=None)
@given(
    num_workers=st.integers(1, 2),
    ahead=st.integers(1, 5),
    bound=st.sampled_from(["hours", "one batch", "none"]),
    holds=st.integers(0, 4),
)
def test_while_a_producer_makes_the_batch_it_needs_the_loop_makes_the_next_ones_in_one_call(
    ints: Path, num_workers: int, ahead: int, bound: str, holds: int
) -> None:  # fmt: skip
    """Batch 1 claimed by a producer that has not made it yet (here: claimed by the test, the producers held back):
    the loop, waiting for it, makes the batches after it that no producer has started in one compiled call (the first
    claimed before the call, the others claimed inside it: ``LOOP_CLAIM``): as many as the slots allow under a
    ``WAIT_RUN_NS`` of hours, ``producers + 1`` batches under one of the loop's last batch's time, one batch alone
    under less; they are handed over as the loop's, every batch the model's, held batches never overwritten, the next
    epoch whole. (Made one call each, every one of them would be claimed before its call.)"""
    gate = threading.Event()
    patches = (
        mock.patch.object(_engine, "WAIT_RUN_NS", 10**15 if bound == "hours" else 0),
        mock.patch.object(_engine, "MAKE_RUN_NS", 0),  # (the epoch's start: one batch to a call)
        _gated_submit(gate),
    )
    bs = 10
    with patches[0], patches[1], patches[2], mock.patch.dict(os.environ, AS_SET), Loader(ints, batch_size=bs, num_workers=num_workers, order=OrderOption.RANDOM,
                                                     seed=5, batches_ahead=ahead,
                                                     pipelines={"y": [IntDecoder(), ToTensor(), Squeeze()]}) as loader:  # fmt: skip
        rec = loader._recorder
        assert rec is not None
        order = loader.epoch_indices(loader._next_epoch)
        it = iter(loader)
        ring, base = it._ring, it._rec_base  # type: ignore[attr-defined]
        span = ring.producers * ring.ahead
        kept: list[tuple[int, torch.Tensor, np.ndarray]] = []
        _take(it, order, bs, 0, kept, holds)
        assert ring.claim(1)  # a producer's claim on batch 1, its batch not made yet
        if bound == "one batch":
            _engine.WAIT_RUN_NS = ring.memory.loop_batch_ns  # (batch 0's time: the loop's last batch)
        assert not it._work_while_waiting(1, ring.producer_of(1))  # type: ignore[attr-defined]  # (1 is never made meanwhile)
        hi = min(ring.n_batches, 1 + span)  # (the slots free while batch 1 is not taken)
        run = {"hours": max(1, hi - 2), "one batch": ring.producers + 1, "none": 1}[bound]  # batches to a call
        claims = [int(ring.claims[b]) for b in range(2, hi)]
        assert claims == [1 if i % run == 0 else LOOP_CLAIM for i in range(hi - 2)], (claims, run)
        assert all(ring.status[b] == DONE for b in range(2, hi))
        it._make(1)  # type: ignore[attr-defined]  # (the "producer" makes batch 1: the loop then takes it as made)
        gate.set()
        for b in range(1, ring.n_batches):
            _take(it, order, bs, b, kept, holds)
            if 2 <= b < hi:
                assert rec.steps[(base + b) % ROWS][MAKER] == LOOP_MADE, (b, rec.steps[(base + b) % ROWS])
        with pytest.raises(StopIteration):
            next(it)
        for b, y, values in kept:  # held while later batches were made: never overwritten
            np.testing.assert_array_equal(y.numpy(), values, err_msg=f"held batch {b} was overwritten")
        del it, kept
        order = loader.epoch_indices(loader._next_epoch)
        got = np.concatenate([y.numpy().copy() for (y,) in loader])
        np.testing.assert_array_equal(got, order)


@pytest.mark.parametrize("num_workers", [1, 2])
def test_the_loop_waits_a_moment_for_a_running_producer_a_little_behind(
    ints: Path, num_workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    """Once a producer has handed a batch over, a batch it has not finished yet is waited for in the fast path (a spin
    of up to ``LOOP_SPIN_NS``, here long: every batch is a producer's and takes 2 ms) rather than made by the loop;
    every batch right. With no spin, none is spun for; nor when the loop's own last batch took longer than the spin
    (the slow path makes a batch meanwhile: Otto's 40 us batches spun 10 us for nothing before each)."""
    monkeypatch.setattr(_engine, "MAKE_WHEN_WAITING", False)  # (the loop makes no batch: each one waited for)

    def epoch(spin_ns: int, loop_batch_ns: int = 0) -> int:
        monkeypatch.setattr(_handover, "LOOP_SPIN_NS", spin_ns)
        with Loader(ints, batch_size=10, num_workers=num_workers, order=OrderOption.RANDOM, seed=4, batches_ahead=2,
                    pipelines={"y": [IntDecoder(), _SleepEach(2), ToTensor(), Squeeze()]}) as loader:  # fmt: skip
            order = loader.epoch_indices(loader._next_epoch)
            it = iter(loader)
            fast, ring = it._fast, it._ring  # type: ignore[attr-defined]
            assert fast is not None
            ring.memory.loop_batch_ns = loop_batch_ns  # (the loop's last batch: none made here, as if it had)
            for c in range(len(it)):
                if not fast.running and c + 1 < ring.n_batches:  # until a batch was handed over ready: wait for it
                    _until(lambda c=c, ring=ring: ring.status[c] == DONE, f"batch {c} made")
                (y,) = next(it)
                np.testing.assert_array_equal(y.numpy(), order[c * 10 : (c + 1) * 10])
            with pytest.raises(StopIteration):
                next(it)
            return int(fast.spins)

    assert epoch(60 * 10**9) > 0
    assert epoch(0) == 0
    assert epoch(60 * 10**9, loop_batch_ns=60 * 10**9 + 1) == 0


# ---- the ring's counter, with Python producers ------------------------------------------------


class _Field:
    """A pipeline's slot memory as the ring sees it (see ``test_ring.py``)."""

    def __init__(self, num_slots: int, width: int = 4) -> None:
        import sys

        self._refs = sys.getrefcount
        self.width = width
        self.memory_generation = 0
        self._views = [np.zeros(width, dtype=np.int64) for _ in range(num_slots)]
        self._baseline = [self._refs(v) for v in self._views]

    def slot_in_use(self, slot: int) -> bool:
        return self._refs(self._views[slot]) != self._baseline[slot]

    def renew_slot(self, slot: int) -> None:
        self._views[slot] = np.zeros(self.width, dtype=np.int64)
        self._baseline[slot] = self._refs(self._views[slot])
        self.memory_generation += 1


def test_a_sleeping_producer_is_woken_once_half_the_batches_ahead_are_left() -> None:
    """Single thread, the words set by hand: ``give_token`` posts the sleeper's semaphore at ``WAKE_AT`` and not before."""
    for producers, ahead in [(1, 1), (1, 4), (2, 3), (1, 8)]:
        span = producers * ahead
        ring = SlotRing(RingMemory(span + 2, 0, producers), [_Field(span + 2)], None, 100, 0, 0, producers, ahead, [0])  # type: ignore[list-item]
        b = span  # producer 0's first batch it may not make yet (b == CONSUMED + span)
        b -= b % producers
        ring.ctl[WAKE_AT(0)] = wake_after(b, span)
        ring.ctl[SLEEPING(0)] = 1
        assert wake_after(b, span) >= b - span + 1  # woken no earlier than when b may be made
        for c in range(wake_after(b, span)):
            assert not ring.sems.try_wait(0), f"woken after {c} of {wake_after(b, span)} batches ({producers}x{ahead})"
            ring.give_token(c)
        assert ring.sems.try_wait(0) and ring.ctl[SLEEPING(0)] == 0
        assert ring.ctl[CONSUMED] == wake_after(b, span)
        ring.set_end(End("closed"))


@pytest.mark.parametrize("producers", [1, 2])
def test_the_loop_wakes_a_producer_whose_wake_was_missed_before_it_waits(producers: int) -> None:
    """The race the loop's fence covers, set up by hand: producer 0 went to sleep for batch 2 (it read an old CONSUMED)
    while the loop's store of CONSUMED and its read of SLEEPING passed each other, so no wake was posted, and its
    WAKE_AT is behind. The loop, about to wait for batch 2, wakes it first: the batch arrives (no hang)."""
    field = _Field(producers * 2 + 2)
    ring = SlotRing(RingMemory(producers * 2 + 2, 0, producers), [field], None, 10, 0, 0, producers, 2, [0])  # type: ignore[list-item]
    b = 2 * producers  # producer 0's batch just past CONSUMED + span when CONSUMED was 0
    ring.ctl[CONSUMED] = b  # the loop took batches 0 .. b-1 (made by someone: not modelled here)
    ring.ctl[WAKE_AT(0)] = wake_after(b, ring.span)
    ring.ctl[SLEEPING(0)] = 1

    def producer() -> None:  # asleep, as take_token leaves it
        ring.sems.wait(0)
        ring.ctl[SLEEPING(0)] = 0
        if ring.stop[0] == 0:
            field._views[ring.slot(b)][:] = b
            ring.finish(b, DONE)
            ring.made(0, b)

    sleeper = threading.Thread(target=producer)
    loop = threading.Thread(target=ring.wait_ready, args=(b,))
    sleeper.start()
    loop.start()
    loop.join(timeout=DEADLINE_S)
    woke = not loop.is_alive()
    ring.set_end(End("closed"))  # (unblocks both if the wake was lost)
    loop.join(timeout=DEADLINE_S)
    sleeper.join(timeout=DEADLINE_S)
    assert woke, f"the loop waited for batch {b} without waking its sleeping producer (no batch within {DEADLINE_S} s)"
    assert ring.status[b] == DONE and (field._views[ring.slot(b)] == b).all()


@settings(max_examples=examples(40, 300), deadline=None)
@given(
    n_batches=st.integers(1, 60),
    producers=st.integers(1, 2),
    ahead=st.integers(1, 8),
    holds=st.integers(0, 3),
    pauses=st.lists(st.integers(0, 59), max_size=8),
    waits=st.booleans(),
    end_at=st.one_of(st.none(), st.integers(0, 60)),
    end_kind=st.sampled_from(["break", "closed"]),
)
def test_no_wake_is_missed_and_no_slot_is_written_early(
    n_batches: int, producers: int, ahead: int, holds: int, pauses: list[int], waits: bool, end_at: int | None, end_kind: str
) -> None:  # fmt: skip
    """Python producers sleep at once (no spin); the consumer takes batches in order (a status read, else it waits), holds
    some, lets the producers fall asleep at drawn batches (waits for it: a condition), and the epoch ends at the end, by
    a break, or by ``set_end`` from another thread. Checked: every batch right, a held one never overwritten, no batch
    made before its slot may be written (``b < CONSUMED + span``), every thread returns."""
    span = producers * ahead
    num_slots = span + 2 + holds
    field = _Field(num_slots)
    ring = SlotRing(RingMemory(num_slots, 0, producers), [field], None, n_batches, 0, 0, producers, ahead, [0])  # type: ignore[list-item]
    early: list[tuple[int, int]] = []

    def producer(t: int) -> None:
        for b in range(t, n_batches, producers):
            if not ring.take_token(t, b):
                return
            if b >= ring.ctl[CONSUMED] + span:
                early.append((b, int(ring.ctl[CONSUMED])))
            if not ring.claim(b):
                continue
            field._views[ring.slot(b)][:] = b
            ring.finish(b, DONE)
            ring.made(t, b)

    threads = [threading.Thread(target=producer, args=(t,)) for t in range(producers)]
    for thread in threads:
        thread.start()
    kept: list[tuple[int, np.ndarray]] = []
    seen = []
    try:
        for c in range(n_batches):
            if end_kind == "closed" and c == end_at:
                closer = threading.Thread(target=ring.set_end, args=(End("closed", by_other_thread=True),))
                closer.start()
                closer.join()
            if not ring.try_ready(c):
                if not waits and ring.claim(c):  # the loop makes it itself
                    field._views[ring.slot(c)][:] = c
                    ring.finish(c, DONE)
                else:
                    ring.wait_ready(c)
            if ring.end is not None:
                break
            batch = field._views[ring.slot(c)]
            ring.give_token(c)
            assert (batch == c).all(), f"batch {c} holds {batch[0]}"
            for b, v in kept:
                assert (v == b).all(), f"held batch {b} was overwritten"
            seen.append(c)
            kept.append((c, batch))
            del batch
            if len(kept) > holds + 1:
                kept.pop(0)
            if c in pauses:  # every producer with a batch it may not make yet falls asleep (or has returned)
                for t in range(producers):
                    _until(lambda t=t: ring.ctl[SLEEPING(t)] == 1 or not threads[t].is_alive()
                           or all(b < ring.ctl[CONSUMED] + span for b in range(t, n_batches, producers)
                                  if ring.status[b] != DONE), f"producer {t} asleep")  # fmt: skip
            if end_kind == "break" and c == end_at:
                break
    finally:
        ring.set_end(End("closed"))
        for thread in threads:
            thread.join(timeout=DEADLINE_S)
    assert not any(thread.is_alive() for thread in threads), "a producer was left waiting"
    assert not early, f"batches made before their slot was free: {early}"
    stop = n_batches if end_at is None or end_at >= n_batches else end_at + (end_kind == "break")
    assert seen == list(range(stop))


def test_the_fast_path_is_off_where_it_does_not_apply(ints: Path) -> None:
    """Extras (here the samples' indices) are fresh tensors per batch: the slow path hands those batches over."""
    with Loader(ints, batch_size=64, num_workers=2, order=OrderOption.RANDOM, seed=4, return_indices=True,
                pipelines={"y": [IntDecoder(), ToTensor(), Squeeze()]}) as loader:  # fmt: skip
        order = loader.epoch_indices(loader._next_epoch)
        it = iter(loader)
        assert it._fast is None  # type: ignore[attr-defined]
        got = [batch for batch in it]
        np.testing.assert_array_equal(np.concatenate([b[0].numpy() for b in got]), order)


class _Interrupt:
    """Wraps a callable: raises KeyboardInterrupt on its ``at``-th call (Ctrl-C arriving there)."""

    def __init__(self, fn: Any, at: int) -> None:
        self.fn, self.at, self.calls = fn, at, 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return self.fn(*args)


@pytest.mark.parametrize("where", ["slot_in_use", "post", "tail", "keep_tail"])
@pytest.mark.parametrize("at", [2, 3])  # (the first batch may be the loop's own: the slow path)
def test_ctrl_c_inside_the_fast_hand_over_ends_the_epoch_safely(
    ints: Path, where: str, at: int, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    """KeyboardInterrupt at the fast path's points (checking the slot of a later batch, waking a sleeping producer, a
    tail step, keeping a slot's tail output made once): it leaves next() as itself, no producer is left running, the
    loader iterates the next epoch whole."""
    monkeypatch.setattr(_producers, "SPIN_NS", 0)  # producers sleep at once: the loop wakes them (`post`)
    with Loader(ints, batch_size=10, num_workers=2, order=OrderOption.RANDOM, seed=9, batches_ahead=1,
                pipelines={"y": [IntDecoder(), ToTensor(), Squeeze()]}) as loader:  # fmt: skip
        it = iter(loader)
        fast = it._fast  # type: ignore[attr-defined]
        ring = it._ring  # type: ignore[attr-defined]
        if where in ("slot_in_use", "keep_tail"):
            p = loader.pipelines[0]
            monkeypatch.setattr(p, where, _Interrupt(getattr(p, where), at))
        elif where == "post":
            fast.post = _Interrupt(fast.post, at)
        else:
            step = fast.tails[0][3][0]
            fast.tails[0][3][0] = (step[0], _Interrupt(step[1], at), *step[2:])
        interrupted = []
        try:
            for c in range(len(it)):
                if c > ring.skip:  # (the batch ready: the fast path takes it)
                    _until(lambda c=c: ring.status[c] == DONE or ring.end is not None, f"batch {c} made")
                next(it)
        except KeyboardInterrupt as exc:
            interrupted.append(traceback.extract_tb(exc.__traceback__))
        assert len(interrupted) == 1
        assert any(f.filename.endswith("_handover.py") for f in interrupted[0]), "interrupted inside the fast path"
        assert loader._pool is not None and not loader._pool.busy()
        monkeypatch.undo()
        del it, fast
        order = loader.epoch_indices(loader._next_epoch)
        got = np.concatenate([y.numpy().copy() for (y,) in loader])
        np.testing.assert_array_equal(got, order)


def test_the_ring_words_from_python_and_compiled_code() -> None:
    """``exchange``/``fenced_load``/``store`` (Python's side) and the compiled intrinsics read and write the same words."""
    import numba

    words = np.zeros(4, dtype=np.int64)
    assert native.exchange(words, 1, 7) == 0 and native.exchange(words, 1, 9) == 7 and words[1] == 9
    native.store(words, 2, -3)
    assert native.fenced_load(words, 2) == -3 and list(words) == [0, 9, -3, 0]
    with pytest.raises(IndexError):
        native.exchange(words, 4, 1)

    @numba.njit(nogil=True)
    def compiled(a: np.ndarray, s: np.ndarray) -> int:
        base = a.ctypes.data
        native.atomic_store(base + 8 * 3, 5)
        native.fence()
        native.store_i8(s.ctypes.data + 1, 2)
        return native.atomic_exchange(base, 11) + native.atomic_load(base + 8 * 3)

    status = np.zeros(3, dtype=np.int8)
    assert compiled(words, status) == 0 + 5 and words[0] == 11 and words[3] == 5 and list(status) == [0, 2, 0]


# ---- the common case in one frame, its accounting row in one store (issue 45, seed 003's loop) ---------------------

#: the producers as set in every epoch (a second epoch tuned down to the loop making every batch would leave a batch
#: the test waits for unmade: test_cached_outputs.AS_SET)
AS_SET = {"STOKER_TUNING": "0"}


def _python_calls(fn: Any) -> tuple[Any, list[str]]:
    """``fn()`` and the Python functions it entered on this thread (``sys.setprofile``: the producers' threads are not
    seen), by name."""
    import sys

    names: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            names.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, names


@pytest.mark.parametrize("num_workers", [1, 2])
def test_a_ready_batch_is_handed_over_in_one_python_frame_and_a_slot_check_per_field(
    ints: Path, num_workers: int
) -> None:  # fmt: skip
    """Seed 003's loop (``IntDecoder, ToTensor, Squeeze``): once a batch is made and its slot's tensor is made already,
    ``next()`` enters one Python function (the iterator's ``__next__``, the hand-over itself) and, for the slot the
    count of batches taken frees, one check per field (``FieldPipeline.slot_in_use``); no wrapper frames. Every batch
    is the model's."""
    with mock.patch.dict(os.environ, AS_SET), Loader(ints, batch_size=7, num_workers=num_workers, order=OrderOption.RANDOM,
                                                     seed=3, pipelines={"y": [IntDecoder(), ToTensor(), Squeeze()]}) as loader:  # fmt: skip
        for _ in range(2):  # (the second epoch: every slot's tensor made in the first)
            order = loader.epoch_indices(loader._next_epoch)
            it = iter(loader)
            fast, ring = it._fast, it._ring  # type: ignore[attr-defined]
            checked = 0
            for c in range(len(it)):
                if c > ring.skip:
                    _until(lambda c=c, ring=ring: ring.status[c] == DONE, f"batch {c} made")
                hits = fast.hits
                # (a slot the epoch before may still hold, once: ring.free_slot, a Python call, checks it)
                plain = ring.pipelines[0]._tail_cache[ring.slot(c)] is not None and not fast.forgiven
                (y,), calls = _python_calls(functools.partial(next, it))
                np.testing.assert_array_equal(y.numpy(), order[c * 7 : (c + 1) * 7])
                if fast.hits > hits and plain:
                    assert calls[0] == "next_batch" and set(calls[1:]) <= {"slot_in_use"} and len(calls) <= 2, calls
                    checked += 1
                del y
            assert checked > 0, "no batch took the fast hand-over with its slot's tensor made"
            with pytest.raises(StopIteration):
                next(it)
            del it


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two fields: ``a`` = ``0 ... N-1``, ``b`` = ``2a``."""
    path = tmp_path_factory.mktemp("handover_pairs") / "pairs.stoker"
    DatasetWriter(path, {"a": IntField(), "b": IntField()}, num_workers=1, progress=False).from_indexed_dataset(
        [(i, 2 * i) for i in range(N)]
    )
    return path


class _Plus1(Operation):
    """A tail step that is not a view (it runs for every batch): ``batch + 1``."""

    reentrant = True

    def declare_state_and_memory(self, previous_state: Any) -> Any:
        return previous_state, None

    def generate_code(self) -> Any:
        def plus1(batch: torch.Tensor, dst: Any) -> torch.Tensor:
            return batch + 1

        return plus1


@settings(max_examples=examples(6, 40), deadline=None)
@given(
    num_workers=st.integers(1, 2),
    batch_size=st.sampled_from([7, 16, 50]),
    tail=st.sampled_from(["views", "views+step", "two fields"]),
    ahead=st.integers(1, 4),
)
def test_the_fast_hand_overs_accounting_rows_against_the_model(
    ints: Path, pairs: Path, num_workers: int, batch_size: int, tail: str, ahead: int
) -> None:  # fmt: skip
    """Every step's row, written in one store by the fast hand-over (the rows filled with stale values first, as rows
    of 4,096 batches before): ``T_ENTER == T_READY <= T_EXIT``, ``MAKER`` the producer of the batch in the model
    (``(c - skip) % producers``), ``BLOCKED`` 0, a tail's columns 0 where its output was the slot's tensor made
    before (no step ran) and the step's nanoseconds where it ran; rows of the slow path as that path writes them.
    Every batch is the model's."""
    path, pipes, plus = ints, {"y": [IntDecoder(), ToTensor(), Squeeze()]}, 0
    if tail == "views+step":
        pipes["y"].append(_Plus1())
        plus = 1
    elif tail == "two fields":
        path, pipes = pairs, {"a": [IntDecoder(), ToTensor(), Squeeze()], "b": [IntDecoder(), ToTensor()]}
    with mock.patch.dict(os.environ, AS_SET), Loader(path, batch_size=batch_size, num_workers=num_workers,
                                                     order=OrderOption.RANDOM, seed=8, batches_ahead=ahead,
                                                     pipelines=pipes) as loader:  # fmt: skip
        rec = loader._recorder
        assert rec is not None
        for _ in range(2):  # (the second epoch: slots' tensors made in the first)
            order = loader.epoch_indices(loader._next_epoch)
            it = iter(loader)
            fast, ring = it._fast, it._ring  # type: ignore[attr-defined]
            assert fast is not None
            base = it._rec_base  # type: ignore[attr-defined]
            rec.steps[:] = -7  # stale rows
            rows: dict[int, tuple[bool, bool]] = {}  # batch -> (fast path, every tail's output made before)
            for c in range(len(it)):
                if c > ring.skip:
                    _until(lambda c=c, ring=ring: ring.status[c] == DONE, f"batch {c} made")
                slot = ring.slot(c)
                made_before = not plus and all(p._tail_cache[slot] is not None for p in ring.pipelines)
                hits = fast.hits
                batch = next(it)
                idx = order[c * batch_size : (c + 1) * batch_size]
                np.testing.assert_array_equal(batch[0].reshape(-1).numpy(), idx + plus)
                if tail == "two fields":
                    np.testing.assert_array_equal(batch[1].reshape(-1).numpy(), 2 * idx)
                rows[c] = (fast.hits > hits, made_before)
                del batch
            with pytest.raises(StopIteration):
                next(it)
            assert any(f for f, _ in rows.values()), "no batch took the fast hand-over"
            for c, (was_fast, made_before) in rows.items():
                row = rec.steps[(base + c) % ROWS]
                tails = row[STEP_FIXED : rec.width]
                assert 0 < row[T_ENTER] <= row[T_READY] <= row[T_EXIT], (c, row)
                assert row[BLOCKED] in (0, 1) and row[MAKER] in (LOOP_MADE, *range(ring.producers)), (c, row)
                assert (tails >= 0).all(), (c, row)  # (every tail column written: none stale)
                if was_fast:
                    assert row[T_READY] == row[T_ENTER] and row[BLOCKED] == 0, (c, row)
                    assert row[MAKER] == (c - ring.skip) % ring.producers, (c, row)
                    if made_before:
                        assert (tails == 0).all(), (c, row)
                    elif plus:
                        assert tails[-1] > 0, (c, row)  # (_Plus1 ran: its nanoseconds)
            del it
