"""Checksums computed while writing (``writer.BlockCrcs``) equal those of the bytes on disk, in any write order."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.fields import BytesField, IntField, NDArrayField, RGBImageField
from stoker.format import Reader
from stoker.format.writer import BlockCrcs, DatasetWriter


def _reference(content: bytes, start: int, end: int, block: int) -> list[int]:
    return [zlib.crc32(content[b : min(b + block, end)]) & 0xFFFFFFFF for b in range(start, end, block)]


@settings(max_examples=200, deadline=None)
@given(
    start=st.integers(0, 50),
    block=st.integers(1, 40),
    pieces=st.lists(st.integers(0, 60), max_size=12),
    shuffle=st.booleans(),
    gap_at_end=st.integers(0, 30),
    seed=st.integers(0, 1000),
)
def test_streamed_checksums_equal_the_file(
    tmp_path_factory: pytest.TempPathFactory, start: int, block: int, pieces: list[int], shuffle: bool, gap_at_end: int, seed: int
) -> None:
    """Writes in order (streamed), out of order (read back from where streaming stopped), and a never-written tail (zeros)."""
    rng = np.random.default_rng(seed)
    offsets = np.cumsum([start, *pieces])
    writes = [(int(o), rng.integers(0, 256, n, dtype=np.uint8).tobytes()) for o, n in zip(offsets[:-1], pieces, strict=True)]
    if shuffle:
        writes = [writes[i] for i in rng.permutation(len(writes))]
    end = int(offsets[-1]) + gap_at_end
    path = tmp_path_factory.mktemp("crcs") / "region.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        crcs = BlockCrcs(start, block)
        for offset, data in writes:
            os.pwrite(fd, data, offset)
            crcs.feed(offset, data)
        os.ftruncate(fd, end)
        got = crcs.result(fd, end)
    finally:
        os.close(fd)
    assert got == _reference(path.read_bytes(), start, end, block)


@pytest.mark.parametrize("num_workers", [1, 2])
def test_a_heap_and_metadata_are_checksummed_without_reading_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, num_workers: int
) -> None:
    """Values in the heap and scalars in the metadata (a converted image folder's layout): every checksum streamed."""

    def no_read_back(fd: int, start: int, length: int) -> int:
        raise AssertionError(f"read back {length} bytes at {start}")

    fields = {"b": BytesField(), "y": IntField()}
    rng = np.random.default_rng(0)
    samples = [(rng.integers(0, 256, 1 + (i * 7919) % 80_000, np.uint8).tobytes(), i) for i in range(900)]  # ~36 MB: 3 data blocks
    monkeypatch.setattr(DatasetWriter, "_crc_range", staticmethod(no_read_back))
    path = tmp_path / "heap.stoker"
    DatasetWriter(path, fields, num_workers=num_workers, progress=False).from_indexed_dataset(samples)
    with Reader(path) as reader:
        reader.verify()
        assert len(reader._data_crcs) == 3
        ptr, size = int(reader.metadata["b/ptr"][777]), int(reader.metadata["b/size"][777])
        assert bytes(reader.storage[ptr : ptr + size]) == samples[777][0]


@pytest.mark.parametrize("num_workers", [1, 2])
def test_files_of_every_layout_pass_verify(tmp_path: Path, num_workers: int) -> None:
    """Two columns (their writes interleave: streaming stops, the rest is read back), images in a heap, several workers."""
    fields = {
        "x": NDArrayField(shape=(3,), dtype=np.dtype("float32")),
        "z": NDArrayField(shape=(2,), dtype=np.dtype("int16")),
        "img": RGBImageField(),
        "y": IntField(),
    }
    rng = np.random.default_rng(1)
    samples = [
        (rng.standard_normal(3).astype(np.float32), rng.integers(-9, 9, 2).astype(np.int16), rng.integers(0, 256, (9, 7, 3), np.uint8), i)
        for i in range(700)
    ]
    path = tmp_path / "layouts.stoker"
    DatasetWriter(path, fields, num_workers=num_workers, progress=False).from_indexed_dataset(samples)
    with Reader(path) as reader:
        reader.verify()
        np.testing.assert_array_equal(np.array(reader.column("z"))[699], samples[699][1])
