"""Streams other than the current one, without a GPU: nested outputs all record their stream, and a side stream that
reads a batch keeps its slot from being rewritten once declared with ``stoker.device.record_stream``.

CUDA tensors are stood in for by :class:`FakeCuda`, a real CPU tensor that says it is on ``cuda:0`` and logs its
``record_stream`` calls: the walk, the storage addresses and the transfer's bookkeeping are stoker's own code. The
GPU is the simulated one of ``tests/device/_gpu_sim.py`` (streams run their queued work in the orders the test
chooses; a copy writes the batch number into the slot's tensor, a read on the side stream checks it). The same
properties on a GPU: ``tests/gpu/test_side_stream_cuda.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.device import _stream
from stoker.device._stream import CudaBackend, StreamTransfer, issuing
from tests.device._gpu_sim import SimGPU, SimStream

CUDA0 = torch.device("cuda", 0)


class FakeCuda(torch.Tensor):
    """A CPU tensor that says it is on ``cuda:0``; ``record_stream`` is logged on :attr:`recorded`, per storage."""

    recorded: ClassVar[list[tuple[int, Any]]] = []

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return CUDA0

    def record_stream(self, stream: Any) -> None:  # type: ignore[override]
        FakeCuda.recorded.append((self.untyped_storage().data_ptr(), stream))


def fake(n: int = 4) -> FakeCuda:
    return torch.zeros(n).as_subclass(FakeCuda)  # type: ignore[return-value]


class Stream:
    def __init__(self, name: str, device: Any = CUDA0) -> None:
        self.name, self.device = name, device

    def __repr__(self) -> str:
        return self.name


class Pair(NamedTuple):
    a: Any
    b: Any


@dataclasses.dataclass(frozen=True)
class Boxed:
    inner: Any
    note: str = "x"


def _recorded_on(stream: Any) -> list[int]:
    return sorted(ptr for ptr, s in FakeCuda.recorded if s is stream)


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


# ---- b. nested outputs: every CUDA tensor records the stream ------------------------------------------


def test_every_cuda_tensor_of_a_nested_batch_records_the_stream() -> None:
    """A tuple of dicts of lists (and named tuples, dataclasses) of tensors: every CUDA tensor, at any depth, records the
    stream and is named among the addresses returned; CPU tensors and tensors of another device do not."""
    FakeCuda.recorded.clear()
    deep = [fake() for _ in range(6)]
    cpu = torch.zeros(3)
    other = fake()
    other_device = torch.device("cuda", 1)

    class OtherDevice(FakeCuda):
        @property
        def device(self) -> torch.device:  # type: ignore[override]
            return other_device

    elsewhere = other.as_subclass(OtherDevice)
    batch = (
        {"images": [deep[0], deep[1]], "meta": {"ids": [deep[2], "a", 3], "cpu": cpu}},
        Pair(deep[3], {"x": (deep[4],)}),
        Boxed({"y": [[deep[5]]]}),
        elsewhere,
        "label",
    )
    stream = Stream("consumer")
    keys = CudaBackend(CUDA0).record_stream(batch, stream)
    assert _recorded_on(stream) == sorted(_ptr(t) for t in deep), "every CUDA tensor of the stream's device, at any depth"
    assert keys == frozenset(_ptr(t) for t in deep)


def test_a_view_records_and_names_its_storage() -> None:
    FakeCuda.recorded.clear()
    base = fake(8)
    stream = Stream("s")
    assert CudaBackend(CUDA0).record_stream({"v": [base[2:5]]}, stream) == {_ptr(base)}
    assert _recorded_on(stream) == [_ptr(base)]


class WalkingGPU(SimGPU):
    """The simulated GPU with stoker's own walk for ``record_stream`` (CudaBackend's), its streams on ``cuda:0``."""

    def __init__(self) -> None:
        super().__init__()
        self.user.device = CUDA0
        self.torch = torch  # (what CudaBackend's methods use)

    def new_stream(self) -> SimStream:
        stream = super().new_stream()
        stream.device = CUDA0
        return stream

    def record_stream(self, outputs: Any, stream: SimStream) -> frozenset[int]:  # type: ignore[override]
        return CudaBackend.record_stream(self, outputs, stream)  # type: ignore[arg-type]


def test_the_transfer_records_both_streams_on_every_tensor_of_nested_outputs() -> None:
    """The outputs a Loader's tail returns may be nested: the transfer's stream (``end``) and the consumer's
    (``hand_over``) are recorded on all of their tensors."""
    FakeCuda.recorded.clear()
    gpu = WalkingGPU()
    t = StreamTransfer(CUDA0, 2, backend=gpu)
    deep = [fake() for _ in range(3)]
    outputs = [({"a": [deep[0]], "b": {"c": deep[1]}},), [[deep[2]]]]
    t.free(0)
    with issuing(t, 0, outputs):
        pass
    t.hand_over(0, outputs)
    want = sorted(_ptr(x) for x in deep)
    assert _recorded_on(t.stream) == want and _recorded_on(gpu.user) == want


# ---- a. a side stream that reads a batch --------------------------------------------------------------


class SideRun:
    """The Loader's use of a transfer (as ``test_transfer_book.Run``), batch ``b`` in slot ``b % slots``, each slot's
    device memory a tensor the copy fills with the batch number; the user reads some batches on a side stream."""

    def __init__(self, slots: int, ahead: bool, declare: bool) -> None:
        self.gpu = WalkingGPU()
        self.side = SimStream(self.gpu, "side")
        self.side.device = CUDA0
        self.slots, self.declare = slots, declare
        self.t = StreamTransfer(CUDA0, slots, ahead=ahead, backend=self.gpu)
        self.dev = [fake(1) - 1 for _ in range(slots)]  # slot memory on the "device" (-1: never written)
        self.issued = 0
        self.side_reads: list[tuple[int, int]] = []  # (batch, what the side stream's read saw)
        self.user_reads: list[tuple[int, int]] = []

    def give_back(self, b: int) -> None:
        self.t.free(b % self.slots)  # (the user dropped the slot's previous batch: nothing refers to it)

    def issue(self) -> None:
        b, s = self.issued, self.issued % self.slots
        self.issued += 1
        out = [self.dev[s]]

        def copy() -> None:
            self.dev[s].fill_(b)

        with issuing(self.t, s, out):
            self.gpu.current_stream().run(copy, f"copy {b}")

    def consume(self, c: int, on_side: bool) -> None:
        s = c % self.slots
        batch = ({"x": [self.dev[s]]},)  # nested, as the user receives it
        self.t.hand_over(s, [batch])
        user = self.gpu.current_stream()
        user.run(self._read(batch, c, self.user_reads), f"step {c}")
        if on_side:
            self.side.wait_stream(user)  # the user's side stream starts after the batch is ready (PyTorch's rule)
            self.side.run(self._read(batch, c, self.side_reads), f"side read {c}")
            if self.declare:
                _stream.record_stream(batch, self.side)

    @staticmethod
    def _read(batch: Any, c: int, into: list[tuple[int, int]]) -> Callable[[], None]:
        x = batch[0]["x"][0]
        return lambda: into.append((c, int(x.sum().item())))


def _drive(run: SideRun, n: int, lead: int, side: list[bool], gpu_runs: Callable[[], None]) -> None:
    for b in range(min(lead, n)):
        run.give_back(b)
    for c in range(n):
        if run.t.ahead:
            while run.issued < min(n, c + lead):  # copies queued as soon as the batch is made (here: at once)
                run.issue()
                gpu_runs()
        while run.issued <= c:
            run.issue()
        run.consume(c, side[c])
        gpu_runs()
        if c + lead < n:
            run.give_back(c + lead)
        gpu_runs()
    run.gpu.drain()


def _slow_side(run: SideRun) -> Callable[[], None]:
    """The adversary: every stream but the side one runs as far as it can (the side stream is busy with long work)."""

    def go() -> None:
        while True:
            ready = [s for s in run.gpu.runnable() if s is not run.side]
            if not ready:
                return
            ready[0].step()

    return go


@pytest.mark.parametrize("ahead", [True, False])
def test_without_a_declaration_a_slow_side_stream_reads_a_later_batch(ahead: bool) -> None:
    """The hazard the declaration is for (and the simulation shows it): the Loader marks only the streams that were
    current at a ``next()``, so a copy rewrites the slot while the side stream has not read it yet."""
    run = SideRun(slots=2, ahead=ahead, declare=False)
    _drive(run, n=6, lead=1, side=[True] * 6, gpu_runs=_slow_side(run))
    assert any(seen != c for c, seen in run.side_reads), run.side_reads


@pytest.mark.parametrize("ahead", [True, False])
def test_a_declared_side_stream_always_reads_its_own_batch_even_when_slow(ahead: bool) -> None:
    """(A side stream more batches behind than the ring has slots makes the host wait before it rewrites a slot's
    page-locked memory, as a slow consumer stream does; the simulation runs the side stream then, no deadlock.)"""
    run = SideRun(slots=2, ahead=ahead, declare=True)
    _drive(run, n=6, lead=1, side=[True] * 6, gpu_runs=_slow_side(run))
    assert run.side_reads == [(c, c) for c in range(6)]
    assert run.user_reads == [(c, c) for c in range(6)]


@settings(max_examples=60, deadline=None)
@given(
    slots=st.integers(2, 5),
    lead=st.integers(1, 4),
    ahead=st.booleans(),
    n=st.integers(1, 14),
    slow_side=st.booleans(),
    data=st.data(),
)
def test_on_a_simulated_gpu_every_declared_side_read_sees_its_own_batch(
    slots: int, lead: int, ahead: bool, n: int, slow_side: bool, data: st.DataObject
) -> None:
    """Random batches read on a side stream (declared), the GPU running the streams in random orders (or the side
    stream last)."""
    lead = min(lead, slots - 1)
    run = SideRun(slots, ahead, declare=True)
    side = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    slow = _slow_side(run)

    def gpu_runs() -> None:
        if slow_side:
            slow()
            return
        for k in data.draw(st.lists(st.integers(0, 3), max_size=6)):
            run.gpu.step(k)

    _drive(run, n, lead, side, gpu_runs)
    assert sorted(run.side_reads) == [(c, c) for c in range(n) if side[c]]
    assert sorted(run.user_reads) == [(c, c) for c in range(n)]


def test_a_declaration_protects_one_batch_of_the_slot_and_prefetch_memory_needs_no_mark() -> None:
    """The mark on the side stream is recorded once, when the declared batch's slot is given back; a slot whose
    memory is fresh for each batch (prefetch's: ``release(marks=False)``) records none (PyTorch's allocator orders it)."""
    run = SideRun(slots=2, ahead=True, declare=True)
    run.give_back(0)
    run.give_back(1)
    run.issue()
    run.issue()
    run.consume(0, on_side=True)
    assert run.t._extra[0] == (run.side,)
    run.gpu.drain()
    run.consume(1, on_side=False)
    assert run.side not in run.t._marks[0]
    run.give_back(2)  # slot 0, for batch 2: a mark on the side stream, once
    assert run.t._extra[0] == ()
    side_mark = run.t._marks[0][run.side]
    recorded = side_mark.recorded
    run.issue()
    run.gpu.drain()
    run.consume(2, on_side=False)  # not declared
    run.give_back(4)  # slot 0 again
    assert side_mark.recorded == recorded, "slot 0's next batch was not declared: no mark on the side stream"
    t = StreamTransfer(CUDA0, 2, backend=WalkingGPU())
    t.free(1)
    x = fake()
    with issuing(t, 1, [x]):
        pass
    t.hand_over(1, [x])
    side = Stream("side")
    assert t.used_on({_ptr(x)}, side) and not t.used_on({_ptr(x) + 1}, side)
    t.reuse(1)
    t.release(1, marks=False)
    assert t._extra[1] == () and side not in t._marks[1]


def test_record_stream_reaches_only_the_transfer_that_handed_out_the_memory_and_refuses_a_non_stream() -> None:
    gpu = WalkingGPU()
    mine, other = StreamTransfer(CUDA0, 2, backend=gpu), StreamTransfer(CUDA0, 2, backend=gpu)
    x, y = fake(), fake()
    for t, v in ((mine, x), (other, y)):
        t.free(0)
        with issuing(t, 0, [v]):
            pass
        t.hand_over(0, [v])
    side = Stream("side")
    FakeCuda.recorded.clear()
    _stream.record_stream({"batch": [x[1:]]}, side)
    assert mine._extra[0] == (side,) and other._extra[0] == ()
    assert _recorded_on(side) == [_ptr(x)]
    with pytest.raises(TypeError, match=r"torch\.cuda\.Stream"):
        _stream.record_stream(x, "side")
