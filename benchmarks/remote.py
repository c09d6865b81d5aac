"""Streaming from object storage, side by side: stoker from a loopback S3 store vs stoker from local disk vs Mosaic streaming.

The store is moto's S3 server on loopback, behind a proxy that adds a latency
to every request and caps the bandwidth (default 20 ms, 200 MB/s): both run in
a child process, so that the loaders measured do not share this process's GIL
with them. The task is decode-bound: about 500x375 JPEGs (q90, as scenario C of
``benchmarks/images.py``) -> a random resized crop to 224 + flip -> uint8 NCHW,
batch 64, ``QUASI_RANDOM`` order, 2 threads (stoker) or 2 worker processes
(Mosaic, under torch's DataLoader, decoding with Pillow as its users do).

Per system and run: the time to the first batch (from building the loader,
manifest and shard heads included, with an empty cache), the throughput of the
first (cold) epoch and of the second (warm) epoch [images/s], the bytes
downloaded and the cache's peak size. Both stoker and Mosaic get the same
cache limit (``--cache-fraction`` of the dataset's bytes). Every batch's
shape and dtype are checked; a system whose batches differ reports no number.

Mosaic streaming runs in an environment of its own (``benchmarks/mosaic/``;
``--mosaic`` sets it up on first use: it needs about 1 GB).

Run: ``python benchmarks/remote.py [--images 3000] [--runs 3] [--mosaic] [--split-cpus] [--out DIR]``.
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

BATCH = 64
SHAPE = (BATCH, 3, 224, 224)


# ---- the store, in a child process ---------------------------------------------------------------
def serve(latency_ms: float, bandwidth: float) -> None:
    """The child: moto's S3 server and the latency proxy; prints their endpoints, runs until stdin closes."""
    from _servers import loopback

    if os.environ.get("STOKER_BENCH_STORE_CPUS"):  # --split-cpus: the store on its own CPU, set before its threads start
        os.sched_setaffinity(0, {int(c) for c in os.environ["STOKER_BENCH_STORE_CPUS"].split(",")})
    with loopback.s3_server("bench") as s3, loopback.LatencyProxy(s3.host, s3.port, latency_ms=latency_ms, bandwidth=bandwidth) as proxy:
        print(json.dumps({"direct": s3.endpoint, "proxy": proxy.endpoint}), flush=True)
        sys.stdin.read()


class Store:
    """The child process serving the store; ``direct`` (no latency, for uploads) and ``proxy`` endpoints."""

    def __init__(self, latency_ms: float, bandwidth: float, cpus: set[int] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(latency_ms), str(bandwidth)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "STOKER_BENCH_STORE_CPUS": ",".join(map(str, sorted(cpus or ())))},
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the loopback store did not start (is moto[server] installed? pip install -e '.[test]')")
        ends = json.loads(line)
        self.direct, self.proxy = ends["direct"], ends["proxy"]
        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_REGION="us-east-1")

    def cpu_seconds(self) -> float:
        """CPU time the store's process (moto and the proxy, all threads) has used so far [s]: taken from this machine's
        cores, which a real remote store would not take."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(60)


def upload(folder: Path, url: str, endpoint: str) -> None:
    from stoker.dataset._manifest import MANIFEST_NAME
    from stoker.remote._store import open_store

    store = open_store(url, {"endpoint": endpoint})
    for path in sorted(folder.iterdir()):
        if path.suffix == ".stoker":
            store.upload(path.name, path)
    store.upload(MANIFEST_NAME, folder / MANIFEST_NAME)


# ---- data ----------------------------------------------------------------------------------------
def build(out: Path, n: int, shard_bytes: int) -> Path:
    """``n`` photo-like JPEGs (scenario C's) as a folder of shards of about ``shard_bytes``."""
    from images import DATASETS
    from stoker.dataset.sharded import ShardedReader
    from stoker.dataset.shards import ShardedWriter
    from stoker.errors import StokerError
    from stoker.fields import IntField, RGBImageField

    folder = out / f"photos-{n}-shards"
    try:
        with ShardedReader(folder) as reader:
            if len(reader) == n:
                return folder
    except (StokerError, OSError):
        pass
    shutil.rmtree(folder, ignore_errors=True)
    fields = {"image": RGBImageField(write_mode="jpg", jpeg_quality=90), "label": IntField()}
    ShardedWriter(folder, fields, bytes_per_shard=shard_bytes, num_workers=2).from_indexed_dataset(DATASETS["C"][1](n))
    return folder


def pipelines() -> dict[str, Any]:
    from stoker.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from stoker.transforms import RandomHorizontalFlip, Squeeze, ToTensor, ToTorchImage

    return {
        "image": [RandomResizedCropRGBImageDecoder((224, 224)), RandomHorizontalFlip(), ToTensor(), ToTorchImage(channels_last=False)],
        "label": [IntDecoder(), ToTensor(), Squeeze()],
    }


# ---- one system ------------------------------------------------------------------------------------
def _check(batch: Any, who: str, n_last: int) -> int:
    images, labels = batch[0], batch[1]
    if tuple(images.shape[1:]) != SHAPE[1:] or str(images.dtype) != "torch.uint8" or images.shape[0] not in (BATCH, n_last):
        raise SystemExit(f"{who}: a batch of {tuple(images.shape)} {images.dtype}; expected {SHAPE} uint8: no number reported")
    if labels.shape[0] != images.shape[0]:
        raise SystemExit(f"{who}: {labels.shape[0]} labels for {images.shape[0]} images")
    return int(images.shape[0])


def warm_up(photos: Path, workers: int) -> None:
    """Compile the pipelines once (Numba), so that no system's first batch pays for it."""
    from stoker import Loader

    for os_cache in (True, False):
        with Loader(str(photos), batch_size=BATCH, num_workers=workers, pipelines=pipelines(), os_cache=os_cache) as loader:
            for k, _ in enumerate(loader):
                if k == 2:
                    break


def run_stoker(source: str, n: int, cache_dir: Path | None, limit: int | None, workers: int, endpoint: str | None,
               os_cache: bool = True) -> dict[str, Any]:  # fmt: skip
    """Two epochs; the clock starts before the Loader is built (the first batch includes opening the dataset)."""
    from stoker import Loader, OrderOption

    remote: dict[str, Any] = {"os_cache": os_cache}
    if cache_dir is not None:
        shutil.rmtree(cache_dir, ignore_errors=True)
        remote = {"cache_dir": cache_dir, "cache_limit": limit, "storage_options": {"endpoint": endpoint}}  # (os_cache: always bounded)
    t0 = time.perf_counter()
    loader = Loader(source, batch_size=BATCH, num_workers=workers, order=OrderOption.QUASI_RANDOM, seed=0, pipelines=pipelines(), **remote)
    out: dict[str, Any] = {}
    peak = 0
    first_at, first_images = t0, 0
    try:
        for epoch in range(2):
            start = time.perf_counter() if epoch else t0
            seen = 0
            for batch in loader:
                if seen == 0 and epoch == 0:
                    first_at = time.perf_counter()
                    out["first_batch_s"] = first_at - t0
                seen += _check(batch, "stoker", n % BATCH or BATCH)
                if epoch == 0 and first_images == 0:
                    first_images = seen
                if loader.remote is not None and seen % (8 * BATCH) == 0:
                    peak = max(peak, loader.remote.cache.usage_bytes())
            if seen != n:
                raise SystemExit(f"stoker: {seen} images in epoch {epoch}; expected {n}")
            end = time.perf_counter()
            out["cold_ips" if epoch == 0 else "warm_ips"] = n / (end - start)
            if epoch == 0:  # the epoch's throughput after its first batch: without the start (opening, first download)
                out["cold_after_first_ips"] = (n - first_images) / (end - first_at)
        if loader.remote is not None:
            stats = loader.remote.stats()
            out.update(bytes_downloaded=stats["bytes_downloaded"], cache_peak_bytes=max(peak, stats["cache_peak_bytes"]),
                       retries=stats.get("retries", 0.0))  # fmt: skip
    finally:
        loader.close()
    return out


def run_mosaic(out_dir: Path, photos: Path, store: Store, limit: int, workers: int, n: int, shard_bytes: int,
               block: int | None = None) -> dict[str, Any]:  # fmt: skip
    """Mosaic streaming in its own environment (benchmarks/mosaic/), on the same JPEG bytes written as MDS shards.

    ``block``: Mosaic's ``shuffle_block_size`` [samples]; ``None``: its default, which spans the whole of a small
    dataset (a global shuffle: with a cache smaller than the dataset every batch may need another shard).
    """
    mosaic = HERE / "mosaic"
    python = mosaic / ".venv" / "bin" / "python"
    subprocess.run(["bash", str(mosaic / "setup_env.sh")], check=True, capture_output=True)  # a few seconds once made
    remote = "s3://bench/photos-mds/"
    if not getattr(store, "mds_written", False):
        raw = out_dir / f"mds-input-{n}"
        export_jpegs(photos, raw)
        subprocess.run([str(python), str(mosaic / "write_mds.py"), "--input", str(raw), "--remote", remote, "--endpoint", store.direct,
                        "--shard-mb", str(max(1, shard_bytes >> 20))], check=True, capture_output=True, text=True)  # fmt: skip
        store.mds_written = True  # type: ignore[attr-defined]
    cmd = [str(python), str(mosaic / "run_mosaic.py"), "--remote", remote, "--endpoint", store.proxy, "--cache-dir",
           str(out_dir / "mosaic-cache"), "--cache-limit", str(limit), "--batch-size", str(BATCH), "--workers", str(workers),
           "--epochs", "2", "--crop", "224"] + (["--shuffle-block-size", str(block)] if block else [])  # fmt: skip
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    batch = got.get("batch", {})
    if (
        list(batch.get("shape", []))[1:] != list(SHAPE[1:])
        or batch.get("dtype") != "uint8"
        or batch.get("labels_shape", [0])[0] != batch["shape"][0]
    ):
        raise SystemExit(f"mosaic: batches of {batch}; expected {SHAPE} uint8 with one label each: no number reported")
    if any(e["images"] != n for e in got["epochs"]):
        raise SystemExit(f"mosaic: epochs of {[e['images'] for e in got['epochs']]} images; expected {n}: no number reported")
    return {"first_batch_s": got["first_batch_s"], "cold_ips": got["cold_images_per_s"], "warm_ips": got["warm_images_per_s"],
            "cold_after_first_ips": got["cold_after_first_images_per_s"],
            "bytes_downloaded": got["bytes_downloaded"], "cache_peak_bytes": got["peak_cache_bytes"],
            "cache_limit_held": float(bool(got.get("cache_limit_held")))}  # fmt: skip


def export_jpegs(photos: Path, raw: Path) -> None:
    """The stoker shards' JPEG bytes and labels, in the input format of ``benchmarks/mosaic/write_mds.py``."""
    import importlib.util

    from stoker.dataset.sharded import ShardedReader

    spec = importlib.util.spec_from_file_location("write_mds", HERE / "mosaic" / "write_mds.py")
    assert spec is not None and spec.loader is not None
    write_mds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(write_mds)
    blobs, labels = [], []
    with ShardedReader(photos) as reader:
        for sh in reader.shards:
            meta = sh.metadata
            for row in meta:
                blobs.append(bytes(sh.storage[int(row["image/ptr"]) : int(row["image/ptr"]) + int(row["image/size"])]))
                labels.append(int(row["label/value"]))
    write_mds.save_blobs(raw, blobs, labels)


# ---- report --------------------------------------------------------------------------------------
def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = sorted({k for r in runs for k in r if isinstance(r[k], (int, float))})
    return {k: {"median": statistics.median(r[k] for r in runs if k in r), "min": min(r[k] for r in runs if k in r),
                "max": max(r[k] for r in runs if k in r)} for k in keys}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serve", nargs=2, type=float, help=argparse.SUPPRESS)
    ap.add_argument("--images", type=int, default=3000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--bandwidth", type=float, default=200e6, help="[bytes/s]")
    ap.add_argument("--shard-bytes", type=int, default=16 << 20)
    ap.add_argument("--cache-fraction", type=float, default=0.5, help="the cache limit, as a fraction of the dataset's bytes")
    ap.add_argument("--mosaic", action="store_true", help="also run Mosaic streaming (its own environment, benchmarks/mosaic/)")
    ap.add_argument("--mosaic-default-runs", type=int, default=1, help="runs of Mosaic with its default shuffle block (slow)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "stoker-bench-remote")
    ap.add_argument(
        "--split-cpus",
        action="store_true",
        help="run the store on this process's last CPU and every system (and its workers) on the others, as if the store's "
        "CPU were elsewhere, as it is for a real store (--workers is then the number of the others)",
    )
    args = ap.parse_args(argv)
    if args.serve:
        serve(*args.serve)
        return 0
    store_cpus: set[int] | None = None
    if args.split_cpus:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise SystemExit("--split-cpus needs at least 2 CPUs")
        store_cpus = {cpus[-1]}
        os.sched_setaffinity(0, set(cpus[:-1]))  # before any thread starts: the loaders' threads inherit it
        args.workers = len(cpus) - 1
    args.out.mkdir(parents=True, exist_ok=True)
    photos = build(args.out, args.images, args.shard_bytes)
    total = sum(p.stat().st_size for p in photos.glob("*.stoker"))
    shard = max(p.stat().st_size for p in photos.glob("*.stoker"))
    limit = max(int(total * args.cache_fraction), 4 * shard)
    store = Store(args.latency_ms, args.bandwidth, store_cpus)
    url = "s3://bench/photos/"
    results: dict[str, list[dict[str, Any]]] = {
        "stoker_local": [],
        "stoker_local_bounded": [],
        "stoker_remote": [],
        "mosaic_shard_blocks": [],
        "mosaic_default": [],
    }
    try:
        upload(photos, url, store.direct)
        warm_up(photos, args.workers)
        for run in range(args.runs):
            print(f"run {run + 1}/{args.runs}", file=sys.stderr, flush=True)
            results["stoker_local"].append(run_stoker(str(photos), args.images, None, None, args.workers, None))
            results["stoker_local_bounded"].append(run_stoker(str(photos), args.images, None, None, args.workers, None, os_cache=False))
            before = store.cpu_seconds()
            results["stoker_remote"].append(run_stoker(url, args.images, args.out / "cache", limit, args.workers, store.proxy))
            results["stoker_remote"][-1]["store_cpu_s"] = store.cpu_seconds() - before
            if args.mosaic:  # with a shuffle block of one shard's samples, as stoker's windows; and (first runs) Mosaic's default
                per_shard = -(-args.images // len(list(photos.glob("*.stoker"))))
                for name, block in (("mosaic_shard_blocks", per_shard), ("mosaic_default", None)):
                    if block is None and run >= args.mosaic_default_runs:
                        continue
                    before = store.cpu_seconds()
                    results[name].append(run_mosaic(args.out, photos, store, limit, args.workers, args.images, args.shard_bytes, block))
                    results[name][-1]["store_cpu_s"] = store.cpu_seconds() - before
    finally:
        store.close()
    table = {name: summary(runs) for name, runs in results.items() if runs}
    local, remote = table["stoker_local"], table["stoker_remote"]
    ratios = {
        "remote_cold_vs_local": remote["cold_ips"]["median"] / local["cold_ips"]["median"],
        "remote_warm_vs_local": remote["warm_ips"]["median"] / local["warm_ips"]["median"],
        "remote_cold_after_first_vs_local": remote["cold_after_first_ips"]["median"] / local["cold_after_first_ips"]["median"],
        "remote_cold_vs_local_bounded": remote["cold_ips"]["median"] / table["stoker_local_bounded"]["cold_ips"]["median"],
        "first_batch_s": remote["first_batch_s"]["median"],
        "one_shard_download_s": shard / args.bandwidth + args.latency_ms / 1000,
    }
    for name in ("mosaic_shard_blocks", "mosaic_default"):
        if name in table:
            ratios[f"remote_cold_vs_{name}_cold"] = remote["cold_ips"]["median"] / table[name]["cold_ips"]["median"]
            ratios[f"remote_warm_vs_{name}_warm"] = remote["warm_ips"]["median"] / table[name]["warm_ips"]["median"]
            ratios[f"remote_cold_after_first_vs_{name}"] = (
                remote["cold_after_first_ips"]["median"] / table[name]["cold_after_first_ips"]["median"]
            )
    report = {
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "images": args.images, "dataset_bytes": total, "shard_bytes_max": shard, "cache_limit": limit,
        "latency_ms": args.latency_ms, "bandwidth": args.bandwidth, "split_cpus": args.split_cpus, "workers": args.workers, "runs": results, "summary": table, "ratios": ratios,
    }  # fmt: skip
    (args.out / "remote.json").write_text(json.dumps(report, indent=1))
    print(
        f"{'system':16} {'first batch s':>14} {'cold img/s':>18} {'after 1st img/s':>18} {'warm img/s':>18} {'downloaded MB':>14} {'peak cache MB':>14} {'store CPU s':>12}"
    )
    for name, s in table.items():

        def cell(key: str, scale: float = 1.0, s: dict[str, Any] = s) -> str:
            if key not in s:
                return "-"
            v = s[key]
            return f"{v['median'] / scale:.0f} [{v['min'] / scale:.0f}-{v['max'] / scale:.0f}]" if scale != 1 or v["median"] > 10 else (
                f"{v['median']:.2f} [{v['min']:.2f}-{v['max']:.2f}]"
            )  # fmt: skip

        print(f"{name:20} {cell('first_batch_s'):>14} {cell('cold_ips'):>18} {cell('cold_after_first_ips'):>18} {cell('warm_ips'):>18} "
              f"{cell('bytes_downloaded', 1e6):>14} {cell('cache_peak_bytes', 1e6):>14} {cell('store_cpu_s'):>12}")  # fmt: skip
    print(json.dumps(ratios, indent=1))
    print(f"dataset {total / 1e6:.0f} MB in {len(list(photos.glob('*.stoker')))} shards, cache limit {limit / 1e6:.0f} MB; "
          f"{args.latency_ms:.0f} ms, {args.bandwidth / 1e6:.0f} MB/s; {args.workers} workers"
          f"{'; the store on its own CPU' if args.split_cpus else ''}; {report['machine']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
