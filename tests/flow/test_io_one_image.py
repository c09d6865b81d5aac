"""stoker.io.decode_image's one-image path: the batch path's pixels, without its per-call arrays; the rest falls back."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

import stoker.io as sio
from stoker.io import _image


def photo(seed: int, h: int, w: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    base = 128 + 60 * np.sin(xx / (5 + seed))[..., None] * np.cos(yy / 9)[..., None] * np.array([1.0, 0.6, -0.4])
    return np.clip(base + rng.normal(0, 6, (h, w, 3)), 0, 255).astype(np.uint8)


def jpeg(img: np.ndarray, subsampling: int = 2) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=90, subsampling=subsampling)
    return buf.getvalue()


JPEGS = [jpeg(photo(0, 75, 100)), jpeg(photo(1, 64, 48), subsampling=0), jpeg(photo(2, 33, 57), subsampling=1)]


@st.composite
def requests(draw: st.DrawFn) -> tuple[bytes, tuple[int, int] | None, tuple[int, int, int, int] | None, bool]:
    """An image, an output size or none, a crop inside it or none, and whether to pass ``out``."""
    data = draw(st.sampled_from(JPEGS))
    h, w = Image.open(io.BytesIO(data)).size[::-1]
    crop = None
    if draw(st.booleans()):
        ch, cw = draw(st.integers(1, h)), draw(st.integers(1, w))
        crop = (draw(st.integers(0, h - ch)), draw(st.integers(0, w - cw)), ch, cw)
    # sizes that keep the decode at full scale, and ones far enough below the crop for 1/2, 1/4, 1/8 in the DCT domain
    size = draw(st.none() | st.tuples(st.integers(1, 2 * h), st.integers(1, 2 * w)) | st.sampled_from([(h, w), (h // 8 or 1, w // 8 or 1)]))
    return data, size, crop, draw(st.booleans())


@settings(max_examples=40, deadline=None)
@given(requests())
def test_one_image_equals_the_batch_path(request: tuple[bytes, tuple[int, int] | None, tuple[int, int, int, int] | None, bool]) -> None:
    """Reference model: ``decode_images([data], size, [crop])[0]``, the same kernels: equal to the last bit."""
    data, size, crop, with_out = request
    want = sio.decode_images([data], size=size, crops=[crop])[0]
    out = np.full(want.shape, 7, np.uint8) if with_out else None
    got = sio.decode_image(data, size=size, crop=crop, out=out)
    assert got.shape == want.shape and got.dtype == np.uint8
    assert np.array_equal(got, want)
    if out is not None:
        assert got is out
    if size is not None:  # the spdl.io names take the same path
        desc = sio.get_video_filter_desc(scale_width=size[1], scale_height=size[0])
        frame = sio.decode_packets(sio.ImagePackets(np.frombuffer(data, np.uint8), "mem"), filter_desc=desc)
        assert np.array_equal(frame, sio.decode_images([data], size=size)[0])


def test_a_jpeg_takes_the_one_image_path_and_the_rest_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A readable RGB JPEG never goes through the batch path; CMYK, a corrupt-data warning, a bad crop or
    ``out`` and non-JPEG data do (it reads them with Pillow, or raises naming the problem)."""
    batch_path = _image._decode_many  # (decode_images' body)
    calls: list[int] = []

    def spy(arrays, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(len(arrays))
        return batch_path(arrays, *args, **kwargs)

    monkeypatch.setattr(_image, "_decode_many", spy)
    for data in JPEGS:
        sio.decode_image(data, size=(20, 30))
        sio.decode_image(data, size=(8, 8), crop=(1, 2, 16, 16))
        sio.decode_image(np.frombuffer(data, np.uint8))
    assert calls == []

    img = photo(3, 40, 52)
    k = 255 - img.max(axis=2, keepdims=True)
    buf = io.BytesIO()
    Image.fromarray(np.concatenate([255 - img - k, k], axis=2).astype(np.uint8), "CMYK").save(buf, format="JPEG", quality=90)
    at = JPEGS[0].index(b"\xff\xda")
    warned = JPEGS[0][:at] + b"\x00\x00" + JPEGS[0][at:]  # libjpeg-turbo: "extraneous bytes before marker"
    png = io.BytesIO()
    Image.fromarray(img).save(png, format="PNG")
    for data in (buf.getvalue(), warned, png.getvalue()):
        assert sio.decode_image(data, size=(10, 12)).shape == (10, 12, 3)
    assert calls == [1, 1, 1]
    with pytest.raises(ValueError, match="must lie inside"):
        sio.decode_image(JPEGS[0], crop=(0, 0, 10_000, 5))
    with pytest.raises(ValueError, match="out must be"):
        sio.decode_image(JPEGS[0], size=(10, 12), out=np.empty((10, 13, 3), np.uint8))
    with pytest.raises(ValueError, match=r"item 0: .*libjpeg-turbo"):
        sio.decode_image(JPEGS[0][:200], size=8)
    assert calls == [1, 1, 1, 1, 1, 1]


def test_a_truncated_jpeg_leaves_the_decoder_sound(tmp_path: Path) -> None:
    """After libjpeg-turbo fails on a truncated stream, the next header call on that handle "succeeded" without
    reading (the last image's size, or -1), and the decode sized from it overran memory. Each failure, in either
    path, must raise and leave the next decodes exact. In a child process, from its first decode: the old failure
    corrupted its heap."""
    good, cut = tmp_path / "good.jpg", tmp_path / "cut.jpg"
    good.write_bytes(JPEGS[0])
    cut.write_bytes(JPEGS[0][:200])  # the frame header is whole; the stream ends before its scan
    sizes = ((30, 40), (75, 100), (9, 12))
    for k, size in enumerate(sizes):
        np.save(tmp_path / f"want{k}.npy", sio.decode_images([JPEGS[0]], size=size)[0])
    code = textwrap.dedent(
        f"""
        import numpy as np, stoker.io as sio
        good, cut = open({str(good)!r}, "rb").read(), open({str(cut)!r}, "rb").read()
        want = [np.load({str(tmp_path)!r} + f"/want{{k}}.npy") for k in range({len(sizes)})]
        for _ in range(3):
            for call in (lambda: sio.decode_image(cut, size=8), lambda: sio.decode_images([cut], size=8),
                         lambda: sio.decode_images([good, cut, good], size=8)):
                try:
                    call()
                    raise SystemExit("a truncated JPEG decoded without an error")
                except ValueError as exc:
                    assert "libjpeg-turbo" in str(exc), exc
                for s, w in zip({sizes!r}, want):
                    assert np.array_equal(sio.decode_image(good, size=s), w), ("decode_image", s)
                    assert np.array_equal(sio.decode_images([good], size=s)[0], w), ("decode_images", s)
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", f"rc {proc.returncode}: {proc.stdout[-500:]} {proc.stderr[-800:]}"
