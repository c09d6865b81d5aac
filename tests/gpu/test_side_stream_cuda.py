"""Streams other than the current one, on a GPU: nested outputs record the consumer's stream, and a batch read on a
side stream is not rewritten before that stream has read it once declared with ``stoker.device.record_stream``.

The side stream (or the consumer's) sleeps about :data:`SLEEP_MS` before it reads each batch, and the loop never
synchronises: the host runs far ahead of the GPU. The same properties without a GPU:
``tests/device/test_side_streams.py``. Skipped without CUDA.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import stoker.device
from stoker import prefetch
from stoker.decoders import IntDecoder, NDArrayDecoder
from stoker.device._stream import CudaBackend
from stoker.fields import IntField, NDArrayField
from stoker.loader import Loader, OrderOption
from stoker.transforms import ToDevice, ToTensor
from stoker.writer import DatasetWriter

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

N_ROWS, WIDTH, BATCH = 4096, 64, 256  # 16 batches
#: how long a stream sleeps before it reads each batch [milliseconds]
SLEEP_MS = 30.0


def _elapsed_ms(cycles: int) -> float:
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
    _elapsed_ms(1000)  # warm-up: the kernel's first launch
    probe = 1_000_000
    while (ms := _elapsed_ms(probe)) < 5.0:
        probe *= 4
    cycles = int(probe * SLEEP_MS / ms)
    assert _elapsed_ms(cycles) >= 0.7 * SLEEP_MS
    return cycles


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """x[i] = i * WIDTH + column (exact in float32), y[i] = i."""
    p = tmp_path_factory.mktemp("gpu-side") / "t.stoker"
    x = np.arange(N_ROWS * WIDTH, dtype=np.float32).reshape(N_ROWS, WIDTH)
    fields = {"x": NDArrayField(shape=(WIDTH,), dtype=np.dtype("float32")), "y": IntField()}
    DatasetWriter(p, fields, progress=False).from_arrays({"x": x, "y": np.arange(N_ROWS)})
    return p


def _loader(path: Path, ahead: bool = True, **kw: Any) -> Loader:
    pipes = kw.pop("pipelines", None) or {
        "x": [NDArrayDecoder(), ToTensor(), ToDevice("cuda")],
        "y": [IntDecoder(), ToTensor(), ToDevice("cuda")],
    }
    kw.setdefault("batches_ahead", 3)  # fewer slots than the epoch's 16 batches: every slot is reused
    loader = Loader(path, batch_size=BATCH, order=OrderOption.SEQUENTIAL, pipelines=pipes, **kw)
    loader._copy_ahead = ahead
    return loader


def _sums(b: int) -> tuple[float, float]:
    """What batch ``b``'s x and y sum to."""
    rows = np.arange(b * BATCH, min((b + 1) * BATCH, N_ROWS), dtype=np.float64)
    x = (rows[:, None] * WIDTH + np.arange(WIDTH)).sum()
    return float(x), float(rows.sum())


def _wrong(snapshots: list[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    """The batches whose snapshot does not hold their own rows."""
    torch.cuda.synchronize()
    got = [(float(x.double().sum()), float(y.double().sum())) for x, y in snapshots]
    return [b for b, sums in enumerate(got) if sums != _sums(b)]


# ---- b. nested outputs -------------------------------------------------------------------------------


@pytest.mark.parametrize("record", [False, True])
def test_every_tensor_of_a_nested_batch_records_the_stream_for_the_allocator(sleep_cycles: int, record: bool) -> None:
    """Memory allocated on one stream, recorded on another that is still busy, then freed: the allocator does not give
    it to the next allocation on the first stream (each tensor of a tuple of dicts of lists). Without the record
    (the control) it does, at once: what a consumer still reading it would see overwritten."""
    device = torch.device("cuda", torch.cuda.current_device())
    producer, consumer = torch.cuda.Stream(), torch.cuda.current_stream()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # (no cached block of another test in the way: the control's reuse is then certain)

    def allocate() -> list[torch.Tensor]:
        with torch.cuda.stream(producer):
            return [torch.empty(1 << 20, device=device) for _ in range(4)]

    made = allocate()
    nested = ({"a": [made[0], {"b": made[1]}]}, [(made[2],)], {"c": {"d": [[made[3]]]}})
    consumer.wait_stream(producer)
    if record:
        keys = CudaBackend(device).record_stream(nested, consumer)
        assert keys == {t.untyped_storage().data_ptr() for t in made}
    torch.cuda._sleep(sleep_cycles)  # the consumer's stream is busy: its reads of the batch come after this
    old = {t.data_ptr() for t in made}
    del made, nested
    again = allocate()
    reused = old & {t.data_ptr() for t in again}
    torch.cuda.synchronize()
    if record:
        assert not reused, "memory recorded on a busy stream went to another allocation before that stream was done"
    else:
        assert reused, "control: memory not recorded is reused at once (else this test could not fail)"


def test_a_loader_whose_tail_returns_nested_fresh_tensors_under_a_slow_consumer(path: Path, sleep_cycles: int) -> None:
    """Operations after ToDevice allocate on the loader's stream and return nested containers: every tensor must
    record the consumer's stream, or the next batch's allocation takes the memory while the consumer still reads it."""
    pipes = {
        "x": [NDArrayDecoder(), ToTensor(), ToDevice("cuda"), lambda t: ({"rows": [t * 1.0]},)],
        "y": [IntDecoder(), ToTensor(), ToDevice("cuda"), lambda t: {"ids": (t + 0,)}],
    }
    snapshots = []
    batch: Any
    for batch in _loader(path, pipelines=pipes):
        x, y = batch
        torch.cuda._sleep(sleep_cycles)
        snapshots.append((x[0]["rows"][0].clone(), y["ids"][0].clone()))
        del batch
        del x, y  # freed on the host before the reads ran
    assert len(snapshots) == N_ROWS // BATCH
    assert _wrong(snapshots) == []


# ---- a. a side stream ----------------------------------------------------------------------------------


def _read_on_side(batches: Any, sleep_cycles: int, declare: bool, what: Any = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each batch read on a side stream after a sleep there; the batch dropped at once; never a synchronisation."""
    side = torch.cuda.Stream()
    snapshots = []
    for batch in batches:
        x, y = what(batch) if what is not None else batch
        side.wait_stream(torch.cuda.current_stream())  # (the batch is ready on the current stream)
        with torch.cuda.stream(side):
            torch.cuda._sleep(sleep_cycles)
            snapshots.append((x.clone(), y.clone()))
        if declare:
            stoker.device.record_stream(batch, side)
        del batch, x, y
    torch.cuda.current_stream().wait_stream(side)
    return snapshots


@pytest.mark.parametrize("ahead", [True, False])
def test_a_loader_batch_read_on_a_declared_side_stream_is_never_overwritten(path: Path, sleep_cycles: int, ahead: bool) -> None:
    loader = _loader(path, ahead)
    for epoch in range(2):
        snapshots = _read_on_side(loader, sleep_cycles, declare=True)
        assert len(snapshots) == N_ROWS // BATCH
        assert _wrong(snapshots) == [], f"epoch {epoch}"


def test_control_a_loader_batch_read_on_an_undeclared_side_stream_is_overwritten(path: Path, sleep_cycles: int) -> None:
    """The hazard the declaration is for: the loader's copies wait only for the streams current at a ``next()`` (idle
    here), so they rewrite the slots while the side stream sleeps. If this control saw no wrong batch, the test above
    could not fail."""
    loader = _loader(path)
    loader._allocate()
    assert loader._num_slots < N_ROWS // BATCH, "slots are reused within the epoch"
    snapshots = _read_on_side(loader, sleep_cycles, declare=False)
    assert _wrong(snapshots) != []


def test_a_named_loader_and_prefetch_on_a_declared_side_stream(path: Path, sleep_cycles: int) -> None:
    """A named loader's dict, and prefetch's batches (memory of PyTorch's allocator, which the declaration's
    ``Tensor.record_stream`` protects), read on a side stream."""
    named = _read_on_side(_loader(path, named=True), sleep_cycles, True, what=lambda b: (b["x"], b["y"]))
    assert _wrong(named) == []
    cpu = Loader(path, batch_size=BATCH, order=OrderOption.SEQUENTIAL)
    fetched = _read_on_side(prefetch(cpu, "cuda", depth=3), sleep_cycles, True)
    assert _wrong(fetched) == []
