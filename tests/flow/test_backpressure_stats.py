"""Bounded queues while running, and statistics that add up."""

from __future__ import annotations

import itertools
import threading
import time

from stoker.flow import PipelineBuilder


def test_a_fast_source_and_a_slow_stage_keep_queues_bounded() -> None:
    produced = itertools.count()

    def source():  # type: ignore[no-untyped-def]
        for i in range(10**9):
            next(produced)
            yield i

    def slow(x: int) -> int:
        time.sleep(0.001)
        return x

    pipeline = (
        PipelineBuilder()
        .add_source(source())
        .pipe(lambda x: x, concurrency=2, name="fast")
        .pipe(slow, concurrency=2, output_order="input")
        .aggregate(3)
        .add_sink(2)
        .build(queue_size=5)
    )
    # held at most: fast (2 held + 5 queued), slow (2 + 5), the aggregate's 2, sink 2 batches of 3, the source's 1
    bound = (2 + 5) + (2 + 5) + 2 + 2 * 3 + 1
    seen_full = False
    with pipeline.auto_stop():
        for i, _ in enumerate(pipeline):
            sizes = pipeline.queue_sizes()
            assert sizes["fast"][0] <= 5 and sizes["fast"][1] <= 2
            assert sizes["slow"][0] <= 5 and sizes["slow"][1] <= 2
            assert sizes["sink"][0] <= 2
            stats = pipeline.stats()
            delivered_items = 3 * stats.delivered
            source_items = stats.stage("source").items_out
            assert source_items - delivered_items <= bound, (source_items, delivered_items)
            seen_full |= sizes["slow"][0] == 5
            time.sleep(0.002)  # a slow consumer too
            if i == 60:
                break
    assert seen_full  # the slow stage's queue filled up: back-pressure was exercised


def test_statistics_add_up() -> None:
    def flaky(x: int) -> int:
        if x % 10 == 3:
            raise ValueError(x)
        return x

    pipeline = (
        PipelineBuilder()
        .add_source(range(200))
        .pipe(flaky, concurrency=3)
        .aggregate(8)
        .pipe(len, name="count", concurrency=2)
        .add_sink(3)
        .build(max_failures=20)
    )
    counts = list(pipeline)
    stats = pipeline.stats()
    source, flaky_s, count, sink = stats.stages
    assert (source.name, flaky_s.name, count.name, sink.name) == ("source", "flaky", "count", "sink")
    assert source.items_out == 200 == flaky_s.items_in
    for s in stats.stages:
        assert s.items_in == s.items_out + s.failures and s.in_flight == 0
    assert flaky_s.failures == 20 and flaky_s.items_out == 180
    assert count.items_in == 23 == len(counts) == sink.items_out == stats.delivered  # 180 items in batches of 8
    assert sum(counts) == 180
    assert flaky_s.mean_s >= 0 and flaky_s.p95_s >= 0 and flaky_s.busy_s > 0
    assert flaky_s.queue_max <= flaky_s.queue_capacity


def test_the_report_names_the_stage_to_give_more_concurrency() -> None:
    def slow(x: int) -> int:  # 1.2 s asleep in all: ten times more than a busy machine's pauses of the cheap stage have cost
        time.sleep(0.02)
        return x

    pipeline = PipelineBuilder().add_source(range(60)).pipe(lambda x: x, name="cheap").pipe(slow).add_sink(8).build()
    list(pipeline)
    stats = pipeline.stats()
    assert stats.bottleneck() is not None and stats.bottleneck().name == "slow"  # type: ignore[union-attr]
    text = stats.report()
    for name in ("source", "cheap", "slow", "sink"):
        assert name in text
    assert "stage 'slow'" in text


def test_reports_are_printed_while_running_and_at_the_end() -> None:
    reports: list[str] = []
    first = threading.Event()

    def record(text: str) -> None:
        reports.append(text)
        first.set()

    def wait_for_a_report(x: int) -> int:
        if x == 5:
            first.wait(10)  # the flow runs until the periodic report came
        return x

    pipeline = (
        PipelineBuilder()
        .add_source(range(10))
        .pipe(wait_for_a_report)
        .add_sink(2)
        .build(report_interval=0.01, report_at_end=True, report=record)
    )
    assert list(pipeline) == list(range(10))
    assert len(reports) >= 2 and all("wait_for_a_report" in r for r in reports)
    assert "10 items delivered" in reports[-1]
