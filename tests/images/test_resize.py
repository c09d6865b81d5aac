"""The resize kernel on its own (against the numpy model, in scratch of exactly the size declared, bounds-checked),
and the decoding kernel allocating nothing per image."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stoker.fields import IntField, RGBImageField
from stoker.image import _kernels as kernels
from stoker.pipeline.compiler import Compiler
from stoker.writer import DatasetWriter
from tests.images._reference import reference_crop


@pytest.fixture(scope="module")
def checked_resize() -> Callable[..., Any]:
    """``resize`` and every compiled function it calls, bounds-checked: a read or write past any array raises."""
    with Compiler.debug():
        return Compiler.compile(kernels.resize)


def cases(n: int) -> list[tuple[int, int, float, float, float, float, int, int]]:
    """(h, w, y, x, box height, box width, oh, ow): integer and fractional boxes (DCT-scaled crops are fractional),
    shrinking, enlarging, one axis of each, boxes touching every edge, one-pixel images and outputs."""
    rng = np.random.default_rng(7)
    out = [(1, 1, 0.0, 0.0, 1.0, 1.0, 1, 1), (1, 9, 0.0, 0.0, 1.0, 9.0, 5, 2), (300, 2, 0.0, 0.0, 300.0, 2.0, 3, 40)]
    while len(out) < n:
        h, w = (int(v) for v in rng.integers(1, 260, 2))
        oh, ow = (int(v) for v in rng.integers(1, 70, 2))
        if rng.random() < 0.5:
            ch, cw = int(rng.integers(1, h + 1)), int(rng.integers(1, w + 1))
            y, x = float(rng.integers(0, h - ch + 1)), float(rng.integers(0, w - cw + 1))
            ch_f, cw_f = float(ch), float(cw)
        else:
            ch_f, cw_f = rng.uniform(0.5, h), rng.uniform(0.5, w)
            y, x = rng.uniform(0, h - ch_f), rng.uniform(0, w - cw_f)
        out.append((h, w, y, x, ch_f, cw_f, oh, ow))
    return out


@pytest.mark.parametrize("case", cases(150))
def test_resize_matches_the_model_within_its_declared_scratch(checked_resize: Callable[..., Any], case: tuple[Any, ...]) -> None:
    h, w, y, x, ch, cw, oh, ow = case
    rng = np.random.default_rng(abs(hash(case)) % 2**32)
    image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    pad, off = 5, 11  # rows further apart than the image is wide, and the image not at the start of the buffer
    flat = np.zeros(off + h * (w * 3 + pad) + 7, dtype=np.uint8)
    for r in range(h):
        flat[off + r * (w * 3 + pad) : off + r * (w * 3 + pad) + w * 3] = image[r].reshape(-1)
    scratch = np.full(int(kernels.resize_scratch_size(h, w, oh, ow)), np.nan, dtype=np.float32)
    taps = np.full(kernels.resize_taps_size(oh, ow), -(2**40), dtype=np.int64)
    dst = np.zeros((oh, ow, 3), dtype=np.uint8)
    checked_resize(flat, off, w * 3 + pad, h, w, y, x, ch, cw, dst, scratch, taps)
    ref = reference_crop(image, (y, x, ch, cw), (oh, ow))
    assert np.abs(dst.astype(int) - ref).max() <= 1
    fast = np.zeros_like(dst)
    kernels.resize(flat, off, w * 3 + pad, h, w, y, x, ch, cw, fast, scratch, taps)
    np.testing.assert_array_equal(fast, dst)


def test_declared_scratch_suffices_for_every_small_shape(checked_resize: Callable[..., Any]) -> None:
    """Every source of up to 16 x 16 into every output of up to 9 x 9, whole and with a fractional border:
    any use of scratch past what ``resize_scratch_size`` / ``resize_taps_size`` declare raises IndexError."""
    src = np.arange(16 * 16 * 3, dtype=np.uint8)
    for h in range(1, 17):
        for w in range(1, 17):
            for oh in range(1, 10):
                for ow in range(1, 10):
                    scratch = np.empty(int(kernels.resize_scratch_size(h, w, oh, ow)), dtype=np.float32)
                    taps = np.empty(kernels.resize_taps_size(oh, ow), dtype=np.int64)
                    dst = np.empty((oh, ow, 3), dtype=np.uint8)
                    for box in ((0.0, 0.0, float(h), float(w)), (0.375, 0.625, h - 0.5, w - 0.75)):
                        checked_resize(src, 0, w * 3, h, w, *box, dst, scratch, taps)


ALLOCATIONS = r"""
import sys
import numpy as np
from numba.core.runtime import rtsys
from stoker.image import _kernels as kernels
from stoker.decoders import CenterCropRGBImageDecoder, RandomResizedCropRGBImageDecoder
from stoker.loader import Loader
path = sys.argv[1]
for decoder in (CenterCropRGBImageDecoder((40, 30)), RandomResizedCropRGBImageDecoder(24)):
    pipeline = Loader(path, batch_size=64, pipelines={"image": [decoder], "label": None}).pipelines[0]
    dst = np.zeros((64, *pipeline.steps[0].query.shape), np.uint8)
    seeds = np.arange(64, dtype=np.uint64)
    kernels.decode_images(np.arange(1), dst[:1], pipeline.arrays, pipeline.storage, seeds[:1])  # compiled, NRT started
    counts = []
    for n in (1, 1, 64):
        before = rtsys.get_allocation_stats().alloc
        kernels.decode_images(np.arange(n), dst[:n], pipeline.arrays, pipeline.storage, seeds[:n])
        counts.append(rtsys.get_allocation_stats().alloc - before)
    print(type(decoder).__name__, counts[1], counts[2])
"""


@pytest.mark.parametrize("mode", ["jpg", "raw"])
def test_decoding_allocates_nothing_per_image(tmp_path: Path, mode: str) -> None:
    """Numba's allocation count for a batch of 64 images is that of a batch of one (the parallel loop's own)."""
    images = [(np.random.default_rng(i).integers(0, 256, (60 + 7 * i, 50 + 5 * i, 3), dtype=np.uint8), i) for i in range(64)]
    path = tmp_path / "a.stoker"
    DatasetWriter(path, {"image": RGBImageField(write_mode=mode), "label": IntField()}, num_workers=1, progress=False).from_indexed_dataset(
        images
    )
    env = {**os.environ, "NUMBA_NRT_STATS": "1"}
    proc = subprocess.run([sys.executable, "-c", ALLOCATIONS, str(path)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.split("\n")[:2]
    for line in lines:
        name, one, many = line.split()
        assert one == many, f"{name}: {one} allocations for one image, {many} for 64"
