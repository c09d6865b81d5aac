"""Image decoders against Pillow as the reference."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from stoker.errors import LoaderError, PipelineError
from stoker.fields import IntField, RGBImageField
from stoker.fields._image_kernels import random_resized_crop
from stoker.fields.decoders import CenterCropRGBImageDecoder, RandomResizedCropRGBImageDecoder, SimpleRGBImageDecoder
from stoker.format import Reader
from stoker.loader import Loader, OrderOption
from stoker.pipeline.compiler import Compiler
from stoker.pipeline.random import sample_seeds
from stoker.transforms import ToTensor, ToTorchImage
from stoker.writer import DatasetWriter


def smooth_image(i: int, h: int, w: int) -> np.ndarray:
    """A smooth picture (low-frequency waves): realistic for JPEG, unlike noise."""
    rng = np.random.default_rng(i)
    yy, xx = np.mgrid[0:h, 0:w] / max(h, w)
    chans = [
        127 + 100 * np.sin(rng.uniform(1, 4) * xx + rng.uniform(0, 6)) * np.cos(rng.uniform(1, 4) * yy + rng.uniform(0, 6))
        for _ in range(3)
    ]
    return np.clip(np.stack(chans, -1), 0, 255).astype(np.uint8)


class Images:
    def __init__(self, n: int, size: tuple[int, int] | None) -> None:
        self.n, self.size = n, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        h, w = self.size if self.size else (120 + i % 7 * 23, 90 + i % 5 * 31)
        return smooth_image(i, h, w), i


def write(path: Path, images: Images, mode: str) -> Path:
    DatasetWriter(path, {"image": RGBImageField(write_mode=mode), "label": IntField()}, num_workers=1, progress=False).from_indexed_dataset(
        images
    )
    return path


@pytest.fixture(scope="module")
def jpeg32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write(tmp_path_factory.mktemp("img") / "j32.stoker", Images(150, (32, 32)), "jpg")


@pytest.fixture(scope="module", params=["jpg", "raw", "proportion"])
def varied(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write(tmp_path_factory.mktemp("img") / f"var-{request.param}.stoker", Images(40, None), request.param)


def pillow_decode(reader: Reader, i: int) -> np.ndarray:
    m = reader.metadata[i]
    data = bytes(reader.storage[int(m["image/ptr"]) : int(m["image/ptr"]) + int(m["image/size"])])
    if m["image/mode"] == 0:
        return np.frombuffer(data, np.uint8).reshape(int(m["image/height"]), int(m["image/width"]), 3)
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def pillow_crop_resize(image: np.ndarray, y: int, x: int, ch: int, cw: int, out: tuple[int, int]) -> np.ndarray:
    crop = Image.fromarray(np.ascontiguousarray(image[y : y + ch, x : x + cw]))
    return np.asarray(crop.resize((out[1], out[0]), Image.Resampling.BOX if ch >= out[0] else Image.Resampling.BILINEAR))


def test_jpeg_decoding_matches_pillow(jpeg32: Path) -> None:
    reader = Reader(jpeg32)
    loader = Loader(
        jpeg32, batch_size=64, order=OrderOption.RANDOM, seed=0, pipelines={"image": [SimpleRGBImageDecoder(), ToTensor(), ToTorchImage()]}
    )
    for images, labels in loader:
        assert images.shape[1:] == (3, 32, 32)
        for k in range(len(labels)):
            ref = pillow_decode(reader, int(labels[k, 0]))
            assert np.abs(images[k].permute(1, 2, 0).numpy().astype(int) - ref).mean() < 1.5


@pytest.mark.parametrize(("dct_scaling", "crop_decode"), [(True, True), (False, True), (True, False), (False, False)])
def test_center_crop_matches_pillow(varied: Path, dct_scaling: bool, crop_decode: bool) -> None:
    reader = Reader(varied)
    out = (40, 30)
    loader = Loader(
        varied,
        batch_size=16,
        pipelines={"image": [CenterCropRGBImageDecoder(out, ratio=0.75, dct_scaling=dct_scaling, crop_decode=crop_decode), ToTensor()]},
    )
    for images, labels in loader:
        for k in range(len(labels)):
            full = pillow_decode(reader, int(labels[k, 0]))
            h, w = full.shape[:2]
            c = int(0.75 * min(h, w))
            ref = pillow_crop_resize(full, (h - c) // 2, (w - c) // 2, c, c, out)
            assert np.abs(images[k].numpy().astype(int) - ref).mean() < 3


def test_random_resized_crop_matches_pillow_geometry(varied: Path) -> None:
    reader = Reader(varied)
    decoder = RandomResizedCropRGBImageDecoder(24, scale=(0.3, 1.0))
    loader = Loader(varied, batch_size=8, seed=5, order=OrderOption.RANDOM, pipelines={"image": [decoder, ToTensor()]})
    salt = loader.pipelines[0].steps[0].salt
    for images, labels in loader:
        idx = labels.numpy().ravel()
        seeds = sample_seeds(5, 0, idx, salt)
        for k, i in enumerate(idx):
            full = pillow_decode(reader, int(i))
            h, w = full.shape[:2]
            y, x, ch, cw = random_resized_crop.py_func(h, w, seeds[k], 0.3, 1.0, np.log(3 / 4), np.log(4 / 3))
            assert y >= 0 and x >= 0 and y + ch <= h and x + cw <= w
            ref = pillow_crop_resize(full, y, x, ch, cw, (24, 24))
            assert np.abs(images[k].numpy().astype(int) - ref).mean() < 3


def test_random_crops_depend_on_seed_and_epoch_not_threads(varied: Path) -> None:
    def epochs(workers: int, seed: int) -> list[np.ndarray]:
        loader = Loader(
            varied,
            batch_size=8,
            seed=seed,
            num_workers=workers,
            pipelines={"image": [RandomResizedCropRGBImageDecoder(16), ToTensor()], "label": None},
        )
        return [np.concatenate([im.numpy().copy() for (im,) in loader]) for _ in range(2)]

    one, two, other = epochs(1, 3), epochs(2, 3), epochs(1, 4)
    np.testing.assert_array_equal(one[0], two[0])
    np.testing.assert_array_equal(one[1], two[1])
    assert not np.array_equal(one[0], one[1]), "a new epoch should draw new crops"
    assert not np.array_equal(one[0], other[0]), "another seed should draw other crops"


def test_compiler_off_gives_the_same_pixels(varied: Path) -> None:
    pipes = {"image": [RandomResizedCropRGBImageDecoder(16), ToTensor()]}
    on = [im.numpy().copy() for im, _ in Loader(varied, batch_size=8, seed=1, pipelines=pipes)]
    with Compiler.disabled():
        off = [im.numpy().copy() for im, _ in Loader(varied, batch_size=8, seed=1, pipelines=pipes)]
    for a, b in zip(on, off, strict=True):
        np.testing.assert_array_equal(a, b)


def _corrupt(path: Path, sample: int) -> None:
    reader = Reader(path)
    m = reader.metadata[sample]
    ptr, size = int(m["image/ptr"]), int(m["image/size"])
    reader.close()
    with open(path, "r+b") as fh:  # keep the SOI marker, break everything after it
        fh.seek(ptr + 2)
        fh.write(b"\x00" * (size - 2))
    # checksums no longer match the data region, but metadata is intact: the loader opens it
    # (data checksums are checked by Reader.verify / stoker inspect --verify)


def test_corrupt_jpeg_names_the_sample_or_is_replaced(tmp_path: Path) -> None:
    path = write(tmp_path / "bad.stoker", Images(30, (32, 32)), "jpg")
    _corrupt(path, 17)
    loader = Loader(path, batch_size=8, pipelines={"image": [SimpleRGBImageDecoder(), ToTensor()]})
    with pytest.raises(LoaderError) as info:
        for _ in loader:
            pass
    assert info.value.index == 17 and info.value.field == "image" and "corrupt" in str(info.value)
    decoder = CenterCropRGBImageDecoder(16, on_error="replace")
    seen = 0
    for images, labels in Loader(path, batch_size=8, pipelines={"image": [decoder, ToTensor()]}):
        for k in range(len(labels)):
            seen += 1
            if int(labels[k, 0]) == 17:
                assert not images[k].any()
            else:
                assert images[k].any()
    assert seen == 30 and decoder.num_replaced == 1


def test_mixed_raw_and_jpeg_in_one_file(tmp_path: Path) -> None:
    path = write(tmp_path / "mixed.stoker", Images(40, (24, 24)), "proportion")
    modes = Reader(path).metadata["image/mode"]
    assert 0 < modes.sum() < len(modes), "proportion mode should mix raw and JPEG"
    reader = Reader(path)
    for images, labels in Loader(path, batch_size=10, pipelines={"image": [SimpleRGBImageDecoder(), ToTensor()]}):
        for k in range(len(labels)):
            ref = pillow_decode(reader, int(labels[k, 0]))
            assert np.abs(images[k].numpy().astype(int) - ref).mean() < 1.5


def test_crop_decoder_arguments_are_checked(varied: Path) -> None:
    with pytest.raises(ValueError, match="ratio"):
        CenterCropRGBImageDecoder(8, ratio=0)
    with pytest.raises(ValueError, match="scale"):
        RandomResizedCropRGBImageDecoder(8, scale=(0.5, 0.1))
    with pytest.raises(ValueError, match="on_error"):
        CenterCropRGBImageDecoder(8, on_error="ignore")
    with pytest.raises(PipelineError, match="decodes fields of type rgb_image"):
        Loader(varied, batch_size=4, pipelines={"image": None, "label": [CenterCropRGBImageDecoder(8)]})
