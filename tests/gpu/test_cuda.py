"""CUDA paths: pinned memory, the loader's stream, ToDevice. Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from stoker.fields import IntField, NDArrayField
from stoker.fields.decoders import IntDecoder, NDArrayDecoder
from stoker.loader import Loader, OrderOption
from stoker.transforms import Squeeze, ToDevice, ToTensor
from stoker.writer import DatasetWriter

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("gpu") / "t.stoker"
    x = np.arange(4000 * 8, dtype=np.float32).reshape(4000, 8)
    DatasetWriter(p, {"x": NDArrayField(shape=(8,), dtype=np.dtype("float32")), "y": IntField()}, progress=False).from_arrays(
        {"x": x, "y": np.arange(4000)}
    )
    return p


def test_to_device_cuda_matches_cpu(path: Path) -> None:
    pipes = {
        "x": [NDArrayDecoder(), ToTensor(), ToDevice("cuda")],
        "y": [IntDecoder(), ToTensor(), ToDevice(torch.device("cuda")), Squeeze()],
    }
    loader = Loader(path, batch_size=256, order=OrderOption.RANDOM, seed=0, pipelines=pipes)
    cpu = Loader(path, batch_size=256, order=OrderOption.RANDOM, seed=0)
    for (x, y), (cx, cy) in zip(loader, cpu, strict=True):
        assert x.is_cuda and y.is_cuda
        torch.testing.assert_close(x.cpu(), cx)
        torch.testing.assert_close(y.cpu(), cy.squeeze(1))


def test_batch_memory_is_pinned_and_reused(path: Path) -> None:
    loader = Loader(path, batch_size=256, pipelines={"x": [NDArrayDecoder(), ToTensor(), ToDevice("cuda")], "y": None})
    step = loader.pipelines[0].steps[0]
    loader._allocate()
    assert torch.from_numpy(step.memory).is_pinned()
    ptrs = {x.data_ptr() for _ in range(3) for (x,) in loader}
    assert len(ptrs) <= loader._num_slots


def test_consumer_stream_sees_complete_batches(path: Path) -> None:
    loader = Loader(
        path,
        batch_size=512,
        order=OrderOption.RANDOM,
        seed=1,
        pipelines={"x": [NDArrayDecoder(), ToTensor(), ToDevice("cuda")], "y": [IntDecoder(), ToTensor(), ToDevice("cuda")]},
    )
    for _ in range(3):
        for x, y in loader:
            expected = y.squeeze(1).float()[:, None] * 8 + torch.arange(8, device="cuda")
            torch.testing.assert_close(x, expected)
            torch.cuda._sleep(1000)  # keep the user's stream busy so reuse must wait
