"""One pass per sample: fused pipelines against the same pipelines unfused and a hand-written one-pass loop, interleaved.

Scenario B of ``benchmarks/images.py`` (50,000 32x32 raw images -> random flip +
``NormalizeImage`` to float32 NCHW, batch 512, random order), and with ``--photos``
its photo pipeline (``RandomResizedCropRGBImageDecoder(224)``, flip, ``ToTensor()``,
``ToTorchImage(channels_last=False)``, batch 64, 2 workers). Systems, one epoch each
per round, round after round in one process (a busy machine slows them alike),
compared by their median epoch, with the spread over rounds. Scenario B, for each
thread count of ``--threads`` (the Loader's ``num_workers``; Numba's threads of the
reference and of the loop's thread):

* ``ffcv_t{n}``: the pipeline FFCV's users write, ``[SimpleRGBImageDecoder(),
  RandomHorizontalFlip(), ToTensor(), ToTorchImage(), NormalizeImage(mean, std,
  np.float32)]`` (the normalisation on the tensor, as in FFCV's examples);
* ``ffcv_tensor_t{n}``: the same without ``ToTorchImage()``;
* ``ffcv_unfused_t{n}``: ``ffcv_t{n}`` with ``STOKER_FUSE=0`` (each step over the batch, as written);
* ``stoker_t{n}``: ``[SimpleRGBImageDecoder(), RandomHorizontalFlip(), NormalizeImage(...),
  ToTensor()]``, the order stoker's docs use (what this benchmark timed before issue 45);
* ``one_pass_reference_t{n}``: ``benchmarks/images.py``'s compiled one-pass loop (gather,
  flip by the same draw, normalise to float32 NCHW), on ``n`` Numba threads;
* ``raw_gather``: ``np.take`` of the raw uint8 images (a quarter of the output's bytes).

Before timing, each pipeline's batches (with the samples' indices) are checked against
the reference kernel (every sample equal, bit for bit, to the reference's image of that
index, flipped or not, and about half of them flipped), and every timed system's first
epoch against those batches (a digest per batch): all the pipelines give the same
batches. The steps each pipeline runs in the producers (compiled, fused) and on the
loop's thread are printed. Loaders compile their producer loop before the first round.

Run: ``python benchmarks/fusion.py [--rounds 15] [--threads 1,2] [--photos] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent


def _loader(path: Path, ops: list[Any], batch: int, fuse: bool, workers: int = 2, indices: bool = False) -> Any:
    from stoker.decoders import IntDecoder
    from stoker.loader import Loader, OrderOption
    from stoker.transforms import ToTensor

    os.environ["STOKER_FUSE"] = "1" if fuse else "0"
    try:
        pipes = {"image": ops, "label": [IntDecoder(), ToTensor()]}
        return Loader(
            path, batch_size=batch, num_workers=workers, order=OrderOption.RANDOM, seed=0, pipelines=pipes, return_indices=indices
        )
    finally:
        os.environ.pop("STOKER_FUSE", None)


def _same(a: Any, b: Any) -> None:
    for k, (x, y) in enumerate(zip(a, b, strict=True)):
        if not np.array_equal(np.asarray(x[0]), np.asarray(y[0])) or not np.array_equal(np.asarray(x[1]), np.asarray(y[1])):
            raise SystemExit(f"fused and unfused batches differ at batch {k}")


def _steps(loader: Any) -> dict[str, Any]:
    """Where each step of the image pipeline runs: compiled in the producers (fused or not), or on the loop's thread."""
    image = loader.pipelines[0]
    return {
        "producers": [type(s.op).__name__ for s in image.jit_steps],
        "one_pass_per_sample": bool(image.per_sample),
        "loop_thread": [repr(s.op) for s in image.steps if not s.jit],
    }


def _digest(x: Any) -> str:
    return hashlib.blake2b(np.ascontiguousarray(np.asarray(x)).view(np.uint8), digest_size=16).hexdigest()


def _check_against_reference(
    loader: Any, raw: np.ndarray, one_pass: Any, mean32: np.ndarray, inv_std32: np.ndarray, atol: float = 0.0
) -> list[str]:
    """One epoch of ``loader`` (with indices): every sample the reference's image of its index, flipped or not; the digests.

    ``atol``: the largest difference allowed (0: bit for bit; ``--approx``, for trees whose tensor path divided by std).
    """
    digests, flipped, total = [], 0, 0
    for x, _y, idx in loader:
        idx_ = idx.numpy()
        plain = one_pass(raw, idx_, np.zeros(len(idx_), np.bool_), mean32, inv_std32, np.empty((len(idx_), 3, 32, 32), np.float32))
        mirror = one_pass(raw, idx_, np.ones(len(idx_), np.bool_), mean32, inv_std32, np.empty((len(idx_), 3, 32, 32), np.float32))
        got = x.numpy()
        same_plain = (np.abs(got - plain) <= atol).reshape(len(idx_), -1).all(axis=1)
        same_mirror = (np.abs(got - mirror) <= atol).reshape(len(idx_), -1).all(axis=1)
        if not (same_plain | same_mirror).all():
            bad = int(np.flatnonzero(~(same_plain | same_mirror))[0])
            raise SystemExit(f"{_steps(loader)}: sample {int(idx_[bad])} differs from the reference's image, flipped or not")
        flipped += int((same_mirror & ~same_plain).sum())
        total += len(idx_)
        digests.append(_digest(got))
    if not 0.4 < flipped / total < 0.6:
        raise SystemExit(f"{flipped} of {total} samples flipped: expected about half")
    return digests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", default="1,2", help="thread counts of scenario B, comma-separated")
    parser.add_argument("--photos", action="store_true", help="the photo pipeline instead of scenario B")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--approx", action="store_true", help="B: values within 1e-5 of the reference (older trees), not bit for bit")
    args = parser.parse_args()
    os.environ.setdefault("STOKER_COMPILE_IN_BACKGROUND", "0")  # steady state: loops compiled before the first batch
    sys.path.insert(0, str(HERE))
    if args.photos:
        photos(args)
    else:
        raw_images(args, [int(t) for t in args.threads.split(",")])


def _time(systems: dict[str, Any], rounds: int, n: int, threads: dict[str, int]) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Epoch times and CPU times of each system, round after round; Numba's threads on this thread set per system."""
    import numba

    times: dict[str, list[float]] = {name: [] for name in systems}
    cpu: dict[str, list[float]] = {name: [] for name in systems}
    default = numba.get_num_threads()
    for _ in range(rounds):
        for name, system in systems.items():
            numba.set_num_threads(threads.get(name, default))
            c0, t0 = time.process_time(), time.perf_counter()
            count = 0
            for x, *_rest in system:
                count += x.shape[0]
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            if count != n:
                raise SystemExit(f"{name}: an epoch yielded {count} samples, expected {n}")
    numba.set_num_threads(default)
    return times, cpu


def raw_images(args: argparse.Namespace, thread_counts: list[int]) -> None:
    """Scenario B: the pipelines users write and stoker's, against the one-pass reference, at each thread count."""
    import numba

    import images
    from stoker.decoders import SimpleRGBImageDecoder
    from stoker.format import Reader
    from stoker.transforms import NormalizeImage, RandomHorizontalFlip, ToTensor, ToTorchImage

    path = images.dataset_path(args.out, "B", 50_000)
    n, batch = 50_000, 512
    load_before = os.getloadavg()

    def pipeline(kind: str) -> list[Any]:
        head = [SimpleRGBImageDecoder(), RandomHorizontalFlip()]
        normalize = NormalizeImage(images.MEAN, images.STD, np.float32)
        if kind == "stoker":
            return [*head, normalize, ToTensor()]
        if kind == "ffcv_tensor":
            return [*head, ToTensor(), normalize]
        return [*head, ToTensor(), ToTorchImage(), normalize]

    kinds = {"ffcv": ("ffcv", True), "ffcv_tensor": ("ffcv_tensor", True), "ffcv_unfused": ("ffcv", False), "stoker": ("stoker", True)}
    with Reader(path) as r:
        m = r.metadata
        raw = np.stack([np.frombuffer(bytes(r.storage[int(p) : int(p) + 3072]), np.uint8).reshape(32, 32, 3) for p in m["image/ptr"]])
    one_pass = images._one_pass_kernel()
    mean32, inv_std32 = np.asarray(images.MEAN, np.float32), (1 / np.asarray(images.STD, np.float32)).astype(np.float32)
    expected: dict[str, list[str]] = {}
    paths: dict[str, Any] = {}
    for name, (kind, fuse) in kinds.items():  # the batches, checked against the reference, before any timing
        check = _loader(path, pipeline(kind), batch, fuse, indices=True)
        expected[name] = _check_against_reference(check, raw, one_pass, mean32, inv_std32, 1e-5 if args.approx else 0.0)
        if not args.approx and expected[name] != next(iter(expected.values())):
            raise SystemExit(f"{name}: its batches differ from the other pipelines' (the same seeds: they should not)")
        paths[name] = _steps(check)
        check.close()
    systems: dict[str, Any] = {}
    threads: dict[str, int] = {}
    names: dict[str, str] = {}  # a timed loader's name -> its pipeline's
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

    for t in thread_counts:
        for name, (kind, fuse) in kinds.items():
            systems[f"{name}_t{t}"] = _loader(path, pipeline(kind), batch, fuse, workers=t)
            threads[f"{name}_t{t}"] = t
            names[f"{name}_t{t}"] = name
        systems[f"one_pass_reference_t{t}"] = OnePass()
        threads[f"one_pass_reference_t{t}"] = t
    systems["raw_gather"] = Gather()
    default = numba.get_num_threads()
    for name, system in systems.items():  # warm-up epoch; a loader's first epoch is the checked one (epoch 0, seed 0)
        numba.set_num_threads(threads.get(name, default))
        digests = [_digest(x) for x, *_ in system]
        if name in names and digests != expected[names[name]]:
            raise SystemExit(f"{name}: its first epoch differs from the checked batches")
    numba.set_num_threads(default)
    times, cpu = _time(systems, args.rounds, n, threads)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = {}
    for t in thread_counts:
        ref = med[f"one_pass_reference_t{t}"]
        ratios[f"t{t}"] = {k: ref / v for k, v in med.items() if k.endswith(f"_t{t}")}
    result = {
        "scenario": "B",
        "rounds": args.rounds,
        "checked": "within 1e-5 of the reference" if args.approx else "bit for bit",
        "steps": paths,
        "samples_per_s": {k: n / v for k, v in med.items()},
        "spread_samples_per_s": {k: [n / max(v), n / min(v)] for k, v in times.items()},
        "cpu_s_per_epoch": {k: statistics.median(v) for k, v in cpu.items()},
        "ratio_to_one_pass_reference": ratios,
        "load_average": {"before": load_before, "after": os.getloadavg()},
    }
    print(json.dumps(result, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fusion_B.json").write_text(json.dumps(result, indent=1))
    for system in systems.values():
        close = getattr(system, "close", None)
        if callable(close):
            close()


def photos(args: argparse.Namespace) -> None:
    """The photo pipeline, fused against unfused."""
    import images
    from stoker.decoders import RandomResizedCropRGBImageDecoder
    from stoker.transforms import RandomHorizontalFlip, ToTensor, ToTorchImage

    path = images.dataset_path(args.out, "C", 3000)
    n, batch = 3000, 64

    def ops() -> list[Any]:
        return [RandomResizedCropRGBImageDecoder((224, 224)), RandomHorizontalFlip(), ToTensor(), ToTorchImage(channels_last=False)]

    systems = {name: _loader(path, ops(), batch, fuse) for name, fuse in (("fused", True), ("unfused", False))}
    _same([(x.clone(), y.clone()) for x, y in systems["fused"]], [(x.clone(), y.clone()) for x, y in systems["unfused"]])
    for system in systems.values():  # warm-up epoch
        for _ in system:
            pass
    times, cpu = _time(systems, args.rounds, n, {})
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "scenario": "photos",
        "rounds": args.rounds,
        "steps": {k: _steps(v) for k, v in systems.items()},
        "samples_per_s": {k: n / v for k, v in med.items()},
        "spread_samples_per_s": {k: [n / max(v), n / min(v)] for k, v in times.items()},
        "cpu_s_per_epoch": {k: statistics.median(v) for k, v in cpu.items()},
        "fused_vs_unfused": med["unfused"] / med["fused"],
        "load_average": os.getloadavg(),
    }
    print(json.dumps(result, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fusion_photos.json").write_text(json.dumps(result, indent=1))
    for system in systems.values():
        system.close()


if __name__ == "__main__":
    main()
