"""Datasets made of several stoker files ("shards") read as one.

A sharded dataset is a folder holding stoker files with the same fields and,
written last, a small manifest (:data:`MANIFEST_NAME`) listing the shards in
order with their sample counts, sizes and header checksums, and a hash of the
field table. A folder without a manifest, a list of files or a glob pattern
also name a dataset: their files are taken in the order given (sorted for a
folder or a glob).

Manifest (UTF-8 JSON, written atomically: temporary file, fsync, rename)::

    {"stoker_manifest": 1,
     "fields_sha256": "<sha256 of the field table without column offsets>",
     "num_samples": 30000,
     "shards": [{"name": "shard-00000.stoker", "num_samples": 10000,
                 "file_size": 1234567, "header_crc": 305419896}, ...]}

Shard names are relative to the manifest's folder.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stoker.errors import DatasetFormatError
from stoker.format import spec
from stoker.format._durable import write_file_atomically

__all__ = [
    "MANIFEST_NAME",
    "ShardInfo",
    "fields_hash",
    "read_manifest",
    "resolve_dataset",
    "shard_info",
    "write_manifest",
]

#: the manifest's file name inside a sharded dataset's folder
MANIFEST_NAME = "manifest.stoker.json"
MANIFEST_VERSION = 1
_GLOB_CHARS = set("*?[")


@dataclass(frozen=True)
class ShardInfo:
    """One shard as the manifest records it (read from its header)."""

    path: Path
    num_samples: int
    file_size: int
    header_crc: int
    fields_sha256: str


def fields_hash(table: Sequence[dict[str, Any]]) -> str:
    """The sha256 of a field table (list of ``{"name", "type", "args", ...}``), column offsets left out."""
    canonical = [{"name": e["name"], "type": e["type"], "args": e["args"]} for e in table]
    return hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def shard_info(path: str | os.PathLike[str]) -> ShardInfo:
    """Read a shard's header and field table (nothing else) and check their checksums.

    Raises:
        DatasetFormatError: the file is missing, not a stoker file, or corrupt.
    """
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            head = fh.read(spec.HEADER_SIZE)
            if len(head) < spec.HEADER_SIZE or head[: len(spec.MAGIC)] != spec.MAGIC:
                raise DatasetFormatError(p, "not a stoker dataset (no stoker header)")
            h = np.frombuffer(head, dtype=spec.HEADER_DTYPE)[0]
            if spec.crc32(head[:252]) != int(h["header_crc"]):
                raise DatasetFormatError(p, "corrupt header: its checksum does not match")
            fh.seek(int(h["field_table_offset"]))
            raw = fh.read(int(h["field_table_size"]))
        size = p.stat().st_size
    except FileNotFoundError as exc:
        raise DatasetFormatError(p, "shard is missing") from exc
    except OSError as exc:
        raise DatasetFormatError(p, f"cannot be read: {exc.strerror or exc}") from exc
    if spec.crc32(raw) != int(h["field_table_crc"]):
        raise DatasetFormatError(p, "corrupt field table: its checksum does not match")
    table = json.loads(raw.decode("utf-8"))["fields"]
    return ShardInfo(p, int(h["num_samples"]), size, int(h["header_crc"]), fields_hash(table))


def write_manifest(directory: str | os.PathLike[str], shards: Sequence[str | os.PathLike[str]]) -> Path:
    """Write ``directory``'s manifest listing ``shards`` in this order (atomically, last).

    Every shard must lie in ``directory`` and have the same fields as the first.

    Returns:
        The manifest's path.

    Raises:
        DatasetFormatError: a shard is missing, corrupt, outside the folder, or
            has other fields than the first shard (both named).
    """
    folder = Path(directory)
    if not shards:
        raise ValueError(f"write_manifest({str(folder)!r}): no shards given")
    infos = [shard_info(s if Path(s).is_absolute() else folder / Path(s).name) for s in shards]
    first = infos[0]
    entries = []
    for info in infos:
        if info.path.resolve().parent != folder.resolve():
            raise DatasetFormatError(info.path, f"a shard must lie in the manifest's folder {folder}")
        if info.fields_sha256 != first.fields_sha256:
            raise DatasetFormatError(info.path, f"has other fields than the first shard {first.path.name}")
        entries.append(
            {"name": info.path.name, "num_samples": info.num_samples, "file_size": info.file_size, "header_crc": info.header_crc}
        )
    manifest = {
        "stoker_manifest": MANIFEST_VERSION,
        "fields_sha256": first.fields_sha256,
        "num_samples": sum(i.num_samples for i in infos),
        "shards": entries,
    }
    path = folder / MANIFEST_NAME
    write_file_atomically(path, json.dumps(manifest, indent=1).encode())
    return path


def read_manifest(directory: str | os.PathLike[str]) -> list[ShardInfo]:
    """The shards listed in ``directory``'s manifest, each checked against its file's header.

    Raises:
        DatasetFormatError: the manifest is corrupt or of another version, or a
            shard is missing, was rewritten (size or header checksum differ) or
            has other fields (names the shard).
    """
    folder = Path(directory)
    path = folder / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text("utf-8"))
        version = manifest["stoker_manifest"]
        entries = manifest["shards"]
        expected_fields = manifest["fields_sha256"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DatasetFormatError(path, f"not a readable stoker manifest: {exc}") from exc
    if version != MANIFEST_VERSION:
        raise DatasetFormatError(path, f"manifest version {version}; this stoker reads version {MANIFEST_VERSION}")
    infos = []
    for entry in entries:
        info = shard_info(folder / entry["name"])
        if info.file_size != entry["file_size"] or info.header_crc != entry["header_crc"] or info.num_samples != entry["num_samples"]:
            raise DatasetFormatError(
                info.path,
                f"shard differs from the manifest {path.name} (size {info.file_size} vs {entry['file_size']}, "
                f"samples {info.num_samples} vs {entry['num_samples']}): it was rewritten after the manifest",
            )
        if info.fields_sha256 != expected_fields:
            raise DatasetFormatError(info.path, f"shard has other fields than the manifest {path.name} records")
        infos.append(info)
    if not infos:
        raise DatasetFormatError(path, "the manifest lists no shards")
    return infos


def resolve_dataset(source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[Path]:
    """The files that make up a dataset named by a file, a folder, a glob pattern or a list of files.

    A folder with a manifest gives the manifest's shards (checked); a folder
    without one gives its ``*.stoker`` files, sorted by name. A glob pattern
    gives its matches, sorted.

    Raises:
        DatasetFormatError: nothing matches, or a folder holds no stoker files.
    """
    if isinstance(source, (list, tuple)):
        if not source:
            raise ValueError("an empty list of dataset files")
        return [Path(s) for s in source]
    text = os.fspath(source)  # type: ignore[arg-type]
    path = Path(text)
    if path.is_dir():
        if (path / MANIFEST_NAME).exists():
            return [i.path for i in read_manifest(path)]
        files = sorted(p for p in path.iterdir() if p.suffix == ".stoker" and p.is_file())
        if not files:
            raise DatasetFormatError(path, f"a folder with no {MANIFEST_NAME} and no *.stoker files")
        return files
    if not path.exists() and _GLOB_CHARS & set(text):
        matches = sorted(Path(m) for m in glob.glob(text))
        if not matches:
            raise DatasetFormatError(path, "the pattern matches no file")
        return matches
    return [path]
