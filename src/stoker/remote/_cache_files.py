"""The shard cache's files on disk: their names, their locks, and what a scan of the cache's folders finds.

:mod:`stoker.remote._cache` describes the layout and the protocol (and
:mod:`stoker.remote._cache_room` how the limit holds); this module is their
vocabulary:

- an *entry* is ``<key>@<ident>``: the object's key, percent-quoted, and what
  the file holds; its complete file has that name, its download in progress is
  ``.<entry>.<bytes>.part`` (``<bytes>``: the disk reserved for it) and its
  locks are ``.<entry>.lock``, ``.pin`` and ``.ahead``;
- :func:`lock` takes a ``flock`` on a lock file that nobody can swap: the file
  is created with ``O_EXCL`` or opened without following a link, and checked,
  once locked, to still be the file of that name;
- :func:`scan` lists what the folders hold, with the disk each thing takes
  (``st_blocks``, as ``du`` counts; a download at least its reservation);
- a *store folder* is one the cache made: 16 hex digits, holding the empty
  file :data:`MARKER`; nothing else in ``cache_dir`` is ever counted, evicted
  or deleted (a user's folder of 16 hex digits included);
- :class:`Index` is one process's view of what the store folders hold, kept
  current by the changes it makes and, when another process changed something
  (the root lock's generation moved), by a look at the folders' names alone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import os
import random
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple
from urllib.parse import quote, unquote

from stoker import _cache_roots
from stoker.errors import StokerError

#: the root's lock file: held exclusively to change any folder of the cache, shared to measure it
ROOT_LOCK = ".lock"
PART = ".part"
#: the empty file the cache writes in each store folder it makes: a folder without it is not the cache's
MARKER = ".stoker-store"


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
    """The key and the ident of an entry (``<quoted key>@<ident>``, as :func:`entry_name` makes it).

    Raises:
        ValueError: ``entry`` has no ``@``: no file the cache writes (a stray file in a store's folder).
    """
    stem, at, ident = entry.rpartition("@")
    if not at:
        raise ValueError(f"{entry!r} is not a cache entry: expected '<quoted key>@<ident>'")
    return unquote(stem), ident


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
def locked(path: Path, mode: int, file_mode: int) -> Iterator[int]:
    """Hold ``flock(mode)`` on the lock file ``path`` for the block (waiting for it); its descriptor."""
    fd = lock(path, mode, True, file_mode)
    assert fd is not None  # noqa: S101 - blocking
    try:
        yield fd
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


def is_store_folder(path: Path) -> bool:
    """Whether ``path`` is a store folder the cache made: 16 hex digits, a folder (not a link), holding :data:`MARKER`."""
    name = path.name
    if len(name) != 16 or not all(c in "0123456789abcdef" for c in name):
        return False
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode) and stat.S_ISREG(os.lstat(path / MARKER).st_mode)
    except OSError:
        return False


def folders(cache_dir: Path) -> list[Path]:
    """Every store folder in the cache (16 hex digits and the :data:`MARKER`: a user's folder of such a name is not one)."""
    out = []
    with os.scandir(cache_dir) as it:
        for entry in it:
            name = entry.name
            if len(name) == 16 and entry.is_dir(follow_symlinks=False) and is_store_folder(Path(entry.path)):
                out.append(Path(entry.path))
    return out


def _item(where: Path, name: str, st: os.stat_result) -> Item:
    """What the entry ``name`` of the store folder ``where`` is, from its ``lstat``."""
    disk = st.st_blocks * 512
    if not stat.S_ISREG(st.st_mode):
        return Item("other", where, name, "", disk, 0.0)
    if not name.startswith("."):
        return Item("file", where, name, name, disk, st.st_mtime)
    if name.endswith(PART):
        entry, _, reserved = name[1 : -len(PART)].rpartition(".")
        with contextlib.suppress(ValueError):
            disk = max(disk, int(reserved))
        return Item("part", where, name, entry, disk, st.st_size)
    return Item("other", where, name, name[1:].rpartition(".")[0], disk, 0.0)


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
                try:
                    st = item.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                yield _item(where, item.name, st)


class _Folder:
    """What the index knows of one store folder: every name in it (oldest first), its disk, its downloads."""

    __slots__ = ("disk", "draws", "files", "items", "parts", "snapshot", "strange", "used")

    def __init__(self) -> None:
        self.items: dict[str, Item] = {}  # everything, by name
        self.files: dict[str, Item] = {}  # the complete files, in the order they appeared (oldest first)
        self.parts: set[str] = set()  # downloads in progress
        self.strange: set[str] = set()  # not regular files (a planted link): removed by the next reservation
        self.used = 0  # the disk of its items [bytes]
        self.disk = 0  # the folder's own blocks [bytes]
        self.snapshot: list[Item] = []  # its complete files when the list was made (for random draws: see Index.candidates)
        self.draws = 0  # draws left before the list is made again

    def add(self, item: Item) -> None:
        self.remove(item.name)
        self.items[item.name] = item
        self.used += item.disk
        if item.kind == "file":
            self.files[item.name] = item
        elif item.kind == "part":
            self.parts.add(item.name)
        elif item.kind == "other" and not item.entry and item.name != MARKER:
            self.strange.add(item.name)

    def remove(self, name: str) -> None:
        old = self.items.pop(name, None)
        if old is not None:
            self.used -= old.disk
            self.files.pop(name, None)
            self.parts.discard(name)
            self.strange.discard(name)


class Index:
    """One process's view of what the store folders of ``cache_dir`` hold, to reserve without looking at every file.

    Used under the root lock only (the caller holds it, and :attr:`mutex` for
    the threads of this process that hold it shared). Every change the cache
    makes to a store folder is made under the exclusive root lock and moves the
    root lock file's *generation* (its size: a sparse file, no disk); :meth:`sync`
    finds the view current when the generation is the one it last saw, and
    otherwise lists the folders' names (no ``stat`` but of new names).
    """

    #: with more complete files than this in a folder, an eviction picks among a sample of this many (see :meth:`candidates`)
    EXACT = 512
    #: the view is looked at again after this long even if the generation did not move (what was changed by hand) [seconds]
    LOOK_EVERY = 30.0

    def __init__(self, cache_dir: Path) -> None:
        self.cache_dir = cache_dir
        self.mutex = threading.Lock()
        self.generation = -1  # the generation the view is of (-1: never looked)
        self.looked = 0.0  # when the folders' names were last listed [time.monotonic()]
        self.folders: dict[Path, _Folder] = {}
        self.root_disk = 0
        self.changed = False  # set by add and remove: the holder of the exclusive lock moves the generation

    # ---- keeping it current ------------------------------------------------------------------------
    def sync(self, generation: int) -> None:
        """Make the view current (the caller holds the root lock, whose generation is ``generation``)."""
        if generation != self.generation or time.monotonic() - self.looked > self.LOOK_EVERY:
            self.looked = time.monotonic()
            present = set(folders(self.cache_dir))
            for gone in set(self.folders) - present:
                del self.folders[gone]
            for where in present:
                self._look(where)
            self.generation = generation
        with contextlib.suppress(OSError):
            self.root_disk = os.lstat(self.cache_dir).st_blocks * 512
        for where, f in self.folders.items():
            try:
                f.disk = os.lstat(where).st_blocks * 512
            except OSError:
                f.disk = 0

    def _look(self, where: Path) -> None:
        """Bring one folder's view up to date by its names: ``stat`` new names only (a new folder: all, oldest first)."""
        f = self.folders.get(where)
        try:
            names = set(os.listdir(where))
        except OSError:
            self.folders.pop(where, None)
            return
        fresh = f is None
        if f is None:
            f = self.folders[where] = _Folder()
        for name in f.items.keys() - names:
            f.remove(name)
        found = []
        for name in names - f.items.keys() if not fresh else names:
            try:
                found.append(_item(where, name, os.lstat(where / name)))
            except FileNotFoundError:
                continue
        for item in sorted(found, key=lambda i: i.mtime if i.kind == "file" else 0.0):
            f.add(item)

    def add_folder(self, where: Path) -> None:
        """Note the store folder ``where`` (the caller just made it, under the exclusive root lock)."""
        self.changed = True
        self._look(where)

    def add(self, where: Path, name: str) -> None:
        """Note what is now at ``where / name`` (the caller just made it, under the exclusive root lock)."""
        self.changed = True
        f = self.folders.get(where)
        if f is None:
            return  # a folder this view does not hold: the next sync finds it
        try:
            f.add(_item(where, name, os.lstat(where / name)))
        except FileNotFoundError:
            f.remove(name)

    def remove(self, where: Path, name: str) -> None:
        """Note that ``where / name`` is gone (the caller removed it, under the exclusive root lock)."""
        self.changed = True
        f = self.folders.get(where)
        if f is not None:
            f.remove(name)

    # ---- reading it ----------------------------------------------------------------------------------
    def used(self) -> int:
        """The disk of the store folders and all they hold, and of the root folder [bytes] (as :func:`scan` sums)."""
        return self.root_disk + sum(f.disk + f.used for f in self.folders.values())

    def parts(self) -> list[Item]:
        """Every download in progress (of every process)."""
        return [f.items[n] for f in self.folders.values() for n in f.parts]

    def strange(self) -> list[Path]:
        """Every entry of a store folder that is not a regular file (a planted link)."""
        return [where / n for where, f in self.folders.items() for n in f.strange]

    def files(self, where: Path | None = None, *, others: bool = False) -> list[Item]:
        """The complete files of ``where`` (``others``: of every folder but ``where``; ``None``: of all), oldest first
        in each folder (a copy: the caller may change the index while it goes through them)."""
        out: list[Item] = []
        for folder, f in self.folders.items():
            if where is None or (folder != where if others else folder == where):
                out += f.files.values()
        return out

    def candidates(self, where: Path, skip: str) -> tuple[list[Item], bool]:
        """The complete files of ``where`` (but ``skip``) to order by priority for an eviction, and whether they are a
        sample: all of them, or, with more than :attr:`EXACT`, the oldest half of :attr:`EXACT` and a random half of all
        (drawn from a list of the folder's files made again every :attr:`EXACT` draws: a few ms at 10^5 files): the
        eviction order is then approximate, the lowest priority of the sample, not of all."""
        f = self.folders.get(where)
        if f is None:
            return [], False
        if len(f.files) <= self.EXACT:
            return [i for i in f.files.values() if i.name != skip], False
        half = self.EXACT // 2
        if f.draws <= 0 or not f.snapshot:
            f.snapshot, f.draws = list(f.files.values()), self.EXACT
        f.draws -= 1
        chosen = {i.name: i for i in itertools.islice(f.files.values(), half)}
        for i in random.sample(f.snapshot, min(half, len(f.snapshot))):
            if f.files.get(i.name) is i:  # (not evicted since the list was made)
                chosen.setdefault(i.name, i)
        chosen.pop(skip, None)
        return list(chosen.values()), True
