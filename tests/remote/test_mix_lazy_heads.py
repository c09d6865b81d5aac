"""A mix's first batch reads only the heads it needs (issue 44), as one dataset's does (``test_lazy_heads.py``).

Opening a mix of datasets in object storage reads each dataset's manifest and
its first shard's head; a batch reads the heads of its shards first; the
others are read in the background after the first batch (the one reader of
shards from stores, ``stoker.dataset._store_reader``). Real servers on
loopback: moto's S3 server behind the suite's fault proxy, which counts the
requests it passes on (ranged ones apart: a head is read with ranges, a shard
downloaded without). The reference is the same mix read from local folders.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("obstore")
pytest.importorskip("moto")

from benchmarks._servers.loopback import S3Server

from stoker import Loader, OrderOption, Stream
from stoker.dataset._manifest import MANIFEST_NAME
from stoker.decoders import CenterCropRGBImageDecoder
from stoker.errors import DatasetFormatError
from tests.remote._faults import FaultProxy
from tests.remote.conftest import options
from tests.remote.test_lazy_heads import SETTINGS, _prefix, _upload, _write, faults  # noqa: F401 - faults: the fixture

SOURCE = -1  # (return_source=True: the stream of each sample is the batch's last output)


def _mix(root: Path, s3: S3Server, counts: list[list[int]], seed: int, **write: Any) -> tuple[list[Path], list[str], list[list[Path]]]:
    """One dataset per ``counts[i]`` (shards of those sizes), each in a local folder and under its own prefix of the store
    (``write``: :func:`_write`'s options; ``big_at`` for the last dataset only)."""
    folders, urls, files = [], [], []
    run = uuid.uuid4().hex[:8]
    for i, member in enumerate(counts):
        folder = root / f"d{i}"
        mine = dict(write)
        if i != len(counts) - 1:  # (the largest value and image: in the last dataset)
            mine.pop("big_at", None)
        files.append(_write(folder, member, seed=seed + i, **mine))
        url = s3.url(f"mixlazy-{run}/d{i}/")
        _upload(folder, url, s3.endpoint)
        folders.append(folder)
        urls.append(url)
    return folders, urls, files


def _streams(sources: list[Any], weights: list[float], endpoint: str | None) -> list[Stream]:
    opts = options(endpoint) if endpoint is not None else None
    return [Stream(str(s), weight=w, name=f"d{i}", storage_options=opts) for i, (s, w) in enumerate(zip(sources, weights))]


def _heads(proxy: FaultProxy, before: dict[str, int]) -> dict[str, int]:
    """The ranged requests (heads) since ``before``, by object path."""
    return {p: c - before.get(p, 0) for p, c in proxy.ranged.items() if c - before.get(p, 0)}


def _shard_path(url: str, file: Path) -> str:
    return _prefix(url) + file.name


# ---- the open and the first batch: the manifests, the first heads, the first batch's shards' heads ----------------
@SETTINGS
@given(
    counts=st.lists(st.lists(st.integers(5, 30), min_size=2, max_size=4), min_size=2, max_size=3),
    weights=st.lists(st.floats(0.1, 1.0), min_size=3, max_size=3),
    batch_size=st.integers(4, 24),
    seed=st.integers(0, 1000),
)
def test_a_mixs_open_reads_each_manifest_and_first_head_and_its_first_batch_its_shards_heads(
    s3: S3Server, faults: FaultProxy, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
    counts: list[list[int]], weights: list[float], batch_size: int, seed: int,
) -> None:  # fmt: skip
    """An epoch of one batch (``samples_per_epoch``), no background reads: ``Loader()`` reads each dataset's manifest
    once and its first shard's head, no other; the batch then reads the heads of the shards its samples lie in, no
    other; it is the batch of the same mix of local folders."""
    monkeypatch.setattr("stoker.dataset._store_reader.BACKGROUND_HEADS", 0, raising=False)
    root = tmp_path_factory.mktemp("mixfirst")
    folders, urls, files = _mix(root, s3, counts, seed)
    w = weights[: len(counts)]
    kw: dict[str, Any] = {"batch_size": batch_size, "samples_per_epoch": batch_size, "order": OrderOption.RANDOM, "seed": seed,
                          "num_workers": 1, "return_source": True}  # fmt: skip
    gets, ranged = dict(faults.gets), dict(faults.ranged)
    with (
        Loader(_streams(folders, w, None), **kw) as local,
        Loader(_streams(urls, w, faults.endpoint), cache_dir=root / "c", **kw) as remote,
    ):
        for url in urls:
            assert faults.gets[_prefix(url) + MANIFEST_NAME] - gets.get(_prefix(url) + MANIFEST_NAME, 0) == 1
        assert _heads(faults, ranged) == {_shard_path(u, f[0]): 1 for u, f in zip(urls, files)}  # (shards < 128 KiB: one request)
        (mine,) = [[np.asarray(t) for t in b] for b in remote]
        (want,) = [[np.asarray(t) for t in b] for b in local]
        for g, e in zip(mine, want, strict=True):
            assert g.shape == e.shape and np.array_equal(g, e)
        touched = {(s, 0) for s in range(len(counts))}
        for s, y in zip(mine[SOURCE].ravel().tolist(), mine[1].ravel().tolist()):  # (y: the sample's index in its dataset)
            touched.add((s, int(np.searchsorted(np.cumsum(counts[s]), y, side="right"))))
        assert _heads(faults, ranged) == {_shard_path(urls[s], files[s][k]): 1 for s, k in touched}
        firsts = np.cumsum([0, *(len(c) for c in counts)])
        assert remote.reader.heads_read() == sorted(int(firsts[s]) + k for s, k in touched)  # type: ignore[union-attr]


# ---- every batch: the plan made from the first heads and the records holds for the whole mix -------------------
@pytest.mark.long  # (12-30 s, its image kernels compiled; make test: the first batch's test above and the older manifest's epoch below)
@SETTINGS
@given(
    counts=st.lists(st.lists(st.integers(5, 25), min_size=2, max_size=4), min_size=2, max_size=3),
    big=st.floats(0, 1, exclude_max=True),
    mix=st.sampled_from(["samples", "batches"]),
    background=st.sampled_from([0, 2]),
    seed=st.integers(0, 1000),
)
def test_every_batch_of_two_epochs_of_a_mix_is_the_local_mixs(
    s3: S3Server, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch,
    counts: list[list[int]], big: float, mix: str, background: int, seed: int,
) -> None:  # fmt: skip
    """Datasets of bytes and images (JPEG and raw) whose largest value and largest image lie in a drawn shard of the last
    dataset (never read at open): in two epochs, the mix from the store gives the batches of the mix of local folders
    (the padded width of the bytes, the crops), heads read as batches need them or in the background; every head is
    read by the end."""
    monkeypatch.setattr("stoker.dataset._store_reader.BACKGROUND_HEADS", background, raising=False)
    root = tmp_path_factory.mktemp("mixsame")
    folders, urls, _ = _mix(root, s3, counts, seed, images=True, big_at=int(big * sum(counts[-1])))
    w = [1.0 + i for i in range(len(counts))]
    kw: dict[str, Any] = {"batch_size": 8, "order": OrderOption.QUASI_RANDOM, "seed": seed, "num_workers": 2, "mix": mix,
                          "return_source": True, "pipelines": {"img": [CenterCropRGBImageDecoder((8, 8))]}}  # fmt: skip
    with (
        Loader(_streams(folders, w, None), **kw) as local,
        Loader(_streams(urls, w, s3.endpoint), cache_dir=root / "c", **kw) as remote,
    ):
        for _ in range(2):
            mine = [[np.asarray(t) for t in b] for b in remote]
            want = [[np.asarray(t) for t in b] for b in local]
            assert len(mine) == len(want)
            for b, (got, expected) in enumerate(zip(mine, want)):
                for f, (g, e) in enumerate(zip(got, expected, strict=True)):
                    assert g.shape == e.shape and np.array_equal(g, e), f"batch {b}, output {f}"
        remote.reader.read_heads()  # type: ignore[union-attr]
        assert remote.reader.heads_read() == list(range(sum(len(c) for c in counts)))  # type: ignore[union-attr]


# ---- a head that disagrees with its record; a manifest without records ------------------------------------------
def test_a_head_of_a_mix_that_disagrees_with_its_record_is_refused_naming_the_shard(s3: S3Server, tmp_path: Path) -> None:
    """The second dataset's manifest says shard 1's largest ``blob`` is a byte shorter than it is: the open reads no head
    of it but the first; the batch that first reads it fails naming the shard's URL and the record."""
    folders, urls, files = _mix(tmp_path, s3, [[20, 20], [15, 15, 15]], seed=7, big_at=20)
    manifest = json.loads((folders[1] / MANIFEST_NAME).read_bytes())
    values = manifest["shards"][1]["head"]["values"]["blob/size"]
    values[values.index(max(values))] -= 1
    _upload(folders[1], urls[1], s3.endpoint, json.dumps(manifest).encode())
    with (
        Loader(_streams(urls, [1.0, 1.0], s3.endpoint), batch_size=10, cache_dir=tmp_path / "c", num_workers=1) as loader,
        pytest.raises(DatasetFormatError) as info,
    ):
        assert loader.reader.heads_read() == [0, 2]  # type: ignore[union-attr]
        for _ in loader:
            pass
    assert str(info.value).startswith(urls[1] + files[1][1].name), str(info.value)
    assert "head differs from the manifest's record" in str(info.value)


def test_a_mix_member_whose_manifest_has_no_head_records_has_every_head_read_at_open(
    s3: S3Server, faults: FaultProxy, tmp_path: Path  # noqa: F811
) -> None:  # fmt: skip
    """Dataset 0's manifest is an older stoker's (no ``head`` keys): its every head is read at open, dataset 1's first
    only; the batches are the local mix's."""
    folders, urls, files = _mix(tmp_path, s3, [[10, 12, 9], [8, 11, 7]], seed=3)
    manifest = json.loads((folders[0] / MANIFEST_NAME).read_bytes())
    for e in manifest["shards"]:
        del e["head"]
    _upload(folders[0], urls[0], s3.endpoint, json.dumps(manifest).encode())
    kw: dict[str, Any] = {"batch_size": 6, "order": OrderOption.RANDOM, "seed": 1, "num_workers": 1}
    ranged = dict(faults.ranged)
    with (
        Loader(_streams(folders, [1.0, 2.0], None), **kw) as local,
        Loader(_streams(urls, [1.0, 2.0], faults.endpoint), cache_dir=tmp_path / "c", **kw) as remote,
    ):
        assert _heads(faults, ranged) == {**{_shard_path(urls[0], f): 1 for f in files[0]}, _shard_path(urls[1], files[1][0]): 1}
        assert remote.reader.heads_read() == [0, 1, 2, 3]  # type: ignore[union-attr]
        for got, want in zip(remote, local, strict=True):
            assert all(np.array_equal(np.asarray(g), np.asarray(w)) for g, w in zip(got, want, strict=True))


# ---- the state saved before any head but the first is read -----------------------------------------------------
@pytest.mark.parametrize("mixed", [False, True])
def test_the_state_saved_at_open_is_the_local_datasets(s3: S3Server, tmp_path: Path, mixed: bool) -> None:
    """``state_dict()`` right after the open (heads not read yet: it reads them) is the one of the same dataset, or mix,
    from local folders (its ``config``: every shard's checksum-table CRC), and the local loader takes it."""
    folders, urls, _ = _mix(tmp_path, s3, [[10, 12, 9], [8, 11]], seed=5)
    kw: dict[str, Any] = {"batch_size": 4, "order": OrderOption.RANDOM, "seed": 2, "num_workers": 1}
    local_src: Any = _streams(folders, [1.0, 1.0], None) if mixed else str(folders[0])
    remote_src: Any = _streams(urls, [1.0, 1.0], s3.endpoint) if mixed else urls[0]
    remote_opts: dict[str, Any] = {} if mixed else {"storage_options": options(s3.endpoint)}
    with Loader(local_src, **kw) as local, Loader(remote_src, cache_dir=tmp_path / "c", **remote_opts, **kw) as remote:
        assert remote.reader.heads_read() == ([0, 3] if mixed else [0])  # type: ignore[union-attr]
        state = remote.state_dict()
        assert state["config"] == local.state_dict()["config"]
        local.load_state_dict(state)
