"""Datasets made of several stoker files ("shards") read as one: naming them, and writing a folder of them.

A sharded dataset is a folder holding stoker files with the same fields and a
small manifest (:data:`MANIFEST_NAME`) listing the shards in order with their
sample counts, sizes and header checksums, and a hash of the field table (the
layout: :mod:`stoker.dataset._manifest`). The manifest *is* the dataset: a
folder is read through it, and a folder without one is refused, since its
files may be what a write left when it did not finish, or several datasets
side by side. A list of files or a glob pattern names a dataset too: their
files are taken in the order given (sorted for a glob).

:class:`ShardedWriter` (and :func:`write_shards`) write such a folder as a
transaction (:class:`~stoker.dataset._transaction.FolderTransaction`): one
:class:`~stoker.format.writer.DatasetWriter` file per shard, under names no
earlier write used (``shard-g<GEN>-00000.stoker``, ...), then the manifest,
renamed into place, then the previous dataset's shards are deleted. A write
that fails or is killed leaves the previous dataset as it was.

The destination may also be an object store's URL (``s3://bucket/train/``):
each shard is written in a local staging folder, uploaded as soon as it is
complete and deleted locally, and the manifest is put last
(:mod:`stoker.dataset._remote_transaction`).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from stoker._threads import available_cpus
from stoker.dataset._manifest import MANIFEST_NAME, ShardInfo, fields_hash, read_manifest, shard_info
from stoker.dataset._transaction import write_manifest
from stoker.errors import DatasetFormatError, DatasetNotFoundError

__all__ = [
    "MANIFEST_NAME",
    "ShardInfo",
    "ShardedWriter",
    "fields_hash",
    "open_files",
    "read_manifest",
    "resolve_dataset",
    "shard_info",
    "write_manifest",
    "write_shards",
]

_GLOB_CHARS = set("*?[")
#: samples encoded to estimate the bytes per sample for ``bytes_per_shard``
_SIZE_PROBE = 256
#: opens of a folder retried because a write committed a new manifest meanwhile
_REOPENS = 20

T = TypeVar("T")
Source = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


def resolve_dataset(source: Source) -> list[Path]:
    """The files that make up a dataset named by a file, a folder, a glob pattern or a list of files.

    A folder gives its manifest's shards (checked). A glob pattern gives its
    matches, sorted; a list, its files in order.

    Raises:
        DatasetNotFoundError: nothing matches (a ``FileNotFoundError`` too).
        DatasetFormatError: a folder without a manifest (the
            message says whether it holds ``*.stoker`` files: then a write did
            not finish, or the files are not one dataset, and names them by a
            glob or a list is the way to read them).
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
        files = sorted(p.name for p in path.iterdir() if p.suffix == ".stoker" and p.is_file())
        if not files:
            raise DatasetFormatError(path, f"a folder with no {MANIFEST_NAME} and no *.stoker files")
        listed = ", ".join(files[:3]) + (f", ... ({len(files)} files)" if len(files) > 3 else "")
        raise DatasetFormatError(
            path,
            f"a folder of *.stoker files ({listed}) without its {MANIFEST_NAME}: a write into it did not finish "
            "(or is running now), or the files are not one dataset, so they are not read as one. Write the dataset "
            f"again, or name the files you mean: a glob pattern such as {str(path / '*.stoker')!r}, or a list of paths",
        )
    if not path.exists() and _GLOB_CHARS & set(text):
        matches = sorted(Path(m) for m in glob.glob(text))
        if not matches:
            raise DatasetNotFoundError(path, "the pattern matches no file")
        return matches
    return [path]


def _manifest_bytes(path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError:
        return None


def open_files(source: Source, opener: Callable[[list[Path]], T]) -> T:
    """``opener(resolve_dataset(source))``, opened again when a write into the folder committed meanwhile.

    A write deletes the shards of the dataset it replaces right after it
    publishes the new manifest: a reader that read the old manifest may find
    its shards gone. When opening fails and the folder's manifest is no longer
    the one it was, the new dataset is opened instead (up to 20 times), so
    that a reader gets the old dataset or the new one, never an error for
    having come in between. ``opener`` must keep the files it opened
    readable (open or map them), so that the dataset stays the one opened.

    Raises:
        DatasetFormatError: as :func:`resolve_dataset` and ``opener``, when the manifest did not change.
    """
    manifest = None
    if not isinstance(source, (list, tuple)) and Path(os.fspath(source)).is_dir():  # type: ignore[arg-type]
        manifest = Path(os.fspath(source)) / MANIFEST_NAME  # type: ignore[arg-type]
    for attempt in range(_REOPENS + 1):
        before = _manifest_bytes(manifest)
        try:
            return opener(resolve_dataset(source))
        except (DatasetFormatError, OSError):
            if manifest is None or attempt == _REOPENS or _manifest_bytes(manifest) == before:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


class ShardedWriter:
    """Write a dataset as a folder of shards and a manifest, as one transaction.

    Each shard is a complete stoker file written by a
    :class:`~stoker.format.writer.DatasetWriter` (atomically too), under a
    name of this write's generation (``shard-g<GEN>-00000.stoker``, ...);
    then the manifest is renamed into place (the commit: readers see the new
    dataset from then on), then the previous dataset's shards are deleted.
    An error, Ctrl-C or SIGTERM before the commit deletes this write's shards
    and leaves the previous dataset as it was; SIGKILL or a power loss leaves
    files that no manifest lists, which the next write deletes. See
    :mod:`stoker.dataset._transaction`. In an object store a rewrite keeps the
    generation it replaces for the jobs still reading it, and the next write
    deletes it and a killed write's leftovers once ``retention`` has passed
    (``storage_options``, default 7 days; see
    :mod:`stoker.dataset._remote_transaction`).

    Args:
        directory: the dataset's folder (created if missing), or the URL of
            an object store prefix (``s3://bucket/train/``, ``gs://``,
            ``az://``): shards are uploaded as they are finished, the manifest
            last. A dataset there is replaced.
        fields: field name -> Field, as for ``DatasetWriter``.
        samples_per_shard: samples in each shard (the last may hold fewer).
        bytes_per_shard: aim for shards of about this size [bytes]: the
            samples per shard are this divided by the bytes per sample of up
            to 256 samples spread over the dataset (encoded once to measure).
            Give exactly one of ``samples_per_shard`` and ``bytes_per_shard``.
        num_workers: encoding processes per shard, as for ``DatasetWriter``.
        progress: show a progress bar per shard.
        storage_options: for a URL: credentials, endpoint, retries,
            ``retention`` (see :func:`stoker.remote.open_store`); by default
            read from the environment as the AWS tools do.

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
        *,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        if (samples_per_shard is None) == (bytes_per_shard is None):
            raise ValueError(
                f"give exactly one of samples_per_shard and bytes_per_shard; got samples_per_shard={samples_per_shard!r}, "
                f"bytes_per_shard={bytes_per_shard!r}"
            )
        for name, value in (("samples_per_shard", samples_per_shard), ("bytes_per_shard", bytes_per_shard)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
                raise ValueError(f"{name} must be an int >= 1; got {value!r}")
        from stoker.dataset._remote_transaction import is_url

        #: the URL when the destination is an object store, else ``None``
        self.url: str | None = str(directory) if is_url(directory) else None
        self.directory = Path(directory) if self.url is None else Path()
        self.storage_options = dict(storage_options) if storage_options is not None else None
        if self.url is None and storage_options is not None:
            raise ValueError(f"storage_options are for a URL destination (s3://, gs://, az://); got the folder {os.fspath(directory)!r}")
        self.fields = dict(fields)
        self.samples_per_shard = samples_per_shard
        self.bytes_per_shard = bytes_per_shard
        self.num_workers = num_workers
        self.progress = progress

    def _per_shard(self, probe: Iterable[tuple[int, Sequence[Any]]]) -> int:
        """Samples per shard; with ``bytes_per_shard``, measured on ``probe``'s ``(index, values in field order)``."""
        if self.samples_per_shard is not None:
            return int(self.samples_per_shard)
        from stoker.format.reader import metadata_dtype

        row = metadata_dtype(self.fields).itemsize
        total, count = 0, 0
        for i, values in probe:
            for field, value in zip(self.fields.values(), values):
                _meta, payload = field.encode(value, i)
                total += memoryview(payload).nbytes if payload is not None else 0
            count += 1
        per_sample = row + total / max(count, 1)
        return max(1, int(int(self.bytes_per_shard or 1) // max(per_sample, 1)))

    @staticmethod
    def _spread(n: int) -> list[int]:
        """Up to 256 sample positions spread over ``n`` samples (the ``bytes_per_shard`` probe)."""
        return np.unique(np.linspace(0, max(n - 1, 0), min(n, _SIZE_PROBE)).astype(np.int64)).tolist() if n else []

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

        per = self._per_shard((i, sample(i)) for i in self._spread(len(idx)))
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
        per = self._per_shard((i, [arrays[name][i] for name in self.fields]) for i in self._spread(n))
        return self._write(n, per, lambda w, a, b: w.from_arrays({k: v[a:b] for k, v in arrays.items()}, chunksize=chunksize))

    def from_webdataset(
        self,
        shards: Sequence[str | os.PathLike[str]] | str | os.PathLike[str],
        pipeline: Callable[[Any], Iterable[Any]] | None = None,
        *,
        keys: Mapping[str, str] | None = None,
        chunksize: int = 100,
    ) -> list[Path]:
        """Write the samples of WebDataset tar files, tar after tar, cut into stoker shards.

        The arguments are those of :meth:`~stoker.format.writer.DatasetWriter.from_webdataset`;
        a stoker shard may end inside a tar file. With ``bytes_per_shard``,
        the bytes per sample are measured on the first 256 samples.

        Returns:
            The shards' paths, in order.

        Raises:
            As ``DatasetWriter.from_webdataset``; a sample's index counts the
            samples of every tar file before it.
        """
        from stoker.format import _webdataset as web
        from stoker.format.writer import _sample_values

        tars, pipeline = web.resolve(self.fields, shards, pipeline, keys, chunksize)
        threads = self.num_workers if self.num_workers > 0 else available_cpus()
        counts = web.count_samples(tars, pipeline, threads=threads)
        names = list(self.fields)
        probe = () if self.samples_per_shard is not None else web.first_samples(tars, pipeline, _SIZE_PROBE)
        per = self._per_shard((i, _sample_values(s, i, names)) for i, s in enumerate(probe))
        source = web.ShardSource(pipeline, self.fields, chunksize)

        def write(writer: Any, a: int, b: int) -> None:
            tasks = web.tasks_between(tars, counts, a, b)
            writer._write(b - a, lambda: writer._encoded(source, tasks))

        return self._write(sum(counts), per, write)

    def _write(self, n: int, per: int, write: Callable[[Any, int, int], None]) -> list[Path]:
        """Write the shards through the destination's transaction; their paths (for a URL: their keys in the store)."""
        from stoker.dataset._remote_transaction import finish_shard, open_transaction
        from stoker.format.writer import DatasetWriter

        destination = self.url if self.url is not None else self.directory
        with open_transaction(destination, overwrite=True, storage_options=self.storage_options) as tx:
            paths = []
            for k, a in enumerate(range(0, max(n, 1), per)):
                path = tx.shard_path(k)
                write(DatasetWriter(path, self.fields, num_workers=self.num_workers, progress=self.progress), a, min(n, a + per))
                finish_shard(tx, path)  # a URL's: uploaded now, the local file deleted
                paths.append(path)
            tx.commit(paths)
        return paths if self.url is None else [Path(p.name) for p in paths]


def write_shards(
    directory: str | os.PathLike[str],
    fields: Mapping[str, Any],
    source: Any,
    samples_per_shard: int | None = None,
    bytes_per_shard: int | None = None,
    num_workers: int = -1,
    progress: bool | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> list[Path]:
    """Write ``source`` (an indexed dataset, or a mapping of arrays) as a folder of shards and a manifest.

    See :class:`ShardedWriter` for the arguments (``directory`` may be an object store's URL).

    Returns:
        The shards' paths, in order (for a URL: their keys under it).
    """
    writer = ShardedWriter(directory, fields, samples_per_shard, bytes_per_shard, num_workers, progress, storage_options=storage_options)
    if isinstance(source, Mapping):
        return writer.from_arrays(source)
    return writer.from_indexed_dataset(source)
