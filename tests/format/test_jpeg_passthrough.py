"""JPEG files stored as they are: byte-identical payloads, the loader's pixels equal to a decode of the source."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import simplejpeg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from stoker.convert.imagefolder import convert_image_folder
from stoker.fields import IntField, RGBImageField
from stoker.fields._jpeg_header import jpeg_info, passthrough_problem
from stoker.fields.rgb_image import MODE_JPEG, MODE_RAW
from stoker.format import DatasetWriter, Reader

from .._profile import examples


def photo(h: int, w: int, seed: int) -> np.ndarray:
    """A photo-like picture: smooth gradients plus noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([128 + 90 * np.sin(x / 17 + seed), 128 + 90 * np.cos(y / 23), (x + y) * 255 / (h + w)], axis=-1)
    return np.clip(base + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)


def jpeg_bytes(image: np.ndarray, **options: Any) -> bytes:
    out = io.BytesIO()
    Image.fromarray(image if image.shape[2] == 3 else image[..., 0]).save(out, format="JPEG", **options)
    return out.getvalue()


def source_pixels(data: bytes) -> np.ndarray:
    """libjpeg-turbo's decode of the source, as the loader's decoder does it (accurate DCT, fancy upsampling)."""
    return simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=False, fastupsample=False)


KINDS = {
    "baseline 4:2:0": {"quality": 90, "subsampling": 2},
    "baseline 4:4:4": {"quality": 85, "subsampling": 0},
    "baseline 4:2:2": {"quality": 75, "subsampling": 1},
    "progressive": {"quality": 90, "progressive": True},
    "optimized": {"quality": 60, "optimize": True},
}


def write(path: Path, values: list[Any], field: RGBImageField, num_workers: int = 1) -> None:
    DatasetWriter(path, {"image": field}, num_workers=num_workers, progress=False).from_indexed_dataset(values, chunksize=3)


def test_header_parser_reads_what_pillow_wrote() -> None:
    image = photo(37, 53, 0)
    for name, options in KINDS.items():
        info = jpeg_info(jpeg_bytes(image, **options))
        assert info is not None and (info.height, info.width) == (37, 53), name
        assert info.process == ("progressive" if "progressive" in name else "baseline"), name
        assert passthrough_problem(info, None) is None
        assert passthrough_problem(info, 52) is not None and passthrough_problem(info, 53) is None
    gray = jpeg_info(jpeg_bytes(image[..., :1]))
    assert gray is not None and gray.subsampling == "gray" and passthrough_problem(gray, None) is None
    cmyk = io.BytesIO()
    Image.fromarray(image).convert("CMYK").save(cmyk, format="JPEG")
    info = jpeg_info(cmyk.getvalue())
    assert info is not None and len(info.components) == 4 and "CMYK" in str(passthrough_problem(info, None))
    full = jpeg_bytes(photo(200, 300, 1))
    truncated = jpeg_info(full[: len(full) // 2])
    assert truncated is not None and "EOI" in str(passthrough_problem(truncated, None))
    assert jpeg_info(b"\x89PNG\r\n\x1a\n") is None and jpeg_info(full[:3]) is None


@pytest.mark.parametrize("kind", [*KINDS, "gray"])
@pytest.mark.parametrize("given_as", ["path", "bytes", "pil"])
def test_jpeg_is_stored_byte_for_byte(tmp_path: Path, kind: str, given_as: str) -> None:
    images = [photo(40 + 7 * i, 60 - 3 * i, i) for i in range(5)]
    files = [jpeg_bytes(im[..., :1] if kind == "gray" else im, **KINDS.get(kind, {})) for im in images]
    paths = []
    for i, data in enumerate(files):
        paths.append(tmp_path / f"{i}.jpg")
        paths[-1].write_bytes(data)
    values: list[Any] = list(paths if given_as == "path" else files)
    if given_as == "pil":
        values = [Image.open(io.BytesIO(files[i]) if i == 2 else p) for i, p in enumerate(paths)]  # one opened from memory
        values[1].load()  # decoded but not changed: still stored as is
    out = tmp_path / "d.stoker"
    write(out, values, RGBImageField(write_mode="jpg", jpeg_quality=50))
    for value in values:
        if isinstance(value, Image.Image):
            value.close()
    with Reader(out) as reader:
        meta = reader.metadata
        for i, data in enumerate(files):
            assert meta["image/mode"][i] == MODE_JPEG
            ptr, size = int(meta["image/ptr"][i]), int(meta["image/size"][i])
            assert bytes(reader.storage[ptr : ptr + size]) == data
            assert (meta["image/height"][i], meta["image/width"][i]) == images[i].shape[:2]
            np.testing.assert_array_equal(reader.read(i)[0], source_pixels(data))


def test_what_must_change_is_re_encoded(tmp_path: Path) -> None:
    image = photo(80, 120, 3)
    (tmp_path / "edited.jpg").write_bytes(jpeg_bytes(image))
    edited = Image.open(tmp_path / "edited.jpg")
    edited.load()
    edited.putpixel((0, 0), (255, 0, 0))  # changed in place: its pixels are not the file's any more
    cmyk = io.BytesIO()
    Image.fromarray(image).convert("CMYK").save(cmyk, format="JPEG")
    values = [jpeg_bytes(image), edited, cmyk.getvalue(), jpeg_bytes(image, quality=95)]
    out = tmp_path / "d.stoker"
    write(out, values, RGBImageField(write_mode="jpg", max_resolution=100))  # all wider than 100
    with Reader(out) as reader:
        for i in range(len(values)):
            assert reader.metadata["image/width"][i] == 100
            ptr, size = int(reader.metadata["image/ptr"][i]), int(reader.metadata["image/size"][i])
            assert jpeg_info(bytes(reader.storage[ptr : ptr + size])).process == "baseline"  # type: ignore[union-attr]
    write(out, values, RGBImageField(write_mode="jpg"))
    with Reader(out) as reader:
        stored = [
            bytes(reader.storage[int(p) : int(p) + int(s)]) for p, s in zip(reader.metadata["image/ptr"], reader.metadata["image/size"])
        ]
    assert stored[0] == values[0] and stored[3] == values[3]
    assert stored[1] != values[0] and stored[2] != values[2]  # the edited image and the CMYK file: re-encoded
    edited.close()


def test_write_modes_choose_without_decoding(tmp_path: Path) -> None:
    big, small = jpeg_bytes(photo(80, 90, 1)), jpeg_bytes(photo(30, 30, 2))
    out = tmp_path / "d.stoker"
    write(out, [big, small], RGBImageField(write_mode="smart"))  # smart: JPEG above 64x64 pixels (and when smaller than raw)
    with Reader(out) as reader:
        assert reader.metadata["image/mode"].tolist() == [MODE_JPEG, MODE_RAW]
        np.testing.assert_array_equal(reader.read(1)[0], np.asarray(Image.open(io.BytesIO(small)).convert("RGB")))
    write(out, [big, small], RGBImageField(write_mode="raw"))
    with Reader(out) as reader:
        assert reader.metadata["image/mode"].tolist() == [MODE_RAW, MODE_RAW]
    values = [big] * 200
    write(out, values, RGBImageField(write_mode="proportion", compress_probability=0.5))
    write(tmp_path / "arrays.stoker", [source_pixels(big)] * 200, RGBImageField(write_mode="proportion", compress_probability=0.5))
    with Reader(out) as files, Reader(tmp_path / "arrays.stoker") as arrays:  # the same samples compressed, by index
        assert files.metadata["image/mode"].tolist() == arrays.metadata["image/mode"].tolist()
        assert 50 < int(files.metadata["image/mode"].sum()) < 150


@settings(max_examples=examples(ci=5, long=25), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    h=st.integers(1, 70),
    w=st.integers(1, 70),
    quality=st.integers(5, 100),
    subsampling=st.sampled_from([0, 1, 2]),
    progressive=st.booleans(),
    gray=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_loader_decodes_stored_files_like_libjpeg(
    tmp_path: Path, h: int, w: int, quality: int, subsampling: int, progressive: bool, gray: bool, seed: int
) -> None:
    """Any size, subsampling, progressive or not, gray or colour: the loader gives libjpeg-turbo's decode of the file."""
    from stoker.decoders.rgb_image import CenterCropRGBImageDecoder, SimpleRGBImageDecoder
    from stoker.loader import Loader

    image = photo(h, w, seed)
    data = jpeg_bytes(image[..., :1] if gray else image, quality=quality, subsampling=subsampling, progressive=progressive)
    path = tmp_path / f"{seed}-{h}-{w}.stoker"
    DatasetWriter(
        path, {"image": RGBImageField(write_mode="jpg"), "label": IntField()}, num_workers=1, progress=False
    ).from_indexed_dataset([(data, 0)])
    with Reader(path) as reader:
        assert reader.metadata["image/mode"][0] == MODE_JPEG
    expected = source_pixels(data)
    pil = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(np.int16)
    assert np.abs(expected.astype(np.int16) - pil).max() <= 2  # Pillow's libjpeg agrees within a level or two
    loader = Loader(path, batch_size=1, num_workers=1, pipelines={"image": [SimpleRGBImageDecoder()], "label": None})
    (batch,) = list(loader)
    np.testing.assert_array_equal(np.asarray(batch[0][0]), expected)
    side = min(h, w)
    crop = Loader(
        path, batch_size=1, num_workers=1, pipelines={"image": [CenterCropRGBImageDecoder((side, side), ratio=1.0)], "label": None}
    )
    (cropped,) = list(crop)
    assert np.asarray(cropped[0][0]).shape == (side, side, 3)


def test_imagefolder_copies_jpegs_and_reencodes_on_request(tmp_path: Path) -> None:
    root = tmp_path / "src"
    for i in range(6):
        (root / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        (root / f"c{i % 2}" / f"{i}.jpg").write_bytes(jpeg_bytes(photo(90, 100 + i, i), progressive=i % 3 == 0))
    Image.fromarray(photo(90, 90, 9)).save(root / "c0" / "p.png")
    copied = convert_image_folder(root, tmp_path / "a.stoker", write_mode="jpg", num_workers=2, chunksize=2, progress=False)
    reencoded = convert_image_folder(root, tmp_path / "b.stoker", write_mode="jpg", num_workers=2, progress=False, reencode=True)
    samples = sorted(root.rglob("*.*"), key=lambda p: (p.parent.name, str(p)))
    with Reader(copied.path) as a, Reader(reencoded.path) as b:
        for i, path in enumerate(samples):
            stored_a = bytes(a.storage[int(a.metadata["image/ptr"][i]) :][: int(a.metadata["image/size"][i])])
            stored_b = bytes(b.storage[int(b.metadata["image/ptr"][i]) :][: int(b.metadata["image/size"][i])])
            assert (stored_a == path.read_bytes()) == (path.suffix == ".jpg"), path
            assert stored_b != path.read_bytes()
            assert a.metadata["image/height"][i] == b.metadata["image/height"][i]
            assert a.metadata["image/width"][i] == b.metadata["image/width"][i]


def _segment(marker: int, body: bytes) -> bytes:
    return bytes([0xFF, marker]) + (len(body) + 2).to_bytes(2, "big") + body


@settings(max_examples=100, deadline=None)
@given(
    transform=st.integers(0, 255),
    adobe_first=st.booleans(),
    extras=st.lists(st.binary(max_size=40), max_size=3),
    fill=st.integers(0, 3),
    size=st.tuples(st.integers(1, 65535), st.integers(1, 65535)),
    frame=st.sampled_from([(0xC0, "baseline"), (0xC1, "extended"), (0xC2, "progressive"), (0xC9, "extended, arithmetic")]),
)
def test_header_parser_reads_built_headers(
    transform: int, adobe_first: bool, extras: list[bytes], fill: int, size: tuple[int, int], frame: tuple[int, str]
) -> None:
    """Headers built by hand: APPn segments before or after the frame, fill bytes, the Adobe APP14 transform byte."""
    h, w = size
    sof = _segment(frame[0], bytes([8]) + h.to_bytes(2, "big") + w.to_bytes(2, "big") + bytes([3, 1, 0x22, 0, 2, 0x11, 1, 3, 0x11, 1]))
    adobe = _segment(0xEE, b"Adobe" + bytes([0, 100, 0, 0, 0, 0, transform]))
    apps = [_segment(0xE1 + k, body) for k, body in enumerate(extras)]
    middle = [adobe, *apps, sof] if adobe_first else [*apps, sof, adobe]
    data = b"\xff\xd8" + b"".join(b"\xff" * fill + seg for seg in middle) + _segment(0xDA, bytes(10)) + bytes(20) + b"\xff\xd9"
    info = jpeg_info(data)
    assert info is not None
    assert (info.height, info.width, info.process, info.precision, info.adobe_transform) == (h, w, frame[1], 8, transform)
    assert info.components == ((1, 2, 2), (2, 1, 1), (3, 1, 1)) and info.subsampling == "420" and info.ends_with_eoi
    if frame[0] != 0xC9:  # arithmetic coding is never stored as is
        assert ("RGB" in str(passthrough_problem(info, None))) == (transform == 0)
    assert jpeg_info(data[: len(b"\xff\xd8") + fill + 3]) is None  # cut inside the first segment
