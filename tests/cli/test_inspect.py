"""``stoker inspect``, run as a user would: ``python -m stoker inspect FILE``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stoker.cli.inspect import human_size
from stoker.cli.main import main
from stoker.fields import BytesField, IntField, NDArrayField, RGBImageField
from stoker.format import DatasetWriter, Reader


def stoker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stoker", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "small.stoker"
    fields = {
        "x": NDArrayField((4,), np.float32),
        "y": IntField(),
        "blob": BytesField(),
        "image": RGBImageField(write_mode="jpg", jpeg_quality=85),
    }
    samples = [(np.full(4, i, np.float32), i, b"ab" * i, np.full((8, 6, 3), i, np.uint8)) for i in range(50)]
    DatasetWriter(path, fields, num_workers=1, progress=False).from_indexed_dataset(samples)
    return path


def test_inspect_good_file(dataset: Path) -> None:
    proc = stoker("inspect", str(dataset))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    out = proc.stdout
    assert f"path:           {dataset.resolve()}" in out
    assert "format version: 1" in out
    assert "samples:        50" in out
    assert f"file size:      {dataset.stat().st_size:,} bytes" in out
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("field"))
    assert header.split() == ["field", "type", "args", "storage", "bytes"]
    table = lines[lines.index(header) + 2 :]
    table = table[: table.index("")] if "" in table else table  # the image lines follow after a blank line
    rows = {line.split()[0]: line for line in table}
    assert set(rows) == {"x", "y", "blob", "image"}
    assert "ndarray" in rows["x"] and "shape=[4], dtype='<f4'" in rows["x"] and "column" in rows["x"]
    assert rows["x"].split()[-1] == f"{50 * 16:,}"
    assert rows["y"].split()[1:] == ["int", "-", "meta", "400"]
    assert rows["blob"].split()[-1] == f"{50 * 16 + sum(2 * i for i in range(50)):,}"
    assert "write_mode='jpg'" in rows["image"] and "jpeg_quality=85" in rows["image"] and "heap" in rows["image"]
    assert "checksums" not in out


def test_inspect_verify(dataset: Path) -> None:
    proc = stoker("inspect", "--verify", str(dataset))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip().endswith("all checksums OK")


def test_inspect_corrupt_file(tmp_path: Path, dataset: Path) -> None:
    raw = bytearray(dataset.read_bytes())
    raw[20] ^= 0xFF  # inside num_samples: the header checksum no longer matches
    path = tmp_path / "corrupt.stoker"
    path.write_bytes(raw)
    proc = stoker("inspect", str(path))
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.strip() == f"stoker inspect: error: {path}: corrupt header: its checksum does not match"
    assert "Traceback" not in proc.stderr


def test_inspect_verify_finds_a_corrupt_data_block(tmp_path: Path, dataset: Path) -> None:
    raw = bytearray(dataset.read_bytes())
    with Reader(dataset) as reader:
        raw[reader.data_offset + 3] ^= 0x01
    path = tmp_path / "data.stoker"
    path.write_bytes(raw)
    assert stoker("inspect", str(path)).returncode == 0  # without --verify the data is not read
    proc = stoker("inspect", "--verify", str(path))
    assert proc.returncode == 1
    assert "corrupt data region: checksum mismatch in block 0" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "all checksums OK" not in proc.stdout


def test_inspect_checks_the_metadata_before_its_figures(tmp_path: Path, dataset: Path) -> None:
    """An image's height changed in the metadata table, its checksum left stale: without --verify too, inspect refuses
    the table (as a Loader does) rather than print sizes from it (it printed "max 4,000,000,000 pixels", exit 0)."""
    raw = bytearray(dataset.read_bytes())
    with Reader(dataset) as reader:
        offset = reader.row_dtype.fields["image/height"][1]
        row = reader.metadata_offset + 3 * reader.metadata_row_size
    raw[row + offset : row + offset + 4] = (4_000_000_000).to_bytes(4, "little")
    path = tmp_path / "meta.stoker"
    path.write_bytes(raw)
    proc = stoker("inspect", str(path))
    assert proc.returncode == 1, proc.stdout
    assert proc.stderr.strip() == f"stoker inspect: error: {path}: corrupt metadata table: checksum mismatch in block 0 (samples from 0)"
    assert "4,000,000,000" not in proc.stdout


@pytest.mark.parametrize("content", [None, b"", b"just some text\n"])
def test_inspect_missing_or_foreign_file(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "x.stoker"
    if content is not None:
        path.write_bytes(content)
    proc = stoker("inspect", str(path))
    assert proc.returncode == 1
    message = proc.stderr.strip()
    assert len(message.splitlines()) == 1 and "Traceback" not in message
    assert message.startswith(f"stoker inspect: error: {path}: ")
    assert ("No such file" if content is None else "not a stoker dataset") in message


def test_main_in_process(dataset: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(dataset)]) == 0
    assert "samples:        50" in capsys.readouterr().out
    assert main([]) == 2
    assert "inspect" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["inspect"])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0


def test_cli_import_loads_no_numba_or_torch() -> None:
    code = "import sys, stoker.cli.main; bad = [m for m in ('numba', 'torch') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_help_lists_the_commands() -> None:
    proc = stoker("--help")
    assert proc.returncode == 0
    assert "inspect" in proc.stdout and "bench" in proc.stdout


def test_human_size() -> None:
    assert human_size(0) == "0 bytes"
    assert human_size(1023) == "1,023 bytes"
    assert human_size(1536) == "1,536 bytes (1.5 KiB)"
    assert human_size(5 << 30) == "5,368,709,120 bytes (5.0 GiB)"


def test_inspect_shows_classes_and_image_sizes(tmp_path: Path) -> None:
    from PIL import Image

    from stoker.convert.imagefolder import convert_image_folder

    sizes = {"cat": [(30, 40), (50, 20), (31, 41)], "dog": [(80, 90), (10, 12)], "eel": [(64, 65)]}
    for name, shapes in sizes.items():
        for i, (h, w) in enumerate(shapes):
            (tmp_path / "src" / name).mkdir(parents=True, exist_ok=True)
            image = Image.fromarray(np.random.default_rng(i).integers(0, 256, (h, w, 3), dtype=np.uint8))
            image.save(tmp_path / "src" / name / f"{i}.{'png' if h == 10 else 'jpg'}")
    summary = convert_image_folder(tmp_path / "src", tmp_path / "pets.stoker", write_mode="smart", num_workers=1, progress=False)
    proc = stoker("inspect", str(summary.path))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert "classes:  3 from pets.stoker.classes.json: cat (3), dog (2), eel (1)" in out
    heights = sorted(h for shapes in sizes.values() for h, _ in shapes)
    widths = sorted(w for shapes in sizes.values() for _, w in shapes)
    with Reader(summary.path) as reader:
        jpg = int(reader.metadata["image/mode"].sum())
    assert 0 < jpg < 6  # smart: JPEG only for the images above 64 * 64 pixels
    assert f"images 'image': 6 ({jpg} jpg, {6 - jpg} raw)" in out
    assert f"  height: min {heights[0]}, median {np.median(heights):.1f}, max {heights[-1]} pixels" in out
    assert f"  width:  min {widths[0]}, median {np.median(widths):.1f}, max {widths[-1]} pixels" in out


def test_inspect_without_a_class_list(dataset: Path, tmp_path: Path) -> None:
    out = stoker("inspect", str(dataset)).stdout
    assert "classes:" not in out
    assert "images 'image': 50 (50 jpg, 0 raw)" in out
    assert "  height: min 8, median 8, max 8 pixels" in out
    broken = tmp_path / "x.stoker"
    broken.write_bytes(dataset.read_bytes())
    (tmp_path / "x.stoker.classes.json").write_text('{"classes": "cat"}')
    assert "classes:  unreadable (" in stoker("inspect", str(broken)).stdout


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    from stoker.dataset import write_shards

    folder = tmp_path_factory.mktemp("cli") / "data"
    fields = {"x": NDArrayField((4,), np.float32), "y": IntField(), "image": RGBImageField(write_mode="raw")}
    samples = [(np.full(4, i, np.float32), i, np.full((6 + i % 3, 5, 3), i, np.uint8)) for i in range(25)]
    paths = write_shards(folder, fields, samples, samples_per_shard=10, num_workers=1, progress=False)
    return folder, paths


def test_inspect_a_folder_of_shards_shows_its_manifest(shards: tuple[Path, list[Path]]) -> None:
    folder, paths = shards
    proc = stoker("inspect", str(folder))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert f"path:           {folder.resolve()}" in lines
    assert "manifest:       manifest.stoker.json" in lines
    assert "shards:         3" in lines and "samples:        25" in lines
    assert f"total size:     {human_size(sum(p.stat().st_size for p in paths))}" in lines
    header = next(line for line in lines if line.startswith("field"))
    table = lines[lines.index(header) + 2 : lines.index(header) + 5]
    rows = {line.split()[0]: line.split() for line in table}
    assert set(rows) == {"x", "y", "image"}
    assert rows["x"][-1] == f"{25 * 16:,}" and rows["y"][1:] == ["int", "-", "meta", f"{25 * 8:,}"]
    shard_header = next(line for line in lines if line.startswith("shard "))
    assert shard_header.split() == ["shard", "first", "sample", "samples", "file", "size"]
    shown = [line.split() for line in lines[lines.index(shard_header) + 2 : lines.index(shard_header) + 5]]
    assert shown == [[p.name, f"{10 * k}", f"{min(10, 25 - 10 * k)}", f"{p.stat().st_size:,}"] for k, p in enumerate(paths)]
    assert "images 'image': 25 (0 jpg, 25 raw)" in lines
    assert "  height: min 6, median 7, max 8 pixels" in lines
    verified = stoker("inspect", "--verify", str(folder))
    assert verified.returncode == 0 and verified.stdout.rstrip().endswith("all checksums OK"), verified.stderr


def test_inspect_a_folder_names_a_missing_shard(shards: tuple[Path, list[Path]], tmp_path: Path) -> None:
    import shutil

    folder, paths = shards
    copy = tmp_path / "data"
    shutil.copytree(folder, copy)
    (copy / paths[1].name).unlink()
    proc = stoker("inspect", str(copy))
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("stoker inspect: error: ") and paths[1].name in proc.stderr and "Traceback" not in proc.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = stoker("inspect", str(empty))
    assert proc.returncode == 1 and proc.stderr.startswith(f"stoker inspect: error: {empty}")


def test_inspect_a_folder_of_one_shard(tmp_path: Path) -> None:
    from stoker.dataset import write_shards

    (path,) = write_shards(tmp_path / "one", {"y": IntField()}, {"y": np.arange(5)}, samples_per_shard=10, num_workers=1, progress=False)
    lines = stoker("inspect", str(tmp_path / "one")).stdout.splitlines()
    assert "shards:         1" in lines and "samples:        5" in lines
    assert [path.name, "0", "5", f"{path.stat().st_size:,}"] in [line.split() for line in lines]
