"""``stoker inspect PATH``: what a stoker file, a folder of shards or a dataset in object storage holds, and optionally whether it is intact.

Prints the path, format version, sample count, file size and one row per
field (name, type, args, storage, bytes); for each image field, the image
sizes (min, median, max of height and width) and how many are stored raw and
as JPEG; and the class names of a dataset written by ``stoker convert
imagefolder`` (its ``FILE.classes.json``). For a folder of shards, the
dataset its manifest lists: the manifest, the shard count, the samples and
bytes of all shards, and one row per shard (name, first sample, samples,
file size). PATH may be the URL of a dataset in object storage
(``s3://bucket/train/``, ``gs://``, ``az://``, ``https://``): its manifest and
shards' heads are read (credentials as for ``Loader``). ``--verify`` also
checks every checksum (for a URL: each shard is downloaded into the cache and
checked). Errors print one line to stderr and exit with code 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

_UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB")
#: class names shown before "... and N more"
_CLASSES_SHOWN = 20
#: shards listed before "... and N more"
_SHARDS_SHOWN = 20


def human_size(n: int) -> str:
    """``1536`` -> ``'1,536 bytes (1.5 KiB)'``."""
    exact = f"{n:,} bytes"
    value, unit = float(n), 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return exact if unit == 0 else f"{exact} ({value:.1f} {_UNITS[unit]})"


def _format_args(args: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in args.items()) or "-"


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> str:
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]

    def line(row: list[str]) -> str:
        cells = [cell.rjust(w) if c in right else cell.ljust(w) for c, (cell, w) in enumerate(zip(row, widths))]
        return "  ".join(cells).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def image_lines(reader: Any, name: str) -> list[str]:
    """The lines describing the images of the ``rgb_image`` field ``name``: sizes and storage modes.

    Reads the field's metadata (height, width, mode), once its checksums are checked, not the images.

    Raises:
        DatasetFormatError: the metadata table is corrupt.
    """
    import numpy as np

    from stoker.fields.rgb_image import MODE_JPEG, MODE_RAW

    if len(reader) == 0:
        return [f"images '{name}': none"]
    reader.validate_metadata()  # (its checksums first: no figure from a corrupt table)
    meta = reader.metadata
    modes = np.bincount(np.asarray(meta[f"{name}/mode"]), minlength=256)
    counts = f"{modes[MODE_JPEG]:,} jpg, {modes[MODE_RAW]:,} raw"
    other = int(modes.sum() - modes[MODE_JPEG] - modes[MODE_RAW])
    lines = [f"images '{name}': {len(reader):,} ({counts}{f', {other:,} of an invalid mode' if other else ''})"]
    for side in ("height", "width"):
        values = np.asarray(meta[f"{name}/{side}"])
        median = float(np.median(values))
        shown = f"{median:,.0f}" if median.is_integer() else f"{median:,.1f}"
        lines.append(f"  {side + ':':<8}min {int(values.min()):,}, median {shown}, max {int(values.max()):,} pixels")
    return lines


def class_lines(reader: Any, path: Path) -> list[str]:
    """The class names of the sidecar ``path.classes.json`` (``stoker convert imagefolder``), with the images per class
    when the file has an integer ``label`` field; no line without a sidecar."""
    import numpy as np

    from stoker.convert.imagefolder import CLASSES_SUFFIX

    sidecar = path.with_name(path.name + CLASSES_SUFFIX)
    if not sidecar.is_file():
        return []
    try:
        classes = json.loads(sidecar.read_text("utf-8"))["classes"]
        if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
            raise ValueError("'classes' is not a list of names")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"classes:  unreadable ({sidecar}: {exc})"]
    label = reader.fields.get("label")
    per_class = None
    if label is not None and label.TYPE_NAME == "int" and len(reader):
        reader.validate_metadata()
        values = np.asarray(reader.metadata["label/value"])
        if values.min() >= 0 and values.max() < len(classes):
            per_class = np.bincount(values, minlength=len(classes))
    names = [f"{c} ({per_class[i]:,})" if per_class is not None else c for i, c in enumerate(classes[:_CLASSES_SHOWN])]
    more = f", ... and {len(classes) - _CLASSES_SHOWN:,} more" if len(classes) > _CLASSES_SHOWN else ""
    return [f"classes:  {len(classes):,} from {sidecar.name}: {', '.join(names)}{more}"]


def _field_table(reader: Any) -> str:
    sizes = reader.field_sizes()
    rows = [
        [name, field.TYPE_NAME, _format_args(field.to_args()), field.storage, f"{sizes[name]:,}"] for name, field in reader.fields.items()
    ]
    return _table(["field", "type", "args", "storage", "bytes"], rows, right={4})


def _extra_lines(reader: Any, path: Path) -> list[str]:
    """The classes and image lines, after a blank line; nothing when there are none."""
    extra = class_lines(reader, path)
    for name, field in reader.fields.items():
        if field.TYPE_NAME == "rgb_image":
            extra += image_lines(reader, name)
    return ["", *extra] if extra else []


def describe(path: Path | str, verify: bool = False) -> str:
    """The text that ``stoker inspect`` prints for ``path``, a stoker file, a folder of shards or a dataset's URL.

    Raises:
        DatasetFormatError: the file cannot be read, is not a valid stoker
            file, or (with ``verify``) a checksum does not match.
        RemoteError: a URL's store cannot be read.
    """
    from stoker.remote._store import is_url

    if is_url(path):
        return describe_url(str(path), verify)
    path = Path(path)
    if path.is_dir():
        return describe_folder(path, verify)
    from stoker.format.reader import Reader

    with Reader(path) as reader:
        lines = [
            f"path:           {reader.path.resolve()}",
            f"format version: {reader.version}",
            f"samples:        {len(reader):,}",
            f"file size:      {human_size(reader.file_size)}",
            "",
            _field_table(reader),
            *_extra_lines(reader, path),
        ]
        if verify:
            reader.verify()
            lines += ["", "all checksums OK"]
    return "\n".join(lines)


def describe_folder(path: Path, verify: bool = False) -> str:
    """The text that ``stoker inspect`` prints for a folder of shards: the dataset its manifest lists.

    Raises:
        DatasetFormatError: the folder holds no dataset, a shard is missing or
            corrupt, or (with ``verify``) a checksum does not match.
    """
    from contextlib import closing

    from stoker.dataset.sharded import open_dataset
    from stoker.dataset.shards import MANIFEST_NAME

    dataset: Any = open_dataset(path)  # a Reader when the folder holds one shard
    with closing(dataset):
        shards = list(getattr(dataset, "shards", [dataset]))
        versions = ", ".join(str(v) for v in sorted({s.version for s in shards}))
        manifest = MANIFEST_NAME if (path / MANIFEST_NAME).is_file() else f"none (no {MANIFEST_NAME}: the *.stoker files in name order)"
        starts = [0]
        for shard in shards:
            starts.append(starts[-1] + len(shard))
        rows = [
            [shard.path.name, f"{first:,}", f"{len(shard):,}", f"{shard.file_size:,}"]
            for shard, first in zip(shards[:_SHARDS_SHOWN], starts)
        ]
        more = [f"... and {len(shards) - _SHARDS_SHOWN:,} more shards"] if len(shards) > _SHARDS_SHOWN else []
        lines = [
            f"path:           {path.resolve()}",
            f"manifest:       {manifest}",
            f"format version: {versions}",
            f"shards:         {len(shards):,}",
            f"samples:        {len(dataset):,}",
            f"total size:     {human_size(sum(s.file_size for s in shards))}",
            "",
            _field_table(dataset),
            "",
            _table(["shard", "first sample", "samples", "file size"], rows, right={1, 2, 3}),
            *more,
            *_extra_lines(dataset, path),
        ]
        if verify:
            dataset.verify()
            lines += ["", "all checksums OK"]
    return "\n".join(lines)


def describe_url(url: str, verify: bool = False) -> str:
    """The text that ``stoker inspect`` prints for the dataset at ``url`` in object storage: its manifest, shards and fields.

    Raises:
        RemoteError: the store or the manifest cannot be read.
        DatasetFormatError: the manifest or a shard's head is corrupt, or (with
            ``verify``) a shard's checksum does not match.
    """
    from contextlib import closing

    from stoker.dataset._remote import open_remote
    from stoker.dataset.shards import MANIFEST_NAME

    dataset = open_remote(url)
    with closing(dataset):
        dataset.read_heads()  # (an open reads the first; inspect shows every shard's)
        remote = dataset.remote
        shards = list(dataset.shards)
        versions = ", ".join(str(v) for v in sorted({s.version for s in shards}))
        rows = [
            [name, f"{first:,}", f"{len(shard):,}", f"{size:,}"]
            for name, shard, first, size in zip(remote.names[:_SHARDS_SHOWN], shards, dataset.shard_starts, remote.sizes)
        ]
        more = [f"... and {len(shards) - _SHARDS_SHOWN:,} more shards"] if len(shards) > _SHARDS_SHOWN else []
        generation = f" (generation {remote.generation})" if remote.generation else ""
        lines = [
            f"url:            {remote.url}",
            f"manifest:       {MANIFEST_NAME}{generation}",
            f"format version: {versions}",
            f"shards:         {len(shards):,}",
            f"samples:        {len(dataset):,}",
            f"total size:     {human_size(sum(remote.sizes))}",
            "",
            _field_table(dataset),
            "",
            _table(["shard", "first sample", "samples", "file size"], rows, right={1, 2, 3}),
            *more,
        ]
        extra = [line for name, field in dataset.fields.items() if field.TYPE_NAME == "rgb_image" for line in image_lines(dataset, name)]
        lines += ["", *extra] if extra else []
        if verify:
            for name, size in zip(remote.names, remote.sizes):
                remote.cache.pin(name, size)  # downloaded (or found in the cache), and every checksum checked
                remote.cache.unpin(name)
            lines += ["", f"all checksums OK ({len(shards):,} shards checked, cache {remote.cache_dir})"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Print the description of ``args.file``; 1 with a one-line message on error."""
    from stoker.cli._errors import error_message
    from stoker.errors import DatasetFormatError, RemoteError
    from stoker.remote._store import is_url

    try:
        text = describe(args.file if is_url(args.file) else Path(args.file), verify=args.verify)
    except (DatasetFormatError, RemoteError, OSError) as exc:
        print(f"stoker inspect: error: {error_message(exc, reading=args.file)}", file=sys.stderr)
        return 1
    print(text)
    return 0


def register(subparsers: Any) -> None:
    """Add the ``inspect`` sub-command to a ``stoker`` argument parser.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers()`` returned.
    """
    parser = subparsers.add_parser(
        "inspect",
        help="describe a stoker file, a folder of shards or a dataset in object storage (fields, sizes) and optionally verify it",
        description=__doc__.split("\n\n")[1],
    )
    parser.add_argument(
        "file", metavar="PATH", help="the stoker file, the folder of shards (with its manifest), or a dataset's URL (s3://...), to describe"
    )
    parser.add_argument("--verify", action="store_true", help="also check every checksum (reads the whole file)")
    parser.set_defaults(func=run)
