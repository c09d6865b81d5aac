"""``to_device``, ``prefetch`` and the loader's CUDA path under a slow consumer. Skipped without CUDA.

The consumer queues a long chain of matrix products on its stream before it
reads each batch, and never synchronises: the host runs far ahead of the GPU.
Copies that did not wait for the consumer's stream, memory given back to the
allocator without ``record_stream``, or page-locked buffers reused before
their copy would change batches before the consumer reads them; every batch
read is compared with what the CPU path gives.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from stoker import prefetch, to_device
from stoker.decoders import IntDecoder, NDArrayDecoder
from stoker.device import COALESCE_MAX_BYTES
from stoker.fields import IntField, NDArrayField
from stoker.loader import Loader, OrderOption
from stoker.transforms import ToDevice, ToTensor
from stoker.writer import DatasetWriter

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

N_ROWS, WIDTH = 4000, 256
#: how long the consumer keeps its stream busy before reading each batch [milliseconds]
BUSY_MS = 40.0


class Busy:
    """A slow consumer kernel: ``n`` matrix products queued on the current stream (no host synchronisation)."""

    def __init__(self, size: int = 2048) -> None:
        g = torch.Generator(device="cuda").manual_seed(0)
        self.a = torch.randn(size, size, device="cuda", generator=g)
        self.b = torch.randn(size, size, device="cuda", generator=g) / math.sqrt(size)
        self.c = torch.empty_like(self.a)
        self.n = 1

    def __call__(self) -> None:
        for _ in range(self.n):
            torch.mm(self.a, self.b, out=self.c)

    def elapsed_ms(self) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        self()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))


@pytest.fixture(scope="module")
def busy() -> Busy:
    """A :class:`Busy` calibrated to keep the stream busy for about :data:`BUSY_MS`."""
    work = Busy()
    work.elapsed_ms()  # warm-up: cuBLAS handles, the kernel's first launch
    while (ms := work.elapsed_ms()) < 5.0:  # measure at least a few milliseconds, not launch overhead
        work.n *= 2
    work.n = max(1, math.ceil(work.n * BUSY_MS / ms))
    return work


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """x[i] = i * WIDTH + column (exact in float32), y[i] = i."""
    p = tmp_path_factory.mktemp("gpu-prefetch") / "t.stoker"
    x = np.arange(N_ROWS * WIDTH, dtype=np.float32).reshape(N_ROWS, WIDTH)
    fields = {"x": NDArrayField(shape=(WIDTH,), dtype=np.dtype("float32")), "y": IntField()}
    DatasetWriter(p, fields, progress=False).from_arrays({"x": x, "y": np.arange(N_ROWS)})
    return p


def _rows_x(rows: torch.Tensor) -> torch.Tensor:
    return (rows[:, None] * WIDTH + torch.arange(WIDTH, device=rows.device)).float()


def _pageable_batches(n: int, rows: int = 256) -> Iterator[dict[str, Any]]:
    """Batches in pageable memory: x is above the coalescing size (its own copy), y and the ids below (packed)."""
    for b in range(n):
        idx = torch.arange(b * rows, (b + 1) * rows)
        x = _rows_x(idx)
        assert x.numel() * 4 > COALESCE_MAX_BYTES and not x.is_pinned()
        yield {"x": x, "y": idx, "ids": (idx[:3].clone(), f"batch {b}"), "flag": torch.tensor(b % 2 == 0)}


def _expected(b: int, rows: int = 256) -> dict[str, torch.Tensor]:
    idx = torch.arange(b * rows, (b + 1) * rows, device="cuda")
    return {"x": _rows_x(idx), "y": idx}


def test_the_busy_kernel_is_long_enough_to_show_a_race(busy: Busy) -> None:
    """Control: a copy on another stream that does not wait overtakes a read queued behind the busy kernel.

    This is the race the code under test must prevent; if this control did not
    see it, the tests below could not fail.
    """
    first = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    second = torch.full_like(first, -1.0).pin_memory()
    buf = first.to("cuda")
    torch.cuda.synchronize()
    busy()  # the consumer's stream is busy...
    snapshot = buf.clone()  # ...and reads the buffer afterwards
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # a careless producer: no wait on the consumer's stream
        buf.copy_(second, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(snapshot.cpu(), second), "the unsynchronised copy did not overtake the busy stream: make Busy longer"


# ---- to_device ----------------------------------------------------------------------------------


def test_to_device_equals_the_cpu_batch() -> None:
    big = torch.arange(COALESCE_MAX_BYTES, dtype=torch.float32).reshape(-1, 64).t()  # large and transposed
    batch = {
        "small": [torch.arange(10, dtype=dt).reshape(2, 5) for dt in (torch.uint8, torch.int16, torch.int64, torch.float16)],
        "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "strided": torch.arange(100).reshape(10, 10)[::3, 1::2],
        "complex": torch.randn(3, dtype=torch.complex64).conj(),
        "big": big,
        "pinned": torch.arange(5.0).pin_memory(),
        "text": "kept",
    }
    moved = to_device(batch, "cuda")
    assert moved["text"] == "kept"
    for old, new in zip(_tensors(batch), _tensors(moved), strict=True):
        assert new.is_cuda and new.dtype == old.dtype and new.shape == old.shape
        torch.testing.assert_close(new.cpu(), old.resolve_conj(), rtol=0, atol=0)
    small = [t for name in ("small", "bool", "scalar", "strided", "complex", "pinned") for t in _tensors(moved[name])]
    storages = {t.untyped_storage().data_ptr() for t in small}
    assert len(storages) == 1, "small tensors share one device buffer: one copy"
    assert moved["big"].untyped_storage().data_ptr() not in storages
    assert moved["big"].stride() == big.stride(), "large tensors keep their strides, as with Tensor.to"
    back = to_device(moved, "cpu")
    for old, new in zip(_tensors(batch), _tensors(back), strict=True):
        assert new.device.type == "cpu"
        torch.testing.assert_close(new, old.resolve_conj(), rtol=0, atol=0)  # complete: no synchronize needed


def _tensors(tree: Any) -> list[torch.Tensor]:
    from stoker.device._tree import tree_map

    found: list[torch.Tensor] = []

    def collect(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    tree_map(collect, tree)
    return found


def test_to_device_sources_can_change_once_it_returns(busy: Busy) -> None:
    """Pageable sources are staged: writing them after ``to_device`` returns does not reach the copy queued behind a busy stream."""
    results, expected = [], []
    for b, batch in enumerate(_pageable_batches(8)):
        busy()  # the copy is queued on this stream, behind the busy kernel
        results.append(to_device(batch, "cuda"))
        expected.append(_expected(b))
        batch["x"].fill_(-1.0)  # the caller reuses its memory at once
        batch["y"].fill_(-1)
    torch.cuda.synchronize()
    for b, (got, want) in enumerate(zip(results, expected)):
        torch.testing.assert_close(got["x"], want["x"], rtol=0, atol=0, msg=f"x of batch {b}")
        torch.testing.assert_close(got["y"], want["y"], rtol=0, atol=0, msg=f"y of batch {b}")


def test_staging_buffers_outlive_their_copies(busy: Busy) -> None:
    """Staging buffers are not reused by the next call while the copy out of them waits behind a busy stream."""
    results = []
    for b in range(6):
        busy()
        results.append(to_device({"y": torch.full((1000,), b, dtype=torch.int64)}, "cuda"))  # packed: staged
    torch.cuda.synchronize()
    for b, got in enumerate(results):
        assert torch.equal(got["y"].cpu(), torch.full((1000,), b, dtype=torch.int64)), f"batch {b}"


# ---- prefetch -----------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_prefetch_under_a_slow_consumer(busy: Busy, depth: int) -> None:
    """Each batch is read after the busy kernel and dropped at once: prefetch's memory must not be reused before the read."""
    n = 12
    snapshots = []
    for b, batch in enumerate(prefetch(_pageable_batches(n), "cuda", depth=depth)):
        assert batch["x"].is_cuda and batch["ids"][1] == f"batch {b}"
        busy()  # the consumer's stream is busy...
        snapshots.append((batch["x"].clone(), batch["y"].clone(), batch["ids"][0].clone(), batch["flag"].clone()))
        del batch  # ...and the batch is freed on the host before its reads ran
    torch.cuda.synchronize()
    assert len(snapshots) == n
    for b, (x, y, ids, flag) in enumerate(snapshots):
        want = _expected(b)
        torch.testing.assert_close(x, want["x"], rtol=0, atol=0, msg=f"x of batch {b} was overwritten")
        torch.testing.assert_close(y, want["y"], rtol=0, atol=0, msg=f"y of batch {b} was overwritten")
        torch.testing.assert_close(ids, want["y"][:3], rtol=0, atol=0, msg=f"ids of batch {b} were overwritten")
        assert bool(flag) == (b % 2 == 0), f"flag of batch {b} was overwritten"


def test_prefetch_break_and_error_on_cuda() -> None:
    closed = []

    def source() -> Iterator[dict[str, Any]]:
        try:
            for b, batch in enumerate(_pageable_batches(10)):
                if b == 6:
                    raise ValueError("broken batch 6")
                yield batch
        finally:
            closed.append(True)

    got = []
    with pytest.raises(ValueError, match="broken batch 6"):
        for batch in prefetch(source(), "cuda", depth=3):
            got.append(batch["y"][0].item())
    assert got == [0, 256, 512, 768, 1024, 1280] and closed == [True]
    closed.clear()
    for b, _ in enumerate(prefetch(source(), "cuda", depth=3)):
        if b == 1:
            break
    assert closed == [True]


# ---- the loader's CUDA path ----------------------------------------------------------------------


def _cuda_loader(path: Path, **kwargs: Any) -> Loader:
    pipes = kwargs.pop("pipelines", None) or {
        "x": [NDArrayDecoder(), ToTensor(), ToDevice("cuda")],
        "y": [IntDecoder(), ToTensor(), ToDevice("cuda")],
    }
    kwargs.setdefault("batches_ahead", 3)  # fewer slots than the epoch's 16 batches: every slot is reused
    return Loader(path, batch_size=256, order=OrderOption.SEQUENTIAL, pipelines=pipes, **kwargs)


def _check(snapshots: list[tuple[torch.Tensor, torch.Tensor]], what: str) -> None:
    assert len(snapshots) == -(-N_ROWS // 256)
    for b, (x, y) in enumerate(snapshots):
        rows = torch.arange(b * 256, min((b + 1) * 256, N_ROWS), device="cuda")
        torch.testing.assert_close(y.reshape(-1), rows, rtol=0, atol=0, msg=f"labels of batch {b} ({what})")
        torch.testing.assert_close(x, _rows_x(rows), rtol=0, atol=0, msg=f"rows of batch {b} ({what})")


def test_loader_read_ahead_by_prefetch(path: Path, busy: Busy) -> None:
    """A wrapper that reads the loader ahead (prefetch over a Loader that already copies to CUDA).

    The loader's iterator is advanced ``depth`` batches before the consumer
    queues its work on a batch: the loader must not take ``next()`` as the sign
    that the consumer's stream is done with the previous batch.
    """
    loader = _cuda_loader(path)
    assert loader._num_slots < -(-N_ROWS // 256), "slots are reused within the epoch"
    snapshots = []
    for x, y in prefetch(loader, "cuda", depth=2):
        busy()
        snapshots.append((x.clone(), y.clone()))
        del x, y
    torch.cuda.synchronize()
    _check(snapshots, "read ahead by prefetch")


def test_loader_keeping_some_batches_under_a_slow_consumer(path: Path, busy: Busy) -> None:
    """Kept batches get fresh memory (allocated by a producer): the loader's copies must still wait for the consumer."""
    loader = _cuda_loader(path)
    for _ in range(2):
        snapshots, kept = [], []
        for b, (x, y) in enumerate(loader):
            busy()
            snapshots.append((x.clone(), y.clone()))
            if b % 3 == 0:
                kept.append((b, x, y))
        torch.cuda.synchronize()
        _check(snapshots, "with kept batches")
        for b, x, y in kept:
            rows = torch.arange(b * 256, min((b + 1) * 256, N_ROWS), device="cuda")
            torch.testing.assert_close(y.reshape(-1), rows, rtol=0, atol=0, msg=f"labels of kept batch {b}")
            torch.testing.assert_close(x, _rows_x(rows), rtol=0, atol=0, msg=f"rows of kept batch {b}")


def test_named_loader_on_cuda_equals_the_cpu_path(path: Path) -> None:
    cuda = _cuda_loader(path, named=True)
    cpu = Loader(path, batch_size=256, order=OrderOption.SEQUENTIAL, named=True)
    for a, b in zip(cuda, cpu, strict=True):
        assert list(a) == list(b) == ["x", "y"]
        torch.testing.assert_close(a["x"].cpu(), b["x"], rtol=0, atol=0)
        torch.testing.assert_close(a["y"].cpu(), b["y"], rtol=0, atol=0)


def _loader_passes_outputs_to_hand_over(path: Path) -> bool:
    loader = _cuda_loader(path)
    loader._allocate()
    transfer = loader._transfer
    original = transfer.hand_over
    seen = []

    def spy(slot: int, outputs: Any = None) -> None:
        seen.append(outputs is not None)
        original(slot, outputs)

    transfer.hand_over = spy
    next(iter(loader))
    loader.close()
    return any(seen)


def test_loader_with_an_operation_allocating_after_to_device(path: Path, busy: Busy) -> None:
    """An operation after ToDevice allocates on the loader's stream: the memory must record the consumer's stream."""
    assert _loader_passes_outputs_to_hand_over(path), "the Loader must pass the batch's outputs to its transfer's hand_over"
    pipes = {
        "x": [NDArrayDecoder(), ToTensor(), ToDevice("cuda"), lambda t: t * 1.0],  # a fresh tensor per batch
        "y": [IntDecoder(), ToTensor(), ToDevice("cuda"), lambda t: t + 0],
    }
    loader = _cuda_loader(path, pipelines=pipes)
    snapshots = []
    for x, y in loader:
        busy()
        snapshots.append((x.clone(), y.clone()))
        del x, y  # freed at once: the allocator must not give the memory back to the loader's stream early
    torch.cuda.synchronize()
    _check(snapshots, "operation after ToDevice")
