"""Recorded results of full metadata validations, so that a big file is checked once, not at every open.

A record is a small file in ``<cache>/validated/`` (``<cache>`` is
:func:`stoker._cache_roots.cache_root`: ``$STOKER_CACHE_DIR``, else
``$XDG_CACHE_HOME/stoker``, else ``~/.cache/stoker``). A record skips a check,
so it is only ever read from a folder of this user's own
(:func:`stoker._cache_roots.private_dir`: ``0700``, owned by the user, writable
by nobody else; otherwise nothing is recorded and every open validates). Its
name is a hash of the file's identity and its content that identity in full::

    (rules version, real path, st_dev, st_ino, size, mtime_ns, header CRC, checksum-table CRC)

A file replaced (renamed over), rewritten or touched gets a new identity, so
its old record no longer matches and the next open validates it again.
Records are written atomically (temporary file, rename); a cache folder that
cannot be written just means no record.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

from stoker import _cache_roots

#: bump when validate_metadata checks more: records made by older rules then no longer match
RULES_VERSION = 1


def identity_key(path: Path, st: os.stat_result, header_crc: int, checksum_table_crc: int) -> str:
    """The record key of a file: JSON of everything that changes when the file does."""
    real = os.path.realpath(path)
    fields = [RULES_VERSION, real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, header_crc, checksum_table_crc]
    return json.dumps(fields, separators=(",", ":"))


def _record_path(key: str) -> Path | None:
    folder = _cache_roots.private_dir("validated")
    return None if folder is None else folder / hashlib.sha256(key.encode()).hexdigest()[:40]


def is_recorded(key: str) -> bool:
    """Whether a full validation of the file with this key succeeded before (a record in a private folder)."""
    path = _record_path(key)
    if path is None:
        return False
    try:
        fd = _cache_roots.open_file(path)
    except OSError:
        return False
    try:
        with os.fdopen(fd, "rb") as fh:
            return fh.read(len(key.encode()) + 1).decode("utf-8") == key
    except (OSError, UnicodeDecodeError):
        return False


def record(key: str) -> None:
    """Record a successful full validation (best effort: a cache folder that cannot be written, or is not private, records nothing)."""
    path = _record_path(key)
    if path is not None:
        with contextlib.suppress(OSError):
            _cache_roots.write_file(path, key.encode("utf-8"))


def forget(key: str) -> None:
    """Drop the record of this key, if any (a validation failed after all)."""
    path = _record_path(key)
    if path is not None:
        with contextlib.suppress(OSError):
            path.unlink()
