"""Object-store clients side by side: fsspec + s3fs against obstore, through a loopback S3 server.

Against moto's S3 server on 127.0.0.1 behind stoker's loopback proxy (20 ms
per request, 200 MB/s shared), measures for each client:

- ``download``: one 64 MB object streamed to a local file [MB/s];
- ``ranges``: 100 range reads (256 B, then 64 KiB) of a 4 MB object from 8 threads: the wall
  time of the 100 [ms] and the median latency of one read [ms];
- ``import``: ``import <client>`` in a fresh interpreter [ms].

Each figure is the median of ``--runs`` runs (min-max in brackets). A third
column measures stoker's own :class:`stoker.remote.Store` (obstore underneath),
to show what the wrapper costs.

    python benchmarks/remote_clients.py [--runs 3] [--size-mb 64]

Needs ``pip install s3fs obstore "moto[server]"``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _servers.loopback import LatencyProxy, s3_server

KEY = "bench/object.bin"
#: the range reads' object: small, since moto reads its whole stored object for every range (300 ms for 64 MB)
SMALL_KEY = "bench/small.bin"
SMALL = 4 << 20


class Obstore:
    name = "obstore"
    module = "obstore"

    def __init__(self, endpoint: str, bucket: str) -> None:
        from obstore.store import S3Store

        self.store = S3Store(bucket, endpoint=endpoint, region="us-east-1", client_options={"allow_http": True})

    def download(self, key: str, dest: Path) -> int:
        import obstore

        n = 0
        with open(dest, "wb") as fh:
            for chunk in obstore.get(self.store, key).stream(min_chunk_size=8 << 20):
                fh.write(chunk)
                n += len(chunk)
        return n

    def read_range(self, key: str, start: int, stop: int) -> bytes:
        import obstore

        return bytes(obstore.get_range(self.store, key, start=start, end=stop))


class StokerStore:
    """stoker.remote's Store (obstore underneath: 256 KiB stream chunks, counted retries)."""

    name = "stoker Store (obstore)"
    module = "stoker.remote._store"

    def __init__(self, endpoint: str, bucket: str) -> None:
        from stoker.remote import open_store

        options = {"endpoint": endpoint, "access_key_id": "testing", "secret_access_key": "testing", "region": "us-east-1"}
        self.store = open_store(f"s3://{bucket}/", options)

    def download(self, key: str, dest: Path) -> int:
        return self.store.download(key, dest)

    def read_range(self, key: str, start: int, stop: int) -> bytes:
        return self.store.read_range(key, start, stop)


class S3fs:
    name = "fsspec+s3fs"
    module = "s3fs"

    def __init__(self, endpoint: str, bucket: str) -> None:
        import s3fs

        self.bucket = bucket
        self.fs = s3fs.S3FileSystem(
            key="testing", secret="testing", endpoint_url=endpoint, client_kwargs={"region_name": "us-east-1"}, skip_instance_cache=True
        )

    def download(self, key: str, dest: Path) -> int:
        self.fs.get_file(f"{self.bucket}/{key}", os.fspath(dest))
        return dest.stat().st_size

    def read_range(self, key: str, start: int, stop: int) -> bytes:
        return bytes(self.fs.cat_file(f"{self.bucket}/{key}", start=start, end=stop))


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):8.1f} [{min(values):.1f}-{max(values):.1f}]"


def _import_ms(module: str) -> float:
    code = f"import time; t = time.perf_counter(); import {module}; print((time.perf_counter() - t) * 1000)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def _ranges(client: Any, size: int, length: int, count: int = 100, threads: int = 8) -> tuple[float, float]:
    starts = [(i * 7919 * 4096) % (size - length) for i in range(count)]

    def one(start: int) -> float:
        t = time.perf_counter()
        data = client.read_range(SMALL_KEY, start, start + length)
        assert len(data) == length
        return time.perf_counter() - t

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        latencies = list(pool.map(one, starts))
    return (time.perf_counter() - t0) * 1000, statistics.median(latencies) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--size-mb", type=int, default=64)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--bandwidth-mb", type=float, default=200.0)
    args = parser.parse_args()
    size = args.size_mb << 20
    payload = os.urandom(size)
    results: dict[str, dict[str, list[float]]] = {}
    with s3_server() as s3, tempfile.TemporaryDirectory() as tmp:
        import obstore
        from obstore.store import S3Store

        direct = S3Store(s3.bucket, endpoint=s3.endpoint, region="us-east-1", client_options={"allow_http": True})
        obstore.put(direct, KEY, payload)
        obstore.put(direct, SMALL_KEY, payload[:SMALL])
        del payload
        with LatencyProxy(s3.host, s3.port, latency_ms=args.latency_ms, bandwidth=args.bandwidth_mb * 1e6) as proxy:
            clients: list[Callable[[str, str], Any]] = [Obstore, S3fs, StokerStore]
            for run in range(args.runs):
                for make in clients[:: 1 if run % 2 == 0 else -1]:  # alternate which goes first
                    client = make(proxy.endpoint, s3.bucket)
                    r = results.setdefault(client.name, {})
                    dest = Path(tmp) / "download.bin"
                    t = time.perf_counter()
                    n = client.download(KEY, dest)
                    r.setdefault("download MB/s", []).append(n / 1e6 / (time.perf_counter() - t))
                    dest.unlink()
                    for length, label in ((256, "256 B"), (64 << 10, "64 KiB")):
                        wall, median = _ranges(client, SMALL, length)
                        r.setdefault(f"100 x {label}: wall ms", []).append(wall)
                        r.setdefault(f"100 x {label}: median ms", []).append(median)
                    r.setdefault("import ms", []).append(_import_ms(make.module))  # type: ignore[attr-defined]
    names = list(results)
    rows = list(results[names[0]])
    print(
        f"latency {args.latency_ms:g} ms/request, {args.bandwidth_mb:g} MB/s, {args.size_mb} MB object, {args.runs} runs: median [min-max]"
    )
    print(f"{'':28s}" + "".join(f"{n:>28s}" for n in names))
    for row in rows:
        print(f"{row:28s}" + "".join(f"{_median(results[n][row]):>28s}" for n in names))


if __name__ == "__main__":
    main()
