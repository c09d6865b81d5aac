"""The manifest of a folder dataset: its layout, how it is built from shard files, and how it is read back.

A folder dataset is the shards that its manifest, ``manifest.stoker.json``,
lists, in that order; nothing else in the folder is part of it. The manifest
(UTF-8 JSON)::

    {"stoker_manifest": 1,
     "generation": "1f0c9a3e",
     "fields_sha256": "<sha256 of the field table without column offsets>",
     "num_samples": 30000,
     "shards": [{"name": "shard-g1f0c9a3e-00000.stoker", "num_samples": 10000,
                 "file_size": 1234567, "header_crc": 305419896, "head": {...}}, ...]}

``head`` (optional) records what a reader plans from before it reads the
shard's head (its layout and a few samples' sizes; see
:mod:`stoker.dataset._head_record`): a dataset in object storage is opened
with one head read, the others as batches first need them. Every writer
records it; a manifest without it (an older stoker's, or a shard whose
sizes make no short record) is read as before, every such head at open.
Readers of manifest version 1 ignore keys they do not know, so the key
needs no new version. Shard names are relative to the manifest's folder. ``generation`` names the
write that made the shards (see :mod:`stoker.dataset._transaction`); it is
absent from manifests written by :func:`~stoker.dataset.shards.write_manifest`
for files named by hand, and from those of stoker versions before generations
(whose shards are ``shard-00000.stoker``, ...): both read the same way.

A manifest in an object store may also list the generations it replaced
that are kept for the jobs still reading them (a store has no open files:
see :mod:`stoker.dataset._remote_transaction`); readers ignore it::

     "retired": [{"generation": "0b7d2c11", "since": 1764000000.0,
                  "shards": ["shard-g0b7d2c11-00000.stoker", ...]}, ...]

``since`` is when the generation was replaced [seconds since 1970, UTC].
Every value is checked when a manifest is read (:func:`parse_manifest`).

How the manifest is written (last, by renaming a complete file into place) is
the transaction's business, not this module's.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stoker.dataset._head_record import head_record, record_problem
from stoker.errors import DatasetFormatError
from stoker.format import spec
from stoker.format.reader import Reader

#: the manifest's file name inside a sharded dataset's folder
MANIFEST_NAME = "manifest.stoker.json"
MANIFEST_VERSION = 1


@dataclass(frozen=True)
class ShardInfo:
    """One shard as the manifest records it (read from its header)."""

    path: Path
    num_samples: int
    file_size: int
    header_crc: int
    fields_sha256: str
    #: the manifest's ``head`` record of the shard (see :mod:`stoker.dataset._head_record`), or ``None``
    head: dict[str, Any] | None = None


def fields_hash(table: Sequence[dict[str, Any]]) -> str:
    """The sha256 of a field table (list of ``{"name", "type", "args", ...}``), column offsets left out."""
    canonical = [{"name": e["name"], "type": e["type"], "args": e["args"]} for e in table]
    return hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def shard_info(path: str | os.PathLike[str], record: bool = False) -> ShardInfo:
    """Read a shard's header and field table (nothing else) and check their checksums; with ``record``, its metadata too
    (validated) for the manifest's ``head`` record (``None`` for a shard of a field type this stoker does not know).

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
    kept = None
    if record:
        try:
            with Reader(p) as reader:
                reader.validate_metadata()
                kept = head_record(reader)
        except DatasetFormatError as exc:
            if "unknown field type" not in exc.problem:
                raise
    return ShardInfo(p, int(h["num_samples"]), size, int(h["header_crc"]), fields_hash(table), kept)


def build_manifest(directory: str | os.PathLike[str], shards: Sequence[str | os.PathLike[str]], generation: str | None) -> bytes:
    """The manifest listing ``shards`` in this order, each read and checked (its header, its fields).

    Raises:
        ValueError: no shards.
        DatasetFormatError: a shard is missing, corrupt, outside the folder, or
            has other fields than the first shard (both named).
    """
    folder = Path(directory)
    if not shards:
        raise ValueError(f"a manifest for {str(folder)!r}: no shards given")
    infos = [shard_info(s if Path(s).is_absolute() else folder / Path(s).name, record=True) for s in shards]
    for info in infos:
        if info.path.resolve().parent != folder.resolve():
            raise DatasetFormatError(info.path, f"a shard must lie in the manifest's folder {folder}")
    return manifest_bytes(infos, generation)


def manifest_bytes(infos: Sequence[ShardInfo], generation: str | None, retired: Sequence[Mapping[str, Any]] = ()) -> bytes:
    """The manifest listing the shards ``infos`` describe, in this order (by their file names).

    :func:`build_manifest` reads ``infos`` from a folder's files; a writer to
    an object store records them before it uploads each shard, and the
    generations it replaced and keeps for their readers (``retired``: see
    the module).

    Raises:
        ValueError: no shards.
        DatasetFormatError: a shard has other fields than the first (both named).
    """
    if not infos:
        raise ValueError("a manifest needs at least one shard")
    first = infos[0]
    entries = []
    for info in infos:
        if info.fields_sha256 != first.fields_sha256:
            raise DatasetFormatError(info.path, f"has other fields than the first shard {first.path.name}")
        entry: dict[str, Any] = {"name": info.path.name, "num_samples": info.num_samples, "file_size": info.file_size,
                                 "header_crc": info.header_crc}  # fmt: skip
        if info.head is not None:
            entry["head"] = info.head
        entries.append(entry)
    manifest: dict[str, Any] = {"stoker_manifest": MANIFEST_VERSION}
    if generation is not None:
        manifest["generation"] = generation
    manifest.update(fields_sha256=first.fields_sha256, num_samples=sum(i.num_samples for i in infos), shards=entries)
    if retired:
        manifest["retired"] = [dict(r) for r in retired]
    return json.dumps(manifest, indent=1).encode()


#: the largest shard a manifest may declare [bytes] (256 TiB: larger is a corrupt or hostile manifest)
MAX_FILE_SIZE = 1 << 48
_HEX8 = re.compile(r"[0-9a-f]{8}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def _int_in(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def check_shard_name(name: object) -> str | None:
    """Why ``name`` is not a shard's file name in the manifest's folder (``None``: it is one).

    A name is relative to the manifest's folder: one path component, no
    control character (NUL included: object stores refuse them in keys), no
    separator, not ``.`` or ``..``, at most 255 bytes of UTF-8.
    """
    if not isinstance(name, str):
        return f"expected a file name (a string); got {type(name).__name__} {name!r:.60}"
    if not name or name in (".", "..") or "/" in name or "\\" in name or any(c < " " or c == "\x7f" for c in name):
        return f"expected a file name in the manifest's folder (no '/', '\\', NUL or other control character, not '.' or '..'); got {name!r:.80}"
    if len(name.encode("utf-8", "surrogatepass")) > 255:
        return f"expected a file name of at most 255 bytes; got one of {len(name.encode('utf-8', 'surrogatepass'))}"
    return None


def _check_manifest(manifest: object, where: str) -> dict[str, Any]:
    """``manifest`` (parsed JSON) with every value checked: its types and ranges (see the module's layout)."""

    def bad(field: str, problem: str) -> DatasetFormatError:
        return DatasetFormatError(where, f"not a valid stoker manifest: field {field!r}: {problem}")

    if not isinstance(manifest, dict):
        raise DatasetFormatError(where, f"not a valid stoker manifest: expected a JSON object; got {type(manifest).__name__}")
    if "stoker_manifest" not in manifest:
        raise bad("stoker_manifest", "missing (not a stoker manifest)")
    version = manifest["stoker_manifest"]
    if version != MANIFEST_VERSION or isinstance(version, bool):
        raise DatasetFormatError(where, f"manifest version {version!r:.40}; this stoker reads version {MANIFEST_VERSION}")
    fields_sha256 = manifest.get("fields_sha256")
    if not isinstance(fields_sha256, str) or not _HEX64.fullmatch(fields_sha256):
        raise bad("fields_sha256", f"expected 64 hex digits; got {fields_sha256!r:.80}")
    generation = manifest.get("generation")
    if generation is not None and (not isinstance(generation, str) or not _HEX8.fullmatch(generation)):
        raise bad("generation", f"expected 8 hex digits; got {generation!r:.40}")
    shards = manifest.get("shards")
    if not isinstance(shards, list):
        raise bad("shards", f"expected a list of shards; got {type(shards).__name__}")
    seen: set[str] = set()
    total = 0
    for k, entry in enumerate(shards):
        if not isinstance(entry, dict):
            raise bad(f"shards[{k}]", f"expected an object; got {type(entry).__name__}")
        for key in ("name", "num_samples", "file_size", "header_crc"):
            if key not in entry:
                raise bad(f"shards[{k}].{key}", "missing")
        problem = check_shard_name(entry["name"])
        if problem is not None:
            raise bad(f"shards[{k}].name", problem)
        if entry["name"] in seen:
            raise bad(f"shards[{k}].name", f"{entry['name']!r} is listed twice")
        seen.add(entry["name"])
        if not _int_in(entry["num_samples"], 0, 1 << 48):
            raise bad(f"shards[{k}].num_samples", f"expected an int >= 0; got {entry['num_samples']!r:.40}")
        if not _int_in(entry["file_size"], spec.HEADER_SIZE, MAX_FILE_SIZE):
            raise bad(f"shards[{k}].file_size", f"expected an int from {spec.HEADER_SIZE} to 2**48 [bytes]; got {entry['file_size']!r:.40}")
        if not _int_in(entry["header_crc"], 0, 0xFFFFFFFF):
            raise bad(f"shards[{k}].header_crc", f"expected a CRC-32 (an int from 0 to 2**32 - 1); got {entry['header_crc']!r:.40}")
        if "head" in entry and (problem := record_problem(entry["head"], entry["num_samples"], entry["file_size"])) is not None:
            raise bad(f"shards[{k}].head", problem)
        total += entry["num_samples"]
    if "num_samples" in manifest and (not _int_in(manifest["num_samples"], 0, 1 << 63) or manifest["num_samples"] != total):
        raise bad("num_samples", f"expected the sum of the shards' num_samples, {total}; got {manifest['num_samples']!r:.40}")
    retired = manifest.get("retired", [])
    if not isinstance(retired, list):
        raise bad("retired", f"expected a list; got {type(retired).__name__}")
    for k, entry in enumerate(retired):
        if not isinstance(entry, dict):
            raise bad(f"retired[{k}]", f"expected an object; got {type(entry).__name__}")
        generation = entry.get("generation")
        if generation is not None and (not isinstance(generation, str) or not _HEX8.fullmatch(generation)):
            raise bad(f"retired[{k}].generation", f"expected 8 hex digits or null; got {generation!r:.40}")
        since = entry.get("since")
        if isinstance(since, bool) or not isinstance(since, (int, float)) or not 0 <= since < 1e11:
            raise bad(f"retired[{k}].since", f"expected a time [seconds since 1970]; got {since!r:.40}")
        names = entry.get("shards")
        if not isinstance(names, list):
            raise bad(f"retired[{k}].shards", f"expected a list of file names; got {type(names).__name__}")
        for q, name in enumerate(names):
            problem = check_shard_name(name)
            if problem is not None:
                raise bad(f"retired[{k}].shards[{q}]", problem)
    return manifest


def parse_manifest(data: bytes, path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest's JSON, every value checked: its version, types and ranges (``path`` names it in errors: a file or a URL).

    Raises:
        DatasetFormatError: not a readable manifest, of another version, or a
            value of the wrong type or out of range (names the field, e.g.
            ``shards[3].file_size``).
    """
    where = str(path) if isinstance(path, str) else os.fspath(path)
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise DatasetFormatError(where, f"not a readable stoker manifest: not UTF-8 JSON ({exc})") from None
    return dict(_check_manifest(manifest, where))


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
        data = path.read_bytes()
    except OSError as exc:
        raise DatasetFormatError(path, f"not a readable stoker manifest: {exc}") from exc
    manifest = parse_manifest(data, path)
    infos = []
    for entry in manifest["shards"]:
        info = shard_info(folder / entry["name"])
        if info.file_size != entry["file_size"] or info.header_crc != entry["header_crc"] or info.num_samples != entry["num_samples"]:
            raise DatasetFormatError(
                info.path,
                f"shard differs from the manifest {path.name} (size {info.file_size} vs {entry['file_size']}, "
                f"samples {info.num_samples} vs {entry['num_samples']}): it was rewritten after the manifest",
            )
        if info.fields_sha256 != manifest["fields_sha256"]:
            raise DatasetFormatError(info.path, f"shard has other fields than the manifest {path.name} records")
        infos.append(info)
    if not infos:
        raise DatasetFormatError(path, "the manifest lists no shards")
    return infos
