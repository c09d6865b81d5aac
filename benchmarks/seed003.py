"""Seed 003's question: the fastest loop over 300,000 samples in batches of 300, shuffled every epoch.

Seed 003 ("The fast train loops", Nasy, 2024) answers with two loops; stoker's
``Loader`` answers over the same 300,000 integers, written as an ``IntField``:

* ``numpy_permutation``: the seed's numpy loop, ``rng.permutation(dataset).reshape(-1, 300)``,
  then its rows (numpy rows out, not tensors);
* ``fast_dataloader``: the seed's 15-line ``FastDataloader`` (``torch.randperm``, then a slice
  of the permutation and a gather per batch) over ``torch.arange(300_000)``;
* ``stoker_default_w1``, ``stoker_default_w2``: ``Loader`` with FFCV's default pipeline of an
  ``IntField`` (``IntDecoder()``, then stoker's ``ToTensor()``: ``(300, 1)`` int64 tensors),
  ``OrderOption.RANDOM``, 1 and 2 threads;
* ``stoker_squeeze_w1``, ``stoker_squeeze_w2``: the same with ``IntDecoder(), ToTensor(),
  Squeeze()`` (``(300,)`` int64 tensors, the seed's shape).

Each run times every system in blocks of ``--block`` epochs in a row, round after
round (the systems' order reversed every other round, so that a busy machine slows
them alike), after a warm-up epoch that compiles stoker's producer loop: the seed
times each loop over 1000 epochs in a row, and a block's epochs after its first are
that (back to back). The figure is the median over a run's back-to-back epochs of
(epoch time / batches), and the time from ``iter()`` to the first batch; the first
epoch of each block (after another loop's: its threads idle meanwhile, the second
CPU too, and every wake-up after that is slower on this machine) is reported apart
(``per_batch_after_switch_us``). A ratio is ``stoker / it`` as a speed: the other
loop's time over stoker's (above 1: stoker is faster). Several runs give the spread.

Before any number is reported, every system's warm-up epoch and the next one are
checked: every batch has 300 int64 values in the system's shape (tensors for the
torch and stoker loops), each epoch holds every sample exactly once, and the two
epochs' orders differ (shuffled every epoch).

On a 2-CPU machine ``num_workers=2`` runs one producer beside the loop (the loop makes batches too while it
waits: ``producers_beside_loop``), so ``_w1`` and ``_w2`` differ only in their slots and batches ahead there.

Run: ``python benchmarks/seed003.py [--runs 3] [--epochs 20] [--block 5] [--out DIR]`` (the table, then ``DIR/seed003.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np


class FastDataloader:
    """Seed 003's custom data loader, as the seed writes it: a permutation per epoch, then slices of it."""

    def __init__(self, dataset: Any, batch_size: int, shuffle: bool = True) -> None:
        self.data = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle

    def __iter__(self) -> FastDataloader:
        import torch

        self.idx = torch.randperm(len(self.data)) if self.shuffle else torch.arange(len(self.data))
        self.i = 0
        return self

    def __next__(self) -> Any:
        if self.i >= len(self.data):
            raise StopIteration
        batch = self.idx[self.i : self.i + self.batch_size]
        self.i += self.batch_size
        return self.data[batch]


class NumpyPermutation:
    """Seed 003's numpy loop: one permutation of the dataset per epoch, reshaped into batches, then its rows."""

    def __init__(self, dataset: np.ndarray, batch_size: int, seed: int) -> None:
        self.dataset, self.batch_size = dataset, batch_size
        self.rng = np.random.default_rng(seed)

    def __iter__(self) -> Iterator[np.ndarray]:
        rd = self.rng.permutation(self.dataset).reshape(-1, self.batch_size)
        return iter(rd)


class _Samples:
    """The 300,000 integers as ``DatasetWriter`` reads them: sample ``i`` is ``(i,)``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int]:
        return (int(i),)


def write_integers(out: Path, n: int) -> Path:
    """``out/seed003-<n>.stoker``: one ``IntField`` ``y`` holding ``0 ... n-1`` (reused when it has ``n`` samples: the
    checks of :func:`check_epochs` read every value)."""
    from stoker.errors import StokerError
    from stoker.fields import IntField
    from stoker.writer import DatasetWriter

    out.mkdir(parents=True, exist_ok=True)
    path = out / f"seed003-{n}.stoker"
    if path.exists():
        from stoker.format.reader import Reader

        try:
            reader = Reader(str(path))
            if reader.num_samples == n:
                return path
        except (OSError, StokerError):  # a partial or stale file: written again below
            pass
        path.unlink()
    DatasetWriter(path, {"y": IntField()}, num_workers=1, progress=False).from_indexed_dataset(_Samples(n))
    return path


def batches(system: Iterable[Any]) -> Iterator[Any]:
    """A system's batch as one array: stoker's loaders yield a tuple of fields (here one)."""
    for b in system:
        yield b[0] if isinstance(b, tuple) else b


def check_epochs(name: str, system: Iterable[Any], n: int, batch_size: int, shape: tuple[int, ...], tensors: bool) -> None:
    """Two epochs of ``system``: every batch ``shape`` int64 (a tensor when ``tensors``), every sample once per
    epoch, the two orders different (shuffled every epoch). Raises ``SystemExit`` naming what failed."""
    import torch

    orders = []
    for epoch in range(2):
        got = []
        for k, b in enumerate(batches(system)):
            is_tensor = isinstance(b, torch.Tensor)
            if tensors != is_tensor or tuple(b.shape) != shape or str(b.dtype) not in ("int64", "torch.int64"):
                raise SystemExit(
                    f"{name}: batch {k} of epoch {epoch} is a {type(b).__name__} {tuple(b.shape)} {b.dtype}, "
                    f"expected a {'tensor' if tensors else 'numpy array'} {shape} int64"
                )
            got.append(np.asarray(b).reshape(-1).copy())
        order = np.concatenate(got) if got else np.zeros(0, dtype=np.int64)
        if len(order) != n or not np.array_equal(np.sort(order), np.arange(n)):
            raise SystemExit(f"{name}: epoch {epoch} did not yield each of the {n} samples once ({len(order)} values)")
        orders.append(order)
    if np.array_equal(orders[0], orders[1]):
        raise SystemExit(f"{name}: two epochs came in the same order (not shuffled every epoch)")


def time_epoch(system: Iterable[Any], n_batches: int, name: str) -> tuple[float, float]:
    """(seconds of the whole epoch, seconds from ``iter()`` to its first batch)."""
    clock = time.perf_counter
    t0 = t1 = clock()
    k = 0
    for _ in system:  # (a plain for loop: the seed's FastDataloader starts its epoch again in every iter())
        if k == 0:
            t1 = clock()
        k += 1
    t2 = clock()
    if k != n_batches:
        raise SystemExit(f"{name}: an epoch yielded {k} batches, expected {n_batches}")
    return t2 - t0, t1 - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs, each timing every system for --epochs epochs (spread)")
    parser.add_argument("--epochs", type=int, default=20, help="timed epochs of each system per run (a multiple of --block)")
    parser.add_argument("--block", type=int, default=5, help="epochs of a system in a row (>= 2; the first follows another loop's)")
    parser.add_argument("--samples", type=int, default=300_000)
    parser.add_argument("--batch-size", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    args = parser.parse_args()
    if args.block < 2 or args.epochs % args.block:
        parser.error(f"--block must be >= 2 and divide --epochs; got --block {args.block}, --epochs {args.epochs}")
    if args.samples % args.batch_size:
        parser.error(f"--samples must be a multiple of --batch-size (the seed's numpy loop reshapes); got {args.samples}")
    # compiled epochs: the warm-up epoch compiles each loader's producer loop before the runs (see otto_pipelines.py)
    os.environ.setdefault("STOKER_COMPILE_IN_BACKGROUND", "0")

    import torch

    from stoker.decoders import IntDecoder
    from stoker.loader import Loader, OrderOption
    from stoker.transforms import Squeeze, ToTensor

    n, bs = args.samples, args.batch_size
    n_batches = n // bs
    path = write_integers(args.out, n)
    common: dict[str, Any] = dict(batch_size=bs, order=OrderOption.RANDOM, seed=0)
    squeeze = {"y": [IntDecoder(), ToTensor(), Squeeze()]}
    systems: dict[str, Any] = {
        "numpy_permutation": NumpyPermutation(np.arange(n), bs, 0),
        "fast_dataloader": FastDataloader(torch.arange(n), bs),
        "stoker_default_w1": Loader(str(path), num_workers=1, **common),
        "stoker_default_w2": Loader(str(path), num_workers=2, **common),
        "stoker_squeeze_w1": Loader(str(path), num_workers=1, pipelines=squeeze, **common),
        "stoker_squeeze_w2": Loader(str(path), num_workers=2, pipelines=squeeze, **common),
    }
    shapes = {name: (bs, 1) if "default" in name else (bs,) for name in systems}
    load_before = os.getloadavg()
    for name, system in systems.items():  # the warm-up epoch (compiles) and the next one, checked
        check_epochs(name, system, n, bs, shapes[name], tensors=name != "numpy_permutation")
    runs: list[dict[str, Any]] = []
    for _ in range(args.runs):
        epoch_s: dict[str, list[float]] = {name: [] for name in systems}  # back to back (a block after its first)
        first_s: dict[str, list[float]] = {name: [] for name in systems}
        switch_s: dict[str, list[float]] = {name: [] for name in systems}  # a block's first epoch
        load = os.getloadavg()[0]
        names = list(systems)
        for r in range(args.epochs // args.block):
            for name in names if r % 2 == 0 else names[::-1]:
                for e in range(args.block):
                    whole, first = time_epoch(systems[name], n_batches, name)
                    if e == 0:
                        switch_s[name].append(whole)
                    else:
                        epoch_s[name].append(whole)
                        first_s[name].append(first)
        runs.append({
            "per_batch_us": {k: statistics.median(v) / n_batches * 1e6 for k, v in epoch_s.items()},
            "first_batch_us": {k: statistics.median(v) * 1e6 for k, v in first_s.items()},
            "per_batch_after_switch_us": {k: statistics.median(v) / n_batches * 1e6 for k, v in switch_s.items()},
            "load_1min": [load, os.getloadavg()[0]],
        })  # fmt: skip
    stoker_names = [k for k in systems if k.startswith("stoker")]
    others = [k for k in systems if not k.startswith("stoker")]
    ratios = {
        f"{s}/{o}": [r["per_batch_us"][o] / r["per_batch_us"][s] for r in runs] for s in stoker_names for o in others
    }  # fmt: skip
    after_switch = {
        f"{s}/{o}": [r["per_batch_after_switch_us"][o] / r["per_batch_after_switch_us"][s] for r in runs]
        for s in stoker_names for o in others
    }  # fmt: skip
    result = {
        "samples": n,
        "batch_size": bs,
        "runs": args.runs,
        "epochs_per_run": args.epochs,
        "block": args.block,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        "shapes": {k: list(v) for k, v in shapes.items()},
        "runs_detail": runs,
        "ratio_stoker_over": ratios,
        "ratio_stoker_over_after_switch": after_switch,
        "note": "ratio = the other loop's per-batch time / stoker's (a speed ratio: above 1, stoker is faster)",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "seed003.json").write_text(json.dumps(result, indent=1))
    print(report(result, list(systems), stoker_names, others))
    print(f"\n(all figures: {args.out / 'seed003.json'})")
    for system in systems.values():
        close = getattr(system, "close", None)
        if callable(close):
            close()


def _spread(values: list[float], fmt: str) -> str:
    lo, hi = min(values), max(values)
    return format(lo, fmt) if len(values) == 1 or format(lo, fmt) == format(hi, fmt) else f"{lo:{fmt}}-{hi:{fmt}}"


def report(result: dict[str, Any], names: list[str], stoker_names: list[str], others: list[str]) -> str:
    """The markdown table: per-batch and first-batch times (min-max over runs), then stoker's ratios."""
    runs = result["runs_detail"]
    lines = [
        f"Seed 003: {result['samples']:,} samples, batches of {result['batch_size']}, {result['runs']} runs of "
        f"{result['epochs_per_run']} epochs in blocks of {result['block']}; {result['cpus']} CPUs, load average "
        f"{result['load_avg_before'][0]:.1f} before, {result['load_avg_after'][0]:.1f} after",
        "",
        "| loop | batch | per batch, back to back [us] | first batch of an epoch [us] | per batch, the epoch after another loop's [us] |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        shape = "x".join(str(d) for d in result["shapes"][name])
        per = _spread([r["per_batch_us"][name] for r in runs], ".1f")
        first = _spread([r["first_batch_us"][name] for r in runs], ".0f")
        switch = _spread([r["per_batch_after_switch_us"][name] for r in runs], ".1f")
        lines.append(f"| {name} | {shape} | {per} | {first} | {switch} |")
    head = " | ".join(f"{o} | {o}, after a switch" for o in others)
    lines += ["", f"| stoker / it (speed) | {head} |", "|---|" + "---|" * (2 * len(others))]
    for s in stoker_names:
        cells = [
            _spread(result[key][f"{s}/{o}"], ".2f") + "x" for o in others for key in ("ratio_stoker_over", "ratio_stoker_over_after_switch")
        ]  # fmt: skip
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
