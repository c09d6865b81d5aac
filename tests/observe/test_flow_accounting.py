"""A flow's per-step accounting: the same report as a Loader's, naming its slow stage."""

from __future__ import annotations

import time

import pytest

from stoker.flow import PipelineBuilder
from tests.observe._ops import sleepy

SLOW = 0.03
ITEMS = 24


def fast(x: int) -> int:
    return x + 1


def _flow(slow_concurrency: int = 1):  # type: ignore[no-untyped-def]
    return (
        PipelineBuilder()
        .add_source(range(ITEMS))
        .pipe(fast, concurrency=2)
        .pipe(sleepy(SLOW), concurrency=slow_concurrency)
        .pipe(fast, name="last")
        .add_sink(2)
        .build(num_threads=3)
    )


def test_a_slow_stage_and_a_fast_consumer_is_data_bound_and_named() -> None:
    flow = _flow()
    t0 = time.perf_counter()
    got = list(flow)
    wall = time.perf_counter() - t0
    assert got == [i + 2 for i in range(ITEMS)]
    a = flow.stats().accounting
    text = flow.report()
    assert a["verdict"] == "data-bound", text
    assert a["bottleneck"] == "sleepy", text
    assert a["stages"]["sleepy"]["stall_share"] > 0.7, text
    assert a["stages"]["sleepy"]["items"] == ITEMS and a["stages"]["fast"]["items"] == ITEMS
    assert a["stages"]["last"]["items"] == ITEMS and a["stages"]["source"]["items"] == ITEMS
    assert 0.9 * SLOW * 1e3 <= a["stages"]["sleepy"]["p50_ms"] <= 4 * SLOW * 1e3, text
    assert a["batches"] == ITEMS - 1  # every get() is a step; the first apart
    assert a["first_batch_s"] + a["stall_s"] + a["step_s"] <= wall
    assert "concurrency" in a["suggestion"] and "sleepy" in text


def test_the_same_flow_with_a_slow_consumer_is_not_data_bound() -> None:
    flow = _flow()
    with flow.auto_stop():
        for _ in flow:
            time.sleep(3 * SLOW)
    a = flow.stats().accounting
    assert a["verdict"] == "not data-bound", flow.report()
    assert a["stall_share"] < 0.1


def test_accounting_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STOKER_ACCOUNTING", "0")
    flow = _flow()
    assert len(list(flow)) == ITEMS
    assert flow.stats().accounting == {}
    assert "accounting is off" in flow.report()
