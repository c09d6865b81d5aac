"""Otto: the pipelines users write against the default ones and the compiled gather, epochs interleaved.

Systems, each run for ``--block`` epochs in a row per round, round after round (the
systems' order reversed every other round), in one process (so that a busy machine
slows them alike), and compared by their median epoch back to back (the epochs of a
block after its first), as a training job runs its one loader:

* ``compiled_gather``: the one-thread compiled limit (:class:`stoker.bench.baselines.CompiledGather`);
* ``default``: ``Loader`` with its default pipelines (decoder, ``ToTensor()``);
* ``seed000``: seed 000's pipelines as its notebook writes them: ``NDArrayDecoder(), ToTensor(),
  ToDevice("cpu")`` and ``IntDecoder(), ToTensor(), ToDevice("cpu"), Squeeze()`` (FFCV's label pipeline).

Every batch's shapes and dtypes are checked, and every epoch's labels must be the
dataset's labels (as a multiset) before a number is reported.

Why blocks: interleaved one epoch at a time, each system's epoch follows the others',
which have pushed its data out of the CPU's caches; the two loaders read the same
file (the same page-cache pages), the gather its own copy in memory, so the gather
paid more for it: 4.2 ms an epoch interleaved against 2.2 ms back to back, the
loaders 3.2-3.5 against 2.4-2.7 ms (2026-12-03; an interleaved run said 1.15x-1.18x
where back to back is 0.85x-0.92x). The first epoch of each block (after another
system's) is reported too (``first_in_block_epoch_ms``).

Run: ``python benchmarks/otto_pipelines.py [--rounds 12] [--block 5] [--workers 2] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--block", type=int, default=5, help="epochs of each system in a row per round (>= 2)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    args = parser.parse_args()
    # the rounds compare compiled epochs: the warm-up epoch compiles each loader's producer loop before the rounds
    # (by default a loader whose loop is not cached yet makes its epochs with Python producers while the loop
    # compiles in the background, which a short run would time instead: seen at 0.43x the gather on an empty cache)
    os.environ.setdefault("STOKER_COMPILE_IN_BACKGROUND", "0")

    from stoker.bench.baselines import CompiledGather
    from stoker.bench.data import OTTO_FEATURES, OTTO_SAMPLES, write_otto
    from stoker.decoders import IntDecoder, NDArrayDecoder
    from stoker.loader import Loader, OrderOption
    from stoker.transforms import Squeeze, ToDevice, ToTensor

    otto = write_otto(args.out, OTTO_SAMPLES, 0)
    bs = args.batch_size
    seed000 = {"x": [NDArrayDecoder(), ToTensor(), ToDevice("cpu")], "y": [IntDecoder(), ToTensor(), ToDevice("cpu"), Squeeze()]}
    common: dict[str, Any] = dict(batch_size=bs, num_workers=args.workers, order=OrderOption.RANDOM, seed=0, drop_last=True)
    systems: dict[str, Any] = {
        "compiled_gather": CompiledGather(otto.X, otto.y, bs, 0),
        "default": Loader(str(otto.path), **common),
        "seed000": Loader(str(otto.path), pipelines=seed000, **common),
    }
    y_all = np.asarray(otto.y, dtype=np.int64)
    for name, system in systems.items():  # warm-up epoch (compiles), checked
        _check_full(name, [(np.asarray(x).copy(), np.asarray(yb).copy()) for x, yb in system], y_all, bs, OTTO_FEATURES)
    if args.block < 2:
        parser.error("--block must be at least 2 (its first epoch follows another system's; the others are back to back)")
    times: dict[str, list[float]] = {name: [] for name in systems}  # back to back: a block's epochs after its first
    firsts: dict[str, list[float]] = {name: [] for name in systems}  # a block's first epoch (after another system's)
    names = list(systems)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            system = systems[name]
            for e in range(args.block):
                t0 = time.perf_counter()
                n = 0
                for x, _yb in system:
                    n += x.shape[0]
                (firsts if e == 0 else times)[name].append(time.perf_counter() - t0)
                if n != len(y_all) // bs * bs:
                    raise SystemExit(f"{name}: an epoch yielded {n} samples")
    med = {name: statistics.median(t) for name, t in times.items()}
    first = {name: statistics.median(t) for name, t in firsts.items()}
    result = {
        "workers": args.workers,
        "rounds": args.rounds,
        "block": args.block,
        "median_epoch_ms": {k: v * 1e3 for k, v in med.items()},
        "first_in_block_epoch_ms": {k: v * 1e3 for k, v in first.items()},
        "seed000_vs_default": med["default"] / med["seed000"],
        "seed000_vs_gather": med["compiled_gather"] / med["seed000"],
        "default_vs_gather": med["compiled_gather"] / med["default"],
        "first_in_block_default_vs_gather": first["compiled_gather"] / first["default"],
    }
    print(json.dumps(result, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"otto_pipelines_w{args.workers}.json").write_text(json.dumps(result, indent=1))
    for system in systems.values():
        close = getattr(system, "close", None)
        if callable(close):
            close()


def _check_full(name: str, batches: list[tuple[np.ndarray, np.ndarray]], y: np.ndarray, batch_size: int, features: int) -> None:
    """Shapes and dtypes of every batch, and the epoch's labels: the dataset's (as a multiset, last partial batch dropped)."""
    for x, yb in batches:
        if x.shape != (batch_size, features) or x.dtype != np.float32:
            raise SystemExit(f"{name}: a batch of x is {x.shape} {x.dtype}")
        if yb.shape not in ((batch_size,), (batch_size, 1)) or yb.dtype != np.int64:
            raise SystemExit(f"{name}: a batch of y is {yb.shape} {yb.dtype}")
    got = np.concatenate([yb.reshape(-1) for _, yb in batches])
    if len(got) != len(y) // batch_size * batch_size:
        raise SystemExit(f"{name}: an epoch yielded {len(got)} labels, expected {len(y) // batch_size * batch_size}")
    counts, total = np.bincount(got, minlength=y.max() + 1), np.bincount(y, minlength=y.max() + 1)
    if (counts > total).any():
        raise SystemExit(f"{name}: an epoch's labels are not the dataset's")


if __name__ == "__main__":
    sys.exit(main())
