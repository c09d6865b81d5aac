"""What the per-step accounting (``stoker.observe``, on by default) costs, side by side with it off (``STOKER_ACCOUNTING=0``).

Two tasks, 2 threads, random order, each with four Loaders of the same file in one
process, made in the order on, off, off, on (the switch is read when a Loader is
made), one epoch each per round, interleaved (each Loader goes first in turn),
medians after a warm-up epoch; the two Loaders of each setting measure the noise:

* Otto (61,878 x 93 float32 rows, batch 1024): the default pipelines, and seed 000's
  (``NDArrayDecoder(), ToTensor(), ToDevice("cpu")`` / ``IntDecoder(), ToTensor(),
  ToDevice("cpu"), Squeeze()``: more Python steps per batch, each timed);
* T2-like images (50,000 32x32 JPEG q90 -> uint8 NCHW, batch 512; ``benchmarks/images.py``'s scenario A).

Before timing, both Loaders' first epochs must give the same batches (values,
shapes, dtypes); every timed batch's shapes and dtypes are checked. The ratio is
``median(off) / median(on)`` over both Loaders of each setting: 1.00 costs nothing, 0.99 is 1% slower with accounting.

Run: ``python benchmarks/accounting_overhead.py [--rounds 60] [--out DIR]``.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _loaders(make: Any) -> dict[str, Any]:
    """Four Loaders from ``make()``: accounting on, off, off, on, made in that order (the environment is read when a
    Loader is made; on a busy machine the order Loaders are made in can matter by several percent: each setting gets
    one early and one late, and the two of each setting measure the noise)."""
    saved = os.environ.get("STOKER_ACCOUNTING")
    out = {}
    try:
        for name in ("on_a", "off_a", "off_b", "on_b"):
            os.environ["STOKER_ACCOUNTING"] = "1" if name.startswith("on") else "0"
            out[name] = make()
    finally:
        if saved is None:
            os.environ.pop("STOKER_ACCOUNTING", None)
        else:
            os.environ["STOKER_ACCOUNTING"] = saved
    assert all((loader._recorder is not None) == name.startswith("on") for name, loader in out.items())
    return out


def _signature(batch: Any) -> tuple[Any, ...]:
    return tuple((tuple(t.shape), str(t.dtype)) for t in batch)


def _same_first_epoch(name: str, loaders: dict[str, Any]) -> tuple[Any, ...]:
    epochs = {k: [tuple(np.asarray(t).copy() for t in b) for b in loader] for k, loader in loaders.items()}
    first = epochs["on_a"]
    for k, epoch in epochs.items():
        for a, b in zip(first, epoch, strict=True):
            if any(x.shape != y.shape or x.dtype != y.dtype or not np.array_equal(x, y) for x, y in zip(a, b, strict=True)):
                raise SystemExit(f"{name}: {k} yielded other batches than on_a")
    return tuple((x.shape[1:], str(x.dtype)) for x in first[0])


def _time(name: str, loaders: dict[str, Any], rounds: int, want: tuple[Any, ...]) -> dict[str, Any]:
    times: dict[str, list[float]] = {k: [] for k in loaders}
    names = list(loaders)
    want_sig = tuple((tuple(s), _torch(d)) for s, d in want)
    for r in range(rounds):
        for k in names[r % 4 :] + names[: r % 4]:  # each Loader first, second, third and fourth in turn
            t0 = time.perf_counter()
            for batch in loaders[k]:
                if tuple((tuple(t.shape[1:]), str(t.dtype)) for t in batch) != want_sig:
                    raise SystemExit(f"{name} ({k}): a batch of {_signature(batch)}")
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    on = statistics.median(times["on_a"] + times["on_b"]) * 1e3
    off = statistics.median(times["off_a"] + times["off_b"]) * 1e3
    return {
        "median_epoch_ms": med,
        "median_epoch_ms_on": on,
        "median_epoch_ms_off": off,
        "throughput_ratio_on_vs_off": off / on,
        "noise_ratio_on_b_vs_on_a": med["on_a"] / med["on_b"],
        "noise_ratio_off_b_vs_off_a": med["off_a"] / med["off_b"],
        "rounds": rounds,
    }


def _torch(numpy_dtype: str) -> str:
    return {"float32": "torch.float32", "int64": "torch.int64", "uint8": "torch.uint8", "int32": "torch.int32"}[numpy_dtype]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=60, help="timed epochs per Loader (Otto: 4x as many)")
    parser.add_argument("--images", type=int, default=50_000)
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--only", choices=["otto", "jpeg"], default=None)
    args = parser.parse_args()

    from images import dataset_path  # benchmarks/images.py
    from stoker.bench.data import OTTO_SAMPLES, write_otto
    from stoker.decoders import IntDecoder, NDArrayDecoder, SimpleRGBImageDecoder
    from stoker.loader import Loader, OrderOption
    from stoker.transforms import Squeeze, ToDevice, ToTensor, ToTorchImage

    args.out.mkdir(parents=True, exist_ok=True)
    tasks: dict[str, Any] = {}
    if args.only in (None, "otto"):
        otto = write_otto(args.out, OTTO_SAMPLES, 0)
        common: dict[str, Any] = dict(batch_size=1024, num_workers=2, order=OrderOption.RANDOM, seed=0, drop_last=True)
        seed000 = {"x": [NDArrayDecoder(), ToTensor(), ToDevice("cpu")], "y": [IntDecoder(), ToTensor(), ToDevice("cpu"), Squeeze()]}
        tasks["otto_default"] = (_loaders(lambda: Loader(str(otto.path), **common)), 4 * args.rounds)
        tasks["otto_seed000"] = (_loaders(lambda: Loader(str(otto.path), pipelines=seed000, **common)), 4 * args.rounds)
    if args.only in (None, "jpeg"):
        path = dataset_path(args.out, "A", args.images)
        pipes = {"image": [SimpleRGBImageDecoder(), ToTensor(), ToTorchImage(channels_last=False)], "label": [IntDecoder(), ToTensor()]}
        make = lambda: Loader(path, batch_size=512, num_workers=2, order=OrderOption.RANDOM, seed=0, pipelines=pipes)  # noqa: E731
        tasks["jpeg_32x32"] = (_loaders(make), args.rounds)
    results: dict[str, Any] = {"cpus": os.cpu_count(), "load_average_at_start": os.getloadavg()}
    for name, (loaders, rounds) in tasks.items():
        want = _same_first_epoch(name, loaders)
        results[name] = _time(name, loaders, rounds, want)
        print(name, json.dumps(results[name]), flush=True)
        for loader in loaders.values():
            loader.close()
    results["load_average_at_end"] = os.getloadavg()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.exit(main())
