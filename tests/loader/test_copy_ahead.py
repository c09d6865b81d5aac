"""The Loader's CUDA path without a GPU: its transfer over a simulated device (``tests/device/_gpu_sim.py``).

The pipelines are CPU ones; the transfer (``StreamTransfer``) is the real one
over the simulated device, so the engine runs its CUDA path: each batch's tails
issued on the transfer's stream as soon as the batch is made (ahead of the
loop), handed over with the slot's event, slots given back with marks, and
next()'s waits for the device counted apart. What a GPU run does with the same
calls is checked in tests/gpu/test_copy_ahead_cuda.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from stoker import prefetch
from stoker.decoders import IntDecoder, NDArrayDecoder
from stoker.device._stream import StreamTransfer
from stoker.errors import LoaderError
from stoker.loader import Loader, OrderOption
from stoker.transforms import ToTensor
from tests.device._gpu_sim import SimGPU

BATCH = 64  # 1000 samples: 16 batches, the last one short


def _pipes(x_tail: list[Any] | None = None) -> dict[str, list[Any]]:
    return {"x": [NDArrayDecoder(), ToTensor(), *(x_tail or [])], "y": [IntDecoder(), ToTensor()]}


def sim_loader(path: Path, gpu: SimGPU | None = None, ahead: bool = True, **kw: Any) -> tuple[Loader, SimGPU, list[Any]]:
    """A Loader whose transfer runs over a simulated device; the list records each ``begin`` (slot, batches handed over)."""
    gpu = gpu if gpu is not None else SimGPU(eager=True)
    kw.setdefault("pipelines", _pipes())
    kw.setdefault("order", OrderOption.RANDOM)
    loader = Loader(path, batch_size=BATCH, seed=3, **kw)
    begins: list[Any] = []
    allocate = loader._allocate

    def allocate_with_transfer() -> None:
        fresh = not loader._allocated
        allocate()
        if fresh:
            transfer = StreamTransfer("sim", loader._num_slots, ahead=ahead, backend=gpu)
            begin = transfer.begin

            def spy(slot: int) -> None:
                active = loader._active() if loader._active is not None else None
                begins.append((slot, active.consumed if active is not None else None))
                begin(slot)

            transfer.begin = spy  # type: ignore[method-assign]
            loader._transfer = transfer

    loader._allocate = allocate_with_transfer  # type: ignore[method-assign]
    return loader, gpu, begins


def _plain(path: Path, **kw: Any) -> Loader:
    kw.setdefault("pipelines", _pipes())
    kw.setdefault("order", OrderOption.RANDOM)
    return Loader(path, batch_size=BATCH, seed=3, **kw)


def _same(a: Any, b: Any) -> None:
    assert len(a) == len(b)
    for u, v in zip(a, b, strict=True):
        torch.testing.assert_close(u, v, rtol=0, atol=0)


@pytest.mark.parametrize("ahead", [True, False])
@pytest.mark.parametrize("options", [{"num_workers": 1}, {"num_workers": 2}, {"num_workers": 2, "os_cache": False}], ids=str)
def test_the_cuda_path_gives_the_batches_of_the_cpu_path(table_path: Path, ahead: bool, options: dict[str, Any]) -> None:
    loader, _, begins = sim_loader(table_path, ahead=ahead, **options)
    plain = _plain(table_path, **options)
    for _ in range(2):
        got = [tuple(t.clone() for t in batch) for batch in loader]
        _same([b for batch in got for b in batch], [b for batch in plain for b in batch])
    assert len(begins) == 2 * len(loader) and loader._transfer.host_waits == 0
    assert loader.stats()["loader"]["consumer_waiting_for_device"] == 0.0


def _producers_ahead(it: Any, upto: int) -> None:
    """Wait until the producers have made every batch before ``upto`` (but the epoch's first, which the loop makes)."""
    ring = it._ring
    first = it.consumed + (it.consumed == ring.skip and it._first_claimed)
    deadline = time.monotonic() + 60
    while any(ring.status[b] == 0 for b in range(first, min(upto, it._n_batches))):
        assert time.monotonic() < deadline, "the producers made no progress in a minute"
        time.sleep(0.001)


@pytest.mark.parametrize("ahead", [True, False])
def test_a_batch_made_before_the_loop_asks_for_the_one_before_it_is_copied_then(table_path: Path, ahead: bool) -> None:
    """With the producers ahead, batch b's copy is queued inside next() for batch b - 1 (or earlier), never at its own."""
    loader, _, begins = sim_loader(table_path, ahead=ahead, num_workers=2, batches_ahead=4)
    it = iter(loader)
    n = 0
    while True:
        _producers_ahead(it, it.consumed + 2)
        try:
            next(it)
        except StopIteration:
            break
        n += 1
    assert n == len(loader) == len(begins)
    at = [consumed for _, consumed in begins]  # batches handed over when batch b's copy was queued
    if ahead:
        assert at[0] == 0 and all(at[b] < b for b in range(1, n)), at
    else:
        assert at == list(range(n)), at


def test_kept_batches_and_a_break_mid_epoch_with_copies_issued_ahead(table_path: Path) -> None:
    loader, _, begins = sim_loader(table_path, num_workers=2, batches_ahead=6)
    reference = _plain(table_path, num_workers=2)
    plain = [tuple(t.clone() for t in b) for b in reference]
    plain_next = [x.clone() for b in reference for x in b]  # (the next epoch: another order)
    it = iter(loader)
    kept = []
    span = it._ring.span
    for b in range(7):
        # (a sleeping producer is woken once half the batches ahead are left: those are made without the loop waiting)
        _producers_ahead(it, b + span - max(0, span // 2 - 1))
        batch = next(it)
        if b % 3 == 0:
            kept.append((b, batch))
    assert len(begins) > 7, "batches were issued ahead of the break"
    del it  # break: the batches issued ahead are dropped with the epoch
    for b, batch in kept:
        _same(batch, plain[b])
    second = [tuple(t.clone() for t in batch) for batch in loader]  # the next epoch reuses slots issued and never handed over
    _same([x for batch in second for x in batch], plain_next)
    for b, batch in kept:
        _same(batch, plain[b])


def test_resume_with_read_ahead_yields_what_the_loop_had_not_received(table_path: Path) -> None:
    loader, _, _ = sim_loader(table_path, num_workers=2, batches_ahead=6)
    batches = prefetch(loader, "cpu", depth=3)
    seen = []
    for b, batch in enumerate(batches):
        seen.append(tuple(t.clone() for t in batch))
        if b == 5:
            state = batches.state_dict()  # inside the loop: after break, it is the next epoch's start
            break
    resumed, _, _ = sim_loader(table_path, num_workers=2, batches_ahead=6)
    resumed.load_state_dict(state)
    rest = [tuple(t.clone() for t in batch) for batch in prefetch(resumed, "cpu", depth=3)]
    whole = [tuple(t.clone() for t in b) for b in _plain(table_path, num_workers=2)]
    _same([x for batch in seen + rest for x in batch], [x for batch in whole for x in batch])


class FailsOn:
    """A tail step that raises on the batch holding sample row ``row`` (x[i] = 100 i + column)."""

    def __init__(self, row: int) -> None:
        self.row = row

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x[:, 0] == 100 * self.row).any()):
            raise ValueError(f"row {self.row}")
        return x


def test_a_tail_failing_on_a_batch_issued_ahead_reaches_the_loop_at_that_batch(table_path: Path) -> None:
    plain = list(_plain(table_path, order=OrderOption.SEQUENTIAL, num_workers=2))
    loader, _, begins = sim_loader(table_path, order=OrderOption.SEQUENTIAL, num_workers=2, batches_ahead=6,
                                   pipelines=_pipes([FailsOn(5 * BATCH + 3)]))  # fmt: skip
    it = iter(loader)
    got = []
    with pytest.raises(LoaderError) as info:
        while True:
            _producers_ahead(it, it.consumed + 4)
            got.append(next(it))
    assert len(got) == 5, "every batch before the failing one is handed over"
    for a, b in zip(got, plain, strict=False):
        _same(a, b)
    assert len(begins) > 6, "the failing batch had been issued ahead of the loop"
    assert info.value.index == 5 * BATCH + 3 and "row 323" in str(info.value)


def _gpu_bound(loader: Loader, steps: int, step: Callable[[], None]) -> None:
    for _ in range(2):
        for n, _batch in enumerate(loader):
            step()
            if n == steps:
                break


def test_next_waiting_for_the_gpu_is_the_devices_time_not_the_loaders(table_path: Path) -> None:
    """Every slot's copy is still queued when the slot comes round (a GPU far behind): next() waits for it each time.

    The loop itself does nothing else, so without the device's own line the report would call it data-bound.
    """
    gpu = SimGPU(sync_seconds=0.02)  # not eager: the simulated GPU runs only when the host waits for it
    loader, _, _ = sim_loader(table_path, gpu=gpu, num_workers=1, batches_ahead=3)
    _gpu_bound(loader, 12, lambda: None)
    a = loader.stats()["accounting"]
    text = loader.report()
    assert loader._transfer.host_waits > 0 and gpu.host_syncs == loader._transfer.host_waits
    assert a["device_s"] >= 0.02 * (loader._transfer.host_waits - 8), text  # (the waits at epochs' starts are not steps')
    assert a["device_share"] > 0.5 and a["verdict"] == "not data-bound", text
    assert "blocked on the device" in text and "GPU" in a["suggestion"], text
    assert a["bottleneck"] != "the GPU (next() waited for it)"
    assert loader.stats()["loader"]["consumer_waiting_for_device"] >= a["device_s"]


def test_a_gpu_that_keeps_up_costs_next_no_wait(table_path: Path) -> None:
    loader, gpu, _ = sim_loader(table_path, num_workers=1)
    _gpu_bound(loader, 12, lambda: time.sleep(0.002))
    a = loader.stats()["accounting"]
    assert gpu.host_syncs == 0 and a["device_s"] == 0.0
    assert "blocked on the device" not in loader.report()
    assert np.isclose(a["stall_share"] + a["device_share"], a["stall_share"])
