"""``stoker.convert.imagefolder``: a class-per-folder image tree to a stoker file."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from stoker._threads import available_cpus
from stoker.convert.imagefolder import ImageFolderDataset, convert_image_folder, find_images, load_image
from stoker.errors import SampleError, StokerError
from stoker.format import Reader

CLASSES = ["Mango", "apple", "zebra"]  # sorted as Python sorts: upper case first


def smooth(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A smooth RGB picture (gradients), which JPEG keeps close to the source."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    phase = seed * 0.7
    rgb = [128 + 100 * np.sin(x / (w / 3) + phase), 128 + 100 * np.cos(y / (h / 2) + phase), 255 * (x + y) / (h + w)]
    return np.clip(np.stack(rgb, axis=-1), 0, 255).astype(np.uint8)


def make_tree(root: Path) -> dict[str, tuple[str, tuple[int, int]]]:
    """Write an image tree; returns relative path -> (class, (height, width)) of each image."""
    images: dict[str, tuple[str, tuple[int, int]]] = {}

    def save(rel: str, image: Image.Image, **kwargs: object) -> None:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        image.save(path, **kwargs)
        images[rel] = (rel.split("/")[0], (image.height, image.width))

    save("apple/b.jpg", Image.fromarray(smooth(40, 60, 1)), quality=95)
    save("apple/a.png", Image.fromarray(smooth(64, 48, 2)))
    save("apple/more/deep.jpg", Image.fromarray(smooth(30, 30, 3)), quality=95)
    save("Mango/gray.png", Image.fromarray(smooth(50, 50, 4)[..., 0]))  # mode L
    rgba = np.concatenate([smooth(20, 30, 5), np.full((20, 30, 1), 128, np.uint8)], axis=-1)
    save("Mango/alpha.png", Image.fromarray(rgba))  # mode RGBA
    palette = Image.fromarray(smooth(24, 24, 6)).quantize(16)
    palette.info["transparency"] = bytes([0, 100] + [255] * 14)
    save("Mango/palette.png", palette, transparency=palette.info["transparency"])  # mode P, transparency as bytes
    save("zebra/big.JPEG", Image.fromarray(smooth(200, 300, 7)), quality=95)
    save("zebra/tiny.bmp", Image.fromarray(smooth(8, 5, 8)))
    (root / "zebra" / "notes.txt").write_text("not an image")
    jpeg = (root / "apple" / "b.jpg").read_bytes()
    (root / ".ipynb_checkpoints").mkdir()  # hidden: not a class (it would be class 0 and shift every label)
    (root / ".ipynb_checkpoints" / "b.jpg").write_bytes(jpeg)
    (root / "apple" / ".hidden").mkdir()  # hidden folders and files below a class are not samples either
    (root / "apple" / ".hidden" / "c.jpg").write_bytes(jpeg)
    (root / "zebra" / "._big.JPEG").write_bytes(b"\x00\x05\x16\x07 a macOS resource fork")
    (root / "notes.txt").write_text("files other than images in the root are ignored")
    return images


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, tuple[str, tuple[int, int]]]]:
    root = tmp_path_factory.mktemp("imagefolder") / "src"
    return root, make_tree(root)


def expected_order(root: Path, images: dict[str, tuple[str, tuple[int, int]]]) -> list[str]:
    return sorted(images, key=lambda rel: (CLASSES.index(images[rel][0]), str((root / rel).parent), rel.rsplit("/", 1)[1]))


# ---- find_images ---------------------------------------------------------------------------------
def test_find_images_follows_torchvision(tree: tuple[Path, dict[str, tuple[str, tuple[int, int]]]]) -> None:
    root, images = tree
    samples, classes = find_images(root)
    assert classes == CLASSES
    assert [str(p.relative_to(root)) for p, _ in samples] == expected_order(root, images)
    assert [label for _, label in samples] == [CLASSES.index(images[str(p.relative_to(root))][0]) for p, _ in samples]
    assert root / "apple" / "more" / "deep.jpg" in [p for p, _ in samples]


def test_images_in_the_root_are_refused(tmp_path: Path) -> None:
    (tmp_path / "cat").mkdir()
    Image.fromarray(smooth(8, 8)).save(tmp_path / "cat" / "a.png")
    for name in ["x.jpg", "y.PNG", "z.webp", "w.jpeg"]:
        Image.fromarray(smooth(8, 8)).save(tmp_path / name, format="PNG")
    with pytest.raises(
        ValueError, match=r"holds images directly \(w\.jpeg, x\.jpg, y\.PNG and 1 more\); give the folder whose sub-folders"
    ):
        find_images(tmp_path)
    with pytest.raises(ValueError, match="holds images directly"):
        convert_image_folder(tmp_path, tmp_path / "cat" / "out.stoker", progress=False)
    assert not (tmp_path / "cat" / "out.stoker").exists()


def test_find_images_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_images(tmp_path / "missing")
    (tmp_path / "file.txt").write_bytes(b"x")
    with pytest.raises(NotADirectoryError, match="is not a folder"):
        find_images(tmp_path / "file.txt")
    (tmp_path / ".hidden").mkdir()  # not a class
    with pytest.raises(FileNotFoundError, match="no sub-folders"):
        find_images(tmp_path)
    (tmp_path / "cat").mkdir()
    (tmp_path / "dog").mkdir()
    (tmp_path / "dog" / "x.png").write_bytes(b"x")
    (tmp_path / "cat" / "readme.txt").write_text("no image")
    with pytest.raises(FileNotFoundError, match=r"no image in the class folder\(s\) cat;"):
        find_images(tmp_path)


def test_dataset_items(tree: tuple[Path, dict[str, tuple[str, tuple[int, int]]]]) -> None:
    root, images = tree
    samples, _ = find_images(root)
    dataset = ImageFolderDataset(samples)
    assert len(dataset) == len(images)
    for i, (path, label) in enumerate(samples):
        image, got = dataset[i]
        assert got == label
        assert image.dtype == np.uint8 and image.ndim == 3 and image.shape == (*images[str(path.relative_to(root))][1], 3)
    gray = load_image(root / "Mango" / "gray.png")
    assert (gray[..., 0] == gray[..., 1]).all() and (gray[..., 1] == gray[..., 2]).all()
    with Image.open(root / "Mango" / "alpha.png") as img:  # RGBA: alpha dropped, colours kept (torchvision's convert('RGB'))
        np.testing.assert_array_equal(load_image(root / "Mango" / "alpha.png"), np.asarray(img)[..., :3])


# ---- convert_image_folder ------------------------------------------------------------------------
@pytest.mark.parametrize("write_mode", ["raw", "jpg", "smart", "proportion"])
def test_convert_each_write_mode(tmp_path: Path, tree: tuple[Path, dict[str, tuple[str, tuple[int, int]]]], write_mode: str) -> None:
    root, images = tree
    dst = tmp_path / "out.stoker"
    summary = convert_image_folder(root, dst, write_mode=write_mode, jpeg_quality=95, num_workers=1, progress=False)
    order = expected_order(root, images)
    assert summary.images == len(images) and summary.skipped == [] and summary.classes == CLASSES
    assert summary.bytes == dst.stat().st_size
    assert json.loads(summary.classes_path.read_text()) == {"classes": CLASSES}
    assert summary.classes_path == tmp_path / "out.stoker.classes.json"
    with Reader(dst) as reader:
        assert list(reader.fields) == ["image", "label"]
        assert len(reader) == len(images)
        modes = reader.metadata["image/mode"]
        for i, rel in enumerate(order):
            image, label = reader.read(i)
            assert label == CLASSES.index(images[rel][0])
            assert image.shape == (*images[rel][1], 3)
            source = load_image(root / rel).astype(np.int16)
            if modes[i] == 0:  # raw: exactly torchvision's pixels
                np.testing.assert_array_equal(image, source)
            elif rel not in ("zebra/tiny.bmp", "Mango/palette.png"):  # the smooth ones (16 colours, or 8x5 pixels, are not)
                assert np.abs(image.astype(np.int16) - source).mean() < 4, rel
    if write_mode == "raw":
        assert (modes == 0).all()
    elif write_mode == "jpg":
        assert (modes == 1).all()
    elif write_mode == "smart":  # JPEG only above 64*64 pixels
        assert [bool(m) for m in modes] == [images[rel][1][0] * images[rel][1][1] > 64 * 64 for rel in order]


def test_convert_max_resolution_in_parallel(tmp_path: Path, tree: tuple[Path, dict[str, tuple[str, tuple[int, int]]]]) -> None:
    root, images = tree
    dst = tmp_path / "small.stoker"
    summary = convert_image_folder(root, dst, write_mode="raw", max_resolution=32, num_workers=2, chunksize=2, progress=False)
    assert summary.images == len(images)
    with Reader(dst) as reader:
        for i, rel in enumerate(expected_order(root, images)):
            (h, w), (image, _) = images[rel][1], reader.read(i)
            if max(h, w) <= 32:
                assert image.shape == (h, w, 3)
            else:
                assert max(image.shape[:2]) == 32
                assert abs(image.shape[0] / image.shape[1] - h / w) < 0.05


def bad_tree(tmp_path: Path, tree: tuple[Path, dict[str, tuple[str, tuple[int, int]]]]) -> Path:
    src = tmp_path / "src"
    shutil.copytree(tree[0], src)
    (src / "apple" / "corrupt.jpg").write_bytes(np.random.default_rng(0).bytes(2000))
    full = (src / "zebra" / "big.JPEG").read_bytes()
    (src / "zebra" / "truncated.jpg").write_bytes(full[: len(full) // 2])
    return src


@pytest.mark.parametrize("num_workers", [1, 2])
def test_bad_image_names_the_file_and_writes_nothing(
    tmp_path: Path, tree: tuple[Path, dict[str, tuple[str, tuple[int, int]]]], num_workers: int
) -> None:
    src = bad_tree(tmp_path, tree)
    (src / "zebra" / "truncated.jpg").unlink()
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(SampleError) as info:
        convert_image_folder(src, out / "x.stoker", num_workers=num_workers, chunksize=2, progress=False)
    message = str(info.value)
    assert str(src / "apple" / "corrupt.jpg") in message
    assert "not an image that Pillow can identify" in message and "skip_bad=True" in message
    assert isinstance(info.value, StokerError)
    assert list(out.iterdir()) == []  # no file, no temporary, no class list


def test_truncated_image_names_the_file(tmp_path: Path, tree: tuple[Path, dict[str, tuple[str, tuple[int, int]]]]) -> None:
    src = bad_tree(tmp_path, tree)
    (src / "apple" / "corrupt.jpg").unlink()
    with pytest.raises(SampleError, match=r"truncated\.jpg: OSError: image file is truncated"):
        convert_image_folder(src, tmp_path / "x.stoker", num_workers=1, progress=False)
    assert not (tmp_path / "x.stoker").exists()


@pytest.mark.parametrize("num_workers", [1, 2])
def test_skip_bad_lists_and_leaves_out(tmp_path: Path, tree: tuple[Path, dict[str, tuple[str, tuple[int, int]]]], num_workers: int) -> None:
    src = bad_tree(tmp_path, tree)
    root, images = tree
    dst = tmp_path / "out.stoker"
    summary = convert_image_folder(src, dst, write_mode="jpg", skip_bad=True, num_workers=num_workers, progress=False)
    assert [p for p, _ in summary.skipped] == [src / "apple" / "corrupt.jpg", src / "zebra" / "truncated.jpg"]
    assert "Pillow can identify" in summary.skipped[0][1] and "truncated" in summary.skipped[1][1]
    assert summary.images == len(images)
    with Reader(dst) as reader:
        assert len(reader) == len(images)
        assert [int(label) for label in reader.metadata["label/value"]] == [
            CLASSES.index(images[rel][0]) for rel in expected_order(root, images)
        ]


def test_skip_bad_with_nothing_readable(tmp_path: Path) -> None:
    (tmp_path / "src" / "cat").mkdir(parents=True)
    (tmp_path / "src" / "cat" / "x.png").write_bytes(b"not a png")
    with pytest.raises(FileNotFoundError, match=r"none of the 1 images could be read; the first: .*x\.png"):
        convert_image_folder(tmp_path / "src", tmp_path / "x.stoker", skip_bad=True, num_workers=1, progress=False)
    assert not (tmp_path / "x.stoker").exists()


def test_destination_errors(tmp_path: Path, tree: tuple[Path, dict[str, tuple[str, tuple[int, int]]]]) -> None:
    with pytest.raises(IsADirectoryError, match="is a folder"):
        convert_image_folder(tree[0], tmp_path, progress=False)
    with pytest.raises(FileNotFoundError, match="does not exist; create it first"):
        convert_image_folder(tree[0], tmp_path / "missing" / "x.stoker", progress=False)
    with pytest.raises(ValueError, match="jpeg_quality"):
        convert_image_folder(tree[0], tmp_path / "x.stoker", jpeg_quality=0, progress=False)


# ---- interrupted conversions and the class list -----------------------------------------------------
# Converts 400 small images, each load slowed to >= 10 ms, so that it can be stopped mid-way. The first image
# decoded (by a worker process, when checking images) creates the file `marker`: the check is under way.
SLOW_CONVERT = r"""
import os
import sys
import time

import numpy as np
from PIL import Image

import stoker.convert.imagefolder as imagefolder

src, dst, skip_bad, marker = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
original_load, original_item = imagefolder.load_image, imagefolder.ImageFolderDataset.__getitem__


def slow_load(path):
    if not os.path.exists(marker):
        open(marker, "a").close()
    time.sleep(0.01)
    return original_load(path)


def slow_item(self, index):
    time.sleep(0.01)
    return original_item(self, index)


imagefolder.load_image = slow_load  # the worker processes are forked: they see it too
imagefolder.ImageFolderDataset.__getitem__ = slow_item
print("started", flush=True)
imagefolder.convert_image_folder(src, dst, num_workers=2, chunksize=4, skip_bad=skip_bad, progress=False)
print("finished", flush=True)
"""


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("many") / "src"
    for i in range(400):
        path = root / ("cat" if i % 2 else "dog") / f"{i:03}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(smooth(12, 16, i)).save(path)
    return root


@pytest.mark.parametrize("stage", ["writing", "checking"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_mid_conversion_leaves_nothing(tmp_path: Path, many: Path, stage: str, sig: int) -> None:
    out = tmp_path / "out"
    out.mkdir()
    dst = out / "train.stoker"
    checking = tmp_path / "checking"

    def under_way() -> bool:
        """Writing: the temporary holds sample data. Checking: a worker decoded an image (the pool runs, and the check,
        400 images at >= 10 ms on 2 workers, has >= 2 s to go)."""
        if stage == "writing":
            return any(p.stat().st_size > 0 for p in out.glob(".train.stoker.stoker-tmp-*"))
        return checking.exists()

    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_CONVERT, str(many), str(dst), "1" if stage == "checking" else "0", str(checking)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its worker processes are in the process group proc.pid
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"started\n"
        deadline = time.monotonic() + 120  # generous: the machine may be busy; a conversion takes >= 4 s of sleeps
        while not under_way():
            assert time.monotonic() < deadline and proc.poll() is None, "the conversion never got there"
            time.sleep(0.02)
    finally:
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=60)
    assert b"finished" not in stdout
    if sig == signal.SIGTERM:
        assert proc.returncode == -signal.SIGTERM, stderr.decode()
    else:
        assert proc.returncode == -signal.SIGINT and b"KeyboardInterrupt" in stderr, stderr.decode()  # Python re-raises SIGINT at exit
    assert list(out.iterdir()) == []  # no dataset, no class list, no temporary
    deadline = time.monotonic() + 30
    while group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert group_members(proc.pid) == []  # no worker process left behind


def group_members(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (from /proc; empty where there is no /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names the fsynced files through /proc")
def test_class_list_is_written_atomically(
    tmp_path: Path, tree: tuple[Path, dict[str, tuple[str, tuple[int, int]]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sidecar goes through a temporary that is fsynced, renamed, and its folder fsynced, as the dataset."""
    import os

    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    (tmp_path / "out.stoker.classes.json").write_text("old")
    summary = convert_image_folder(tree[0], tmp_path / "out.stoker", num_workers=1, progress=False)
    assert json.loads(summary.classes_path.read_text()) == {"classes": CLASSES}
    sidecar = [i for i, name in enumerate(synced) if Path(name).name.startswith(".out.stoker.classes.json.stoker-tmp-")]
    assert len(sidecar) == 1
    assert synced[sidecar[0] + 1] == str(tmp_path)  # then the folder, after the rename
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.stoker", "out.stoker.classes.json"]


def _jpeg_tree(root: Path, count: int, odd: dict[int, str]) -> None:
    """``count`` JPEGs in two classes; image ``i`` in ``odd`` is saved as that format instead."""
    for i in range(count):
        folder = root / ("a" if i % 2 else "b")
        folder.mkdir(parents=True, exist_ok=True)
        kind = odd.get(i, "jpg")
        Image.fromarray(smooth(16, 20, i)).save(folder / f"{i:04d}.{kind}", quality=90)


@pytest.mark.parametrize(
    ("odd", "reencode", "given", "expected"),
    [
        ({}, False, -1, 1),  # JPEGs copied as they are: in this process
        ({}, True, -1, "cpus"),  # re-encoding is work: one process per CPU
        ({}, False, 2, 2),  # an explicit count is kept
        ({7: "png"}, False, -1, "cpus"),  # a PNG among the sampled files: it needs decoding
    ],
)
def test_default_workers_follow_the_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, odd: dict[int, str], reencode: bool, given: int, expected: int | str
) -> None:
    """``num_workers=-1`` converts JPEGs that need no decoding in this process: processes would only slow it down."""
    from stoker.format import writer as writer_module

    _jpeg_tree(tmp_path / "src", 40, odd)  # 40 files: the 32 sampled are 0, 1, 2, ... 31 (a step of 1)
    seen: list[int] = []
    real = writer_module.DatasetWriter.__init__

    def record(self: object, *args: object, **kwargs: object) -> None:
        real(self, *args, **kwargs)  # type: ignore[arg-type]
        seen.append(self.num_workers)  # type: ignore[attr-defined]

    monkeypatch.setattr(writer_module.DatasetWriter, "__init__", record)
    summary = convert_image_folder(
        tmp_path / "src", tmp_path / "out.stoker", write_mode="jpg", num_workers=given, reencode=reencode, progress=False
    )
    assert seen == [available_cpus() if expected == "cpus" else expected]
    assert summary.images == 40
