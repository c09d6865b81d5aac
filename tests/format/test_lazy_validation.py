"""Big indexes: lazy, block-by-block metadata validation and the recorded result of a full validation.

Files are small; the thresholds (``LAZY_VALIDATION_BYTES``, ``RECORD_VALIDATION_BYTES``)
are lowered to 0 and the metadata checksum block to 4 KiB (written so by
patching ``spec.METADATA_BLOCK_SIZE`` while writing), so that a few thousand
rows span many blocks, and rows of 24 bytes straddle block boundaries.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stoker.format.reader as reader_module
from stoker.errors import DatasetFormatError, PipelineError
from stoker.fields import BytesField, IntField
from stoker.format import DatasetWriter, Reader, spec
from stoker.loader._graph import FieldPipeline
from stoker.loader.loader import Loader
from stoker.loader.order import OrderOption

N = 3000
BLOCK = 4096
ROW = 24  # label/value <i8, blob/ptr <u8, blob/size <u8


@pytest.fixture(autouse=True)
def _small_thresholds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(reader_module, "LAZY_VALIDATION_BYTES", 0)
    monkeypatch.setattr(reader_module, "RECORD_VALIDATION_BYTES", 0)
    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path / "cache"))


def write(path: Path, monkeypatch: pytest.MonkeyPatch, offset: int = 0) -> Path:
    samples = [(i + offset, bytes([i % 251]) * (i % 7)) for i in range(N)]
    with monkeypatch.context() as m:
        m.setattr(spec, "METADATA_BLOCK_SIZE", BLOCK)
        DatasetWriter(path, {"label": IntField(), "blob": BytesField()}, num_workers=1, progress=False).from_indexed_dataset(samples)
    with Reader(path) as r:
        assert r.metadata_block_size == BLOCK and r.metadata_row_size == ROW
    return path


@pytest.fixture
def path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return write(tmp_path / "data.stoker", monkeypatch)


class CrcCounter:
    """Counts ``spec.crc32`` calls and the bytes they cover."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls, self.bytes = 0, 0
        original = spec.crc32

        def counting(data: Any) -> int:
            self.calls += 1
            self.bytes += len(memoryview(data).cast("B"))
            return original(data)

        monkeypatch.setattr(spec, "crc32", counting)


def meta_pos(r: Reader, sample: int, column: str) -> int:
    """The file offset of a sample's metadata sub-column."""
    assert r.row_dtype.fields is not None
    return r.metadata_offset + sample * r.metadata_row_size + r.row_dtype.fields[column][1]


def edit(path: Path, pos: int, data: bytes, reseal: bool = False) -> None:
    """Overwrite bytes in place; ``reseal``: recompute the checksums (a crafted, self-consistent file)."""
    with open(path, "r+b") as fh:
        fh.seek(pos)
        fh.write(data)
    if reseal:
        raw = bytearray(path.read_bytes())
        h = np.frombuffer(bytes(raw[: spec.HEADER_SIZE]), dtype=spec.HEADER_DTYPE)[0].copy()
        lo, hi = int(h["metadata_offset"]), int(h["metadata_offset"]) + int(h["num_samples"]) * int(h["metadata_row_size"])
        start = int(h["checksum_offset"])
        crcs = np.frombuffer(bytes(raw[start:]), dtype="<u4").copy()
        for b, s in enumerate(range(lo, hi, BLOCK)):
            crcs[b] = spec.crc32(bytes(raw[s : min(s + BLOCK, hi)]))
        raw[start:] = crcs.tobytes()
        h["checksum_table_crc"] = spec.crc32(crcs.tobytes())
        raw[: spec.HEADER_SIZE] = spec.pack_header(
            {k: h[k] for k in h.dtype.names if k not in ("magic", "version", "header_size", "reserved", "header_crc")}
        )
        path.write_bytes(bytes(raw))


@pytest.fixture
def compiled_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[np.ndarray]]:
    """Records the indices of every batch the compiled pipelines run on; refuses the samples in ``forbidden``."""
    seen: list[np.ndarray] = []
    original = FieldPipeline.run

    def spy(self: FieldPipeline, indices: np.ndarray, *args: Any, **kwargs: Any) -> Any:
        bad = np.intersect1d(indices, spy.forbidden)  # type: ignore[attr-defined]
        if len(bad):
            raise AssertionError(f"compiled code was about to read the metadata of corrupt sample(s) {bad.tolist()}")
        seen.append(np.array(indices))
        return original(self, indices, *args, **kwargs)

    spy.forbidden = np.zeros(0, dtype=np.int64)  # type: ignore[attr-defined]
    monkeypatch.setattr(FieldPipeline, "run", spy)
    yield seen


def test_loader_construction_reads_no_metadata_block(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counter = CrcCounter(monkeypatch)
    loader = Loader(path, batch_size=100, num_workers=1, pipelines={"blob": None}, seed=0)
    # the header, the field table and the checksum table: nothing of the metadata table
    assert counter.calls == 3, f"Loader() computed {counter.calls} CRCs ({counter.bytes} bytes)"
    assert counter.bytes < 1024
    assert sum(1 for _ in loader) == 30
    loader.close()
    # Each block is checked when a batch first reaches it, not once per batch that touches it. The count is a
    # bound, not exact: the loop may make a batch beside a producer, and two threads that reach a block at once
    # may both check it (Reader.validate_samples says so). Checking per batch would cost ``per_batch`` CRCs.
    blocks = -(-N * ROW // BLOCK)
    per_batch = 0
    for lo in range(0, N, 100):
        rows = np.arange(lo, min(N, lo + 100))
        for b in np.unique(rows * ROW // BLOCK).tolist():
            row_hi = min(N, -(-((b + 1) * BLOCK) // ROW))
            per_batch += min(blocks - 1, (row_hi * ROW - 1) // BLOCK) - b + 1
    assert 2 * blocks < per_batch
    assert blocks <= counter.calls - 3 <= 2 * blocks, f"{counter.calls - 3} CRCs of metadata blocks for {blocks} blocks"


def test_corrupt_block_raises_naming_the_sample_when_a_batch_reaches_it(
    path: Path, compiled_reads: list[np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    with Reader(path) as r:
        target = 2100  # in block 12, whose first row (2048) starts on its first byte: no row of block 11 spans into it
        edit(path, meta_pos(r, target, "label/value"), b"\xff")  # one bit pattern changed, checksums not
    block = target * ROW // BLOCK
    first_in_block, last_in_block = block * BLOCK // ROW, -(-(block + 1) * BLOCK // ROW) - 1
    FieldPipeline.run.forbidden = np.arange(first_in_block, last_in_block + 1)  # type: ignore[attr-defined]
    loader = Loader(path, batch_size=100, num_workers=1, seed=0)  # constructs: the corruption is not looked at yet
    batches = []
    with pytest.raises(DatasetFormatError) as info:
        for batch in loader:
            batches.append(batch)
    message = str(info.value)
    assert f"checksum mismatch in block {block}" in message
    assert f"found when sample {first_in_block} was first read" in message  # the batch's first sample stored there
    assert str(path) in message
    assert len(batches) == first_in_block // 100  # every batch before it was loaded
    assert all(len(np.intersect1d(s, np.arange(first_in_block, last_in_block + 1))) == 0 for s in compiled_reads)


def test_corrupt_pointer_with_valid_checksums_names_the_sample(path: Path, compiled_reads: list[np.ndarray]) -> None:
    target = 1234
    with Reader(path) as r:
        edit(path, meta_pos(r, target, "blob/ptr"), np.array([1 << 60], "<u8").tobytes(), reseal=True)
    FieldPipeline.run.forbidden = np.array([target])  # type: ignore[attr-defined]
    loader = Loader(path, batch_size=64, num_workers=1, order=OrderOption.RANDOM, seed=3)
    with pytest.raises(DatasetFormatError, match=rf"sample {target}, field 'blob' points outside the heap"):
        for _ in loader:
            pass


def test_corrupt_size_read_at_build_time_is_a_clear_error(path: Path) -> None:
    """BytesDecoder sizes its output from the largest size: a corrupt one is named, not allocated."""
    target = 77
    with Reader(path) as r:
        edit(path, meta_pos(r, target, "blob/size"), np.array([1 << 62], "<u8").tobytes(), reseal=True)
    with pytest.raises(PipelineError, match=rf"BytesDecoder.*sample {target}, field 'blob' points outside the heap") as info:
        Loader(path, batch_size=16, num_workers=1, seed=0)
    assert isinstance(info.value.__cause__, DatasetFormatError)


def test_a_row_across_two_blocks_is_checked_in_both(path: Path) -> None:
    sample = BLOCK // ROW  # 170: bytes 4080..4103, across blocks 0 and 1
    with Reader(path) as r:
        pos = r.metadata_offset + sample * ROW + 20  # a byte of its blob/size, in block 1
        assert (pos - r.metadata_offset) // BLOCK == 1 and sample * ROW // BLOCK == 0
        edit(path, pos, b"\x7f")
    r = Reader(path)
    r.validate_metadata(lazy=True)
    with pytest.raises(DatasetFormatError, match=rf"checksum mismatch in block 1 .*found when sample {sample} was first read"):
        r.validate_samples(np.array([sample]))
    r.validate_samples(np.arange(171 + 171, 500))  # rows in blocks 2.. only: fine


def test_full_validation_is_recorded_and_skipped_next_time(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    Reader(path).validate_metadata()
    counter = CrcCounter(monkeypatch)
    r = Reader(path)
    r.validate_metadata()
    r.validate_samples(np.arange(N))
    assert counter.calls == 3  # the recorded result: no block read
    assert r.read(5)[0] == 5


def test_a_finished_lazy_validation_is_recorded(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    r = Reader(path)
    r.validate_metadata(lazy=True)
    r.validate_samples(np.arange(N)[::-1])
    counter = CrcCounter(monkeypatch)
    Reader(path).validate_metadata()
    assert counter.calls == 3


def test_record_is_invalidated_when_the_file_changes_in_place(path: Path) -> None:
    Reader(path).validate_metadata()
    before = os.stat(path).st_mtime_ns
    with Reader(path) as r:
        edit(path, meta_pos(r, 10, "label/value"), b"\x55")
    if os.stat(path).st_mtime_ns == before:  # a coarse clock: make the change visible as a real one would be
        os.utime(path, ns=(before + 10**9, before + 10**9))
    with pytest.raises(DatasetFormatError, match="checksum mismatch in block 0"):
        Reader(path).validate_metadata()


def test_record_is_invalidated_when_the_file_is_replaced(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    Reader(path).validate_metadata()
    write(path, monkeypatch, offset=1)  # a new file renamed over the old one: same path and size, new inode
    counter = CrcCounter(monkeypatch)
    r = Reader(path)
    r.validate_metadata()
    assert counter.calls == 3 + -(-N * ROW // BLOCK)
    assert r.read(0)[0] == 1


def test_record_is_invalidated_when_the_file_is_touched(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    Reader(path).validate_metadata()
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    counter = CrcCounter(monkeypatch)
    Reader(path).validate_metadata()
    assert counter.calls > 3


def test_verify_ignores_the_record_and_forgets_it(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    Reader(path).validate_metadata()
    st = os.stat(path)
    with Reader(path) as r:
        edit(path, meta_pos(r, 10, "label/value"), b"\x55")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # bit rot: the identity is unchanged
    Reader(path).validate_metadata()  # trusts the record (documented)
    with pytest.raises(DatasetFormatError, match="checksum mismatch in block 0"):
        Reader(path).verify()
    with pytest.raises(DatasetFormatError, match="checksum mismatch in block 0"):
        Reader(path).validate_metadata()  # the record is gone


def test_small_tables_are_validated_at_once(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reader_module, "LAZY_VALIDATION_BYTES", N * ROW)
    monkeypatch.setattr(reader_module, "RECORD_VALIDATION_BYTES", N * ROW + 1)
    with Reader(path) as r:
        edit(path, meta_pos(r, 2999, "label/value"), b"\x55")
    with pytest.raises(DatasetFormatError, match=rf"checksum mismatch in block {2999 * ROW // BLOCK}"):
        Loader(path, batch_size=100, num_workers=1, seed=0)
    assert not list((Path(os.environ["STOKER_CACHE_DIR"]) / "validated").glob("*"))


def test_loader_indices_are_made_only_when_needed(path: Path) -> None:
    loader = Loader(path, batch_size=100, num_workers=1, pipelines={"blob": None}, seed=0)
    assert loader._indices is None and len(loader) == 30
    explicit = Loader(path, batch_size=100, num_workers=1, pipelines={"blob": None}, seed=0, indices=np.arange(N))
    state = loader.state_dict()
    assert loader._indices is None  # the digest of 0..N-1 is made a piece at a time
    explicit.load_state_dict(state)  # the same samples: the same configuration
    np.testing.assert_array_equal(loader.indices, np.arange(N))
