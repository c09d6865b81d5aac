"""The loader's bounded cache (``os_cache=False``) against the OS page cache (``os_cache=True``).

Two datasets, generated with numpy (no download), each written as one file:

* ``rows-8k``: 8,000-byte uint8 rows and an int label (the size of a small
  JPEG): every sample spans two or three pages;
* ``table``: 93 float32 values and an int label per sample (372-byte rows, the
  shape of the Otto table): many samples share a page.

The file fits in RAM and is read once before timing, so both modes read from
the page cache: the comparison is the cost of the cache's own reads
(``preadv`` into anonymous memory, then ``MADV_DONTNEED``) against mapped
pages. Each (dataset, order, mode) runs in a fresh process: a warm-up epoch
of 20 batches (it loads the libraries and starts the threads), then timed
epochs (median of ``--repeat``); RSS (RssAnon + RssFile + RssShmem) is
sampled after every batch of the first timed epoch, and its growth from just
before that epoch is reported (the batches' own memory included) with the
cache's bound (``ShardedReader.cache_bound``, 2 batches) and the cache's peak.

Usage::

    python benchmarks/bounded_cache.py            # 512 MB files, a few minutes on 2 cores
    python benchmarks/bounded_cache.py --quick    # 64 MB files
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DATASETS = {"rows-8k": 8000, "table": 93 * 4}


def rss() -> int:
    """RssAnon + RssFile + RssShmem of this process [bytes]."""
    total = 0
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in ("RssAnon", "RssFile", "RssShmem"):
                total += int(rest.split()[0]) * 1024
    return total


def write(path: Path, name: str, size_mb: int) -> None:
    from stoker.fields import IntField, NDArrayField
    from stoker.format import DatasetWriter

    row = DATASETS[name]
    n = size_mb * 2**20 // row
    rng = np.random.default_rng(0)
    x: np.ndarray
    if name == "table":
        x = rng.poisson(2.0, (n, 93)).astype(np.float32)
        field = NDArrayField((93,), np.dtype("<f4"))
    else:
        x = rng.integers(0, 256, (n, row), dtype=np.uint8)
        field = NDArrayField((row,), np.dtype("u1"))
    DatasetWriter(path, {"x": field, "y": IntField()}, num_workers=1, progress=False).from_arrays({"x": x, "y": np.arange(n)})


def run_one(path: str, order: str, os_cache: bool, batch_size: int, workers: int, repeat: int) -> dict[str, float]:
    """One configuration, in this process (called in a child process)."""
    from stoker.loader import Loader, OrderOption

    with open(path, "rb") as fh:  # into the page cache
        while fh.read(1 << 24):
            pass
    kwargs = {"batch_size": batch_size, "num_workers": workers, "order": OrderOption[order], "seed": 0, "os_cache": os_cache}
    with Loader(path, indices=np.arange(20 * batch_size), **kwargs) as warm:  # type: ignore[arg-type]
        for _ in warm:
            pass
    loader = Loader(path, **kwargs)  # type: ignore[arg-type]
    times, probe = [], []
    before = rss()
    for r in range(repeat):
        t0 = time.perf_counter()
        for _batch in loader:
            if r == 0:
                probe.append(rss())
        times.append(time.perf_counter() - t0)
    reader = loader.reader
    cache = getattr(reader, "cache", None)
    n = len(reader)
    return {
        "samples_per_s": n / statistics.median(times),
        "mb_per_s": os.path.getsize(path) / 2**20 / statistics.median(times),
        "rss_growth_mb": (max(probe) - before) / 2**20,
        "bound_mb": reader.cache_bound(batch_size) / 2**20 if cache is not None else float("nan"),  # type: ignore[union-attr]
        "peak_mb": cache.peak_bytes / 2**20 if cache is not None else float("nan"),
        "file_mb": os.path.getsize(path) / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 MB files instead of 512 MB")
    parser.add_argument("--size-mb", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--child", nargs=3, metavar=("PATH", "ORDER", "OS_CACHE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        path, order, os_cache = args.child
        print(json.dumps(run_one(path, order, os_cache == "1", args.batch_size, args.workers, args.repeat)))
        return
    size = args.size_mb or (64 if args.quick else 512)
    print(f"# bounded cache vs os_cache=True: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}, batch {args.batch_size}, {args.workers} workers, {size} MB files\n")  # fmt: skip
    print("| dataset | order | os_cache=True samples/s | bounded samples/s | bounded / True | RSS growth True (MB) "
          "| RSS growth bounded (MB) | cache bound (MB) | cache peak (MB) | file / bound |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in DATASETS:
            path = Path(tmp) / f"{name}.stoker"
            write(path, name, size)
            for order in ("QUASI_RANDOM", "SEQUENTIAL", "RANDOM"):
                res = {}
                for flag in ("1", "0"):
                    cmd = [sys.executable, __file__, "--child", str(path), order, flag, "--batch-size", str(args.batch_size),
                           "--workers", str(args.workers), "--repeat", str(args.repeat)]  # fmt: skip
                    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                    res[flag] = json.loads(out.strip().splitlines()[-1])
                t, b = res["1"], res["0"]
                print(f"| {name} | {order} | {t['samples_per_s']:,.0f} | {b['samples_per_s']:,.0f} | "
                      f"{b['samples_per_s'] / t['samples_per_s']:.2f} | {t['rss_growth_mb']:.0f} | {b['rss_growth_mb']:.1f} | "
                      f"{b['bound_mb']:.1f} | {b['peak_mb']:.1f} | {b['file_mb'] / b['bound_mb']:.0f}x |", flush=True)  # fmt: skip
            path.unlink()


if __name__ == "__main__":
    main()
