"""``Loader('dir/')`` over shards: the same batches as over one file, and QUASI_RANDOM windows kept within shards.

SEQUENTIAL and RANDOM must equal a Loader over the single file exactly.
QUASI_RANDOM keeps its windows within shards, so its order legitimately
differs from the single file's: it is checked against a numpy reference of the
documented shard-aware order (:func:`stoker.loader.order.epoch_order`), every
window's samples must come from one shard, and the batches must hold the
samples that order names.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.dataset import ShardedWriter
from stoker.dataset.shards import read_manifest
from stoker.errors import DatasetFormatError, StokerError
from stoker.loader.loader import Loader
from stoker.loader.order import OrderOption, epoch_order
from stoker.writer import DatasetWriter
from tests.loader.conftest import MIXED_FIELDS, N_SAMPLES, MixedDataset

SHARD = 90  # 237 samples: shards of 90, 90 and 57


# under ``make test`` Python producers make the batches: shards against one file, not the loop, is the subject (tests/_profile.py)
pytestmark = pytest.mark.usefixtures("python_producers_unless_long")


@pytest.fixture(scope="module")
def single(mixed_path: Path) -> Path:
    """The same samples in one file (the loader tests' mixed dataset)."""
    return mixed_path


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sharded") / "mixed"
    ShardedWriter(out, MIXED_FIELDS, samples_per_shard=SHARD, num_workers=1, progress=False).from_indexed_dataset(MixedDataset())
    return out


def as_arrays(batch: Any) -> list[np.ndarray]:
    """A batch's tensors as numpy copies."""
    return [np.array(t.numpy()) for t in batch]


def epoch(source: Path | str | list[Path], **kwargs: object) -> list[list[np.ndarray]]:
    with Loader(source, **kwargs) as loader:  # type: ignore[arg-type]
        return [as_arrays(batch) for batch in loader]


def assert_same(a: list[list[np.ndarray]], b: list[list[np.ndarray]]) -> None:
    assert len(a) == len(b)
    for k, (x, y) in enumerate(zip(a, b)):
        for f, (u, v) in enumerate(zip(x, y)):
            assert np.array_equal(u, v), f"batch {k}, output {f}"


@pytest.mark.parametrize("order", [OrderOption.SEQUENTIAL, OrderOption.RANDOM])
@pytest.mark.parametrize(
    ("batch_size", "workers", "os_cache"), [(32, 2, True), pytest.param(50, 1, True, marks=pytest.mark.long), (32, 2, False)]
)  # (TEST_SPLIT.md)
def test_shards_equal_the_single_file(
    single: Path, folder: Path, order: OrderOption, batch_size: int, workers: int, os_cache: bool
) -> None:
    kwargs = {"batch_size": batch_size, "num_workers": workers, "order": order, "seed": 11}
    assert_same(epoch(folder, os_cache=os_cache, **kwargs), epoch(single, **kwargs))


def test_indices_and_distributed_equal_the_single_file(single: Path, folder: Path) -> None:
    indices = np.random.default_rng(3).integers(0, N_SAMPLES, 150)
    for rank in range(2):
        kwargs = {"batch_size": 16, "num_workers": 2, "order": OrderOption.RANDOM, "seed": 4, "indices": indices,
                  "distributed": True, "rank": rank, "world_size": 2}  # fmt: skip
        assert_same(epoch(folder, **kwargs), epoch(single, **kwargs))


# ---- QUASI_RANDOM ---------------------------------------------------------------------------------------


def quasi_reference(indices: np.ndarray, seed: int, ep: int, chunk: int, window: int, starts: list[int]) -> list[np.ndarray]:
    """The documented shard-aware QUASI_RANDOM order, as a list of windows (plain loops)."""
    rng = np.random.default_rng([seed & 0xFFFFFFFF, seed >> 32 & 0xFFFFFFFF, ep])
    ordered = np.sort(indices)
    chunks = []
    for k in range(len(starts) - 1):
        mine = ordered[(ordered >= starts[k]) & (ordered < starts[k + 1])]
        chunks += [(k, mine[a : a + chunk]) for a in range(0, len(mine), chunk)]
    if not chunks:
        return []
    windows: list[tuple[int, list[np.ndarray]]] = []
    for c in rng.permutation(len(chunks)):
        k, values = chunks[c]
        current = [w for w in windows if w[0] == k]
        if current and len(current[-1][1]) < window:
            current[-1][1].append(values)
        else:
            windows.append((k, [values]))
    return [rng.permutation(np.concatenate(parts)) for _, parts in windows]


def legacy_quasi(indices: np.ndarray, seed: int, ep: int, chunk: int, window: int) -> np.ndarray:
    """QUASI_RANDOM of a single file as it was before shards existed."""
    rng = np.random.default_rng([seed & 0xFFFFFFFF, seed >> 32 & 0xFFFFFFFF, ep])
    ordered = np.sort(indices)
    n_chunks = max(1, -(-len(ordered) // chunk))
    chunks = [ordered[c * chunk : (c + 1) * chunk] for c in rng.permutation(n_chunks)]
    out = [rng.permutation(np.concatenate(chunks[w : w + window])) for w in range(0, n_chunks, window)]
    return np.concatenate(out) if out else ordered


@settings(max_examples=150, deadline=None)
@given(
    counts=st.lists(st.integers(0, 40), min_size=1, max_size=5),
    picks=st.integers(0, 2**32),
    seed=st.integers(0, 2**64 - 1),
    ep=st.integers(0, 5),
    chunk=st.integers(1, 12),
    window=st.integers(1, 4),
)
def test_quasi_random_matches_the_reference(counts: list[int], picks: int, seed: int, ep: int, chunk: int, window: int) -> None:
    starts = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    n = int(starts[-1])
    rng = np.random.default_rng(picks)
    indices = rng.integers(0, max(n, 1), rng.integers(0, 2 * n + 1)) if n else np.zeros(0, np.int64)  # repeats allowed
    got = epoch_order(OrderOption.QUASI_RANDOM, indices, seed, ep, chunk, window, starts)
    windows = quasi_reference(indices, seed, ep, chunk, window, starts.tolist())
    expected = np.concatenate(windows) if windows else np.sort(indices)
    assert np.array_equal(got, expected)
    for w in windows:  # every window within one shard, of at most window * chunk samples
        shard = np.searchsorted(starts, w, side="right") - 1
        assert len(set(shard.tolist())) == 1 and len(w) <= window * chunk
    # one shard, or none given: exactly the single-file order of before
    legacy = legacy_quasi(indices, seed, ep, chunk, window)
    assert np.array_equal(epoch_order(OrderOption.QUASI_RANDOM, indices, seed, ep, chunk, window), legacy)
    assert np.array_equal(epoch_order(OrderOption.QUASI_RANDOM, indices, seed, ep, chunk, window, np.array([0, n])), legacy)


@pytest.mark.parametrize("os_cache", [True, False])
def test_quasi_random_loader_follows_the_shard_aware_order(single: Path, folder: Path, os_cache: bool) -> None:
    kwargs = {"batch_size": 20, "num_workers": 2, "order": OrderOption.QUASI_RANDOM, "seed": 9, "chunk_size": 25, "window_chunks": 2}
    with Loader(folder, os_cache=os_cache, return_indices=True, **kwargs) as loader:  # type: ignore[arg-type]
        starts = loader.reader.shard_starts.tolist()  # type: ignore[union-attr]
        batches = [as_arrays(b) for b in loader]
        expected = np.concatenate(quasi_reference(np.arange(N_SAMPLES), 9, 0, 25, 2, starts))
    order = np.concatenate([b[-1] for b in batches])
    assert np.array_equal(order, expected)
    # the batches hold those samples: the single file loaded with these indices, in this order
    same_samples = epoch(single, batch_size=20, num_workers=1, indices=expected, return_indices=True)
    assert_same(batches, same_samples)


# ---- errors and state ----------------------------------------------------------------------------------


def copy_folder(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def shard_name(folder: Path, k: int) -> str:
    """The file name of shard ``k`` of the folder's dataset (it holds the write's generation)."""
    return read_manifest(folder)[k].path.name


def test_missing_shard(folder: Path, tmp_path: Path) -> None:
    broken = copy_folder(folder, tmp_path / "d")
    name = shard_name(broken, 2)
    (broken / name).unlink()
    with pytest.raises(DatasetFormatError, match=rf"{name}: shard is missing"):
        Loader(broken, batch_size=8)


def test_shard_with_other_fields(folder: Path, tmp_path: Path) -> None:
    """Files named by a list have no manifest: their fields are compared when the Loader opens them."""
    fields = dict(MIXED_FIELDS)
    fields.pop("img")
    samples = [MixedDataset()[i][:-1] for i in range(5)]
    other = tmp_path / "other.stoker"
    DatasetWriter(other, fields, num_workers=1, progress=False).from_indexed_dataset(samples)
    with pytest.raises(DatasetFormatError, match=r"other\.stoker: shard has other fields than the first shard"):
        Loader([*sorted(folder.glob("*.stoker")), other], batch_size=8)


def test_folder_without_its_manifest_is_refused(folder: Path, tmp_path: Path) -> None:
    broken = copy_folder(folder, tmp_path / "d")
    (broken / "manifest.stoker.json").unlink()
    with pytest.raises(DatasetFormatError, match=r"without its manifest\.stoker\.json: a write into it did not finish"):
        Loader(broken, batch_size=8)


def test_glob_and_list_sources(single: Path, folder: Path) -> None:
    kwargs = {"batch_size": 64, "num_workers": 1, "order": OrderOption.RANDOM, "seed": 1}
    expected = epoch(single, **kwargs)
    assert_same(epoch(str(folder / "shard-*.stoker"), **kwargs), expected)
    assert_same(epoch(sorted(folder.glob("*.stoker")), **kwargs), expected)  # type: ignore[arg-type]


def test_shard_changed_in_place_is_refused(folder: Path, tmp_path: Path) -> None:
    data = copy_folder(folder, tmp_path / "d")
    loader = Loader(data, batch_size=64, num_workers=1)
    path = data / shard_name(data, 1)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(DatasetFormatError, match=rf"{path.name}: changed on disk"):
        iter(loader)


def test_state_records_every_shard(folder: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    ShardedWriter(other, MIXED_FIELDS, samples_per_shard=100, num_workers=1, progress=False).from_indexed_dataset(MixedDataset())
    a = Loader(folder, batch_size=16, seed=0, order=OrderOption.QUASI_RANDOM)
    state = a.state_dict()
    assert state["config"]["dataset"]["shards"][0][0] == SHARD
    with pytest.raises(StokerError, match=r"dataset\.shards"):
        Loader(other, batch_size=16, seed=0, order=OrderOption.QUASI_RANDOM).load_state_dict(state)
    Loader(folder, batch_size=16, seed=0, order=OrderOption.QUASI_RANDOM, os_cache=False).load_state_dict(state)
