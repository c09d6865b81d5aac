"""Async stages on the event loop, process-pool and executor stages, mixed with thread stages."""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from stoker.flow import PipelineBuilder, StageError
from tests.flow._stages import pid_of, square_or_fail


def test_async_stage_runs_its_concurrency_at_once_and_keeps_input_order() -> None:
    state = {"now": 0, "peak": 0}
    full = asyncio.Event()
    loops = set()

    async def fetch(x: int) -> int:
        loops.add(id(asyncio.get_running_loop()))
        state["now"] += 1
        state["peak"] = max(state["peak"], state["now"])
        if state["now"] == 4:
            full.set()
        if x < 4:  # the first four wait until four are in flight at once: with less concurrency this times out
            await asyncio.wait_for(full.wait(), 10)
        await asyncio.sleep(0.001 * (x % 3))
        state["now"] -= 1
        return x + 1

    pipeline = PipelineBuilder().add_source(range(40)).pipe(fetch, concurrency=4, output_order="input").add_sink(2).build()
    assert list(pipeline) == list(range(1, 41))
    assert state["peak"] == 4 and len(loops) == 1
    assert pipeline.stats().stage("fetch").kind == "async"


def test_async_failure_is_reported() -> None:
    async def fails(x: int) -> int:
        await asyncio.sleep(0)
        if x == 2:
            raise RuntimeError("async boom")
        return x

    pipeline = PipelineBuilder().add_source(range(10)).pipe(fails, concurrency=2).add_sink(1).build()
    with pytest.raises(StageError, match="async boom") as info:
        list(pipeline)
    assert info.value.stage == "fails" and info.value.position == 2


def test_stop_cancels_running_coroutines() -> None:
    started = threading.Event()

    async def forever(x: int) -> int:
        started.set()
        await asyncio.sleep(3600)
        return x

    pipeline = PipelineBuilder().add_source(range(10)).pipe(forever, concurrency=3).add_sink(1).build()
    pipeline.start()
    assert started.wait(10)
    pipeline.stop()  # returns: the coroutines were cancelled, the loop's thread joined


def test_process_stage_runs_in_other_processes() -> None:
    pipeline = (
        PipelineBuilder()
        .add_source(range(12))
        .pipe(lambda x: x * 2, concurrency=2, output_order="input")
        .pipe(pid_of, concurrency=2, executor="process", output_order="input")
        .pipe(lambda item: item, concurrency=1)
        .add_sink(2)
        .build()
    )
    out = list(pipeline)
    assert [x for x, _ in out] == [2 * i for i in range(12)]
    pids = {pid for _, pid in out}
    assert os.getpid() not in pids and 1 <= len(pids) <= 2


def test_process_stage_failure_names_the_stage_and_is_tolerated() -> None:
    pipeline = (
        PipelineBuilder()
        .add_source(range(10))
        .pipe(square_or_fail, concurrency=2, executor="process", output_order="input")
        .add_sink(2)
        .build(max_failures=1)
    )
    assert list(pipeline) == [i * i for i in range(10) if i != 7]
    (err,) = pipeline.failures
    assert err.stage == "square_or_fail" and err.position == 7 and isinstance(err.exception, ArithmeticError)


def test_an_executor_of_yours_runs_the_stage_and_stays_open() -> None:
    with ThreadPoolExecutor(2, thread_name_prefix="mine") as pool:
        names = set()

        def where(x: int) -> int:
            names.add(threading.current_thread().name)
            return x

        pipeline = (
            PipelineBuilder().add_source(range(20)).pipe(where, concurrency=2, executor=pool, output_order="input").add_sink(2).build()
        )
        assert list(pipeline) == list(range(20))
        assert all(n.startswith("mine") for n in names)
        assert pool.submit(lambda: 1).result() == 1  # still usable: the pipeline does not own it


def test_async_function_with_an_executor_is_refused() -> None:
    async def f(x: int) -> int:
        return x

    with pytest.raises(TypeError, match="event loop"):
        PipelineBuilder().add_source(range(1)).pipe(f, executor="process")
