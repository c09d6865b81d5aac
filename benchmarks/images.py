"""Image loading, side by side: stoker vs torch DataLoader (Pillow) vs the decode-only reference.

Three scenarios (issue "Images at the speed of the decoder"):

A. 50,000 32x32 images stored as JPEG q90 -> uint8 NCHW, batch 512, random order.
   Reference: ``simplejpeg.decode_jpeg`` of the same bytes in 2 threads, one call per image,
   each thread looping over half of the batch (``per_image_calls_reference``, the earlier
   reference, pays one executor call per image and is shown beside it).
B. The same images stored raw -> random flip + normalize to float32 NCHW, batch 512.
   Reference: a raw uint8 gather of the same samples (``np.take`` into a reused buffer).
C. 3,000 JPEGs around 500x375 (q90) -> RandomResizedCrop 224 + flip -> uint8 NCHW, batch 64.
   Reference: the DataLoader; the decode-only reference (full decode) is shown for scale,
   and stoker is run with each decoding technique switched off in turn.

Every loader yields the same layout: contiguous NCHW tensors (stoker with
``ToTorchImage(channels_last=False)``; the DataLoader's ``__getitem__`` returns
contiguous CHW tensors that the default collate stacks). One extra stoker row in
A and C yields FFCV's channels-last view instead, to show what the contiguous
copy costs; the references make no batch (A, C) or gather NHWC uint8 (B).

Before a system is timed, a verification pass checks its values: each system
is built again in file order, with the random crop replaced by a centre crop
(C), and its first batches are compared with the expected images: the
``simplejpeg`` decode (A), the normalised raw images (B), Pillow's resize of the
``simplejpeg`` decode (C), within tolerances that allow for different
resizers; a random flip must give each image or its mirror, in the right
proportion. Every timed batch is checked for shape, dtype and layout. A system
that fails reports no number: the script exits with status 1.

Run: ``python benchmarks/images.py [--out DIR] [--quick] [--only A|B|C]``.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from stoker.bench.loading import BenchCheckError
from stoker.bench.pixels import Tolerance, check_images, check_maybe_flipped, layout, to_numpy

MEAN = np.array([0.485, 0.456, 0.406]) * 255
STD = np.array([0.229, 0.224, 0.225]) * 255
#: batches of each system compared with the expected images, in file order
VERIFY_BATCHES = 2
#: the same bytes decoded by two libjpeg-turbo builds: equal but for rounding
TOL_DECODE = Tolerance(mean_abs=0.5, max_abs=4)
#: float32 arithmetic in another order
TOL_NORMALIZE = Tolerance(mean_abs=1e-5, max_abs=1e-4)
#: C: stoker's resize (area when shrinking, bilinear when enlarging) against Pillow's antialiased bilinear;
#: at the border the two treat the pixels outside the crop differently
VERIFY_CROPS = {
    "shrink": (224 / 256, 224, Tolerance(mean_abs=2.0, max_abs=32, border=2, edge_max_abs=64)),
    "enlarge": (0.4, 224, Tolerance(mean_abs=2.0, max_abs=16, border=2, edge_max_abs=64)),
    # decoded at 1/2 scale in the DCT domain, then area-resized: another low-pass filter than Pillow's
    "dct_scaled": (1.0, 96, Tolerance(mean_abs=3.0, max_abs=48, border=2, edge_max_abs=64)),
}


# ---- data ---------------------------------------------------------------------------------------
def natural_image(i: int, h: int, w: int, detail: float, grain: float = 0.0) -> np.ndarray:
    """Smooth structure, 1/f texture and sensor-like luminance grain: JPEG sizes like photographs."""
    rng = np.random.default_rng(i)
    out = np.zeros((h, w, 3), np.float32)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32) / max(h, w)
    for c in range(3):
        out[..., c] = 127 + 80 * np.sin(rng.uniform(1, 5) * xx + rng.uniform(0, 6)) * np.cos(rng.uniform(1, 5) * yy + rng.uniform(0, 6))
    octave = 4
    while octave <= max(h, w):
        grid = rng.standard_normal((octave + 1, octave + 1, 3)).astype(np.float32)
        ys = np.linspace(0, octave, h)
        xs = np.linspace(0, octave, w)
        y0, x0 = np.floor(ys).astype(int).clip(0, octave - 1), np.floor(xs).astype(int).clip(0, octave - 1)
        ty, tx = (ys - y0)[:, None, None], (xs - x0)[None, :, None]
        g = (
            grid[y0][:, x0] * (1 - ty) * (1 - tx)
            + grid[y0 + 1][:, x0] * ty * (1 - tx)
            + grid[y0][:, x0 + 1] * (1 - ty) * tx
            + grid[y0 + 1][:, x0 + 1] * ty * tx
        )
        out += detail * 64.0 / math.sqrt(octave) * g
        octave *= 2
    if grain:
        out += rng.normal(0, grain, (h, w, 1)).astype(np.float32)
    return np.clip(out, 0, 255).astype(np.uint8)


class Generated:
    def __init__(self, n: int, h: int, w: int, detail: float, jitter: int = 0, grain: float = 0.0) -> None:
        self.n, self.h, self.w, self.detail, self.jitter, self.grain = n, h, w, detail, jitter, grain

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        h = self.h + (i * 7 % (2 * self.jitter + 1) - self.jitter if self.jitter else 0)
        w = self.w + (i * 13 % (2 * self.jitter + 1) - self.jitter if self.jitter else 0)
        return natural_image(i, h, w, self.detail, self.grain), i % 1000


def build(path: Path, dataset: Generated, mode: str) -> Path:
    from stoker.errors import StokerError
    from stoker.fields import IntField, RGBImageField
    from stoker.format import Reader
    from stoker.writer import DatasetWriter

    if path.exists():
        try:
            with Reader(path) as reader:
                if len(reader) == len(dataset):
                    return path
        except StokerError:
            pass
    DatasetWriter(
        path, {"image": RGBImageField(write_mode=mode, jpeg_quality=90), "label": IntField()}, num_workers=2
    ).from_indexed_dataset(dataset, chunksize=256)
    return path


#: the dataset of each scenario: file name, images, storage
DATASETS: dict[str, tuple[str, Callable[[int], Generated], str]] = {
    "A": ("cifar-jpg-{n}.stoker", lambda n: Generated(n, 32, 32, detail=1.0), "jpg"),
    "B": ("cifar-raw-{n}.stoker", lambda n: Generated(n, 32, 32, detail=1.0), "raw"),
    "C": ("photos-{n}.stoker", lambda n: Generated(n, 375, 500, detail=4.0, jitter=20, grain=10.0), "jpg"),
}


def dataset_path(out: Path, scenario: str, n: int) -> Path:
    """The file of a scenario's ``n`` images in ``out`` (made if missing), written unless already there."""
    name, make, mode = DATASETS[scenario]
    out.mkdir(parents=True, exist_ok=True)
    return build(out / name.format(n=n), make(n), mode)


def payloads(path: Path) -> tuple[list[bytes], np.ndarray]:
    from stoker.format import Reader

    with Reader(path) as r:
        m = r.metadata
        blobs = [bytes(r.storage[int(p) : int(p) + int(s)]) for p, s in zip(m["image/ptr"], m["image/size"])]
        return blobs, np.array(m["label/value"])


# ---- the DataLoader side --------------------------------------------------------------------------
class WorkerRng:
    """One numpy ``Generator`` per process: per DataLoader worker, seeded with torch's seed for that worker.

    ``torch.initial_seed()`` in a worker is the DataLoader's base seed plus the
    worker's id, so the streams differ between workers; drawing from one
    generator costs a fraction of a microsecond (building one costs about 40).
    """

    def __init__(self) -> None:
        self._pid = -1
        self._rng = np.random.default_rng(0)

    def get(self) -> np.random.Generator:
        if self._pid != os.getpid():
            import torch

            self._rng = np.random.default_rng(torch.initial_seed())
            self._pid = os.getpid()
        return self._rng


def dataloader(dataset: Any, batch: int, workers: int, shuffle: bool = True) -> Any:
    """The DataLoader baseline; workers start from a forkserver and persist across epochs.

    Persistent workers spare the DataLoader its start-up cost in every epoch (in its favour);
    the forkserver keeps forked workers clear of the threads this process already runs.
    """
    import torch

    return torch.utils.data.DataLoader(
        dataset, batch_size=batch, shuffle=shuffle, num_workers=workers, persistent_workers=workers > 0,
        multiprocessing_context="forkserver" if workers else None,
    )  # fmt: skip


def chw(arr: np.ndarray) -> Any:
    """An HWC image as a contiguous CHW tensor (so that the default collate stacks contiguous NCHW batches)."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))


class PillowJpeg:
    def __init__(self, blobs: list[bytes], labels: np.ndarray) -> None:
        self.blobs, self.labels = blobs, labels

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        from PIL import Image

        return chw(np.asarray(Image.open(io.BytesIO(self.blobs[i])).convert("RGB"))), int(self.labels[i])


class RawFlipNormalize:
    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        self.images, self.labels = images, labels
        self.mean = np.asarray(MEAN, np.float32)[:, None, None]
        self.std = np.asarray(STD, np.float32)[:, None, None]
        self.rng = WorkerRng()

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch

        img = self.images[i]
        if self.rng.get().random() < 0.5:
            img = img[:, ::-1]
        x = (img.transpose(2, 0, 1).astype(np.float32) - self.mean) / self.std
        return torch.from_numpy(x), int(self.labels[i])


def rrc_params(h: int, w: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop geometry (scale 0.08..1, ratio 3/4..4/3)."""
    area = h * w
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw, ch = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < cw <= w and 0 < ch <= h:
            return int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1)), ch, cw
    return 0, 0, h, w


def centre_crop(h: int, w: int, ratio: float) -> tuple[int, int, int, int]:
    """FFCV's centre crop (as ``CenterCropRGBImageDecoder``): a centred square of side ``ratio * min(h, w)``."""
    c = max(1, int(ratio * min(h, w)))
    return (h - c) // 2, (w - c) // 2, c, c


def pillow_resize(img: Any, box: tuple[int, int, int, int], size: int) -> np.ndarray:
    """Pillow's antialiased bilinear resize of the crop ``(y, x, ch, cw)`` to ``size`` x ``size``, HWC."""
    from PIL import Image

    y, x, ch, cw = box
    return np.asarray(img.resize((size, size), Image.Resampling.BILINEAR, box=(x, y, x + cw, y + ch)))


class PillowRRC:
    """Pillow decode, RandomResizedCrop 224 (bilinear), random flip; ``centre=(ratio, size)`` for the verification pass."""

    def __init__(self, blobs: list[bytes], labels: np.ndarray, centre: tuple[float, int] | None = None) -> None:
        self.blobs, self.labels, self.centre = blobs, labels, centre
        self.rng = WorkerRng()

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        from PIL import Image

        rng = self.rng.get()
        img = Image.open(io.BytesIO(self.blobs[i])).convert("RGB")
        if self.centre is None:
            out = pillow_resize(img, rrc_params(img.height, img.width, rng), 224)
        else:
            out = pillow_resize(img, centre_crop(img.height, img.width, self.centre[0]), self.centre[1])
        if rng.random() < 0.5:
            out = out[:, ::-1]
        return chw(out), int(self.labels[i])


# ---- checks ---------------------------------------------------------------------------------------
class _Shape:
    """Stands for a batch of a reference that makes no batch: its size, per-sample shape and dtype."""

    def __init__(self, n: int, shape: tuple, dtype: str, layout: str) -> None:
        self.shape, self.dtype, self.layout = (n, *shape), dtype, layout


def sig_of(batch: Any) -> tuple:
    """(samples, sample shape, dtype, layout) of a batch ``(images, labels, ...)``."""
    x = batch[0]
    lay = x.layout if isinstance(x, _Shape) else layout(x)
    return (int(x.shape[0]), tuple(int(s) for s in x.shape[1:]), str(x.dtype).replace("torch.", ""), lay)


def first_batches(loader: Iterable[Any], batches: int = VERIFY_BATCHES) -> tuple[np.ndarray, np.ndarray]:
    """Copies of the images and labels of a loader's first ``batches`` batches."""
    xs, ys = [], []
    for b, batch in enumerate(loader):
        if b == batches:
            break
        xs.append(to_numpy(batch[0]))
        ys.append(to_numpy(batch[1]).reshape(-1))
    close = getattr(loader, "close", None)
    if callable(close):
        close()
    return np.concatenate(xs), np.concatenate(ys)


def verify(who: str, loader: Iterable[Any], want: np.ndarray, labels: np.ndarray, tol: Tolerance, flipped: bool) -> dict[str, float]:
    """Compare a system's first batches, in file order, with the expected images and labels."""
    got, got_labels = first_batches(loader)
    if got.shape[0] != len(want) or not np.array_equal(got_labels, labels[: len(want)]):
        raise BenchCheckError(f"{who}: in file order, the first {len(want)} labels must be those of samples 0..{len(want) - 1}")
    return check_maybe_flipped(got, want, tol, who) if flipped else check_images(got, want, tol, who)


def run_epochs(make_iter: Callable[[int], Iterable[Any]], epochs: int, n_expected: int) -> dict[str, Any]:
    """Time ``epochs`` epochs (after one warm-up epoch); check every batch's signature; return samples/s."""
    signature = None
    first = None
    rates = []
    for e in range(epochs + 1):
        t0 = time.perf_counter()
        count = 0
        for batch in make_iter(e):
            sig = sig_of(batch)
            if signature is None:
                signature = sig
            elif sig[1:] != signature[1:]:
                raise BenchCheckError(f"batch signature changed: {sig} vs {signature}")
            count += sig[0]
        dt = time.perf_counter() - t0
        if count != n_expected:
            raise BenchCheckError(f"an epoch yielded {count} samples, expected {n_expected}")
        if e == 0:
            first = dt
        else:
            rates.append(count / dt)
    return {"samples_per_s": statistics.median(rates), "first_epoch_s": first, "signature": signature}


class Bench:
    """The systems of one scenario: each verified, then timed; results by name."""

    def __init__(self, n: int, epochs: int) -> None:
        self.n, self.epochs = n, epochs
        self.results: dict[str, Any] = {}

    def add(
        self, name: str, timed: Callable[[int], Iterable[Any]], checks: dict[str, Any] | None, epochs: int | None = None, system: Any = None
    ) -> None:
        """Time a system whose checks passed (``checks`` is ``None`` for a reference), then close ``system`` if given."""
        print(f"  {name} ...", file=sys.stderr, flush=True)
        try:
            res = run_epochs(timed, self.epochs if epochs is None else epochs, self.n)
        finally:
            close = getattr(system, "close", None)
            if callable(close):
                close()
        res["checks"] = checks
        self.results[name] = res


def stoker_loader(path: Path, batch: int, workers: int, image_ops: list[Any], order: Any = None, squeeze: bool = False) -> Any:
    """A stoker Loader; ``squeeze``: FFCV's label pipeline (``IntDecoder(), ToTensor(), Squeeze()``), else without Squeeze."""
    from stoker.decoders import IntDecoder
    from stoker.loader import Loader, OrderOption
    from stoker.transforms import Squeeze, ToTensor

    pipes = {"image": image_ops, "label": [IntDecoder(), ToTensor(), *([Squeeze()] if squeeze else [])]}
    return Loader(path, batch_size=batch, num_workers=workers, order=order or OrderOption.RANDOM, seed=0, pipelines=pipes)


# ---- scenario A -----------------------------------------------------------------------------------
def scenario_a(out: Path, n: int, epochs: int, workers: int) -> dict[str, Any]:
    import simplejpeg

    from stoker.decoders import SimpleRGBImageDecoder
    from stoker.loader import OrderOption
    from stoker.transforms import ToTensor, ToTorchImage

    path = dataset_path(out, "A", n)
    blobs, labels = payloads(path)
    v = min(n, VERIFY_BATCHES * 512)
    want = np.stack([simplejpeg.decode_jpeg(b) for b in blobs[:v]]).transpose(0, 3, 1, 2)
    bench = Bench(n, epochs)
    bench.results.update({"images": n, "mean_jpeg_bytes": float(np.mean([len(b) for b in blobs]))})

    def ops(channels_last: bool) -> list[Any]:
        return [SimpleRGBImageDecoder(), ToTensor(), ToTorchImage(channels_last=channels_last)]

    for name, cl, squeeze in (("stoker", False, False), ("stoker_ffcv_labels", False, True), ("stoker_channels_last_view", True, False)):
        check_loader = stoker_loader(path, 512, workers, ops(cl), OrderOption.SEQUENTIAL, squeeze)
        checks = verify(name, check_loader, want, labels, TOL_DECODE, False)
        loader = stoker_loader(path, 512, workers, ops(cl), squeeze=squeeze)
        bench.add(name, lambda e, loader=loader: loader, checks, system=loader)
    pool = ThreadPoolExecutor(2)

    def reference(e: int) -> Iterable[Any]:  # two threads, each decoding half of the batch in a plain loop
        perm = np.random.default_rng(e).permutation(n)
        for s in range(0, n, 512):
            halves = np.array_split(perm[s : s + 512], 2)
            images = [im for half in pool.map(lambda idx: [simplejpeg.decode_jpeg(blobs[i]) for i in idx], halves) for im in half]
            yield (_Shape(len(images), (3, *images[0].shape[:2]), "uint8", "none: decodes, makes no batch"),)

    def per_image_calls(e: int) -> Iterable[Any]:  # the earlier reference: one executor call per image
        perm = np.random.default_rng(e).permutation(n)
        for s in range(0, n, 512):
            images = list(pool.map(lambda i: simplejpeg.decode_jpeg(blobs[i]), perm[s : s + 512]))
            yield (_Shape(len(images), (3, *images[0].shape[:2]), "uint8", "none: decodes, makes no batch"),)

    bench.add("decode_only_reference", reference, None)
    bench.add("per_image_calls_reference", per_image_calls, None)
    ds = PillowJpeg(blobs, labels)
    for w in (0, 2):
        checks = verify(f"dataloader_w{w}", dataloader(ds, 512, w, shuffle=False), want, labels, TOL_DECODE, False)
        dl = dataloader(ds, 512, w)
        bench.add(f"dataloader_w{w}", lambda e, dl=dl: dl, checks, max(1, epochs // 2))
    return bench.results


# ---- scenario B -----------------------------------------------------------------------------------
def scenario_b(out: Path, n: int, epochs: int, workers: int) -> dict[str, Any]:
    from stoker.decoders import SimpleRGBImageDecoder
    from stoker.format import Reader
    from stoker.loader import OrderOption
    from stoker.transforms import NormalizeImage, RandomHorizontalFlip, ToTensor

    path = dataset_path(out, "B", n)
    with Reader(path) as r:
        m = r.metadata
        images = np.stack([np.frombuffer(bytes(r.storage[int(p) : int(p) + 3072]), np.uint8).reshape(32, 32, 3) for p in m["image/ptr"]])
        labels = np.array(m["label/value"])
    v = min(n, VERIFY_BATCHES * 512)
    want = ((images[:v].astype(np.float64) - MEAN) / STD).transpose(0, 3, 1, 2)
    bench = Bench(n, epochs)
    bench.results["images"] = n

    def ops() -> list[Any]:
        return [SimpleRGBImageDecoder(), RandomHorizontalFlip(), NormalizeImage(MEAN, STD, np.float32), ToTensor()]

    checks = verify("stoker", stoker_loader(path, 512, workers, ops(), OrderOption.SEQUENTIAL), want, labels, TOL_NORMALIZE, True)
    loader = stoker_loader(path, 512, workers, ops())
    bench.add("stoker", lambda e: loader, checks, system=loader)
    buf = np.empty((512, 32, 32, 3), np.uint8)

    def gather(e: int) -> Iterable[Any]:
        perm = np.random.default_rng(e).permutation(n)
        for s in range(0, n, 512):
            idx = perm[s : s + 512]
            out_ = buf[: len(idx)]
            np.take(images, idx, axis=0, out=out_)
            yield (_Shape(len(idx), (32, 32, 3), "uint8", "NHWC uint8, a quarter of the output's bytes"),)

    bench.add("raw_gather_limit", gather, None)
    # the same work as stoker's in one compiled pass over each sample (gather, random flip, normalise to float32 NCHW),
    # two threads: what a hand-written loop costs
    one_pass = _one_pass_kernel()
    mean32, inv_std32 = np.asarray(MEAN, np.float32), (1 / np.asarray(STD, np.float32)).astype(np.float32)
    out32 = np.empty((512, 3, 32, 32), np.float32)
    rng = np.random.default_rng(0)
    k = min(4, n)  # checked (and compiled) before it is timed: unflipped samples are the expected images, flipped their mirrors
    flips = np.arange(k) % 2 == 1
    one_pass(images, np.arange(k), flips, mean32, inv_std32, out32[:k])
    expected = np.where(flips[:, None, None, None], want[:k, :, :, ::-1], want[:k])
    if np.abs(out32[:k] - expected).max() > TOL_NORMALIZE.max_abs:
        raise BenchCheckError("one_pass_reference: its images differ from the expected ones")

    def one_pass_reference(e: int) -> Iterable[Any]:
        perm = np.random.default_rng(e).permutation(n)
        for s in range(0, n, 512):
            idx = perm[s : s + 512]
            out_ = out32[: len(idx)]
            one_pass(images, idx, rng.random(len(idx)) < 0.5, mean32, inv_std32, out_)
            yield (_Shape(len(idx), (3, 32, 32), "float32", "contiguous"),)

    bench.add("one_pass_reference", one_pass_reference, None)
    ds = RawFlipNormalize(images, labels)
    for w in (0, 2):
        checks = verify(f"dataloader_w{w}", dataloader(ds, 512, w, shuffle=False), want, labels, TOL_NORMALIZE, True)
        dl = dataloader(ds, 512, w)
        bench.add(f"dataloader_w{w}", lambda e, dl=dl: dl, checks, max(1, epochs // 2))
    return bench.results


def _one_pass_kernel() -> Any:
    """``out[b] = normalise(flip?(images[idx[b]]))`` as float32 CHW: one pass over each sample, in parallel.

    Written as stoker's kernels are (unsigned flat indices, literal RGB strides, the flip chosen once per
    sample), so that LLVM vectorises it: a fair hand-written loop, not a strawman.
    """
    import numba

    @numba.njit(nogil=True, parallel=True, cache=True)
    def one_pass(images, idx, flips, mean, inv_std, out):  # type: ignore[no-untyped-def]
        h, w = images.shape[1], images.shape[2]
        hw = numba.uint64(h * w)
        wu = numba.uint64(w)
        last = numba.uint64(w - 1)
        m0, m1, m2 = mean[0], mean[1], mean[2]
        s0, s1, s2 = inv_std[0], inv_std[1], inv_std[2]
        for b in numba.prange(idx.shape[0]):
            src = images[idx[b]].reshape(-1)
            dst = out[b].reshape(-1)
            if flips[b]:
                for y in range(numba.uint64(h)):
                    for x in range(wu):
                        p = y * wu + x
                        q = numba.uint64(3) * (y * wu + last - x)
                        dst[p] = (np.float32(src[q]) - m0) * s0
                        dst[hw + p] = (np.float32(src[q + numba.uint64(1)]) - m1) * s1
                        dst[numba.uint64(2) * hw + p] = (np.float32(src[q + numba.uint64(2)]) - m2) * s2
            else:
                for p in range(hw):
                    q = numba.uint64(3) * p
                    dst[p] = (np.float32(src[q]) - m0) * s0
                    dst[hw + p] = (np.float32(src[q + numba.uint64(1)]) - m1) * s1
                    dst[numba.uint64(2) * hw + p] = (np.float32(src[q + numba.uint64(2)]) - m2) * s2
        return out

    return one_pass


# ---- scenario C -----------------------------------------------------------------------------------
def scenario_c(out: Path, n: int, epochs: int, workers: int) -> dict[str, Any]:
    import simplejpeg
    from PIL import Image

    from stoker.decoders import CenterCropRGBImageDecoder, RandomResizedCropRGBImageDecoder
    from stoker.loader import OrderOption
    from stoker.transforms import RandomHorizontalFlip, ToTensor, ToTorchImage

    path = dataset_path(out, "C", n)
    blobs, labels = payloads(path)
    v = min(n, VERIFY_BATCHES * 64)
    decoded = [Image.fromarray(simplejpeg.decode_jpeg(b)) for b in blobs[:v]]
    wants = {
        case: np.stack([pillow_resize(img, centre_crop(img.height, img.width, ratio), size) for img in decoded]).transpose(0, 3, 1, 2)
        for case, (ratio, size, _) in VERIFY_CROPS.items()
    }
    bench = Bench(n, epochs)
    bench.results.update({"images": n, "mean_jpeg_bytes": float(np.mean([len(b) for b in blobs]))})
    variants: dict[str, tuple[dict[str, Any], bool]] = {
        "stoker": ({}, False),
        "stoker_no_crop_decode": ({"crop_decode": False}, False),
        "stoker_no_dct_scaling": ({"dct_scaling": False}, False),
        "stoker_full_decode": ({"crop_decode": False, "dct_scaling": False}, False),
        "stoker_fast_dct": ({"fast_dct": True}, False),
        "stoker_channels_last_view": ({}, True),
    }
    for name, (options, cl) in variants.items():
        checks = {}
        for case, (ratio, size, tol) in VERIFY_CROPS.items():
            ops = [CenterCropRGBImageDecoder((size, size), ratio=ratio, **options), RandomHorizontalFlip(), ToTensor(), ToTorchImage(cl)]
            checks[case] = verify(
                f"{name} ({case} centre crop)",
                stoker_loader(path, 64, workers, ops, OrderOption.SEQUENTIAL),
                wants[case],
                labels,
                tol,
                True,
            )
        ops = [RandomResizedCropRGBImageDecoder((224, 224), **options), RandomHorizontalFlip(), ToTensor(), ToTorchImage(cl)]
        loader = stoker_loader(path, 64, workers, ops)
        bench.add(name, lambda e, loader=loader: loader, checks, system=loader)
    pool = ThreadPoolExecutor(2)

    def reference(e: int) -> Iterable[Any]:  # two threads, each decoding half of the batch in a plain loop
        perm = np.random.default_rng(e).permutation(n)
        for s in range(0, n, 64):
            list(pool.map(lambda idx: [simplejpeg.decode_jpeg(blobs[i]) for i in idx], np.array_split(perm[s : s + 64], 2)))
            yield (_Shape(len(perm[s : s + 64]), (3, 224, 224), "uint8", "none: decodes, makes no batch"),)

    bench.add("decode_only_reference", reference, None)
    for w in (0, 2):
        checks = {}
        for case, (ratio, size, tol) in VERIFY_CROPS.items():
            ds = PillowRRC(blobs, labels, centre=(ratio, size))
            checks[case] = verify(
                f"dataloader_w{w} ({case} centre crop)", dataloader(ds, 64, w, shuffle=False), wants[case], labels, tol, True
            )
        dl = dataloader(PillowRRC(blobs, labels), 64, w)
        bench.add(f"dataloader_w{w}", lambda e, dl=dl: dl, checks, max(1, epochs // 2))
    return bench.results


# ---- report -----------------------------------------------------------------------------------------
def _checked(checks: dict[str, Any] | None) -> str:
    if checks is None:
        return "reference"
    cases = [checks] if "mean_abs" in checks else list(checks.values())
    mean = max(c["mean_abs"] for c in cases)
    peak = max(c["max_abs"] for c in cases)
    return f"{mean:.3g} / {peak:.3g}"


def report(name: str, res: dict[str, Any], reference: str, tolerance: str) -> str:
    systems = {k: v for k, v in res.items() if isinstance(v, dict) and "samples_per_s" in v}
    sigs = {k: tuple(v["signature"][1:]) for k, v in systems.items()}
    common = {k for k in systems if not k.endswith(("_limit", "_reference", "_channels_last_view"))}
    if len({sigs[k] for k in common}) != 1:
        raise BenchCheckError(f"{name}: the loaders disagree on batch shape, dtype or layout: { {k: sigs[k] for k in common} }")
    if "dataloader_w0" in systems:
        best = max(("dataloader_w0", "dataloader_w2"), key=lambda k: systems[k]["samples_per_s"])
        systems["dataloader_best"] = systems[best]
        sigs["dataloader_best"] = sigs[best]
    ref = systems[reference]["samples_per_s"]
    shape, dtype, lay = sigs[next(iter(sorted(common)))]
    lines = [f"### {name}", "", f"every loader's batches: {shape} {dtype}, {lay} (NCHW); reference: `{reference}`.", ""]
    lines += [f"Checked before timing, in file order against the expected images: {tolerance}.", ""]
    lines += [
        "| system | output | samples/s | ratio to reference | mean / max abs diff | warm-up epoch [s] |",
        "|---|---|---:|---:|---|---:|",
    ]
    for k, v in systems.items():
        s = sigs[k]
        out = "same" if k in common or k == "dataloader_best" else s[2]
        lines.append(
            f"| {k} | {out} | {v['samples_per_s']:,.0f} | {v['samples_per_s'] / ref:.2f}x | {_checked(v['checks'])} | {v['first_epoch_s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--only", choices=["A", "B", "C"], action="append")
    args = parser.parse_args(argv)
    # steady state: each loader compiles its producer loop before its first batch, not beside the timed epochs
    os.environ.setdefault("STOKER_COMPILE_IN_BACKGROUND", "0")
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = {"A": 2_000, "B": 2_000, "C": 128} if args.quick else {"A": 50_000, "B": 50_000, "C": 3_000}
    epochs = 1 if args.quick else args.epochs
    only = args.only or ["A", "B", "C"]
    all_results: dict[str, Any] = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {sys.version.split()[0]}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "loadavg_1min_start": os.getloadavg()[0],
    }
    text = []
    for key in only:  # every dataset first: the writer forks worker processes, which must not inherit the loaders' threads
        dataset_path(args.out, key, sizes[key])
    crops = "; ".join(f"{case} (centre crop {ratio:.3g} -> {size}): {tol.describe()}" for case, (ratio, size, tol) in VERIFY_CROPS.items())
    try:
        if "A" in only:
            print("A ...", file=sys.stderr, flush=True)
            all_results["A"] = res = scenario_a(args.out, sizes["A"], epochs, args.num_workers)
            title = f"A. {sizes['A']:,} 32x32 JPEG q90 -> uint8 NCHW, batch 512 (mean {res['mean_jpeg_bytes']:.0f} B/image)"
            text.append(report(title, res, "decode_only_reference", f"simplejpeg's decode, {TOL_DECODE.describe()}"))
        if "B" in only:
            print("B ...", file=sys.stderr, flush=True)
            all_results["B"] = res = scenario_b(args.out, sizes["B"], epochs, args.num_workers)
            title = f"B. {sizes['B']:,} 32x32 raw -> flip + normalize float32 NCHW, batch 512"
            text.append(
                report(title, res, "one_pass_reference", f"(x - mean) / std of the raw images or their mirrors, {TOL_NORMALIZE.describe()}")
            )
        if "C" in only:
            print("C ...", file=sys.stderr, flush=True)
            all_results["C"] = res = scenario_c(args.out, sizes["C"], epochs, args.num_workers)
            title = (
                f"C. {sizes['C']:,} ~500x375 JPEG q90 -> RandomResizedCrop 224 + flip, batch 64 "
                f"(mean {res['mean_jpeg_bytes'] / 1000:.0f} KB/image)"
            )
            tol = f"the random crop replaced by centre crops, Pillow's bilinear resize of simplejpeg's decode or its mirror: {crops}"
            text.append(report(title, res, "dataloader_best", tol))
    except BenchCheckError as exc:
        print(f"images benchmark: FAILED, no numbers reported: {exc}", file=sys.stderr)
        return 1
    all_results["loadavg_1min_end"] = os.getloadavg()[0]
    print("\n".join(text))
    (args.out / "images.json").write_text(json.dumps(all_results, indent=2, default=str))
    (args.out / "images.md").write_text("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
