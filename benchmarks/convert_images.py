"""Converting a folder of JPEG photos: stored as they are vs decoded and re-encoded, against merely reading the files.

Generates (no download) ``--images`` photo-like JPEGs of about 500x375 pixels
(smooth colour fields, texture and sensor-like noise, saved by Pillow at quality
90, 4:2:0) in two class folders, then measures, median of ``--repeats`` runs:

* **read files**: reading every file's bytes (``Path.read_bytes``) in this
  process: the floor of any conversion (the files are in the page cache, as
  they are after the first run of anything);
* **stored as is**: ``convert_image_folder(write_mode="jpg")``: each JPEG is
  copied byte for byte;
* **re-encoded**: the same with ``reencode=True``: each file is decoded by
  Pillow and encoded again by libjpeg-turbo at quality 90 (stoker's only path
  before);

each conversion with 1 and 2 worker processes and the default (``num_workers=-1``). Every output is reopened: its
sample count, and for the stored-as-is files the first and last payloads
against the source files' bytes.

Usage::

    python benchmarks/convert_images.py                 # 2,000 images, about a minute on 2 cores
    python benchmarks/convert_images.py --images 200 --repeats 1
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
from pathlib import Path

import numpy as np
from PIL import Image


def photo(h: int, w: int, rng: np.random.Generator) -> np.ndarray:
    """A photo-like picture: low-frequency colour fields, a texture, mild noise."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    channels = []
    for _ in range(3):
        fx, fy, phase = (*rng.uniform(0.5, 4, 2).tolist(), rng.uniform(0, 6.3))
        channels.append(128 + 80 * np.sin(x / w * fx * 6.3 + phase) * np.cos(y / h * fy * 6.3))
    image = np.stack(channels, axis=-1) + 20 * np.sin(x / 3.1 + y / 4.7)[..., None] + rng.normal(0, 6, (h, w, 3))
    return np.clip(image, 0, 255).astype(np.uint8)


def make_folder(root: Path, count: int, seed: int = 0) -> int:
    """Write ``count`` JPEGs into ``root/a`` and ``root/b``; returns their total size [bytes]."""
    rng = np.random.default_rng(seed)
    total = 0
    for i in range(count):
        folder = root / ("a" if i % 2 else "b")
        folder.mkdir(parents=True, exist_ok=True)
        h, w = (375, 500) if i % 4 else (500, 375)
        path = folder / f"{i:06d}.jpg"
        Image.fromarray(photo(h, w, rng)).save(path, quality=90)
        total += path.stat().st_size
    return total


def timed(fn: Callable[[], object], repeats: int, setup: Callable[[], object] = lambda: None) -> float:
    """Median wall time of ``fn`` [seconds]; ``setup`` runs before each call, untimed."""
    times = []
    for _ in range(repeats):
        setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=2000, help="JPEGs to generate (default: 2000)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per case; the median is reported (default: 3)")
    parser.add_argument("--out", default=None, help="folder for the temporary files (default: the system's)")
    args = parser.parse_args()

    from stoker.convert.imagefolder import convert_image_folder, find_images
    from stoker.format import Reader

    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        root = Path(tmp) / "photos"
        size = make_folder(root, args.images)
        samples, _ = find_images(root)
        files = [p for p, _ in samples]
        dst = Path(tmp) / "out.stoker"

        def read() -> None:
            for path in files:
                path.read_bytes()

        def convert(workers: int, reencode: bool) -> Callable[[], object]:
            return lambda: convert_image_folder(root, dst, write_mode="jpg", num_workers=workers, reencode=reencode, progress=False)

        rows = [("read files", "-", timed(read, args.repeats))]
        for label, reencode in (("stored as is", False), ("re-encoded", True)):
            for workers in (1, 2, -1):  # -1: the default (one per CPU, or this process for JPEGs copied as they are)
                # the previous output is deleted before, untimed: freeing a 100 MiB file's pages takes ~0.04 s, which
                # converting into a new file does not pay
                seconds = timed(convert(workers, reencode), args.repeats, setup=lambda: dst.unlink(missing_ok=True))
                with Reader(dst) as reader:
                    if len(reader) != len(files):
                        raise SystemExit(f"{label}: {len(reader)} samples written, {len(files)} expected")
                    if not reencode:
                        for i in (0, len(files) - 1):
                            ptr, n = int(reader.metadata["image/ptr"][i]), int(reader.metadata["image/size"][i])
                            if bytes(reader.storage[ptr : ptr + n]) != files[i].read_bytes():
                                raise SystemExit(f"{label}: sample {i} is not the file {files[i]}")
                rows.append((label, "default" if workers == -1 else str(workers), seconds))

    read_s = rows[0][2]
    baseline = {w: s for label, w, s in rows if label == "re-encoded"}
    print(
        f"{args.images:,} JPEGs of 500x375, {size / 2**20:.1f} MiB; {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"median of {args.repeats}"
    )
    print()
    print("| case | workers | time [s] | images/s | MiB/s of JPEG | vs re-encoded, same workers | vs reading the files |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, workers, seconds in rows:
        speedup = f"{baseline[workers] / seconds:.1f}x" if workers in baseline else "-"
        print(
            f"| {label} | {workers} | {seconds:.3f} | {args.images / seconds:,.0f} | {size / 2**20 / seconds:,.0f} | {speedup} "
            f"| {read_s / seconds:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
