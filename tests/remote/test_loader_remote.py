"""The Loader on a dataset in object storage: a real S3 server (moto) on loopback, no mock of the client.

Every test compares with the same dataset read from its local folder: a remote
dataset must give the same batches, cold (empty cache) or warm, in every order.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")

from benchmarks._servers import loopback

from stoker import Loader, OrderOption
from stoker.dataset._manifest import MANIFEST_NAME
from stoker.dataset.shards import write_shards
from stoker.errors import StokerError
from stoker.fields import BytesField, IntField, NDArrayField
from stoker.loader.loader import RemoteOrderWarning
from stoker.remote._store import open_store

N = 2400
PER_SHARD = 400


def _arrays(n: int = N) -> dict[str, Any]:
    rng = np.random.default_rng(7)
    blobs = np.empty(n, dtype=object)
    for i in range(n):
        blobs[i] = rng.integers(0, 256, int(rng.integers(1, 300)), dtype=np.uint8).tobytes()
    return {"x": rng.normal(size=(n, 32)).astype(np.float32), "y": np.arange(n, dtype=np.int64), "blob": blobs}


FIELDS = {"x": NDArrayField(np.dtype("float32"), (32,)), "y": IntField(), "blob": BytesField()}


def _upload(folder: Path, url: str) -> None:
    store = open_store(url)
    for path in sorted(folder.iterdir()):
        if path.name != MANIFEST_NAME:
            store.upload(path.name, path)
    store.upload(MANIFEST_NAME, folder / MANIFEST_NAME)  # last, as a writer does


@pytest.fixture(scope="module")
def s3() -> Iterator[loopback.S3Server]:
    with loopback.s3_server("loader-remote") as server:
        yield server


@pytest.fixture(scope="module")
def dataset(s3: loopback.S3Server, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, list[int]]:
    """The local folder, its URL in the store, and its shards' sizes."""
    folder = tmp_path_factory.mktemp("remote-data") / "ds"
    write_shards(folder, FIELDS, _arrays(), samples_per_shard=PER_SHARD, num_workers=1, progress=False)
    url = s3.url("ds/")
    _upload(folder, url)
    sizes = [p.stat().st_size for p in sorted(folder.glob("*.stoker"))]
    return folder, url, sizes


def _batches(loader: Loader) -> list[tuple[np.ndarray, ...]]:
    out = []
    for x, y, blob in loader:
        out.append((x.numpy().copy(), y.numpy().copy(), blob.numpy().copy()))
    return out


def _same(a: list[tuple[np.ndarray, ...]], b: list[tuple[np.ndarray, ...]]) -> None:
    assert len(a) == len(b)
    for k, (one, two) in enumerate(zip(a, b)):
        for u, v in zip(one, two):
            assert u.shape == v.shape and u.dtype == v.dtype, f"batch {k}"
            assert np.array_equal(u, v), f"batch {k} differs"


@pytest.mark.parametrize(
    ("order", "workers", "limit_shards"),
    [(OrderOption.SEQUENTIAL, 1, 3), (OrderOption.QUASI_RANDOM, 2, 3), (OrderOption.QUASI_RANDOM, 2, None), (OrderOption.RANDOM, 2, 8)],
)
def test_cold_and_warm_epochs_give_the_local_folders_batches(
    dataset: tuple[Path, str, list[int]], tmp_path: Path, order: OrderOption, workers: int, limit_shards: int | None
) -> None:
    folder, url, sizes = dataset
    limit = None if limit_shards is None else limit_shards * max(sizes)
    kw: dict[str, Any] = {"batch_size": 96, "order": order, "seed": 5, "num_workers": workers, "chunk_size": 128, "window_chunks": 2}
    local = Loader(str(folder), **kw)
    remote = Loader(url, cache_dir=tmp_path / "cache", cache_limit=limit, **kw)
    try:
        for _epoch in range(2):  # the first cold, the second (partly) warm
            _same(_batches(local), _batches(remote))
        stats = remote.remote.stats()
        assert stats["downloads"] >= len(sizes)  # every shard at least once
        if limit is None:
            assert stats["downloads"] == len(sizes)  # warm: nothing downloaded again
            assert stats["hits"] > 0
    finally:
        local.close()
        remote.close()


def test_the_cache_never_holds_more_than_its_limit(dataset: tuple[Path, str, list[int]], tmp_path: Path) -> None:
    """The cache's size, sampled from another thread all along two epochs, stays within the limit."""
    _folder, url, sizes = dataset
    limit = 3 * max(sizes)
    loader = Loader(url, batch_size=64, order=OrderOption.QUASI_RANDOM, seed=1, num_workers=2, cache_dir=tmp_path / "c",
                    cache_limit=limit, chunk_size=100, window_chunks=2)  # fmt: skip
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(loader.remote.cache.usage_bytes())
            stop.wait(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        seen = [int(v) for _ in range(2) for _, y, _ in loader for v in y.numpy().ravel()]
    finally:
        stop.set()
        sampler.join()
        loader.close()
    assert sorted(seen) == sorted(list(range(N)) * 2)
    assert samples and max(samples) <= limit
    assert loader.remote.cache.peak_bytes <= limit
    assert max(samples) > max(sizes)  # it did hold shards (the sampler saw them)


def test_downloads_follow_the_order_and_each_shard_is_fetched_once_per_epoch(dataset: tuple[Path, str, list[int]], tmp_path: Path) -> None:
    """QUASI_RANDOM with a cache of 3 shards: a window is one shard's samples, so an epoch downloads each shard once."""
    _, url, sizes = dataset
    loader = Loader(url, batch_size=50, order=OrderOption.QUASI_RANDOM, seed=2, num_workers=1, cache_dir=tmp_path / "c",
                    cache_limit=3 * max(sizes), chunk_size=PER_SHARD, window_chunks=1)  # fmt: skip
    try:
        for epoch in range(2):
            for _ in loader:
                pass
            assert loader.remote.stats()["downloads"] <= len(sizes) * (epoch + 1)
    finally:
        loader.close()


def test_a_flipped_byte_in_a_stored_shard_is_refused_naming_it(s3: loopback.S3Server, tmp_path: Path) -> None:
    folder = tmp_path / "ds"
    write_shards(folder, FIELDS, _arrays(800), samples_per_shard=PER_SHARD, num_workers=1, progress=False)
    shard = sorted(folder.glob("*.stoker"))[1]
    raw = bytearray(shard.read_bytes())
    from stoker.format.reader import Reader

    with Reader(shard) as reader:
        at = reader.data_offset + 10  # a data byte: the head (checked at open) stays intact
    raw[at] ^= 0xFF
    shard.write_bytes(bytes(raw))
    url = s3.url("flipped/")
    _upload(folder, url)
    loader = Loader(url, batch_size=100, num_workers=1, cache_dir=tmp_path / "c")  # the heads are fine
    try:
        with pytest.raises(StokerError) as info:
            for _ in loader:
                pass
        text = str(info.value) + repr(info.value.__cause__)
        assert shard.name in text and "flipped/" in text
        assert loader.remote.stats()["refetches"] >= 1  # downloaded once more before it was refused
        k = loader.remote.names.index(shard.name)
        assert loader.remote.cached_path(k).parent.is_dir() and not loader.remote.cached_path(k).exists()  # never published
    finally:
        loader.close()


def test_a_missing_manifest_is_an_error_at_open_naming_the_url(s3: loopback.S3Server, tmp_path: Path) -> None:
    from stoker.errors import RemoteError

    with pytest.raises(RemoteError, match=r"nothing-here/"):
        Loader(s3.url("nothing-here/"), batch_size=8, cache_dir=tmp_path)


def test_a_missing_shard_is_an_error_at_open_naming_it(s3: loopback.S3Server, tmp_path: Path) -> None:
    folder = tmp_path / "ds"
    write_shards(folder, FIELDS, _arrays(800), samples_per_shard=PER_SHARD, num_workers=1, progress=False)
    url = s3.url("holes/")
    _upload(folder, url)
    gone = sorted(folder.glob("*.stoker"))[0].name
    open_store(url).delete(gone)
    with pytest.raises(StokerError, match=gone):
        Loader(url, batch_size=8, cache_dir=tmp_path / "c")


def test_random_order_over_a_dataset_larger_than_the_cache_warns(dataset: tuple[Path, str, list[int]], tmp_path: Path) -> None:
    _, url, sizes = dataset
    with pytest.warns(RemoteOrderWarning, match="QUASI_RANDOM"):
        Loader(url, batch_size=8, order=OrderOption.RANDOM, seed=0, cache_dir=tmp_path, cache_limit=3 * max(sizes)).close()


def test_a_cache_limit_below_one_shard_is_refused_with_the_sizes(dataset: tuple[Path, str, list[int]], tmp_path: Path) -> None:
    _, url, sizes = dataset
    with pytest.raises(StokerError, match=rf"cache_limit=1000 bytes .* \({max(sizes)} bytes"):
        Loader(url, batch_size=8, cache_dir=tmp_path, cache_limit=1000)


def test_remote_arguments_on_a_local_dataset_are_refused(dataset: tuple[Path, str, list[int]], tmp_path: Path) -> None:
    folder, _, _ = dataset
    with pytest.raises(ValueError, match="cache_limit"):
        Loader(str(folder), batch_size=8, cache_limit=10**9)


def test_the_readme_image_example_trains_from_the_store(s3: loopback.S3Server, tmp_path: Path) -> None:
    """The README's image example, its dataset written straight to the store (ShardedWriter(url)) and trained on
    with Loader("s3://..."): only the writer's and the Loader's first arguments change."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text("utf-8")
    blocks = [b.split("```", 1)[0] for b in readme.split("```python\n")[1:]]
    (code,) = [b for b in blocks if 'DatasetWriter("images.stoker"' in b]
    url = s3.url("readme-images/")
    code = code.replace(
        'DatasetWriter("images.stoker"',
        f'from stoker.dataset.shards import ShardedWriter\nShardedWriter("{url}"',
    ).replace(
        "num_workers=2).from_indexed_dataset(Pictures())",
        "samples_per_shard=16, num_workers=2, progress=False).from_indexed_dataset(Pictures())",
    )
    code = code.replace('Loader("images.stoker",', f'Loader("{url}", cache_dir="cache", cache_limit=10**8,')
    assert f'Loader("{url}"' in code and f'ShardedWriter("{url}"' in code
    env = {**os.environ}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert len(re.findall(r"^epoch \d+: loss \d", proc.stdout, flags=re.M)) == 2, proc.stdout[-2000:]  # (the README's lines)


def test_eviction_order_follows_the_epochs_schedule(dataset: tuple[Path, str, list[int]], tmp_path: Path) -> None:
    """Shards the epoch does not read again go first, then those it reads latest; a shard read for the last time drops to first."""
    _, url, sizes = dataset
    loader = Loader(url, batch_size=PER_SHARD, num_workers=1, cache_dir=tmp_path, download_ahead=1)
    remote = loader.remote
    try:
        order = np.concatenate([np.arange(2 * PER_SHARD, 3 * PER_SHARD), np.arange(0, PER_SHARD), np.arange(PER_SHARD, 2 * PER_SHARD)])
        remote.schedule(loader.reader.locate(order)[0], PER_SHARD)  # shards 2, 0, 1 in this order; 3, 4, 5 not at all
        prio = [remote._priority(remote.names[k], remote.idents[k]) for k in range(len(sizes))]
        assert prio[3] == prio[4] == prio[5] == float("-inf")
        assert prio[2] > prio[0] > prio[1] > float("-inf")
        remote.begin(2)
        remote.done(2)  # its only batch has read it
        assert remote._priority(remote.names[2], remote.idents[2]) == float("-inf")
        assert remote._priority(remote.names[0], "h" + remote.idents[0]) == float("-inf")  # a head, or another content: first to go
    finally:
        loader.close()


def test_shards_whose_metadata_is_larger_than_the_first_read(s3: loopback.S3Server, tmp_path: Path) -> None:
    """A shard's front (header, field table, metadata) longer than the first range request is read in two."""
    from stoker.dataset import _remote_heads

    folder = tmp_path / "ds"
    n = 6000
    write_shards(folder, FIELDS, _arrays(n), samples_per_shard=n // 2, num_workers=1, progress=False)
    from stoker.format.reader import Reader

    with Reader(sorted(folder.glob("*.stoker"))[0]) as reader:
        assert reader.data_offset > _remote_heads.FIRST_READ  # the case under test
    url = s3.url("big-metadata/")
    _upload(folder, url)
    kw: dict[str, Any] = {"batch_size": 500, "num_workers": 1, "order": OrderOption.QUASI_RANDOM, "seed": 3}
    with Loader(str(folder), **kw) as local, Loader(url, cache_dir=tmp_path / "c", **kw) as remote:
        _same(_batches(local), _batches(remote))


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_downloads_only_the_shards_of_its_share(dataset: tuple[Path, str, list[int]], tmp_path: Path, rank: int) -> None:
    """SEQUENTIAL on 2 ranks: each rank's contiguous half of the order lies in half of the shards, and only those are fetched."""
    _, url, sizes = dataset
    with Loader(url, batch_size=100, num_workers=1, distributed=True, rank=rank, world_size=2, seed=0, cache_dir=tmp_path) as loader:
        seen = [int(v) for _, y, _ in loader for v in y.numpy().ravel()]
        stats = loader.remote.stats()
    half = N // 2
    assert seen == list(range(rank * half, (rank + 1) * half))
    assert stats["downloads"] == len(sizes) // 2
    cached = [k for k in range(len(sizes)) if loader.remote.cached_path(k).exists()]
    assert cached == list(range(rank * len(sizes) // 2, (rank + 1) * len(sizes) // 2))


def test_a_dataset_over_plain_https_style_http(dataset: tuple[Path, str, list[int]], tmp_path: Path) -> None:
    """http(s):// URLs: the same manifest and shards served by a plain HTTP server with Range requests."""
    folder, _, _ = dataset
    kw: dict[str, Any] = {"batch_size": 128, "num_workers": 2, "order": OrderOption.QUASI_RANDOM, "seed": 9}
    with loopback.RangeHTTPServer(folder.parent) as server:
        url = f"{server.endpoint}/{folder.name}/"
        with Loader(str(folder), **kw) as local, Loader(url, cache_dir=tmp_path, **kw) as remote:
            _same(_batches(local), _batches(remote))


def test_windows_over_groups_of_shards_stream_each_shard_once_per_epoch(dataset: tuple[Path, str, list[int]], tmp_path: Path) -> None:
    """window_shards=3: batches mix three shards, a group is read in one stretch, so a cache of 7 shards downloads each once."""
    folder, url, sizes = dataset
    kw: dict[str, Any] = {"batch_size": 64, "order": OrderOption.QUASI_RANDOM, "seed": 8, "num_workers": 2, "window_shards": 3,
                          "chunk_size": 100, "window_chunks": 4}  # fmt: skip
    with Loader(str(folder), **kw) as local, Loader(url, cache_dir=tmp_path, cache_limit=7 * max(sizes), **kw) as remote:
        for epoch in range(2):
            a, b = _batches(local), _batches(remote)
            _same(a, b)
            assert remote.remote.stats()["downloads"] <= len(sizes) * (epoch + 1)
        shards_in_batch = [len(set((y.ravel() // PER_SHARD).tolist())) for _, y, _ in b]
        assert np.median(shards_in_batch) == 3 and max(shards_in_batch) <= 6  # (a batch across two groups: up to 6)


def test_downloads_appear_on_the_loaders_timeline(dataset: tuple[Path, str, list[int]], tmp_path: Path) -> None:
    """loader.trace(): every shard downloaded in the traced epoch is a 'download' span on the downloading thread's track."""
    import json

    _, url, sizes = dataset
    with Loader(url, batch_size=100, num_workers=1, cache_dir=tmp_path / "c", order=OrderOption.QUASI_RANDOM, seed=0) as loader:
        with loader.trace(tmp_path / "run.json"):
            for _ in loader:
                pass
        downloads = loader.remote.stats()["downloads"]
    events = json.loads((tmp_path / "run.json").read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    spans = [e for e in events if e.get("cat") == "download" and e["name"].startswith("download ")]
    assert downloads == len(sizes)
    assert sorted(e["name"].split()[1] for e in spans) == sorted(loader.remote.names)
    assert all(e["ph"] == "X" and e["dur"] >= 0 for e in spans)


_RANK = """
import json, sys
import numpy as np
from stoker import Loader, OrderOption
url, cache, limit, rank = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
with Loader(url, batch_size=50, num_workers=2, order=OrderOption.QUASI_RANDOM, seed=rank, cache_dir=cache, cache_limit=limit,
            chunk_size=100, window_chunks=2) as loader:
    seen = sorted(int(v) for _ in range(2) for _, y, _ in loader for v in y.numpy().ravel())
    print(json.dumps({"seen": seen, "stats": loader.remote.stats()}))
"""


def test_two_ranks_on_one_node_share_the_cache_within_its_limit(dataset: tuple[Path, str, list[int]], tmp_path: Path) -> None:
    """Two processes (the ranks of a node) stream two epochs each through one cache of 3 shards: its size, sampled
    from a third process all along, never passes the limit, and each rank sees every sample of every epoch."""
    from stoker.remote import ShardCache

    _, url, sizes = dataset
    limit = 3 * max(sizes)
    cache_dir = tmp_path / "shared"
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, url, str(cache_dir), str(limit), str(r)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]  # fmt: skip
    watcher = ShardCache(open_store(url), cache_dir, limit)
    samples = []
    while any(p.poll() is None for p in procs):
        samples.append(watcher.usage_bytes())
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        got = json.loads(out)
        assert got["seen"] == sorted(list(range(N)) * 2)
    assert len(samples) > 10 and max(samples) <= limit
    assert max(samples) > 0
