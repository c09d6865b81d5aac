"""A Ray dataset into stoker shards, on a local Ray runtime started here and kept on loopback."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stoker.dataset.shards import MANIFEST_NAME, read_manifest
from stoker.errors import SampleError
from stoker.fields import BytesField, IntField, NDArrayField, RGBImageField
from tests.convert._readback import loader_ids, read_shards

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from stoker.convert.ray import write_ray_dataset  # noqa: E402

# Ray's own deprecation notices (raised inside Ray Data) are not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:`use_:DeprecationWarning")  # DataContext: `use_polars`, `use_push_based_shuffle`

N = 20_000
SHARDS = 4
_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


@pytest.fixture(scope="module", autouse=True)
def ray_runtime() -> Iterator[None]:
    """A private two-CPU Ray on 127.0.0.1, with a temporary folder of its own (short: Ray puts sockets there)."""
    saved = {k: os.environ.get(k) for k in _ENV}
    os.environ.update(_ENV)
    temp = tempfile.mkdtemp(prefix="stoker-ray-", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp, _node_ip_address="127.0.0.1", log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        yield
    finally:
        ray.shutdown()
        for _ in range(10):  # Ray's processes may still write their last logs there for a moment
            shutil.rmtree(temp, ignore_errors=True)
            if not os.path.exists(temp):
                break
            time.sleep(0.5)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def image_of(i: np.ndarray) -> np.ndarray:
    """Images (8x8 RGB) that differ from row to row, a function of the row ids."""
    grid = np.arange(8 * 8 * 3, dtype=np.int64).reshape(1, 8, 8, 3)
    return ((grid * 31 + i.reshape(-1, 1, 1, 1) * 7) % 251).astype(np.uint8)


def images_and_labels(batch: dict[str, np.ndarray]) -> dict[str, Any]:
    ids = batch["id"]
    return {"id": ids, "image": image_of(ids), "label": ids % 10}


@pytest.mark.long
def test_20000_images_and_labels_every_row_once_and_equal(tmp_path: Path) -> None:
    ds = ray.data.range(N, override_num_blocks=SHARDS).map_batches(images_and_labels)
    out = tmp_path / "shards"
    t0 = time.perf_counter()
    manifest = write_ray_dataset(ds, out, {"image": RGBImageField(), "label": IntField(), "id": IntField()})
    seconds = time.perf_counter() - t0
    assert manifest == out / MANIFEST_NAME
    infos = read_manifest(out)
    gen = json.loads(manifest.read_text())["generation"]
    assert [i.path.name for i in infos] == [f"shard-g{gen}-{k:05d}.stoker" for k in range(SHARDS)]  # one per block
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST_NAME] + [i.path.name for i in infos])  # no temporaries
    sizes, rows = read_shards(out)
    assert sum(sizes) == N and len(sizes) == SHARDS
    ids = np.array([r[2] for r in rows])
    np.testing.assert_array_equal(ids, np.arange(N))  # every row once, in the dataset's order
    images = np.stack([r[0] for r in rows])
    np.testing.assert_array_equal(images, image_of(ids))
    np.testing.assert_array_equal([r[1] for r in rows], ids % 10)
    print(f"write_ray_dataset: {N} rows in {seconds:.2f} s")  # (reported, never asserted: tests assert no time)
    np.testing.assert_array_equal(loader_ids(out, "id"), np.arange(N))  # Loader('dir/') over the shards


def test_inferred_fields_and_more_blocks_than_cpus(tmp_path: Path) -> None:
    ds = ray.data.range(1000, override_num_blocks=7).map_batches(
        lambda b: {"id": b["id"], "x": np.stack([b["id"], -b["id"]], axis=1).astype(np.float32), "s": [f"r{i}".encode() for i in b["id"]]}
    )
    write_ray_dataset(ds, tmp_path / "s")
    sizes, rows = read_shards(tmp_path / "s")
    assert 7 <= len(sizes) <= 8, sizes  # Ray cuts range(1000) into 7 blocks of 142 and a last one of 6
    from stoker.format import Reader

    with Reader(read_manifest(tmp_path / "s")[0].path) as r:
        assert r.fields == {"id": IntField(), "x": NDArrayField((2,), np.float32), "s": BytesField()}
    assert [r[0] for r in rows] == list(range(1000))
    np.testing.assert_array_equal(rows[999][1], [999.0, -999.0])
    assert bytes(rows[5][2]) == b"r5"


def test_min_rows_per_shard_gathers_blocks(tmp_path: Path) -> None:
    ds = ray.data.range(1000, override_num_blocks=10)
    write_ray_dataset(ds, tmp_path / "s", min_rows_per_shard=500)
    sizes, rows = read_shards(tmp_path / "s")
    assert len(sizes) < 10 and all(s >= 100 for s in sizes)
    assert [r[0] for r in rows] == list(range(1000))


def test_errors(tmp_path: Path) -> None:
    ds = ray.data.range(100, override_num_blocks=2)
    with pytest.raises(KeyError, match=r"column 'label', which the data does not have; its columns are \['id'\]"):
        write_ray_dataset(ds, tmp_path / "a", {"label": IntField()})
    with pytest.raises(TypeError, match=r"column 'id' has Arrow type int64, which the field RGBImageField\(.*\) cannot hold"):
        write_ray_dataset(ds, tmp_path / "b", {"id": RGBImageField()})
    with pytest.raises(TypeError, match=r"expected a ray\.data\.Dataset; got list"):
        write_ray_dataset([1, 2], tmp_path / "c")  # type: ignore[arg-type]


def test_a_refused_value_fails_the_write_and_leaves_no_dataset(tmp_path: Path) -> None:
    ds = ray.data.range(100, override_num_blocks=2).map_batches(lambda b: {"id": b["id"].astype(np.uint64) + np.uint64(2**63 - 60)})
    with pytest.raises(SampleError, match=r"field 'id'") as info:
        write_ray_dataset(ds, tmp_path / "s")
    assert re.search(r"shard-g[0-9a-f]{8}-0000\d\.stoker", "".join(getattr(info.value, "__notes__", [])) + str(info.value))
    assert not list((tmp_path / "s").glob("*"))


def test_a_retried_task_replaces_its_shard(tmp_path: Path) -> None:
    """Ray runs a failed task again with the same index: the shard is written again under the same name."""
    import pyarrow as pa

    from stoker.convert.ray import stoker_datasink

    sink = stoker_datasink(tmp_path, {"id": IntField()})
    ctx = type("Ctx", (), {"task_idx": 3})()
    block = pa.table({"id": np.arange(10), "other": np.zeros(10)})
    first = sink.write([block], ctx)
    again = sink.write([block.slice(0, 4), block.slice(4)], ctx)
    name = f"shard-g{sink.generation}-00003.stoker"
    assert first == again == {"task": 3, "name": name, "rows": 10}
    assert [p.name for p in tmp_path.iterdir()] == [name]  # no duplicate, no temporary
    assert sink.write([block.slice(0, 0)], ctx) is None  # an empty task writes nothing


def test_a_failed_overwrite_keeps_the_previous_dataset(tmp_path: Path) -> None:
    """Issue 23 finding 2: overwrite=True deleted the old dataset first, and a failed write left an empty folder."""
    out = tmp_path / "s"
    write_ray_dataset(ray.data.range(30, override_num_blocks=3), out)
    before = sorted(p.name for p in out.iterdir())
    bad = ray.data.range(100, override_num_blocks=2).map_batches(lambda b: {"id": b["id"].astype(np.uint64) + np.uint64(2**63 - 60)})
    with pytest.raises(SampleError, match=r"field 'id'"):
        write_ray_dataset(bad, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == before  # the old shards and manifest, nothing of the failed write
    assert [r[0] for r in read_shards(out)[1]] == list(range(30))
    write_ray_dataset(ray.data.range(12, override_num_blocks=2), out, overwrite=True)
    assert [r[0] for r in read_shards(out)[1]] == list(range(12))
    assert len(list(out.glob("shard-*.stoker"))) == 2  # the previous generation's shards are gone


def test_images_of_varying_sizes(tmp_path: Path) -> None:
    items = [{"image": np.full((2 + i % 3, 3 + i % 2, 3), i, np.uint8), "id": i} for i in range(12)]
    write_ray_dataset(ray.data.from_items(items, override_num_blocks=3), tmp_path / "s", {"image": RGBImageField(), "id": IntField()})
    _, rows = read_shards(tmp_path / "s")
    assert [r[1] for r in rows] == list(range(12))
    for image, i in rows:
        np.testing.assert_array_equal(image, items[i]["image"])
