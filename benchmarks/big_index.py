"""Big indexes: what opening a 10^8-sample file costs, compared with a 10^4-sample one.

Writes a table of ``--rows`` samples (default 10^8) of one ``IntField`` (8
bytes of metadata per sample, 800 MB in all) with ``DatasetWriter.from_arrays``,
and a 10^4-row one, then measures, each in a fresh Python process:

* ``open``: ``Reader(path)`` [ms] and the process's RSS right after it [MiB]
  (torch, Numba and stoker already imported: about 100 MiB before opening);
* ``Loader()``: the constructor [ms] (``batch_size=1024``, ``num_workers=1``,
  sequential order; this includes loading the compiled pipeline from Numba's
  disk cache, the same for any number of rows) and the RSS after it;
* ``first batch``: ``next(iter(loader))`` [ms] (the epoch's order is made and
  the batch's metadata blocks validated) and the RSS after it;
* ``validate``: a full ``Reader.validate_metadata()`` [ms].

Each file is measured in three ways (each the median of ``--repeats`` fresh
processes), in this order:

1. ``eager``: the behaviour before lazy validation, for comparison
   (``LAZY_VALIDATION_BYTES`` raised so that ``Loader()`` validates the whole
   table; no recorded result);
2. ``first run``: lazy validation, no recorded validation (the cache
   folder's ``validated/`` emptied before each process); its
   ``validate_metadata()`` column is a full validation with nothing recorded;
3. ``second run``: after a full validation was recorded; its
   ``validate_metadata()`` column finds the record.

Compiled pipelines are cached beforehand (a warm-up process), so no row
includes Numba compilation. The files are in the page cache (just written).

Usage::

    python benchmarks/big_index.py                 # 10^8 rows: about 2 GB of disk in --dir, a few minutes
    python benchmarks/big_index.py --rows 1000000  # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BATCH = 1024


def rss_mib() -> float:
    """This process's resident set size [MiB]."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def child(mode: str, path: str) -> dict[str, Any]:
    """One measurement in this (fresh) process."""
    import stoker.format.reader as reader_module
    import stoker.transforms  # noqa: F401  (imports torch and numba: not part of what is measured)
    from stoker.format import Reader
    from stoker.loader.loader import Loader

    out: dict[str, Any] = {"rss_start": rss_mib()}
    if mode == "eager":
        reader_module.LAZY_VALIDATION_BYTES = 1 << 62  # type: ignore[misc]
    if mode == "validate":
        t0 = time.perf_counter()
        reader = Reader(path)
        reader.validate_metadata()
        out["validate_ms"] = (time.perf_counter() - t0) * 1e3
        return out
    t0 = time.perf_counter()
    reader = Reader(path)
    out["open_ms"] = (time.perf_counter() - t0) * 1e3
    out["rss_open"] = rss_mib()
    reader.close()
    del reader
    t0 = time.perf_counter()
    loader = Loader(path, batch_size=BATCH, num_workers=1, seed=0)
    out["loader_ms"] = (time.perf_counter() - t0) * 1e3
    out["rss_loader"] = rss_mib()
    t0 = time.perf_counter()
    it: Any = iter(loader)
    (y,) = next(it)
    out["first_batch_ms"] = (time.perf_counter() - t0) * 1e3
    out["rss_first_batch"] = rss_mib()
    assert y[:, 0].tolist() == list(range(min(BATCH, len(y)))), "wrong first batch"
    it.close()
    return out


def run_child(mode: str, path: Path, env: dict[str, str]) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", mode, str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} on {path} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write(path: Path, rows: int) -> float:
    """Write ``rows`` samples of one IntField (value = index); returns seconds."""
    import numpy as np

    from stoker.fields import IntField
    from stoker.format import DatasetWriter

    t0 = time.perf_counter()
    DatasetWriter(path, {"y": IntField()}, num_workers=1, progress=False).from_arrays(
        {"y": np.arange(rows, dtype=np.int64)}, chunksize=1 << 20
    )
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, default=10**8, help="samples of the big file (default 10^8)")
    parser.add_argument("--small-rows", type=int, default=10**4, help="samples of the small file (default 10^4)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per measurement; the median is shown")
    parser.add_argument("--dir", type=Path, default=None, help="where to write the files (default: a temporary folder in /tmp)")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    folder = Path(tempfile.mkdtemp(prefix="stoker-big-index-", dir=args.dir))
    need = 8 * args.rows * 1.1 + (64 << 20)
    free = shutil.disk_usage(folder).free
    if free < need:
        shutil.rmtree(folder)
        sys.exit(
            f"{folder} has {free / 2**30:.1f} GiB free; the {args.rows}-row file needs {need / 2**30:.1f} GiB (pass --dir or fewer --rows)"
        )
    cache = folder / "cache"
    env = dict(os.environ, STOKER_CACHE_DIR=str(cache))
    try:
        files = {}
        for rows in (args.small_rows, args.rows):
            path = folder / f"rows-{rows}.stoker"
            seconds = write(path, rows)
            print(f"wrote {path.name}: {path.stat().st_size / 2**20:.1f} MiB in {seconds:.1f} s", flush=True)
            files[rows] = path
        run_child("first", files[args.small_rows], env)  # warm-up: compiles and caches the pipeline
        records = cache / "validated"
        results = []
        for rows, path in files.items():

            def measure(mode: str, path: Path = path, clear: bool = False) -> dict[str, Any]:
                runs = []
                for _ in range(args.repeats):
                    if clear:
                        shutil.rmtree(records, ignore_errors=True)
                    runs.append(run_child(mode, path, env))
                return {key: statistics.median(r[key] for r in runs) for key in runs[0]}

            eager = measure("eager", clear=True)
            first = measure("first", clear=True)
            validate = measure("validate", clear=True)  # each records the result
            second = measure("second")
            again = measure("validate")
            results.append((rows, "eager (before: full validation in Loader())", eager, None))
            results.append((rows, "first run (lazy, nothing recorded)", first, validate["validate_ms"]))
            results.append((rows, "second run (validation recorded)", second, again["validate_ms"]))
        print()
        print(
            "| rows | run | open [ms] | RSS after open [MiB] | Loader() [ms] | RSS after Loader() [MiB] | first batch [ms] | RSS after first batch [MiB] | full validate_metadata() [ms] |"
        )
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for rows, name, r, val in results:
            v = "-" if val is None else f"{val:.1f}"
            print(
                f"| {rows:,} | {name} | {r['open_ms']:.1f} | {r['rss_open']:.0f} | {r['loader_ms']:.1f} | {r['rss_loader']:.0f} | "
                f"{r['first_batch_ms']:.1f} | {r['rss_first_batch']:.0f} | {v} |"
            )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
