"""Numba's per-thread settings in producer threads: threads for the batch's parallel loops, and their chunk size."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numba
import pytest

from stoker.fields.decoders import IntDecoder, NDArrayDecoder
from stoker.loader import Loader
from stoker.loader._epoch import CHUNKS_PER_THREAD
from stoker.pipeline.operation import Operation
from stoker.pipeline.state import State
from stoker.transforms import ToTensor


class _Record(Operation):
    """A Python step after ToTensor: records the calling thread's Numba settings for each batch."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, int]] = []

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, None]:
        return previous_state, None

    def generate_code(self) -> Callable[..., Any]:
        seen = self.seen

        def record(batch: Any, dst: Any) -> Any:
            seen.append((len(batch), numba.get_num_threads(), numba.get_parallel_chunksize()))
            return batch

        return record


@pytest.mark.parametrize(("num_workers", "batch_size"), [(1, 100), (2, 100), (2, 7), (3, 64)])
def test_producers_run_parallel_loops_in_chunks_and_leave_the_loop_thread_alone(
    table_path: Path, num_workers: int, batch_size: int
) -> None:
    record = _Record()
    before = numba.get_parallel_chunksize()
    pipelines = {"x": [NDArrayDecoder(), ToTensor(), record], "y": [IntDecoder(), ToTensor()]}
    with Loader(table_path, batch_size=batch_size, num_workers=num_workers, pipelines=pipelines) as loader:
        batches = sum(1 for _ in loader)
    threads = max(1, min(num_workers, numba.config.NUMBA_NUM_THREADS))  # one producer: the operation keeps no promise
    chunk = -(-batch_size // (CHUNKS_PER_THREAD * threads)) if threads > 1 else 0
    assert len(record.seen) == batches
    assert {(t, c) for _, t, c in record.seen} == {(threads, chunk)}
    assert numba.get_parallel_chunksize() == before  # the settings are the producer thread's own
