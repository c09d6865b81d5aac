"""The dataset a Loader reads: opened from a file, shards, a URL or a mix's streams; its files kept unchanged.

:func:`open_reader` opens a :class:`~stoker.format.reader.Reader`, or a
:class:`~stoker.dataset.sharded.ShardedReader` (same reading API) for shards or ``os_cache=False``; a URL: a
:class:`~stoker.dataset._remote.RemoteReader` (always bounded); a mix: the streams' datasets read as one.
:func:`identity` and :func:`check_unchanged` refuse a file rewritten in place since it was opened (reading a
mapped file that changed can kill the process with SIGBUS).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from stoker._env import env_count
from stoker.dataset.sharded import ShardedReader, open_dataset
from stoker.errors import DatasetFormatError
from stoker.format import _verify
from stoker.format.reader import Reader
from stoker.loader import _checks, _mix
from stoker.loader.order import OrderOption

if TYPE_CHECKING:
    from stoker.dataset._remote import RemoteShards
    from stoker.fields.base import Field
    from stoker.loader.mixing import Stream


class RemoteOrderWarning(UserWarning):
    """``order=RANDOM`` over a dataset in object storage that is larger than its cache."""


def open_reader(
    fname: Any,
    streams: list[Stream] | None,
    custom_fields: Mapping[str, type[Field]],
    os_cache: bool,
    check_data: bool | None,
    storage_options: Mapping[str, Any] | None,
    cache_dir: str | os.PathLike[str] | None,
    cache_limit: int | None,
    download_ahead: int | None,
    cache_shared: bool,
) -> tuple[Reader | ShardedReader, bool]:
    """The dataset, and ``os_cache`` as it applies (``False`` for a URL, or a mix with a dataset in object storage).

    The store's arguments (``cache_limit``, ``download_ahead``, ``cache_shared``) are checked first.
    """
    remote = isinstance(fname, str) and "://" in fname
    _checks.check_int("cache_limit", cache_limit, none_ok=True)
    _checks.check_int("download_ahead", download_ahead, none_ok=True)
    _checks.check_bool("cache_shared", cache_shared)
    options = {"storage_options": storage_options, "cache_dir": cache_dir, "cache_limit": cache_limit, "ahead": download_ahead,
               "cache_shared": cache_shared or None}  # fmt: skip
    if remote:
        options["verify"] = _verify.env_enabled() if check_data is None else bool(check_data)
        os_cache = False
    reader: Reader | ShardedReader
    if streams is not None:  # a mix: the streams' datasets read as one (any in object storage: all bounded)
        reader = _mix.open_streams(streams, custom_fields, not os_cache, storage_options, cache_dir, cache_limit,
                                   _verify.env_enabled() if check_data is None else bool(check_data), download_ahead,
                                   bool(cache_shared))  # fmt: skip
        os_cache = os_cache and not reader.bounded
    else:
        reader = open_dataset(fname, custom_fields=custom_fields, bounded=not os_cache, **options)
        if os_cache and isinstance(reader, Reader) and not reader.head and reader.file_size <= in_memory_bytes():
            reader.load_into_memory()
    return reader, os_cache


#: a local dataset file up to this size, read with ``os_cache=True``, is served from a copy in the loader's memory
#: (:meth:`Reader.load_into_memory <stoker.format.reader.Reader.load_into_memory>`: huge pages, a quarter less time per
#: random batch of a table); ``STOKER_IN_MEMORY_BYTES`` sets it (0: always the memory map) [bytes]
IN_MEMORY_BYTES = 64 << 20


def in_memory_bytes() -> int:
    """The largest file a Loader copies into its memory (``STOKER_IN_MEMORY_BYTES``, default :data:`IN_MEMORY_BYTES`)."""
    return env_count("STOKER_IN_MEMORY_BYTES", IN_MEMORY_BYTES, "bytes", "never copy")


def warn_random_order(remote: RemoteShards, order: OrderOption) -> None:
    """``RANDOM`` over a remote dataset larger than its cache: every batch may need another shard."""
    total = sum(remote.sizes)
    if order is OrderOption.RANDOM and remote.limit is not None and total > remote.limit:
        where = remote.url or f"the mix's datasets in object storage {[p.url for p in getattr(remote, 'parts', [])]}"
        warnings.warn(
            f"order=RANDOM over {where} ({total} bytes in {len(remote.sizes)} shards) with cache_limit={remote.limit}: "
            "the dataset does not fit in the cache, so every batch may need a different shard and shards are downloaded "
            "again and again. Use order=OrderOption.QUASI_RANDOM (windows within shards; see docs/remote.md), or a "
            "cache_limit of the dataset's size",
            RemoteOrderWarning,
            stacklevel=3,
        )


def _file_identity(path: Any) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _dataset_files(reader: Reader | ShardedReader) -> list[Any]:
    """The file of a Reader, or every shard of a ShardedReader (none of a dataset in object storage: its heads are
    files of the shard cache, never rewritten in place and maybe evicted, and its data is read, not mapped; a mix's
    local files only)."""
    remote_shard = getattr(reader, "remote_shard", None)
    if remote_shard is not None:  # a mix (stoker.dataset.mixed.MixedReader)
        return [p for p, j in zip(reader.paths, remote_shard.tolist()) if j < 0]  # type: ignore[union-attr]
    if getattr(reader, "remote", None) is not None:
        return []
    return list(getattr(reader, "paths", [reader.path]))


def identity(reader: Reader | ShardedReader) -> list[tuple[int, int, int, int]]:
    """Each of the dataset's local files as it is now (device, inode, size, modification time), for :func:`check_unchanged`."""
    return [_file_identity(p) for p in _dataset_files(reader)]


def check_unchanged(reader: Reader | ShardedReader, opened: list[tuple[int, int, int, int]]) -> None:
    """Refuse a file (any shard) changed in place since it was opened (reading it could kill the process with SIGBUS).

    Raises:
        DatasetFormatError: naming the file that changed.
    """
    for path, was in zip(_dataset_files(reader), opened):
        try:
            now = _file_identity(path)
        except OSError:
            continue  # removed or renamed: the mapping still holds the file we opened
        if now[:2] == was[:2] and now != was:
            raise DatasetFormatError(
                path,
                "changed on disk since this Loader opened it; a file rewritten in place while it is mapped can kill the "
                "process (SIGBUS). Write a new file and rename it over the old one (DatasetWriter does), then make a new Loader",
            )
