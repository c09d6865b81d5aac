"""Batch memory that starts at a chosen offset from a 64-byte boundary (``AllocationQuery.offset``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.decoders import IntDecoder, NDArrayDecoder
from stoker.loader import Loader
from stoker.pipeline.allocation_query import ALIGNMENT, AllocationQuery, offset_array
from stoker.pipeline.operation import Operation
from stoker.pipeline.state import State


@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.integers(0, 40), min_size=1, max_size=4).map(tuple),
    dtype=st.sampled_from(["u1", "i2", "f4", "f8", "i8"]),
    offset=st.integers(0, ALIGNMENT - 1),
)
def test_offset_arrays_start_where_asked(shape: tuple[int, ...], dtype: str, offset: int) -> None:
    offset -= offset % np.dtype(dtype).itemsize  # items stay aligned
    a = offset_array(shape, dtype, offset)
    assert a.shape == shape and a.dtype == np.dtype(dtype)
    assert a.flags.c_contiguous and a.flags.writeable
    assert a.ctypes.data % ALIGNMENT == offset
    a[...] = 7  # the whole array lies inside its buffer
    assert (a == 7).all()


def test_views_of_an_offset_array_keep_the_array_itself() -> None:
    """The loader tells a batch the user kept by the references to the slot's array: a view must be one of them,
    as for ``np.empty`` (a view of a view of another array would count on that array instead)."""
    a = offset_array((4, 3, 5), "u1", 8)
    before = sys.getrefcount(a)
    view = a[:2]
    assert view.base is a
    assert sys.getrefcount(a) == before + 1
    del view
    assert sys.getrefcount(a) == before
    torch = pytest.importorskip("torch")
    tensor = torch.from_numpy(a[1:])
    assert sys.getrefcount(a) > before
    del tensor
    assert sys.getrefcount(a) == before


@pytest.mark.parametrize("offset", [-1, ALIGNMENT, 8.0, "8"])
def test_offsets_outside_the_alignment_are_refused(offset: object) -> None:
    with pytest.raises(ValueError, match=r"AllocationQuery.offset must be an int in \[0, 64\)"):
        AllocationQuery((3,), np.dtype("u1"), offset=offset)  # type: ignore[arg-type]


def test_the_default_offset_is_zero() -> None:
    assert AllocationQuery((3,), np.dtype("u1")).offset == 0


def test_offsets_that_would_misalign_items_are_refused() -> None:
    with pytest.raises(ValueError, match="leaves float64 items unaligned: use a multiple of 8"):
        AllocationQuery((3,), np.dtype("f8"), offset=4)
    with pytest.raises(ValueError, match="leaves int32 items unaligned: use a multiple of 4"):
        offset_array((3,), "i4", 6)
    assert AllocationQuery((3,), np.dtype("f8"), offset=8).offset == 8


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_offset_memory_stays_private_to_a_process_after_fork() -> None:
    """As np.empty's: a forked child writing a batch it inherited leaves the parent's batch as it was."""
    a = offset_array((1000,), "u1", 8)
    a[:] = 1
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        a[:] = 2
        os._exit(0)
    os.waitpid(pid, 0)
    assert (a == 1).all()


class _FFCVQuery(NamedTuple):
    """A memory query made like FFCV's, by a class that is not stoker's (no offset)."""

    shape: tuple[int, ...]
    dtype: Any
    device: Any = None


class _AddIndex(Operation):
    """x + index into memory asked for with ``query`` (a compiled step after the decoder)."""

    def __init__(self, query: Callable[[State], Any]) -> None:
        self.query = query

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, Any]:
        return previous_state, self.query(previous_state)

    def generate_code(self) -> Callable[..., Any]:
        def add_index(batch, dst, indices):  # type: ignore[no-untyped-def]
            for i in range(batch.shape[0]):
                dst[i] = batch[i] + indices[i]
            return dst

        return add_index


@pytest.mark.parametrize(
    ("query", "offset"),
    [
        (lambda s: _FFCVQuery(s.shape, s.dtype), 0),
        (lambda s: AllocationQuery(s.shape, s.dtype, offset=16), 16),
        (lambda s: AllocationQuery(s.shape, s.dtype), 0),
    ],
)
def test_pipeline_memory_honours_the_query(table_path: Path, query: Callable[[State], Any], offset: int) -> None:
    loader = Loader(table_path, batch_size=64, pipelines={"x": [NDArrayDecoder(), _AddIndex(query)], "y": [IntDecoder()]})
    for xs, ys in loader:  # the table: x[i] = i * 100 + column
        i = ys.reshape(-1).astype(np.float32)
        np.testing.assert_array_equal(xs, i[:, None] * 100 + np.arange(5, dtype=np.float32) + i[:, None])
    memory = [views[1] for views in loader.pipelines[0]._views]
    if offset:
        assert {m.ctypes.data % ALIGNMENT for m in memory} == {offset}
