"""Mosaic streaming's side of the remote-dataset benchmark (issue 24): epochs from an S3 store through its cache.

Runs in Mosaic's own environment (``benchmarks/mosaic/setup_env.sh``) on a
dataset that ``write_mds.py`` uploaded::

    benchmarks/mosaic/.venv/bin/python benchmarks/mosaic/run_mosaic.py \\
        --remote s3://BUCKET/PREFIX --endpoint http://127.0.0.1:PORT \\
        --cache-dir DIR --cache-limit BYTES --batch-size 64 --workers 2 --epochs 2 --crop 224

The pipeline is the benchmark's image task as a Mosaic user writes it: a
subclass of ``streaming.StreamingDataset(remote, local, cache_limit, shuffle=True,
batch_size)`` whose ``__getitem__`` takes Mosaic's sample (the ``jpeg`` column
is decoded by Mosaic with Pillow), applies a RandomResizedCrop (torchvision's
geometry: scale 0.08-1, ratio 3/4-4/3; Pillow's bilinear resize of the box to
``crop`` x ``crop``) and a random horizontal flip, and returns a contiguous uint8
CHW tensor and the label; ``torch.utils.data.DataLoader(num_workers=W,
batch_size=B, persistent_workers=W > 0)`` batches them into uint8 NCHW
(``--layout nhwc``: NHWC). This is ``benchmarks/images.py``'s ``PillowRRC``.

The cache folder is emptied before the run (so epoch 1 is cold) and Mosaic's
stale shared memory is cleaned. A thread samples the cache folder's size every
``--sample-ms`` (50) ms. Bytes downloaded are counted by wrapping streaming's S3
download (each finished file's size, summed over the main process and the
workers through small files in a scratch folder); the harness's proxy counts the
bytes on the wire.

Prints one JSON line (keys in ``benchmarks/mosaic/README.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

T_START = time.perf_counter()

import numpy as np  # noqa: E402

COUNTER_ENV = "STOKER_MOSAIC_COUNTER_DIR"


# ---- the sample pipeline (PIL + numpy, as benchmarks/images.py's PillowRRC) -----------------------
def rrc_params(h: int, w: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop geometry (scale 0.08..1, ratio 3/4..4/3): ``(y, x, ch, cw)``."""
    area = h * w
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw, ch = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < cw <= w and 0 < ch <= h:
            return int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1)), ch, cw
    return 0, 0, h, w


def centre_crop(h: int, w: int, ratio: float) -> tuple[int, int, int, int]:
    """FFCV's centre crop (as ``benchmarks/images.py``): a centred square of side ``ratio * min(h, w)``."""
    c = max(1, int(ratio * min(h, w)))
    return (h - c) // 2, (w - c) // 2, c, c


class WorkerRng:
    """One numpy generator per process, seeded from torch's per-worker seed (so workers differ)."""

    def __init__(self) -> None:
        self._pid = -1
        self._rng = np.random.default_rng(0)

    def get(self) -> np.random.Generator:
        if self._pid != os.getpid():
            import torch

            self._rng = np.random.default_rng(torch.initial_seed())
            self._pid = os.getpid()
        return self._rng


def _count_downloads() -> None:
    """Wrap streaming's S3 download so that each finished file's size is appended to ``$COUNTER_ENV/<pid>``."""
    from streaming.base.storage import download

    cls = download.S3Downloader
    if getattr(cls, "_stoker_counted", False):
        return
    inner = cls._download_file_impl

    def counted(self: Any, remote: str, local: str, timeout: float) -> None:
        inner(self, remote, local, timeout)
        folder = os.environ.get(COUNTER_ENV)
        if folder:
            with open(os.path.join(folder, str(os.getpid())), "a") as fh:
                fh.write(f"{os.path.getsize(local)}\n")

    cls._download_file_impl = counted
    cls._stoker_counted = True


def read_counter(folder: str) -> tuple[int, int]:
    """(files, bytes) downloaded so far by every process."""
    files = total = 0
    for entry in os.scandir(folder):
        with open(entry.path) as fh:
            for line in fh:
                if line.strip():
                    files += 1
                    total += int(line)
    return files, total


def make_dataset_class() -> type:
    import torch
    from streaming import StreamingDataset

    class RRCDataset(StreamingDataset):
        """Mosaic's sample (``image``: a Pillow image, decoded by the ``jpeg`` encoding) -> RRC + flip -> uint8 tensor.

        With ``centre`` (a ratio), a centre crop and no flip instead, and the sample's index as a third item (the check).
        """

        def __init__(self, *, crop: int, layout: str, centre: float | None = None, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.crop, self.layout, self.centre = crop, layout, centre
            self.rng = WorkerRng()

        def __getitem__(self, idx: int) -> tuple[Any, ...]:
            from PIL import Image

            sample = super().__getitem__(idx)
            rng = self.rng.get()
            img = sample["image"].convert("RGB")
            if self.centre is None:
                y, x, ch, cw = rrc_params(img.height, img.width, rng)
            else:
                y, x, ch, cw = centre_crop(img.height, img.width, self.centre)
            out = np.asarray(img.resize((self.crop, self.crop), Image.Resampling.BILINEAR, box=(x, y, x + cw, y + ch)))
            if self.centre is None and rng.random() < 0.5:
                out = out[:, ::-1]
            if self.layout == "nchw":
                out = out.transpose(2, 0, 1)
            tensor = torch.from_numpy(np.ascontiguousarray(out))
            return (tensor, int(sample["label"])) if self.centre is None else (tensor, int(sample["label"]), int(idx))

    return RRCDataset


# ---- cache sampler --------------------------------------------------------------------------------
def folder_bytes(root: str) -> int:
    total = 0
    stack = [root]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    with contextlib.suppress(FileNotFoundError):
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                        else:
                            total += e.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            pass
    return total


class CacheSampler(threading.Thread):
    """Samples a folder's size every ``interval`` seconds; ``peak`` is the largest seen."""

    def __init__(self, root: str, interval: float) -> None:
        super().__init__(name="cache-sampler", daemon=True)
        self.root, self.interval = root, interval
        self.peak = self.samples = 0
        self._stop_event = threading.Event()

    def sample(self) -> None:
        size = folder_bytes(self.root)
        self.peak = max(self.peak, size)
        self.samples += 1

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        self._stop_event.set()
        self.join()
        self.sample()


# ---- the check -----------------------------------------------------------------------------------
def verify(args: argparse.Namespace, cache: Path) -> int:
    """The pipeline with a centre crop, no flip, no shuffle, in this process: the first batches, with sample ids, to an .npz.

    ``images`` (uint8, the layout asked for), ``labels`` and ``ids`` (each sample's index in the
    input); the harness compares them with its own decode of the same JPEGs. Prints one JSON line.
    """
    import torch

    ds = make_dataset_class()(
        remote=args.remote, local=os.fspath(cache), shuffle=False, batch_size=args.batch_size,
        crop=args.crop, layout=args.layout, centre=args.verify_centre,
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(ds, batch_size=args.batch_size, num_workers=0)
    images, labels, ids = [], [], []
    for i, (x, y, idx) in enumerate(loader):
        if i >= args.verify_batches:
            break
        images.append(x.numpy())
        labels.append(y.numpy())
        ids.append(idx.numpy())
    out = {"images": np.concatenate(images), "labels": np.concatenate(labels), "ids": np.concatenate(ids)}
    args.verify_out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(args.verify_out, **out)
    print(
        json.dumps(
            {"verify_out": os.fspath(args.verify_out), "images_shape": list(out["images"].shape), "ids_head": out["ids"][:8].tolist()}
        )
    )
    return 0


# ---- main -----------------------------------------------------------------------------------------
def parse_bytes(text: str) -> int:
    units = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
    s = text.strip().lower().removesuffix("b")
    for suffix in sorted(units, key=len, reverse=True):
        if s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * units[suffix])
    return int(float(s))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--remote", help="s3://bucket/prefix that write_mds.py uploaded")
    ap.add_argument(
        "--stream",
        action="append",
        default=[],
        metavar="REMOTE=PROPORTION",
        help="instead of --remote: a mix of streams (issue 33), streaming.Stream(remote=REMOTE, proportion=PROPORTION) each, "
        "downloaded into CACHE_DIR/<k>; repeat for each stream",
    )
    ap.add_argument("--epoch-size", type=int, default=None, help="with --stream: the samples of an epoch (Mosaic's epoch_size)")
    ap.add_argument("--endpoint", help="S3-compatible endpoint (sets S3_ENDPOINT_URL and AWS_ENDPOINT_URL)")
    ap.add_argument("--cache-dir", required=True, type=Path, help="Mosaic's local cache folder (emptied first)")
    ap.add_argument("--cache-limit", type=parse_bytes, default=None, help="bytes (1e9, 500MB, 2GiB); Mosaic needs >= 4x the largest shard")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--crop", type=int, default=224)
    ap.add_argument("--layout", choices=["nchw", "nhwc"], default="nchw")
    ap.add_argument("--seed", type=int, default=0, help="shuffle_seed of the dataset and torch's seed")
    ap.add_argument("--predownload", type=int, default=None, help="samples to download ahead per worker (Mosaic's default: 8 x batch)")
    ap.add_argument(
        "--shuffle-block-size",
        type=int,
        default=None,
        help="Mosaic's shuffle_block_size [samples] (default: Mosaic's, which spans up to 262,144 samples)",
    )
    ap.add_argument("--sample-ms", type=float, default=50.0, help="cache size sampling interval")
    ap.add_argument("--keep-cache", action="store_true", help="do not empty the cache folder first (a warm start)")
    ap.add_argument("--mp-context", default=None, help="DataLoader multiprocessing_context (default: torch's, fork on Linux)")
    ap.add_argument("--verify-out", type=Path, default=None, help="instead of timing: write the check's batches to this .npz and exit")
    ap.add_argument("--verify-batches", type=int, default=2, help="batches in the check (--verify-out)")
    ap.add_argument("--verify-centre", type=float, default=224 / 256, help="the check's centre-crop ratio (FFCV's default)")
    args = ap.parse_args(argv)
    if (args.remote is None) == (not args.stream):
        ap.error("give --remote, or --stream REMOTE=PROPORTION for each stream of a mix")

    if args.endpoint:
        os.environ["S3_ENDPOINT_URL"] = args.endpoint
        os.environ["AWS_ENDPOINT_URL"] = args.endpoint
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

    t_import = time.perf_counter()
    import streaming
    import torch
    from streaming.base.util import clean_stale_shared_memory

    import_s = time.perf_counter() - t_import
    _count_downloads()
    torch.manual_seed(args.seed)

    cache = args.cache_dir.resolve()
    if cache.exists() and not args.keep_cache:
        shutil.rmtree(cache)
    cache.mkdir(parents=True, exist_ok=True)
    clean_stale_shared_memory()

    if args.verify_out is not None:
        return verify(args, cache)

    counter = tempfile.mkdtemp(prefix="mosaic-downloads-")
    os.environ[COUNTER_ENV] = counter
    sampler = CacheSampler(os.fspath(cache), args.sample_ms / 1000)
    sampler.start()
    try:
        t0 = time.perf_counter()
        source: dict[str, Any] = {"remote": args.remote, "local": os.fspath(cache)}
        if args.stream:  # a mix: one Stream per dataset, each with its own folder in the cache, one cache_limit for all
            source = {"streams": [streaming.Stream(remote=remote, local=os.fspath(cache / str(k)), proportion=float(p))
                                  for k, (remote, _, p) in enumerate(x.rpartition("=") for x in args.stream)],
                      "epoch_size": args.epoch_size}  # fmt: skip
        ds = make_dataset_class()(
            **source, cache_limit=args.cache_limit, shuffle=True, shuffle_seed=args.seed,
            batch_size=args.batch_size, predownload=args.predownload, crop=args.crop, layout=args.layout,
            **({"shuffle_block_size": args.shuffle_block_size} if args.shuffle_block_size else {}),
        )  # fmt: skip
        init_s = time.perf_counter() - t0
        loader = torch.utils.data.DataLoader(
            ds, batch_size=args.batch_size, num_workers=args.workers, persistent_workers=args.workers > 0,
            multiprocessing_context=args.mp_context if args.workers else None,
        )  # fmt: skip
        first_batch_s = None
        batch_info: dict[str, Any] = {}
        epochs = []
        for epoch in range(args.epochs):
            files0, bytes0 = read_counter(counter)
            te = time.perf_counter()
            images = batches = 0
            first_at, first_images = None, 0
            for x, y in loader:
                if first_at is None:
                    first_at, first_images = time.perf_counter(), len(x)
                if first_batch_s is None:
                    first_batch_s = time.perf_counter() - t0
                    batch_info = {
                        "shape": list(x.shape), "dtype": str(x.dtype).removeprefix("torch."), "contiguous": bool(x.is_contiguous()),
                        "labels_shape": list(y.shape), "labels_dtype": str(y.dtype).removeprefix("torch."),
                    }  # fmt: skip
                if x.dtype != torch.uint8 or x.shape[1:] != torch.Size(batch_info["shape"][1:]):
                    raise AssertionError(f"batch {batches} of epoch {epoch + 1}: {tuple(x.shape)} {x.dtype}")
                images += len(x)
                batches += 1
            seconds = time.perf_counter() - te
            files1, bytes1 = read_counter(counter)
            epochs.append({
                "epoch": epoch + 1, "seconds": round(seconds, 3), "images": images, "batches": batches,
                "images_per_s": round(images / seconds, 1),
                "after_first_images_per_s": round((images - first_images) / (te + seconds - first_at), 1) if first_at else 0.0,
                "bytes_downloaded": bytes1 - bytes0, "files_downloaded": files1 - files0,
            })  # fmt: skip
        del loader  # persistent workers end here
    finally:
        sampler.stop()
    files, total = read_counter(counter)
    shutil.rmtree(counter, ignore_errors=True)
    result = {
        "system": "mosaic-streaming",
        "version": streaming.__version__,
        "torch": torch.__version__,
        "remote": args.remote if args.remote else args.stream,
        "samples": len(ds),
        "shards": int(ds.num_shards),
        "max_shard_bytes": int(max(s.get_max_size() for s in ds.shards)),
        "batch_size": args.batch_size,
        "workers": args.workers,
        "crop": args.crop,
        "layout": args.layout,
        "cache_limit": args.cache_limit,
        "predownload": ds.predownload,
        "import_s": round(import_s, 3),
        "init_s": round(init_s, 3),
        "first_batch_s": round(first_batch_s, 3) if first_batch_s is not None else None,
        "epochs": epochs,
        "cold_images_per_s": epochs[0]["images_per_s"] if epochs else None,
        "cold_after_first_images_per_s": epochs[0]["after_first_images_per_s"] if epochs else None,
        "warm_images_per_s": epochs[1]["images_per_s"] if len(epochs) > 1 else None,
        "bytes_downloaded": total,
        "files_downloaded": files,
        "peak_cache_bytes": sampler.peak,
        "cache_samples": sampler.samples,
        "cache_limit_held": None if args.cache_limit is None else sampler.peak <= args.cache_limit,
        "batch": batch_info,
        "process_s": round(time.perf_counter() - T_START, 3),
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
