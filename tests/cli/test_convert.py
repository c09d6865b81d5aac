"""``stoker convert imagefolder``, run as a user would: ``python -m stoker convert imagefolder SRC DST``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from stoker.format import Reader


def stoker(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stoker", *map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.fixture
def src(tmp_path: Path) -> Path:
    """cat: 2 JPEGs (one in a sub-folder) and a grayscale PNG; dog: an RGBA PNG and a 120x80 JPEG."""
    rng = np.random.default_rng(0)
    root = tmp_path / "src"
    for rel, shape in [("cat/1.jpg", (40, 30, 3)), ("cat/nested/2.jpg", (20, 20, 3)), ("cat/3.png", (16, 24)), ("dog/4.png", (10, 12, 4))]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(root / rel)
    Image.fromarray(rng.integers(0, 256, (80, 120, 3), dtype=np.uint8)).save(root / "dog" / "5.jpg")
    return root


def test_convert_prints_a_summary(tmp_path: Path, src: Path) -> None:
    dst = tmp_path / "out.stoker"
    proc = stoker("convert", "imagefolder", src, dst, "--write-mode", "jpg", "--jpeg-quality", "80", "--max-resolution", "64", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert lines == [
        f"wrote:    {dst.resolve()}",
        "images:   5",
        f"classes:  2 (cat, dog); names in {dst.resolve()}.classes.json",
        f"bytes:    {dst.stat().st_size:,} bytes ({dst.stat().st_size / 1024:.1f} KiB)",
        "skipped:  0",
    ]
    assert json.loads(Path(f"{dst}.classes.json").read_text()) == {"classes": ["cat", "dog"]}
    with Reader(dst) as reader:
        assert len(reader) == 5
        assert reader.fields["image"].to_args()["jpeg_quality"] == 80
        assert reader.metadata["label/value"].tolist() == [0, 0, 0, 1, 1]
        assert (reader.metadata["image/mode"] == 1).all()
        assert reader.read(4)[0].shape == (43, 64, 3)  # 80x120 -> longer side 64


def test_bad_image_fails_naming_the_file(tmp_path: Path, src: Path) -> None:
    bad = src / "dog" / "broken.jpg"
    bad.write_bytes(np.random.default_rng(1).bytes(1000))
    dst = tmp_path / "out.stoker"
    proc = stoker("convert", "imagefolder", src, dst, "--quiet")
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("stoker convert imagefolder: error: ")
    assert str(bad) in proc.stderr and "--skip-bad" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no dataset, no temporary, no class list


def test_skip_bad_lists_the_file(tmp_path: Path, src: Path) -> None:
    bad = src / "cat" / "nested" / "broken.png"
    bad.write_bytes(b"\x89PNG not really")
    dst = tmp_path / "out.stoker"
    proc = stoker("convert", "imagefolder", src, dst, "--skip-bad", "--num-workers", "2", "--write-mode", "raw")
    assert proc.returncode == 0, proc.stderr
    assert "images:   5" in proc.stdout
    assert proc.stdout.rstrip().endswith(f"skipped:  1\n  {bad}: not an image that Pillow can identify")
    with Reader(dst) as reader:
        assert len(reader) == 5


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: tmp / "missing", "does not exist"),
        (lambda tmp: tmp, "has no sub-folders"),
    ],
    ids=["missing", "no-class-folders"],
)
def test_bad_source_is_one_line(tmp_path: Path, make: object, message: str) -> None:
    source = make(tmp_path)  # type: ignore[operator]
    proc = stoker("convert", "imagefolder", source, tmp_path / "out.stoker")
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"stoker convert imagefolder: error: {source} {message}; ")
    assert len(proc.stderr.splitlines()) == 1


@pytest.mark.parametrize(
    "args",
    [
        ["convert"],
        ["convert", "nosuchsource", "a", "b"],
        ["convert", "imagefolder", "a"],
        ["convert", "imagefolder", "a", "b", "--jpeg-quality", "0"],
        ["convert", "imagefolder", "a", "b", "--write-mode", "png"],
        ["convert", "imagefolder", "a", "b", "--max-resolution", "0"],
        ["convert", "imagefolder", "a", "b", "--compress-probability", "1.5"],
        ["convert", "imagefolder", "a", "b", "--num-workers", "-2"],
    ],
)
def test_usage_errors(args: list[str]) -> None:
    proc = stoker(*args)
    assert proc.returncode == 2
    assert "usage: stoker convert" in proc.stderr
