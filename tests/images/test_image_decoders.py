"""Image decoders: pixels against Pillow, crop geometry on sharp edges, corrupt and crafted files.

Geometry is checked on images made of sharp-edged cells at irregular positions, by
the *largest* error against a reference of the same crop box: Pillow decodes the
JPEG at the scale the decoder picks (libjpeg's 1/2, 1/4, 1/8 DCT scaling, through
``Image.draft``), and a numpy model resamples the box (area when shrinking,
bilinear when enlarging). A crop one source pixel off changes edge pixels by far
more than the tolerance, even at 1/8 scale (an eighth of a decoded pixel there).
"""

from __future__ import annotations

import gc
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from stoker.decoders import CenterCropRGBImageDecoder, RandomResizedCropRGBImageDecoder, SimpleRGBImageDecoder
from stoker.errors import LoaderError, PipelineError
from stoker.fields import IntField, RGBImageField
from stoker.format import Reader
from stoker.image._kernels import jpeg_rows, jpeg_scratch_size, random_resized_crop
from stoker.image._turbojpeg import JPEG_ROWS_OFFSET
from stoker.loader import Loader, OrderOption
from stoker.pipeline.compiler import Compiler
from stoker.pipeline.random import sample_seeds
from stoker.transforms import ToTensor, ToTorchImage
from stoker.writer import DatasetWriter
from tests.images._reference import reference_crop

# ---- images and datasets -------------------------------------------------------------------------


def smooth_image(i: int, h: int, w: int) -> np.ndarray:
    """A smooth colour picture (low-frequency waves): realistic for JPEG, unlike noise."""
    rng = np.random.default_rng(i)
    yy, xx = np.mgrid[0:h, 0:w] / max(h, w)
    chans = [
        127 + 100 * np.sin(rng.uniform(1, 4) * xx + rng.uniform(0, 6)) * np.cos(rng.uniform(1, 4) * yy + rng.uniform(0, 6))
        for _ in range(3)
    ]
    return np.clip(np.stack(chans, -1), 0, 255).astype(np.uint8)


def _cuts(rng: np.random.Generator, n: int) -> np.ndarray:
    """Cell index of each of ``n`` pixels: cells of irregular widths, so that no shift maps the pattern onto itself."""
    lo = max(2, n // 40)
    widths = rng.integers(lo, 3 * lo + 1, size=n)
    return np.searchsorted(np.cumsum(widths), np.arange(n), side="right")


def sharp_image(i: int, h: int, w: int) -> np.ndarray:
    """Grey cells with sharp edges at irregular positions (grey: JPEG's subsampled chroma stays constant)."""
    rng = np.random.default_rng(1000 + i)
    rows, cols = _cuts(rng, h), _cuts(rng, w)
    parity = (np.arange(rows.max() + 1)[:, None] + np.arange(cols.max() + 1)[None, :]) % 2
    levels = 25 + 165 * parity + rng.integers(0, 40, size=parity.shape)  # every edge a step of 125..205
    grey = levels[rows[:, None], cols[None, :]]
    return np.repeat(grey[:, :, None], 3, axis=2).astype(np.uint8)


class Images:
    """(image, index) samples of given sizes."""

    def __init__(self, sizes: list[tuple[int, int]], make: Any = smooth_image) -> None:
        self.sizes, self.make = sizes, make

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.make(i, *self.sizes[i]), i


def write(path: Path, images: Images, mode: str, quality: int = 90) -> Path:
    field = RGBImageField(write_mode=mode, jpeg_quality=quality)
    DatasetWriter(path, {"image": field, "label": IntField()}, num_workers=1, progress=False).from_indexed_dataset(images)
    return path


def varied_sizes(n: int) -> list[tuple[int, int]]:
    return [(120 + i % 7 * 23, 90 + i % 5 * 31) for i in range(n)]


#: sharp images: large ones (the decoder reaches 1/8 DCT scaling), non-square ones both ways, small ones (enlarged)
SHARP_SIZES = [(2000, 1800), (1700, 2100), (950, 1300), (640, 480), (333, 251), (150, 90), (37, 53), (23, 17)]


@pytest.fixture(scope="module")
def jpeg32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write(tmp_path_factory.mktemp("img") / "j32.stoker", Images([(32, 32)] * 150), "jpg")


@pytest.fixture(scope="module", params=["jpg", "raw", "proportion"])
def varied(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write(tmp_path_factory.mktemp("img") / f"var-{request.param}.stoker", Images(varied_sizes(40)), request.param)


@pytest.fixture(scope="module", params=["jpg", "raw"])
def sharp(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("img") / f"sharp-{request.param}.stoker"
    return write(path, Images(SHARP_SIZES, sharp_image), request.param, quality=95)


# ---- references ----------------------------------------------------------------------------------


def payload(reader: Reader, i: int) -> tuple[bytes, int, int, int]:
    m = reader.metadata[i]
    ptr, size = int(m["image/ptr"]), int(m["image/size"])
    return bytes(reader.storage[ptr : ptr + size]), int(m["image/height"]), int(m["image/width"]), int(m["image/mode"])


def pillow_decode(reader: Reader, i: int, num: int = 8) -> np.ndarray:
    """Sample ``i`` decoded by Pillow, at ``num``/8 of its size (libjpeg's DCT scaling; JPEG only)."""
    data, h, w, mode = payload(reader, i)
    if mode == 0:
        assert num == 8
        return np.frombuffer(data, np.uint8).reshape(h, w, 3)
    image = Image.open(io.BytesIO(data))
    if num != 8:
        k = 8 // num
        image.draft("RGB", (max(1, w // k), max(1, h // k)))
        assert image.size == (-(-w // k), -(-h // k)), (image.size, w, h, k)
    return np.asarray(image.convert("RGB"))


def dct_num(reader: Reader, i: int, ch: int, cw: int, out: tuple[int, int], dct_scaling: bool) -> int:
    """The decoder's documented choice: the smallest of 1/8, 1/4, 1/2 that keeps the crop at least the output's size."""
    if not dct_scaling or payload(reader, i)[3] == 0:
        return 8
    return next((m for m in (1, 2, 4) if ch * m >= 8 * out[0] and cw * m >= 8 * out[1]), 8)


def check_crop(reader: Reader, i: int, got: np.ndarray, box: tuple[int, int, int, int], dct_scaling: bool) -> int:
    """Assert that ``got`` is the box of sample ``i``, to the pixel; returns the DCT scale used (num/8)."""
    out = got.shape[:2]
    y, x, ch, cw = box
    num = dct_num(reader, i, ch, cw, out, dct_scaling)
    s = num / 8
    ref = reference_crop(pillow_decode(reader, i, num), (y * s, x * s, ch * s, cw * s), out)
    err = np.abs(got.astype(int) - ref)
    assert err.max() <= 1, f"sample {i}: box {box} at scale {num}/8 is off by up to {err.max()} (mean {err.mean():.2f})"
    return num


def run_epoch(loader: Loader) -> list[tuple[int, int, np.ndarray]]:
    """(position in the epoch, sample index, image) for every sample of one epoch."""
    out = []
    for images, labels in loader:
        for k in range(len(labels)):
            out.append((len(out), int(labels[k, 0]), images[k].numpy().copy()))
    return out


# ---- pixels --------------------------------------------------------------------------------------


def test_jpeg_decoding_matches_pillow(jpeg32: Path) -> None:
    reader = Reader(jpeg32)
    loader = Loader(
        jpeg32, batch_size=64, order=OrderOption.RANDOM, seed=0, pipelines={"image": [SimpleRGBImageDecoder(), ToTensor(), ToTorchImage()]}
    )
    for images, labels in loader:
        assert images.shape[1:] == (3, 32, 32)
        for k in range(len(labels)):
            ref = pillow_decode(reader, int(labels[k, 0]))
            assert np.abs(images[k].permute(1, 2, 0).numpy().astype(int) - ref).max() <= 1


@pytest.mark.filterwarnings("ignore::stoker.loader.loader.HeldBatchesWarning")
@pytest.mark.parametrize("num_workers", [1, 2])
def test_whole_jpegs_decode_into_memory_off_the_32_byte_boundaries_and_kept_batches_stay(jpeg32: Path, num_workers: int) -> None:
    """Every slot of a whole-JPEG decoder's output starts JPEG_ROWS_OFFSET bytes past a 64-byte boundary (rows on
    a 32-byte boundary get libjpeg-turbo's non-temporal stores), fresh memory for kept batches included; and such
    memory still tells kept batches apart: every batch of two epochs, all kept (the last, short one a view of its
    slot's memory), equals Pillow's decode at the end."""
    reader = Reader(jpeg32)
    loader = Loader(
        jpeg32, batch_size=16, num_workers=num_workers, batches_ahead=1, order=OrderOption.RANDOM, seed=1,
        pipelines={"image": [SimpleRGBImageDecoder(), ToTensor()]},
    )  # fmt: skip
    kept = list(loader) + list(loader)
    assert len(kept[len(kept) // 2 - 1][1]) < 16  # epoch 0's last batch, short, kept while epoch 1 reuses slots
    assert loader.stats()["loader"]["kept_batches"] > 0  # slots were given fresh memory
    slots = loader.pipelines[0]._views
    decoder_memory = [views[0] for views in slots]
    assert all(m.ctypes.data % 64 == JPEG_ROWS_OFFSET for m in decoder_memory)
    assert {images.data_ptr() % 64 for images, _ in kept} == {JPEG_ROWS_OFFSET}  # 32x32x3 bytes an image: each at the offset
    for images, labels in kept:
        for k in range(len(labels)):
            assert np.abs(images[k].numpy().astype(int) - pillow_decode(reader, int(labels[k, 0]))).max() <= 1


@settings(max_examples=300, deadline=None)
@given(address=st.integers(0, 2**47), height=st.integers(1, 65535), width=st.integers(1, 65535))
def test_scratch_rows_for_libjpeg_start_off_the_32_byte_boundaries(address: int, height: int, width: int) -> None:
    start, pitch = jpeg_rows(address, width)
    assert 0 <= start < 32 and (address + start) % 32 == JPEG_ROWS_OFFSET
    assert pitch % 32 == 0 and 3 * width <= pitch < 3 * width + 32  # so every row starts at the offset
    assert start + height * pitch <= jpeg_scratch_size(height, width)


def test_whole_sharp_images_are_decoded_to_the_pixel(tmp_path: Path) -> None:
    path = write(tmp_path / "same.stoker", Images([(451, 333)] * 4, sharp_image), "jpg", quality=95)
    reader = Reader(path)
    for _, i, got in run_epoch(Loader(path, batch_size=4, pipelines={"image": [SimpleRGBImageDecoder(), ToTensor()]})):
        assert np.abs(got.astype(int) - pillow_decode(reader, i)).max() <= 1


def test_mixed_raw_and_jpeg_in_one_file(tmp_path: Path) -> None:
    path = write(tmp_path / "mixed.stoker", Images([(24, 24)] * 40), "proportion")
    reader = Reader(path)
    modes = reader.metadata["image/mode"]
    assert 0 < modes.sum() < len(modes), "proportion mode should mix raw and JPEG"
    for _, i, got in run_epoch(Loader(path, batch_size=10, pipelines={"image": [SimpleRGBImageDecoder(), ToTensor()]})):
        assert np.abs(got.astype(int) - pillow_decode(reader, i)).max() <= 1


# ---- geometry ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("dct_scaling", "crop_decode"), [(True, True), (False, True), (True, False), (False, False)])
@pytest.mark.parametrize(("out", "ratio"), [((224, 160), 1.0), ((40, 64), 0.75)])
def test_center_crop_lands_on_the_right_pixels(
    sharp: Path, dct_scaling: bool, crop_decode: bool, out: tuple[int, int], ratio: float
) -> None:
    reader = Reader(sharp)
    decoder = CenterCropRGBImageDecoder(out, ratio=ratio, dct_scaling=dct_scaling, crop_decode=crop_decode)
    scales = set()
    for _, i, got in run_epoch(Loader(sharp, batch_size=3, pipelines={"image": [decoder, ToTensor()]})):
        h, w = SHARP_SIZES[i]
        c = max(1, int(ratio * min(h, w)))  # FFCV's centre crop: a centred square
        scales.add(check_crop(reader, i, got, ((h - c) // 2, (w - c) // 2, c, c), dct_scaling))
    if dct_scaling and reader.metadata["image/mode"].any():
        assert 1 in scales and 8 in scales, scales


def test_random_resized_crop_lands_on_the_right_pixels(sharp: Path) -> None:
    reader = Reader(sharp)
    out = (48, 72)
    decoder = RandomResizedCropRGBImageDecoder(out, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3))
    loader = Loader(sharp, batch_size=3, seed=5, order=OrderOption.RANDOM, pipelines={"image": [decoder, ToTensor()]})
    salt = loader.pipelines[0].steps[0].salt
    scales = set()
    for epoch in range(4):
        for position, i, got in run_epoch(loader):
            h, w = SHARP_SIZES[i]
            seed = sample_seeds(5, epoch, np.array([position]), salt)[0]
            box = random_resized_crop.py_func(h, w, seed, 0.08, 1.0, np.log(3 / 4), np.log(4 / 3))
            y, x, ch, cw = box
            assert y >= 0 and x >= 0 and ch > 0 and cw > 0 and y + ch <= h and x + cw <= w
            scales.add(check_crop(reader, i, got, box, True))
    if reader.metadata["image/mode"].any():
        assert scales == {1, 2, 4, 8}, scales


def colour_image(i: int, h: int, w: int) -> np.ndarray:
    """Cells of saturated colours with sharp edges at irregular positions: JPEG's subsampled chroma changes at every edge."""
    rng = np.random.default_rng(2000 + i)
    rows, cols = _cuts(rng, h), _cuts(rng, w)
    palette = rng.integers(0, 256, size=(rows.max() + 1, cols.max() + 1, 3))
    return palette[rows[:, None], cols[None, :]].astype(np.uint8)


@pytest.mark.parametrize("dct_scaling", [False, True])
def test_crop_region_decode_matches_a_full_decode_to_the_edge(tmp_path: Path, dct_scaling: bool) -> None:
    """Decoding only the crop's region gives the pixels of a full decode, edge pixels included.

    libjpeg upsamples chroma (4:2:0) from neighbouring samples and treats the edge of a cropping region as
    the image's edge: a region without a pixel of margin around the crop changes the crop's edge pixels
    (by 2 levels after resizing, here), which a resize then spreads over the output's border.
    """
    sizes = [(333, 251), (640, 480), (251, 333), (97, 130)]
    path = write(tmp_path / "colour.stoker", Images(sizes, colour_image), "jpg", quality=95)

    def epoch(crop_decode: bool, decoder: Any) -> list[np.ndarray]:
        loader = Loader(path, batch_size=4, seed=3, pipelines={"image": [decoder(crop_decode), ToTensor()], "label": None})
        return [im.numpy().copy() for _ in range(6) for (im,) in loader]

    for decoder in (
        lambda cd: RandomResizedCropRGBImageDecoder((56, 72), dct_scaling=dct_scaling, crop_decode=cd),
        lambda cd: RandomResizedCropRGBImageDecoder(224, scale=(0.05, 0.3), dct_scaling=dct_scaling, crop_decode=cd),
        lambda cd: CenterCropRGBImageDecoder(48, ratio=0.37, dct_scaling=dct_scaling, crop_decode=cd),
    ):
        for region, full in zip(epoch(True, decoder), epoch(False, decoder), strict=True):
            err = np.abs(region.astype(int) - full)
            assert err.max() <= 1, f"the crop-region decode is off by up to {err.max()} (mean {err.mean():.3f})"


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


# ---- corrupt and crafted files -------------------------------------------------------------------


def _zero_payload(path: Path, sample: int, start: int) -> None:
    """Zero the bytes of a sample's payload from ``start`` on and reseal the checksums: a JPEG that was damaged
    before it was written (the data check, which refuses bytes damaged on disk, lets it through to the decoder)."""
    reader = Reader(path)
    m = reader.metadata[sample]
    ptr, size = int(m["image/ptr"]), int(m["image/size"])
    reader.close()
    from tests.format.test_reader_errors import reseal

    raw = bytearray(path.read_bytes())
    raw[ptr + start : ptr + size] = bytes(size - start)
    path.write_bytes(bytes(reseal(raw)))  # checksums recomputed: a JPEG damaged before it was written, not on disk


def _edit_metadata(path: Path, sample: int, **values: int) -> None:
    """Rewrite metadata columns of one sample and reseal every checksum: a crafted, self-consistent file."""
    from tests.format.test_reader_errors import reseal

    reader = Reader(path)
    offset = reader.metadata_offset + sample * reader.metadata_row_size
    dtype = reader.metadata.dtype
    reader.close()
    raw = bytearray(path.read_bytes())
    row = np.frombuffer(bytes(raw[offset : offset + dtype.itemsize]), dtype=dtype).copy()
    for name, value in values.items():
        row[f"image/{name}"] = value
    raw[offset : offset + dtype.itemsize] = row.tobytes()
    path.write_bytes(bytes(reseal(raw)))


def _load_all(path: Path, decoder: Any) -> None:
    for _ in Loader(path, batch_size=8, pipelines={"image": [decoder, ToTensor()]}):
        pass


@pytest.mark.parametrize(
    ("start", "words"), [(2, "JPEG datastream contains no image"), (None, "Invalid JPEG file structure: missing SOS marker")]
)
@pytest.mark.parametrize("decoder", [SimpleRGBImageDecoder, lambda: CenterCropRGBImageDecoder(16)])
def test_corrupt_jpeg_names_the_sample_in_libjpeg_turbos_words(tmp_path: Path, start: int | None, words: str, decoder: Any) -> None:
    path = write(tmp_path / "bad.stoker", Images([(32, 32)] * 30), "jpg")
    size = int(Reader(path).metadata["image/size"][17])
    _zero_payload(path, 17, size // 2 if start is None else start)
    with pytest.raises(LoaderError) as info:
        _load_all(path, decoder())
    assert info.value.index == 17 and info.value.field == "image" and "corrupt" in str(info.value)
    assert f"libjpeg-turbo: {words}" in str(info.value), str(info.value)


def test_corrupt_jpeg_is_replaced_and_described(tmp_path: Path) -> None:
    path = write(tmp_path / "bad.stoker", Images([(32, 32)] * 30), "jpg")
    _zero_payload(path, 17, 2)
    decoder = CenterCropRGBImageDecoder(16, on_error="replace")
    assert decoder.describe_error() is None, "not built yet"
    seen = 0
    for images, labels in Loader(path, batch_size=30, pipelines={"image": [decoder, ToTensor()]}):  # one batch
        for k in range(len(labels)):
            seen += 1
            assert images[k].any() != (int(labels[k, 0]) == 17)
    assert seen == 30 and decoder.num_replaced == 1
    described = decoder.describe_error()  # about the last batch decoded
    assert described == "libjpeg-turbo: JPEG datastream contains no image (tj3Decompress8 failed, TJERR_WARNING)"
    order = np.r_[10:30, 0:10]  # the failing batch, then a good one, in one build
    images = [im for _, _, im in run_epoch(Loader(path, batch_size=20, indices=order, pipelines={"image": [decoder, ToTensor()]}))]
    assert len(images) == 30 and not images[7].any() and decoder.num_replaced == 2
    assert decoder.describe_error() is None, "the last batch decoded fine"


def test_jpeg_whose_header_disagrees_with_the_metadata(tmp_path: Path) -> None:
    path = write(tmp_path / "size.stoker", Images([(32, 32)] * 12), "jpg")
    _edit_metadata(path, 5, width=31)
    with pytest.raises(LoaderError) as info:
        _load_all(path, CenterCropRGBImageDecoder(16))
    assert info.value.index == 5
    assert "the JPEG's header says 32x32 pixels, the metadata 32x31" in str(info.value)


@pytest.mark.parametrize(("height", "width"), [(65536, 32), (32, 70000), (2**32 - 1, 2**32 - 1)])
@pytest.mark.parametrize("decoder", [SimpleRGBImageDecoder, lambda: RandomResizedCropRGBImageDecoder(16)])
def test_jpeg_sizes_past_libjpegs_limit_are_refused_at_build(tmp_path: Path, height: int, width: int, decoder: Any) -> None:
    from stoker.errors import DatasetFormatError
    from stoker.format import Reader
    from stoker.loader._graph import build_pipeline

    path = write(tmp_path / "big.stoker", Images([(32, 32)] * 4), "jpg")
    _edit_metadata(path, 2, height=height, width=width)
    # the Loader validates the metadata first: the reader refuses the sample
    with pytest.raises(DatasetFormatError, match="sample 2, field 'image' has a size that disagrees"):
        Loader(path, batch_size=4, pipelines={"image": [decoder(), ToTensor()]})
    # and the decoder validates a reader nobody validated before building its pipeline
    reader = Reader(path)
    with pytest.raises(PipelineError, match="sample 2, field 'image' has a size that disagrees"):
        build_pipeline("image", reader.fields["image"], [decoder(), ToTensor()], reader, 0, 4)


def test_scratch_is_capped_naming_the_largest_image(tmp_path: Path) -> None:
    sizes = [(40, 30), (600, 500), (100, 700), (50, 50)]
    path = write(tmp_path / "sizes.stoker", Images(sizes), "jpg")
    # sample 1 needs 900,000 bytes to decode into, and a little more to resize
    with pytest.raises(PipelineError, match=r"max_scratch_bytes=900000; the largest image is sample 1 \(600x500 pixels, JPEG\)"):
        Loader(path, batch_size=4, pipelines={"image": [CenterCropRGBImageDecoder(16, max_scratch_bytes=900_000), ToTensor()]})
    Loader(path, batch_size=4, pipelines={"image": [CenterCropRGBImageDecoder(16, max_scratch_bytes=2 * 10**6), ToTensor()]})
    with pytest.raises(ValueError, match="max_scratch_bytes"):
        CenterCropRGBImageDecoder(16, max_scratch_bytes=0)


# ---- handles -------------------------------------------------------------------------------------


def test_handles_live_as_long_as_the_arrays_the_kernel_reads(tmp_path: Path) -> None:
    path = write(tmp_path / "h.stoker", Images([(32, 32)] * 8), "jpg")
    decoder = CenterCropRGBImageDecoder(16)
    first = Loader(path, batch_size=8, pipelines={"image": [decoder, ToTensor()]})
    fin = decoder._handles_finalizer
    assert fin is not None and fin.alive
    assert fin.atexit is False, "freeing handles at interpreter exit could race a thread still decoding"
    second = Loader(path, batch_size=8, pipelines={"image": [decoder, ToTensor()]})  # a new build, new handles
    assert decoder._handles_finalizer is not fin
    gc.collect()
    assert fin.alive, "the first loader's pipeline still holds its handles"
    assert len(run_epoch(first)) == 8
    del first
    gc.collect()
    assert not fin.alive, "handles are freed with the last pipeline that holds them, though the decoder lives on"
    assert len(run_epoch(second)) == 8


def test_crop_decoder_arguments_are_checked(varied: Path) -> None:
    with pytest.raises(ValueError, match="ratio"):
        CenterCropRGBImageDecoder(8, ratio=0)
    with pytest.raises(ValueError, match="scale"):
        RandomResizedCropRGBImageDecoder(8, scale=(0.5, 0.1))
    with pytest.raises(ValueError, match="on_error"):
        CenterCropRGBImageDecoder(8, on_error="ignore")
    with pytest.raises(PipelineError, match="decodes fields of type rgb_image"):
        Loader(varied, batch_size=4, pipelines={"image": None, "label": [CenterCropRGBImageDecoder(8)]})
