"""What the check before use costs on a dataset in object storage: every data block read from a cached shard that this
process did not download, checked against its CRC-32 once per process (``Loader(check_data=True)``, the default).

A shard this process downloads is checked whole at download and costs nothing more; the cost shows in the first epoch
of a process over a *warm* cache (an earlier run's shards, or another rank's): it reads each block once more and
computes its CRC. Measured side by side in one process: Loaders with ``check_data=True`` and ``check_data=False`` alternate,
each timing one warm epoch as the first of a process (the process's record of checked blocks is cleared before each
``check_data=True`` epoch), then a second epoch (everything checked: no cost expected). The same for the same shards in a
local folder read through the bounded cache (``os_cache=False``), whose check is the same code: the remote check
should cost what the local one does.

Two datasets: a table (93 float32 features and a label per row, Otto's shape: a batch is a gather, so the check's
share is the largest) and photos (about 500x375 JPEGs, random resized crop 224 + flip, as ``benchmarks/remote.py``).
Both Loaders must yield the same batches (the table, bit for bit) and the photos the same shapes and dtypes.

Run: ``python benchmarks/remote_check_cost.py [--rounds 5] [--rows 200000] [--images 1000] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def table(out: Path, rows: int) -> Path:
    from stoker.dataset.shards import write_shards
    from stoker.fields import IntField, NDArrayField

    folder = out / f"table-{rows}"
    if not (folder / "manifest.stoker.json").exists():
        shutil.rmtree(folder, ignore_errors=True)
        rng = np.random.default_rng(0)
        arrays = {"x": rng.normal(size=(rows, 93)).astype(np.float32), "y": rng.integers(0, 9, rows)}
        fields = {"x": NDArrayField(np.dtype("float32"), (93,)), "y": IntField()}
        write_shards(folder, fields, arrays, samples_per_shard=max(1, rows // 5), num_workers=1, progress=False)
    return folder


def upload(folder: Path, url: str) -> None:
    from stoker.dataset._manifest import MANIFEST_NAME
    from stoker.remote._store import open_store

    store = open_store(url)
    for path in sorted(folder.glob("*.stoker")):
        store.upload(path.name, path)
    store.upload(MANIFEST_NAME, folder / MANIFEST_NAME)


def epoch(loader: Any, keep: bool) -> tuple[float, list[Any]]:
    """One epoch's time [s]; the batches (copied) if ``keep``, else their shapes and dtypes."""
    out = []
    t0 = time.perf_counter()
    for batch in loader:
        out.append([b.numpy().copy() for b in batch] if keep else [(tuple(b.shape), str(b.dtype)) for b in batch])
    return time.perf_counter() - t0, out


def same(a: list[Any], b: list[Any], exact: bool) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        for u, v in zip(x, y):
            if exact and not (u.shape == v.shape and u.dtype == v.dtype and np.array_equal(u, v)):
                return False
            if not exact and u != v:
                return False
    return True


def measure(name: str, source: str, kw: dict[str, Any], rounds: int, exact: bool) -> dict[str, Any]:
    """``rounds`` alternating pairs of Loaders (verify on / off): each one's first and second epoch."""
    from stoker import Loader
    from stoker.format import _verify

    times: dict[str, list[float]] = {"verify_first": [], "no_verify_first": [], "verify_second": [], "no_verify_second": []}
    crcs: list[int] = []
    reference: list[Any] | None = None
    for r in range(rounds):
        for verify in (True, False) if r % 2 == 0 else (False, True):
            if verify:
                _verify._MARKS.clear()  # as a new process: no block of these files checked yet
            with Loader(source, check_data=verify, **kw) as loader:
                first, batches = epoch(loader, exact)
                second, _ = epoch(loader, False)
                check = getattr(loader.reader, "data_check", None) or loader._data_check
                if verify and check is not None:
                    crcs.append(int(check.counts[0]))
            if reference is None:
                reference = batches
            elif not same(reference, batches, exact):
                raise SystemExit(f"{name}: check_data={verify} yielded other batches than the first Loader: no number reported")
            tag = "verify" if verify else "no_verify"
            times[f"{tag}_first"].append(first)
            times[f"{tag}_second"].append(second)
            print(f"  {name} round {r + 1}: check_data={verify!s:5} first epoch {first:.3f} s, second {second:.3f} s", file=sys.stderr)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "times": times,
        "median_s": med,
        "first_epoch_verify_vs_off": med["verify_first"] / med["no_verify_first"],
        "second_epoch_verify_vs_off": med["verify_second"] / med["no_verify_second"],
        "crcs_per_first_epoch": statistics.median(crcs) if crcs else 0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "stoker-bench-remote-check")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    from _servers import loopback
    from remote import build, pipelines
    from stoker import Loader, OrderOption

    datasets = {
        "table": (table(args.out, args.rows), {"batch_size": 1024}, True),
        "photos": (build(args.out, args.images, 16 << 20), {"batch_size": 64, "pipelines": pipelines()}, False),
    }
    results: dict[str, Any] = {}
    with loopback.s3_server("check-cost"):
        for name, (folder, extra, exact) in datasets.items():
            url = f"s3://check-cost/{name}/"
            upload(folder, url)
            cache = args.out / f"cache-{name}"
            shutil.rmtree(cache, ignore_errors=True)
            kw = {"num_workers": args.workers, "order": OrderOption.QUASI_RANDOM, "seed": 0, **extra}
            with Loader(url, cache_dir=cache, **kw) as warm:  # fills the cache (and compiles)
                epoch(warm, False)
            results[f"{name}_remote_warm_cache"] = measure(f"{name} remote", url, {**kw, "cache_dir": cache}, args.rounds, exact)
            results[f"{name}_local_bounded"] = measure(f"{name} local", str(folder), {**kw, "os_cache": False}, args.rounds, exact)
            results[f"{name}_bytes"] = sum(p.stat().st_size for p in folder.glob("*.stoker"))
    report = {"machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}",
              "rounds": args.rounds, "workers": args.workers, "results": results}  # fmt: skip
    (args.out / "remote_check_cost.json").write_text(json.dumps(report, indent=1))
    print(f"{'':28} {'first epoch, verify / off':>26} {'second epoch':>14} {'CRCs (first)':>13} {'verify s':>9} {'off s':>8}")
    for key, r in results.items():
        if isinstance(r, dict):
            m = r["median_s"]
            print(f"{key:28} {r['first_epoch_verify_vs_off']:>26.3f} {r['second_epoch_verify_vs_off']:>14.3f} "
                  f"{r['crcs_per_first_epoch']:>13.0f} {m['verify_first']:>9.3f} {m['no_verify_first']:>8.3f}")  # fmt: skip
    print(f"table {results['table_bytes'] / 1e6:.0f} MB, photos {results['photos_bytes'] / 1e6:.0f} MB; {args.workers} workers; "
          f"medians of {args.rounds} alternating rounds; {report['machine']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
