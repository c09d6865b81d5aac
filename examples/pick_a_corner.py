"""FFCV's "Fast custom image transforms" guide (PickACorner), with ``ffcv`` replaced by ``stoker``.

``PickACorner`` returns, for each image, its top-left quadrant (one time in
four) or its bottom-right quadrant, in a loop that stoker compiles to
parallel machine code. The guide uses torchvision's CIFAR-10; here a
CIFAR-like dataset of random 32x32 RGB images is drawn and written raw, so
nothing is downloaded.

    python examples/pick_a_corner.py                       # 50,000 images, 100 epochs as in the guide
    python examples/pick_a_corner.py --samples 4096 --epochs 3
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from stoker.decoders import SimpleRGBImageDecoder
from stoker.fields import IntField, RGBImageField
from stoker.loader import Loader, OrderOption
from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.compiler import Compiler
from stoker.pipeline.operation import Operation
from stoker.pipeline.state import State
from stoker.transforms import ToTensor
from stoker.writer import DatasetWriter


class PickACorner(Operation):
    # Return the code to run this operation
    def generate_code(self) -> Callable:
        parallel_range = Compiler.get_iterable()

        def pick_a_corner(images, dst):
            which_corner = np.random.randint(low=0, high=4, size=(images.shape[0]))
            for i in parallel_range(images.shape[0]):
                if which_corner[i] == 0:
                    dst[i] = images[i, : images.shape[1] // 2, : images.shape[2] // 2]
                else:
                    dst[i] = images[i, -images.shape[1] // 2 :, -images.shape[2] // 2 :]

            return dst

        pick_a_corner.is_parallel = True
        return pick_a_corner

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        h, w, c = previous_state.shape
        new_shape = (h // 2, w // 2, c)

        # Everything in the state stays the same other than the shape
        # States are immutable, so we have to edit them using the
        # dataclasses.replace function
        new_state = replace(previous_state, shape=new_shape)

        # We need to allocate memory for the new images
        # so below, we ask for a memory allocation whose width and height is
        # half the original image, with the same type
        # (shape=(,)) of the same type as the image data
        mem_allocation = AllocationQuery(new_shape, previous_state.dtype)
        return (new_state, mem_allocation)


class RandomImages:
    """A CIFAR-like dataset: ``(32x32x3 uint8 image, label in 0..9)``, drawn from a seed."""

    def __init__(self, num_samples: int, seed: int = 0, size: int = 32) -> None:
        rng = np.random.default_rng(seed)
        self.images = rng.integers(0, 256, size=(num_samples, size, size, 3), dtype=np.uint8)
        self.labels = rng.integers(0, 10, size=num_samples)

    def __getitem__(self, idx: int) -> tuple[np.ndarray, int]:
        return self.images[idx], int(self.labels[idx])

    def __len__(self) -> int:
        return len(self.images)


def write_random_cifar(path: str, num_samples: int, seed: int = 0) -> RandomImages:
    """Write a :class:`RandomImages` dataset as the guide writes CIFAR-10: ``RGBImageField()`` (raw) and ``IntField()``."""
    ds = RandomImages(num_samples, seed)
    writer = DatasetWriter(path, {"image": RGBImageField(), "label": IntField()}, num_workers=min(8, os.cpu_count() or 1))
    writer.from_indexed_dataset(ds)
    return ds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=50_000, help="images (CIFAR-10 train: 50,000)")
    parser.add_argument("--epochs", type=int, default=100, help="timed epochs after the first (the guide: 100)")
    parser.add_argument("--num-workers", type=int, default=8, help="loader threads (the guide: 8)")
    parser.add_argument("--out", default=None, help="folder for cifar.stoker (default: a temporary folder)")
    args = parser.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="pick-a-corner-")
    path = os.path.join(out, "cifar.stoker")
    write_random_cifar(path, args.samples)

    BATCH_SIZE = 512
    image_pipelines = {
        "with": [SimpleRGBImageDecoder(), PickACorner(), ToTensor()],
        "without": [SimpleRGBImageDecoder(), ToTensor()],
    }

    for name, pipeline in image_pipelines.items():
        loader = Loader(
            path,
            batch_size=BATCH_SIZE,
            num_workers=args.num_workers,
            order=OrderOption.RANDOM,
            drop_last=True,
            pipelines={"image": pipeline},
        )

        # First epoch includes compilation time
        for ims, labs in loader:  # noqa: B007 - the guide's loop
            pass
        start_time = time.time()
        for _ in range(args.epochs):
            for ims, labs in loader:  # noqa: B007
                pass
        print(f"Method: {name} | Shape: {ims.shape} | Time per epoch: {(time.time() - start_time) / args.epochs:.4f}s")


if __name__ == "__main__":
    main()
