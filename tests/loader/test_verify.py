"""Corrupt data is never read silently: a flipped byte anywhere is refused at open or by the first epoch that reads it.

The file is written with 512-byte data checksum blocks (``spec.DATA_BLOCK_SIZE``
patched while writing), so that its columns and heap span about a hundred blocks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stoker.errors import DatasetFormatError
from stoker.format import Reader, _verify, spec
from stoker.loader import _engine
from stoker.loader.loader import Loader
from stoker.loader.order import OrderOption
from stoker.writer import DatasetWriter
from tests.loader.conftest import MIXED_FIELDS, MixedDataset

BLOCK = 512


@pytest.fixture(scope="module")
def small_blocks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("verify") / "mixed.stoker"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(spec, "DATA_BLOCK_SIZE", BLOCK)
        DatasetWriter(path, MIXED_FIELDS, num_workers=1, progress=False).from_indexed_dataset(MixedDataset())
    return path


def _epoch(path: Path, **kwargs: Any) -> list[list[np.ndarray]]:
    with Loader(path, batch_size=64, num_workers=1, seed=0, **kwargs) as loader:
        return [[np.asarray(t).copy() for t in batch] for batch in loader]


@pytest.fixture(scope="module")
def reference(small_blocks: Path) -> list[list[np.ndarray]]:
    return _epoch(small_blocks, check_data=True)


def _regions(path: Path) -> dict[str, tuple[int, int]]:
    r = Reader(path)
    first_column = min(r._columns.values())
    return {
        "header": (0, spec.HEADER_SIZE),
        "field table": (r.field_table_offset, r.field_table_offset + r.field_table_size),
        "metadata": (r.metadata_offset, r.metadata_offset + r.num_samples * r.metadata_row_size),
        "columns": (first_column, r.heap_offset),
        "heap": (r.heap_offset, r.data_offset + r.data_size),
        "checksum table": (r.checksum_offset, r.file_size),
    }


def _flips(path: Path) -> list[tuple[str, int]]:
    rng = np.random.default_rng(23)
    out = []
    for name, (lo, hi) in _regions(path).items():
        for off in sorted({lo, hi - 1, *rng.integers(lo, hi, 8).tolist()}):
            out.append((name, int(off)))
    return out


def _same(a: list[list[np.ndarray]], b: list[list[np.ndarray]]) -> bool:
    return len(a) == len(b) and all(
        len(x) == len(y) and all(u.shape == v.shape and np.array_equal(u, v, equal_nan=True) for u, v in zip(x, y)) for x, y in zip(a, b)
    )


@pytest.mark.parametrize("kwargs", [{}, {"compile": False}, {"os_cache": False}], ids=["compiled", "python", "bounded"])
def test_every_flipped_byte_is_refused(
    tmp_path: Path, small_blocks: Path, reference: list[list[np.ndarray]], kwargs: dict[str, Any]
) -> None:
    """About 60 single-byte flips over every region: each raises at open or in the first epoch; none returns data.

    A flip that leaves the values the same cannot happen: a flip changes the stored bytes,
    and every stored byte is covered by a checksum.
    """
    raw = small_blocks.read_bytes()
    silent = []
    for n, (region, off) in enumerate(_flips(small_blocks)):
        damaged = bytearray(raw)
        damaged[off] ^= 1 << (n % 8)
        path = tmp_path / f"flip-{n}.stoker"
        path.write_bytes(bytes(damaged))
        try:
            got = _epoch(path, **kwargs)
        except DatasetFormatError:
            continue
        silent.append((region, off, "same values" if _same(got, reference) else "WRONG values"))
    assert not silent, f"flips read without an error: {silent}"


def test_the_error_names_file_block_and_samples(tmp_path: Path, small_blocks: Path) -> None:
    r = Reader(small_blocks)
    off = r._columns["x"] + 100 * 48 + 5  # sample 100's item of the (3, 4) float32 column
    damaged = bytearray(small_blocks.read_bytes())
    damaged[off] ^= 0x40
    path = tmp_path / "column.stoker"
    path.write_bytes(bytes(damaged))
    with pytest.raises(DatasetFormatError) as info:
        _epoch(path, order=OrderOption.SEQUENTIAL)
    block = (off - r.data_offset) // BLOCK
    start = r.data_offset + block * BLOCK
    msg = str(info.value)
    assert msg.startswith(f"{path}: corrupt data region: checksum mismatch in data block {block} (bytes {start}..{start + BLOCK} ")
    first, last = (int(s) for s in msg.split("holds samples ")[1].split(" ")[0].split(".."))
    assert first <= 100 <= last
    assert "check_data=False" in msg and "STOKER_VERIFY=0" in msg


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_verify_off_reads_without_the_check(
    tmp_path: Path, small_blocks: Path, reference: list[list[np.ndarray]], monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    r = Reader(small_blocks)
    damaged = bytearray(small_blocks.read_bytes())
    damaged[r._columns["x"] + 3] ^= 0x40
    path = tmp_path / f"off-{how}.stoker"
    path.write_bytes(bytes(damaged))
    if how == "environment":
        monkeypatch.setenv("STOKER_VERIFY", "0")
        got = _epoch(path)
    else:
        got = _epoch(path, check_data=False)
    assert not _same(got, reference)  # the damaged value, as asked
    monkeypatch.delenv("STOKER_VERIFY", raising=False)
    with pytest.raises(DatasetFormatError):
        _epoch(path)


def test_blocks_are_checked_once_per_process(tmp_path: Path, small_blocks: Path, reference: list[list[np.ndarray]],
                                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A second epoch and a second Loader of the same file compute no CRC again; a batch then does no check at all."""
    # one thread makes every batch (the producer): an exact count (two threads beside each other may both check a block)
    monkeypatch.setattr(_engine, "MAKE_WHEN_WAITING", False)
    path = tmp_path / "copy.stoker"
    path.write_bytes(small_blocks.read_bytes())  # a file of its own: no other test has checked its blocks
    loader = Loader(path, batch_size=64, num_workers=1, seed=0, order=OrderOption.RANDOM)
    first = [[np.asarray(t).copy() for t in b] for b in loader]
    check = loader._data_check
    assert check is not None and check.all_verified()
    computed = int(check.counts[0])
    assert computed == len(check.crcs)  # every block once (the loaded fields read every block of this file)
    second_epoch = [[np.asarray(t).copy() for t in b] for b in loader]
    with Loader(path, batch_size=64, num_workers=1, seed=0, order=OrderOption.RANDOM) as other:
        list(other)
        assert other._data_check is not None and other._data_check.counts is check.counts
    assert int(check.counts[0]) == computed
    assert len(first) == len(second_epoch) == len(reference)
    loader.close()


def test_a_subset_checks_only_its_blocks(tmp_path: Path, small_blocks: Path) -> None:
    path = tmp_path / "subset.stoker"
    path.write_bytes(small_blocks.read_bytes())
    with Loader(path, batch_size=16, num_workers=1, seed=0, indices=[5, 6, 7], pipelines={"x": None, "img": None}) as loader:
        list(loader)
        check = loader._data_check
        assert check is not None
        assert 0 < int(check.verified.sum()) < len(check.crcs)
        assert not check.all_verified()


def test_metadata_only_fields_need_no_check(small_blocks: Path) -> None:
    keep = {name: None for name in MIXED_FIELDS if name not in ("y", "f")}
    with Loader(small_blocks, batch_size=64, num_workers=1, seed=0, pipelines=keep) as loader:
        list(loader)
        assert loader._data_check is not None and not loader._data_check.reads_data


def test_the_check_is_kept_per_file_identity(tmp_path: Path, small_blocks: Path) -> None:
    path = tmp_path / "ident.stoker"
    path.write_bytes(small_blocks.read_bytes())
    a = _verify.DataCheck(Reader(path), ["x"])
    b = _verify.DataCheck(Reader(small_blocks), ["x"])
    assert a.verified is not b.verified  # another file (another inode), the same bytes: checked on its own


@pytest.mark.parametrize("kwargs", [{"drop_last": True}, {"indices": list(range(0, 200, 3))}], ids=["drop_last", "subset"])
def test_after_a_whole_epoch_later_epochs_do_no_check(tmp_path: Path, small_blocks: Path, kwargs: dict[str, Any]) -> None:
    """With drop_last or a subset some blocks are never read, so 'every block checked' never comes: after a whole
    epoch, the blocks of the loader's samples no batch read are checked, and later epochs do no check per batch
    (the check cost 5-10% of a small-row table's throughput while it stayed on)."""
    path = tmp_path / "cover.stoker"
    path.write_bytes(small_blocks.read_bytes())
    with Loader(path, batch_size=64, num_workers=1, seed=0, order=OrderOption.RANDOM, **kwargs) as loader:
        it = iter(loader)
        assert it._batches.check is not None  # type: ignore[attr-defined]
        list(it)
        assert loader._data_covered
        it = iter(loader)
        assert it._batches.check is None  # type: ignore[attr-defined]
        list(it)


def test_a_flip_only_dropped_samples_read_is_refused_at_the_end_of_the_first_epoch(tmp_path: Path, small_blocks: Path) -> None:
    """The samples left out of every batch of the first epoch still get their blocks checked before a later epoch
    may read them: a flip there is refused when the first epoch ends, never read as data."""
    path = tmp_path / "dropped.stoker"
    path.write_bytes(small_blocks.read_bytes())
    r = Reader(path)
    sample = 230  # sequential order, batch 64, drop_last: samples 192..236 are never in a batch
    offset = r._columns["x"] + sample * r.fields["x"].column_itemsize
    r.close()
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    with (
        Loader(path, batch_size=64, num_workers=1, seed=0, drop_last=True, pipelines={"img": None}) as loader,
        pytest.raises(DatasetFormatError, match="block"),
    ):
        list(loader)


def test_the_data_check_has_one_name(small_blocks: Path) -> None:
    """``check_data=`` only: stoker was never published with ``verify=``, so no alias of it is kept."""
    with pytest.raises(TypeError, match="verify"):
        Loader(small_blocks, batch_size=64, verify=False)  # type: ignore[call-arg]
    assert not hasattr(Loader, "verify")
