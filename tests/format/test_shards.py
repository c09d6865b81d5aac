"""Sharded datasets: the writer, the manifest, ShardedReader's virtual storage, and the bounded page cache."""

from __future__ import annotations

import gc
import json
import mmap
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.dataset import ShardedReader, ShardedWriter, _vstore, open_dataset, write_shards
from stoker.dataset.shards import MANIFEST_NAME, read_manifest
from stoker.errors import DatasetFormatError
from stoker.fields import BytesField, IntField, JSONField, NDArrayField
from stoker.format import DatasetWriter, Reader

PAGE = mmap.PAGESIZE
FIELDS = {"x": NDArrayField((5,), np.dtype("<f4")), "y": IntField(), "b": BytesField(), "j": JSONField()}
N = 230


def sample(i: int) -> tuple:
    return (np.arange(5, dtype=np.float32) + i, i, bytes([i % 256]) * (i % 37), {"i": i})


class Data:
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple:
        return sample(i)


def as_array(value: object) -> np.ndarray:
    return np.frombuffer(value, dtype=np.uint8) if isinstance(value, bytes) else np.asarray(value)


def same(a: tuple, b: tuple) -> bool:
    return all(np.array_equal(as_array(x), as_array(y)) if not isinstance(x, dict) else x == y for x, y in zip(a, b))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("shards") / "data"
    ShardedWriter(folder, FIELDS, samples_per_shard=100, num_workers=1, progress=False).from_indexed_dataset(Data())
    return folder


def shard(folder: Path, k: int) -> Path:
    """Shard ``k`` of the folder's dataset (its name holds the write's generation)."""
    return read_manifest(folder)[k].path


def test_writer_makes_shards_and_a_manifest(sharded: Path) -> None:
    names = sorted(p.name for p in sharded.iterdir())
    manifest = json.loads((sharded / MANIFEST_NAME).read_text())
    gen = manifest["generation"]
    assert len(gen) == 8 and names == [MANIFEST_NAME] + [f"shard-g{gen}-{k:05d}.stoker" for k in range(3)]
    assert [s["name"] for s in manifest["shards"]] == names[1:]
    assert [s["num_samples"] for s in manifest["shards"]] == [100, 100, 30]
    assert manifest["num_samples"] == N


def test_every_sample_reads_back(sharded: Path) -> None:
    reader = open_dataset(sharded)
    assert isinstance(reader, ShardedReader) and reader.num_shards == 3 and len(reader) == N
    assert reader.shard_starts.tolist() == [0, 100, 200, 230]
    for i in range(N):
        assert same(reader.read(i), sample(i)), i


def test_virtual_storage_holds_every_shard_at_its_base(sharded: Path) -> None:
    """Rebased heap pointers and column offsets address each shard's bytes inside the one storage array."""
    reader = ShardedReader(sharded)
    storage, meta = reader.storage, reader.metadata
    assert all(b % PAGE == 0 for b in reader.bases.tolist())
    offsets = reader.column_offsets("x")
    for i in range(N):
        k = int(np.searchsorted(reader.shard_starts, i, side="right")) - 1
        local = i - int(reader.shard_starts[k])
        ptr, size = int(meta["b/ptr"][i]), int(meta["b/size"][i])
        assert bytes(storage[ptr : ptr + size]) == sample(i)[2]
        x = storage[int(offsets[k]) + local * 20 : int(offsets[k]) + (local + 1) * 20].view("<f4")
        assert np.array_equal(x, sample(i)[0])
    with pytest.raises(DatasetFormatError, match="column_offsets"):
        reader.column("x")


def test_storage_outlives_its_reader(sharded: Path) -> None:
    """The address range is unmapped only when no array points into it (else compiled code would crash)."""
    reader = ShardedReader(sharded)
    view = reader.storage[int(reader.bases[2]) :]
    expected = Reader(reader.paths[2]).storage[:64].copy()
    del reader
    gc.collect()
    assert np.array_equal(view[:64], expected)


def test_list_and_glob_sources(sharded: Path) -> None:
    files = sorted(sharded.glob("*.stoker"))
    for source in (files, str(sharded / "shard-*.stoker")):
        reader = open_dataset(source)
        assert len(reader) == N and same(reader.read(150), sample(150))
    assert isinstance(open_dataset(files[:1]), Reader)


def test_bytes_per_shard(tmp_path: Path) -> None:
    target = 6000
    paths = write_shards(tmp_path / "d", FIELDS, Data(), bytes_per_shard=target, num_workers=1, progress=False)
    sizes = [p.stat().st_size for p in paths]
    assert len(paths) > 2 and max(sizes) < 2 * target + 4096, sizes  # the header and padding come on top
    assert len(open_dataset(tmp_path / "d")) == N


def test_rewrite_with_fewer_shards_removes_the_extra_ones(tmp_path: Path) -> None:
    arrays = {"x": np.zeros((N, 5), np.float32), "y": np.arange(N)}
    fields = {"x": FIELDS["x"], "y": FIELDS["y"]}
    write_shards(tmp_path, fields, arrays, samples_per_shard=50, progress=False)
    assert len(list(tmp_path.glob("shard-*"))) == 5
    paths = write_shards(tmp_path, fields, arrays, samples_per_shard=200, progress=False)
    assert sorted(tmp_path.glob("shard-*")) == paths and len(paths) == 2
    reader = ShardedReader(tmp_path)
    assert reader.shard_starts.tolist() == [0, 200, 230]
    assert reader.read(229)[1] == 229


@pytest.mark.parametrize(("samples", "size"), [(None, None), (10, 10), (0, None), (None, -1)])
def test_writer_arguments(tmp_path: Path, samples: int | None, size: int | None) -> None:
    with pytest.raises(ValueError, match="_per_shard"):
        ShardedWriter(tmp_path, FIELDS, samples_per_shard=samples, bytes_per_shard=size)


def _copy(folder: Path, to: Path) -> Path:
    """A copy of a shard folder, to damage."""
    to.mkdir()
    for p in folder.iterdir():
        (to / p.name).write_bytes(p.read_bytes())
    return to


def test_missing_shard(sharded: Path, tmp_path: Path) -> None:
    folder = _copy(sharded, tmp_path / "copy")
    name = shard(folder, 1).name
    (folder / name).unlink()
    with pytest.raises(DatasetFormatError, match=rf"{name}: shard is missing"):
        open_dataset(folder)


def test_shard_with_other_fields(tmp_path: Path) -> None:
    """Files named by a list or a glob have no manifest: the fields are compared at open; the error names both shards."""
    DatasetWriter(tmp_path / "a.stoker", {"y": IntField()}, num_workers=1, progress=False).from_indexed_dataset([1, 2])
    DatasetWriter(tmp_path / "b.stoker", {"z": IntField()}, num_workers=1, progress=False).from_indexed_dataset([1, 2])
    for source in ([tmp_path / "a.stoker", tmp_path / "b.stoker"], str(tmp_path / "*.stoker")):
        with pytest.raises(DatasetFormatError, match=r"b\.stoker: shard has other fields than the first shard .*a\.stoker"):
            open_dataset(source)


def test_shard_rewritten_after_the_manifest(sharded: Path, tmp_path: Path) -> None:
    folder = _copy(sharded, tmp_path / "copy")
    name = shard(folder, 2).name
    DatasetWriter(folder / name, FIELDS, num_workers=1, progress=False).from_indexed_dataset([sample(0)])
    with pytest.raises(DatasetFormatError, match=rf"{name}: shard differs from the manifest"):
        open_dataset(folder)


def test_verify_names_the_corrupt_shard(sharded: Path, tmp_path: Path) -> None:
    folder = _copy(sharded, tmp_path / "copy")
    reader = ShardedReader(folder)
    reader.verify()
    path = shard(folder, 1)
    raw = bytearray(path.read_bytes())
    raw[Reader(path).heap_offset + 3] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(DatasetFormatError, match=rf"{path.name}: corrupt data region"):
        ShardedReader(folder).verify()


# ---- the page cache ---------------------------------------------------------------------------------


def runs_reference(starts: list[int], ends: list[int], gap: int) -> list[tuple[int, int]]:
    """Pages covered, as runs, merging runs less than ``gap`` pages apart: page by page."""
    pages = sorted({p for s, e in zip(starts, ends) if e > s for p in range(s // PAGE, (e - 1) // PAGE + 1)})
    out: list[list[int]] = []
    for p in pages:
        if out and p - out[-1][1] <= gap:
            out[-1][1] = p + 1
        else:
            out.append([p, p + 1])
    return [(a, b) for a, b in out]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 40 * PAGE), st.integers(0, 3 * PAGE)), max_size=20),
    st.integers(0, 4),
)
def test_page_runs_match_reference(ranges: list[tuple[int, int]], gap: int) -> None:
    starts = [s for s, _ in ranges]
    ends = [s + n for s, n in ranges]
    first, stop = _vstore.page_runs(np.array(starts, dtype=np.int64), np.array(ends, dtype=np.int64), gap)
    assert list(zip(first.tolist(), stop.tolist())) == runs_reference(starts, ends, gap)


@pytest.fixture
def files(tmp_path: Path) -> list[Path]:
    rng = np.random.default_rng(0)
    out = []
    for k, size in enumerate([5 * PAGE + 123, 3 * PAGE, 7 * PAGE + 1]):
        path = tmp_path / f"f{k}"
        path.write_bytes(rng.integers(1, 256, size, dtype=np.uint8).tobytes())  # no zero byte: a freed page shows
        out.append(path)
    return out


def expected_storage(files: list[Path]) -> np.ndarray:
    bases, total = _vstore.layout([p.stat().st_size for p in files])
    out = np.zeros(total, dtype=np.uint8)
    for p, b in zip(files, bases.tolist()):
        data = np.frombuffer(p.read_bytes(), dtype=np.uint8)
        out[b : b + len(data)] = data
    return out


def test_shared_page_stays_while_another_batch_holds_it(files: list[Path]) -> None:
    cache = _vstore.PageCache(files, [p.stat().st_size for p in files], max_gap=0)
    want = expected_storage(files)
    a = cache.acquire(np.array([100]), np.array([PAGE + 10]))  # pages 0, 1
    b = cache.acquire(np.array([PAGE + 20]), np.array([2 * PAGE + 5]))  # pages 1, 2
    assert cache.resident_bytes == 3 * PAGE
    cache.release(a)
    got = cache.storage[PAGE : 3 * PAGE]
    assert np.array_equal(got, want[PAGE : 3 * PAGE]), "a page still held by a batch was freed"
    assert not cache.storage[:PAGE].any(), "a page no batch holds was not freed"
    cache.release(b)
    assert cache.resident_bytes == 0 and cache.peak_bytes == 3 * PAGE


@pytest.mark.parametrize("keep", [0, 3 * PAGE])
def test_concurrent_batches_never_see_a_freed_page(files: list[Path], keep: int) -> None:
    """Three threads hold overlapping ranges at once; each checks its bytes while it holds them."""
    sizes = [p.stat().st_size for p in files]
    cache = _vstore.PageCache(files, sizes, max_gap=1, keep_bytes=keep)
    want = expected_storage(files)
    bases = cache.bases.tolist()
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(300):
            k = rng.integers(0, len(sizes), 4)
            starts = np.array([bases[j] + rng.integers(0, sizes[j]) for j in k], dtype=np.int64)
            ends = np.minimum(starts + rng.integers(1, 2 * PAGE, 4), [bases[j] + sizes[j] for j in k])
            ticket = cache.acquire(starts, ends)
            for s, e in zip(starts.tolist(), ends.tolist()):
                if not np.array_equal(cache.storage[s:e], want[s:e]):
                    errors.append(f"bytes {s}..{e} differ while held")
            cache.release(ticket)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert cache.resident_bytes <= keep and np.count_nonzero(cache.storage) <= keep


def test_truncated_file_is_named(files: list[Path]) -> None:
    cache = _vstore.PageCache(files, [p.stat().st_size for p in files])
    with open(files[2], "r+b") as fh:
        fh.truncate(PAGE)
    base = int(cache.bases[2])
    with pytest.raises(DatasetFormatError, match="f2: ends at byte"):
        cache.acquire(np.array([base + 3 * PAGE]), np.array([base + 4 * PAGE]))
    assert cache.resident_bytes == 0  # the failed batch holds nothing


def test_reader_given_a_folder_points_to_open_dataset(sharded: Path) -> None:
    with pytest.raises(DatasetFormatError, match=r"cannot be read: it is a folder; .*open_dataset"):
        Reader(sharded)


def test_kept_pages_are_reused_and_the_oldest_freed(files: list[Path]) -> None:
    cache = _vstore.PageCache(files, [p.stat().st_size for p in files], max_gap=0, keep_bytes=2 * PAGE)
    want = expected_storage(files)
    for page in (0, 1, 2):  # three single-page batches, one after the other
        cache.release(cache.acquire(np.array([page * PAGE]), np.array([page * PAGE + 1])))
    assert cache.resident_bytes == 2 * PAGE and cache.bytes_read == 3 * PAGE
    assert not cache.storage[:PAGE].any(), "the oldest kept page was not freed"
    assert np.array_equal(cache.storage[PAGE : 3 * PAGE], want[PAGE : 3 * PAGE])
    ticket = cache.acquire(np.array([PAGE]), np.array([3 * PAGE]))  # both kept pages: nothing read
    assert cache.bytes_read == 3 * PAGE
    cache.keep_bytes = 0
    cache.release(ticket)
    assert cache.resident_bytes == 0 and not cache.storage.any()
