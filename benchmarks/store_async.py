"""The cost of interruptible reads, side by side: the Store's requests (obstore's asynchronous API on the calling
thread's event loop, so that close() and Ctrl-C stop them) against obstore's synchronous calls (the Store's way
before issue 29), on moto's S3 server on loopback.

Two measures, each alternating the two ways in one process, medians [min-max]:

- a 64 MB object streamed to a file through the latency proxy (20 ms a request, 200 MB/s) [MB/s], and the CPU
  time of this process [s];
- 200 range reads of 256 bytes, one after another, straight to the server (no latency: the per-request cost) [ms].

Both ways must give the same bytes; a run whose bytes differ reports no number.

Run: ``python benchmarks/store_async.py [--runs 7]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args(argv)
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    import obstore as obs

    from _servers.loopback import LatencyProxy, s3_server
    from stoker.remote import open_store

    tmp = Path(tempfile.mkdtemp(prefix="stoker-bench-store-"))
    with s3_server("bench-store", environment=False) as s3, LatencyProxy(s3.host, s3.port, latency_ms=20, bandwidth=200e6) as proxy:
        opts = {"endpoint": s3.endpoint, "access_key_id": "a", "secret_access_key": "b", "region": "us-east-1"}
        direct = open_store(s3.url("p/"), opts)
        big, small = os.urandom(64 << 20), os.urandom(1 << 20)
        direct.write("big", big)
        direct.write("small", small)
        slow = open_store(s3.url("p/"), {**opts, "endpoint": proxy.endpoint})

        def sync_download(dest: Path) -> None:
            with open(dest, "wb") as fh:
                for chunk in obs.get(slow._inner, "big").stream(min_chunk_size=256 << 10):
                    fh.write(chunk)

        downloads: dict[str, list[tuple[float, float]]] = {"Store.download (async)": [], "obstore stream (sync)": []}
        reads: dict[str, list[float]] = {"Store.read_range (async)": [], "obstore get_range (sync)": []}
        for run in range(args.runs):
            for name in list(downloads)[:: 1 if run % 2 == 0 else -1]:
                dest = tmp / "big"
                t, c = time.perf_counter(), time.process_time()
                slow.download("big", dest) if name.startswith("Store") else sync_download(dest)
                downloads[name].append(((64 << 20) / (time.perf_counter() - t) / 1e6, time.process_time() - c))
                if dest.read_bytes() != big:
                    raise SystemExit(f"{name}: the bytes differ: no number reported")
            for name in list(reads)[:: 1 if run % 2 == 0 else -1]:
                got = []
                t = time.perf_counter()
                for i in range(200):
                    a, b = i * 256, i * 256 + 256
                    got.append(
                        direct.read_range("small", a, b)
                        if name.startswith("Store")
                        else bytes(obs.get_range(direct._inner, "small", start=a, end=b))
                    )
                reads[name].append((time.perf_counter() - t) / 200 * 1e3)
                if b"".join(got) != small[: 200 * 256]:
                    raise SystemExit(f"{name}: the bytes differ: no number reported")
    for name, values in downloads.items():
        mbs = [v for v, _ in values]
        print(
            f"{name:28} {statistics.median(mbs):6.1f} MB/s [{min(mbs):.1f}-{max(mbs):.1f}], CPU {statistics.median(c for _, c in values):.2f} s"
        )
    for name, ms in reads.items():
        print(f"{name:28} {statistics.median(ms):6.2f} ms a read [{min(ms):.2f}-{max(ms):.2f}]")
    (a, _), (b, _) = ([statistics.median(v for v, _ in values), 0] for values in downloads.values())
    r1, r2 = (statistics.median(v) for v in reads.values())
    print(f"download throughput, async/sync: {a / b:.2f}; time of a small read, async/sync: {r1 / r2:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
