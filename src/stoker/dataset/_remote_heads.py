"""Shards' heads: everything of a shard in object storage but its data region, read with range requests, cached.

A shard's *head* holds its bytes ``[0, data_offset)`` (header, field table,
metadata table) then ``[checksum_offset, file_size)`` (checksum table), as
:class:`~stoker.format.reader.Reader` opens them with ``head=True``. A head
is read from the store at the first open in one round trip for most shards:
its first bytes (the header and, for shards of modest metadata, the rest of the
front; the whole front, up to :data:`MAX_FRONT_HINT`, when the manifest's ``head``
record gives its length) and, at the same time, its last bytes (the checksum table,
unless it is larger); a shard of at most ``FIRST_READ + TAIL_READ`` bytes in one request. It is checked against the
manifest's record of the shard (its size and header CRC: the header's CRC
covers the checksum table's, which covers every other CRC), and kept as a
file of the shard cache under the identity ``h<header CRC>-<size>``: it
counts against the cache's limit like any file, takes only its own bytes on
disk (no sparse file: portable to any file system), and may be evicted (the
next open reads it again). A head found in the cache is opened without
following links and checked again, as everything in a cache is.

:func:`read_head` reads a head from the store and checks, before any value is
used to size a read or a file:

- the object's size (which the first answer gives) against the manifest's ``file_size``;
- the header: the magic, its CRC, and the CRC against the manifest's ``header_crc`` (and its ``num_samples``);
- the header's ``file_size`` and its section offsets, in order and within the object;
- the head's size against :data:`MAX_HEAD_BYTES`.

The rest (the field table's and metadata's CRCs and contents) is checked by
:class:`~stoker.format.reader.Reader` when the head is opened, as for a local
file. Errors are :class:`~stoker.errors.DatasetFormatError` naming the shard's
URL and the field at fault. A well-framed answer with fewer bytes than asked
is retried by the store (:meth:`stoker.remote.Store.read_range_sized`).

:func:`said_if_slow` says what an open waits for: a dataset whose manifest
and heads take more than a second to read gets one INFO line (logger
``stoker.dataset``) naming the URL, from a helper thread, while it waits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from stoker import _cache_roots
from stoker._threads import start_thread
from stoker.errors import DatasetFormatError
from stoker.fields import Field
from stoker.format import spec
from stoker.format.reader import Reader
from stoker.observe import span

if TYPE_CHECKING:
    from stoker.remote import ShardCache, Store

__all__ = [
    "FIRST_READ",
    "MAX_FRONT_HINT",
    "MAX_HEAD_BYTES",
    "MAX_MANIFEST_BYTES",
    "SAY_AFTER",
    "TAIL_READ",
    "Head",
    "head_ident",
    "open_head",
    "read_head",
    "said_if_slow",
    "shard_ident",
]

#: the first request of a shard's head: its header and, for shards of modest metadata, the rest of its front [bytes]
FIRST_READ = 1 << 16
#: the last bytes of a shard read beside its first request (its checksum table, for shards of modest size) [bytes]
TAIL_READ = 1 << 16
#: the longest first request of a head whose front's length the manifest records (``head.data_offset``) [bytes]
MAX_FRONT_HINT = 16 << 20
#: the most bytes of a shard's head (front and checksum table) read from a store [bytes]
MAX_HEAD_BYTES = 1 << 30
#: the most bytes of a manifest read from a store [bytes] (about 400,000 shards)
MAX_MANIFEST_BYTES = 64 << 20
#: an open that waits longer than this is said (an INFO line) [seconds]
SAY_AFTER = 1.0
log = logging.getLogger("stoker.dataset")


@contextlib.contextmanager
def said_if_slow(message: str, after: float = SAY_AFTER) -> Iterator[None]:
    """Log ``message`` (INFO, with the seconds waited so far) once if the ``with`` block is still running ``after``
    seconds from now: a helper thread says it while the block waits (for the store, most often)."""
    done = threading.Event()
    start = time.monotonic()

    def say() -> None:
        if not done.wait(after):
            log.info("%s (%.1f s so far)", message, time.monotonic() - start)

    thread = start_thread(say, name="stoker-say-slow")
    try:
        yield
    finally:
        done.set()
        thread.join()


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
    num_samples: int | None = None,
    tails: Executor | None = None,
    front: int | None = None,
) -> tuple[Path, Reader]:
    """Shard ``name``'s head as a ``Reader`` (``head=True``), from the cache or read from the store and cached.

    A cached head that does not open as the manifest's shard is deleted and
    read again, once. ``key``: the shard's key in ``cache`` when it is not
    ``name`` (a cache of several stores' shards, keyed by their URLs);
    ``num_samples``: the manifest's count of the shard's samples, checked
    against its header when it is read from the store; ``tails``: where the
    read of the shard's last bytes runs beside its first; ``front``: the length
    of its front as the manifest records it (see :func:`read_head`).

    Raises:
        DatasetFormatError: the shard's head is corrupt or differs from the
            manifest (names the shard's URL).
        RemoteError: the store failed.
    """
    ident = head_ident(header_crc, size)
    where = store.url + name
    key = name if key is None else key

    def download() -> Path:
        """Read the head from the store (every value checked against the manifest) into the cache as ``key``; pinned."""
        with span(f"head {key}", "download"):  # (on the timeline of an active loader.trace(): a head read in an epoch)
            head = read_head(store, name, size, header_crc, num_samples, tails=tails, front=front)  # every value checked, reads bounded

        def fill(part: Path) -> int:
            with open(_cache_roots.open_file(part, os.O_WRONLY | os.O_TRUNC), "wb") as fh:
                fh.write(head.front)
                fh.write(head.back)
            return len(head.front) + len(head.back)

        def check(key: str, part: Path) -> None:
            _open(part, where, size, header_crc, custom_fields).close()

        return cache.pin(key, len(head.front) + len(head.back), ident, fill=fill, check=check)

    for attempt in range(2):
        path = cache.lookup(key, ident)
        if path is None:
            path = download()
        try:
            return path, _open(path, where, size, header_crc, custom_fields)
        except DatasetFormatError as exc:
            if attempt:
                if exc.path == str(path):  # a head that fails the reader's checks: named by its URL, not the cache's copy
                    raise DatasetFormatError(where, f"{exc.problem} (its head cached as {path})") from exc
                raise
            with contextlib.suppress(OSError):
                cache.discard(key, ident, os.lstat(path), cause="head")
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


@dataclass(frozen=True)
class Head:
    """The checked head of a shard: ``front`` is its bytes ``[0, data_offset)``, ``back`` its bytes ``[checksum_offset, size)``."""

    size: int
    front: bytes
    checksum_offset: int
    back: bytes


def read_head(
    store: Store,
    name: str,
    size: int,
    header_crc: int,
    num_samples: int | None = None,
    *,
    tails: Executor | None = None,
    front: int | None = None,
) -> Head:
    """Read and check the head of shard ``name`` of ``store``, whose manifest says ``size`` bytes, ``header_crc`` and
    (when given) ``num_samples``.

    A shard of at most ``FIRST_READ + TAIL_READ`` bytes is read in one
    request. With ``tails`` (an executor), a larger shard's last
    ``TAIL_READ`` bytes are read there while its first ``FIRST_READ`` are read
    here: one round trip when its checksum table fits in them (it is read on
    its own otherwise). ``front``: the length of the shard's front (header,
    field table, metadata) that its manifest's ``head`` record gives, read in
    the first request when longer than ``FIRST_READ`` (at most
    :data:`MAX_FRONT_HINT`): a hint only, the header's own ``data_offset`` is
    what is used. Nothing read is used before the header is checked.

    Raises:
        DatasetFormatError: the object or its header disagrees with the manifest,
            or a header value is out of range (names the shard's URL and the field).
        RemoteError: the store failed (after its retries).
    """
    where = store.url + name
    first_read = FIRST_READ if front is None else max(FIRST_READ, min(int(front), MAX_FRONT_HINT))
    whole = size <= first_read + TAIL_READ
    tail: Future[tuple[bytes, int]] | None = None
    if not whole and tails is not None:
        tail = tails.submit(store.read_range_sized, name, size - TAIL_READ, size)
    try:
        return _read_head(store, name, size, header_crc, num_samples, where, size if whole else first_read, tail)
    finally:
        if tail is not None and not tail.cancel():
            with contextlib.suppress(BaseException):
                tail.result()  # (its request ends before the head is used or refused: none outlives the open)


def _sized(where: str, object_size: int, size: int) -> None:
    if object_size != size:
        raise DatasetFormatError(
            where,
            f"the object is {object_size} bytes, the manifest's file_size says {size}: the shard was replaced, or the manifest is wrong",
        )


def _read_head(
    store: Store,
    name: str,
    size: int,
    header_crc: int,
    num_samples: int | None,
    where: str,
    first_read: int,
    tail: Future[tuple[bytes, int]] | None,
) -> Head:
    first, object_size = store.read_range_sized(name, 0, min(size, first_read))
    _sized(where, object_size, size)
    head = first[: spec.HEADER_SIZE]
    if len(head) < spec.HEADER_SIZE or head[: len(spec.MAGIC)] != spec.MAGIC:
        raise DatasetFormatError(where, "not a stoker dataset (no stoker header)")
    h = np.frombuffer(head, dtype=spec.HEADER_DTYPE)[0]
    if spec.crc32(head[:252]) != int(h["header_crc"]):
        raise DatasetFormatError(where, "corrupt header: its checksum does not match")
    if int(h["header_crc"]) != header_crc:
        raise DatasetFormatError(
            where, "its header differs from the manifest's record (header_crc): the shard was rewritten after the manifest, or is corrupt"
        )
    if int(h["file_size"]) != size:
        raise DatasetFormatError(where, f"header field file_size: {int(h['file_size'])} bytes; the manifest says {size}")
    if num_samples is not None and int(h["num_samples"]) != num_samples:
        raise DatasetFormatError(where, f"header field num_samples: {int(h['num_samples'])}; the manifest says {num_samples}")
    data_offset, checksum_offset = int(h["data_offset"]), int(h["checksum_offset"])
    if not spec.HEADER_SIZE <= data_offset <= checksum_offset <= size:
        raise DatasetFormatError(
            where,
            f"header fields data_offset, checksum_offset out of order (data at {data_offset}, checksums at {checksum_offset}, size {size})",
        )
    if data_offset + (size - checksum_offset) > MAX_HEAD_BYTES:
        raise DatasetFormatError(
            where,
            f"header fields data_offset, checksum_offset: a head of {data_offset + size - checksum_offset} bytes (metadata and "
            f"checksums), more than the {MAX_HEAD_BYTES} read from a store: write shards with fewer samples",
        )
    front = first[:data_offset]
    if len(front) < data_offset:
        front += store.read_range(name, len(first), data_offset)
    if size <= checksum_offset:
        back = b""
    elif len(first) == size:  # (the whole object was read)
        back = first[checksum_offset:]
    elif tail is not None and checksum_offset >= size - TAIL_READ:
        end, tail_size = tail.result()
        _sized(where, tail_size, size)
        back = end[len(end) - (size - checksum_offset) :] if len(end) >= size - checksum_offset else b""
    else:
        back = store.read_range(name, checksum_offset, size)
    if len(front) != data_offset or len(back) != size - checksum_offset:
        raise DatasetFormatError(where, f"is shorter than the manifest's file_size ({size} bytes) says")
    return Head(size, front, checksum_offset, back)
