"""CUDA paths: pinned memory, the loader's stream, ToDevice. Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from stoker.decoders import IntDecoder, NDArrayDecoder
from stoker.fields import IntField, NDArrayField
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
    loader._allocate()
    memory = loader.pipelines[0].slot_memory(0)[0]  # the decoder's memory in slot 0
    assert torch.from_numpy(memory).is_pinned()
    ptrs = {x.data_ptr() for _ in range(3) for (x,) in loader}
    assert len(ptrs) <= loader._num_slots


#: how long the user's stream is kept busy per batch [milliseconds]: long enough that a producer
#: which did not wait for the user's stream would overwrite a batch before the user reads it
SLEEP_MS = 60.0


def _elapsed_ms(cycles: int) -> float:
    """Time of ``torch.cuda._sleep(cycles)`` on the current stream, measured with CUDA events [milliseconds]."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end))


@pytest.fixture(scope="module")
def sleep_cycles() -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` needs to keep a stream busy for about :data:`SLEEP_MS`."""
    _elapsed_ms(1000)  # warm-up: the first launch pays for loading the kernel
    probe = 1_000_000
    ms = _elapsed_ms(probe)
    while ms < 5.0:  # measure at least a few milliseconds, so the rate is not launch overhead
        probe *= 4
        ms = _elapsed_ms(probe)
    cycles = int(probe * SLEEP_MS / ms)
    measured = _elapsed_ms(cycles)
    assert measured >= 0.7 * SLEEP_MS, f"calibrated {cycles} cycles to sleep {SLEEP_MS} ms, but they slept {measured:.1f} ms"
    return cycles


def test_the_sleep_is_long_enough_to_show_a_race(sleep_cycles: int) -> None:
    """Control: a copy on another stream that does not wait overtakes a read queued behind the sleep.

    This is the race the loader must prevent; if this control did not see it,
    the test below could not fail.
    """
    first = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    second = torch.full_like(first, -1.0).pin_memory()
    buf = first.to("cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(sleep_cycles)  # the user's stream is busy...
    snapshot = buf.clone()  # ...and reads the buffer afterwards
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # a careless producer: no wait on the user's stream
        buf.copy_(second, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(snapshot.cpu(), second), "the unsynchronised copy did not overtake the sleeping stream: sleep longer"


def test_consumer_stream_sees_complete_batches(path: Path, sleep_cycles: int) -> None:
    """Each batch is read on the user's stream only after a long sleep queued there, and is still intact.

    The loop never synchronises with the GPU, so the host runs far ahead: the
    loader must make its stream wait for the user's work on a slot before
    copying into it again (and keep the pinned memory until its copy is done).
    Without that, later batches overwrite the slots while the sleeps run and
    the snapshots hold the wrong rows.
    """
    batch_size = 256  # 16 batches: more than the loader's slots, so that every slot is reused
    loader = Loader(
        path,
        batch_size=batch_size,
        order=OrderOption.SEQUENTIAL,
        pipelines={"x": [NDArrayDecoder(), ToTensor(), ToDevice("cuda")], "y": [IntDecoder(), ToTensor(), ToDevice("cuda")]},
        batches_ahead=3,  # (the default for batches this small would give a slot to every batch of the epoch)
    )
    num_batches = -(-4000 // batch_size)
    assert num_batches > loader._num_slots, "the epoch must be longer than the slots, so that slots are reused"
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    for _ in range(2):
        snapshots = []
        start.record()
        for x, y in loader:
            torch.cuda._sleep(sleep_cycles)  # keep the user's stream busy...
            snapshots.append((x.clone(), y.clone()))  # ...so that it reads the batch late
        end.record()
        torch.cuda.synchronize()
        assert start.elapsed_time(end) >= 0.7 * SLEEP_MS * num_batches  # the sleeps ran on the user's stream
        assert len(snapshots) == num_batches
        for b, (x, y) in enumerate(snapshots):
            rows = torch.arange(b * batch_size, min((b + 1) * batch_size, 4000), device="cuda")
            torch.testing.assert_close(y.squeeze(1), rows, msg=f"labels of batch {b} were overwritten")
            torch.testing.assert_close(x, (rows[:, None] * 8 + torch.arange(8, device="cuda")).float(), msg=f"batch {b} was overwritten")
