"""One pass per sample: fused pipelines against the same pipelines unfused and a hand-written one-pass loop, interleaved.

Scenario B of ``benchmarks/images.py`` (50,000 32x32 raw images -> random flip +
``NormalizeImage`` to float32 NCHW, batch 512, random order, 2 workers), and with
``--photos`` its photo pipeline (``RandomResizedCropRGBImageDecoder(224)``, flip,
``ToTensor()``, ``ToTorchImage(channels_last=False)``, batch 64). Systems, one epoch
each per round, round after round in one process (a busy machine slows them alike),
compared by their median epoch, with the spread over rounds:

* ``fused``: stoker, the head's steps fused into one loop over samples (the default);
* ``unfused``: stoker with ``STOKER_FUSE=0``: each step a loop over the batch;
* ``one_pass_reference`` (B): ``benchmarks/images.py``'s compiled one-pass loop;
* ``raw_gather`` (B): ``np.take`` of the raw uint8 images (a quarter of the output's bytes).

Before timing, the fused and unfused loaders' batches are compared bit for bit over
an epoch; both loaders compile their producer loop before the first round.

Run: ``python benchmarks/fusion.py [--rounds 15] [--photos] [--out DIR]``.
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

HERE = Path(__file__).resolve().parent


def _loader(path: Path, ops: list[Any], batch: int, fuse: bool) -> Any:
    from stoker.decoders import IntDecoder
    from stoker.loader import Loader, OrderOption
    from stoker.transforms import ToTensor

    os.environ["STOKER_FUSE"] = "1" if fuse else "0"
    try:
        pipes = {"image": ops, "label": [IntDecoder(), ToTensor()]}
        return Loader(path, batch_size=batch, num_workers=2, order=OrderOption.RANDOM, seed=0, pipelines=pipes)
    finally:
        os.environ.pop("STOKER_FUSE", None)


def _same(a: Any, b: Any) -> None:
    for k, (x, y) in enumerate(zip(a, b, strict=True)):
        if not np.array_equal(np.asarray(x[0]), np.asarray(y[0])) or not np.array_equal(np.asarray(x[1]), np.asarray(y[1])):
            raise SystemExit(f"fused and unfused batches differ at batch {k}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--photos", action="store_true", help="the photo pipeline instead of scenario B")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    args = parser.parse_args()
    os.environ.setdefault("STOKER_COMPILE_IN_BACKGROUND", "0")  # steady state: loops compiled before the first batch
    sys.path.insert(0, str(HERE))
    import images
    from stoker.decoders import RandomResizedCropRGBImageDecoder, SimpleRGBImageDecoder
    from stoker.transforms import NormalizeImage, RandomHorizontalFlip, ToTensor, ToTorchImage

    systems: dict[str, Any] = {}
    if args.photos:
        path = images.dataset_path(args.out, "C", 3000)
        n, batch = 3000, 64

        def ops() -> list[Any]:
            return [RandomResizedCropRGBImageDecoder((224, 224)), RandomHorizontalFlip(), ToTensor(), ToTorchImage(channels_last=False)]
    else:
        path = images.dataset_path(args.out, "B", 50_000)
        n, batch = 50_000, 512

        def ops() -> list[Any]:
            return [SimpleRGBImageDecoder(), RandomHorizontalFlip(), NormalizeImage(images.MEAN, images.STD, np.float32), ToTensor()]

    for name, fuse in (("fused", True), ("unfused", False)):
        systems[name] = _loader(path, ops(), batch, fuse)
    _same([(x.clone(), y.clone()) for x, y in systems["fused"]], [(x.clone(), y.clone()) for x, y in systems["unfused"]])
    if not args.photos:
        from stoker.format import Reader

        with Reader(path) as r:
            m = r.metadata
            raw = np.stack([np.frombuffer(bytes(r.storage[int(p) : int(p) + 3072]), np.uint8).reshape(32, 32, 3) for p in m["image/ptr"]])
        one_pass = images._one_pass_kernel()
        mean32, inv_std32 = np.asarray(images.MEAN, np.float32), (1 / np.asarray(images.STD, np.float32)).astype(np.float32)
        out32 = np.empty((batch, 3, 32, 32), np.float32)
        gathered = np.empty((batch, 32, 32, 3), np.uint8)
        rng = np.random.default_rng(0)

        class OnePass:
            def __iter__(self) -> Any:
                perm = rng.permutation(n)
                for s in range(0, n, batch):
                    idx = perm[s : s + batch]
                    yield one_pass(raw, idx, rng.random(len(idx)) < 0.5, mean32, inv_std32, out32[: len(idx)]), idx

        class Gather:
            def __iter__(self) -> Any:
                perm = rng.permutation(n)
                for s in range(0, n, batch):
                    idx = perm[s : s + batch]
                    yield np.take(raw, idx, axis=0, out=gathered[: len(idx)]), idx

        systems["one_pass_reference"], systems["raw_gather"] = OnePass(), Gather()
    for system in systems.values():  # warm-up epoch
        for _ in system:
            pass
    times: dict[str, list[float]] = {name: [] for name in systems}
    cpu: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(args.rounds):
        for name, system in systems.items():
            c0, t0 = time.process_time(), time.perf_counter()
            count = 0
            for x, _y in system:
                count += x.shape[0]
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            if count != n:
                raise SystemExit(f"{name}: an epoch yielded {count} samples, expected {n}")
    med = {k: statistics.median(v) for k, v in times.items()}
    ref = "one_pass_reference" if "one_pass_reference" in med else "unfused"
    result = {
        "scenario": "photos" if args.photos else "B",
        "rounds": args.rounds,
        "samples_per_s": {k: n / v for k, v in med.items()},
        "spread_samples_per_s": {k: [n / max(v), n / min(v)] for k, v in times.items()},
        "cpu_s_per_epoch": {k: statistics.median(v) for k, v in cpu.items()},
        f"ratio_to_{ref}": {k: med[ref] / v for k, v in med.items()},
        "fused_vs_unfused": med["unfused"] / med["fused"],
        "load_average": os.getloadavg(),
    }
    print(json.dumps(result, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"fusion_{result['scenario']}.json").write_text(json.dumps(result, indent=1))
    for system in systems.values():
        close = getattr(system, "close", None)
        if callable(close):
            close()


if __name__ == "__main__":
    main()
