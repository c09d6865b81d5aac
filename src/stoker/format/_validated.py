"""Recorded results of full metadata validations, so that a big file is checked once, not at every open.

A record is a small file in ``<cache>/validated/`` (``<cache>`` is
``$STOKER_CACHE_DIR``, else ``$XDG_CACHE_HOME/stoker``, else
``~/.cache/stoker``, as for the fused-pipeline cache). Its name is a hash of
the file's identity and its content that identity in full::

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
import tempfile
from pathlib import Path

#: bump when validate_metadata checks more: records made by older rules then no longer match
RULES_VERSION = 1


def cache_root() -> Path:
    """The stoker cache folder (``$STOKER_CACHE_DIR``, else ``$XDG_CACHE_HOME/stoker``, else ``~/.cache/stoker``)."""
    root = os.environ.get("STOKER_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "stoker")
    return Path(root)


def identity_key(path: Path, st: os.stat_result, header_crc: int, checksum_table_crc: int) -> str:
    """The record key of a file: JSON of everything that changes when the file does."""
    real = os.path.realpath(path)
    fields = [RULES_VERSION, real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, header_crc, checksum_table_crc]
    return json.dumps(fields, separators=(",", ":"))


def _record_path(key: str) -> Path:
    return cache_root() / "validated" / hashlib.sha256(key.encode()).hexdigest()[:40]


def is_recorded(key: str) -> bool:
    """Whether a full validation of the file with this key succeeded before."""
    try:
        return _record_path(key).read_text("utf-8") == key
    except (OSError, UnicodeDecodeError):
        return False


def record(key: str) -> None:
    """Record a successful full validation (best effort: an unwritable cache folder records nothing)."""
    target = _record_path(key)
    with contextlib.suppress(OSError):
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(key)
            os.replace(tmp, target)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def forget(key: str) -> None:
    """Drop the record of this key, if any (a validation failed after all)."""
    with contextlib.suppress(OSError):
        _record_path(key).unlink()
