"""Whole-image JPEG decoding without ``tj3DecompressHeader``: ``jpeg_size`` reads the SOF as libjpeg does, or refuses.

``SimpleRGBImageDecoder`` decodes a JPEG whose SOF (read by :func:`jpeg_size`) says the
metadata's size straight into the output, so libjpeg parses its header once. Anything
else goes the checked way (``tj3DecompressHeader``, the size compared with the metadata,
then the decode), which records what went wrong. The fuzz test below holds the kernel
to a Python model of the checked way on mutated JPEGs: same status, same message, same
pixels, and nothing written outside the sample's own output.
"""

from __future__ import annotations

import ctypes
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from stoker.decoders import CenterCropRGBImageDecoder, SimpleRGBImageDecoder
from stoker.fields import IntField, RGBImageField
from stoker.format import Reader
from stoker.image import _kernels as kernels
from stoker.image._kernels import jpeg_size
from stoker.image._turbojpeg import KERNEL_FUNCTIONS, TJPARAM_JPEGHEIGHT, TJPARAM_JPEGWIDTH, TJPF_RGB, TurboJPEG
from stoker.loader import Loader
from stoker.transforms import ToTensor
from stoker.writer import DatasetWriter

H, W = 23, 37  # odd, non-square: a transposed size or an MCU-rounded one shows


def picture(h: int = H, w: int = W, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([(xx * 7 + yy * 3) % 256, (yy * 11) % 256, (xx * yy) % 256], -1)
    return np.clip(base + rng.integers(-20, 21, base.shape), 0, 255).astype(np.uint8)


def encode(image: np.ndarray, mode: str = "RGB", **options: Any) -> bytes:
    out = io.BytesIO()
    Image.fromarray(image).convert(mode).save(out, "JPEG", quality=90, **options)
    return out.getvalue()


def size(data: bytes) -> tuple[int, int]:
    h, w = jpeg_size(np.frombuffer(data, np.uint8), 0, len(data))
    return int(h), int(w)


def segment(marker: int, body: bytes) -> bytes:
    return bytes([0xFF, marker]) + (len(body) + 2).to_bytes(2, "big") + body


def after_soi(data: bytes, extra: bytes) -> bytes:
    return data[:2] + extra + data[2:]


@pytest.mark.parametrize(
    ("shape", "options"),
    [
        ((H, W), {}),
        ((W, H), {"subsampling": 0}),
        ((1, 1), {}),
        ((7, 300), {"subsampling": 1}),
        ((H, W), {"progressive": True}),
        ((H, W), {"optimize": True, "comment": b"a comment"}),
        ((H, W), {"restart_marker_blocks": 1}),
        ((H, W), {"icc_profile": b"\0" * 70_000}),  # split over two APP2 segments
        ((H, W), {"exif": b"Exif\0\0" + b"\1" * 500}),
        ((H, W), {"mode": "L"}),
    ],
)
def test_jpeg_size_reads_what_libjpeg_reads(shape: tuple[int, int], options: dict[str, Any]) -> None:
    mode = options.pop("mode", "RGB")
    data = encode(picture(*shape), mode, **options)
    assert size(data) == shape == libjpeg_header(data)[1:]
    filled = data[:2] + b"\xff\xff" + data[2:]  # fill bytes before a marker: allowed
    assert size(filled) == shape == libjpeg_header(filled)[1:]
    inside = np.frombuffer(b"\x12" * 5 + data + b"\x34" * 3, np.uint8)  # a payload inside the file's storage
    assert tuple(int(v) for v in jpeg_size(inside, 5, len(data))) == shape


SOF0 = segment(0xC0, b"\x08\x00\x10\x00\x10\x03\x01\x22\x00\x02\x11\x01\x03\x11\x01")


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("empty", b""),
        ("no SOI", b"\xff\xd9" + SOF0),
        ("SOI only", b"\xff\xd8"),
        ("bytes between segments", b"\xff\xd8\x00" + SOF0),
        ("a stuffed zero after SOI", b"\xff\xd8\xff\x00" + SOF0),
        ("second SOI", b"\xff\xd8\xff\xd8" + SOF0),
        ("SOS before SOF", b"\xff\xd8" + segment(0xDA, b"\x01\x01\x00\x00\x3f\x00") + SOF0),
        ("EOI before SOF", b"\xff\xd8\xff\xd9" + SOF0),
        ("unsupported SOF5", b"\xff\xd8" + bytes([0xFF, 0xC5]) + SOF0[2:]),
        ("unknown marker", b"\xff\xd8" + segment(0x02, b"") + SOF0),
        ("segment length 1", b"\xff\xd8\xff\xfe\x00\x01" + SOF0),
        ("truncated segment", b"\xff\xd8" + segment(0xFE, b"x" * 40)[:20]),
        ("truncated SOF", b"\xff\xd8" + SOF0[:8]),
        ("SOF length below 8", b"\xff\xd8\xff\xc0\x00\x07\x08\x00\x10\x00\x10"),
    ],
)
def test_jpeg_size_refuses_what_libjpeg_would_not_read_as_it(name: str, data: bytes) -> None:
    assert size(data) == (-1, -1), name


def test_jpeg_size_stays_inside_its_payload() -> None:
    data = encode(picture())
    sof = data.index(b"\xff\xc0")
    storage = np.frombuffer(data, np.uint8)
    assert tuple(int(v) for v in jpeg_size(storage, 0, sof + 6)) == (-1, -1)  # the payload ends inside the SOF
    assert tuple(int(v) for v in jpeg_size(storage, 0, len(data) + 10)) == (-1, -1)  # a size past the storage


# ---- the kernel against the checked way, on mutated JPEGs -----------------------------------------


def libjpeg_header(data: bytes) -> tuple[int, int, int]:
    """``(tj3DecompressHeader's result, height, width)``."""
    tj = TurboJPEG.load()
    assert tj is not None
    (handle,) = tj.new_handles(1, False, False)
    try:
        buf = ctypes.create_string_buffer(data, max(1, len(data)))
        rc = tj.functions["tj3DecompressHeader"](handle, ctypes.addressof(buf), len(data))
        get = tj.functions["tj3Get"]
        return rc, get(handle, TJPARAM_JPEGHEIGHT), get(handle, TJPARAM_JPEGWIDTH)
    finally:
        tj.destroy_handles([handle])


def checked_way(tj: TurboJPEG, handle: int, data: bytes, h: int, w: int) -> tuple[int, bytes, np.ndarray | None]:
    """A Python model of the decoder's checked way for whole images: (status, libjpeg's message, pixels or None)."""
    f = tj.functions
    buf = ctypes.create_string_buffer(data, len(data))
    if f["tj3DecompressHeader"](handle, ctypes.addressof(buf), len(data)) != 0:
        return kernels.ERR_HEADER, ctypes.string_at(f["tj3GetErrorStr"](handle)), None
    if (f["tj3Get"](handle, TJPARAM_JPEGHEIGHT), f["tj3Get"](handle, TJPARAM_JPEGWIDTH)) != (h, w):
        return kernels.ERR_SIZE, b"", None
    f["tj3SetScalingFactor"](handle, 1 | (1 << 32))  # 1/1, packed as the struct is passed
    f["tj3SetCroppingRegion"](handle, 0, 0)
    out = np.zeros((h, w, 3), np.uint8)
    if f["tj3Decompress8"](handle, ctypes.addressof(buf), len(data), out.ctypes.data, w * 3, TJPF_RGB) != 0:
        return kernels.ERR_DECODE, ctypes.string_at(f["tj3GetErrorStr"](handle)), None
    return kernels.OK, b"", out


def mutations(data: bytes, count: int, seed: int) -> list[bytes]:
    """``data`` with 1 to 3 bytes of its header replaced (a third of them in the SOF's size), same length."""
    rng = np.random.default_rng(seed)
    header_end = data.index(b"\xff\xda") + 12
    sof = data.index(b"\xff\xc0")
    out = []
    for k in range(count):
        b = bytearray(data)
        for _ in range(int(rng.integers(1, 4))):
            pos = int(rng.integers(sof + 5, sof + 9)) if k % 3 == 0 else int(rng.integers(0, header_end))
            b[pos] = int(rng.choice([0x00, 0xFF, 0xD8, 0xDA, 0xC0, 0xC5, 0x01, int(rng.integers(0, 256))]))
        out.append(bytes(b))
    return out


class Counted:
    """A C function pointer that counts its calls and forwards them (to check which TurboJPEG calls the kernel makes)."""

    def __init__(self, address: int, restype: Any, argtypes: list[Any]) -> None:
        self.calls = 0
        proto = ctypes.CFUNCTYPE(restype, *argtypes)
        target = proto(address)

        def forward(*args: Any) -> Any:
            self.calls += 1
            return target(*args)

        self.callback = proto(forward)
        self.address = ctypes.cast(self.callback, ctypes.c_void_p).value


@pytest.fixture(scope="module")
def mutated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[bytes]]:
    """A file of 300 copies of one 23x37 JPEG, all but the first mutated in place (the metadata stays intact)."""
    path = tmp_path_factory.mktemp("hdr") / "mutated.stoker"
    images = [(picture(), i) for i in range(300)]
    DatasetWriter(
        path, {"image": RGBImageField(write_mode="jpg", jpeg_quality=90), "label": IntField()}, num_workers=1, progress=False
    ).from_indexed_dataset(images)
    with Reader(path) as reader:
        m = reader.metadata
        ptrs, sizes = np.array(m["image/ptr"]), np.array(m["image/size"])
        stored = bytes(reader.storage[int(ptrs[0]) : int(ptrs[0]) + int(sizes[0])])
    assert len(set(sizes.tolist())) == 1
    payloads = [stored, *mutations(stored, 299, seed=7)]
    with open(path, "r+b") as fh:
        for p, data in zip(ptrs, payloads):
            fh.seek(int(p))
            fh.write(data)
    _reseal(path)
    return path, payloads


def _reseal(path: Path) -> None:
    """Recompute the checksums of a file edited in place: JPEGs damaged before they were written, not on disk (the
    loader's data check refuses bytes damaged on disk before a decoder sees them)."""
    from tests.format.test_reader_errors import reseal

    path.write_bytes(bytes(reseal(bytearray(path.read_bytes()))))


def test_kernel_matches_the_checked_way_on_mutated_jpegs(mutated: tuple[Path, list[bytes]]) -> None:
    """Each JPEG decoded as the checked way decodes it on a fresh handle: whatever the JPEGs before it did to the kernel's."""
    path, payloads = mutated
    decoder = SimpleRGBImageDecoder(on_error="replace")
    loader = Loader(path, batch_size=1, pipelines={"image": [decoder, ToTensor()], "label": None})
    arrays, storage = loader.pipelines[0].arrays, loader.pipelines[0].storage
    status, messages = arrays[10], arrays[11]
    tj = TurboJPEG.load()
    assert tj is not None
    seen = set()
    for j, data in enumerate(payloads):
        (handle,) = tj.new_handles(1, False, False)
        try:
            want_status, want_message, want_pixels = checked_way(tj, handle, data, H, W)
        finally:
            tj.destroy_handles([handle])
        dst = np.full((2, H, W, 3), 77, np.uint8)  # dst[1]: what the kernel must never touch
        kernels.decode_images(np.array([j]), dst[:1], arrays, storage, np.zeros(0, np.uint64))
        assert (dst[1] == 77).all(), f"sample {j}: written past its image"
        got_message = bytes(messages[0]).split(b"\0", 1)[0]
        assert int(status[0, 0]) == want_status, (j, int(status[0, 0]), want_status, got_message, want_message)
        seen.add(want_status)
        if want_status == kernels.OK:
            np.testing.assert_array_equal(dst[0], want_pixels, err_msg=f"sample {j}")
        else:
            assert (dst[0] == 0).all()  # replaced
            if want_status != kernels.ERR_SIZE:
                assert got_message == want_message, j
    assert seen >= {kernels.OK, kernels.ERR_HEADER, kernels.ERR_SIZE, kernels.ERR_DECODE}, seen


@pytest.mark.parametrize("decoder", [SimpleRGBImageDecoder, CenterCropRGBImageDecoder], ids=["whole", "crop"])
def test_a_failed_header_leaves_the_next_jpegs_alone(tmp_path: Path, decoder: Any) -> None:
    """libjpeg left half-way through a failed header would fail every later JPEG of that thread ("Bogus marker length")."""
    path = tmp_path / "one-bad.stoker"
    images = [(picture(seed=i), i) for i in range(40)]
    DatasetWriter(
        path, {"image": RGBImageField(write_mode="jpg"), "label": IntField()}, num_workers=1, progress=False
    ).from_indexed_dataset(images)
    with Reader(path) as reader:
        ptr, size_ = int(reader.metadata["image/ptr"][3]), int(reader.metadata["image/size"][3])
        data = bytes(reader.storage[ptr : ptr + size_])
    with open(path, "r+b") as fh:
        fh.seek(ptr + data.index(b"\xff\xda") + 5)  # the SOS's first component: one the frame does not have
        fh.write(b"\x07")
    _reseal(path)
    decoder = SimpleRGBImageDecoder(on_error="replace") if decoder is SimpleRGBImageDecoder else decoder(16, on_error="replace")
    for _ in range(2):  # the second epoch starts on handles that saw the failure
        for batch, labels in Loader(path, batch_size=40, pipelines={"image": [decoder, ToTensor()]}):
            for k in range(len(labels)):
                j = int(labels[k, 0])
                assert batch[k].numpy().any() == (j != 3), f"sample {j}"
    assert decoder.num_replaced == 2
    assert decoder.describe_error() == "libjpeg-turbo: Invalid component ID 7 in SOS (tj3DecompressHeader failed, TJERR_FATAL)"


def test_whole_images_skip_the_header_call(mutated: tuple[Path, list[bytes]]) -> None:
    """libjpeg parses a good JPEG's header once (in tj3Decompress8); a failed one goes the checked way."""
    path, payloads = mutated
    loader = Loader(path, batch_size=1, pipelines={"image": [SimpleRGBImageDecoder(on_error="replace"), ToTensor()], "label": None})
    arrays, storage = loader.pipelines[0].arrays, loader.pipelines[0].storage
    fps = arrays[5].copy()
    header = Counted(int(fps[KERNEL_FUNCTIONS.index("tj3DecompressHeader")]), ctypes.c_int, [ctypes.c_size_t] * 3)
    fps[KERNEL_FUNCTIONS.index("tj3DecompressHeader")] = header.address
    counted = (*arrays[:5], fps, *arrays[6:])
    dst = np.zeros((1, H, W, 3), np.uint8)
    none = np.zeros(0, np.uint64)
    kernels.decode_images(np.array([0]), dst, counted, storage, none)
    assert header.calls == 0 and int(arrays[10][0, 0]) == kernels.OK
    failed = next(j for j, data in enumerate(payloads) if size(data) == (-1, -1))
    kernels.decode_images(np.array([failed]), dst, counted, storage, none)
    assert header.calls == 1 and int(arrays[10][0, 0]) != kernels.OK
