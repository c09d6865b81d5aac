"""The Loader's per-step accounting: the verdict, the stage named, and exact counts and sums."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from stoker.decoders import IntDecoder, NDArrayDecoder
from stoker.loader import Loader
from stoker.transforms import ToTensor
from tests.observe._ops import Spin, sleepy

BATCH = 32  # 320 samples: 10 batches an epoch
SLOW_MS = 25.0


def _loader(table: Path, x_ops: list[Any], **kw: Any) -> Loader:
    return Loader(table, batch_size=BATCH, num_workers=1, pipelines={"x": x_ops, "y": [IntDecoder(), ToTensor()]}, **kw)


def _run(loader: Loader, loop_sleep: float = 0.0, epochs: int = 1) -> float:
    """Iterate ``epochs`` epochs (sleeping ``loop_sleep`` per step); the seconds measured around the loops."""
    wall = 0.0
    for _ in range(epochs):
        t0 = time.perf_counter()
        for _batch in loader:
            if loop_sleep:
                time.sleep(loop_sleep)
        wall += time.perf_counter() - t0
    return wall


SLOW_STAGES = {
    "compiled": (lambda: [NDArrayDecoder(), Spin(SLOW_MS), ToTensor()], "x: NDArrayDecoder+Spin", "compiled"),
    "python": (lambda: [NDArrayDecoder(), ToTensor(), sleepy(SLOW_MS / 1e3)], "x: sleepy", "python"),
}


@pytest.mark.parametrize("slow", sorted(SLOW_STAGES))
def test_a_slow_stage_and_a_fast_loop_is_data_bound_and_named(table: Path, slow: str) -> None:
    ops, name, kind = SLOW_STAGES[slow]
    with _loader(table, ops()) as loader:
        _run(loader, epochs=2)
        a = loader.stats()["accounting"]
        text = loader.report()
    assert a["verdict"] == "data-bound" and a["data_bound"], text
    assert a["stall_share"] > 0.5, text  # the loop does nothing: it waits nearly all the time
    assert a["bottleneck"] == name, text
    assert a["stages"][name]["kind"] == kind
    assert a["stages"][name]["stall_share"] > 0.6, text
    # its time per batch, as the stage takes it (the spin or the sleep), within a factor for a busy machine
    assert 0.8 * SLOW_MS <= a["stages"][name]["p50_ms"] <= 4 * SLOW_MS, text
    assert "verdict: data-bound" in text and f"most waiting: {name}" in text
    if kind == "python":
        assert "compiled operation" in a["suggestion"]
    else:  # the advice for a compiled head: the idle CPUs, or (none idle) a cheaper head (tests/observe/test_advice.py)
        from stoker._threads import available_cpus

        cpus = available_cpus()
        expected = f"raise num_workers (now 1; this process may use {cpus} CPUs)" if cpus > 1 else "uses every CPU (1 workers)"
        assert expected in a["suggestion"], text


@pytest.mark.parametrize("slow", sorted(SLOW_STAGES))
def test_the_same_pipeline_with_a_slow_loop_is_not_data_bound(table: Path, slow: str) -> None:
    ops, name, kind = SLOW_STAGES[slow]
    if kind == "python":  # a Python stage runs inside next(): a slower loop cannot hide it; the share falls with the step
        loop = 8 * SLOW_MS / 1e3
    else:
        loop = 3 * SLOW_MS / 1e3
    with _loader(table, ops()) as loader:
        _run(loader, loop_sleep=loop)
        a = loader.stats()["accounting"]
        text = loader.report()
    if kind == "python":
        assert a["stall_share"] < 0.3, text
        assert a["bottleneck"] == name, text
    else:
        assert a["verdict"] == "not data-bound" and not a["data_bound"], text
        assert a["stall_share"] < 0.1, text
        assert "verdict: not data-bound" in text


def test_counts_and_sums_are_exact(table: Path) -> None:
    """Batch counts and per-stage item counts exactly; waits + steps lie between bounds made by construction.

    No timing assumption (the machine may be busy): the user's own clock around each ``next()`` gives a lower
    bound (every pause between a batch's arrival and the next ``next()`` call is inside a step the accounting
    counts) and an upper bound (the wall time from the first counted batch's arrival to the last one's).
    """
    epochs, walls, pauses = 3, [], 0.0
    with _loader(table, [NDArrayDecoder(), ToTensor()]) as loader:
        for _ in range(epochs):
            it = iter(loader)  # (starting an epoch is not a step; the first one loads the compiled loop)
            t0 = arrived = None
            for i in range(10):
                called = time.perf_counter()
                if arrived is not None:  # the pause since the last batch arrived: part of a step
                    pauses += called - arrived
                next(it)
                arrived = time.perf_counter()
                if i == 0:  # (an epoch's first hand-over may start its producers after its row's exit time: from the call)
                    t0 = called
                time.sleep(0.002)
            assert t0 is not None and arrived is not None
            walls.append(arrived - t0)  # (the step after an epoch's last batch is no step: no next() follows)
            with pytest.raises(StopIteration):
                next(it)
        a = loader.stats()["accounting"]
    n = epochs * 10
    assert a["batches"] == n - 1  # the first batch is reported apart (first_batch_s)
    for name in ("x: NDArrayDecoder", "y: IntDecoder", "x: ToTensor", "y: ToTensor", "read"):
        assert a["stages"][name]["items"] == n - 1, name
    assert sum(v["stall_s"] for v in a["stages"].values()) == pytest.approx(a["stall_s"], rel=1e-6, abs=1e-6)
    wall = sum(walls)
    measured = a["stall_s"] + a["step_s"]
    assert a["stall_s"] <= wall
    assert measured <= wall + 1e-6
    # every pause of the user's loop (at least 2 ms a batch: 27 of them) is inside a counted step
    assert a["step_s"] >= pauses - 1e-6, (a["step_s"], pauses)
    assert pauses >= 0.002 * (n - epochs)


def test_accounting_off(table: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STOKER_ACCOUNTING", "0")
    with _loader(table, [NDArrayDecoder(), ToTensor()]) as loader:
        batches = list(loader)
        assert len(batches) == 10
        assert loader.stats()["accounting"] == {}
        assert "accounting is off" in loader.report()


def test_the_report_before_any_batch(table: Path) -> None:
    with _loader(table, [NDArrayDecoder(), ToTensor()]) as loader:
        a = loader.stats()["accounting"]
        assert a["batches"] == 0 and a["verdict"] == "not data-bound"
        assert "no batch" in a["suggestion"]
        loader.report()


def test_the_first_batch_is_timed_from_iter(table: Path) -> None:
    """The first batch is timed as the user waits for it: from the first ``iter()`` (planning, compiling, starting the
    producers) to the end of the first ``next()``, not from the first ``next()`` alone. Bounds by construction (no
    timing assumption): the figure lies between the time from after ``iter()`` returned to before ``next()`` was
    called, plus the pause between them, and the whole span measured outside."""
    with _loader(table, [NDArrayDecoder(), ToTensor()]) as loader:
        t0 = time.perf_counter()
        it = iter(loader)
        t1 = time.perf_counter()
        time.sleep(0.3)  # the user's pause between iter() and next(): waited for, as iter()'s own time is
        t2 = time.perf_counter()
        next(it)
        t3 = time.perf_counter()
        for _ in it:
            pass
        a = loader.stats()["accounting"]
        text = loader.report()
    assert t2 - t1 <= a["first_batch_s"] <= t3 - t0, (a["first_batch_s"], t1 - t0, t2 - t1, t3 - t2)
    assert a["first_batch_s"] - a["first_next_s"] >= t2 - t1  # iter() and the pause: before the first next()
    assert 0 < a["first_next_s"] <= t3 - t2
    assert f"after the first (which took {a['first_batch_s']:.2f} s from iter())" in text
    with _loader(table, [NDArrayDecoder(), ToTensor()]) as again:  # a later iter() does not move it
        _run(again, epochs=2)
        first = again.stats()["accounting"]["first_batch_s"]
        _run(again)
        assert again.stats()["accounting"]["first_batch_s"] == first
