"""A mix of datasets in object storage and on local disk (issue 33), on the suite's loopback S3 server (moto).

A mix with a stream in the store gives the batches of the same mix read from local folders, cold and warm; the
streams in the store share one cache folder and one ``cache_limit`` (its size, sampled from another thread, never
passes it), their shards downloaded by first use whichever stream they belong to.
"""

from __future__ import annotations

import os
import shutil
import stat
import threading
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from benchmarks._servers.loopback import S3Server

from stoker import Loader, OrderOption, Stream
from stoker.dataset._manifest import MANIFEST_NAME, build_manifest
from stoker.dataset.shards import write_shards
from stoker.fields import BytesField, IntField, NDArrayField
from stoker.loader import _engine
from stoker.remote import open_store

from .conftest import options

PER_SHARD = 100
FIELDS = {"x": NDArrayField(np.dtype("float32"), (8,)), "y": IntField(), "blob": BytesField()}


def _arrays(n: int, base: int) -> dict[str, Any]:
    rng = np.random.default_rng(base)
    blobs = np.empty(n, dtype=object)
    for i in range(n):
        blobs[i] = rng.integers(0, 256, int(rng.integers(1, 200)), dtype=np.uint8).tobytes()
    return {"x": rng.normal(size=(n, 8)).astype(np.float32), "y": base + np.arange(n, dtype=np.int64), "blob": blobs}


@pytest.fixture(scope="module")
def folders(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three datasets (600, 300 and 400 samples in shards of 100), each in a local folder and in the store."""
    root = tmp_path_factory.mktemp("mix-remote")
    out: dict[str, Any] = {"options": options(s3.endpoint)}
    for name, n, base in (("a", 600, 0), ("b", 300, 10_000), ("c", 400, 20_000)):
        folder = root / name
        write_shards(folder, FIELDS, _arrays(n, base), samples_per_shard=PER_SHARD, num_workers=1, progress=False)
        url = s3.url(f"mix-{uuid.uuid4().hex[:8]}/{name}/")
        store = open_store(url, out["options"])
        for path in sorted(folder.iterdir()):
            if path.name != MANIFEST_NAME:
                store.upload(path.name, path)
        store.upload(MANIFEST_NAME, folder / MANIFEST_NAME)
        out[name] = (folder, url, max(p.stat().st_size for p in folder.glob("*.stoker")))
    return out


def _batches(loader: Loader) -> list[tuple[np.ndarray, ...]]:
    return [tuple(t.numpy().copy() for t in batch) for batch in loader]


def _same(a: list[tuple[np.ndarray, ...]], b: list[tuple[np.ndarray, ...]]) -> None:
    assert len(a) == len(b)
    for k, (one, two) in enumerate(zip(a, b)):
        for u, v in zip(one, two):
            assert u.dtype == v.dtype and u.shape == v.shape and np.array_equal(u, v), f"batch {k} differs"


@pytest.mark.parametrize(("order", "mix"), [(OrderOption.QUASI_RANDOM, "samples"), (OrderOption.RANDOM, "batches")])
def test_a_local_and_a_remote_stream_give_the_batches_of_two_local_ones(
    folders: dict[str, Any], tmp_path: Path, order: OrderOption, mix: str
) -> None:
    (a, _, _), (b_folder, b_url, b_shard) = folders["a"], folders["b"]
    kw: dict[str, Any] = {"batch_size": 50, "order": order, "seed": 4, "num_workers": 2, "chunk_size": 100, "window_chunks": 1,
                          "mix": mix, "return_indices": True, "return_source": True}  # fmt: skip
    local = Loader([Stream(str(a), weight=0.7, name="a"), Stream(str(b_folder), weight=0.3, name="b")], **kw)
    remote = Loader(
        [Stream(str(a), weight=0.7, name="a"), Stream(b_url, weight=0.3, name="b", storage_options=folders["options"])],
        cache_dir=tmp_path / "cache", cache_limit=4 * b_shard, **kw,
    )  # fmt: skip
    try:
        for _ in range(2):  # cold, then warm
            _same(_batches(local), _batches(remote))
        stats = remote.stats()
        assert stats["remote"]["downloads"] >= 3  # b's three shards
        assert set(stats["remote"]["streams"]) == {"b"} and stats["remote"]["streams"]["b"]["downloads"] >= 3
        assert stats["mix"]["b"]["read_s"] > 0 and stats["mix"]["a"]["read_s"] > 0  # both read through the bounded cache
        assert stats["remote"]["cache_peak_bytes"] <= 4 * b_shard
    finally:
        local.close()
        remote.close()


def test_two_remote_streams_share_one_cache_within_its_limit(folders: dict[str, Any], tmp_path: Path) -> None:
    """Three streams, two in the store, one cache of 5 shards: the cache's size, sampled all along two epochs, never
    passes the limit; both stores' shards lie in one folder; QUASI_RANDOM windows of a shard each: each shard is
    downloaded at most once per epoch (by first use, whichever stream)."""
    (a, _, _), (_, b_url, b_shard), (_, c_url, c_shard) = folders["a"], folders["b"], folders["c"]
    limit = 5 * max(b_shard, c_shard)
    opts = folders["options"]
    streams = [Stream(str(a), weight=2, name="a"), Stream(b_url, weight=1, name="b"), Stream(c_url, repeat=1, name="c")]
    loader = Loader(streams, batch_size=40, order=OrderOption.QUASI_RANDOM, seed=9, num_workers=2, chunk_size=PER_SHARD,
                    window_chunks=1, cache_dir=tmp_path / "cache", cache_limit=limit, storage_options=opts)  # fmt: skip
    remote = loader.remote
    assert remote is not None
    usage: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            usage.append(remote.cache.usage_bytes())
            stop.wait(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        seen, downloads = [], []
        for _ in range(2):
            seen.append(np.concatenate([y.numpy().ravel() for _, y, _ in loader]))
            downloads.append(loader.stats()["remote"]["downloads"])
    finally:
        stop.set()
        sampler.join()
        loader.close()
    for ys in seen:  # weights 2 : 1 share the 900 samples of a and b; c once (400)
        assert len(ys) == 1300 and ((ys >= 20_000).sum(), (ys < 10_000).sum()) == (400, 600)
    assert sorted(seen[0][seen[0] >= 20_000].tolist()) == list(range(20_000, 20_400))
    assert usage and max(usage) <= limit and remote.cache.peak_bytes <= limit
    assert downloads[0] == 3 + 4, "each of b's 3 and c's 4 shards once in the cold epoch"
    assert downloads[1] <= 2 * (3 + 4), "at most once more in the next (those the cache kept: none)"
    streams = loader.stats()["remote"]["streams"]
    assert streams["b"]["downloads"] + streams["c"]["downloads"] == downloads[1] and streams["c"]["downloads"] >= 4
    folders = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert len(folders) == 1, "one folder for the mix's shards and heads"
    files = {p.name for p in folders[0].iterdir() if not p.name.startswith(".")}  # (not the lock files)
    shards = {n for n in files if "@h" not in n}  # (heads: "<key>@h<header CRC>-<size>")
    assert any("%2Fb%2F" in n for n in shards) and any("%2Fc%2F" in n for n in shards)
    assert shards <= {remote.cached_path(k).name for k in range(3 + 4)}, "files named by their URLs and what they hold"


def test_downloads_are_scheduled_by_first_use_across_streams(folders: dict[str, Any], tmp_path: Path) -> None:
    """The shared schedule lists the stores' shards in the order the epoch's batches first read them, whichever stream,
    and counts for each the batches that read it (a local stream's samples count for none)."""
    (a, _, _), (_, b_url, _), (_, c_url, _) = folders["a"], folders["b"], folders["c"]
    streams = [Stream(str(a), weight=2, name="a"), Stream(b_url, weight=1, name="b"), Stream(c_url, weight=1, name="c")]
    loader = Loader(streams, batch_size=40, order=OrderOption.RANDOM, seed=3, num_workers=1, cache_dir=tmp_path / "cache",
                    storage_options=folders["options"], download_ahead=1)  # fmt: skip
    remote = loader.remote
    assert remote is not None
    reader = loader.reader
    order = loader.epoch_indices(0)
    shard = reader.remote_shard[reader.locate(order)[0]]  # type: ignore[attr-defined]
    batch = np.arange(len(order)) // 40
    first_use: list[int] = []
    need = np.zeros(len(remote.sizes), dtype=np.int64)
    for b in range(int(batch[-1]) + 1):
        for k in np.unique(shard[batch == b]).tolist():
            if k >= 0:
                need[k] += 1
                if k not in first_use:
                    first_use.append(k)
    it = iter(loader)
    try:
        assert remote._first_order == first_use
        assert remote._remaining.tolist() == need.tolist()
        for _ in it:
            pass
        assert remote._remaining.tolist() == [0] * len(need)  # every batch that needed a shard said it was done
    finally:
        del it
        loader.close()


def test_a_flipped_byte_in_a_local_stream_of_a_remote_mix_is_refused_naming_its_file(folders: dict[str, Any], tmp_path: Path) -> None:
    """The local streams of a mix with streams in object storage are checked block by block, as batches read them
    (through the descriptors the mix reads them with): a damaged local shard ends the epoch with an error that names it."""
    from stoker.errors import DatasetFormatError
    from stoker.format.reader import Reader

    local = tmp_path / "a"
    shutil.copytree(folders["a"][0], local)
    shard = sorted(local.glob("*.stoker"))[2]
    raw = bytearray(shard.read_bytes())
    with Reader(shard) as reader:
        at = reader.data_offset + 5
    raw[at] ^= 0xFF
    shard.write_bytes(bytes(raw))
    streams = [Stream(str(local), weight=0.7, name="a"), Stream(folders["b"][1], weight=0.3, name="b")]
    loader = Loader(streams, batch_size=50, num_workers=1, cache_dir=tmp_path / "cache", storage_options=folders["options"])
    try:
        with pytest.raises(DatasetFormatError, match=shard.name):
            for _ in loader:
                pass
    finally:
        loader.close()


def test_bit_rot_in_a_cached_shard_of_a_mix_is_found_block_by_block_and_refetched(folders: dict[str, Any], tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A byte flipped in a mix's cached shard after a first run: the next Loader did not download that file, so it checks
    the blocks its batches read before any compiled code reads them (as one dataset's reader does), downloads the
    shard again, and serves the right data."""
    from stoker.format.reader import Reader

    # one thread makes every batch (its producer): the CRCs computed are then an exact count (two threads making batches
    # beside each other may both check a block, as Reader.validate_samples says: 7 CRCs for 6 blocks seen)
    monkeypatch.setattr(_engine, "MAKE_WHEN_WAITING", False)

    (a, _, _), (b_folder, b_url, _) = folders["a"], folders["b"]
    kw: dict[str, Any] = {"batch_size": 50, "seed": 5, "num_workers": 1, "return_indices": True, "return_source": True}
    with Loader([Stream(str(a), weight=0.7, name="a"), Stream(str(b_folder), weight=0.3, name="b")], **kw) as local:
        want = _batches(local)
    streams = [Stream(str(a), weight=0.7, name="a"), Stream(b_url, weight=0.3, name="b", storage_options=folders["options"])]
    cache = tmp_path / "cache"
    with Loader(streams, cache_dir=cache, **kw) as first:
        _same(want, _batches(first))  # downloads b's shards (checked whole)
        rotten = first.remote.cached_path(1)  # type: ignore[union-attr]
        check = first.reader.data_check  # type: ignore[union-attr]
        assert check is not None and check.all_verified()  # a's blocks checked as read, b's shards whole at download
        a_blocks = int(check.block_base[6])  # (a's 6 shards come first)
        assert int(check.counts[0]) == a_blocks, "CRCs computed for a's blocks, none for b's shards (checked at download)"
    with Reader(rotten) as reader:
        at = reader._columns["x"] + 5 * 32 + 3  # sample 5's x
    raw = bytearray(rotten.read_bytes())
    raw[at] ^= 0x40
    rotten.write_bytes(bytes(raw))
    with Loader(streams, cache_dir=cache, **kw) as second:
        _same(want, _batches(second))  # not the flipped value
        stats = second.stats()["remote"]
    assert stats["refetches"] == 1 and stats["downloads"] == 1, stats  # that shard, once
    with Reader(rotten) as reader:
        reader.verify()  # the cache holds the good shard again


def test_a_rewritten_remote_stream_is_never_served_from_the_old_cache(s3: S3Server, tmp_path: Path) -> None:
    """A mix's dataset in the store rewritten under the same shard names with other content of the same sizes: a Loader
    after the rewrite reads the new data (the mix's cache names files by what they hold), with the check before use and
    without it (then nothing else would notice)."""
    fields = {"x": NDArrayField(np.dtype("float32"), (8,)), "y": IntField()}

    def write(folder: Path, seed: int, names: list[str] | None = None) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        arrays = {"x": rng.normal(size=(300, 8)).astype(np.float32), "y": np.arange(300, dtype=np.int64)}
        write_shards(folder, fields, arrays, samples_per_shard=PER_SHARD, num_workers=1, progress=False)
        if names is not None:
            renamed = [p.rename(folder / name) for p, name in zip(sorted(folder.glob("*.stoker")), names)]
            (folder / MANIFEST_NAME).write_bytes(build_manifest(folder, renamed, None))
        return arrays

    def upload(folder: Path, url: str) -> None:
        store = open_store(url, opts)
        for path in sorted(folder.iterdir()):
            if path.name != MANIFEST_NAME:
                store.upload(path.name, path)
        store.upload(MANIFEST_NAME, folder / MANIFEST_NAME)

    def remote_x(**kw: Any) -> np.ndarray:
        """The remote stream's x, by its index within the stream (one epoch: every sample of both once)."""
        with Loader(streams, batch_size=64, num_workers=1, return_indices=True, return_source=True, cache_dir=cache, **kw) as loader:
            out = np.zeros((300, 8), dtype=np.float32)
            for x, _, index, source in loader:
                mine = source.numpy() == 1
                out[index.numpy()[mine]] = x.numpy()[mine]
        return out

    opts = options(s3.endpoint)
    names = [f"part-{k}.stoker" for k in range(3)]
    write(tmp_path / "local", 7)
    old = write(tmp_path / "old", 1, names)
    new = write(tmp_path / "new", 2, names)
    assert [p.stat().st_size for p in sorted((tmp_path / "old").glob("*.stoker"))] == [
        p.stat().st_size for p in sorted((tmp_path / "new").glob("*.stoker"))
    ]
    url = s3.url(f"mix-rewritten-{uuid.uuid4().hex[:8]}/")
    streams = [Stream(str(tmp_path / "local"), weight=1, name="local"), Stream(url, weight=1, name="remote", storage_options=opts)]
    cache = tmp_path / "cache"
    upload(tmp_path / "old", url)
    assert np.array_equal(remote_x(), old["x"])
    upload(tmp_path / "new", url)
    for verify in (False, True):  # without the check before use too: the old files are not even looked at
        assert np.array_equal(remote_x(check_data=verify), new["x"]), f"check_data={verify}: the old shards' bytes were served"


def test_the_shared_cache_of_a_mix_has_the_default_limit_and_is_private_unless_shared(
    folders: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without cache_limit, a mix's cache takes the default limit (a fraction of the free disk) as one dataset's does;
    a cache folder its group can write is refused unless cache_shared=True; a default limit below a shard is refused."""
    from stoker.errors import StokerError, UnsafeCacheError
    from stoker.remote._cache_room import DEFAULT_LIMIT_FRACTION

    (a, _, _), (_, b_url, _) = folders["a"], folders["b"]
    streams = [Stream(str(a), weight=0.7, name="a"), Stream(b_url, weight=0.3, name="b", storage_options=folders["options"])]
    cache = tmp_path / "cache"
    with Loader(streams, batch_size=50, cache_dir=cache) as loader:
        remote = loader.remote
        assert remote is not None and remote.default_limit
        st = os.statvfs(cache)
        used = remote.cache.usage_bytes()
        assert abs(remote.limit - DEFAULT_LIMIT_FRACTION * (st.f_bavail * st.f_frsize + used)) < 0.01 * remote.limit + (64 << 20)
        assert remote.cache.limit == remote.limit == loader.stats()["remote"]["cache_limit"]
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    shared = tmp_path / "group-cache"
    shared.mkdir()
    shared.chmod(0o770)
    with pytest.raises(UnsafeCacheError, match="writable by its group"):
        Loader(streams, batch_size=50, cache_dir=shared)
    with Loader(streams, batch_size=50, cache_dir=shared, cache_shared=True) as loader:
        assert sum(len(y) for _, y, _ in loader) == 900  # opted in: used (every file still checked)
    monkeypatch.setattr("stoker.remote._cache_room.DEFAULT_LIMIT_FRACTION", 1e-12)
    with pytest.raises(StokerError, match=f"the default cache_limit.*{b_url}"):
        Loader(streams, batch_size=50, cache_dir=cache)


def test_closing_a_mix_stops_every_stores_downloads_and_report_names_the_store(folders: dict[str, Any], tmp_path: Path) -> None:
    """A mix of two streams in the store: the epoch's close stops the requests of both stores (downloads_stopped), and
    accepts them again after; report() ends with the line of the mix's store (downloads, retries)."""
    (_, b_url, b_shard), (_, c_url, _) = folders["b"], folders["c"]
    streams = [Stream(b_url, weight=0.5, name="b", storage_options=folders["options"]),
               Stream(c_url, weight=0.5, name="c", storage_options=folders["options"])]  # fmt: skip
    with Loader(streams, batch_size=50, seed=1, num_workers=1, cache_dir=tmp_path / "cache", cache_limit=6 * b_shard) as loader:
        remote = loader.reader.remote
        stores = remote.store.stores
        with loader.reader.downloads_stopped():
            assert all(s.interrupted for s in stores) and remote.store.interrupted
        assert not any(s.interrupted for s in stores)
        expected = len(loader)
        assert sum(1 for _ in loader) == expected > 0  # (downloads accepted again: the epoch reads every batch)
        report = loader.report()
    assert report.rstrip().splitlines()[-1].startswith("store of the mix: ")
    assert "retries of transient errors" in report.splitlines()[-1]


def test_stats_count_in_ints(folders: dict[str, Any], tmp_path: Path) -> None:
    """Counts (downloads, hits, requests, retries, bytes) are ints, durations (``*_s``) floats: in Store.stats(),
    ShardCache.stats(), a dataset in a store's stats() and a mix's, per stream too (issue 46)."""
    from stoker.dataset._remote import open_remote
    from stoker.dataset.mixed import open_mixed

    single = open_remote(folders["a"][1], storage_options=folders["options"], cache_dir=tmp_path / "one")
    mix = open_mixed([folders["b"][1], str(folders["c"][0])], ["b", "c"], storage_options=[folders["options"], None],
                     cache_dir=tmp_path / "mix")  # fmt: skip
    try:
        for reader in (single, mix):
            reader.read(0)  # a shard downloaded
        assert single.remote is not None and mix.remote is not None
        rows = [single.remote.store.stats(), single.remote.cache.stats(), single.remote.stats(), mix.remote.stats()]
        rows += mix.remote.part_stats()  # type: ignore[attr-defined]
        for row in rows:
            for key, value in row.items():
                assert type(value) is (float if key.endswith("_s") else int), (key, value)
        assert single.remote.stats()["downloads"] == 1 and mix.remote.stats()["downloads"] == 1
    finally:
        single.close()
        mix.close()
