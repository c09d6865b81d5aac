"""Shards' heads: everything of a shard in object storage but its data region, read with range requests, cached.

A shard's *head* holds its bytes ``[0, data_offset)`` (header, field table,
metadata table) then ``[checksum_offset, file_size)`` (checksum table), as
:class:`~stoker.format.reader.Reader` opens them with ``head=True``. A head
is read from the store at the first open (the header and, for shards of
modest metadata, the rest of the front in one request), checked against the
manifest's record of the shard (its size and header CRC: the header's CRC
covers the checksum table's, which covers every other CRC), and kept as a
file of the shard cache under the identity ``h<header CRC>-<size>``: it
counts against the cache's limit like any file, takes only its own bytes on
disk (no sparse file: portable to any file system), and may be evicted (the
next open reads it again). A head found in the cache is opened without
following links and checked again, as everything in a cache is.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from stoker import _cache_roots
from stoker.errors import DatasetFormatError
from stoker.fields import Field
from stoker.format import spec
from stoker.format.reader import Reader

if TYPE_CHECKING:
    from stoker.remote import ShardCache, Store

#: the first request of a shard's head: its header and, for shards of modest metadata, the rest of its front [bytes]
FIRST_READ = 1 << 16


def head_ident(header_crc: int, size: int) -> str:
    """The cache identity of a shard's head."""
    return f"h{header_crc:08x}-{size}"


def shard_ident(header_crc: int, size: int) -> str:
    """The cache identity of a whole shard: what it holds (the CRC of its header covers every other CRC) and its size."""
    return f"{header_crc:08x}-{size}"


def open_head(
    cache: ShardCache,
    store: Store,
    name: str,
    size: int,
    header_crc: int,
    custom_fields: Mapping[str, type[Field]] | None,
    key: str | None = None,
) -> tuple[Path, Reader]:
    """Shard ``name``'s head as a ``Reader`` (``head=True``), from the cache or read from the store and cached.

    A cached head that does not open as the manifest's shard is deleted and
    read again, once. ``key``: the shard's key in ``cache`` when it is not
    ``name`` (a cache of several stores' shards, keyed by their URLs).

    Raises:
        DatasetFormatError: the shard's head is corrupt or differs from the
            manifest (names the shard's URL).
        RemoteError: the store failed.
    """
    ident = head_ident(header_crc, size)
    where = store.url + name
    key = name if key is None else key
    for attempt in range(2):
        path = cache.lookup(key, ident)
        if path is None:
            path = _download(cache, store, name, size, header_crc, custom_fields, key)
        try:
            return path, _open(path, where, size, header_crc, custom_fields)
        except DatasetFormatError:
            if attempt:
                raise
            with contextlib.suppress(OSError):
                cache.discard(key, ident, os.lstat(path))
        finally:
            cache.unpin(key, ident)
    raise AssertionError("unreachable")  # pragma: no cover


def _open(path: Path, where: str, size: int, header_crc: int, custom_fields: Mapping[str, type[Field]] | None) -> Reader:
    reader = Reader(path, custom_fields, head=True)
    if reader.file_size != size or reader.header_crc != header_crc:
        reader.close()
        raise DatasetFormatError(
            where,
            f"its head (cached as {path}) is of a shard of {reader.file_size} bytes with header CRC {reader.header_crc:#010x}; "
            f"the manifest records {size} bytes and {header_crc:#010x}",
        )
    return reader


def _download(
    cache: ShardCache, store: Store, name: str, size: int, header_crc: int, custom_fields: Mapping[str, type[Field]] | None, key: str
) -> Path:
    """Read the head from the store (checked against the manifest) into the cache as ``key``; pinned."""
    where = store.url + name
    first = store.read_range(name, 0, min(size, FIRST_READ))  # the header, and often the whole front
    head = first[: spec.HEADER_SIZE]
    if len(head) < spec.HEADER_SIZE or head[: len(spec.MAGIC)] != spec.MAGIC:
        raise DatasetFormatError(where, "not a stoker dataset (no stoker header)")
    h = np.frombuffer(head, dtype=spec.HEADER_DTYPE)[0]
    if spec.crc32(head[:252]) != int(h["header_crc"]) or int(h["header_crc"]) != header_crc:
        raise DatasetFormatError(
            where, "its header differs from the manifest's record: the shard was rewritten after the manifest, or is corrupt"
        )
    if int(h["file_size"]) != size:
        raise DatasetFormatError(where, f"its header says {int(h['file_size'])} bytes, the manifest {size}")
    data_offset, checksum_offset = int(h["data_offset"]), int(h["checksum_offset"])
    if not spec.HEADER_SIZE <= data_offset <= checksum_offset <= size:
        raise DatasetFormatError(
            where, f"sections out of order in its header (data at {data_offset}, checksums at {checksum_offset}, size {size})"
        )

    def fill(part: Path) -> int:
        front = first[:data_offset]
        if len(front) < data_offset:
            front += store.read_range(name, len(front), data_offset)
        back = store.read_range(name, checksum_offset, size) if size > checksum_offset else b""
        if len(front) != data_offset or len(back) != size - checksum_offset:
            raise DatasetFormatError(where, "is shorter than the manifest says")
        with open(_cache_roots.open_file(part, os.O_WRONLY | os.O_TRUNC), "wb") as fh:
            fh.write(front)
            fh.write(back)
        return len(front) + len(back)

    def check(key: str, part: Path) -> None:
        _open(part, where, size, header_crc, custom_fields).close()

    return cache.fetch(key, data_offset + size - checksum_offset, head_ident(header_crc, size), fill=fill, check=check)
