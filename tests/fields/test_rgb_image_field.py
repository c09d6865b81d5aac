"""RGBImageField: sizes, resizing, write modes, grayscale conversion and rejected inputs."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from stoker.errors import SampleError
from stoker.fields import IntField, RGBImageField
from stoker.fields.rgb_image import MODE_JPEG, MODE_RAW
from stoker.format import DatasetWriter, Reader

SIZES = [(1, 1), (1, 7), (7, 1), (2, 3), (17, 31), (48, 64), (64, 48), (300, 200)]


def smooth_image(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A low-frequency colour gradient: JPEG reproduces it closely."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    y, x = y / max(h - 1, 1), x / max(w - 1, 1)
    channels = []
    for _ in range(3):
        a, b, c, phase = rng.uniform(-1, 1, 4)
        channels.append(128 + 60 * a * x + 40 * b * y + 20 * np.sin(np.pi * (c * x + y) + phase))
    return np.clip(np.stack(channels, axis=-1), 0, 255).astype(np.uint8)


def write(path: Path, field: RGBImageField, images: list[Any], num_workers: int = 1) -> Reader:
    DatasetWriter(path, {"image": field, "i": IntField()}, num_workers=num_workers, progress=False).from_indexed_dataset(
        [(im, i) for i, im in enumerate(images)], chunksize=16
    )
    reader = Reader(path)
    reader.verify()
    return reader


def test_raw_is_exact_for_many_sizes(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in SIZES]
    with write(tmp_path / "d.stoker", RGBImageField(write_mode="raw"), images) as reader:
        for i, want in enumerate(images):
            got, index = reader.read(i)
            assert index == i
            assert got.dtype == np.uint8 and got.shape == want.shape
            np.testing.assert_array_equal(got, want)
        assert (reader.metadata["image/mode"] == MODE_RAW).all()
        np.testing.assert_array_equal(reader.metadata["image/height"], [h for h, _ in SIZES])
        np.testing.assert_array_equal(reader.metadata["image/width"], [w for _, w in SIZES])


def test_jpg_is_close_on_smooth_images(tmp_path: Path) -> None:
    images = [smooth_image(h, w, seed) for seed, (h, w) in enumerate(SIZES)]
    with write(tmp_path / "d.stoker", RGBImageField(write_mode="jpg", jpeg_quality=90), images) as reader:
        assert (reader.metadata["image/mode"] == MODE_JPEG).all()
        for i, want in enumerate(images):
            got = reader.read(i)[0]
            assert got.shape == want.shape
            diff = np.abs(got.astype(np.int16) - want.astype(np.int16))
            if min(want.shape[:2]) >= 16:  # smooth at JPEG's 8x8/16x16 scale
                assert diff.mean() < 3 and diff.max() < 40, (want.shape, diff.mean(), diff.max())
            else:  # a whole gradient in a few pixels, with 4:2:0 chroma: only roughly kept
                assert diff.mean() < 40, (want.shape, diff.mean())
        big = int(np.argmax([h * w for h, w in SIZES]))
        assert reader.metadata["image/size"][big] < images[big].nbytes / 4  # it did compress


def test_jpeg_quality_changes_size(tmp_path: Path) -> None:
    images = [smooth_image(128, 128, s) for s in range(3)]
    with write(tmp_path / "lo.stoker", RGBImageField("jpg", jpeg_quality=30), images) as lo:
        lo_size = int(lo.metadata["image/size"].sum())
    with write(tmp_path / "hi.stoker", RGBImageField("jpg", jpeg_quality=95), images) as hi:
        hi_size = int(hi.metadata["image/size"].sum())
    assert lo_size < hi_size


@pytest.mark.parametrize("write_mode", ["raw", "jpg"])
@pytest.mark.parametrize(("h", "w"), [(300, 200), (200, 300), (100, 100), (64, 10), (50, 40), (1000, 3)])
def test_max_resolution(tmp_path: Path, write_mode: str, h: int, w: int) -> None:
    image = smooth_image(h, w)
    with write(tmp_path / "d.stoker", RGBImageField(write_mode=write_mode, max_resolution=64), [image]) as reader:
        got = reader.read(0)[0]
    gh, gw = got.shape[:2]
    if max(h, w) <= 64:
        assert (gh, gw) == (h, w)
        if write_mode == "raw":
            np.testing.assert_array_equal(got, image)
    else:
        assert max(gh, gw) == 64
        assert (gh >= gw) == (h >= w)
        short = min(h, w) * 64 / max(h, w)
        assert abs(min(gh, gw) - short) <= 1, (got.shape, short)
        assert min(gh, gw) >= 1


def test_smart_mode_compresses_only_large_images(tmp_path: Path) -> None:
    images = [smooth_image(16, 16), smooth_image(200, 120), smooth_image(8, 40), smooth_image(64, 65)]
    field = RGBImageField(write_mode="smart", smart_threshold=64 * 64 * 3)
    with write(tmp_path / "d.stoker", field, images) as reader:
        modes = reader.metadata["image/mode"].tolist()
        assert modes == [MODE_RAW, MODE_JPEG, MODE_RAW, MODE_JPEG]
        np.testing.assert_array_equal(reader.read(0)[0], images[0])
        assert np.abs(reader.read(1)[0].astype(int) - images[1]).mean() < 4


def test_proportion_mixes_and_is_reproducible(tmp_path: Path) -> None:
    images = [smooth_image(8, 8, s) for s in range(200)]
    field = RGBImageField(write_mode="proportion", compress_probability=0.5)
    with write(tmp_path / "a.stoker", field, images, num_workers=1) as a:
        modes = a.metadata["image/mode"].copy()
    with write(tmp_path / "b.stoker", field, images, num_workers=2) as b:
        np.testing.assert_array_equal(b.metadata["image/mode"], modes)
        for i in (0, 1, 2, 3):
            if modes[i] == MODE_RAW:
                np.testing.assert_array_equal(b.read(i)[0], images[i])
    assert 60 < int((modes == MODE_JPEG).sum()) < 140
    assert (tmp_path / "a.stoker").read_bytes() == (tmp_path / "b.stoker").read_bytes()
    with write(tmp_path / "none.stoker", RGBImageField("proportion", compress_probability=0.0), images[:20]) as r:
        assert (r.metadata["image/mode"] == MODE_RAW).all()
    with write(tmp_path / "all.stoker", RGBImageField("proportion", compress_probability=1.0), images[:20]) as r:
        assert (r.metadata["image/mode"] == MODE_JPEG).all()


def test_grayscale_inputs_become_rgb(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    gray = rng.integers(0, 256, (5, 9), dtype=np.uint8)
    images: list[Any] = [gray, gray[:, :, None], Image.fromarray(gray, mode="L"), Image.fromarray(gray).convert("1")]
    rgb = rng.integers(0, 256, (4, 6, 3), dtype=np.uint8)
    images += [Image.fromarray(rgb, mode="RGB"), np.asfortranarray(rgb)]
    with write(tmp_path / "d.stoker", RGBImageField(), images) as reader:
        for i in range(3):
            got = reader.read(i)[0]
            assert got.shape == (5, 9, 3)
            for c in range(3):
                np.testing.assert_array_equal(got[:, :, c], gray)
        binary = reader.read(3)[0]
        assert set(np.unique(binary).tolist()) <= {0, 255}
        np.testing.assert_array_equal(reader.read(4)[0], rgb)
        np.testing.assert_array_equal(reader.read(5)[0], rgb)


@pytest.mark.parametrize("num_workers", [1, 2])
@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (np.zeros((4, 4, 4), np.uint8), "RGBA"),
        (Image.new("RGBA", (4, 4)), "alpha"),
        (Image.new("LA", (4, 4)), "alpha"),
        (Image.new("I;16", (4, 4)), "mode 'I;16'"),
        (np.zeros((3, 8, 8), np.uint8), "CHW"),
        (np.zeros((4, 4, 3), np.float32), "uint8"),
        (np.zeros((0, 4, 3), np.uint8), "non-empty"),
        ("not an image", "PIL image"),
    ],
)
def test_rejected_images_name_index_and_field(tmp_path: Path, num_workers: int, bad: Any, message: str) -> None:
    images: list[Any] = [smooth_image(4, 4)] * 30
    images[17] = bad
    path = tmp_path / "d.stoker"
    with pytest.raises(SampleError, match=re.escape(message)) as info:
        write(path, RGBImageField(), images, num_workers=num_workers)
    assert info.value.index == 17
    assert info.value.field == "image"
    assert "sample 17, field 'image'" in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_field_arguments_are_validated_and_round_trip() -> None:
    field = RGBImageField(write_mode="proportion", max_resolution=256, jpeg_quality=80, compress_probability=0.25, smart_threshold=100)
    assert RGBImageField.from_args(field.to_args()) == field
    with pytest.raises(ValueError, match="write_mode"):
        RGBImageField(write_mode="png")
    with pytest.raises(ValueError, match="max_resolution"):
        RGBImageField(max_resolution=0)
    with pytest.raises(ValueError, match="jpeg_quality"):
        RGBImageField(jpeg_quality=101)
    with pytest.raises(ValueError, match="compress_probability"):
        RGBImageField(compress_probability=1.5)
