"""``ToTorchImage(channels_last=False)``: a compiled HWC -> CHW copy into the slot memory the loader allocates."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from stoker.decoders import IntDecoder, SimpleRGBImageDecoder
from stoker.loader import Loader, OrderOption
from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.compiler import Compiler
from stoker.pipeline.state import State
from stoker.transforms import ToTensor, ToTorchImage
from stoker.transforms.tensor import hwc_to_chw

from .conftest import H, N, W, images, run


@pytest.mark.parametrize("dtype", [np.uint8, np.float32, np.int16])
@pytest.mark.parametrize("c", [3, 1, 4])
@pytest.mark.parametrize("shape", [(5, 9, 7), (2, 1, 33), (3, 17, 1), (0, 4, 4), (2, 0, 3)])
def test_kernel_matches_numpy(compiled: bool, shape: tuple[int, int, int], c: int, dtype: type) -> None:
    n, h, w = shape
    src = (np.arange(n * h * w * c) % 251).astype(dtype).reshape(n, h, w, c)
    dst = np.full((n, c, h, w), 7, dtype)
    kernel = hwc_to_chw if compiled else hwc_to_chw.py_func
    out = kernel(src, dst)
    assert out is dst
    np.testing.assert_array_equal(dst, src.transpose(0, 3, 1, 2))


def test_kernel_writes_only_the_first_n_images() -> None:
    """A last batch smaller than the slot: the kernel gets the slot's first rows and touches nothing else."""
    src = images()[:3]
    slot = np.full((5, 3, H, W), 7, np.uint8)
    hwc_to_chw(src, slot[:3])
    np.testing.assert_array_equal(slot[:3], src.transpose(0, 3, 1, 2))
    assert (slot[3:] == 7).all()


def state(shape: tuple[int, int, int], layout: str, dtype: torch.dtype = torch.uint8, device: str = "cpu") -> State:
    return State(jit_mode=False, device=torch.device(device), shape=shape, dtype=dtype, layout=layout)


def test_declares_slot_memory_for_the_copy_only() -> None:
    s, query = ToTorchImage(channels_last=False).declare_state_and_memory(state((H, W, 3), "HWC"))
    assert (s.shape, s.layout, s.dtype) == ((3, H, W), "CHW", torch.uint8)
    assert query == AllocationQuery((3, H, W), torch.uint8)
    s, query = ToTorchImage(channels_last=True).declare_state_and_memory(state((H, W, 3), "HWC"))
    assert (s.shape, s.layout, query) == ((3, H, W), "CHW", None)  # a view: no memory
    s, query = ToTorchImage(channels_last=False).declare_state_and_memory(state((3, H, W), "CHW"))
    assert (s.shape, s.layout, query) == ((3, H, W), "CHW", None)  # already CHW: nothing to copy
    _, query = ToTorchImage(channels_last=False).declare_state_and_memory(state((H, W, 3), "HWC", torch.bfloat16))
    assert query is None  # no numpy view of bfloat16: torch copies


@pytest.mark.parametrize("channels_last", [False, True])
def test_loader_output(images_path: Path, compiled: bool, channels_last: bool) -> None:
    """Every image of two epochs (the last batch smaller: 60 = 3 x 16 + 12), in NCHW, in the layout asked for."""
    ops = [SimpleRGBImageDecoder(), ToTensor(), ToTorchImage(channels_last=channels_last)]
    for img, label in run(images_path, ops, compiled=compiled):
        np.testing.assert_array_equal(img, images()[label[:, 0]].transpose(0, 3, 1, 2))


def make_loader(path: Path, compiled: bool) -> Loader:
    pipelines = {"img": [SimpleRGBImageDecoder(), ToTensor(), ToTorchImage(channels_last=False)], "label": [IntDecoder(), ToTensor()]}
    with Compiler.enabled(compiled):
        return Loader(path, batch_size=16, order=OrderOption.SEQUENTIAL, num_workers=1, pipelines=pipelines)


def test_batches_live_in_slot_memory(images_path: Path) -> None:
    """Each batch is a contiguous NCHW tensor in the memory of one of the loader's slots, reused from epoch to epoch."""
    loader = make_loader(images_path, True)
    pipeline = next(p for p in loader.pipelines if p.name == "img")
    seen, batches = set(), 0
    iter(loader).close()  # allocates the slots
    # the last step with memory holds the batch (the producers' NCHW copy, ToTorchImage's compiled form, when fused)
    step = max(k for k, memory in enumerate(pipeline.slot_memory(0)) if memory is not None)

    def address(memory: object) -> int:
        return int(memory.data_ptr()) if hasattr(memory, "data_ptr") else int(memory.ctypes.data)  # type: ignore[attr-defined]

    epochs = len(pipeline._views) // len(loader) + 2  # more batches than slots
    for _ in range(epochs):
        for img, _label in loader:
            assert img.is_contiguous() and img.shape[1:] == (3, H, W)
            slots = {address(pipeline.slot_memory(s)[step]) for s in range(len(pipeline._views))}
            assert img.data_ptr() in slots
            seen.add(img.data_ptr())
            batches += 1
            del img, _label
    assert len(seen) <= len(pipeline._views) < batches  # more batches than slots: the slots' memory was reused


def test_kept_batch_is_never_overwritten(images_path: Path, compiled: bool) -> None:
    loader = make_loader(images_path, compiled)
    kept = [(img, label) for img, label in loader]  # every batch kept: the slots must be renewed, not overwritten
    assert sum(len(img) for img, _ in kept) == N
    for img, label in kept:
        np.testing.assert_array_equal(img.numpy(), images()[label.numpy()[:, 0]].transpose(0, 3, 1, 2))


def test_fallbacks_copy_with_torch() -> None:
    """A batch that is not contiguous, or whose shape an earlier operation changed undeclared, is still made NCHW."""
    op = ToTorchImage(channels_last=False)
    _, query = op.declare_state_and_memory(state((H, W, 3), "HWC"))
    assert query is not None
    code = op.generate_code()
    dst = torch.full((4, 3, H, W), 7, dtype=torch.uint8)
    src = torch.from_numpy(images()[:4])
    want = src.numpy().transpose(0, 3, 1, 2)
    swapped = torch.from_numpy(np.ascontiguousarray(images()[:4].transpose(0, 2, 1, 3))).transpose(1, 2)
    assert not swapped.is_contiguous()
    out = code(swapped, dst)
    assert out.data_ptr() == dst.data_ptr()
    np.testing.assert_array_equal(out.numpy(), want)
    out = code(src, dst)
    assert out.data_ptr() == dst.data_ptr()
    np.testing.assert_array_equal(out.numpy(), want)
    wider = torch.from_numpy(np.ascontiguousarray(np.concatenate([images()[:4]] * 2, axis=2)))
    out = code(wider, dst)
    assert out.is_contiguous()
    np.testing.assert_array_equal(out.numpy(), wider.numpy().transpose(0, 3, 1, 2))


def test_smaller_batch_than_its_memory() -> None:
    op = ToTorchImage(channels_last=False)
    op.declare_state_and_memory(state((H, W, 3), "HWC"))
    dst = torch.full((4, 3, H, W), 7, dtype=torch.uint8)
    out = op.generate_code()(torch.from_numpy(images()[:3]), dst)
    assert out.shape == (3, 3, H, W) and out.data_ptr() == dst.data_ptr()
    np.testing.assert_array_equal(out.numpy(), images()[:3].transpose(0, 3, 1, 2))
    assert (dst[3] == 7).all()
