"""Writing a dataset to an object store (moto on loopback): write_shards, write_arrow, write_ray_dataset.

Shards are uploaded as they are finished, the manifest last; a failed write leaves the previous manifest and
its shards as they were; a rewrite keeps the previous generation's shards for the retention (test_generations.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from benchmarks._servers.loopback import S3Server

from stoker.dataset._manifest import MANIFEST_NAME, build_manifest
from stoker.dataset.shards import write_shards
from stoker.errors import SampleError
from stoker.fields import BytesField, IntField
from stoker.remote import Store
from tests.convert._readback import read_shards
from tests.remote.conftest import options

FIELDS = {"id": IntField(), "blob": BytesField()}


def _arrays(n: int, offset: int = 0) -> dict[str, Any]:
    blobs = np.empty(n, dtype=object)
    for i in range(n):
        blobs[i] = bytes([(offset + i) % 251]) * (1 + i % 37)
    return {"id": np.arange(offset, offset + n, dtype=np.int64), "blob": blobs}


def _download(store: Store, dest: Path) -> dict[str, Any]:
    """The store's manifest and the shards it lists, copied into ``dest``; returns the manifest."""
    dest.mkdir(parents=True, exist_ok=True)
    manifest = json.loads(store.read(MANIFEST_NAME))
    for entry in manifest["shards"]:
        store.download(entry["name"], dest / entry["name"])
    (dest / MANIFEST_NAME).write_bytes(store.read(MANIFEST_NAME))
    return manifest


def _ids(store: Store, dest: Path) -> list[int]:
    _download(store, dest)
    return [int(r[0]) for r in read_shards(dest)[1]]


def _shard_keys(store: Store) -> list[str]:
    return [k for k in store.list() if k.startswith("shard-")]


class _FailsAt:
    """An indexed dataset whose sample ``bad`` raises."""

    def __init__(self, n: int, bad: int) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, bytes]:
        if i == self.bad:
            raise RuntimeError(f"sample {i} is broken")
        return i, b"x" * (1 + i % 5)


def test_write_shards_to_a_url(s3: S3Server, proxy, store: Store, prefix: str, tmp_path: Path) -> None:
    url, opts = s3.url(prefix), options(proxy.endpoint)
    staging = set(Path(tempfile.gettempdir()).glob("stoker-upload-*"))  # (a writer killed by another test leaves its own)
    keys = write_shards(url, FIELDS, _arrays(250), samples_per_shard=100, num_workers=1, progress=False, storage_options=opts)
    manifest = _download(store, tmp_path / "a")
    names = [e["name"] for e in manifest["shards"]]
    assert [k.name for k in keys] == names and len(names) == 3
    assert all(re.fullmatch(rf"shard-g{manifest['generation']}-0000\d\.stoker", n) for n in names)
    assert sorted(store.list()) == sorted([*names, MANIFEST_NAME])
    # the same bytes as build_manifest makes for the folder of these shards
    assert store.read(MANIFEST_NAME) == build_manifest(tmp_path / "a", names, manifest["generation"])
    assert [int(r[0]) for r in read_shards(tmp_path / "a")[1]] == list(range(250))
    assert not [p for p in set(Path(tempfile.gettempdir()).glob("stoker-upload-*")) - staging if any(p.iterdir())]

    # a rewrite: a new generation; the previous one's shards are kept (jobs may still read them), retired in the manifest
    write_shards(url, FIELDS, _arrays(120, 1000), samples_per_shard=100, num_workers=1, progress=False, storage_options=opts)
    second = json.loads(store.read(MANIFEST_NAME))
    assert second["generation"] != manifest["generation"]
    assert sorted(_shard_keys(store)) == sorted(names + [e["name"] for e in second["shards"]])
    (retired,) = second["retired"]
    assert retired["generation"] == manifest["generation"] and retired["shards"] == names
    assert _ids(store, tmp_path / "b") == list(range(1000, 1120))
    # with no retention, a rewrite deletes what it replaces once the new manifest is up
    write_shards(url, FIELDS, _arrays(120, 1000), samples_per_shard=100, num_workers=1, progress=False,
                 storage_options={**opts, "retention": 0})  # fmt: skip
    third = json.loads(store.read(MANIFEST_NAME))
    assert sorted(_shard_keys(store)) == sorted(e["name"] for e in third["shards"]) and "retired" not in third

    # a write that fails in the middle (shard 2 of 3): the previous dataset is what the store shows, nothing else
    before = sorted(store.list())
    with pytest.raises(SampleError, match="sample 210"):
        write_shards(url, FIELDS, _FailsAt(300, 210), samples_per_shard=100, num_workers=1, progress=False, storage_options=opts)
    assert sorted(store.list()) == before
    assert _ids(store, tmp_path / "c") == list(range(1000, 1120))


def test_write_arrow_uploads_each_shard_when_finished(s3: S3Server, proxy, store: Store, prefix: str, tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    from stoker.convert.arrow import write_arrow

    url, opts = s3.url(prefix), options(proxy.endpoint)
    seen: list[tuple[list[str], bool]] = []

    def tables(n: int, fail_at: int | None = None) -> Iterator[Any]:
        for k in range(n):
            if k == fail_at:
                raise RuntimeError("the source broke")
            seen.append((_shard_keys(store), MANIFEST_NAME in store.list()))
            yield pa.table({"id": np.arange(k * 50, (k + 1) * 50, dtype=np.int64)})

    result = write_arrow(tables(4), url, {"id": IntField()}, rows_per_shard=50, storage_options=opts)
    assert result == store.url + MANIFEST_NAME
    # before table k is read, shards 0..k-1 are in the store: each uploaded as soon as it was full
    assert [len(keys) for keys, _ in seen] == [0, 1, 2, 3]
    assert not any(manifest for _, manifest in seen)  # the manifest comes last
    assert _ids(store, tmp_path / "a") == list(range(200))
    before = sorted(store.list())
    with pytest.raises(RuntimeError, match="the source broke"):
        write_arrow(tables(4, fail_at=3), url, {"id": IntField()}, rows_per_shard=50, overwrite=True, storage_options=opts)
    assert sorted(store.list()) == before  # this write's uploaded shards deleted, the manifest untouched
    with pytest.raises(FileExistsError):
        write_arrow(tables(1), url, {"id": IntField()}, rows_per_shard=50, storage_options=opts)
    assert _ids(store, tmp_path / "b") == list(range(200))


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`use_:DeprecationWarning")  # Ray Data's own DataContext notices
def test_write_ray_dataset_uploads_from_its_tasks(s3: S3Server, proxy, store: Store, prefix: str, tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    from stoker.convert.ray import write_ray_dataset

    env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    temp = tempfile.mkdtemp(prefix="stoker-ray-", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp, _node_ip_address="127.0.0.1", log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        url, opts = s3.url(prefix), options(proxy.endpoint)
        result = write_ray_dataset(ray.data.range(300, override_num_blocks=3), url, storage_options=opts)
        assert result == store.url + MANIFEST_NAME
        manifest = json.loads(store.read(MANIFEST_NAME))
        assert len(manifest["shards"]) == 3
        assert sorted(_shard_keys(store)) == sorted(e["name"] for e in manifest["shards"])
        assert _ids(store, tmp_path / "a") == list(range(300))
        before, listed = store.read(MANIFEST_NAME), set(_shard_keys(store))
        bad = ray.data.range(100, override_num_blocks=2).map_batches(lambda b: {"id": b["id"].astype(np.uint64) + np.uint64(2**63 - 60)})
        with pytest.raises(SampleError, match=r"field 'id'"):
            write_ray_dataset(bad, url, overwrite=True, storage_options=opts)
        assert store.read(MANIFEST_NAME) == before  # the previous dataset, whole
        assert listed <= set(_shard_keys(store))
        # a task that Ray had not stopped may upload its shard after the driver's abort deleted the others: such a
        # shard is of the failed generation, listed by no manifest, so never read
        assert all(k in listed or manifest["generation"] not in k for k in _shard_keys(store))
        assert _ids(store, tmp_path / "b") == list(range(300))
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
