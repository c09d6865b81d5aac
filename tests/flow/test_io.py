"""stoker.io: decoding against Pillow, batches, crops, other formats, errors, normalize, and the GIL released."""

from __future__ import annotations

import io
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import stoker.io as sio


def photo(seed: int, h: int, w: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    base = 128 + 60 * np.sin(xx / (7 + seed))[..., None] * np.cos(yy / 11)[..., None] * np.array([1.0, 0.7, -0.5])
    return np.clip(base + rng.normal(0, 4, (h, w, 3)), 0, 255).astype(np.uint8)


def encode(img: np.ndarray, fmt: str = "JPEG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


@pytest.fixture(scope="module")
def jpegs() -> list[bytes]:
    return [encode(photo(i, 120 + 8 * i, 160 - 4 * i)) for i in range(6)]


def pillow(data: bytes, size: tuple[int, int] | None = None, box: tuple[int, int, int, int] | None = None) -> np.ndarray:
    img = Image.open(io.BytesIO(data)).convert("RGB")
    if box is not None:
        y, x, h, w = box
        img = img.crop((x, y, x + w, y + h))
    if size is not None:
        img = img.resize((size[1], size[0]), Image.BILINEAR)
    return np.asarray(img)


def test_full_decode_matches_pillow(jpegs: list[bytes]) -> None:
    for data in jpegs:
        got, want = sio.decode_image(data), pillow(data)
        assert got.shape == want.shape and got.dtype == np.uint8
        assert np.abs(got.astype(int) - want).mean() < 0.5  # two libjpeg builds: equal but for rounding


@pytest.mark.parametrize(("size", "box"), [((64, 80), None), ((200, 240), None), ((32, 32), (10, 20, 60, 70)), (None, (5, 7, 40, 50))])
def test_resized_and_cropped_decode_is_close_to_pillow(
    jpegs: list[bytes], size: tuple[int, int] | None, box: tuple[int, int, int, int] | None
) -> None:
    for data in jpegs:
        got = sio.decode_image(data, size=size, crop=box)
        want = pillow(data, size, box)
        assert got.shape == want.shape
        assert np.abs(got.astype(int) - want).mean() < 3.0  # another resampling filter than Pillow's


def test_decode_images_fills_one_batch_and_reads_paths_and_other_formats(jpegs: list[bytes], tmp_path: object) -> None:
    path = tmp_path / "a.jpg"  # type: ignore[operator]
    path.write_bytes(jpegs[1])
    png = encode(photo(9, 50, 70), "PNG")
    batch = sio.decode_images([jpegs[0], path, png, np.frombuffer(jpegs[2], np.uint8)], size=(48, 56))
    assert batch.shape == (4, 48, 56, 3) and batch.dtype == np.uint8
    for got, data in zip(batch, [jpegs[0], jpegs[1], png, jpegs[2]]):
        assert np.abs(got.astype(int) - pillow(data, (48, 56))).mean() < 3.0
    with pytest.raises(ValueError, match="one size"):
        sio.decode_images(jpegs[:2])


def cmyk_jpeg(img: np.ndarray, ycck: bool = False) -> bytes:
    """A 4-component JPEG written by Pillow (CMYK, Adobe's inverted convention); with ``ycck`` its Adobe
    marker says YCCK (transform 2), which decoders then convert YCC -> RGB before K: Pillow cannot write YCCK."""
    k = 255 - img.max(axis=2, keepdims=True)
    cmyk = np.concatenate([255 - img - k, k], axis=2).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(cmyk, "CMYK").save(buf, format="JPEG", quality=90)
    data = bytearray(buf.getvalue())
    at = data.find(b"\xff\xee\x00\x0eAdobe")
    assert at >= 0 and data[at + 15] == 0  # APP14 "Adobe": version, flags0, flags1, transform (0: CMYK)
    if ycck:
        data[at + 15] = 2
    return bytes(data)


def test_cmyk_ycck_and_grayscale_jpegs_read_as_pillow_reads_them(jpegs: list[bytes]) -> None:
    """libjpeg-turbo cannot convert CMYK or YCCK to RGB: those go through Pillow; grayscale stays with libjpeg-turbo."""
    img = photo(3, 60, 76)
    cmyk, ycck = cmyk_jpeg(img), cmyk_jpeg(img, ycck=True)
    gray = encode(img[..., 1].copy())
    assert Image.open(io.BytesIO(ycck)).mode == "CMYK" and Image.open(io.BytesIO(gray)).mode == "L"
    for data in (cmyk, ycck):
        assert np.array_equal(sio.decode_image(data), pillow(data))
    assert np.abs(sio.decode_image(gray).astype(int) - pillow(gray)).mean() < 0.5
    items = [jpegs[0], cmyk, ycck, gray, jpegs[1]]
    batch = sio.decode_images(items, size=(30, 40))
    for got, data in zip(batch, items):
        assert np.abs(got.astype(int) - pillow(data, (30, 40))).mean() < 3.0
    crop = sio.decode_image(ycck, size=(20, 20), crop=(5, 6, 40, 50))
    assert np.abs(crop.astype(int) - pillow(ycck, (20, 20), (5, 6, 40, 50))).mean() < 3.0


def test_jpegs_libjpeg_turbo_stops_at_with_a_warning_are_read_by_pillow(jpegs: list[bytes]) -> None:
    """TurboJPEG fails on a corrupt-data warning ("extraneous bytes before marker"); Pillow reads such files."""
    at = jpegs[2].index(b"\xff\xda")
    warned = jpegs[2][:at] + b"\x00\x00" + jpegs[2][at:]
    assert np.array_equal(sio.decode_image(warned), pillow(warned))
    batch = sio.decode_images([jpegs[0], warned], size=(30, 40))
    assert np.abs(batch[1].astype(int) - pillow(warned, (30, 40))).mean() < 3.0


def test_errors_name_the_item_and_the_decoder(jpegs: list[bytes]) -> None:
    with pytest.raises(ValueError, match=r"item 1: .*libjpeg-turbo"):
        sio.decode_images([jpegs[0], jpegs[1][:200]], size=8)
    with pytest.raises(ValueError, match=r"item 2: not a JPEG, and Pillow cannot read it"):
        sio.decode_images([jpegs[0], jpegs[1], b"not an image"], size=8)
    with pytest.raises(ValueError, match="must lie inside"):
        sio.decode_image(jpegs[0], crop=(0, 0, 10_000, 5))
    with pytest.raises(TypeError, match="bytes, a 1-D uint8 array or a path"):
        sio.decode_image(12)  # type: ignore[arg-type]


def test_errors_name_the_file_of_an_item_given_by_its_path(jpegs: list[bytes], tmp_path: Path) -> None:
    """A path given is named in the error (Pillow's own message named its in-memory file: "<_io.BytesIO object ...>")."""
    good, text, cut = tmp_path / "good.jpg", tmp_path / "notes.jpg", tmp_path / "cut.jpg"
    good.write_bytes(jpegs[0])
    text.write_bytes(b"not an image at all")
    cut.write_bytes(jpegs[1][:200])
    with pytest.raises(ValueError, match=rf"^{text}: item 0: not a JPEG, and Pillow cannot read it: not an image format it knows$"):
        sio.decode_image(text)
    with pytest.raises(ValueError, match=rf"^{cut}: item 1: .*libjpeg-turbo"):
        sio.decode_images([good, cut], size=8)
    with pytest.raises(ValueError, match=r"^item 1: not a JPEG") as info:  # (bytes: no path to name)
        sio.decode_images([jpegs[0], b"not an image"], size=8)
    assert "BytesIO" not in str(info.value)
    with pytest.raises(TypeError, match=r"decode_images\(\) needs a sequence of images; got one str"):
        sio.decode_images(str(good))  # type: ignore[arg-type]  # (it read the path's characters as paths)
    with pytest.raises(ValueError, match="whole numbers of pixels"):
        sio.decode_image(good, size=(10.5, 10))  # type: ignore[arg-type]  # (it made a 10x10 image)


@pytest.mark.parametrize("shape", [(0, 8, 3), (8, 0, 3), (0, 0, 3)])
def test_resize_refuses_an_empty_image(shape: tuple[int, int, int]) -> None:
    """The kernel read past an empty image (its output held other memory's bytes); resize() needs a size too."""
    with pytest.raises(ValueError, match=re.escape(f"resize() needs a non-empty image; got shape {shape}")):
        sio.resize(np.zeros(shape, np.uint8), (4, 4))
    from stoker.io import _jpeg

    with pytest.raises(ValueError, match="resize needs a non-empty"):  # (the internal call every resize goes through)
        _jpeg.resize_into(np.zeros(shape, np.uint8), (0.0, 0.0, 1.0, 1.0), np.empty((4, 4, 3), np.uint8))
    with pytest.raises(ValueError, match="must lie inside the 8x6 image"):
        _jpeg.resize_into(np.zeros((8, 6, 3), np.uint8), (0.0, 0.0, 9.0, 6.0), np.empty((4, 4, 3), np.uint8))
    with pytest.raises(ValueError, match=r"resize\(\) needs a size"):
        sio.resize(np.zeros((8, 8, 3), np.uint8), None)  # type: ignore[arg-type]


def test_resize_matches_the_decoders_resize(jpegs: list[bytes]) -> None:
    full = sio.decode_image(jpegs[0])
    assert np.array_equal(sio.resize(full, (30, 40), crop=(4, 6, 50, 60)), sio.decode_image(jpegs[0], (30, 40), (4, 6, 50, 60)))
    assert np.array_equal(sio.resize(full, full.shape[:2]), full)


def test_normalize_and_to_tensor_batch_match_torch() -> None:
    batch = np.random.default_rng(0).integers(0, 256, (2, 5, 7, 3), dtype=np.uint8)
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    want = ((torch.from_numpy(batch).permute(0, 3, 1, 2).float() / 255) - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(
        1, 3, 1, 1
    )
    got = sio.normalize(batch, mean, std)
    assert got.shape == (2, 3, 5, 7) and got.dtype == np.float32
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        sio.normalize(torch.from_numpy(batch), mean, std, channels_first=False), want.permute(0, 2, 3, 1).numpy(), atol=1e-5
    )
    tensor = sio.to_tensor_batch(batch)
    assert tuple(tensor.shape) == (2, 3, 5, 7) and tensor.data_ptr() == batch.ctypes.data  # a view, no copy
    assert sio.to_tensor_batch(batch, contiguous=True).is_contiguous()
    with pytest.raises(ValueError, match="std non-zero"):
        sio.normalize(batch, mean, [1, 0, 1])


def test_threads_decode_at_once_each_with_its_own_handle(jpegs: list[bytes]) -> None:
    want = [sio.decode_image(d, size=(40, 50)) for d in jpegs]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            got = list(pool.map(lambda d: sio.decode_image(d, size=(40, 50)), jpegs * 4))
            assert all(np.array_equal(g, want[i % len(jpegs)]) for i, g in enumerate(got))


def test_decoding_releases_the_gil(jpegs: list[bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    """With a switch interval of a minute, Python threads only take turns when the GIL is released:
    the main thread runs while another decodes only if the decoding does not hold the GIL."""
    from stoker.io import _jpeg

    items = jpegs * 40
    sio.decode_images(items[:2], size=(64, 64))  # compiled before the switch interval is raised
    headers = _jpeg.jpeg_headers([np.frombuffer(d, np.uint8) for d in items])
    monkeypatch.setattr(_jpeg, "jpeg_headers", lambda arrays: headers)  # only the decoding itself may release the GIL
    started, finished = threading.Event(), threading.Event()

    def decode() -> None:
        started.set()
        sio.decode_images(items, size=(64, 64))
        finished.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        thread = threading.Thread(target=decode)
        thread.start()
        started.wait()
        turns = 0
        while not finished.is_set():
            turns += 1
            time.sleep(0)  # hands the GIL back at once
        thread.join()
    finally:
        sys.setswitchinterval(old)
    assert turns > 10, f"the main thread ran {turns} times while another thread decoded {len(items)} images"


def test_spdl_names_decode_and_batch(jpegs: list[bytes], tmp_path: object) -> None:
    path = tmp_path / "x.jpg"  # type: ignore[operator]
    path.write_bytes(jpegs[0])
    desc = sio.get_video_filter_desc(scale_width=32, scale_height=24)
    frame = sio.decode_packets(sio.demux_image(path), filter_desc=desc)
    assert frame.shape == (24, 32, 3)
    buffer = sio.convert_frames([frame, frame])
    tensor = sio.to_torch(buffer).permute(0, 3, 1, 2)
    assert tuple(tensor.shape) == (2, 3, 24, 32) and tensor.dtype == torch.uint8
    with pytest.raises(ValueError, match="scale_width and scale_height only"):
        sio.get_video_filter_desc(scale_width=3, scale_height=3, pix_fmt="rgb24")


def test_convert_frames_holds_the_batch_channels_first() -> None:
    """The NHWC batch's values, in NCHW memory: SPDL's ``to_torch(buffer).permute(0, 3, 1, 2)`` is contiguous without a copy."""
    rng = np.random.default_rng(3)
    frames = [rng.integers(0, 256, (5, 7, 3), dtype=np.uint8) for _ in range(4)]
    buffer = sio.convert_frames(frames)
    assert buffer.shape == (4, 5, 7, 3) and np.array_equal(buffer, np.stack(frames))
    tensor = sio.to_torch(buffer).permute(0, 3, 1, 2)
    assert tensor.is_contiguous() and torch.equal(tensor, torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2))
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    assert np.array_equal(sio.normalize(buffer, mean, std), sio.normalize(np.stack(frames), mean, std)), (
        "the same values from either memory"
    )
    assert sio.to_tensor_batch(buffer).is_contiguous(), "the NCHW view of a channels-first batch needs no copy"
    grey = [rng.integers(0, 256, (5, 7), dtype=np.uint8) for _ in range(2)]  # not HWC: stacked as given
    assert np.array_equal(sio.convert_frames(grey), np.stack(grey))
