"""A pure-numpy model of the built-in image operations and of the seeds they receive.

Written from the documented contract, not from stoker's kernels: the seeds
(``sample_seeds``), the draws (``uniform``, ``randint``) and each operation are
re-derived here with numpy only (``stoker._splitmix.mix64`` is the numpy
SplitMix64). Every image operation is written once, on the (batch, height,
width, channels) *view* of the batch, so the layout of the batch in memory
changes only which axes are read, as it should.

Used by ``tests/transforms/test_layouts.py`` and ``tests/loader/test_reference_model.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stoker._splitmix import mix64

_MASK64 = (1 << 64) - 1


# ---- seeds and draws --------------------------------------------------------------------------
def salt(field_position: int, op_position: int) -> int:
    """The salt of an operation's seeds: its field's position among the file's fields, its position in the pipeline."""
    return field_position * 1000 + op_position


def sample_seeds(seed: int, epoch: int, positions: np.ndarray, salt: int) -> np.ndarray:
    """The seed of each sample: (loader seed, epoch, salt, the sample's position in the epoch's order), mixed."""
    base = mix64(np.array([seed & _MASK64], dtype=np.uint64))
    base = mix64(base ^ np.uint64(epoch & _MASK64))
    base = mix64(base ^ np.uint64(salt & _MASK64))
    return mix64(base ^ np.asarray(positions, dtype=np.int64).astype(np.uint64))


def uniform(seeds: np.ndarray, k: int) -> np.ndarray:
    """The k-th draw in [0, 1) of each stream: the top 53 bits of ``mix64(seed ^ mix64(k))``."""
    key = mix64(np.array([k], dtype=np.uint64))
    bits = mix64(np.asarray(seeds, dtype=np.uint64) ^ key) >> np.uint64(11)
    return bits.astype(np.float64) * 2.0**-53


def randint(seeds: np.ndarray, k: int, low: int, high: int) -> np.ndarray:
    """The k-th integer draw in [low, high) of each stream."""
    return low + np.floor(uniform(seeds, k) * (high - low)).astype(np.int64)


# ---- the batch and the operations -------------------------------------------------------------
@dataclass
class Batch:
    """A batch as the model sees it: values, the layout of a sample, and whether it is a tensor yet."""

    x: np.ndarray
    layout: str = "HWC"
    tensor: bool = False

    def hwc(self) -> np.ndarray:
        """A (batch, height, width, channels) view: writing to it writes the batch."""
        return self.x if self.layout == "HWC" else self.x.transpose(0, 2, 3, 1)


class Invalid(Exception):
    """The model's verdict: the loader must refuse this pipeline when it is built."""


@dataclass(frozen=True)
class Flip:
    prob: float = 0.5

    def __call__(self, b: Batch, seeds: np.ndarray) -> Batch:
        if b.tensor:
            raise Invalid("flip after ToTensor")
        v = b.hwc()
        mask = uniform(seeds, 0) < self.prob
        v[mask] = v[mask][:, :, ::-1]
        return b


@dataclass(frozen=True)
class Translate:
    padding: int = 2
    fill: tuple[float, ...] = (0, 0, 0)

    def __call__(self, b: Batch, seeds: np.ndarray) -> Batch:
        if b.tensor:
            raise Invalid("translate after ToTensor")
        src = b.hwc()
        out = Batch(np.empty_like(b.x), b.layout)
        dst = out.hwc()
        dst[:] = np.array(self.fill, dtype=b.x.dtype)
        _, h, w, _ = src.shape
        dys = randint(seeds, 0, -self.padding, self.padding + 1)
        dxs = randint(seeds, 1, -self.padding, self.padding + 1)
        for i, (dy, dx) in enumerate(zip(dys, dxs)):
            y0, y1 = np.clip([dy, h + dy], 0, h)
            x0, x1 = np.clip([dx, w + dx], 0, w)
            if y0 < y1 and x0 < x1:
                dst[i, y0:y1, x0:x1] = src[i, y0 - dy : y1 - dy, x0 - dx : x1 - dx]
        return out


@dataclass(frozen=True)
class Cutout:
    size: int = 3
    fill: tuple[float, ...] = (0, 0, 0)

    def __call__(self, b: Batch, seeds: np.ndarray) -> Batch:
        if b.tensor:
            raise Invalid("cutout after ToTensor")
        v = b.hwc()
        _, h, w, _ = v.shape
        cys, cxs = randint(seeds, 0, 0, h), randint(seeds, 1, 0, w)
        for i, (cy, cx) in enumerate(zip(cys, cxs)):
            y0, x0 = cy - self.size // 2, cx - self.size // 2
            v[i, max(y0, 0) : y0 + self.size, max(x0, 0) : x0 + self.size] = np.array(self.fill, dtype=b.x.dtype)
        return b


@dataclass(frozen=True)
class Normalize:
    """float32 output, NCHW: ``(x - mean) * (1 / std)``, in float32, on numpy batches and on tensors alike."""

    mean: tuple[float, ...] = (120.0, 110.0, 100.0)
    std: tuple[float, ...] = (60.0, 55.0, 50.0)

    def __call__(self, b: Batch, seeds: np.ndarray) -> Batch:
        mean = np.asarray(self.mean, dtype=np.float32)
        std = np.asarray(self.std, dtype=np.float32)
        x = b.hwc().astype(np.float32)
        if not b.tensor and b.x.dtype != np.uint8:
            raise Invalid("NormalizeImage on a float numpy batch")
        y = (x - mean) * (np.float32(1.0) / std)
        assert y.dtype == np.float32
        return Batch(np.ascontiguousarray(y.transpose(0, 3, 1, 2)), "CHW", b.tensor)


@dataclass(frozen=True)
class Tensor:
    def __call__(self, b: Batch, seeds: np.ndarray) -> Batch:
        return Batch(b.x, b.layout, True)


@dataclass(frozen=True)
class TorchImage:
    channels_last: bool = True

    def __call__(self, b: Batch, seeds: np.ndarray) -> Batch:
        if not b.tensor:
            raise Invalid("ToTorchImage before ToTensor")
        return Batch(b.x if b.layout == "CHW" else b.x.transpose(0, 3, 1, 2), "CHW", True)


Op = Flip | Translate | Cutout | Normalize | Tensor | TorchImage


def check(ops: Sequence[Op]) -> None:
    """Raise :class:`Invalid` when the loader must refuse ``[decoder, *ops]`` (the model runs it on a dummy batch)."""
    b = Batch(np.zeros((1, 2, 3, 3), np.uint8))
    for op in ops:
        b = op(b, np.zeros(1, np.uint64))


def run(ops: Sequence[Op], images: np.ndarray, seeds_of: Sequence[np.ndarray]) -> Batch:
    """``[decoder, *ops]`` on ``images`` (n, h, w, c), operation ``k`` (from 0) getting ``seeds_of[k]``."""
    b = Batch(images.copy())
    for op, seeds in zip(ops, seeds_of, strict=True):
        b = op(b, seeds)
    return b


def stoker_op(op: Op) -> object:
    """The stoker operation that ``op`` models."""
    import stoker.transforms as t

    if isinstance(op, Flip):
        return t.RandomHorizontalFlip(op.prob)
    if isinstance(op, Translate):
        return t.RandomTranslate(op.padding, fill=op.fill)
    if isinstance(op, Cutout):
        return t.Cutout(op.size, fill=op.fill)
    if isinstance(op, Normalize):
        return t.NormalizeImage(np.array(op.mean), np.array(op.std), np.float32)
    if isinstance(op, Tensor):
        return t.ToTensor()
    return t.ToTorchImage(channels_last=op.channels_last)
