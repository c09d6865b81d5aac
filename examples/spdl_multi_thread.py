#!/usr/bin/env python3
"""SPDL's ``multi_thread_preprocessing`` example, with ``spdl.pipeline`` -> ``stoker.flow`` and ``spdl.io`` -> ``stoker.io``.

It compares a stoker flow (decode + resize on the pipeline's threads, without the
GIL, then batching and normalizing in the main process) with PyTorch's DataLoader
(Pillow in worker processes), for 1, 2, 4, 8 workers and four configurations:

1. Image decoding and resizing
2. Image decoding, resizing, and batching
3. Image decoding, resizing, batching, and normalization
4. Image decoding, resizing, batching, normalization, and transfer to GPU (only with CUDA)

``exp_torch`` and ``exp_spdl`` are SPDL's code; only the imports differ. The dataset
is torchvision's ``ImageNet`` when torchvision is installed and ``--root-dir`` points
at ImageNet; otherwise a folder of generated photo-like JPEGs (about 500x375,
quality 90) in ImageNet's layout is read by the small stand-ins below.

    python examples/spdl_multi_thread.py                          # generated JPEGs
    python examples/spdl_multi_thread.py --root-dir ~/imagenet    # ImageNet (needs torchvision)

For timings with several runs, checks and the ratios, see ``benchmarks/flow.py``.
"""

# pyre-unsafe

import logging
import multiprocessing
import os
import tempfile
import time
from collections.abc import Iterable
from multiprocessing import Process, Queue

import numpy as np
import torch

import stoker.io
from stoker.flow import PipelineBuilder

try:
    from torchvision.datasets import ImageNet as _TorchvisionImageNet
    from torchvision.transforms import Compose, Normalize, PILToTensor, Resize
except ImportError:  # the stand-ins below do the same
    _TorchvisionImageNet = Compose = Normalize = PILToTensor = Resize = None  # type: ignore[assignment,misc]

__all__ = [
    "entrypoint",
    "exp_spdl",
    "exp_torch",
    "run_dataloader",
]


logging.getLogger().setLevel(logging.ERROR)


# ---- torchvision stand-ins (only when torchvision is not installed) ------------------------------
def ImageNet(root, split, **kwargs):
    """torchvision's ``ImageNet`` for a real ImageNet folder (with its ``meta.bin``), else :class:`_ImageFolderSplit`."""
    if _TorchvisionImageNet is not None and os.path.exists(os.path.join(root, "meta.bin")):
        return _TorchvisionImageNet(root=root, split=split, **kwargs)
    return _ImageFolderSplit(root, split, **kwargs)


class _ImageFolderSplit(torch.utils.data.Dataset):
    """``torchvision.datasets.ImageNet``'s interface over ``root/split/<class>/<image>.JPEG``."""

    def __init__(self, root, split, transform=None, loader=None):
        base = os.path.join(root, split)
        classes = sorted(d for d in os.listdir(base) if os.path.isdir(os.path.join(base, d)))
        self.samples = [(os.path.join(base, c, f), i) for i, c in enumerate(classes) for f in sorted(os.listdir(os.path.join(base, c)))]
        self.transform = transform
        self.loader = loader or _pil_loader

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        path, target = self.samples[index]
        sample = self.loader(path)
        if self.transform is not None:
            sample = self.transform(sample)
        return sample, target


def _pil_loader(path):
    from PIL import Image

    with open(path, "rb") as f, Image.open(f) as img:
        return img.convert("RGB")


class _Compose:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


class _Resize:
    """``torchvision.transforms.Resize((h, w))`` on a PIL image: Pillow's antialiased bilinear."""

    def __init__(self, size):
        self.size = size

    def __call__(self, img):
        from PIL import Image

        return img.resize((self.size[1], self.size[0]), Image.BILINEAR)


class _PILToTensor:
    def __call__(self, img):
        return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).contiguous()


class _Normalize:
    def __init__(self, mean, std):
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, tensor):
        return (tensor - self.mean) / self.std


if Compose is None:
    Compose, Normalize, PILToTensor, Resize = _Compose, _Normalize, _PILToTensor, _Resize


# ---- a folder of photo-like JPEGs ------------------------------------------------------------------
def photo(seed: int, h: int = 375, w: int = 500) -> np.ndarray:
    """Smooth shapes, 1/f texture and sensor grain: JPEG sizes like photographs (about 90 KB at q90)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = np.zeros((h, w, 3), np.float32)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32) / max(h, w)
    for c in range(3):
        out[..., c] = 127 + 70 * np.sin(rng.uniform(1, 6) * xx + rng.uniform(0, 6)) * np.cos(rng.uniform(1, 6) * yy + rng.uniform(0, 6))
    cells = 4
    while cells <= max(h, w) // 2:
        grid = rng.standard_normal((cells, cells, 3)).astype(np.float32)
        layers = [np.asarray(Image.fromarray(grid[..., c]).resize((w, h), Image.BICUBIC)) for c in range(3)]
        out += 90.0 / np.sqrt(cells) * np.stack(layers, axis=-1)
        cells *= 2
    out += rng.normal(0, 13, (h, w, 1)).astype(np.float32)
    return np.clip(out, 0, 255).astype(np.uint8)


def make_image_folder(root: str, num_images: int, split: str = "val", num_classes: int = 4, quality: int = 90) -> str:
    """Write ``num_images`` generated JPEGs into ``root/split/<class>/``, ImageNet's layout; returns ``root``."""
    from PIL import Image

    for i in range(num_images):
        folder = os.path.join(root, split, f"n{i % num_classes:08d}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"img_{i:06d}.JPEG")
        if not os.path.exists(path):
            h, w = (375, 500) if i % 3 else (500, 375)
            Image.fromarray(photo(i, h, w)).save(path, format="JPEG", quality=quality)
    return root


# ---- SPDL's code: only the imports differ ------------------------------------------------------------
def run_dataloader(
    dataloader: Iterable,
    max_items: int,
) -> tuple[int, float]:
    """Run the given dataloader and measure its performance.

    Args:
        dataloader: The dataloader to benchmark.
        max_items: The maximum number of items to process.

    Returns:
        The number of items processed and the elapsed time in seconds.
    """
    num_items = 0
    t0 = time.monotonic()
    try:
        for i, (data, _) in enumerate(dataloader, start=1):
            num_items += 1 if data.ndim == 3 else len(data)
            if i >= max_items:
                break
    finally:
        elapsed = time.monotonic() - t0
    return num_items, elapsed


def exp_torch(
    *,
    root_dir: str,
    split: str,
    num_workers: int,
    max_items: int,
    batch_size: int | None = None,
    normalize: bool = False,
    transfer: bool = False,
) -> tuple[int, float]:
    """Load data with PyTorch native operation using PyTorch DataLoader.

    This is the baseline for comparison.

    Args:
        root_dir: The root directory of the ImageNet dataset.
        split: The dataset split, such as "train" and "val".
        num_workers: The number of workers to use.
        max_items: The maximum number of items to process.
        batch: Whether to batch the data.
        normalize: Whether to normalize the data. Only applicable when ``batch`` is True.
        transfer: Whether to transfer the data to GPU.

    Returns:
        The number of items processed and the elapsed time in seconds.
    """
    dataset = ImageNet(
        root=root_dir,
        split=split,
        transform=Compose([Resize((224, 224)), PILToTensor()]),
    )

    normalize_transform = Normalize(
        mean=[0.485, 0.456, 0.406],
        std=[0.229, 0.224, 0.225],
    )

    def collate(item):
        batch, cls = torch.utils.data.default_collate(item)
        if normalize:
            batch = batch.float() / 255
            batch = normalize_transform(batch)
        return batch, cls

    dataloader = torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=num_workers,
        collate_fn=None if batch_size is None else collate,
        prefetch_factor=1,
        multiprocessing_context="fork",
    )

    if transfer:

        def with_transfer(dataloader):
            for tensor, cls in dataloader:
                tensor = tensor.cuda()
                yield tensor, cls

        dataloader = with_transfer(dataloader)

    with torch.no_grad():
        return run_dataloader(dataloader, max_items)


def exp_spdl(
    *,
    root_dir: str,
    split: str,
    num_workers: int,
    max_items: int,
    batch_size: int | None = None,
    normalize: bool = False,
    transfer: bool = False,
) -> tuple[int, float]:
    """Load data with SPDL operation using SPDL Pipeline.

    Args:
        root_dir: The root directory of the ImageNet dataset.
        split: The dataset split, such as "train" and "val".
        num_workers: The number of workers to use.
        max_items: The maximum number of items to process.
        batch: Whether to batch the data.
        normalize: Whether to normalize the data. Only applicable when ``batch`` is True.
        transfer: Whether to transfer the data to GPU.

    Returns:
        The number of items processed and the elapsed time in seconds.
    """
    filter_desc = stoker.io.get_video_filter_desc(
        scale_width=224,
        scale_height=224,
    )

    def decode_image(path):
        packets = stoker.io.demux_image(path)
        return stoker.io.decode_packets(packets, filter_desc=filter_desc)

    dataset = ImageNet(
        root=root_dir,
        split=split,
        loader=decode_image,
    )

    def convert(items):
        frames, cls = list(zip(*items))
        buffer = stoker.io.convert_frames(frames)
        tensor = stoker.io.to_torch(buffer).permute(0, 3, 1, 2)
        return tensor, cls

    builder = (
        PipelineBuilder()
        .add_source(range(len(dataset)))
        .pipe(dataset.__getitem__, concurrency=num_workers)
        .aggregate(batch_size or 1)
        .pipe(convert)
    )

    if normalize:
        transform = Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])

        def normalize(item):
            tensor, cls = item
            tensor = tensor.float() / 255
            tensor = transform(tensor)
            return tensor, cls

        builder = builder.pipe(normalize)

    if transfer:
        builder = builder.pipe(lambda item: (item[0].cuda(), item[1]))

    builder = builder.add_sink(num_workers)
    pipeline = builder.build(num_threads=num_workers)

    with torch.no_grad(), pipeline.auto_stop():
        return run_dataloader(pipeline, max_items)


##############################################################################
# Execute the test function in subprocess, so as to isolate them
##############################################################################
def exp_torch_(queue, **kwargs):
    queue.put(exp_torch(**kwargs))


def exp_spdl_(queue, **kwargs):
    queue.put(exp_spdl(**kwargs))


def run_in_process(func, **kwargs):
    queue = Queue()
    Process(target=func, args=[queue], kwargs=kwargs).run()
    return queue.get()


def run_test(num_workers_=(1, 2, 4, 8), **kwargs):
    data = {}
    for func in [exp_torch_, exp_spdl_]:
        print(func.__name__)
        print("\tnum_workers\tFPS")
        y = []
        for num_workers in num_workers_:
            num_images, elapsed = run_in_process(func, num_workers=num_workers, **kwargs)
            qps = num_images / elapsed
            y.append(qps)
            print(f"\t{num_workers}\t{qps:8.2f} ({num_images} / {elapsed:5.2f})")

        data[func.__name__] = (num_workers_, y)

    return data


def _print(data):
    for i, (x, y) in enumerate(data.values()):
        if i == 0:
            print("\t".join(str(v) for v in x))
        print("\t".join(f"{v:.2f}" for v in y))


def entrypoint(
    root_dir: str,
    split: str,
    batch_size: int,
    max_items: int,
    num_workers_=(1, 2, 4, 8),
):
    """The main entrypoint for CLI.

    Args:
        root_dir: The root directory of the ImageNet dataset.
        split: Dataset split, such as "train" and "val".
        batch_size: The batch size to use.
        max_items: The maximum number of items to process.
        num_workers_: The worker counts to compare.
    """
    multiprocessing.set_start_method("spawn", force=True)

    argset = [
        {"batch_size": None},
        {"batch_size": batch_size},
        {"batch_size": batch_size, "normalize": True},
    ]
    if torch.cuda.is_available():
        argset.append({"batch_size": batch_size, "normalize": True, "transfer": True})

    for kwargs in argset:
        print(kwargs)
        data = run_test(num_workers_, root_dir=root_dir, split=split, max_items=max_items, **kwargs)
        _print(data)


def _parse_args():
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--root-dir", help="Directory where the ImageNet dataset is stored (default: generated JPEGs).", default=None)
    parser.add_argument("--num-images", type=int, default=320, help="Images to generate when --root-dir is not given.")
    parser.add_argument("--batch-size", default=32, type=int)
    parser.add_argument("--max-items", type=int, help="The maximum number of items (images or batches) to process.", default=100)
    parser.add_argument("--split", default="val")
    parser.add_argument("--workers", default="1,2,4,8", help="Comma-separated worker counts.")
    return parser.parse_args()


if __name__ == "__main__":
    _args = _parse_args()
    workers = tuple(int(w) for w in _args.workers.split(","))
    if _args.root_dir is None:
        with tempfile.TemporaryDirectory(prefix="stoker-jpegs-") as tmp:
            make_image_folder(tmp, _args.num_images, _args.split)
            entrypoint(tmp, _args.split, _args.batch_size, _args.max_items, workers)
    else:
        entrypoint(_args.root_dir, _args.split, _args.batch_size, _args.max_items, workers)
