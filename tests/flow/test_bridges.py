"""Resuming from a sequence or a Loader, a Loader as a source (and the batches it holds), a flow feeding a DatasetWriter."""

from __future__ import annotations

import gc
import itertools
import random
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from stoker.errors import StokerError
from stoker.fields import IntField, NDArrayField
from stoker.flow import Pipeline, PipelineBuilder, write_dataset
from stoker.flow._bridges import source_items_held
from stoker.loader import Loader, OrderOption
from stoker.writer import DatasetWriter


def build_ordered(source: object) -> Pipeline:
    return PipelineBuilder().add_source(source).pipe(lambda x: x * 2, concurrency=3, output_order="input").add_sink(4).build()  # type: ignore[arg-type]


@pytest.mark.parametrize("stop_after", [0, 1, 17, 49, 50])
def test_resume_a_sequence_source_continues_after_the_items_delivered(stop_after: int) -> None:
    source = list(range(50))
    first = build_ordered(source)
    with first.auto_stop():
        got = [first.get_item(timeout=10) for _ in range(stop_after)]
        state = first.state_dict()
    assert state["items_delivered"] == stop_after
    second = build_ordered(source)
    second.load_state_dict(state)
    assert second.state_dict()["items_delivered"] == stop_after
    assert got + list(second) == [2 * i for i in range(50)]


def test_resume_after_reordering_loses_nothing_and_repeats_nothing_below_the_mark() -> None:
    rng = random.Random(0)
    lock = threading.Lock()

    def jitter(x: int) -> int:
        with lock:
            d = rng.random() * 0.001
        time.sleep(d)
        return x

    def build() -> Pipeline:
        return (
            PipelineBuilder()
            .add_source(range(200))
            .pipe(jitter, concurrency=4)
            .aggregate(5)
            .disaggregate()
            .pipe(jitter, concurrency=3)
            .add_sink(3)
            .build()
        )

    first = build()
    with first.auto_stop():
        got = [first.get_item(timeout=10) for _ in range(93)]  # in the middle of a batch of 5
        mark = first.state_dict()["items_delivered"]
    assert mark <= 93 and set(range(mark)) <= set(got)
    second = build()
    second.load_state_dict(first.state_dict())
    rest = list(second)
    assert all(x >= mark for x in rest) and len(rest) == 200 - mark
    assert set(got) | set(rest) == set(range(200))


def test_only_sequences_and_loaders_resume() -> None:
    pipeline = PipelineBuilder().add_source(iter(range(5))).add_sink(1).build()
    with pytest.raises(StokerError, match="sequence"):
        pipeline.load_state_dict({"version": 1, "items_delivered": 2, "source": None})
    with pytest.raises(StokerError, match="version"):
        build_ordered([1]).load_state_dict({"items_delivered": 2})


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> Path:
    n = 50
    path = tmp_path_factory.mktemp("flow") / "table.stoker"
    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    DatasetWriter(
        path, {"x": NDArrayField(shape=(3,), dtype=np.dtype("float32")), "y": IntField()}, num_workers=1, progress=False
    ).from_arrays({"x": x, "y": np.arange(n)})
    return path


def loader_flow(path: Path) -> tuple[Loader, Pipeline]:
    loader = Loader(path, batch_size=4, num_workers=1, order=OrderOption.RANDOM, seed=3)
    flow = (
        PipelineBuilder()
        .add_source(loader)
        .pipe(lambda batch: batch[1].reshape(-1).tolist(), concurrency=2, output_order="input")  # any Python after the compiled part
        .add_sink(2)
        .build()
    )
    return loader, flow


def test_a_loader_is_a_source_and_resumes(table: Path) -> None:
    reference = [b[1].reshape(-1).tolist() for b in Loader(table, batch_size=4, num_workers=1, order=OrderOption.RANDOM, seed=3)]
    loader, flow = loader_flow(table)
    with flow.auto_stop():
        got = [flow.get_item(timeout=30) for _ in range(5)]
        state = flow.state_dict()
    loader.close()
    assert got == reference[:5] and state["items_delivered"] == 5
    loader2, flow2 = loader_flow(table)
    flow2.load_state_dict(state)
    rest = list(flow2)
    loader2.close()
    assert got + rest == reference
    assert sorted(itertools.chain(*reference)) == list(range(50))


def test_a_flow_feeds_a_dataset_writer(tmp_path: Path) -> None:
    def make(i: int) -> tuple[np.ndarray, int]:
        return np.full(3, i, np.float32), i * i

    flow = PipelineBuilder().add_source(range(30)).pipe(make, concurrency=3, output_order="input").add_sink(4).build()
    fields = {"x": NDArrayField(shape=(3,), dtype=np.dtype("float32")), "y": IntField()}
    path = tmp_path / "out.stoker"
    write_dataset(flow, DatasetWriter(path, fields, num_workers=4, progress=False), 30)
    batches = list(Loader(path, batch_size=30, num_workers=1))
    ((x, y),) = batches
    assert x.numpy()[:, 0].tolist() == list(range(30)) and y.numpy().reshape(-1).tolist() == [i * i for i in range(30)]


def test_write_dataset_refuses_a_flow_of_another_length(tmp_path: Path) -> None:
    fields = {"y": IntField()}
    short = PipelineBuilder().add_source(range(5)).add_sink(2).build()
    with pytest.raises(Exception, match="ended after 5 items"):
        write_dataset(short, DatasetWriter(tmp_path / "a.stoker", fields, num_workers=1, progress=False), 6)
    long = PipelineBuilder().add_source(range(7)).add_sink(2).build()
    with pytest.raises(Exception, match="more than num_items"):
        write_dataset(long, DatasetWriter(tmp_path / "b.stoker", fields, num_workers=1, progress=False), 6)
    assert not (tmp_path / "a.stoker").exists() and not (tmp_path / "b.stoker").exists()


def test_a_disaggregated_batch_counts_as_delivered_once_all_its_elements_are() -> None:
    gate = threading.Event()

    def hold_two(x: int) -> int:
        if x == 2:
            gate.wait(10)
        return x

    # one slot held by item 2, one free: the others finish one at a time, in order
    pipeline = PipelineBuilder().add_source(range(10)).aggregate(5).disaggregate().pipe(hold_two, concurrency=2).add_sink(8).build()
    with pipeline.auto_stop():
        first = sorted(pipeline.get_item(timeout=10) for _ in range(4))
        assert first == [0, 1, 3, 4]
        assert pipeline.state_dict()["items_delivered"] == 0  # element 2 of the first batch is still out
        gate.set()
        rest = [pipeline.get_item(timeout=10) for _ in range(6)]
        assert sorted(rest) == [2, 5, 6, 7, 8, 9]
        assert pipeline.state_dict()["items_delivered"] == 10


# ---- a Loader's batches held by the flow: sized for, not warned ------------------------------------------


def test_what_a_flow_holds_is_counted_from_its_bounds() -> None:
    def holds(builder: PipelineBuilder) -> int:
        return source_items_held(builder.build()._engine)

    # the source's last item and its outbox (1 + 1), a stage's queue (4) and concurrency (2), the sink (2) and the
    # consumer's item (1), less the consumer's item the loader counts itself
    assert holds(PipelineBuilder().add_source([]).pipe(abs, concurrency=2).add_sink(2)) == 1 + 1 + 4 + 2 + 2 + 1 - 1
    assert holds(PipelineBuilder().add_source([]).pipe(abs, concurrency=3).add_sink(5)) == 1 + 1 + 6 + 3 + 5 + 1 - 1
    assert holds(PipelineBuilder().add_source([]).add_sink(3)) == 1 + 1 + 3
    # aggregate(4) after the stage: 3 items filling a list; its outputs and the sink hold 4 source items each
    expected = 1 + 1 + 4 + 3 + 2 * 4 + 3 * 4 - 1
    assert holds(PipelineBuilder().add_source([]).pipe(abs, concurrency=2).aggregate(4).add_sink(2)) == expected
    # the source's last item, one item filling a list of 2, that list in the outbox; after disaggregate an element
    # may keep its whole parent alive, so the sink and the consumer's item count 2 each
    assert holds(PipelineBuilder().add_source([]).aggregate(2).disaggregate().add_sink(1)) == 1 + 1 + 1 * 2 + (1 + 1) * 2 - 1


def test_a_flow_reading_a_loader_holds_no_batch_the_loader_did_not_expect(table: Path) -> None:
    # few slots (one producer, one batch ahead); the stage passes the batch itself on, so the flow's queues
    # keep the loader's batches (their memory) alive: without expect_held the loader gives held slots fresh memory.
    # More threads than the stage's concurrency: idle workers, which must not keep their last (old) batch
    loader = Loader(table, batch_size=1, num_workers=1, batches_ahead=1)
    stage = PipelineBuilder().add_source(loader).pipe(lambda batch: batch, concurrency=2, output_order="input")
    flow = stage.add_sink(2).build(num_threads=4)
    got = [int(y) for _, y in flow]
    loader.close()
    assert got == list(range(50))
    assert loader.stats()["loader"]["kept_batches"] == 0


class Item:
    """An item that can be watched with a weak reference."""

    def __init__(self, i: int) -> None:
        self.i = i


def test_an_idle_worker_keeps_no_item_alive() -> None:
    refs: list[weakref.ref[Item]] = []

    def items() -> Iterator[Item]:
        for i in range(40):
            item = Item(i)
            refs.append(weakref.ref(item))
            yield item

    flow = PipelineBuilder().add_source(items()).pipe(lambda x: x, concurrency=1).add_sink(1).build(num_threads=4)
    with flow.auto_stop():
        for _ in range(30):
            flow.get_item(timeout=10)
        gc.collect()
        alive = [r().i for r in refs[:25] if r() is not None]  # type: ignore[union-attr]
    assert alive == [], "items long delivered are still referenced (by a worker thread that went idle after them)"
