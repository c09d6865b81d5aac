"""The flow's contract: order, exactly once, failures, lifecycle."""

from __future__ import annotations

import random
import threading
import time

import pytest

from stoker.errors import StokerError
from stoker.flow import Pipeline, PipelineBuilder, StageError
from tests.flow.conftest import flow_threads


def jittered(seed: int) -> object:
    rng = random.Random(seed)
    lock = threading.Lock()

    def fn(x: int) -> int:
        with lock:
            delay = rng.random() * 0.002
        time.sleep(delay)
        return x

    return fn


@pytest.mark.parametrize("concurrency", [1, 4, 8])
def test_input_order_is_kept_under_random_delays(concurrency: int) -> None:
    pipeline = (
        PipelineBuilder()
        .add_source(range(300))
        .pipe(jittered(concurrency), concurrency=concurrency, output_order="input")
        .pipe(jittered(concurrency + 1), concurrency=3, output_order="input")
        .add_sink(4)
        .build(num_threads=concurrency + 3)
    )
    assert list(pipeline) == list(range(300))


def test_completion_order_delivers_every_item_exactly_once() -> None:
    pipeline = (
        PipelineBuilder()
        .add_source(range(500))
        .pipe(jittered(1), concurrency=6)
        .aggregate(7)
        .disaggregate()
        .pipe(lambda x: x * 10, concurrency=2)
        .add_sink(3)
        .build(num_threads=4)
    )
    out = list(pipeline)
    assert sorted(out) == [10 * i for i in range(500)]
    assert out != sorted(out)  # 500 items through 6 jittered slots: some overtook others


def test_completion_order_lets_a_fast_item_pass_a_slow_one() -> None:
    release = threading.Event()

    def fn(x: int) -> int:
        if x == 0:
            release.wait(10)
        return x

    pipeline = PipelineBuilder().add_source(range(3)).pipe(fn, concurrency=2).add_sink(4).build()
    with pipeline.auto_stop():
        first = pipeline.get_item(timeout=10)
        release.set()
        rest = [pipeline.get_item(timeout=10), pipeline.get_item(timeout=10)]
    assert first != 0 and sorted([first, *rest]) == [0, 1, 2]


def test_aggregate_keeps_or_drops_the_last_batch() -> None:
    def build(drop_last: bool) -> Pipeline:
        return PipelineBuilder().add_source(range(10)).aggregate(4, drop_last=drop_last).add_sink(2).build()

    assert list(build(False)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert list(build(True)) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_none_is_an_item() -> None:
    pipeline = PipelineBuilder().add_source([None, 1, None]).pipe(lambda x: x, concurrency=2, output_order="input").add_sink(1).build()
    assert list(pipeline) == [None, 1, None]


def boom_on(bad: set[int]) -> object:
    def fn(x: int) -> int:
        if x in bad:
            raise ValueError(f"bad item {x}")
        return x

    fn.__name__ = "check"
    return fn


def test_a_failure_stops_the_flow_and_names_the_stage_and_the_item() -> None:
    pipeline = PipelineBuilder().add_source(range(100)).pipe(boom_on({37}), concurrency=3).add_sink(2).build()
    got = []
    with pytest.raises(StageError) as info:
        for x in pipeline:
            got.append(x)
    err = info.value
    assert err.stage == "check" and err.position == 37 and err.source_index == 37
    assert isinstance(err.exception, ValueError) and err.__cause__ is err.exception
    assert "stage 'check', item 37" in str(err) and "bad item 37" in str(err)
    assert 37 not in got and len(got) < 100


def test_max_failures_tolerates_and_counts() -> None:
    bad = {3, 50, 51}
    pipeline = (
        PipelineBuilder().add_source(range(80)).pipe(boom_on(bad), concurrency=4, output_order="input").add_sink(2).build(max_failures=3)
    )
    assert list(pipeline) == [i for i in range(80) if i not in bad]
    assert pipeline.num_failures == 3
    assert sorted(e.position for e in pipeline.failures) == sorted(bad)
    stage = pipeline.stats().stage("check")
    assert stage.failures == 3 and stage.items_out == 77


def test_one_failure_more_than_max_failures_raises() -> None:
    pipeline = PipelineBuilder().add_source(range(80)).pipe(boom_on({3, 50, 51}), output_order="input").add_sink(2).build(max_failures=2)
    with pytest.raises(StageError) as info:
        list(pipeline)
    assert info.value.position == 51


def test_a_failing_source_is_reported_as_the_source() -> None:
    def source():  # type: ignore[no-untyped-def]
        yield 1
        yield 2
        raise OSError("disk gone")

    pipeline = PipelineBuilder().add_source(source()).pipe(lambda x: x).add_sink(2).build()
    with pytest.raises(StageError, match="disk gone") as info:
        list(pipeline)
    assert info.value.stage == "source" and info.value.position == 2


def test_break_stops_every_thread() -> None:
    pipeline = PipelineBuilder().add_source(range(10**9)).pipe(lambda x: x, concurrency=4).add_sink(2).build(num_threads=4)
    for i, _ in enumerate(pipeline):
        if i == 10:
            assert len(flow_threads()) == 5  # 4 workers and the source
            break
    assert flow_threads() == []


def test_an_exception_in_the_consumer_stops_every_thread() -> None:
    pipeline = PipelineBuilder().add_source(range(10**9)).pipe(lambda x: x, concurrency=3).add_sink(2).build()
    with pytest.raises(KeyError):
        for x in pipeline:
            if x == 5:
                raise KeyError(x)
    assert flow_threads() == []


def test_keyboard_interrupt_inside_auto_stop_stops_every_thread() -> None:
    pipeline = PipelineBuilder().add_source(range(10**9)).pipe(lambda x: x, concurrency=2).add_sink(2).build()
    with pytest.raises(KeyboardInterrupt), pipeline.auto_stop():
        for x in pipeline:
            if x == 3:
                raise KeyboardInterrupt
    assert flow_threads() == []


def test_a_pipeline_never_started_holds_no_thread() -> None:
    before = threading.active_count()
    pipeline = PipelineBuilder().add_source(range(10)).pipe(lambda x: x, concurrency=8).add_sink(2).build(num_threads=8)
    assert threading.active_count() == before and flow_threads() == []
    pipeline.stop()  # stopping a pipeline that never ran is fine
    assert threading.active_count() == before


def test_stop_is_idempotent_and_a_pipeline_runs_once() -> None:
    pipeline = PipelineBuilder().add_source(range(10)).pipe(lambda x: x).add_sink(2).build()
    pipeline.start()
    with pytest.raises(StokerError, match="runs once"):
        pipeline.start()
    pipeline.stop()
    pipeline.stop()
    assert flow_threads() == []
    with pytest.raises(StokerError, match="runs once"):
        pipeline.start()


def test_a_dropped_running_pipeline_is_stopped() -> None:
    pipeline = PipelineBuilder().add_source(range(10**9)).pipe(lambda x: x, concurrency=2).add_sink(2).build()
    pipeline.start()
    assert pipeline.get_item(timeout=10) == 0
    del pipeline
    from tests.flow.conftest import wait_no_flow_threads

    assert wait_no_flow_threads() == []


def test_get_item_times_out_and_ends_with_eof() -> None:
    gate = threading.Event()

    def slow(x: int) -> int:
        gate.wait(10)
        return x

    pipeline = PipelineBuilder().add_source(range(1)).pipe(slow).add_sink(1).build()
    with pipeline.auto_stop():
        with pytest.raises(TimeoutError):
            pipeline.get_item(timeout=0.05)
        gate.set()
        assert pipeline.get_item(timeout=10) == 0
        with pytest.raises(EOFError):
            pipeline.get_item(timeout=10)


def test_an_empty_source_ends_at_once() -> None:
    pipeline = PipelineBuilder().add_source([]).pipe(lambda x: x).aggregate(3).add_sink(1).build()
    assert list(pipeline) == []


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda b: b.pipe(lambda x: x, concurrency=0), "concurrency must be an int >= 1"),
        (lambda b: b.pipe(lambda x: x, output_order="random"), "output_order must be"),
        (lambda b: b.aggregate(0), "num_items >= 1"),
        (lambda b: b.add_sink(0), "buffer_size >= 1"),
        (lambda b: b.pipe(lambda x: x, executor="process"), "must pickle"),
        (lambda b: b.pipe(lambda x: x, executor="threads"), "executor must be"),
        (lambda b: b.add_sink(1).build(max_failures=-1), "max_failures must be"),
        (lambda b: b.add_sink(1).build(num_threads=0), "num_threads must be"),
    ],
)
def test_invalid_configuration_is_refused(call: object, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        call(PipelineBuilder().add_source(range(3)))  # type: ignore[operator]


def test_build_needs_a_source_and_a_sink() -> None:
    with pytest.raises(StokerError, match="no source"):
        PipelineBuilder().add_sink(1).build()
    with pytest.raises(StokerError, match="no sink"):
        PipelineBuilder().add_source(range(3)).build()
