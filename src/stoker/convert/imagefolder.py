"""Convert a class-per-folder image tree (torchvision's ``ImageFolder`` layout) to a stoker file.

::

    SRC/
      cat/  001.jpg  002.png  more/003.jpg     -> label 0
      dog/  001.jpg  ...                        -> label 1

Classes are the sub-folders of ``SRC``, sorted by name; a class's label is its
position in that order, as in ``torchvision.datasets.ImageFolder``. Images are
the files with an image extension (:data:`IMG_EXTENSIONS`, any case) anywhere
below a class folder. Hidden folders and files (names starting with ``.``, like
``.ipynb_checkpoints`` or macOS's ``._x.jpg``) are ignored at every level: unlike
torchvision, a hidden folder in ``SRC`` is not a class, which would shift every
label. An image directly in ``SRC`` is an error (the root is probably one level
too deep). Samples are ordered by class, then by path.

Pixels are those of torchvision's default loader: Pillow decodes the file and
``Image.convert('RGB')`` turns grayscale, palette, CMYK and RGBA images into
RGB. Transparency is dropped (the colour under a transparent pixel is kept, it
is not blended with a background), and EXIF orientation is not applied. A JPEG
that is stored as JPEG and that libjpeg-turbo decodes as it is (see
:class:`~stoker.fields.RGBImageField`) is copied byte for byte instead: it
decodes to the same pixels, without a second compression (``reencode=True``
decodes and re-encodes every image).

The file holds the fields ``image`` (:class:`~stoker.fields.RGBImageField`)
and ``label`` (:class:`~stoker.fields.IntField`); the class names go to a
sidecar ``<dst>.classes.json`` (``{"classes": [...]}``, index = label),
written after the dataset and, like it, atomically (temporary, fsync, rename,
fsync of the folder).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from stoker._progress import progress_bar
from stoker._threads import available_cpus
from stoker.errors import SampleError

if TYPE_CHECKING:
    from stoker.fields import RGBImageField

#: file extensions recognised as images (compared case-insensitively), as torchvision's ``IMG_EXTENSIONS``
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

#: suffix of the sidecar file holding the class names
CLASSES_SUFFIX = ".classes.json"


def find_images(root: str | os.PathLike[str]) -> tuple[list[tuple[Path, int]], list[str]]:
    """List the images of a class-per-folder tree.

    Args:
        root: the folder whose sub-folders are the classes.

    Returns:
        ``(samples, classes)``: ``(path, label)`` pairs ordered by class then
        path, and the class names sorted, ``classes[label]`` naming a label.

    Raises:
        FileNotFoundError: ``root`` does not exist, has no sub-folders, or a
            class folder holds no image.
        NotADirectoryError: ``root`` is not a folder.
        ValueError: ``root`` holds image files directly.
    """
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"{root} does not exist; give the folder that holds one sub-folder per class")
    if not root.is_dir():
        raise NotADirectoryError(f"{root} is not a folder; give the folder that holds one sub-folder per class")
    entries = [entry for entry in os.scandir(root) if not entry.name.startswith(".")]
    loose = sorted(e.name for e in entries if e.name.lower().endswith(IMG_EXTENSIONS) and not e.is_dir())
    if loose:
        shown = ", ".join(loose[:3]) + (f" and {len(loose) - 3} more" if len(loose) > 3 else "")
        raise ValueError(
            f"{root} holds images directly ({shown}); give the folder whose sub-folders are the classes "
            f"(SRC/<class>/<image>): move the images into class folders, or pass the folder above {root} if it is a class"
        )
    classes = sorted(entry.name for entry in entries if entry.is_dir())
    if not classes:
        raise FileNotFoundError(f"{root} has no sub-folders; images must be in one sub-folder per class, like {root}/cat/001.jpg")
    samples: list[tuple[Path, int]] = []
    empty: list[str] = []
    for label, name in enumerate(classes):
        found: list[tuple[str, str]] = []
        for folder, dirs, files in os.walk(root / name, followlinks=True):
            dirs[:] = [d for d in dirs if not d.startswith(".")]  # os.walk does not descend into the removed ones
            found += [(folder, f) for f in files if f.lower().endswith(IMG_EXTENSIONS) and not f.startswith(".")]
        samples += [(Path(folder) / fname, label) for folder, fname in sorted(found)]
        if not found:
            empty.append(name)
    if empty:
        shown = ", ".join(empty[:5]) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
        raise FileNotFoundError(
            f"{root}: no image in the class folder(s) {shown}; every class needs at least one file ending in {', '.join(IMG_EXTENSIONS)}"
        )
    return samples, classes


def load_image(path: str | os.PathLike[str]) -> np.ndarray:
    """Decode an image file with Pillow to an HWC uint8 RGB array (torchvision's ``convert('RGB')``).

    Raises:
        Exception: whatever Pillow raises for a file it cannot read
            (``PIL.UnidentifiedImageError``, ``OSError`` for a truncated file, ...).
    """
    from stoker.fields.rgb_image import open_rgb

    return open_rgb(path)


def image_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot be decoded, in a few words, or ``None`` when it can."""
    from PIL import UnidentifiedImageError

    try:
        load_image(path)
    except UnidentifiedImageError:
        return "not an image that Pillow can identify"
    except Exception as exc:  # Pillow raises many types for broken files (OSError, SyntaxError, ValueError, ...)
        return f"{type(exc).__name__}: {exc}"
    return None


class ImageFolderDataset:
    """An indexed dataset over ``(path, label)`` pairs: ``dataset[i]`` is ``(image, label)``.

    Args:
        samples: ``(path, label)`` pairs, as :func:`find_images` returns them.
        decode: the image is decoded by :func:`load_image` (HWC uint8 RGB);
            with ``False`` it is the file's path, which
            :class:`~stoker.fields.RGBImageField` reads, storing a JPEG as it
            is where it can and decoding other files as :func:`load_image` does.
    """

    def __init__(self, samples: list[tuple[Path, int]], decode: bool = True) -> None:
        self.samples = [(p if isinstance(p, Path) else Path(p), int(label)) for p, label in samples]
        self.decode = decode

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[np.ndarray | Path, int]:
        path, label = self.samples[index]
        return (load_image(path) if self.decode else path), label


#: images read (spread evenly over the folder) to choose where ``num_workers=-1`` converts: processes only
#: where some need decoding (see :func:`convert_image_folder`)
SAMPLED_FOR_WORKERS = 32


def _all_stored_as_is(samples: list[tuple[Path, int]], image_field: RGBImageField) -> bool:
    """Whether the images sampled evenly over ``samples`` are all files that ``image_field`` stores as they are."""
    step = max(1, len(samples) // SAMPLED_FOR_WORKERS)
    for pos in range(0, len(samples), step)[:SAMPLED_FOR_WORKERS]:
        try:
            data = samples[pos][0].read_bytes()
        except OSError:
            return False  # the conversion says what is wrong with it
        if not image_field.stores_as_is(data, pos):
            return False
    return True


@dataclass(frozen=True)
class ConversionSummary:
    """What :func:`convert_image_folder` wrote.

    Attributes:
        path: the stoker file.
        classes_path: the sidecar JSON file with the class names.
        images: samples written.
        bytes: size of the stoker file [bytes].
        classes: class names, ``classes[label]``.
        skipped: ``(path, reason)`` of each unreadable image left out (``skip_bad``).
    """

    path: Path
    classes_path: Path
    images: int
    bytes: int
    classes: list[str]
    skipped: list[tuple[Path, str]] = field(default_factory=list)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's handler: Pool.terminate() must end the worker


def _problem_at(task: tuple[int, Path]) -> tuple[int, str | None]:
    return task[0], image_problem(task[1])


def find_bad_images(paths: list[Path], num_workers: int = -1, progress: bool | None = None) -> list[tuple[int, str]]:
    """Decode every image (in parallel processes) and return ``(position, reason)`` of those that fail.

    Args:
        paths: the image files.
        num_workers: processes; ``-1`` for one per CPU, ``0``/``1`` for this process.
        progress: show a progress bar; ``None`` shows it only on a terminal.
    """

    if num_workers == -1:
        num_workers = available_cpus()
    tasks = list(enumerate(paths))
    bad: list[tuple[int, str]] = []
    with contextlib.ExitStack() as stack:
        results: Iterator[tuple[int, str | None]] = map(_problem_at, tasks)
        if num_workers > 1 and len(tasks) > 1:
            method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
            pool = mp.get_context(method).Pool(min(num_workers, len(tasks)), initializer=_ignore_sigint)
            stack.enter_context(pool)  # leaving terminates the workers, also on an error or Ctrl-C
            results = pool.imap_unordered(_problem_at, tasks, chunksize=max(1, min(64, len(tasks) // (4 * num_workers))))
        bar = stack.enter_context(progress_bar(len(tasks), "images", "checking images", progress))
        for pos, problem in results:
            if problem is not None:
                bad.append((pos, problem))
            bar.update(1)
    return sorted(bad)


def convert_image_folder(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    write_mode: str = "smart",
    max_resolution: int | None = None,
    jpeg_quality: int = 90,
    compress_probability: float = 0.5,
    num_workers: int = -1,
    skip_bad: bool = False,
    chunksize: int = 32,
    progress: bool | None = None,
    reencode: bool = False,
) -> ConversionSummary:
    """Write the images of a class-per-folder tree to a stoker file with fields ``image`` and ``label``.

    Args:
        src: the folder with one sub-folder per class (see :func:`find_images`).
        dst: the stoker file to write (replaced if it exists); the class names
            go to ``dst + '.classes.json'``.
        write_mode, max_resolution, jpeg_quality, compress_probability: the
            :class:`~stoker.fields.RGBImageField` options.
        num_workers: decoding and encoding processes; ``-1`` (the default) for
            one per CPU, or none when the images sampled across the folder
            (:data:`SAMPLED_FOR_WORKERS`) are all JPEGs stored as they are: such
            a conversion reads and copies files, which processes only slow down
            (their bytes come back through a pipe), so it runs in this process.
        skip_bad: decode every image first and leave out (and list) those that
            fail, instead of stopping at the first one. Decodes each image twice.
        chunksize: images per task sent to a worker.
        progress: show progress bars; ``None`` shows them only on a terminal.
        reencode: decode every image and encode it again, even a JPEG that
            could be stored as it is.

    Returns:
        A :class:`ConversionSummary`.

    Raises:
        FileNotFoundError, NotADirectoryError: ``src`` is not an image tree, or
            the folder of ``dst`` does not exist.
        IsADirectoryError: ``dst`` is a folder.
        ValueError: a field option is out of range, or ``src`` holds images directly.
        SampleError: an image cannot be read (without ``skip_bad``); the
            message names the file. Nothing is written at ``dst``.
    """
    from stoker.fields import IntField, RGBImageField
    from stoker.format._durable import write_file_atomically
    from stoker.format.writer import DatasetWriter

    dst = Path(dst)
    image_field = RGBImageField(
        write_mode=write_mode, max_resolution=max_resolution, jpeg_quality=jpeg_quality, compress_probability=compress_probability
    )
    if dst.is_dir():
        raise IsADirectoryError(f"{dst} is a folder; give a file path for the dataset, like {dst / 'train.stoker'}")
    if not dst.parent.is_dir():
        raise FileNotFoundError(f"the folder {dst.parent} does not exist; create it first")
    samples, classes = find_images(src)
    skipped: list[tuple[Path, str]] = []
    if skip_bad:
        bad = find_bad_images([p for p, _ in samples], num_workers=num_workers, progress=progress)
        skipped = [(samples[pos][0], reason) for pos, reason in bad]
        drop = {pos for pos, _ in bad}
        samples = [s for pos, s in enumerate(samples) if pos not in drop]
        if not samples:
            raise FileNotFoundError(f"{src}: none of the {len(drop)} images could be read; the first: {skipped[0][0]}: {skipped[0][1]}")
    if num_workers == -1 and not reencode and _all_stored_as_is(samples, image_field):
        num_workers = 1  # reading and copying files: worker processes would only send the bytes back through a pipe
    writer = DatasetWriter(dst, {"image": image_field, "label": IntField()}, num_workers=num_workers, progress=progress)
    try:
        writer.from_indexed_dataset(ImageFolderDataset(samples, decode=reencode), chunksize=chunksize)
    except SampleError as exc:
        if not 0 <= exc.index < len(samples):
            raise
        path = samples[exc.index][0]
        problem = image_problem(path) or exc.problem
        hint = "fix or delete the file, or skip unreadable images with skip_bad=True (stoker convert: --skip-bad)"
        raise SampleError(exc.index, exc.field or "image", f"cannot convert {path}: {problem}; {hint}") from exc
    classes_path = dst.with_name(dst.name + CLASSES_SUFFIX)
    write_file_atomically(classes_path, (json.dumps({"classes": classes}, indent=1) + "\n").encode("utf-8"))
    return ConversionSummary(
        path=dst, classes_path=classes_path, images=len(samples), bytes=dst.stat().st_size, classes=classes, skipped=skipped
    )
