"""Write throughput of DatasetWriter: samples/s and MB/s of output file.

Three datasets, generated with numpy (no download):

* ``otto``: a 61,878 x 93 float32 table of count-like values and an int label
  (the shape of Kaggle's Otto Group product classification data);
* ``images-raw``: 50,000 32x32 RGB images stored raw;
* ``images-jpg``: the same images stored as JPEG, quality 90. The images are
  smooth (random low-frequency colour fields, a texture and mild noise), so
  that their JPEG sizes (about 1 KB, 620 bytes of which are JPEG headers) are
  those of small photographs rather than of noise.

Each case is written with ``from_indexed_dataset`` by 1 and 2 worker
processes (median of 3 runs), and the Otto table also with ``from_arrays``.
Every file is reopened with :class:`stoker.format.Reader` before a number is
reported: its length, and the values of up to 256 samples spread over the file
(the first and the last included) against the dataset's: bit for bit for the
table and raw images, within JPEG's loss for JPEG (mean absolute difference
at most 6, none above 96 levels), labels exactly.

Usage::

    python benchmarks/write_throughput.py            # full sizes, a few minutes on 2 cores
    python benchmarks/write_throughput.py --quick    # tiny sizes, a few seconds
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stoker.fields import IntField, NDArrayField, RGBImageField
from stoker.format import DatasetWriter, Reader

OTTO_FEATURES = 93
OTTO_CLASSES = 9
IMAGE_SIZE = 32


# ---- data -------------------------------------------------------------------------------------
def otto_table(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Count-like features (mostly zeros, a few small counts) and labels 0..8."""
    rng = np.random.default_rng(seed)
    nonzero = rng.random((n, OTTO_FEATURES)) < 0.2
    counts = rng.geometric(0.35, (n, OTTO_FEATURES)) * nonzero
    return counts.astype(np.float32), rng.integers(0, OTTO_CLASSES, n, dtype=np.int64)


def _upsampler(grid: int, size: int) -> np.ndarray:
    """``(size, grid)`` bilinear interpolation weights from a ``grid``-point axis to ``size`` pixels."""
    pos = np.linspace(0, grid - 1, size)
    lo = np.minimum(np.floor(pos).astype(int), grid - 2)
    frac = (pos - lo).astype(np.float32)
    weights = np.zeros((size, grid), dtype=np.float32)
    weights[np.arange(size), lo] = 1 - frac
    weights[np.arange(size), lo + 1] = frac
    return weights


def smooth_images(n: int, seed: int = 0, size: int = IMAGE_SIZE, chunk: int = 4096) -> np.ndarray:
    """``(n, size, size, 3)`` uint8 images that JPEG compresses like small photographs.

    A flat colour, plus a random 4x4 colour field and a 16x16 luminance texture
    (both bilinearly upsampled), plus pixel noise of std 4.
    """
    rng = np.random.default_rng(seed)
    up4, up16 = _upsampler(4, size), _upsampler(16, size)
    tint = np.array([1.0, 0.9, 0.8], dtype=np.float32)
    out = np.empty((n, size, size, 3), dtype=np.uint8)
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        image = np.broadcast_to(rng.uniform(40, 215, (m, 1, 1, 3)).astype(np.float32), (m, size, size, 3)).copy()
        image += np.einsum("yi,nijc,xj->nyxc", up4, rng.normal(0, 35, (m, 4, 4, 3)).astype(np.float32), up4, optimize=True)
        texture = rng.normal(0, 30, (m, 16, 16, 1)).astype(np.float32) * tint
        image += np.einsum("yi,nijc,xj->nyxc", up16, texture, up16, optimize=True)
        image += rng.normal(0, 4, image.shape).astype(np.float32)
        out[start : start + m] = np.clip(image, 0, 255).astype(np.uint8)
    return out


class Table:
    """The Otto table as an indexed dataset of ``(features, label)``."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.x[i], int(self.y[i])


class Images:
    """Images as an indexed dataset of ``(image, label)``."""

    def __init__(self, images: np.ndarray) -> None:
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.images[i], i % 10


# ---- measuring ------------------------------------------------------------------------------------
@dataclass
class Result:
    dataset: str
    method: str
    workers: str
    samples: int
    file_bytes: int
    seconds: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def row(self) -> list[str]:
        t = self.median
        return [
            self.dataset,
            self.method,
            self.workers,
            f"{self.samples:,}",
            f"{self.file_bytes / 1e6:,.1f}",
            f"{self.file_bytes / self.samples:,.0f}",
            f"{t:.2f}",
            f"{self.samples / t:,.0f}",
            f"{self.file_bytes / 1e6 / t:,.1f}",
        ]


HEADER = ["dataset", "method", "workers", "samples", "file MB", "bytes/sample", "median s", "samples/s", "MB/s"]


#: JPEG q90 (4:2:0) of the test images, whose noise it smooths away: mean |decoded - original| is about 4 (3.6 to 4.2), max about 50
JPEG_MEAN_ABS, JPEG_MAX_ABS = 6.0, 96
#: samples read back and compared per file
CHECKED_SAMPLES = 256


def check(path: Path, dataset: Any, lossy: bool) -> int:
    """Reopen the file and compare samples spread over it with the dataset's. Returns the file size.

    Raises:
        RuntimeError: the wrong number of samples, or a sample whose values differ (beyond JPEG's loss when ``lossy``).
    """
    n = len(dataset)
    with Reader(path) as reader:
        if len(reader) != n:
            raise RuntimeError(f"{path}: {len(reader)} samples written, expected {n}")
        for i in np.unique(np.linspace(0, n - 1, min(n, CHECKED_SAMPLES)).astype(int)):
            got, want = reader.read(int(i)), dataset[int(i)]
            values, label = np.asarray(got[0]), got[1]
            if int(np.asarray(label).reshape(-1)[0]) != int(want[1]):
                raise RuntimeError(f"{path}: sample {i} has label {label}, expected {want[1]}")
            if values.shape != want[0].shape or values.dtype != want[0].dtype:
                raise RuntimeError(f"{path}: sample {i} is {values.shape} {values.dtype}, expected {want[0].shape} {want[0].dtype}")
            if not lossy:
                if not np.array_equal(values, want[0]):
                    raise RuntimeError(f"{path}: sample {i} differs from the dataset's")
                continue
            diff = np.abs(values.astype(np.int16) - want[0].astype(np.int16))
            if diff.mean() > JPEG_MEAN_ABS or diff.max() > JPEG_MAX_ABS:
                raise RuntimeError(
                    f"{path}: sample {i} decodes {diff.mean():.2f} levels from the original on average, {diff.max()} at most "
                    f"(JPEG q90 allows {JPEG_MEAN_ABS}, {JPEG_MAX_ABS})"
                )
        return reader.file_size


def measure(
    name: str, method: str, workers: str, dataset: Any, lossy: bool, write: Callable[[Path], None], folder: Path, repeats: int
) -> Result:
    seconds, size = [], 0
    for r in range(repeats):
        path = folder / f"{name}-{method}-{workers}-{r}.stoker"
        start = time.perf_counter()
        write(path)
        seconds.append(time.perf_counter() - start)
        size = check(path, dataset, lossy)
        path.unlink()
    result = Result(name, method, workers, len(dataset), size, seconds)
    print(
        f"  {name:<11} {method:<21} workers={workers:<2} {result.median:7.2f} s  ({', '.join(f'{s:.2f}' for s in seconds)})",
        file=sys.stderr,
    )
    return result


def run(args: argparse.Namespace) -> list[Result]:
    n_otto, n_images = (2_000, 1_000) if args.quick else (args.otto_samples, args.images)
    print(f"generating data: {n_otto:,} table rows, {n_images:,} images", file=sys.stderr)
    x, y = otto_table(n_otto)
    images = smooth_images(n_images)
    otto_fields: dict[str, Any] = {"x": NDArrayField((OTTO_FEATURES,), np.float32), "y": IntField()}
    cases: list[tuple[str, dict[str, Any], Any, bool]] = [
        ("otto", otto_fields, Table(x, y), False),
        ("images-raw", {"image": RGBImageField(write_mode="raw"), "label": IntField()}, Images(images), False),
        ("images-jpg", {"image": RGBImageField(write_mode="jpg", jpeg_quality=90), "label": IntField()}, Images(images), True),
    ]
    results = []
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        folder = Path(tmp)
        for name, fields, dataset, lossy in cases:
            for workers in args.workers:

                def write(path: Path, fields: dict[str, Any] = fields, dataset: Any = dataset, workers: int = workers) -> None:
                    DatasetWriter(path, fields, num_workers=workers, progress=False).from_indexed_dataset(dataset, chunksize=args.chunksize)

                results.append(measure(name, "from_indexed_dataset", str(workers), dataset, lossy, write, folder, args.repeats))
            if name == "otto":

                def write_arrays(path: Path) -> None:
                    DatasetWriter(path, otto_fields, num_workers=1, progress=False).from_arrays({"x": x, "y": y})

                results.append(measure(name, "from_arrays", "-", Table(x, y), False, write_arrays, folder, args.repeats))
    return results


def markdown(results: list[Result]) -> str:
    rows = [HEADER, ["---"] * len(HEADER), *(r.row() for r in results)]
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def machine() -> str:
    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, numpy {np.__version__}"


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"must be comma-separated integers >= 1, like 1,2; got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (2,000 rows, 1,000 images): a smoke test")
    parser.add_argument("--otto-samples", type=int, default=61_878, help="rows of the Otto-shaped table (default 61,878)")
    parser.add_argument("--images", type=int, default=50_000, help="number of 32x32 images (default 50,000)")
    parser.add_argument("--workers", type=_int_list, default=[1, 2], help="comma-separated worker counts (default 1,2)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per case; the median is reported (default 3)")
    parser.add_argument("--chunksize", type=int, default=100, help="samples per task sent to a worker (default 100)")
    parser.add_argument("--out", type=Path, default=None, help="folder for the temporary files (default: the system's temp folder)")
    args = parser.parse_args(argv)
    results = run(args)
    print(f"\n{machine()}\n")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
