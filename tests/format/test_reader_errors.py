"""Reader on files that are not valid: not ours, other version, truncated, corrupt.

Truncated and bit-flipped files are opened in a child process (``sys.executable``)
so that a crash (a segfault from reading past a memory map) fails the test
instead of killing pytest; the child must exit normally after catching
``DatasetFormatError`` for every file.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stoker.errors import DatasetFormatError, StokerError
from stoker.fields import BytesField, FloatField, IntField, RaggedArrayField
from stoker.format import DatasetWriter, Reader, spec

N = 6000  # 6000 rows of 32 bytes: the metadata table alone spans more than 64 KiB
FIRST = 64 << 10

CHILD = r"""
import sys
from stoker.errors import DatasetFormatError
from stoker.format import Reader
for path in sys.argv[1:]:
    try:
        reader = Reader(path)
        reader.validate_metadata()
    except DatasetFormatError as exc:
        print("CAUGHT", path, str(exc).replace("\n", " "), sep="\t", flush=True)
    else:
        print("ACCEPTED", path, sep="\t", flush=True)
"""


def open_in_child(paths: list[Path]) -> dict[str, tuple[str, str]]:
    """Open each file in a fresh interpreter; returns ``{name: (verdict, message)}``."""
    proc = subprocess.run([sys.executable, "-c", CHILD, *map(str, paths)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"child exited with {proc.returncode}: {proc.stderr[-2000:]}"
    results = {}
    for line in proc.stdout.splitlines():
        verdict, path, *message = line.split("\t")
        results[Path(path).name] = (verdict, message[0] if message else "")
    assert len(results) == len(paths), proc.stdout
    return results


@pytest.fixture(scope="module")
def good_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("good") / "good.stoker"
    samples = [(i, i * 0.5, bytes([i % 256]) * (i % 17)) for i in range(N)]
    DatasetWriter(
        path, {"label": IntField(), "score": FloatField(), "blob": BytesField()}, num_workers=1, progress=False
    ).from_indexed_dataset(samples)
    with Reader(path) as reader:
        reader.verify()
        assert reader.metadata_offset + N * reader.metadata_row_size > FIRST
    return path


def header_of(raw: bytes | bytearray) -> np.void:
    return np.frombuffer(bytes(raw[: spec.HEADER_SIZE]), dtype=spec.HEADER_DTYPE)[0].copy()


def reseal(raw: bytearray) -> bytearray:
    """Recompute every checksum of a deliberately edited file (a crafted, self-consistent file)."""
    h = header_of(raw)
    table = bytes(raw[int(h["field_table_offset"]) : int(h["field_table_offset"]) + int(h["field_table_size"])])
    meta_lo, meta_hi = int(h["metadata_offset"]), int(h["metadata_offset"]) + int(h["num_samples"]) * int(h["metadata_row_size"])
    data_lo, data_hi = int(h["data_offset"]), int(h["data_offset"]) + int(h["data_size"])
    mbs, dbs = int(h["metadata_block_size"]), int(h["data_block_size"])
    crcs = [spec.crc32(bytes(raw[s : min(s + mbs, meta_hi)])) for s in range(meta_lo, meta_hi, mbs)]
    crcs += [spec.crc32(bytes(raw[s : min(s + dbs, data_hi)])) for s in range(data_lo, data_hi, dbs)]
    checksums = np.asarray(crcs, dtype="<u4").tobytes()
    start = int(h["checksum_offset"])
    raw[start : start + len(checksums)] = checksums
    values = {name: int(h[name]) for name in spec.HEADER_DTYPE.names if name not in ("magic", "reserved", "header_crc")}
    values |= {"field_table_crc": spec.crc32(table), "checksum_table_crc": spec.crc32(checksums)}
    raw[: spec.HEADER_SIZE] = spec.pack_header(values)
    return raw


# ---- files that are not stoker files ------------------------------------------------------------
@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "not a stoker dataset: the file is empty"),
        (b"label,feature\n1,2\n" * 100, "not a stoker dataset: the file does not start with the stoker magic number"),
        (np.random.default_rng(0).bytes(10_000), "not a stoker dataset"),
        (b"\x89PNG\r\n\x1a\n" + bytes(300), "not a stoker dataset"),
        (spec.MAGIC[:5], "truncated: 5 bytes"),
        (spec.MAGIC + bytes(100), "truncated: 108 bytes, shorter than the 256-byte header"),
    ],
)
def test_not_a_stoker_file(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "other.bin"
    path.write_bytes(content)
    with pytest.raises(DatasetFormatError, match=message) as info:
        Reader(path)
    assert info.value.path == str(path)
    assert str(info.value).startswith(f"{path}: ")


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(DatasetFormatError, match="cannot be read: No such file"):
        Reader(tmp_path / "nope.stoker")
    with pytest.raises(DatasetFormatError, match="cannot be read"):
        Reader(tmp_path)


@pytest.mark.parametrize("version", [0, 2, 99])
def test_other_format_version(tmp_path: Path, good_file: Path, version: int) -> None:
    raw = bytearray(good_file.read_bytes())
    h = header_of(raw)
    values = {name: int(h[name]) for name in spec.HEADER_DTYPE.names if name not in ("magic", "reserved", "header_crc")}
    raw[: spec.HEADER_SIZE] = spec.pack_header(values | {"version": version})
    path = tmp_path / "v.stoker"
    path.write_bytes(raw)
    with pytest.raises(DatasetFormatError, match=f"format version {version}; this stoker reads version {spec.FORMAT_VERSION}") as info:
        Reader(path)
    assert "re-convert" in str(info.value)
    assert isinstance(info.value, StokerError)


def test_flipped_version_without_valid_crc_is_reported_as_corrupt(tmp_path: Path, good_file: Path) -> None:
    raw = bytearray(good_file.read_bytes())
    raw[8] ^= 0x02
    path = tmp_path / "v.stoker"
    path.write_bytes(raw)
    with pytest.raises(DatasetFormatError, match="corrupt header: its checksum does not match \\(it claims format version 3\\)"):
        Reader(path)


def test_error_pickles(good_file: Path) -> None:
    import pickle

    err = DatasetFormatError(good_file, "corrupt header")
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err) and again.path == err.path


# ---- truncation and bit flips, in a child process -------------------------------------------------
def test_truncated_files_are_rejected_at_open(tmp_path: Path, good_file: Path) -> None:
    raw = good_file.read_bytes()
    cuts = {"p0": 0, "p1": len(raw) // 100, "p50": len(raw) // 2, "p99": len(raw) * 99 // 100, "minus1": len(raw) - 1, "b5": 5, "b100": 100}
    paths = []
    for name, cut in cuts.items():
        path = tmp_path / f"{name}.stoker"
        path.write_bytes(raw[:cut])
        paths.append(path)
    results = open_in_child(paths)
    for name, cut in cuts.items():
        verdict, message = results[f"{name}.stoker"]
        assert verdict == "CAUGHT", (name, message)
        expected = "the file is empty" if cut == 0 else "truncated"
        assert expected in message, (name, message)
    # and in this process too: rejected at open, before any memory map exists
    for path in paths:
        with pytest.raises(DatasetFormatError):
            Reader(path)


def test_trailing_bytes_are_rejected(tmp_path: Path, good_file: Path) -> None:
    path = tmp_path / "long.stoker"
    path.write_bytes(good_file.read_bytes() + b"\x00")
    with pytest.raises(DatasetFormatError, match="has trailing bytes"):
        Reader(path)


def flip(raw: bytes, positions: list[int], rng: np.random.Generator) -> bytearray:
    out = bytearray(raw)
    for pos in positions:
        out[pos] ^= int(rng.integers(1, 256))
    return out


def test_flipped_bytes_in_the_first_64_kib_are_detected(tmp_path: Path, good_file: Path) -> None:
    raw = good_file.read_bytes()
    with Reader(good_file) as reader:
        table_end = reader.field_table_offset + reader.field_table_size
        meta = reader.metadata_offset
    targeted = {
        "magic": [0],
        "version": [8],
        "num_samples": [16],
        "file_size": [33],
        "reserved": [200],
        "header_crc": [253],
        "field_table_first": [256],
        "field_table_last": [table_end - 1],
        "padding": [table_end] if table_end < meta else [meta - 1],
        "metadata_first": [meta],
        "metadata_ptr": [meta + 16 * 32 + 16],
        "metadata_late": [FIRST - 1],
    }
    paths = []
    rng = np.random.default_rng(1234)
    for name, positions in targeted.items():
        paths.append(tmp_path / f"t-{name}.stoker")
        paths[-1].write_bytes(flip(raw, positions, rng))
    for seed in range(12):
        rng = np.random.default_rng(seed)
        count = int(rng.integers(1, 17))
        positions = sorted({int(p) for p in rng.integers(0, FIRST, count)})
        paths.append(tmp_path / f"r-{seed}.stoker")
        paths[-1].write_bytes(flip(raw, positions, rng))
    results = open_in_child([good_file, *paths])
    assert results[good_file.name][0] == "ACCEPTED"
    for path in paths:
        verdict, message = results[path.name]
        assert verdict == "CAUGHT", (path.name, message)
        assert "corrupt" in message or "not a stoker dataset" in message or "version" in message, (path.name, message)


def test_flipped_data_byte_is_caught_by_verify(tmp_path: Path, good_file: Path) -> None:
    raw = bytearray(good_file.read_bytes())
    with Reader(good_file) as reader:
        pos = reader.heap_offset + 1000
        ptrs = reader.metadata["blob/ptr"]
        sample = int(np.searchsorted(ptrs, pos, side="right")) - 1
    raw[pos] ^= 0x40
    path = tmp_path / "d.stoker"
    path.write_bytes(raw)
    with Reader(path) as reader:
        reader.validate_metadata()  # the metadata is intact
        reader.read(sample)  # and reading does not check data checksums
        with pytest.raises(DatasetFormatError, match="corrupt data region: checksum mismatch in block 0"):
            reader.verify()


# ---- crafted files whose checksums are all valid --------------------------------------------------
def test_heap_pointer_outside_the_heap(tmp_path: Path, good_file: Path) -> None:
    raw = bytearray(good_file.read_bytes())
    h = header_of(raw)
    row = int(h["metadata_offset"]) + 10 * int(h["metadata_row_size"])
    raw[row + 16 : row + 24] = (int(h["file_size"]) + 5).to_bytes(8, "little")  # blob/ptr of sample 10
    path = tmp_path / "d.stoker"
    path.write_bytes(reseal(raw))
    reader = Reader(path)
    with pytest.raises(DatasetFormatError, match="sample 10, field 'blob' points outside the heap"):
        reader.validate_metadata()
    with pytest.raises(DatasetFormatError):
        reader.read(0)  # read validates first


def test_ragged_length_whose_byte_count_wraps_around(tmp_path: Path) -> None:
    path = tmp_path / "d.stoker"
    DatasetWriter(path, {"r": RaggedArrayField(np.int32)}, num_workers=1, progress=False).from_indexed_dataset([[1, 2], []])
    raw = bytearray(path.read_bytes())
    h = header_of(raw)
    row = int(h["metadata_offset"]) + 1 * int(h["metadata_row_size"])
    raw[row + 16 : row + 24] = (1 << 62).to_bytes(8, "little")  # r/length of the empty sample: 4 * 2**62 wraps to 0
    path.write_bytes(reseal(raw))
    with pytest.raises(DatasetFormatError, match="sample 1, field 'r' has a size that disagrees"):
        Reader(path).validate_metadata()


def test_nonzero_padding_is_corruption(tmp_path: Path, good_file: Path) -> None:
    raw = bytearray(good_file.read_bytes())
    h = header_of(raw)
    end = int(h["field_table_offset"]) + int(h["field_table_size"])
    assert end < int(h["metadata_offset"])
    raw[end] = 1
    path = tmp_path / "d.stoker"
    path.write_bytes(reseal(raw))
    with pytest.raises(DatasetFormatError, match="corrupt padding after the field table"):
        Reader(path).validate_metadata()


def test_overlapping_sections(tmp_path: Path, good_file: Path) -> None:
    raw = bytearray(good_file.read_bytes())
    h = header_of(raw)
    values = {name: int(h[name]) for name in spec.HEADER_DTYPE.names if name not in ("magic", "reserved", "header_crc")}
    raw[: spec.HEADER_SIZE] = spec.pack_header(values | {"metadata_offset": int(h["field_table_offset"]) + 8})
    path = tmp_path / "d.stoker"
    path.write_bytes(raw)
    with pytest.raises(DatasetFormatError, match=r"corrupt header: the metadata table starts at \d+, inside the previous section"):
        Reader(path)


def test_unknown_field_type(tmp_path: Path, good_file: Path) -> None:
    raw = bytearray(good_file.read_bytes())
    h = header_of(raw)
    lo, hi = int(h["field_table_offset"]), int(h["field_table_offset"]) + int(h["field_table_size"])
    raw[lo:hi] = bytes(raw[lo:hi]).replace(b'"type":"bytes"', b'"type":"bytez"')
    path = tmp_path / "d.stoker"
    path.write_bytes(reseal(raw))
    with pytest.raises(DatasetFormatError, match="unknown field type 'bytez' for field 'blob'"):
        Reader(path)


def test_jpeg_side_beyond_libjpeg_limit(tmp_path: Path) -> None:
    from stoker.fields import RGBImageField

    path = tmp_path / "d.stoker"
    images = [np.full((8, 8, 3), 100, np.uint8), np.full((8, 8, 3), 50, np.uint8)]
    DatasetWriter(path, {"img": RGBImageField(write_mode="jpg")}, num_workers=1, progress=False).from_indexed_dataset(
        [(im,) for im in images]
    )
    offset = Reader(path).row_dtype.fields["img/height"][1]
    raw = bytearray(path.read_bytes())
    h = header_of(raw)
    row = int(h["metadata_offset"]) + 1 * int(h["metadata_row_size"])
    raw[row + offset : row + offset + 4] = (70_000).to_bytes(4, "little")  # height of sample 1
    path.write_bytes(reseal(raw))
    with pytest.raises(DatasetFormatError, match="sample 1, field 'img' has a size that disagrees"):
        Reader(path).validate_metadata()


# ---- crafted headers and field tables with valid checksums (checked at open: FORMAT.md's rules) ----------------
@pytest.fixture(scope="module")
def column_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two column fields (``x`` float32 (3,), ``z`` uint8 (5,)) and an int ``label``, 50 samples."""
    from stoker.fields import NDArrayField

    path = tmp_path_factory.mktemp("columns") / "c.stoker"
    rng = np.random.default_rng(0)
    samples = [(rng.random(3, dtype=np.float32), rng.integers(0, 255, 5).astype(np.uint8), i) for i in range(50)]
    fields = {"x": NDArrayField((3,), np.float32), "z": NDArrayField((5,), np.uint8), "label": IntField()}
    DatasetWriter(path, fields, num_workers=1, progress=False).from_indexed_dataset(samples)
    return path


def with_header(raw: bytearray, **changes: int) -> bytearray:
    """``raw`` with header values changed (``header_size`` too, which ``pack_header`` fixes), every checksum recomputed."""
    h = header_of(raw)
    values = {name: int(h[name]) for name in spec.HEADER_DTYPE.names if name not in ("magic", "reserved", "header_crc")}
    size = changes.pop("header_size", None)
    raw[: spec.HEADER_SIZE] = spec.pack_header(values | changes)
    raw = reseal(raw)
    if size is not None:
        raw[12:16] = size.to_bytes(4, "little")
        raw[252:256] = spec.crc32(bytes(raw[:252])).to_bytes(4, "little")
    return raw


def with_table(raw: bytearray, edit: Any) -> bytearray:
    """``raw`` with its field table (parsed, then ``edit(fields)``) written back compactly, every checksum recomputed."""
    import json

    h = header_of(raw)
    lo = int(h["field_table_offset"])
    table = json.loads(bytes(raw[lo : lo + int(h["field_table_size"])]))
    edit(table["fields"])
    text = json.dumps(table, separators=(",", ":"), ensure_ascii=False).encode()
    room = int(h["metadata_offset"]) - lo
    assert len(text) <= room, "the edited table does not fit its room"
    raw[lo : lo + room] = text + bytes(room - len(text))
    return with_header(raw, field_table_size=len(text))


def _set(k: int, key: str, value: Any) -> Any:
    def edit(fields: list[dict[str, Any]]) -> None:
        fields[k][key] = value

    return edit


def _set_arg(k: int, key: str, value: Any) -> Any:
    def edit(fields: list[dict[str, Any]]) -> None:
        fields[k]["args"][key] = value

    return edit


def test_the_untouched_column_file_opens_and_reads(column_file: Path) -> None:
    """(The edits below start from a file that is valid as written, and re-sealed unchanged it stays valid.)"""
    raw = bytearray(column_file.read_bytes())
    assert with_table(bytearray(raw), lambda fields: None) == raw
    with Reader(column_file) as reader:
        reader.verify()
        assert reader.read(7)[2] == 7


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_set(0, "name", 5), r"entry 0 is named 5; a name is a string of 1 to 255 characters without '/'"),
        (_set(1, "name", ""), r"entry 1 is named ''; a name is a string"),
        (_set(0, "name", "a/b"), r"entry 0 is named 'a/b'; a name is a string"),
        (_set(1, "name", "x"), r"two fields are named 'x'"),
        (_set(2, "type", 3), r"field 'label' needs a 'type' string and an 'args' object"),
        (_set(2, "args", []), r"field 'label' needs a 'type' string and an 'args' object"),
        (_set_arg(0, "dtype", ">f4"), r"field 'x' is stored as '>f4'; stoker files are little-endian"),
        (_set_arg(0, "dtype", "|V4"), r"field 'x': NDArrayField dtype must be one the loader reads back"),
        (_set(0, "column_offset", 3648.0), r"the column_offset of field 'x' is 3648.0, not a whole number"),
        (_set(0, "column_offset", True), r"the column_offset of field 'x' is True, not a whole number"),
        (lambda fields: fields.__setitem__(slice(None), [fields[0], *fields]), r"two fields are named 'x'"),
    ],
)
def test_a_field_table_against_the_format_is_refused_at_open(tmp_path: Path, column_file: Path, edit: Any, message: str) -> None:
    """Names, types, dtypes and column offsets as FORMAT.md writes them; a big-endian dtype would be read as
    little-endian (other values), a void one fails later inside a pipeline: each refused when the file is opened."""
    path = tmp_path / "t.stoker"
    path.write_bytes(with_table(bytearray(column_file.read_bytes()), edit))
    with pytest.raises(DatasetFormatError, match=f"corrupt field table: {message}"):
        Reader(path)


@pytest.mark.parametrize("shift", [1, 8, 64, -64])
def test_a_column_not_where_the_format_puts_it_is_refused(tmp_path: Path, column_file: Path, shift: int) -> None:
    """The first column starts at data_offset, each next one at the aligned end of the one before: a column moved
    (its bytes shifted: other values, or a column read across the next one) is refused, whichever one moved."""
    with Reader(column_file) as reader:
        offsets = dict(reader._columns)
    k = 0 if shift > 0 else 1  # (the first column cannot start before the data region: that has its own message)
    name = ["x", "z"][k]
    path = tmp_path / "t.stoker"
    path.write_bytes(with_table(bytearray(column_file.read_bytes()), _set(k, "column_offset", offsets[name] + shift)))
    with pytest.raises(DatasetFormatError, match=rf"the column of field '{name}' (starts at byte {offsets[name] + shift}; the format puts it at {offsets[name]}|lies outside the data region)"):  # fmt: skip
        Reader(path)


@pytest.mark.parametrize(("key", "value"), [("header_size", 0), ("header_size", 320), ("data_block_size", 1 << 63),
                                            ("data_block_size", (1 << 40) + 1), ("metadata_block_size", (1 << 64) - 1)])  # fmt: skip
def test_a_header_against_the_format_is_refused_at_open(tmp_path: Path, column_file: Path, key: str, value: int) -> None:
    """header_size is 256 in version 1; a block size beyond 1 TiB (2**63 made a loader fail with an OverflowError
    after the file had opened and verified)."""
    path = tmp_path / "h.stoker"
    path.write_bytes(with_header(bytearray(column_file.read_bytes()), **{key: value}))
    with pytest.raises(DatasetFormatError, match=f"corrupt header: {key} {value}"):
        Reader(path)


def test_the_largest_block_size_allowed_opens(tmp_path: Path, column_file: Path) -> None:
    path = tmp_path / "h.stoker"
    path.write_bytes(with_header(bytearray(column_file.read_bytes()), data_block_size=1 << 40, metadata_block_size=1 << 40))
    with Reader(path) as reader:
        reader.verify()
        np.testing.assert_array_equal(reader.read(3)[1], Reader(column_file).read(3)[1])


def test_verify_names_a_corrupt_blocks_bytes_within_the_data_region(tmp_path: Path, column_file: Path) -> None:
    """The last (here the only) data block ends where the data region does, not a block size later."""
    raw = bytearray(column_file.read_bytes())
    h = header_of(raw)
    lo, hi = int(h["data_offset"]), int(h["data_offset"]) + int(h["data_size"])
    raw[lo + 5] ^= 0x10
    path = tmp_path / "d.stoker"
    path.write_bytes(raw)
    with Reader(path) as reader, pytest.raises(DatasetFormatError, match=rf"checksum mismatch in block 0 \(bytes {lo}\.\.{hi}\)$"):
        reader.verify()
