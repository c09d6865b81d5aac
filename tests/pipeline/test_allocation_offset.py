"""Batch memory that starts at a chosen offset from a 64-byte boundary (``AllocationQuery.offset``)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.pipeline.allocation_query import ALIGNMENT, AllocationQuery, offset_array


@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.integers(0, 40), min_size=1, max_size=4).map(tuple),
    dtype=st.sampled_from(["u1", "i2", "f4", "f8", "i8"]),
    offset=st.integers(0, ALIGNMENT - 1),
)
def test_offset_arrays_start_where_asked(shape: tuple[int, ...], dtype: str, offset: int) -> None:
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
