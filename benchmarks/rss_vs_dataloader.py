"""Memory of loading: stoker's Loader (2 threads) against torch's DataLoader (2 worker processes) on the same table.

Writes a table of ``--rows`` rows of 93 float32 + an int label (Otto's shape) and
runs one epoch of each loader in a fresh process, sampling the resident memory
of the process and of its children (RSS and PSS from /proc, every 20 ms):

* ``stoker os_cache=True``: the file memory-mapped (its pages count as the
  process's RSS once read);
* ``stoker os_cache=False``: the bounded cache (see docs/scale.md);
* ``DataLoader``: the arrays loaded in RAM (``np.load``, as users do), a
  ``TensorDataset``-like per-item dataset, 2 worker processes (fork).

Every system must yield the same shapes and dtypes; peak RSS and PSS (PSS
counts pages shared between processes once) are printed as a markdown table.

    python benchmarks/rss_vs_dataloader.py --rows 700000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

CHILD = r"""
import json, sys, time
import numpy as np
which, path, npz = sys.argv[1], sys.argv[2], sys.argv[3]
if which.startswith("stoker"):
    from stoker.loader import Loader, OrderOption
    loader = Loader(path, batch_size=1024, num_workers=2, order=OrderOption.QUASI_RANDOM if which.endswith("False") else OrderOption.RANDOM,
                    seed=0, os_cache=which.endswith("True"))
else:
    import torch
    from torch.utils.data import DataLoader, Dataset
    d = np.load(npz)
    X, y = d["x"], d["y"]
    class Table(Dataset):
        def __len__(self): return len(X)
        def __getitem__(self, i): return X[i], y[i]
    loader = DataLoader(Table(), batch_size=1024, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(0))
print("READY", flush=True)
sys.stdin.readline()
shapes = None
for x, y in loader:
    shapes = shapes or [list(x.shape[1:]), str(x.dtype), str(y.dtype)]
print("DONE " + json.dumps(shapes), flush=True)
sys.stdin.readline()
"""


def _memory(pid: int) -> tuple[int, int]:
    """RSS and PSS in bytes of ``pid`` and its children."""
    pids = [pid]
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            pids += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    except OSError:
        pass
    rss = pss = 0
    for p in set(pids):
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1]) * 1024
        except OSError:
            pass
    return rss, pss


def run(which: str, path: str, npz: str) -> dict[str, float | str]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, which, path, npz], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    proc.stdout.readline()  # READY
    base_rss, base_pss = _memory(proc.pid)
    peak = [base_rss, base_pss]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            r, p = _memory(proc.pid)
            peak[0], peak[1] = max(peak[0], r), max(peak[1], p)
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    t0 = time.perf_counter()
    proc.stdin.write("\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    proc.stdin.write("\n")
    proc.stdin.flush()
    proc.wait()
    return {"system": which, "shapes": line.split(" ", 1)[1].strip(), "seconds": seconds,
            "rss_before": base_rss, "peak_rss": peak[0], "peak_pss": peak[1]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=700_000)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    from stoker.fields import IntField, NDArrayField
    from stoker.format import DatasetWriter

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        rng = np.random.default_rng(0)
        x = rng.poisson(0.6, (args.rows, 93)).astype(np.float32)
        y = rng.integers(0, 9, args.rows)
        path, npz = os.path.join(tmp, "table.stoker"), os.path.join(tmp, "table.npz")
        DatasetWriter(path, {"x": NDArrayField((93,), np.float32), "y": IntField()}, num_workers=1).from_arrays({"x": x, "y": y})
        np.savez(npz, x=x, y=y)
        del x, y
        results = [run(w, path, npz) for w in ("stoker os_cache=True", "stoker os_cache=False", "DataLoader")]
    shapes = {r["shapes"] for r in results}
    print(json.dumps(results, indent=1))
    if len({json.dumps(json.loads(str(s))[:1]) for s in shapes}) != 1:
        raise SystemExit(f"the systems yielded different shapes: {shapes}")
    print(f"\n{args.rows} rows x (93 float32 + int label), batch 1024, one epoch\n")
    print("| system | epoch s | RSS before | peak RSS (all processes) | peak PSS |")
    print("|---|---:|---:|---:|---:|")
    for r in results:
        mb = 1 << 20
        print(
            f"| {r['system']} | {r['seconds']:.2f} | {r['rss_before'] / mb:.0f} MB | {r['peak_rss'] / mb:.0f} MB | {r['peak_pss'] / mb:.0f} MB |"
        )  # type: ignore[operator]


if __name__ == "__main__":
    main()
