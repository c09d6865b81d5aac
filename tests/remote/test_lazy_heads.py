"""The store's first batch reads only the heads it needs (issue 44): the manifest's ``head`` records.

A manifest written by stoker records, per shard, what the Loader plans from
(its layout and the samples its figures come from: ``stoker.dataset._head_record``).
Opening a dataset in object storage then reads the manifest and the first
shard's head; a batch reads the heads of its shards first; the others are read
in the background after the first batch. Real servers on loopback (moto's S3
server behind the suite's fault proxy, which counts the requests it passes on,
ranged ones apart: a head is read with ranges, a shard downloaded without).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("obstore")
pytest.importorskip("moto")

from benchmarks._servers.loopback import S3Server

from stoker import Loader, OrderOption
from stoker.dataset._manifest import MANIFEST_NAME, parse_manifest
from stoker.dataset.sharded import open_dataset
from stoker.dataset.shards import write_shards
from stoker.decoders import CenterCropRGBImageDecoder
from stoker.errors import DatasetFormatError
from stoker.fields import BytesField, IntField, NDArrayField, RGBImageField
from stoker.fields.rgb_image import MODE_RAW
from stoker.format.reader import Reader
from stoker.image._kernels import jpeg_scratch_size
from stoker.image._resize import resize_scratch_size
from stoker.remote import open_store
from tests.remote._faults import FaultProxy
from tests.remote.conftest import options

SETTINGS = settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _write(folder: Path, counts: list[int], seed: int, images: bool = False, big_at: int | None = None) -> list[Path]:
    """Shards of ``counts`` samples: ``y`` is the global index; ``blob`` of 0..40 bytes (sample ``big_at``: 300);
    ``images``: an ``img`` of 2..14 x 2..14 pixels (sample ``big_at``: 40 x 9), JPEG or raw by sample."""
    n = sum(counts)
    rng = np.random.default_rng(seed)
    fields: dict[str, Any] = {"x": NDArrayField(np.dtype("float32"), (4,)), "y": IntField(), "blob": BytesField()}
    blobs = np.empty(n, dtype=object)
    for i in range(n):
        blobs[i] = rng.integers(0, 256, 300 if i == big_at else int(rng.integers(0, 40)), dtype=np.uint8).tobytes()
    arrays: dict[str, Any] = {"x": rng.normal(size=(n, 4)).astype(np.float32), "y": np.arange(n, dtype=np.int64), "blob": blobs}
    if images:
        fields["img"] = RGBImageField(write_mode="proportion", compress_probability=0.5)
        imgs = np.empty(n, dtype=object)
        for i in range(n):
            h, w = (40, 9) if i == big_at else (int(rng.integers(2, 15)), int(rng.integers(2, 15)))
            imgs[i] = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        arrays["img"] = imgs
    files: list[Path] = []
    folder.mkdir(parents=True)
    start = 0
    for k, c in enumerate(counts):  # shards of several sizes: written one by one, then one manifest
        part = {name: a[start : start + c] for name, a in arrays.items()}
        for p in write_shards(folder / f"w{k}", fields, part, samples_per_shard=c, num_workers=1, progress=False):
            files.append(p.rename(folder / f"s{k:02d}.stoker"))
        (folder / f"w{k}" / MANIFEST_NAME).unlink()
        (folder / f"w{k}").rmdir()
        start += c
    from stoker.dataset.shards import write_manifest

    write_manifest(folder, files)
    return files


def _upload(folder: Path, url: str, endpoint: str, manifest: bytes | None = None) -> None:
    store = open_store(url, options(endpoint))
    for path in sorted(folder.glob("*.stoker")):
        store.upload(path.name, path)
    data = (folder / MANIFEST_NAME).read_bytes() if manifest is None else manifest
    (folder.parent / "m.json").write_bytes(data)
    store.upload(MANIFEST_NAME, folder.parent / "m.json")  # last, as a writer does


@pytest.fixture
def faults(s3: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(s3.host, s3.port) as proxy:  # (no fault: it counts the requests)
        yield proxy


def _prefix(url: str) -> str:
    return "/" + url.partition("://")[2]


# ---- the first batch: the manifest, the first head, its shards' heads ------------------------------------------
@SETTINGS
@given(
    counts=st.lists(st.integers(5, 40), min_size=2, max_size=6),
    picks=st.lists(st.floats(0, 1, exclude_max=True), min_size=1, max_size=12),
)
def test_the_first_batch_reads_the_manifest_the_first_head_and_its_shards_heads(
    s3: S3Server, faults: FaultProxy, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch,
    counts: list[int], picks: list[float],
) -> None:  # fmt: skip
    """An epoch of one batch (``indices``: samples drawn from any shards), no background reads: the store sees one
    manifest read, and a ranged read (a head) of shard 0 and of each shard of the batch, of no other shard; the batch
    holds the samples asked for."""
    monkeypatch.setattr("stoker.dataset._store_reader.BACKGROUND_HEADS", 0, raising=False)
    root = tmp_path_factory.mktemp("first")
    files = _write(root / "ds", counts, seed=len(counts))
    url = s3.url(f"lazy-{uuid.uuid4().hex[:8]}/")
    _upload(root / "ds", url, s3.endpoint)
    n = sum(counts)
    indices = sorted({int(p * n) for p in picks})
    starts = np.cumsum([0, *counts])
    touched = {0} | {int(np.searchsorted(starts, i, side="right") - 1) for i in indices}
    before, ranged = dict(faults.gets), dict(faults.ranged)
    with Loader(url, batch_size=len(indices), indices=indices, cache_dir=root / "c", storage_options=options(faults.endpoint),
                num_workers=1) as loader:  # fmt: skip
        (batch,) = list(loader)
        assert sorted(batch[1].numpy().ravel().tolist()) == indices
        prefix = _prefix(url)
        assert faults.gets[prefix + MANIFEST_NAME] - before.get(prefix + MANIFEST_NAME, 0) == 1
        heads = {p.rpartition("/")[2]: c - ranged.get(p, 0) for p, c in faults.ranged.items() if c - ranged.get(p, 0)}
        assert heads == {files[k].name: 1 for k in sorted(touched)}  # (shards of < 128 KiB: a head in one request)
        assert loader.reader.heads_read() == sorted(touched)  # type: ignore[union-attr]


# ---- every batch as from the local folder -----------------------------------------------------------------------
@SETTINGS
@given(
    counts=st.lists(st.integers(5, 30), min_size=2, max_size=5),
    order=st.sampled_from([OrderOption.SEQUENTIAL, OrderOption.RANDOM, OrderOption.QUASI_RANDOM]),
    batch_size=st.sampled_from([7, 32]),
    big=st.floats(0, 1, exclude_max=True),
    background=st.sampled_from([0, 2]),
)
def test_every_batch_of_two_epochs_is_the_local_folders(
    s3: S3Server, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch,
    counts: list[int], order: OrderOption, batch_size: int, big: float, background: int,
) -> None:  # fmt: skip
    """Shards of bytes and images (JPEG and raw, of several sizes) whose largest value and largest image lie in a drawn
    shard (a later one, mostly): the Loader planned from the first head and the manifest's records gives, in two epochs,
    the batches the local folder gives (the padded width of the bytes, the crops), heads read as batches need them or in
    the background."""
    monkeypatch.setattr("stoker.dataset._store_reader.BACKGROUND_HEADS", background, raising=False)
    root = tmp_path_factory.mktemp("same")
    n = sum(counts)
    _write(root / "ds", counts, seed=n, images=True, big_at=int(big * n))
    assert all("head" in e for e in json.loads((root / "ds" / MANIFEST_NAME).read_bytes())["shards"])  # (the writer records them)
    url = s3.url(f"same-{uuid.uuid4().hex[:8]}/")
    _upload(root / "ds", url, s3.endpoint)
    kw: dict[str, Any] = {"batch_size": batch_size, "order": order, "seed": 11, "num_workers": 2,
                          "pipelines": {"img": [CenterCropRGBImageDecoder((8, 8))]}}  # fmt: skip
    with Loader(str(root / "ds"), **kw) as local, Loader(url, cache_dir=root / "c", storage_options=options(s3.endpoint), **kw) as remote:
        for _ in range(2):
            mine = [[np.asarray(t) for t in b] for b in remote]
            want = [[np.asarray(t) for t in b] for b in local]
            assert len(mine) == len(want)
            for b, (got, expected) in enumerate(zip(mine, want)):
                for f, (g, e) in enumerate(zip(got, expected)):
                    assert g.shape == e.shape and np.array_equal(g, e), f"batch {b}, output {f}"
        assert remote.reader.heads_read() == list(range(len(counts)))  # type: ignore[union-attr]


# ---- the records: what the planners read is the whole table's ---------------------------------------------------
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(counts=st.lists(st.integers(1, 60), min_size=1, max_size=1), seed=st.integers(0, 2**16))
def test_a_records_stand_in_rows_give_the_planners_figures(tmp_path_factory: pytest.TempPathFactory, counts: list[int], seed: int) -> None:
    """A numpy reference of what the planners take from the metadata (largest bytes, any JPEG, one size for all, the
    largest decode and resize scratch for several outputs): the same from a shard's stand-in rows as from its table."""
    from stoker.dataset._head_record import PendingHead, head_record

    root = tmp_path_factory.mktemp("rec")
    (path,) = _write(root / "ds", counts, seed=seed, images=True)
    with Reader(path) as reader:
        reader.validate_metadata()
        record = json.loads(json.dumps(head_record(reader)))
        stand_in = PendingHead(reader, record, reader.num_samples, reader.file_size, reader.header_crc, "here", path).metadata
        real = np.array(reader.metadata)

    def figures(meta: np.ndarray) -> tuple[Any, ...]:
        h, w, mode = (meta[f"img/{c}"].astype(np.int64) for c in ("height", "width", "mode"))
        jpeg = mode != MODE_RAW
        out: list[Any] = [int(meta["blob/size"].max()), bool((h == h[0]).all() and (w == w[0]).all()), bool(jpeg.any())]
        out.append(int(np.where(jpeg, jpeg_scratch_size(h, w), 0).max()))
        out += [int(resize_scratch_size(h, w, oh, ow).max()) for oh, ow in ((1, 1), (8, 8), (3, 17))]
        out += [int((resize_scratch_size(h, w, 8, 8) * 4 + np.where(jpeg, jpeg_scratch_size(h, w), 0)).max())]
        return tuple(out)

    assert figures(stand_in) == figures(real)


def test_a_malformed_head_record_is_refused_naming_it() -> None:
    """A manifest's ``head`` record is checked with the rest of the manifest: the field is named."""
    entry = {"name": "s.stoker", "num_samples": 3, "file_size": 5000, "header_crc": 1}
    record = {"data_offset": 512, "data_size": 100, "data_block_size": 1 << 20, "columns": {}, "samples": [0, 7], "values": {}}
    manifest = {"stoker_manifest": 1, "fields_sha256": "0" * 64, "shards": [{**entry, "head": record}]}
    with pytest.raises(DatasetFormatError, match=r"shards\[0\]\.head.*samples"):
        parse_manifest(json.dumps(manifest).encode(), "m.json")
    manifest["shards"] = [entry]  # without the key: read as before
    assert "head" not in parse_manifest(json.dumps(manifest).encode(), "m.json")["shards"][0]


# ---- an older manifest; a head that disagrees with its record --------------------------------------------------
def test_a_manifest_without_head_records_reads_every_head_at_open(
    s3: S3Server, faults: FaultProxy, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:  # fmt: skip
    """A manifest of an older stoker (no ``head`` keys): every head is read at open, as before (said at DEBUG), and the
    batches are the local folder's."""
    files = _write(tmp_path / "ds", [20, 15, 25], seed=3)
    manifest = json.loads((tmp_path / "ds" / MANIFEST_NAME).read_bytes())
    assert all("head" in e for e in manifest["shards"])
    for e in manifest["shards"]:
        del e["head"]
    url = s3.url(f"old-{uuid.uuid4().hex[:8]}/")
    _upload(tmp_path / "ds", url, s3.endpoint, json.dumps(manifest).encode())
    with caplog.at_level(logging.DEBUG, logger="stoker.dataset"):
        reader = open_dataset(url, storage_options=options(faults.endpoint), cache_dir=tmp_path / "c")
    try:
        assert reader.heads_read() == [0, 1, 2]  # type: ignore[union-attr]
        assert {p.rpartition("/")[2] for p in faults.ranged} == {f.name for f in files}
        assert any("records no head of 2 of its 3 shards" in r.getMessage() for r in caplog.records)
    finally:
        reader.close()
    kw: dict[str, Any] = {"batch_size": 16, "order": OrderOption.RANDOM, "seed": 2, "num_workers": 1}
    with (
        Loader(str(tmp_path / "ds"), **kw) as local,
        Loader(url, cache_dir=tmp_path / "c2", storage_options=options(s3.endpoint), **kw) as remote,
    ):
        for got, want in zip(remote, local, strict=True):
            assert all(np.array_equal(np.asarray(g), np.asarray(w)) for g, w in zip(got, want))


def test_a_head_that_disagrees_with_its_record_is_refused_naming_the_shard(s3: S3Server, tmp_path: Path) -> None:
    """The manifest's record of shard 2 says its largest ``blob`` is a byte shorter than it is (the plan would pad to the
    wrong width): the batch that first reads shard 2 fails naming the shard's URL and the record; earlier ones do not."""
    files = _write(tmp_path / "ds", [20, 20, 20], seed=5, big_at=45)
    manifest = json.loads((tmp_path / "ds" / MANIFEST_NAME).read_bytes())
    values = manifest["shards"][2]["head"]["values"]["blob/size"]
    values[values.index(max(values))] -= 1
    url = s3.url(f"lie-{uuid.uuid4().hex[:8]}/")
    _upload(tmp_path / "ds", url, s3.endpoint, json.dumps(manifest).encode())
    seen = []
    with (
        Loader(url, batch_size=10, cache_dir=tmp_path / "c", storage_options=options(s3.endpoint), num_workers=1) as loader,
        pytest.raises(DatasetFormatError) as info,
    ):
        for batch in loader:
            seen += batch[1].numpy().ravel().tolist()
    assert str(info.value).startswith(url + files[2].name), str(info.value)
    assert "head differs from the manifest's record" in str(info.value)
    assert set(range(40)) >= set(seen)
