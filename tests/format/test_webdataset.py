"""DatasetWriter.from_webdataset: WebDataset tar shards in, every sample once, in shard order, equal to the source."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from stoker.dataset import ShardedWriter, open_dataset
from stoker.errors import SampleError
from stoker.fields import IntField, JSONField, RGBImageField
from stoker.fields.rgb_image import decode_jpeg, encode_jpeg
from stoker.format import DatasetWriter, Reader

from .._profile import examples

wds = pytest.importorskip("webdataset")


def jpeg(seed: int, h: int = 24, w: int = 32) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(out, format="JPEG", quality=90)
    return out.getvalue()


def make_shards(folder: Path, sizes: list[int]) -> tuple[list[Path], list[tuple[bytes, int]]]:
    """Tar shards of ``sizes`` samples each (JPEG + cls), written with webdataset's TarWriter."""
    shards, samples, n = [], [], 0
    for s, size in enumerate(sizes):
        path = folder / f"shard-{s:04d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for _ in range(size):
                image, label = jpeg(n), (n * 7) % 10
                sink.write({"__key__": f"sample{n:06d}", "jpg": image, "cls": label})
                samples.append((image, label))
                n += 1
        shards.append(path)
    return shards, samples


def decode_rgb(dataset: Any) -> Any:
    """FFCV's documented pipeline form (a function of a module: the workers may be fresh interpreters)."""
    return dataset.decode("rgb8").to_tuple("jpg", "cls")


FIELDS = {"image": RGBImageField(write_mode="jpg"), "label": IntField()}


def stored(path: Path) -> list[tuple[bytes, int]]:
    with Reader(path) as reader:
        meta = reader.metadata
        return [
            (bytes(reader.storage[int(p) : int(p) + int(s)]), int(y))
            for p, s, y in zip(meta["image/ptr"], meta["image/size"], meta["label/value"])
        ]


@settings(max_examples=examples(ci=4, long=8), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(0, 25), min_size=1, max_size=5), num_workers=st.sampled_from([1, 2]), chunksize=st.integers(1, 9))
def test_keys_every_sample_once_and_equal(
    tmp_path_factory: pytest.TempPathFactory, sizes: list[int], num_workers: int, chunksize: int
) -> None:
    folder = tmp_path_factory.mktemp("wds")
    shards, samples = make_shards(folder, sizes)
    out = folder / "out.stoker"
    DatasetWriter(out, FIELDS, num_workers=num_workers, progress=False).from_webdataset(
        shards, keys={"image": "jpg;png", "label": "cls"}, chunksize=chunksize
    )
    assert stored(out) == samples  # each JPEG kept byte for byte, in shard order, none twice, none missing


def test_ffcv_pipeline_and_default_keys(tmp_path: Path) -> None:
    shards, samples = make_shards(tmp_path, [7, 0, 12])
    DatasetWriter(tmp_path / "a.stoker", FIELDS, num_workers=2, progress=False).from_webdataset([str(s) for s in shards], decode_rgb)
    with Reader(tmp_path / "a.stoker") as reader:
        assert len(reader) == len(samples)
        for i, (data, label) in enumerate(samples):
            image, got = reader.read(i)
            assert got == label
            pixels = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))  # what decode("rgb8") gives, encoded again at quality 90
            np.testing.assert_array_equal(image, decode_jpeg(encode_jpeg(pixels, 90)))
    fields = {"jpg": RGBImageField(write_mode="jpg"), "cls": IntField()}
    DatasetWriter(tmp_path / "b.stoker", fields, num_workers=1, progress=False).from_webdataset(shards)  # keys: the field names
    with Reader(tmp_path / "b.stoker") as reader:
        assert [int(v) for v in reader.metadata["cls/value"]] == [label for _, label in samples]


# webdataset leaves the shard files it opened to the garbage collector: after an error they are closed later, outside
# from_webdataset (which silences that ResourceWarning while it reads), and pytest reports the warning
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_errors_name_the_sample(tmp_path: Path) -> None:
    shards, _ = make_shards(tmp_path, [5, 5])
    with pytest.raises(ValueError, match=r"keys must map every field name to a WebDataset key.*missing \['label'\], unexpected \['txt'\]"):
        DatasetWriter(tmp_path / "x.stoker", FIELDS, progress=False).from_webdataset(shards, keys={"image": "jpg", "txt": "txt"})
    with pytest.raises(ValueError, match="not both"):
        DatasetWriter(tmp_path / "x.stoker", FIELDS, progress=False).from_webdataset(shards, decode_rgb, keys={"image": "jpg"})
    with pytest.raises(FileNotFoundError, match=r"shard .*missing\.tar does not exist"):
        DatasetWriter(tmp_path / "x.stoker", FIELDS, progress=False).from_webdataset([*shards, tmp_path / "missing.tar"], decode_rgb)
    with pytest.raises(
        ValueError, match=r"shard .*shard-0000\.tar, its sample 0 \(counting the samples\): ValueError: didn't find \['png'\]"
    ):
        DatasetWriter(tmp_path / "x.stoker", FIELDS, num_workers=1, progress=False).from_webdataset(
            shards, keys={"image": "png", "label": "cls"}
        )
    with pytest.raises(SampleError, match=r"sample 0, field 'label': expected an integer; got str 'sample000000'"):
        fields = {"image": RGBImageField(), "label": IntField(), "meta": JSONField()}
        DatasetWriter(tmp_path / "x.stoker", fields, num_workers=2, progress=False).from_webdataset(
            shards, keys={"image": "jpg", "label": "__key__", "meta": "cls"}
        )
    with wds.TarWriter(str(tmp_path / "bad.tar")) as sink:
        for i in range(4):
            sink.write({"__key__": f"b{i}", "jpg": b"not a jpeg" if i == 2 else jpeg(i), "cls": i})
    with pytest.raises(SampleError, match=r"sample 12, field 'image': cannot decode the image bytes: not an image"):
        DatasetWriter(tmp_path / "x.stoker", FIELDS, num_workers=2, progress=False).from_webdataset(
            [*shards, tmp_path / "bad.tar"], keys={"image": "jpg", "label": "cls"}
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.tar", "shard-0000.tar", "shard-0001.tar"]


@pytest.mark.parametrize("num_workers", [pytest.param(1, marks=pytest.mark.long), 2])  # (TEST_SPLIT.md)
def test_into_a_folder_of_shards_cut_across_tar_files(tmp_path: Path, num_workers: int) -> None:
    """ShardedWriter.from_webdataset: stoker shards of 5 samples from tars of 7, 0 and 12; every sample once, in order."""
    tars, samples = make_shards(tmp_path, [7, 0, 12])
    out = tmp_path / "out"
    paths = ShardedWriter(out, FIELDS, samples_per_shard=5, num_workers=num_workers, progress=False).from_webdataset(
        tars, keys={"image": "jpg", "label": "cls"}, chunksize=2
    )
    assert [len(Reader(p)) for p in paths] == [5, 5, 5, 4]
    assert [s for p in paths for s in stored(p)] == samples
    reader = open_dataset(out)
    assert [int(reader.read(i)[1]) for i in range(len(reader))] == [label for _, label in samples]
    sized = ShardedWriter(tmp_path / "b", FIELDS, bytes_per_shard=4000, num_workers=1, progress=False).from_webdataset(
        tars, keys={"image": "jpg", "label": "cls"}
    )
    assert len(sized) > 2 and [s for p in sized for s in stored(p)] == samples


def test_without_webdataset_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "webdataset", None)  # import webdataset raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'stoker\[webdataset\]'"):
        DatasetWriter(tmp_path / "x.stoker", FIELDS, progress=False).from_webdataset([tmp_path / "a.tar"])
