"""A custom decoder written as FFCV's are, with the two changes docs/loader.md#custom-decoders shows."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from stoker.fields import BytesField, IntField
from stoker.loader import Loader, OrderOption
from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.compiler import Compiler
from stoker.pipeline.operation import Operation
from stoker.pipeline.state import State
from stoker.transforms import ToTensor
from stoker.writer import DatasetWriter


class SumOfBytesDecoder(Operation):
    """FFCV-style: decodes a bytes field into the sum of its bytes (int64), reading the file directly."""

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery]:
        return replace(previous_state, jit_mode=True, shape=(1,), dtype=np.dtype("<i8")), AllocationQuery((1,), np.dtype("<i8"))

    def generate_code(self):  # type: ignore[no-untyped-def]
        my_range = Compiler.get_iterator()

        def decode(batch_indices, destination, arrays, storage, seeds):  # type: ignore[no-untyped-def]
            ptrs, sizes = arrays  # the field's metadata columns, indexed by sample
            for ix in my_range(len(batch_indices)):
                sample_id = batch_indices[ix]
                start, n = ptrs[sample_id], sizes[sample_id]
                total = 0
                for k in range(n):
                    total += np.int64(storage[start + k])
                destination[ix, 0] = total
            return destination

        decode.is_parallel = True  # type: ignore[attr-defined]
        return decode


@pytest.fixture(scope="module")
def blobs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[bytes]]:
    rng = np.random.default_rng(3)
    values = [rng.integers(0, 256, rng.integers(0, 40), dtype=np.uint8).tobytes() for _ in range(97)]
    path = tmp_path_factory.mktemp("custom") / "blobs.stoker"

    class Data:
        def __len__(self) -> int:
            return len(values)

        def __getitem__(self, i: int) -> tuple[bytes, int]:
            return values[i], i

    DatasetWriter(path, {"blob": BytesField(), "i": IntField()}, num_workers=1).from_indexed_dataset(Data())
    return path, values


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("workers", [1, 2])
def test_a_custom_decoder_in_ffcvs_style_reads_every_sample(blobs: tuple[Path, list[bytes]], compiled: bool, workers: int) -> None:
    path, values = blobs
    loader = Loader(path, batch_size=10, num_workers=workers, order=OrderOption.RANDOM, seed=1, compile=compiled,
                    pipelines={"blob": [SumOfBytesDecoder(), ToTensor()]})  # fmt: skip
    seen = 0
    for sums, idx in loader:
        for s, i in zip(sums[:, 0].tolist(), idx[:, 0].tolist()):
            assert s == sum(values[i]), f"sample {i}"
            seen += 1
    assert seen == len(values)
