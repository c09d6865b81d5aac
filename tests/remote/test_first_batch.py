"""The store's first batch: what is read before it (issue 44).

Counted on real servers on loopback (moto's S3 server, behind the suite's fault
proxy, which counts the requests it passes on, or the latency proxy): one
manifest read per dataset and one round trip per shard's head (a shard of at
most ``FIRST_READ + TAIL_READ`` bytes in one request; a larger one's first and
last bytes at once), the first shard's at open, the others' as batches need
them (``tests/remote/test_lazy_heads.py``); then the first batch's shards are downloaded before any
other shard is downloaded ahead (they do not share the link with downloads
that later batches need).

No timing is asserted: the order of the downloads is read from the loader's
timeline (``loader.trace()``), where a download ahead can only start after the
first batch's shards have arrived (a causal order, whatever the machine's load).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

pytest.importorskip("obstore")
pytest.importorskip("moto")

from benchmarks._servers.loopback import LatencyProxy, S3Server

from stoker import Loader, OrderOption, Stream
from stoker.dataset import _remote_heads
from stoker.dataset._manifest import MANIFEST_NAME
from stoker.dataset.sharded import open_dataset
from stoker.dataset.shards import write_manifest, write_shards
from stoker.errors import DatasetFormatError
from stoker.fields import BytesField, IntField, NDArrayField
from stoker.format.reader import Reader
from stoker.remote import open_store
from tests.remote._faults import FaultProxy
from tests.remote.conftest import options

PER_SHARD = 100


def _write(folder: Path, n: int, per_shard: int, width: int, base: int = 0, blob: int = 0) -> list[Path]:
    rng = np.random.default_rng(base + n)
    fields: dict[str, Any] = {"x": NDArrayField(np.dtype("float32"), (width,)), "y": IntField()}
    arrays: dict[str, Any] = {"x": rng.normal(size=(n, width)).astype(np.float32), "y": base + np.arange(n, dtype=np.int64)}
    if blob:
        fields["blob"] = BytesField()
        blobs = np.empty(n, dtype=object)
        for i in range(n):
            blobs[i] = rng.integers(0, 256, int(rng.integers(0, blob)), dtype=np.uint8).tobytes()
        arrays["blob"] = blobs
    return write_shards(folder, fields, arrays, samples_per_shard=per_shard, num_workers=1, progress=False)


def _upload(folder: Path, url: str, endpoint: str) -> None:
    store = open_store(url, options(endpoint))
    for path in sorted(folder.iterdir()):
        if path.name != MANIFEST_NAME:
            store.upload(path.name, path)
    store.upload(MANIFEST_NAME, folder / MANIFEST_NAME)  # last, as a writer does


@pytest.fixture
def faults(s3: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(s3.host, s3.port) as proxy:  # (no fault: it counts the requests)
        yield proxy


# ---- heads: one round trip each ------------------------------------------------------------------------------
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    shards=st.lists(st.integers(1, 4000), min_size=1, max_size=3),
    width=st.sampled_from([4, 64, 256]),
    blob=st.sampled_from([0, 300]),
    tail=st.sampled_from([1 << 16, 4096, 8]),
    records=st.booleans(),
)
@example(shards=[4000], width=4, blob=300, tail=1 << 16, records=True)  # (a front longer than the first read: recorded,
@example(shards=[4000], width=4, blob=300, tail=1 << 16, records=False)  # read at once; not recorded, read in two)
def test_each_head_is_read_in_one_round_trip_and_holds_the_shards_bytes(
    s3: S3Server, faults: FaultProxy, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch,
    shards: list[int], width: int, blob: int, tail: int, records: bool,
) -> None:  # fmt: skip
    """Shards of a few KB to about 1.5 MB (fronts longer than the first read, checksum tables longer than the tail read
    among them): a shard of at most FIRST_READ + TAIL_READ bytes is read in one request; a larger one in its first and
    last bytes (requested at once), plus the rest of its front or its checksum table when they do not fit (the first
    read takes the whole front when the manifest's head ``records`` give its length); and the head kept in the cache
    is the local file's bytes exactly (front, then checksum table)."""
    monkeypatch.setattr(_remote_heads, "TAIL_READ", tail, raising=False)
    root = tmp_path_factory.mktemp("heads")
    folder = root / "ds"
    files: list[Path] = []
    for k, n in enumerate(shards):  # shards of several sizes in one dataset: written one by one
        files += [p.rename(root / f"s{k}.stoker") for p in _write(root / f"w{k}", n, n, width, blob=blob)]
    folder.mkdir()
    for p in files:
        p.rename(folder / p.name)
    write_manifest(folder, [folder / p.name for p in files])
    manifest = json.loads((folder / MANIFEST_NAME).read_bytes())
    if not records:  # (an older stoker's manifest: no head records)
        for e in manifest["shards"]:
            e.pop("head", None)
        (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    recorded = {e["name"] for e in manifest["shards"] if "head" in e}
    url = s3.url(f"heads-{uuid.uuid4().hex[:8]}/")
    _upload(folder, url, s3.endpoint)
    before = dict(faults.gets)
    reader = open_dataset(url, storage_options=options(faults.endpoint), cache_dir=root / "cache")
    try:
        reader.read_heads()  # type: ignore[union-attr]  # (the first at open, the others now: see test_lazy_heads.py)
        prefix = "/" + url.partition("://")[2]
        got = {p: n - before.get(p, 0) for p, n in faults.gets.items() if n - before.get(p, 0)}
        assert got.pop(prefix + MANIFEST_NAME) == 1
        for k, path in enumerate(sorted(folder.glob("*.stoker"))):
            size = path.stat().st_size
            with Reader(path) as local:
                front, back = local.data_offset, size - local.checksum_offset
            first = max(_remote_heads.FIRST_READ, front) if path.name in recorded else _remote_heads.FIRST_READ
            if size <= first + tail:
                want = 1
            else:
                want = 2 + (front > first) + (back > tail)
            assert got.pop(prefix + path.name) == want, f"shard {k}: {size} bytes, front {front}, checksum table {back}"
            raw = path.read_bytes()
            assert reader.paths[k].read_bytes() == raw[:front] + raw[size - back :]
        assert got == {}  # nothing else was read
    finally:
        reader.close()


# ---- the first batch's shards come first -------------------------------------------------------------------------
def _downloads(trace: Path) -> dict[str, tuple[float, float]]:
    """Each shard download on the timeline: its cache key -> (start, end) [µs]."""
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    out = {}
    for e in events:
        if e.get("cat") == "download" and e["name"].startswith("download "):
            key = e["name"].split(" ", 1)[1]
            assert key not in out, f"{key} downloaded twice"
            out[key] = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
    return out


def _assert_first_batch_first(downloads: dict[str, tuple[float, float]], lead: set[str]) -> None:
    assert lead and lead <= set(downloads), (lead, sorted(downloads))
    here = max(downloads[key][1] for key in lead)
    later = {key: start for key, (start, _) in downloads.items() if key not in lead}
    assert later, "the test needs downloads after the first batch's"
    early = {key: round(here - start) for key, start in later.items() if start < here - 2}  # (2 µs: the timeline's rounding)
    assert not early, f"downloaded ahead while the first batch's shards {sorted(lead)} were still on the way (µs early): {early}"


@pytest.mark.parametrize("order", [OrderOption.SEQUENTIAL, OrderOption.QUASI_RANDOM])
def test_the_first_batchs_shards_are_downloaded_before_any_other(
    s3: S3Server, tmp_path: Path, order: OrderOption
) -> None:  # fmt: skip
    """One dataset of 6 shards, 20 ms a request: before the first batch's shards (known from the local folder's first
    batch) have arrived, no other shard is downloaded ahead; then the rest are, and the epoch gives every sample once."""
    folder = tmp_path / "ds"
    _write(folder, 6 * PER_SHARD, PER_SHARD, 64)
    url = s3.url(f"first-{uuid.uuid4().hex[:8]}/")
    _upload(folder, url, s3.endpoint)
    kw: dict[str, Any] = {"batch_size": 50, "order": order, "seed": 3, "num_workers": 1, "chunk_size": 100, "window_chunks": 1}
    with Loader(str(folder), **kw) as local:
        first = next(iter(local))[1].numpy().ravel()
    lead = {sorted(p.name for p in folder.glob("*.stoker"))[int(y) // PER_SHARD] for y in first}
    with (
        LatencyProxy(s3.host, s3.port, latency_ms=20) as proxy,
        Loader(url, cache_dir=tmp_path / "c", storage_options=options(proxy.endpoint), **kw) as loader,
        loader.trace(tmp_path / "run.json"),
    ):
        seen = sorted(int(v) for batch in loader for v in batch[1].numpy().ravel())
    assert seen == list(range(6 * PER_SHARD))
    _assert_first_batch_first(_downloads(tmp_path / "run.json"), lead)


def test_a_mixs_first_batch_shards_are_downloaded_before_any_other(s3: S3Server, tmp_path: Path) -> None:
    """Two datasets in the store, mixed (one cache, one schedule): the same, over both datasets' shards; each dataset's
    manifest is read once."""
    urls, names = [], []
    for name, base in (("a", 0), ("b", 10_000)):
        folder = tmp_path / name
        _write(folder, 4 * PER_SHARD, PER_SHARD, 64, base=base)
        url = s3.url(f"mixfirst-{uuid.uuid4().hex[:8]}/{name}/")
        _upload(folder, url, s3.endpoint)
        urls.append(url)
        names.append(sorted(p.name for p in folder.glob("*.stoker")))
    kw: dict[str, Any] = {"batch_size": 50, "order": OrderOption.QUASI_RANDOM, "seed": 5, "num_workers": 1, "chunk_size": 100,
                          "window_chunks": 1}  # fmt: skip
    with Loader([Stream(str(tmp_path / "a"), name="a"), Stream(str(tmp_path / "b"), name="b")], **kw) as local:
        first = next(iter(local))[1].numpy().ravel()
    lead = {urls[int(y) >= 10_000] + names[int(y) >= 10_000][(int(y) % 10_000) // PER_SHARD] for y in first}
    with LatencyProxy(s3.host, s3.port, latency_ms=20) as proxy:
        streams = [Stream(u, name=n, storage_options=options(proxy.endpoint)) for u, n in zip(urls, ("a", "b"))]
        with Loader(streams, cache_dir=tmp_path / "c", **kw) as loader, loader.trace(tmp_path / "run.json"):
            seen = sorted(int(v) for batch in loader for v in batch[1].numpy().ravel())
    assert seen == sorted([*range(4 * PER_SHARD), *range(10_000, 10_000 + 4 * PER_SHARD)])
    _assert_first_batch_first(_downloads(tmp_path / "run.json"), lead)


# ---- a damaged head is still refused ------------------------------------------------------------------------------
@pytest.mark.parametrize("width", [4, 256])
def test_a_later_shards_damaged_checksum_table_is_refused_naming_it(s3: S3Server, tmp_path: Path, width: int) -> None:
    """A byte of the last shard's checksum table flipped in the store (a small shard read whole, a larger one's last
    bytes read beside its first): the batch that first reads that shard (its head is read then) is refused naming
    that shard's URL, as before at open."""
    folder = tmp_path / "ds"
    files = _write(folder, 4 * PER_SHARD, PER_SHARD, width)
    url = s3.url(f"damaged-{uuid.uuid4().hex[:8]}/")
    _upload(folder, url, s3.endpoint)
    last = sorted(files)[-1]
    raw = bytearray(last.read_bytes())
    with Reader(last) as local:
        assert local.checksum_offset < len(raw)
        raw[local.checksum_offset] ^= 0x01
    store = open_store(url, options(s3.endpoint))
    damaged = tmp_path / "damaged.stoker"
    damaged.write_bytes(bytes(raw))
    store.upload(last.name, damaged)
    with (
        Loader(url, cache_dir=tmp_path / "c", storage_options=options(s3.endpoint), batch_size=10) as loader,
        pytest.raises(DatasetFormatError) as info,
    ):
        for _ in loader:
            pass
    assert str(info.value).startswith(url + last.name), str(info.value)


# ---- a head evicted by another process while this one opens ----------------------------------------------------
def test_a_head_evicted_right_after_it_is_opened_still_opens(s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process sharing the cache may evict a head file as soon as this one has opened it (it is unpinned): the
    manifest's ``fields_sha256`` is checked on the head this process opened, never read again by its path (before, the
    open failed with "shard is missing", seen in ``test_cache_trust.py::test_two_processes_share_a_cache_of_four_shards``).
    The eviction is the file's removal, as the other process's cache does it."""
    from stoker.dataset import _remote

    _write(tmp_path / "ds", 250, PER_SHARD, 4)
    url = s3.url(f"evicted-{uuid.uuid4().hex[:8]}/")
    _upload(tmp_path / "ds", url, s3.endpoint)
    real, removed = _remote.open_head, []

    def open_then_evicted(*args: Any, **kwargs: Any) -> Any:
        path, reader = real(*args, **kwargs)
        path.unlink()  # (the open reader keeps its mapping, as with a real eviction)
        removed.append(path)
        return path, reader

    monkeypatch.setattr(_remote, "open_head", open_then_evicted)
    reader = open_dataset(url, storage_options=options(s3.endpoint), cache_dir=tmp_path / "cache")
    try:
        reader.read_heads()  # type: ignore[union-attr]  # (the first at open, the others now)
        assert len(removed) == 3 and reader.num_samples == 250
    finally:
        reader.close()
