"""What checking every data block against its CRC-32 costs (``Loader(check_data=True)``, the default) on Otto.

Two measurements, side by side:

* steady state: two Loaders of the same file, ``check_data=True`` and ``check_data=False``, one epoch each per round,
  interleaved, medians (after their first epochs);
* the first epoch: fresh processes (Numba's cache warm), alternating ``check_data=True`` / ``check_data=False``, the first
  epoch's time in each (the check CRCs every block the epoch reads, once per process).

Every batch's shapes and dtypes are checked, and both loaders must yield the same batches.

Run: ``python benchmarks/verify_cost.py [--rounds 40] [--processes 3] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

_FIRST_EPOCH = """
import sys, time
from stoker.loader import Loader, OrderOption
t0 = time.perf_counter()
loader = Loader(sys.argv[1], batch_size=1024, num_workers=2, order=OrderOption.RANDOM, seed=0, drop_last=True,
                check_data=sys.argv[2] == "1")
n = sum(x.shape[0] for x, _ in loader)
print(time.perf_counter() - t0, n)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    args = parser.parse_args()

    from stoker.bench.data import OTTO_FEATURES, OTTO_SAMPLES, write_otto
    from stoker.loader import Loader, OrderOption

    otto = write_otto(args.out, OTTO_SAMPLES, 0)
    common: dict[str, Any] = dict(batch_size=1024, num_workers=2, order=OrderOption.RANDOM, seed=0, drop_last=True)
    loaders = {"verify": Loader(str(otto.path), check_data=True, **common), "no_verify": Loader(str(otto.path), check_data=False, **common)}
    epochs = {name: [[(x.numpy().copy(), y.numpy().copy()) for x, y in loader]] for name, loader in loaders.items()}
    for (xa, ya), (xb, yb) in zip(epochs["verify"][0], epochs["no_verify"][0], strict=True):
        if xa.shape != (1024, OTTO_FEATURES) or xa.dtype != np.float32 or not (np.array_equal(xa, xb) and np.array_equal(ya, yb)):
            raise SystemExit("check_data=True and check_data=False yielded different batches")
    times: dict[str, list[float]] = {name: [] for name in loaders}
    for _ in range(args.rounds):
        for name, loader in loaders.items():
            t0 = time.perf_counter()
            n = sum(x.shape[0] for x, _ in loader)
            times[name].append(time.perf_counter() - t0)
            if n != len(otto.y) // 1024 * 1024:
                raise SystemExit(f"{name}: an epoch yielded {n} samples")
    steady = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    first: dict[str, list[float]] = {"verify": [], "no_verify": []}
    for _ in range(args.processes):
        for name, flag in (("verify", "1"), ("no_verify", "0")):
            out = subprocess.run([sys.executable, "-c", _FIRST_EPOCH, str(otto.path), flag], capture_output=True, text=True, check=True)
            first[name].append(float(out.stdout.split()[0]))
    result = {
        "steady_median_epoch_ms": steady,
        "steady_throughput_ratio": steady["no_verify"] / steady["verify"],
        "first_epoch_s": first,
        "first_epoch_extra_s_median": statistics.median(first["verify"]) - statistics.median(first["no_verify"]),
        "file_bytes": otto.file_bytes,
    }
    print(json.dumps(result, indent=1))
    for loader in loaders.values():
        loader.close()


if __name__ == "__main__":
    sys.exit(main())
