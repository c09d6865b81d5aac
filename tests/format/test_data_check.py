"""The data-region check (``stoker.format._verify``): compiled CRC-32, the blocks each sample touches, once per process.

Files are written with 512-byte data checksum blocks (``spec.DATA_BLOCK_SIZE``
patched while writing), so that a few hundred samples span many blocks.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.dataset.sharded import ShardedReader
from stoker.errors import DatasetFormatError
from stoker.fields import BytesField, IntField, NDArrayField
from stoker.format import DatasetWriter, Reader, _verify, spec

BLOCK = 512
N = 300
FIELDS = {"x": NDArrayField((5,), np.dtype("float32")), "y": IntField(), "b": BytesField()}


def _samples(offset: int = 0) -> list[tuple[np.ndarray, int, bytes]]:
    return [(np.full(5, i + offset, np.float32), i, bytes([i % 251]) * (i % 13)) for i in range(N)]


def write(path: Path, monkeypatch: pytest.MonkeyPatch, offset: int = 0) -> Path:
    with monkeypatch.context() as m:
        m.setattr(spec, "DATA_BLOCK_SIZE", BLOCK)
        DatasetWriter(path, FIELDS, num_workers=1, progress=False).from_indexed_dataset(_samples(offset))
    return path


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=300), start=st.integers(0, 40), cut=st.integers(0, 40))
def test_compiled_crc32_is_zlibs(data: bytes, start: int, cut: int) -> None:
    arr = np.frombuffer(data, dtype=np.uint8)
    start = min(start, len(arr))
    stop = max(start, len(arr) - cut)
    want = zlib.crc32(data[start:stop]) & 0xFFFFFFFF
    _verify.kernel()
    assert _verify.crc32_table(arr, start, stop) == want
    if _verify._HAVE_ISAL:
        assert _verify.crc32_isal(arr, start, stop) == want


def test_crc32_of_more_than_a_table_step() -> None:
    data = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    _verify.kernel()
    assert _verify.crc32_table(data, 0, len(data)) == zlib.crc32(data.tobytes()) & 0xFFFFFFFF
    assert _verify._crc(data, 7, len(data) - 3) == zlib.crc32(data[7:-3].tobytes()) & 0xFFFFFFFF


def _expected_blocks(reader: Reader, i: int) -> set[int]:
    """The data blocks sample ``i``'s column item and heap value lie in (plain Python)."""
    bs, d0 = reader.data_block_size, reader.data_offset
    out = set()
    off = reader._columns["x"] + i * 20
    out |= set(range((off - d0) // bs, (off + 19 - d0) // bs + 1))
    row = reader.metadata[i]
    ptr, size = int(row["b/ptr"]), int(row["b/size"])
    if size:
        out |= set(range((ptr - d0) // bs, (ptr + size - 1 - d0) // bs + 1))
    return out


def test_each_sample_checks_the_blocks_it_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reader = Reader(write(tmp_path / "d.stoker", monkeypatch))
    reader.validate_metadata()
    assert len(reader._data_crcs) > 10
    for i in (0, 1, 57, N - 1):
        check = _verify.DataCheck(reader, ["x", "y", "b"])
        check.verified[:] = 0
        check.check(np.array([i]))
        assert set(np.flatnonzero(check.verified).tolist()) == _expected_blocks(reader, i)
        lazy = _verify.DataCheck(reader, ["x", "b"])
        lazy.verified[:] = 0
        lazy.check(np.array([i]), lazy=True)
        assert set(np.flatnonzero(lazy.verified).tolist()) == _expected_blocks(reader, i)


def test_every_block_is_computed_once_per_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "once.stoker", monkeypatch)
    first = _verify.DataCheck(Reader(path), ["x", "b"])
    first.check(np.arange(N))
    assert first.all_verified()
    computed = int(first.counts[0])
    assert computed == len(first.crcs)
    second = _verify.DataCheck(Reader(path), ["x", "b"])  # another reader of the same, unchanged file
    assert second.all_verified()
    second.check(np.arange(N))
    assert int(second.counts[0]) == computed


def test_metadata_fields_read_no_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    check = _verify.DataCheck(Reader(write(tmp_path / "m.stoker", monkeypatch)), ["y"])
    assert not check.reads_data and check.all_verified()
    check.check(np.arange(N))


@pytest.mark.parametrize("where", ["column", "heap"])
@pytest.mark.parametrize("mode", ["mapped", "lazy", "bounded"])
def test_a_flipped_data_byte_names_file_block_and_samples(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, mode: str) -> None:
    path = write(tmp_path / f"flip-{where}-{mode}.stoker", monkeypatch)
    reader = Reader(path)
    reader.validate_metadata()
    i = 123
    if where == "column":
        off = reader._columns["x"] + i * 20 + 3
    else:
        off = int(reader.metadata[i]["b/ptr"]) + 1
    local = (off - reader.data_offset) // BLOCK
    raw = bytearray(path.read_bytes())
    raw[off] ^= 0x04
    bad = tmp_path / f"bad-{where}-{mode}.stoker"
    bad.write_bytes(bytes(raw))
    check = _verify.DataCheck(Reader(bad), ["x", "y", "b"])
    check.check(np.arange(0, 100))  # samples elsewhere read fine (unless they share the block)
    with pytest.raises(DatasetFormatError) as info:
        check.check(np.array([i, 7]), lazy=mode == "lazy", bounded=mode == "bounded")
    msg = str(info.value)
    start = reader.data_offset + local * BLOCK
    assert str(bad) in msg and f"data block {local} (bytes {start}..{start + BLOCK}" in msg
    assert f"found when sample {i} was first read" in msg
    first, last = (int(s) for s in msg.split("holds samples ")[1].split(" ")[0].split(".."))
    assert first <= i <= last
    assert check.verified[local] == 0  # refused again next time
    with pytest.raises(DatasetFormatError):
        check.check(np.array([i]))


def test_shards_number_their_blocks_one_after_another(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = [write(tmp_path / f"s{k}.stoker", monkeypatch, offset=1000 * k) for k in range(3)]
    raw = bytearray(paths[1].read_bytes())
    shard = Reader(paths[1])
    shard.validate_metadata()
    off = int(shard.metadata[10]["b/ptr"])
    raw[off] ^= 0xFF
    paths[1].write_bytes(bytes(raw))
    reader = ShardedReader([str(p) for p in paths])
    reader.validate_metadata()
    check = _verify.DataCheck(reader, ["x", "b"])
    assert check.n_blocks == 3 * len(shard._data_crcs)
    check.check(np.arange(0, N))
    check.check(np.arange(2 * N, 3 * N))
    with pytest.raises(DatasetFormatError) as info:
        check.check(np.arange(N, 2 * N))
    msg = str(info.value)
    assert str(paths[1]) in msg
    found = int(msg.split("found when sample ")[1].split(" ")[0])
    first, last = (int(s) for s in msg.split("holds samples ")[1].split(" ")[0].split(".."))
    assert N <= first <= found <= N + 10 <= last < 2 * N  # global indices: the batch's first sample stored in the block


@pytest.mark.parametrize("fields", [["x", "b"], ["x"], ["b"], ["y"]])
def test_a_shards_blocks_and_its_marks_per_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fields: list[str]) -> None:
    """shard_checked(k): every block that shard k's samples' loaded values lie in (against a per-sample model) is
    marked; bind(k, file) drops (or sets) shard k's marks alone when its data comes from another file."""
    paths = [write(tmp_path / f"s{k}.stoker", monkeypatch, offset=1000 * k) for k in range(3)]
    reader = ShardedReader([str(p) for p in paths])
    reader.validate_metadata()
    _verify._MARKS.clear()
    check = _verify.DataCheck(reader, fields)
    for k, path in enumerate(paths):
        shard = Reader(path)
        shard.validate_metadata()
        base = int(check.block_base[k])
        want: set[int] = set()
        for i in range(N):
            blocks = _expected_blocks(shard, i)
            if fields == ["x"]:  # (the model's blocks are x's and b's: keep only those of x)
                off = shard._columns["x"] + i * 20 - shard.data_offset
                blocks = set(range(off // BLOCK, (off + 19) // BLOCK + 1))
            elif fields == ["b"]:
                row = shard.metadata[i]
                ptr, size = int(row["b/ptr"]) - shard.data_offset, int(row["b/size"])
                blocks = set(range(ptr // BLOCK, (ptr + size - 1) // BLOCK + 1)) if size else set()
            elif fields == ["y"]:
                blocks = set()
            want |= {base + g for g in blocks}
        assert set(check._blocks_of(k).tolist()) == want
        assert check.shard_checked(k) == (not want)
        check.check(np.arange(k * N, (k + 1) * N))
        assert check.shard_checked(k)
    check.bind(1, ("a file",))  # the first file of shard 1 (its marks start empty), checked again
    check.check(np.arange(N, 2 * N))
    assert check.shard_checked(1)
    marked = check.verified.copy()
    check.bind(1, ("another file",))  # shard 1 is read from another file now: its marks go, the others' stay
    assert not check.shard_checked(1) or not check._blocks_of(1).size
    assert check.shard_checked(0) and check.shard_checked(2)
    lo, hi = int(check.block_base[1]), int(check.block_base[2])
    assert not check.verified[lo:hi].any() and np.array_equal(np.delete(check.verified, range(lo, hi)), np.delete(marked, range(lo, hi)))
    check.bind(1, ("another file",))  # the same file: nothing changes
    check.bind(1, ("a third file, checked whole",), checked=True)
    assert check.verified[lo:hi].all() and check.shard_checked(1)


@pytest.mark.parametrize("fields", [["x", "b"], ["x"], ["b"], ["y"]])
def test_the_kernels_arguments_have_one_type(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fields: list[str]) -> None:
    """With the check on or off (every block checked), the producer loop gets arguments of the same types: it is never
    compiled again between epochs (a compilation in the middle of an epoch costs seconds, and can swallow a Ctrl-C)."""
    import numba

    check = _verify.DataCheck(Reader(write(tmp_path / "types.stoker", monkeypatch)), fields)
    on = [numba.typeof(a) for a in check.kernel_args()]
    off = [numba.typeof(a) for a in _verify.empty_args()]
    assert on == off
