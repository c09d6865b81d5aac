"""The Loader's copies ahead of the step, on a GPU: ordering, held batches, breaks, resume, nested batches, report().

The consumer queues long matrix products on its stream per batch and, unless a
test says so, never synchronises: the host runs far ahead of the GPU. Skipped
without CUDA.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

from stoker import prefetch
from stoker.decoders import IntDecoder, NDArrayDecoder
from stoker.fields import IntField, NDArrayField
from stoker.loader import Loader, OrderOption
from stoker.transforms import ToDevice, ToTensor
from stoker.writer import DatasetWriter

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

N_ROWS, WIDTH, BATCH = 4096, 256, 256  # 16 batches
#: how long the consumer's step keeps its stream busy [milliseconds]
STEP_MS = 20.0


class Busy:
    """A consumer's step: ``n`` matrix products queued on the current stream (no host synchronisation)."""

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
    work = Busy()
    work.elapsed_ms()
    while (ms := work.elapsed_ms()) < 5.0:
        work.n *= 2
    work.n = max(1, math.ceil(work.n * STEP_MS / ms))
    return work


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """x[i] = i * WIDTH + column (exact in float32), y[i] = i."""
    p = tmp_path_factory.mktemp("gpu-ahead") / "t.stoker"
    x = np.arange(N_ROWS * WIDTH, dtype=np.float32).reshape(N_ROWS, WIDTH)
    fields = {"x": NDArrayField(shape=(WIDTH,), dtype=np.dtype("float32")), "y": IntField()}
    DatasetWriter(p, fields, progress=False).from_arrays({"x": x, "y": np.arange(N_ROWS)})
    return p


def _loader(path: Path, ahead: bool = True, **kw: Any) -> Loader:
    pipes = {"x": [NDArrayDecoder(), ToTensor(), ToDevice("cuda")], "y": [IntDecoder(), ToTensor(), ToDevice("cuda")]}
    kw.setdefault("order", OrderOption.SEQUENTIAL)
    loader = Loader(path, batch_size=BATCH, pipelines=pipes, **kw)
    loader._copy_ahead = ahead
    return loader


def _want(rows: torch.Tensor) -> torch.Tensor:
    return (rows[:, None] * WIDTH + torch.arange(WIDTH, device=rows.device)).float()


def _check(batches: list[tuple[torch.Tensor, torch.Tensor]], first: int = 0, what: str = "") -> None:
    for k, (x, y) in enumerate(batches):
        b = first + k
        rows = torch.arange(b * BATCH, min((b + 1) * BATCH, N_ROWS), device="cuda")
        torch.testing.assert_close(y.reshape(-1), rows, rtol=0, atol=0, msg=f"labels of batch {b} {what}")
        torch.testing.assert_close(x, _want(rows), rtol=0, atol=0, msg=f"rows of batch {b} {what}")


def _timed_copies(loader: Loader) -> list[torch.cuda.Event]:
    """A timing event recorded on the transfer's stream after each batch's copies (in the order they are queued)."""
    loader._allocate()
    transfer = loader._transfer
    end = transfer.end
    done: list[torch.cuda.Event] = []

    def spy(slot: int, outputs: Any = None, held: Any = None) -> None:
        end(slot, outputs, held)
        event = torch.cuda.Event(enable_timing=True)
        event.record(transfer.stream)
        done.append(event)

    transfer.end = spy  # type: ignore[method-assign]
    return done


@pytest.mark.parametrize("ahead", [True, False])
def test_each_copy_is_done_before_the_step_before_its_batch_ends(path: Path, busy: Busy, ahead: bool) -> None:
    """Copies ahead: batch b+1 is on the GPU before step b has finished (the step never waits for it). The loop-thread
    path queues it behind step b: it lands after step b has ended, and step b+1 waits for it."""
    loader = _loader(path, ahead)
    copied = _timed_copies(loader)
    t0 = torch.cuda.Event(enable_timing=True)
    step_end = []
    snapshots = []
    torch.cuda.synchronize()
    t0.record()
    for x, y in loader:
        busy()
        snapshots.append((x.clone(), y.clone()))
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        step_end.append(end)
    torch.cuda.synchronize()
    _check(snapshots)
    n = len(step_end)
    assert len(copied) == n == N_ROWS // BATCH
    before = [t0.elapsed_time(copied[b + 1]) < t0.elapsed_time(step_end[b]) for b in range(1, n - 1)]
    if ahead:
        assert all(before), f"copies that landed after the step before their batch ended: {before}"
    else:
        assert not any(before), f"the loop-thread path queues each copy behind the user's step: {before}"


def test_a_loop_that_synchronises_each_step_never_waits_for_the_gpu_in_next(path: Path, busy: Busy) -> None:
    loader = _loader(path)
    for _ in range(2):
        for x, _y in loader:
            busy()
            float(x[0, 0])  # (a loss.item(): the host waits for the step here, in the step)
    assert loader._transfer.host_waits == 0
    assert loader.stats()["loader"]["consumer_waiting_for_device"] == 0.0


def test_held_batches_and_a_break_mid_epoch(path: Path, busy: Busy) -> None:
    loader = _loader(path, batches_ahead=6)
    kept, snapshots = [], []
    for b, (x, y) in enumerate(loader):
        busy()
        snapshots.append((x.clone(), y.clone()))
        if b % 3 == 0:
            kept.append((x, y))
        if b == 8:
            break  # batches issued ahead are in flight
    again = []
    for x, y in loader:  # the next epoch: slots issued ahead and never handed over are reused
        busy()
        again.append((x.clone(), y.clone()))
    torch.cuda.synchronize()
    _check(snapshots, what="(before the break)")
    _check(again, what="(the epoch after the break)")
    for k, (x, y) in enumerate(kept):
        _check([(x, y)], first=3 * k, what="(kept)")
    assert loader.stats()["loader"]["kept_batches"] >= 1


def test_resume_with_read_ahead(path: Path, busy: Busy) -> None:
    loader = _loader(path, order=OrderOption.RANDOM, seed=5)
    batches = prefetch(loader, "cuda", depth=3)
    seen = []
    for b, (x, y) in enumerate(batches):
        busy()
        seen.append((x.clone(), y.clone()))
        if b == 6:
            state = batches.state_dict()  # inside the loop: after break, it is the next epoch's start
            break
    resumed = _loader(path, order=OrderOption.RANDOM, seed=5)
    resumed.load_state_dict(state)
    rest = []
    for x, y in prefetch(resumed, "cuda", depth=3):
        busy()
        rest.append((x.clone(), y.clone()))
    whole = [(x.clone(), y.clone()) for x, y in _loader(path, order=OrderOption.RANDOM, seed=5)]
    torch.cuda.synchronize()
    assert len(seen) + len(rest) == len(whole)
    for (x, y), (wx, wy) in zip(seen + rest, whole, strict=True):
        torch.testing.assert_close(y, wy, rtol=0, atol=0)
        torch.testing.assert_close(x, wx, rtol=0, atol=0)


class Pair(NamedTuple):
    ids: torch.Tensor
    name: str


@dataclasses.dataclass(frozen=True)
class Extra:
    mask: torch.Tensor
    weights: list[torch.Tensor]


def _nested(n: int) -> Iterator[dict[str, Any]]:
    for b in range(n):
        rows = torch.arange(b * BATCH, (b + 1) * BATCH)
        yield {
            "x": _want(rows),  # pageable, large: its own copy
            "meta": {
                "pair": Pair(rows[:4].clone(), f"batch {b}"),
                "extra": Extra(rows % 2 == 0, [rows.double(), rows[:3].clone().pin_memory()]),
            },
            "label": rows.clone(),
        }


def test_nested_batches_through_prefetch_under_a_busy_step(busy: Busy) -> None:
    got = []
    for b, batch in enumerate(prefetch(_nested(10), "cuda", depth=3)):
        assert isinstance(batch["meta"]["pair"], Pair) and isinstance(batch["meta"]["extra"], Extra)
        assert batch["meta"]["pair"].name == f"batch {b}"
        busy()
        extra = batch["meta"]["extra"]
        got.append((batch["x"].clone(), batch["label"].clone(), batch["meta"]["pair"].ids.clone(), extra.mask.clone(),
                    extra.weights[0].clone(), extra.weights[1].clone()))  # fmt: skip
        del batch
    torch.cuda.synchronize()
    for b, (x, label, ids, mask, w0, w1) in enumerate(got):
        rows = torch.arange(b * BATCH, (b + 1) * BATCH, device="cuda")
        torch.testing.assert_close(x, _want(rows), rtol=0, atol=0)
        assert torch.equal(label, rows) and torch.equal(ids, rows[:4]) and torch.equal(mask, rows % 2 == 0)
        assert torch.equal(w0, rows.double()) and torch.equal(w1, rows[:3])


@pytest.mark.parametrize("sync_each_step", [False, True])
def test_a_gpu_bound_loop_is_not_data_bound(path: Path, busy: Busy, sync_each_step: bool) -> None:
    """Big matrix products per step and a cheap pipeline: the GPU is the bottleneck, and report() says so."""
    loader = _loader(path, order=OrderOption.RANDOM, seed=1)
    for _ in range(3):
        for x, _y in loader:
            busy()
            if sync_each_step:
                float(x[0, 0])
    torch.cuda.synchronize()
    a = loader.stats()["accounting"]
    text = loader.report()
    assert a["verdict"] == "not data-bound" and a["stall_share"] < 0.1, text
    if a["device_s"] > 0:
        assert "blocked on the device" in text
