"""What ``write_dataset`` raises when the flow fails: the flow's own error, as its docstring says, and nothing on disk.

Before, the writer's encoding loop wrapped whatever ``dataset[i]`` raised into a
``SampleError``: a stage's failure reached the caller as ``SampleError: sample 4:
dataset[4] raised StageError: stage 'f', item 5: ...`` (two positions that disagree,
the first depending on timing) and a flow of the wrong length as ``SampleError: sample 7:
... the flow yields more than num_items=8 items``. Every check below holds whatever the
threads' timing: which item fails is fixed, only when the consumer hears of it varies.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stoker.errors import SampleError, StokerError
from stoker.fields import IntField, NDArrayField
from stoker.flow import PipelineBuilder, StageError, write_dataset
from stoker.writer import DatasetWriter
from tests.flow.conftest import flow_threads

FIELDS = {"x": NDArrayField(shape=(3,), dtype=np.dtype("float32")), "y": IntField()}


def fails_on_5(i: int) -> tuple[np.ndarray, int]:
    if i == 5:
        raise ValueError("stage fail 5")
    return np.zeros(3, np.float32), i


def ok(i: int) -> tuple[np.ndarray, int]:
    return np.full(3, i, np.float32), i


def writer(path: Path) -> DatasetWriter:
    return DatasetWriter(path, FIELDS, num_workers=1, progress=False)


def assert_nothing_left(folder: Path) -> None:
    """No destination and no temporary (the writer's ``.name.tmp-...``) in ``folder``."""
    assert sorted(p.name for p in folder.iterdir()) == []


@pytest.mark.parametrize(
    ("concurrency", "output_order"), [(1, "completion"), (3, "completion"), (3, "input")], ids=["serial", "concurrent", "in-order"]
)
def test_a_failed_stage_reaches_the_caller_as_its_stage_error(tmp_path: Path, concurrency: int, output_order: str) -> None:
    flow = (
        PipelineBuilder()
        .add_source(list(range(10)))
        .pipe(fails_on_5, concurrency=concurrency, output_order=output_order)
        .add_sink(2)
        .build()
    )
    with pytest.raises(StageError) as info:
        write_dataset(flow, writer(tmp_path / "wf.stoker"), 10)
    err = info.value
    assert type(err) is StageError and not isinstance(err, SampleError)
    assert (err.stage, err.position, err.source_index) == ("fails_on_5", 5, 5)
    assert str(err) == "stage 'fails_on_5', item 5: ValueError: stage fail 5"  # one position, the flow's
    assert isinstance(err.__cause__, ValueError) and str(err.__cause__) == "stage fail 5"
    assert_nothing_left(tmp_path)


def test_a_failing_first_item_reaches_the_caller_too(tmp_path: Path) -> None:
    flow = PipelineBuilder().add_source([5, 1, 2]).pipe(fails_on_5).add_sink(2).build()
    with pytest.raises(StageError, match=r"^stage 'fails_on_5', item 0: ValueError: stage fail 5$"):
        write_dataset(flow, writer(tmp_path / "wf.stoker"), 3)
    assert_nothing_left(tmp_path)


@pytest.mark.parametrize(
    ("num_items", "message"), [(8, "the flow yields more than num_items=8 items"), (12, "the flow ended after 10 items; num_items said 12")]
)
def test_a_flow_of_another_length_raises_the_count_error_itself(tmp_path: Path, num_items: int, message: str) -> None:
    flow = PipelineBuilder().add_source(list(range(10))).pipe(ok).add_sink(2).build()
    with pytest.raises(StokerError) as info:
        write_dataset(flow, writer(tmp_path / "n.stoker"), num_items)
    assert type(info.value) is StokerError
    assert str(info.value) == message
    assert_nothing_left(tmp_path)


def test_num_items_0_refuses_a_flow_that_yields_items(tmp_path: Path) -> None:
    """The writer asks for no item when there are none: write_dataset looks for one itself."""
    flow = PipelineBuilder().add_source(list(range(3))).pipe(ok).add_sink(2).build()
    try:
        with pytest.raises(StokerError, match=r"^the flow yields more than num_items=0 items$"):
            write_dataset(flow, writer(tmp_path / "zero.stoker"), 0)
        assert flow_threads() == []
    finally:
        flow.stop()
    assert_nothing_left(tmp_path)


def test_num_items_0_writes_an_empty_flow(tmp_path: Path) -> None:
    flow = PipelineBuilder().add_source([]).pipe(ok).add_sink(2).build()
    write_dataset(flow, writer(tmp_path / "empty.stoker"), 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.stoker"]


def test_an_iterable_s_own_exception_reaches_the_caller_as_it_is(tmp_path: Path) -> None:
    def items() -> Iterator[Any]:
        yield ok(0)
        yield ok(1)
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom") as info:
        write_dataset(items(), writer(tmp_path / "gen.stoker"), 5)
    assert not isinstance(info.value, SampleError)
    assert_nothing_left(tmp_path)


def test_an_item_that_does_not_fit_is_still_a_sample_error(tmp_path: Path) -> None:
    def bad_shape(i: int) -> tuple[np.ndarray, int]:
        return np.zeros(4 if i == 3 else 3, np.float32), i

    flow = PipelineBuilder().add_source(list(range(6))).pipe(bad_shape, output_order="input").add_sink(2).build()
    with pytest.raises(SampleError) as info:
        write_dataset(flow, writer(tmp_path / "fit.stoker"), 6)
    assert info.value.__cause__ is None or not isinstance(info.value.__cause__, StageError)
    assert "sample 3" in str(info.value)
    assert_nothing_left(tmp_path)


def test_a_writer_that_fails_before_the_first_item_starts_no_flow(tmp_path: Path) -> None:
    """The flow starts at the first item the writer asks for: a destination refused first leaves no flow running."""
    flow = PipelineBuilder().add_source(list(range(1000))).pipe(ok).add_sink(2).build()
    try:
        with pytest.raises(FileNotFoundError, match="does not exist"):
            write_dataset(flow, writer(tmp_path / "missing" / "x.stoker"), 1000)
        assert flow_threads() == []
    finally:
        flow.stop()  # (what write_dataset left running, if it did: not the next test's failure)
    assert_nothing_left(tmp_path)
