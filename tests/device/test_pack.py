"""Coalescing: packing small tensors of every dtype and stride into one buffer, and cutting them out again."""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable

import pytest
import torch

from stoker.device._pack import ALIGNMENT, can_pack, layout, pack, unpack
from stoker.device._transfer import COALESCE_MAX_BYTES, copy_in

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    *[getattr(torch, name) for name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)],
]


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (NaNs included: compared bit for bit)."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _variants(dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Contiguous, empty, 0-d and non-contiguous tensors of ``dtype``."""
    base = _random((6, 5), dtype, seed)
    out = [
        base,
        _random((), dtype, seed + 1),
        _random((0,), dtype, seed + 2),
        _random((0, 3), dtype, seed + 3),
        base.t(),  # transposed
        base[::2, 1:4],  # strided slice with an offset
        base[:, 2],  # a column
        _random((1, 4), dtype, seed + 4).expand(3, 4),  # stride 0
    ]
    if dtype.is_complex:
        out.append(base.conj())  # a lazily conjugated view
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_roundtrip_every_dtype_and_stride(dtype: torch.dtype) -> None:
    tensors = _variants(dtype, seed=1)
    assert all(can_pack(t) for t in tensors)
    buffer, spans = pack(tensors)
    assert buffer.dtype == torch.uint8 and buffer.dim() == 1
    views = unpack(buffer, spans)
    for i, (t, v) in enumerate(zip(tensors, views, strict=True)):
        assert _same(v, t), f"tensor {i} ({tuple(t.shape)}, strides {t.stride()}) changed"
        assert v.is_contiguous()
        assert v.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr(), "a view of the buffer"


def test_every_dtype_in_one_buffer() -> None:
    rng = random.Random(0)
    tensors = [t for k, dtype in enumerate(DTYPES) for t in _variants(dtype, seed=10 * k)]
    rng.shuffle(tensors)
    buffer, spans = pack(tensors)
    for t, v in zip(tensors, unpack(buffer, spans), strict=True):
        assert _same(v, t)
    ends = 0
    for span in spans:
        assert span.offset % ALIGNMENT == 0 and span.offset >= ends, "aligned and not overlapping"
        ends = span.offset + span.nbytes
        assert (buffer.data_ptr() + span.offset) % ALIGNMENT == 0
    assert buffer.numel() == ends


def test_layout_offsets() -> None:
    a, b, c = torch.zeros(3, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.bool), torch.zeros((), dtype=torch.float32)
    spans, size = layout([a, b, c])
    assert [s.offset for s in spans] == [0, 64, 128]
    assert [s.nbytes for s in spans] == [24, 4, 4]
    assert size == 132
    assert layout([])[1] == 0


def test_writing_a_view_writes_the_buffer_not_the_source() -> None:
    source = torch.arange(4)
    buffer, spans = pack([source])
    (view,) = unpack(buffer, spans)
    view.fill_(-1)
    assert source.tolist() == [0, 1, 2, 3]


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized dtypes are deprecated: still tensors someone may pass
        return torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.ones(2, requires_grad=True),
        lambda: torch.nn.Parameter(torch.ones(2)),
        lambda: torch.ones(2, 2).to_sparse(),
        _quantized,
        lambda: torch.ones(2, device="meta"),
    ],
    ids=["requires_grad", "subclass", "sparse", "quantized", "meta"],
)
def test_what_is_not_packed(make: Callable[[], torch.Tensor]) -> None:
    assert not can_pack(make())


def test_copy_in_packs_small_tensors_into_one_buffer() -> None:
    """The staging path of to_device, with the CPU as the target (no page-locked memory)."""
    small = [_random((3, 4), torch.float32, 1), _random((7,), torch.int64, 2).flip(0), _random((), torch.bool, 3)]
    at_limit = _random((COALESCE_MAX_BYTES // 2,), torch.int16, 4)
    large = _random((COALESCE_MAX_BYTES + 1,), torch.uint8, 5)
    grad = torch.ones(2, requires_grad=True)
    sources = [small[0], large, small[1], at_limit, grad, small[2]]
    out, created, host = copy_in(sources, torch.device("cpu"), non_blocking=False, pin=False)
    assert len(out) == len(sources)
    for s, o in zip(sources, out, strict=True):
        assert _same(o, s.detach()) if s.requires_grad else _same(o, s)
    packed = [out[i] for i in (0, 2, 3, 5)]
    storage = packed[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == storage for t in packed), "small tensors (up to the limit) share one buffer"
    assert all(s.untyped_storage().data_ptr() != storage for s in sources), "copies, not the sources"
    assert out[1].untyped_storage().data_ptr() != storage, "a tensor above the limit is not packed"
    assert out[4] is grad, "a tensor that requires grad is moved with Tensor.to (here: already on the CPU)"
    assert created[0].untyped_storage().data_ptr() == storage and created[0].dtype == torch.uint8
    assert host[0].dtype == torch.uint8 and host[0].numel() == created[0].numel(), "the staging buffer, kept until copied"


def test_copy_in_without_small_tensors() -> None:
    large = torch.ones(COALESCE_MAX_BYTES)
    out, created, host = copy_in([large], torch.device("cpu"), non_blocking=False, pin=False, coalesce_max_bytes=16)
    assert out == [large] and created == [large] and host == [large]
