"""The shard cache's files on disk: their names, their locks, and what a scan of the cache's folders finds.

:mod:`stoker.remote._cache` describes the layout and the protocol; this module
is its vocabulary:

- an *entry* is ``<key>@<ident>``: the object's key, percent-quoted, and what
  the file holds; its complete file has that name, its download in progress is
  ``.<entry>.<bytes>.part`` (``<bytes>``: the disk reserved for it) and its
  locks are ``.<entry>.lock``, ``.pin`` and ``.ahead``;
- :func:`lock` takes a ``flock`` on a lock file that nobody can swap: the file
  is created with ``O_EXCL`` or opened without following a link, and checked,
  once locked, to still be the file of that name;
- :func:`scan` lists what the folders hold, with the disk each thing takes
  (``st_blocks``, as ``du`` counts; a download at least its reservation).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple
from urllib.parse import quote, unquote

from stoker import _cache_roots
from stoker.errors import StokerError

#: the root's lock file: held exclusively to change any folder of the cache, shared to measure it
ROOT_LOCK = ".lock"
PART = ".part"


def entry_name(key: str, ident: str) -> str:
    """The entry of ``key`` with content ``ident``: ``<quoted key>@<ident>``."""
    name = quote(key, safe="")
    return f"{'%2E' + name[1:] if name.startswith('.') else name}@{ident}"


def check_ident(ident: str) -> str:
    """``ident`` if it is letters, digits and ``-`` (part of a file name), else ``ValueError``."""
    if not ident or not all(c.isalnum() or c == "-" for c in ident):
        raise ValueError(f"ident must be letters, digits and '-'; got {ident!r}")
    return ident


def key_ident(entry: str) -> tuple[str, str]:
    """The key and the ident of an entry (an old version's file without ``@``: its key and ``""``)."""
    stem, at, ident = entry.rpartition("@")
    return (unquote(stem), ident) if at else (unquote(entry), "")


def is_file(path: Path, size: int | None = None) -> bool:
    """Whether ``path`` is a regular file (not a link), of ``size`` bytes if given."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and (size is None or st.st_size == size)


def lock(path: Path, mode: int, blocking: bool, file_mode: int) -> int | None:
    """A descriptor of ``path`` (created if missing, no link followed) holding ``flock(mode)``, or ``None`` when someone
    holds it and not ``blocking``. The lock is on the file that has that name now (it is checked after locking)."""
    for _ in range(100):
        try:
            fd = _cache_roots.create_file(path, file_mode, os.O_RDWR)
        except FileExistsError:
            try:
                fd = _cache_roots.open_file(path, os.O_RDWR)
            except FileNotFoundError:
                continue  # deleted since: make it again
            except PermissionError:  # another user's lock file in a shared cache: flock needs no write access
                fd = _cache_roots.open_file(path, os.O_RDONLY)
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)  # a link planted where a lock file goes: never followed, removed
                continue
        try:
            fcntl.flock(fd, mode | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.path.samestat(os.fstat(fd), os.lstat(path))
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # the file was deleted (and maybe made again) by a process that held it: lock the new one
    raise StokerError(f"cannot take the lock {path}: it keeps being replaced")


@contextlib.contextmanager
def locked(path: Path, mode: int, file_mode: int) -> Iterator[None]:
    """Hold ``flock(mode)`` on the lock file ``path`` for the block (waiting for it)."""
    fd = lock(path, mode, True, file_mode)
    assert fd is not None  # noqa: S101 - blocking
    try:
        yield
    finally:
        os.close(fd)


class Item(NamedTuple):
    """One thing the cache's folders hold (see :func:`scan`)."""

    kind: str  # "file" (complete), "part" (a download, at its reservation), "folder", "other" (locks, links, leftovers)
    folder: Path  # where it is
    name: str  # its file name
    entry: str  # the entry it belongs to ("<key>@<ident>"; "" for a folder)
    disk: int  # the disk it takes [bytes] (a part: at least its reservation)
    mtime: float  # (a part: its bytes so far)


def folders(cache_dir: Path) -> list[Path]:
    """Every store's folder in the cache (16 hex digits)."""
    out = []
    with os.scandir(cache_dir) as it:
        for entry in it:
            name = entry.name
            if len(name) == 16 and all(c in "0123456789abcdef" for c in name) and entry.is_dir(follow_symlinks=False):
                out.append(Path(entry.path))
    return out


def scan(cache_dir: Path, folder: Path | None = None) -> Iterator[Item]:
    """Everything the store folders of ``cache_dir`` hold (or ``folder`` holds), and the folders themselves."""
    where_all = [folder] if folder is not None else folders(cache_dir)
    if folder is None:
        with contextlib.suppress(OSError):
            yield Item("folder", cache_dir, "", "", os.lstat(cache_dir).st_blocks * 512, 0.0)
    for where in where_all:
        try:
            yield Item("folder", where, "", "", os.lstat(where).st_blocks * 512, 0.0)
            it = os.scandir(where)
        except OSError:
            continue
        with it:
            for item in it:
                name = item.name
                try:
                    st = item.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                disk = st.st_blocks * 512
                if not stat.S_ISREG(st.st_mode):
                    yield Item("other", where, name, "", disk, 0.0)
                elif not name.startswith("."):
                    yield Item("file", where, name, name, disk, st.st_mtime)
                elif name.endswith(PART):
                    entry, _, reserved = name[1 : -len(PART)].rpartition(".")
                    with contextlib.suppress(ValueError):
                        disk = max(disk, int(reserved))
                    yield Item("part", where, name, entry, disk, st.st_size)
                else:
                    yield Item("other", where, name, name[1:].rpartition(".")[0], disk, 0.0)
