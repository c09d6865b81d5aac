"""Where stoker keeps what it caches on disk, and how it makes, checks and opens what is there.

One function decides the roots, :func:`cache_root`: ``$STOKER_CACHE_DIR``,
else the user's cache folder's ``stoker`` (``$XDG_CACHE_HOME/stoker``, else
``~/.cache/stoker`` on Linux; ``~/Library/Caches/stoker`` on macOS;
``%LOCALAPPDATA%/stoker`` on Windows). Inside it::

    remote/      shards of datasets in object storage: the default ``cache_dir``
                 (:func:`remote_cache_dir`); every byte read from it is checked first
    fused/       generated pipeline modules and Numba's compiled code of them: code
                 that is imported and run (:func:`private_dir`)
    validated/   records of metadata validations: a record skips a check (:func:`private_dir`)

What is cached is trusted only as far as the folder holding it:

- every folder stoker makes is ``0700`` and every file ``0600``, whatever the
  umask (a shared data cache, opted into, follows its folder's own group bits,
  never with write access for others to the files);
- an existing folder must belong to this user and be writable by no one else,
  and no folder above it may be writable by others unless it is sticky
  (``/tmp``), nor belong to another user than root and this one (its owner
  could rename what it holds): else :class:`~stoker.errors.UnsafeCacheError` for a data cache
  (unless ``shared``), and no disk cache at all (a warning, once) for code and
  records, which are never read from a folder others can write;
- files are opened without following symbolic links (``O_NOFOLLOW``), and
  created with ``O_EXCL``: a link or a file planted under a name stoker uses is
  never followed, read or written through.

This module imports nothing of stoker but :mod:`stoker.errors`: the format,
the remote store and the pipeline compiler all use it.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

from stoker.errors import UnsafeCacheError

__all__ = [
    "CacheFolder",
    "CacheWarning",
    "cache_root",
    "create_file",
    "kernels_dir",
    "open_file",
    "open_folder",
    "private_dir",
    "remote_cache_dir",
    "write_file",
]

ENV = "STOKER_CACHE_DIR"
#: where the library's compiled kernels are cached instead of the root's ``kernels/`` (checked private the same way):
#: the kernels depend only on stoker's sources, so processes with caches of their own may share them (a test suite's
#: child processes do)
KERNELS_ENV = "STOKER_CACHE_KERNELS_DIR"
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_WARNED: set[str] = set()
_WARN_LOCK = threading.Lock()


class CacheWarning(UserWarning):
    """A cache folder is not private: stoker works without it (compiles again, validates again)."""


def cache_root() -> Path:
    """The root of stoker's caches: ``$STOKER_CACHE_DIR``, else the user's cache folder's ``stoker``."""
    root = os.environ.get(ENV)
    if root:
        return Path(root).expanduser()
    if sys.platform == "darwin":
        base = Path("~/Library/Caches").expanduser()
    elif sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path("~/AppData/Local").expanduser())
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path("~/.cache").expanduser())
    return base / "stoker"


def remote_cache_dir() -> Path:
    """The default ``cache_dir`` of datasets in object storage: ``cache_root() / "remote"``."""
    return cache_root() / "remote"


# ---- folders -------------------------------------------------------------------------------------------
def _uid() -> int:
    return os.geteuid() if hasattr(os, "geteuid") else -1


def _problem(path: Path, st: os.stat_result, *, own: bool) -> str | None:
    """Why others could change what ``path`` (a folder) holds, or ``None``."""
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    uid = _uid()
    if own and uid >= 0 and st.st_uid != uid:
        return f"belongs to another user (uid {st.st_uid}; this process runs as uid {uid})"
    if st.st_mode & 0o022 and not (not own and st.st_mode & stat.S_ISVTX):
        who = "its group and others" if st.st_mode & 0o022 == 0o022 else ("its group" if st.st_mode & 0o020 else "others")
        return f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def check_folder(path: Path) -> str | None:
    """Why the folder ``path`` is not private (its owner, its mode, or a folder above it that another user can change:
    writable by others and not sticky, or owned by another user than root and this one), or ``None``."""
    real = Path(os.path.realpath(path))
    try:
        problem = _problem(real, os.stat(real), own=True)
    except OSError as exc:
        return f"cannot be examined ({exc.strerror or exc})"
    if problem is not None:
        return problem
    uid = _uid()
    for above in real.parents:  # someone who can rename entries of a folder above can swap this one
        try:
            st = os.stat(above)
        except OSError:
            continue
        if uid >= 0 and st.st_uid not in (0, uid):  # its owner can rename what it holds (sticky or not: an owner can chmod)
            return (
                f"lies inside {above}, which belongs to another user (uid {st.st_uid}; this process runs as uid {uid}), "
                "who can rename or replace what it holds"
            )
        problem = _problem(above, st, own=False)
        if problem is not None and "writable" in problem:
            return f"lies inside {above}, which {problem} and is not sticky"
    return None


def _mkdir(path: Path, mode: int) -> None:
    """Make the folder ``path`` with exactly ``mode`` (not less because of the umask); an existing one is left as is."""
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        return
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | O_NOFOLLOW | O_CLOEXEC)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _make_parents(path: Path) -> None:
    """Make ``path`` and the missing folders above it, each ``0700``."""
    missing = []
    p = path
    while not os.path.lexists(p):
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for folder in reversed(missing):
        _mkdir(folder, 0o700)


@dataclass(frozen=True)
class CacheFolder:
    """A cache folder, made or checked by :func:`open_folder`: where stoker's files go, and with which modes.

    Attributes:
        path: the folder (symbolic links above it resolved).
        shared: shared with other users on purpose: checks of its owner and
            mode skipped; what stoker makes in it follows its group bits.
        dir_mode: the mode of the folders stoker makes in it.
        file_mode: the mode of the files stoker makes in it.
    """

    path: Path
    shared: bool = False
    dir_mode: int = 0o700
    file_mode: int = 0o600

    def subfolder(self, name: str) -> Path:
        """The folder ``name`` inside, made with :attr:`dir_mode` if missing and checked.

        Raises:
            UnsafeCacheError: ``name`` is a link, not a folder, or (private) belongs to someone else or is writable by others.
        """
        path = self.path / name
        _mkdir(path, self.dir_mode)
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            raise UnsafeCacheError(path, "is a symbolic link where stoker keeps a folder of its cache; remove it")
        problem = _problem(path, st, own=True) if not self.shared else (None if stat.S_ISDIR(st.st_mode) else "is not a folder")
        if problem is not None:
            raise UnsafeCacheError(path, problem + _FIX)
        return path


_FIX = "; stoker reads and runs what a cache holds, so a cache folder must be yours alone (chmod 700 it, or choose another)"


def open_folder(path: str | os.PathLike[str], *, shared: bool = False) -> CacheFolder:
    """Make the cache folder ``path`` (``0700``, and any missing folder above it) or check the one there.

    Args:
        path: the folder.
        shared: it is shared with other users on purpose (a node's cache for a
            group): it may belong to another user and be writable by its group;
            what stoker makes in it takes its group's bits (folders as the
            folder, files readable but not writable by the group).

    Raises:
        UnsafeCacheError: (not ``shared``) it belongs to another user, or it or
            a folder above it (not sticky) is writable by others; it is not a folder.
    """
    folder = Path(path).expanduser()
    _make_parents(folder)
    real = Path(os.path.realpath(folder))
    try:
        st = os.stat(real)
    except OSError as exc:
        raise UnsafeCacheError(folder, f"cannot be used as a cache folder: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeCacheError(folder, "is not a folder")
    if shared:
        bits = stat.S_IMODE(st.st_mode) & 0o2770 | 0o700  # (a setgid folder's group is kept by the folders made in it)
        return CacheFolder(real, True, bits, bits & 0o640)
    problem = check_folder(real)
    if problem is not None:
        raise UnsafeCacheError(
            folder,
            f"{problem}: another user could plant or change the files stoker reads from it. Use a folder of your own "
            "(chmod 700 it, or choose another cache_dir), or pass cache_shared=True if it is shared with other users on "
            "purpose (every file is then still checked against its manifest's CRC-32s, which finds accidents but not a forgery "
            "by a member of the group: see docs/remote.md)",
        )
    return CacheFolder(real)


def private_dir(name: str) -> Path | None:
    """``cache_root() / name`` for code and records (``"fused"``, ``"validated"``): made ``0700`` and checked private.

    Returns:
        The folder, or ``None`` when it cannot be made or is not private (a
        :class:`CacheWarning` says why, once per process): the caller then does
        without a disk cache. There is no opt-in: code and records are never
        read from a folder that others can write.
    """
    return _private_in(cache_root(), name)


def kernels_dir() -> Path | None:
    """The folder of the library's compiled kernels: ``$STOKER_CACHE_KERNELS_DIR/kernels`` when set, else
    ``private_dir("kernels")``; made ``0700`` and checked private alike (``None``, with a warning once, when it is not)."""
    shared = os.environ.get(KERNELS_ENV)
    return _private_in(Path(shared).expanduser(), "kernels") if shared else private_dir("kernels")


def _private_in(root: Path, name: str) -> Path | None:
    try:
        _make_parents(root)
        problem = check_folder(root)
        if problem is None:
            return CacheFolder(Path(os.path.realpath(root))).subfolder(name)
    except (UnsafeCacheError, OSError) as exc:
        problem = str(exc)
    _warn_once(
        str(root),
        f"stoker's cache {root} {problem}: compiled pipelines and validations are not cached there (every process "
        f"compiles and validates again). If the folder is yours alone, chmod 700 it; else set {ENV} to a folder of your own",
    )
    return None


def _warn_once(key: str, message: str) -> None:
    with _WARN_LOCK:
        if key in _WARNED:
            return
        _WARNED.add(key)
    warnings.warn(message, CacheWarning, stacklevel=3)


# ---- files -------------------------------------------------------------------------------------------
def open_file(path: str | os.PathLike[str], flags: int = os.O_RDONLY) -> int:
    """``os.open(path, flags)`` without following a symbolic link at ``path`` (``OSError`` ``ELOOP`` for one)."""
    return os.open(path, flags | O_NOFOLLOW | O_CLOEXEC)


def create_file(path: str | os.PathLike[str], mode: int = 0o600, flags: int = os.O_WRONLY) -> int:
    """Create the file ``path`` (it must not exist: ``O_EXCL``, no link followed) with exactly ``mode``; its descriptor."""
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)  # the umask removed nothing, added nothing
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_file(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` as the file ``path``, atomically: a new temporary file (``O_EXCL``) renamed over ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # (a crashed writer's of this pid and thread)
    fd = create_file(tmp, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
