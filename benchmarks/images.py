"""Image loading, side by side: stoker vs torch DataLoader (Pillow) vs the decode-only reference.

Three scenarios (issue "Images at the speed of the decoder"):

A. 50,000 32x32 images stored as JPEG q90 -> uint8 NCHW, batch 512, random order.
   Reference: ``simplejpeg.decode_jpeg`` of the same bytes in 2 threads, one call per image.
B. The same images stored raw -> random flip + normalize to float32 NCHW, batch 512.
   Reference: a raw uint8 gather of the same samples (``np.take`` into a reused buffer).
C. 3,000 JPEGs around 500x375 (q90) -> RandomResizedCrop 224 + flip -> uint8 NCHW, batch 64.
   Reference: the DataLoader; the decode-only reference (full decode) is shown for scale,
   and stoker is run with each decoding technique switched off in turn.

Every system's batches are checked (shape, dtype, samples per epoch) before a number is printed.
Run: ``python benchmarks/images.py [--out DIR] [--quick]``.
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

MEAN = np.array([0.485, 0.456, 0.406]) * 255
STD = np.array([0.229, 0.224, 0.225]) * 255


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
    from stoker.fields import IntField, RGBImageField
    from stoker.format import Reader
    from stoker.writer import DatasetWriter

    if path.exists():
        try:
            if len(Reader(path)) == len(dataset):
                return path
        except Exception:
            pass
    DatasetWriter(
        path, {"image": RGBImageField(write_mode=mode, jpeg_quality=90), "label": IntField()}, num_workers=2
    ).from_indexed_dataset(dataset, chunksize=256)
    return path


def payloads(path: Path) -> tuple[list[bytes], np.ndarray]:
    from stoker.format import Reader

    r = Reader(path)
    m = r.metadata
    blobs = [bytes(r.storage[int(p) : int(p) + int(s)]) for p, s in zip(m["image/ptr"], m["image/size"])]
    return blobs, np.asarray(m["label/value"])


# ---- timing -------------------------------------------------------------------------------------
def run_epochs(make_iter: Callable[[int], Iterable[Any]], epochs: int, n_expected: int, check: Callable[[Any], tuple]) -> dict[str, Any]:
    """Time ``epochs`` epochs (after one warm-up epoch); return samples/s and the batch signature."""
    signature = None
    first = None
    rates = []
    for e in range(epochs + 1):
        t0 = time.perf_counter()
        count = 0
        for batch in make_iter(e):
            sig = check(batch)
            if signature is None:
                signature = sig
            elif sig[1:] != signature[1:]:
                raise RuntimeError(f"batch signature changed: {sig} vs {signature}")
            count += sig[0]
        dt = time.perf_counter() - t0
        if count != n_expected:
            raise RuntimeError(f"an epoch yielded {count} samples, expected {n_expected}")
        if e == 0:
            first = dt
        else:
            rates.append(count / dt)
    return {"samples_per_s": statistics.median(rates), "first_epoch_s": first, "signature": signature}


def sig_of(batch: Any) -> tuple:
    x = batch[0]
    return (int(x.shape[0]), tuple(int(s) for s in x.shape[1:]), str(x.dtype).replace("torch.", ""))


def dataloader(dataset: Any, batch: int, workers: int) -> Any:
    """The DataLoader baseline; workers start from a forkserver and persist across epochs.

    Persistent workers spare the DataLoader its start-up cost in every epoch (in its favour);
    the forkserver keeps forked workers clear of the threads this process already runs.
    """
    import torch

    return torch.utils.data.DataLoader(
        dataset, batch_size=batch, shuffle=True, num_workers=workers, persistent_workers=workers > 0,
        multiprocessing_context="forkserver" if workers else None,
    )  # fmt: skip


# ---- scenario A -----------------------------------------------------------------------------------
class PillowJpeg:
    def __init__(self, blobs: list[bytes], labels: np.ndarray) -> None:
        self.blobs, self.labels = blobs, labels

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch
        from PIL import Image

        arr = np.array(Image.open(io.BytesIO(self.blobs[i])).convert("RGB"))
        return torch.from_numpy(arr).permute(2, 0, 1), int(self.labels[i])


def scenario_a(out: Path, n: int, epochs: int, workers: int) -> dict[str, Any]:
    import simplejpeg

    from stoker.fields.decoders import IntDecoder, SimpleRGBImageDecoder
    from stoker.loader import Loader, OrderOption
    from stoker.transforms import ToTensor, ToTorchImage

    path = build(out / f"cifar-jpg-{n}.stoker", Generated(n, 32, 32, detail=1.0), "jpg")
    blobs, labels = payloads(path)
    results: dict[str, Any] = {"images": n, "mean_jpeg_bytes": float(np.mean([len(b) for b in blobs]))}
    loader = Loader(path, batch_size=512, num_workers=workers, order=OrderOption.RANDOM, seed=0,
                    pipelines={"image": [SimpleRGBImageDecoder(), ToTensor(), ToTorchImage()], "label": [IntDecoder(), ToTensor()]})  # fmt: skip
    results["stoker"] = run_epochs(lambda e: loader, epochs, n, sig_of)
    pool = ThreadPoolExecutor(2)

    def reference(e: int) -> Iterable[Any]:
        perm = np.random.default_rng(e).permutation(n)
        for s in range(0, n, 512):
            images = list(pool.map(lambda i: simplejpeg.decode_jpeg(blobs[i]), perm[s : s + 512]))
            yield (_Shape(len(images), (3, *images[0].shape[:2]), "uint8"),)

    results["decode_only_reference"] = run_epochs(reference, epochs, n, sig_of)
    ds = PillowJpeg(blobs, labels)
    for w in (0, 2):
        dl = dataloader(ds, 512, w)
        results[f"dataloader_w{w}"] = run_epochs(lambda e, dl=dl: dl, max(1, epochs // 2), n, sig_of)
    return results


class _Shape:
    """Stands for a batch of the reference (which makes no batch): its size, per-sample shape and dtype."""

    def __init__(self, n: int, shape: tuple, dtype: str) -> None:
        self.shape, self.dtype = (n, *shape), dtype


# ---- scenario B -----------------------------------------------------------------------------------
class RawFlipNormalize:
    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        self.images, self.labels = images, labels
        self.mean = np.asarray(MEAN, np.float32)[:, None, None]
        self.std = np.asarray(STD, np.float32)[:, None, None]

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch

        img = self.images[i]
        if np.random.default_rng().random() < 0.5:
            img = img[:, ::-1]
        x = (img.transpose(2, 0, 1).astype(np.float32) - self.mean) / self.std
        return torch.from_numpy(x), int(self.labels[i])


def scenario_b(out: Path, n: int, epochs: int, workers: int) -> dict[str, Any]:
    from stoker.fields.decoders import IntDecoder, SimpleRGBImageDecoder
    from stoker.format import Reader
    from stoker.loader import Loader, OrderOption
    from stoker.transforms import NormalizeImage, RandomHorizontalFlip, ToTensor

    path = build(out / f"cifar-raw-{n}.stoker", Generated(n, 32, 32, detail=1.0), "raw")
    r = Reader(path)
    m = r.metadata
    images = np.stack([np.frombuffer(bytes(r.storage[int(p) : int(p) + 3072]), np.uint8).reshape(32, 32, 3) for p in m["image/ptr"]])
    labels = np.asarray(m["label/value"])
    results: dict[str, Any] = {"images": n}
    pipes = {
        "image": [SimpleRGBImageDecoder(), RandomHorizontalFlip(), NormalizeImage(MEAN, STD, np.float32), ToTensor()],
        "label": [IntDecoder(), ToTensor()],
    }
    loader = Loader(path, batch_size=512, num_workers=workers, order=OrderOption.RANDOM, seed=0, pipelines=pipes)
    results["stoker"] = run_epochs(lambda e: loader, epochs, n, sig_of)
    buf = np.empty((512, 32, 32, 3), np.uint8)

    def gather(e: int) -> Iterable[Any]:
        perm = np.random.default_rng(e).permutation(n)
        for s in range(0, n, 512):
            idx = perm[s : s + 512]
            out_ = buf[: len(idx)]
            np.take(images, idx, axis=0, out=out_)
            yield (_Shape(len(idx), (3, 32, 32), "uint8"),)

    results["raw_gather_limit"] = run_epochs(gather, epochs, n, sig_of)
    ds = RawFlipNormalize(images, labels)
    for w in (0, 2):
        dl = dataloader(ds, 512, w)
        results[f"dataloader_w{w}"] = run_epochs(lambda e, dl=dl: dl, max(1, epochs // 2), n, sig_of)
    return results


# ---- scenario C -----------------------------------------------------------------------------------
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


class PillowRRC:
    def __init__(self, blobs: list[bytes], labels: np.ndarray) -> None:
        self.blobs, self.labels = blobs, labels

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch
        from PIL import Image

        rng = np.random.default_rng()
        img = Image.open(io.BytesIO(self.blobs[i])).convert("RGB")
        y, x, ch, cw = rrc_params(img.height, img.width, rng)
        img = img.resize((224, 224), Image.Resampling.BILINEAR, box=(x, y, x + cw, y + ch))
        if rng.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.array(img)).permute(2, 0, 1), int(self.labels[i])


def scenario_c(out: Path, n: int, epochs: int, workers: int) -> dict[str, Any]:
    import simplejpeg

    from stoker.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from stoker.loader import Loader, OrderOption
    from stoker.transforms import RandomHorizontalFlip, ToTensor, ToTorchImage

    path = build(out / f"photos-{n}.stoker", Generated(n, 375, 500, detail=4.0, jitter=20, grain=10.0), "jpg")
    blobs, labels = payloads(path)
    results: dict[str, Any] = {"images": n, "mean_jpeg_bytes": float(np.mean([len(b) for b in blobs]))}
    variants = {
        "stoker": {},
        "stoker_no_crop_decode": {"crop_decode": False},
        "stoker_no_dct_scaling": {"dct_scaling": False},
        "stoker_full_decode": {"crop_decode": False, "dct_scaling": False},
        "stoker_fast_dct": {"fast_dct": True},
    }
    for name, options in variants.items():
        pipes = {"image": [RandomResizedCropRGBImageDecoder((224, 224), **options), RandomHorizontalFlip(), ToTensor(), ToTorchImage()],
                 "label": [IntDecoder(), ToTensor()]}  # fmt: skip
        loader = Loader(path, batch_size=64, num_workers=workers, order=OrderOption.RANDOM, seed=0, pipelines=pipes)
        results[name] = run_epochs(lambda e, loader=loader: loader, epochs, n, sig_of)
    pool = ThreadPoolExecutor(2)

    def reference(e: int) -> Iterable[Any]:
        perm = np.random.default_rng(e).permutation(n)
        for s in range(0, n, 64):
            list(pool.map(lambda i: simplejpeg.decode_jpeg(blobs[i]), perm[s : s + 64]))
            yield (_Shape(len(perm[s : s + 64]), (3, 224, 224), "uint8"),)

    results["decode_only_reference"] = run_epochs(reference, epochs, n, sig_of)
    ds = PillowRRC(blobs, labels)
    for w in (0, 2):
        dl = dataloader(ds, 64, w)
        results[f"dataloader_w{w}"] = run_epochs(lambda e, dl=dl: dl, max(1, epochs // 2), n, sig_of)
    return results


# ---- report -----------------------------------------------------------------------------------------
def report(name: str, res: dict[str, Any], reference: str) -> str:
    systems = {k: v for k, v in res.items() if isinstance(v, dict) and "samples_per_s" in v}
    sigs = {k: v["signature"][1:] for k, v in systems.items()}
    loaders = {sigs[k] for k in systems if not k.endswith(("_limit", "_reference"))}
    if len(loaders) != 1 or len({s[0] for s in sigs.values()}) != 1:
        raise RuntimeError(f"{name}: systems disagree on batch shapes/dtypes: {sigs}")
    if "dataloader_w0" in systems:
        best = max(("dataloader_w0", "dataloader_w2"), key=lambda k: systems[k]["samples_per_s"])
        systems["dataloader_best"] = systems[best]
    ref = systems[reference]["samples_per_s"]
    out_sig = next(iter(loaders))
    lines = [f"### {name}", "", f"every loader's batches: {out_sig[0]} {out_sig[1]}; reference: `{reference}`", ""]
    lines += ["| system | samples/s | ratio to reference | first epoch [s] |", "|---|---:|---:|---:|"]
    for k, v in systems.items():
        lines.append(f"| {k} | {v['samples_per_s']:,.0f} | {v['samples_per_s'] / ref:.2f}x | {v['first_epoch_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--only", choices=["A", "B", "C"], action="append")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = {"A": 2_000, "B": 2_000, "C": 128} if args.quick else {"A": 50_000, "B": 50_000, "C": 3_000}
    epochs = 1 if args.quick else args.epochs
    only = args.only or ["A", "B", "C"]
    all_results: dict[str, Any] = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {sys.version.split()[0]}"
    }
    text = []
    if "A" in only:
        all_results["A"] = res = scenario_a(args.out, sizes["A"], epochs, args.num_workers)
        text.append(
            report(
                f"A. {sizes['A']:,} 32x32 JPEG q90 -> uint8 NCHW, batch 512 (mean {res['mean_jpeg_bytes']:.0f} B/image)",
                res,
                "decode_only_reference",
            )
        )
    if "B" in only:
        all_results["B"] = res = scenario_b(args.out, sizes["B"], epochs, args.num_workers)
        text.append(report(f"B. {sizes['B']:,} 32x32 raw -> flip + normalize float32 NCHW, batch 512", res, "raw_gather_limit"))
    if "C" in only:
        all_results["C"] = res = scenario_c(args.out, sizes["C"], epochs, args.num_workers)
        text.append(
            report(
                f"C. {sizes['C']:,} ~500x375 JPEG q90 -> RandomResizedCrop 224 + flip, batch 64 (mean {res['mean_jpeg_bytes'] / 1000:.0f} KB/image)",
                res,
                "dataloader_best",
            )
        )
    print("\n".join(text))
    (args.out / "images.json").write_text(json.dumps(all_results, indent=2, default=str))
    (args.out / "images.md").write_text("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
