"""A shard's head read from a store: every value checked before it is used, every read bounded.

A shard's *head* is every byte but its data region: the header, the field
table and the metadata table (``[0, data_offset)``), and the checksum table
(``[checksum_offset, file_size)``). :func:`read_head` reads it with range
requests and checks, before any value is used to size a read or a file:

- the object's size (which the first answer gives) against the manifest's ``file_size``;
- the header: the magic, its CRC, and the CRC against the manifest's ``header_crc`` (and its ``num_samples``);
- the header's ``file_size`` and its section offsets, in order and within the object;
- the head's size against :data:`MAX_HEAD_BYTES`.

The rest (the field table's and metadata's CRCs and contents) is checked by
:class:`~stoker.format.reader.Reader` when the loader opens the head, as for
a local file. Errors are :class:`~stoker.errors.DatasetFormatError` naming the
shard's URL and the field at fault. A well-framed answer with fewer bytes than
asked is retried by the store (:meth:`stoker.remote.Store.read_range_sized`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from stoker.errors import DatasetFormatError
from stoker.format import spec

if TYPE_CHECKING:
    from stoker.remote._store import Store

__all__ = ["FIRST_READ", "MAX_HEAD_BYTES", "MAX_MANIFEST_BYTES", "Head", "read_head"]

#: the first request of a shard's head: its header and, for shards of modest metadata, the rest of its front [bytes]
FIRST_READ = 1 << 16
#: the most bytes of a shard's head (front and checksum table) read from a store [bytes]
MAX_HEAD_BYTES = 1 << 30
#: the most bytes of a manifest read from a store [bytes] (about 400,000 shards)
MAX_MANIFEST_BYTES = 64 << 20


@dataclass(frozen=True)
class Head:
    """The checked head of a shard: ``front`` is its bytes ``[0, data_offset)``, ``back`` its bytes ``[checksum_offset, size)``."""

    size: int
    front: bytes
    checksum_offset: int
    back: bytes


def read_head(store: Store, name: str, size: int, header_crc: int, num_samples: int | None = None) -> Head:
    """Read and check the head of shard ``name`` of ``store``, whose manifest says ``size`` bytes, ``header_crc`` and
    (when given) ``num_samples``.

    Raises:
        DatasetFormatError: the object or its header disagrees with the manifest,
            or a header value is out of range (names the shard's URL and the field).
        RemoteError: the store failed (after its retries).
    """
    where = store.url + name
    first, object_size = store.read_range_sized(name, 0, min(size, FIRST_READ))
    if object_size != size:
        raise DatasetFormatError(
            where,
            f"the object is {object_size} bytes, the manifest's file_size says {size}: the shard was replaced, or the manifest is wrong",
        )
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
    back = store.read_range(name, checksum_offset, size) if size > checksum_offset else b""
    if len(front) != data_offset or len(back) != size - checksum_offset:
        raise DatasetFormatError(where, f"is shorter than the manifest's file_size ({size} bytes) says")
    return Head(size, front, checksum_offset, back)
