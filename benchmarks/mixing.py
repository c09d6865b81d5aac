"""Mixing datasets (issue 33), side by side in one run.

1. **Local**: a 70/30 mix of two photo datasets, ``Loader([Stream(A, weight=0.7), Stream(B, weight=0.3)])``,
   against one dataset of the same images, ``Loader([A's shards..., B's shards...])`` (a list of files is one
   dataset). A holds 70% of the images and B 30%, so the mix's default epoch takes each image once, as the
   concatenated dataset does: the same work, and the ratio is the cost of mixing (target >= 0.95x). The two alternate,
   run after run, in this process; ``RANDOM`` and ``QUASI_RANDOM`` orders.
2. **Remote** (``--remote``): the same mix with both datasets in a loopback S3 store (moto behind a proxy: 20 ms per
   request, 200 MB/s, in a child process; ``benchmarks/remote.py``'s store), ``QUASI_RANDOM``, one cache limit; and
   (``--mosaic``) Mosaic streaming's two-``Stream`` mix (``proportion=0.7`` and ``0.3``, the same JPEG bytes as MDS
   shards, the same cache limit, a shuffle block of one shard's samples as stoker's windows) in its own environment
   (``benchmarks/mosaic/``). Target: stoker's cold epoch >= 2x Mosaic's.

The task is decode-bound, as ``benchmarks/remote.py``'s: about 500x375 JPEGs (q90) -> a random resized crop to 224 +
flip -> uint8 NCHW, batch 64, 2 threads (stoker) or 2 worker processes (Mosaic). Every batch's shape and dtype are
checked, and each mixed epoch's share of each dataset; a system that differs reports no number.

Run: ``python benchmarks/mixing.py [--images 3000] [--runs 3] [--remote] [--mosaic] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import remote as rb  # noqa: E402  (benchmarks/remote.py: the store, the pipeline, the checks, Mosaic's runner)

BATCH = rb.BATCH


class Slice:
    """Images ``base .. base + n - 1`` of the photo generator: A and B are two parts of one set of distinct images."""

    def __init__(self, n: int, base: int) -> None:
        from images import DATASETS

        self.n, self.base, self.images = n, base, DATASETS["C"][1](base + n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self.images[self.base + i]


def build(out: Path, name: str, n: int, base: int, shard_bytes: int) -> Path:
    from stoker.dataset.sharded import ShardedReader
    from stoker.dataset.shards import ShardedWriter
    from stoker.errors import StokerError
    from stoker.fields import IntField, RGBImageField

    folder = out / f"mix-{name}-{base}-{n}"
    try:
        with ShardedReader(folder) as reader:
            if len(reader) == n:
                return folder
    except (StokerError, OSError):
        pass
    shutil.rmtree(folder, ignore_errors=True)
    fields = {"image": RGBImageField(write_mode="jpg", jpeg_quality=90), "label": IntField()}
    ShardedWriter(folder, fields, bytes_per_shard=shard_bytes, num_workers=2).from_indexed_dataset(Slice(n, base))
    return folder


def shard_files(folder: Path) -> list[str]:
    from stoker.dataset.shards import resolve_dataset

    return [str(p) for p in resolve_dataset(folder)]


#: CPU time of this process (every thread) per image of the last epoch() [ms]: steadier than wall time on a busy machine
CPU_MS: list[float] = []


def epoch(loader: Any, n: int, who: str, sources: tuple[int, int] | None = None) -> float:
    """One epoch's throughput [images/s]; checks every batch, and (a mix) each dataset's share of the epoch."""
    import numpy as np

    c0 = time.process_time()
    t0 = time.perf_counter()
    seen = 0
    counts = np.zeros(2, dtype=np.int64)
    for batch in loader:
        seen += rb._check(batch, who, n % BATCH or BATCH)
        if sources is not None:
            counts += np.bincount(batch[-1].numpy(), minlength=2)
    seconds = time.perf_counter() - t0
    CPU_MS.append((time.process_time() - c0) / max(1, seen) * 1e3)
    if seen != n:
        raise SystemExit(f"{who}: {seen} images in an epoch; expected {n}: no number reported")
    if sources is not None and tuple(counts.tolist()) != sources:
        raise SystemExit(f"{who}: {counts.tolist()} images of A and B in an epoch; expected {list(sources)}: no number reported")
    return n / seconds


def run_local(a: Path, b: Path, n_a: int, n_b: int, workers: int, runs: int) -> dict[str, Any]:
    """Mix and concatenation alternating, per order: two epochs each per run (the first warms the page cache)."""
    from stoker import Loader, OrderOption, Stream

    out: dict[str, Any] = {}
    n = n_a + n_b
    files = shard_files(a) + shard_files(b)
    for order in (OrderOption.RANDOM, OrderOption.QUASI_RANDOM):
        kw: dict[str, Any] = {"batch_size": BATCH, "num_workers": workers, "order": order, "seed": 0, "pipelines": rb.pipelines()}
        rows: dict[str, list[float]] = {"concatenated": [], "mix_70_30": []}
        cpu: dict[str, list[float]] = {"concatenated": [], "mix_70_30": []}
        for run in range(runs):
            for name in ("concatenated", "mix_70_30") if run % 2 == 0 else ("mix_70_30", "concatenated"):
                if name == "concatenated":
                    with Loader(files, **kw) as loader:
                        epoch(loader, n, name)
                        rows[name].append(epoch(loader, n, name))
                        cpu[name].append(CPU_MS[-1])
                else:
                    streams = [Stream(str(a), weight=0.7, name="A"), Stream(str(b), weight=0.3, name="B")]
                    with Loader(streams, return_source=True, **kw) as loader:
                        epoch(loader, n, name, (n_a, n_b))
                        rows[name].append(epoch(loader, n, name, (n_a, n_b)))
                        cpu[name].append(CPU_MS[-1])
            print(f"  local {order.name} run {run + 1}/{runs}: " + ", ".join(f"{k} {v[-1]:.0f} img/s ({cpu[k][-1]:.2f} CPU ms/img)"
                                                                            for k, v in rows.items()),
                  file=sys.stderr, flush=True)  # fmt: skip
        med = {k: statistics.median(v) for k, v in rows.items()}
        cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
        out[order.name] = {"runs": rows, "median_ips": med, "ratio_mix_vs_concatenated": med["mix_70_30"] / med["concatenated"],
                           "ratio_per_run": [m / c for m, c in zip(rows["mix_70_30"], rows["concatenated"])],
                           "cpu_ms_per_image": cpu, "cpu_ratio_concatenated_vs_mix": cpu_med["concatenated"] / cpu_med["mix_70_30"]}  # fmt: skip
    return out


def run_stoker_remote(urls: tuple[str, str], n: int, n_ab: tuple[int, int], cache_dir: Path, limit: int, workers: int,
                      endpoint: str) -> dict[str, Any]:  # fmt: skip
    """The mix from the store: two epochs, the first cold (the clock starts before the Loader is built)."""
    from stoker import Loader, OrderOption, Stream

    shutil.rmtree(cache_dir, ignore_errors=True)
    t0 = time.perf_counter()
    streams = [Stream(urls[0], weight=0.7, name="A"), Stream(urls[1], weight=0.3, name="B")]
    loader = Loader(streams, batch_size=BATCH, num_workers=workers, order=OrderOption.QUASI_RANDOM, seed=0, pipelines=rb.pipelines(),
                    cache_dir=cache_dir, cache_limit=limit, storage_options={"endpoint": endpoint}, return_source=True)  # fmt: skip
    out: dict[str, Any] = {}
    try:
        for e in range(2):
            start = time.perf_counter() if e else t0  # (the cold epoch from before the Loader is built: opening included)
            epoch(loader, n, "stoker mix (remote)", n_ab)
            out["cold_ips" if e == 0 else "warm_ips"] = n / (time.perf_counter() - start)
        stats = loader.stats()
        out.update(bytes_downloaded=stats["remote"]["bytes_downloaded"], cache_peak_bytes=stats["remote"]["cache_peak_bytes"],
                   read_s_A=stats["mix"]["A"].get("read_s", 0.0), read_s_B=stats["mix"]["B"].get("read_s", 0.0))  # fmt: skip
    finally:
        loader.close()
    return out


def run_mosaic_mix(out_dir: Path, folders: tuple[Path, Path], store: rb.Store, limit: int, workers: int, n: int,
                   shard_bytes: int) -> dict[str, Any]:  # fmt: skip
    """Mosaic streaming's two-Stream mix (proportions 0.7 and 0.3) in its own environment, the same JPEGs as MDS shards."""
    mosaic = HERE / "mosaic"
    python = mosaic / ".venv" / "bin" / "python"
    subprocess.run(["bash", str(mosaic / "setup_env.sh")], check=True, capture_output=True)
    remotes = [f"s3://bench/mix-mds-{k}/" for k in ("a", "b")]
    if not getattr(store, "mix_mds_written", False):
        for folder, remote in zip(folders, remotes):
            raw = out_dir / f"mds-input-{folder.name}"
            rb.export_jpegs(folder, raw)
            subprocess.run([str(python), str(mosaic / "write_mds.py"), "--input", str(raw), "--remote", remote, "--endpoint",
                            store.direct, "--shard-mb", str(max(1, shard_bytes >> 20))], check=True, capture_output=True, text=True)  # fmt: skip
        store.mix_mds_written = True  # type: ignore[attr-defined]
    per_shard = max(1, int(n / max(1, sum(len(list(f.glob("*.stoker"))) for f in folders))))
    cmd = [str(python), str(mosaic / "run_mosaic.py"), "--stream", f"{remotes[0]}=0.7", "--stream", f"{remotes[1]}=0.3",
           "--epoch-size", str(n), "--endpoint", store.proxy, "--cache-dir", str(out_dir / "mosaic-mix-cache"), "--cache-limit",
           str(limit), "--batch-size", str(BATCH), "--workers", str(workers), "--epochs", "2", "--crop", "224",
           "--shuffle-block-size", str(per_shard)]  # fmt: skip
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    batch = got.get("batch", {})
    if list(batch.get("shape", []))[1:] != list(rb.SHAPE[1:]) or batch.get("dtype") != "uint8":
        raise SystemExit(f"mosaic: batches of {batch}; expected {rb.SHAPE} uint8: no number reported")
    if any(e["images"] != n for e in got["epochs"]):
        raise SystemExit(f"mosaic: epochs of {[e['images'] for e in got['epochs']]} images; expected {n}: no number reported")
    return {"first_batch_s": got["first_batch_s"], "cold_ips": got["cold_images_per_s"], "warm_ips": got["warm_images_per_s"],
            "bytes_downloaded": got["bytes_downloaded"], "cache_peak_bytes": got["peak_cache_bytes"],
            "cache_limit_held": float(bool(got.get("cache_limit_held")))}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=3000, help="A and B together (A: 70%%, B: 30%%)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--shard-bytes", type=int, default=16 << 20)
    ap.add_argument("--remote", action="store_true", help="also the mix from a loopback S3 store")
    ap.add_argument("--mosaic", action="store_true", help="also Mosaic streaming's two-Stream mix (implies --remote)")
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--bandwidth", type=float, default=200e6, help="[bytes/s]")
    ap.add_argument("--cache-fraction", type=float, default=0.5, help="the cache limit, as a fraction of both datasets' bytes")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "stoker-bench-mixing")
    args = ap.parse_args(argv)
    args.remote = args.remote or args.mosaic
    args.out.mkdir(parents=True, exist_ok=True)
    n_a = round(args.images * 0.7)
    n_b = args.images - n_a
    a = build(args.out, "a", n_a, 0, args.shard_bytes)
    b = build(args.out, "b", n_b, n_a, args.shard_bytes)
    rb.warm_up(a, args.workers)
    report: dict[str, Any] = {
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "images": [n_a, n_b], "workers": args.workers, "runs": args.runs,
    }  # fmt: skip
    print("local: the mix against one dataset of the same images", file=sys.stderr)
    report["local"] = run_local(a, b, n_a, n_b, args.workers, args.runs)
    if args.remote:
        sizes = [p.stat().st_size for f in (a, b) for p in f.glob("*.stoker")]
        limit = max(int(sum(sizes) * args.cache_fraction), 4 * max(sizes))
        store = rb.Store(args.latency_ms, args.bandwidth)
        urls = ("s3://bench/mix-a/", "s3://bench/mix-b/")
        rows: dict[str, list[dict[str, Any]]] = {"stoker_mix_remote": [], "mosaic_mix": []}
        try:
            for folder, url in zip((a, b), urls):
                rb.upload(folder, url, store.direct)
            for run in range(args.runs):
                print(f"remote run {run + 1}/{args.runs}", file=sys.stderr, flush=True)
                rows["stoker_mix_remote"].append(
                    run_stoker_remote(urls, args.images, (n_a, n_b), args.out / "cache", limit, args.workers, store.proxy)
                )
                if args.mosaic:
                    rows["mosaic_mix"].append(run_mosaic_mix(args.out, (a, b), store, limit, args.workers, args.images, args.shard_bytes))
        finally:
            store.close()
        table = {k: rb.summary(v) for k, v in rows.items() if v}
        report["remote"] = {"cache_limit": limit, "dataset_bytes": sum(sizes), "latency_ms": args.latency_ms, "bandwidth": args.bandwidth,
                            "runs": rows, "summary": table}  # fmt: skip
        if "mosaic_mix" in table:
            s, m = table["stoker_mix_remote"], table["mosaic_mix"]
            report["remote"]["ratio_cold_vs_mosaic"] = s["cold_ips"]["median"] / m["cold_ips"]["median"]
            report["remote"]["ratio_warm_vs_mosaic"] = s["warm_ips"]["median"] / m["warm_ips"]["median"]
    (args.out / "mixing.json").write_text(json.dumps(report, indent=1))
    for order, res in report["local"].items():
        med = res["median_ips"]
        print(f"local {order:13} concatenated {med['concatenated']:7.0f} img/s   mix 70/30 {med['mix_70_30']:7.0f} img/s   "
              f"ratio {res['ratio_mix_vs_concatenated']:.3f} (per run: {', '.join(f'{r:.3f}' for r in res['ratio_per_run'])}); "
              f"CPU per image: concatenated / mix {res['cpu_ratio_concatenated_vs_mix']:.3f}")  # fmt: skip
    if "remote" in report:
        for name, s in report["remote"]["summary"].items():
            print(f"remote {name:18} cold {s['cold_ips']['median']:6.0f} img/s  warm {s['warm_ips']['median']:6.0f} img/s  "
                  f"peak cache {s['cache_peak_bytes']['median'] / 1e6:.0f} MB (limit {report['remote']['cache_limit'] / 1e6:.0f} MB)")  # fmt: skip
        for key in ("ratio_cold_vs_mosaic", "ratio_warm_vs_mosaic"):
            if key in report["remote"]:
                print(f"{key}: {report['remote'][key]:.2f}")
    print(f"A {n_a} + B {n_b} images, batch {BATCH}, {args.workers} workers; {report['machine']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
