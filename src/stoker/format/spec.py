"""The on-disk layout of a stoker file, and nothing else.

All integers are little-endian. Offsets are absolute byte offsets from the
start of the file. Every section starts on a 64-byte boundary.

::

    offset 0    +--------------------------------------------+
                | header (256 bytes, HEADER_DTYPE)           |
    256         +--------------------------------------------+
                | field table (UTF-8 JSON)                   |
                +--------------------------------------------+
                | metadata table: num_samples rows of the    |
                | structured row dtype (one row per sample)  |
                +--------------------------------------------+  <- data region
                | columns: one dense array per fixed-size    |
                | field (num_samples x item bytes)           |
                +--------------------------------------------+
                | heap: variable-size values, addressed by   |
                | (u8 offset, u8 size) pairs in the metadata |
                +--------------------------------------------+  <- end of data region
                | checksum table: u4 CRC-32 per metadata     |
                | block, then u4 CRC-32 per data block       |
    file_size   +--------------------------------------------+

See ``docs/FORMAT.md`` for the description of every byte.
"""

from __future__ import annotations

from typing import Final

import numpy as np

try:  # python-isal's CRC-32 (SIMD): the values of zlib's, 5-7x as fast; it releases the GIL like zlib's
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - a platform without its wheel
    from zlib import crc32 as _crc32

MAGIC: Final = b"STOKER\x00\x1a"
FORMAT_VERSION: Final = 1
HEADER_SIZE: Final = 256
ALIGNMENT: Final = 64
METADATA_BLOCK_SIZE: Final = 1 << 20  # bytes covered by one metadata checksum
DATA_BLOCK_SIZE: Final = 16 << 20  # bytes covered by one data checksum

HEADER_DTYPE: Final = np.dtype(
    [
        ("magic", "S8"),  # 0
        ("version", "<u4"),  # 8
        ("header_size", "<u4"),  # 12
        ("num_samples", "<u8"),  # 16
        ("num_fields", "<u4"),  # 24
        ("flags", "<u4"),  # 28
        ("file_size", "<u8"),  # 32
        ("field_table_offset", "<u8"),  # 40
        ("field_table_size", "<u8"),  # 48
        ("metadata_offset", "<u8"),  # 56
        ("metadata_row_size", "<u8"),  # 64
        ("data_offset", "<u8"),  # 72
        ("data_size", "<u8"),  # 80
        ("heap_offset", "<u8"),  # 88
        ("checksum_offset", "<u8"),  # 96
        ("metadata_block_size", "<u8"),  # 104
        ("data_block_size", "<u8"),  # 112
        ("field_table_crc", "<u4"),  # 120
        ("checksum_table_crc", "<u4"),  # 124
        ("reserved", "S124"),  # 128
        ("header_crc", "<u4"),  # 252: CRC-32 of bytes 0..251
    ]
)
assert HEADER_DTYPE.itemsize == HEADER_SIZE  # noqa: S101 - a property of the constants above


def align(offset: int, alignment: int = ALIGNMENT) -> int:
    """Round ``offset`` up to the next multiple of ``alignment``."""
    return (offset + alignment - 1) // alignment * alignment


def crc32(data: bytes | memoryview | np.ndarray, value: int = 0) -> int:
    """CRC-32 (zlib's polynomial) of a buffer, as an unsigned int; ``value``: the CRC of the bytes before it."""
    return _crc32(data.data if isinstance(data, np.ndarray) else data, value) & 0xFFFFFFFF


def num_blocks(size: int, block_size: int) -> int:
    """Number of checksum blocks that cover ``size`` bytes."""
    return (size + block_size - 1) // block_size


def pack_header(values: dict[str, int]) -> bytes:
    """Build the 256 header bytes from named values; fills magic, version and CRC."""
    header = np.zeros((), dtype=HEADER_DTYPE)
    header["magic"] = MAGIC
    header["version"] = FORMAT_VERSION
    header["header_size"] = HEADER_SIZE
    for key, value in values.items():
        header[key] = value
    raw = bytearray(header.tobytes())
    raw[252:256] = crc32(bytes(raw[:252])).to_bytes(4, "little")
    return bytes(raw)
