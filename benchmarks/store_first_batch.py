"""Where the store's first batch goes: every request and the Python time between them, from ``Loader("s3://...")``.

The store is the one of ``benchmarks/remote.py`` (moto's S3 server behind the
latency/bandwidth proxy, in a child process; default 20 ms a request, 200 MB/s).
Two datasets: a table (an ``NDArrayField`` of 32 floats, an int, a float) and
the photos of ``benchmarks/remote.py`` (its JPEGs, its crop pipeline), each in
shards. Every pipeline is compiled once first (warm compile caches), then per
run, with an empty shard cache: the clock starts before ``Loader()`` and stops
at the first batch. Every store request made in between is recorded (kind,
object, range, start and end, thread), and so are the open path's phases
(manifest, heads, the reader, the schedule, each shard a batch waits for).

``--only mix``: a weighted mix (``Loader([Stream(...), ...])``) of ``--mix-rows`` tables (default three of 60,000,
40,000 and 30,000 rows, in shards of ``--table-shard-bytes``), each in its own folder of the store.

Run: ``python benchmarks/store_first_batch.py [--runs 3] [--trace] [--open-only] [--only table|photos|mix] [--json FILE]``
(``--open-only``: no Loader, no compiled code: the open path and the first batch's shard alone; not for ``mix``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import remote as bench_remote  # noqa: E402 - benchmarks/remote.py: the store's child process, the photos

EVENTS: list[tuple[str, str, float, float, str]] = []  # (kind, what, start, end, thread)
_T0 = [0.0]


def _traced(kind: str, describe: Any) -> Any:
    def wrap(fn: Any) -> Any:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                EVENTS.append((kind, describe(*args, **kwargs), t - _T0[0], time.perf_counter() - _T0[0], threading.current_thread().name))

        return inner

    return wrap


def install_trace() -> None:
    """Record every store request and the open path's phases (EVENTS)."""
    from stoker.dataset import _remote, _remote_schedule, _store_reader
    from stoker.remote import _store

    S = _store.Store
    S.read = _traced("GET", lambda self, key, *a, **k: f"{key} (whole)")(S.read)
    S.read_range_sized = _traced("GET", lambda self, key, a, b: f"{key} [{a}, {b})")(S.read_range_sized)
    S.size = _traced("HEAD", lambda self, key: key)(S.size)
    S.download = _traced("GET", lambda self, key, *a, **k: f"{key} (download)")(S.download)
    R = _remote.RemoteManifest
    R.__init__ = _traced("phase", lambda *a, **k: "manifest (open the store, read and parse)")(R.__init__)
    RS = _remote.RemoteShards
    RS.open_heads = _traced("phase", lambda *a, **k: "heads at open (the first; all without the manifest's head records)")(RS.open_heads)
    if hasattr(RS, "head"):
        RS.head = _traced("phase", lambda self, k, *a, **kw: f"head of shard {k}")(RS.head)
    _remote.check_limit = _traced("phase", lambda *a, **k: "check_limit")(_remote.check_limit)
    SR = _store_reader.StoreReader
    SR.__init__ = _traced("phase", lambda *a, **k: "StoreReader() (heads, layout)")(SR.__init__)
    SS = _remote_schedule.ShardSchedule
    SS.schedule = _traced("phase", lambda *a, **k: "schedule()")(SS.schedule)
    SS.begin = _traced("phase", lambda self, k: f"begin({k}): shard {k} for a batch")(SS.begin)


def build_table(out: Path, n: int, shard_bytes: int) -> Path:
    import numpy as np

    from stoker.dataset.sharded import ShardedReader
    from stoker.dataset.shards import write_shards
    from stoker.errors import StokerError
    from stoker.fields import FloatField, IntField, NDArrayField

    folder = out / f"table-{n}-{shard_bytes}"
    try:
        with ShardedReader(folder) as reader:
            if len(reader) == n:
                return folder
    except (StokerError, OSError):
        pass
    shutil.rmtree(folder, ignore_errors=True)
    rng = np.random.default_rng(0)
    fields = {"x": NDArrayField(np.dtype("float32"), (32,)), "label": IntField(), "w": FloatField()}
    arrays = {"x": rng.normal(size=(n, 32)).astype(np.float32), "label": np.arange(n, dtype=np.int64), "w": rng.random(n)}
    per_shard = max(1, shard_bytes // 150)
    write_shards(folder, fields, arrays, samples_per_shard=per_shard, num_workers=1, progress=False)
    return folder


def table_pipelines() -> dict[str, Any]:
    from stoker.decoders import FloatDecoder, IntDecoder, NDArrayDecoder
    from stoker.transforms import ToTensor

    return {"x": [NDArrayDecoder(), ToTensor()], "label": [IntDecoder(), ToTensor()], "w": [FloatDecoder(), ToTensor()]}


def mix_streams(urls: list[str]) -> list[Any]:
    """The mix's streams: one per table, weighted 3:2:1... (the first the heaviest)."""
    from stoker import Stream

    return [Stream(url, weight=float(len(urls) - i), name=f"t{i}") for i, url in enumerate(urls)]


def first_batch(url: str | list[Any], pipelines: Any, cache: Path, endpoint: str, workers: int) -> float:
    """Seconds from ``Loader(url)`` (a URL, or a mix's streams) to its first batch, with an empty shard cache."""
    from stoker import Loader, OrderOption

    shutil.rmtree(cache, ignore_errors=True)
    EVENTS.clear()
    _T0[0] = t0 = time.perf_counter()
    loader = Loader(url, batch_size=64, num_workers=workers, order=OrderOption.QUASI_RANDOM, seed=0, pipelines=pipelines,
                    cache_dir=cache, storage_options={"endpoint": endpoint})  # fmt: skip
    EVENTS.append(("phase", "Loader() returned", 0.0, time.perf_counter() - t0, threading.current_thread().name))
    try:
        it = iter(loader)
        next(it)
        took = time.perf_counter() - t0
        EVENTS.append(("phase", "first batch", 0.0, took, threading.current_thread().name))
    finally:
        loader.close()
    return took


def open_and_first_shard(url: str, cache: Path, endpoint: str) -> tuple[float, float]:
    """Without a Loader (no compiled code): the open path (manifest, heads, the reader), then the first batch's shard as a
    batch gets it, with the schedule's downloads ahead running (SEQUENTIAL order). Seconds to each, from the start."""
    import numpy as np

    from stoker.dataset.sharded import open_dataset

    shutil.rmtree(cache, ignore_errors=True)
    EVENTS.clear()
    _T0[0] = t0 = time.perf_counter()
    reader: Any = open_dataset(url, storage_options={"endpoint": endpoint}, cache_dir=cache)
    try:
        opened = time.perf_counter() - t0
        reader.schedule(np.arange(len(reader), dtype=np.int64), 64)
        reader.release(reader.acquire(np.arange(64, dtype=np.int64)))  # the first batch's bytes: its shard downloaded
        first = time.perf_counter() - t0
    finally:
        reader.close()
    EVENTS.append(("phase", "opened", 0.0, opened, "main"))
    EVENTS.append(("phase", "first batch's bytes", 0.0, first, "main"))
    return opened, first


def show(events: list[tuple[str, str, float, float, str]]) -> None:
    for kind, what, a, b, thread in sorted(events, key=lambda e: (e[2], e[3])):
        print(f"  {a * 1000:8.1f} .. {b * 1000:8.1f} ms  {kind:5} {what}  [{thread}]")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--bandwidth", type=float, default=200e6)
    ap.add_argument("--images", type=int, default=3000)
    ap.add_argument("--rows", type=int, default=400_000)
    ap.add_argument("--shard-bytes", type=int, default=16 << 20, help="the photos' shards [bytes]")
    ap.add_argument("--table-shard-bytes", type=int, default=4 << 20, help="the table's shards [bytes]")
    ap.add_argument("--trace", action="store_true", help="print every request and phase of the last run")
    ap.add_argument("--only", choices=["table", "photos", "mix"], default=None, help="one set (default: table and photos)")
    ap.add_argument("--mix-rows", type=int, nargs="+", default=[60_000, 40_000, 30_000], help="the mix's tables [rows]")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "stoker-bench-remote")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--open-only", action="store_true", help="no Loader: the open path and the first batch's shard (see open_and_first_shard)"
    )
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    install_trace()
    sets = {}
    if args.only in (None, "table"):
        sets["table"] = (build_table(args.out, args.rows, args.table_shard_bytes), table_pipelines)
    if args.only in (None, "photos"):
        sets["photos"] = (bench_remote.build(args.out, args.images, args.shard_bytes), bench_remote.pipelines)
    if args.only == "mix":
        sets["mix"] = ([build_table(args.out, n, args.table_shard_bytes) for n in args.mix_rows], table_pipelines)  # type: ignore[assignment]
    store = bench_remote.Store(args.latency_ms, args.bandwidth)
    results: dict[str, Any] = {"load_average_before": os.getloadavg()}
    try:
        from stoker import Loader

        for name, (folder, pipelines) in sets.items():
            folders = folder if isinstance(folder, list) else [folder]
            urls = [f"s3://bench/{name}/"] if len(folders) == 1 else [f"s3://bench/{name}-{i}/" for i in range(len(folders))]
            for where, url in zip(folders, urls):
                bench_remote.upload(where, url, store.direct)
            source: Any = urls[0] if len(folders) == 1 else mix_streams(urls)
            folder = folders[0]  # (the compile's warm-up reads the first)
            if args.open_only:
                if len(folders) > 1:
                    raise SystemExit("--open-only is for one dataset (table or photos), not a mix")
                runs = [open_and_first_shard(urls[0], args.out / "cache", store.proxy) for _ in range(args.runs + 1)][1:]
                gets = sum(1 for e in EVENTS if e[0] in ("GET", "HEAD") and e[2] < runs[-1][1])
                results[name] = {"shards": len(list(folder.glob("*.stoker"))), "open_s": [r[0] for r in runs],
                                 "first_bytes_s": [r[1] for r in runs], "requests_last_run": gets, "events_last_run": list(EVENTS)}  # fmt: skip
                print(f"{name}: open {', '.join(f'{r[0]:.3f}' for r in runs)} s; first batch's bytes {', '.join(f'{r[1]:.3f}' for r in runs)} s; "
                      f"{gets} requests (last run)")  # fmt: skip
                if args.trace:
                    show(EVENTS)
                continue
            for os_cache in (True, False):  # compile once: warm caches for every run
                with Loader(str(folder), batch_size=64, num_workers=args.workers, pipelines=pipelines(), os_cache=os_cache) as loader:
                    for k, _ in enumerate(loader):
                        if k == 2:
                            break
            first_batch(source, pipelines(), args.out / "cache", store.proxy, args.workers)  # (the first open's imports)
            times = []
            for _ in range(args.runs):
                times.append(first_batch(source, pipelines(), args.out / "cache", store.proxy, args.workers))
            shards = sum(len(list(f.glob("*.stoker"))) for f in folders)
            gets = sum(1 for e in EVENTS if e[0] in ("GET", "HEAD") and e[2] < times[-1])
            ranged = sum(1 for e in EVENTS if e[0] == "GET" and e[1].endswith(")") and "[" in e[1] and e[2] < times[-1])  # (heads)
            results[name] = {"shards": shards, "first_batch_s": times, "median_s": statistics.median(times), "requests_last_run": gets,
                             "ranged_requests_last_run": ranged, "events_last_run": list(EVENTS)}  # fmt: skip
            print(f"{name}: {shards} shards; first batch {', '.join(f'{t:.3f}' for t in times)} s (median {statistics.median(times):.3f}); "
                  f"{gets} store requests before it, {ranged} of them ranged (heads) (last run)")  # fmt: skip
            if args.trace:
                show(EVENTS)
    finally:
        store.close()
    results["load_average_after"] = os.getloadavg()
    print(f"load average before {results['load_average_before']}, after {results['load_average_after']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
