"""Numba's per-thread settings in producer threads: threads for the batch's parallel loops, and their chunk size."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numba
import numpy as np
import pytest

from stoker.decoders import IntDecoder, NDArrayDecoder
from stoker.loader import Loader
from stoker.loader._epoch import CHUNKS_PER_THREAD
from stoker.pipeline import native
from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.operation import Operation
from stoker.pipeline.state import State
from stoker.transforms import ToTensor

pytestmark = pytest.mark.compiled_loop  # (the compiled producer loop: tests/conftest.py)


class _Record(Operation):
    """A compiled copy that records, for each batch, the Numba settings of the thread that runs it (a producer's)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.seen = np.zeros((capacity, 2), dtype=np.int64)  # threads, chunk size
        self.count = np.zeros(1, dtype=np.int64)

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery]:
        return previous_state, AllocationQuery(previous_state.shape, previous_state.dtype)

    def generate_code(self) -> Callable[..., Any]:
        seen_at, count_at, capacity = self.seen.ctypes.data, self.count.ctypes.data, len(self.seen)
        address = native.address_as_pointer

        def record(batch, dst):  # type: ignore[no-untyped-def]
            seen = numba.carray(address(seen_at), (capacity, 2), np.int64)
            count = numba.carray(address(count_at), (1,), np.int64)
            k = count[0]
            count[0] = k + 1
            seen[k, 0] = numba.get_num_threads()
            seen[k, 1] = numba.get_parallel_chunksize()
            dst[:] = batch
            return dst

        return record


@pytest.mark.filterwarnings("ignore:Cannot cache compiled function:numba.core.errors.NumbaWarning")  # (addresses as constants)
@pytest.mark.parametrize(("num_workers", "batch_size"), [(1, 100), (2, 100), (2, 7), (3, 64)])
def test_producers_run_parallel_loops_in_chunks_and_leave_the_loop_thread_alone(
    table_path: Path, num_workers: int, batch_size: int
) -> None:
    record = _Record()
    before = numba.get_parallel_chunksize()
    pipelines = {"x": [NDArrayDecoder(), record, ToTensor()], "y": [IntDecoder(), ToTensor()]}
    with Loader(table_path, batch_size=batch_size, num_workers=num_workers, pipelines=pipelines) as loader:
        batches = sum(1 for _ in loader)
        assert loader._plan is not None and loader._plan.loop is not None  # the compiled producers ran it
    threads = max(1, min(num_workers, numba.config.NUMBA_NUM_THREADS))  # one producer: the operation keeps no promise
    chunk = -(-batch_size // (CHUNKS_PER_THREAD * threads)) if threads > 1 else 0
    assert int(record.count[0]) == batches
    assert {(int(t), int(c)) for t, c in record.seen[:batches]} == {(threads, chunk)}
    assert numba.get_parallel_chunksize() == before  # the settings are the producer thread's own
