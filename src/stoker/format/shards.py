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

:class:`ShardedWriter` (and :func:`write_shards`) write such a folder: one
:class:`~stoker.format.writer.DatasetWriter` file per shard,
``shard-00000.stoker``, ``shard-00001.stoker``, ..., then the manifest.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
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
    "ShardedWriter",
    "fields_hash",
    "read_manifest",
    "resolve_dataset",
    "shard_info",
    "write_manifest",
    "write_shards",
]

#: the manifest's file name inside a sharded dataset's folder
MANIFEST_NAME = "manifest.stoker.json"
MANIFEST_VERSION = 1
_GLOB_CHARS = set("*?[")
_SHARD_NAME = re.compile(r"shard-(\d{5,})\.stoker")
#: samples encoded to estimate the bytes per sample for ``bytes_per_shard``
_SIZE_PROBE = 256


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


def shard_name(k: int) -> str:
    """The file name of shard ``k`` written by :class:`ShardedWriter`."""
    return f"shard-{k:05d}.stoker"


class ShardedWriter:
    """Write a dataset as a folder of shards and a manifest, written last and atomically.

    Each shard is a complete stoker file written by a
    :class:`~stoker.format.writer.DatasetWriter` (atomically too). Before the
    first shard is written the folder's old manifest is removed, so that a
    write stopped half way leaves no manifest that points at new shards; after
    the new manifest, ``shard-NNNNN.stoker`` files left over from an earlier,
    larger write are deleted.

    Args:
        directory: the dataset's folder (created if missing).
        fields: field name -> Field, as for ``DatasetWriter``.
        samples_per_shard: samples in each shard (the last may hold fewer).
        bytes_per_shard: aim for shards of about this size [bytes]: the
            samples per shard are this divided by the bytes per sample of up
            to 256 samples spread over the dataset (encoded once to measure).
            Give exactly one of ``samples_per_shard`` and ``bytes_per_shard``.
        num_workers: encoding processes per shard, as for ``DatasetWriter``.
        progress: show a progress bar per shard.

    Example:
        >>> ShardedWriter("data/", fields, samples_per_shard=100_000).from_indexed_dataset(dataset)  # doctest: +SKIP
        >>> Loader("data/", batch_size=512)  # doctest: +SKIP
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        fields: Mapping[str, Any],
        samples_per_shard: int | None = None,
        bytes_per_shard: int | None = None,
        num_workers: int = -1,
        progress: bool | None = None,
    ) -> None:
        if (samples_per_shard is None) == (bytes_per_shard is None):
            raise ValueError(
                f"give exactly one of samples_per_shard and bytes_per_shard; got samples_per_shard={samples_per_shard!r}, "
                f"bytes_per_shard={bytes_per_shard!r}"
            )
        for name, value in (("samples_per_shard", samples_per_shard), ("bytes_per_shard", bytes_per_shard)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
                raise ValueError(f"{name} must be an int >= 1; got {value!r}")
        self.directory = Path(directory)
        self.fields = dict(fields)
        self.samples_per_shard = samples_per_shard
        self.bytes_per_shard = bytes_per_shard
        self.num_workers = num_workers
        self.progress = progress

    def _per_shard(self, sample: Any, n: int) -> int:
        if self.samples_per_shard is not None:
            return int(self.samples_per_shard)
        from stoker.format.reader import metadata_dtype

        probe: Any = np.unique(np.linspace(0, max(n - 1, 0), min(n, _SIZE_PROBE)).astype(np.int64)) if n else []
        row = metadata_dtype(self.fields).itemsize
        total = 0
        for i in probe:
            values = sample(int(i))
            for field, value in zip(self.fields.values(), values):
                _meta, payload = field.encode(value, int(i))
                total += len(payload) if payload is not None else 0
        per_sample = row + total / max(len(probe), 1)
        return max(1, int(int(self.bytes_per_shard or 1) // max(per_sample, 1)))

    def from_indexed_dataset(self, dataset: Any, indices: Sequence[int] | np.ndarray | None = None, chunksize: int = 100) -> list[Path]:
        """Write ``dataset[i]`` for each ``i`` in ``indices`` (default: all), cut into shards in this order.

        Returns:
            The shards' paths, in order (the manifest is ``directory / MANIFEST_NAME``).

        Raises:
            SampleError: as ``DatasetWriter.from_indexed_dataset`` (the index is the dataset's).
        """
        idx = np.arange(len(dataset), dtype=np.int64) if indices is None else np.asarray(indices, dtype=np.int64).reshape(-1)
        names = list(self.fields)

        def sample(i: int) -> Sequence[Any]:
            value = dataset[int(idx[i])]
            return value if len(names) > 1 or isinstance(value, tuple) else (value,)

        per = self._per_shard(sample, len(idx))
        return self._write(len(idx), per, lambda w, a, b: w.from_indexed_dataset(dataset, indices=idx[a:b], chunksize=chunksize))

    def from_arrays(self, arrays: Mapping[str, Any], chunksize: int = 4096) -> list[Path]:
        """Write samples given as arrays, one per field (as ``DatasetWriter.from_arrays``), cut into shards.

        Returns:
            The shards' paths, in order.

        Raises:
            ValueError: missing or extra names, or arrays of different lengths.
            SampleError: as ``DatasetWriter.from_arrays`` (the index is inside its shard).
        """
        from stoker.format.writer import check_arrays

        n = check_arrays(self.fields, arrays)
        per = self._per_shard(lambda i: [arrays[name][i] for name in self.fields], n)
        return self._write(n, per, lambda w, a, b: w.from_arrays({k: v[a:b] for k, v in arrays.items()}, chunksize=chunksize))

    def _write(self, n: int, per: int, write: Any) -> list[Path]:
        from stoker.format.writer import DatasetWriter

        folder = self.directory
        folder.mkdir(parents=True, exist_ok=True)
        (folder / MANIFEST_NAME).unlink(missing_ok=True)
        paths = []
        for k, a in enumerate(range(0, max(n, 1), per)):
            path = folder / shard_name(k)
            write(DatasetWriter(path, self.fields, num_workers=self.num_workers, progress=self.progress), a, min(n, a + per))
            paths.append(path)
        write_manifest(folder, paths)
        for stale in folder.iterdir():
            match = _SHARD_NAME.fullmatch(stale.name)
            if match and int(match.group(1)) >= len(paths):
                stale.unlink(missing_ok=True)
        return paths


def write_shards(
    directory: str | os.PathLike[str],
    fields: Mapping[str, Any],
    source: Any,
    samples_per_shard: int | None = None,
    bytes_per_shard: int | None = None,
    num_workers: int = -1,
    progress: bool | None = None,
) -> list[Path]:
    """Write ``source`` (an indexed dataset, or a mapping of arrays) as a folder of shards and a manifest.

    See :class:`ShardedWriter` for the arguments.

    Returns:
        The shards' paths, in order.
    """
    writer = ShardedWriter(directory, fields, samples_per_shard, bytes_per_shard, num_workers, progress)
    if isinstance(source, Mapping):
        return writer.from_arrays(source)
    return writer.from_indexed_dataset(source)
