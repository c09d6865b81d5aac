"""The time of one reservation in a full shard cache of many entries (issue 43: target under 10 ms at 10^5).

A cache folder is filled with ``--entries`` complete files of one byte (one
4 KiB block each: 400 MB of disk at 10^5), its limit set to what it holds,
and an eviction priority like the loader's (a dict look-up and an array read
per entry) is set. Then each timed step pins one new key (written by a
``fill`` of one byte: no store is asked) and unpins it: a reservation that
must evict one file. Two cases:

* ``alone``: one ShardCache (one process) makes every change;
* ``two processes``: two ShardCache objects on the same folder take turns
  (each has its own descriptors and its own view, as another process would),
  so each finds the other's changes before its reservation.

Usage::

    python benchmarks/cache_reserve.py                  # 10^5 entries, about a minute (most of it making the files)
    python benchmarks/cache_reserve.py --entries 10000
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from stoker.remote import ShardCache, open_store
from stoker.remote._cache_files import entry_name


def _one_byte(path: Path) -> int:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, b"x")
    finally:
        os.close(fd)
    return 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    store = open_store("http://127.0.0.1:9/none/")  # never asked: every file comes from a fill
    with tempfile.TemporaryDirectory(prefix="stoker-reserve-") as tmp:
        directory = ShardCache(store, tmp, limit=None).directory
        t = time.perf_counter()
        for i in range(args.entries):
            with open(directory / entry_name(f"s{i:07d}", "1"), "wb") as fh:
                fh.write(b"x")
        print(f"made {args.entries} files in {time.perf_counter() - t:.1f} s")
        cache = ShardCache(store, tmp, limit=None)  # (made after the files, as a process that finds a full cache)
        names = [f"s{i:07d}" for i in range(args.entries)] + [f"n{i:07d}" for i in range(4 * args.repeat)]
        index = {name: k for k, name in enumerate(names)}
        next_use = np.random.default_rng(0).permutation(len(names)).astype(np.int64)

        def priority(key: str, ident: str) -> float:  # the shape of RemoteShards._priority
            k = index.get(key)
            if k is None or ident != "1":
                return float("-inf")
            return -float(next_use[k])

        other = ShardCache(store, tmp, limit=None)
        for c in (cache, other):
            c.set_priority(priority)
        t = time.perf_counter()
        used = cache.usage_bytes()
        print(f"first usage_bytes (a full look at the folder): {1e3 * (time.perf_counter() - t):.1f} ms, {used} bytes")
        n = 0
        for label, caches in (("alone", [cache]), ("two processes", [cache, other])):
            for c in (cache, other):
                c.limit = used  # full: every reservation evicts one file
            times = []
            for r in range(args.repeat):
                c = caches[r % len(caches)]
                key = f"n{n:07d}"
                n += 1
                t = time.perf_counter()
                c.pin(key, 1, "1", fill=_one_byte)
                times.append(time.perf_counter() - t)
                c.unpin(key, "1")
            print(
                f"{label}: one reservation (pin of a new key, evicting one file) with {args.entries} entries: "
                f"median {1e3 * statistics.median(times):.2f} ms, max {1e3 * max(times):.2f} ms over {args.repeat}"
            )
        print(f"evictions: {cache.stats()['evictions'] + other.stats()['evictions']:g}")


if __name__ == "__main__":
    main()
