"""Writing a folder dataset as a transaction: new shards under new names, the manifest published last.

Every writer of a folder dataset (:class:`~stoker.dataset.shards.ShardedWriter`,
``write_shards``, ``ShardedWriter.from_webdataset``,
:func:`stoker.convert.arrow.write_arrow` and its Parquet and Hugging Face
front ends, :func:`stoker.convert.ray.write_ray_dataset`) goes through a
:class:`FolderTransaction`::

    begin     mkdir; lock the folder (flock, one write at a time); refuse an
              existing dataset unless overwrite; delete what earlier writes
              left: shard files no manifest lists, stale temporaries
    write     shard k of this write is shard-g<GEN>-<k>.stoker, GEN a fresh
              random generation (8 hex digits): no file of the dataset being
              replaced is touched, and no name is ever reused for other bytes
    commit    build the manifest from the shards' headers, publish it through
              the commit point (the single moment the new dataset appears),
              then delete the previous generation's shards
    abort     (an exception, SIGTERM, a failed commit) delete this
              generation's shards; the published manifest is unchanged

A reader finds the dataset through the manifest only (a folder without one is
refused, see :func:`stoker.dataset.shards.resolve_dataset`): before the commit
it reads the previous dataset exactly, after it the new one, never a mix. A
write killed outright (SIGKILL, power loss) leaves unlisted shard files and
temporaries, which nothing reads and the next write into the folder deletes.

The commit point is an object of its own (:class:`CommitPoint`: the current
manifest, and ``publish``), so that another store (an object store: upload the
shards, then put the manifest) can stand in for :class:`LocalManifest`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import uuid
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Protocol

from stoker.dataset._manifest import MANIFEST_NAME, build_manifest, parse_manifest
from stoker.errors import DatasetFormatError
from stoker.format._durable import TMP_MARK, clean_stale_temporaries, sigterm_unwinds, write_file_atomically

__all__ = ["CommitPoint", "FolderTransaction", "LocalManifest", "shard_file_name", "write_manifest"]

#: a shard file a writer made: this version's ``shard-g<GEN>-<k>.stoker``, or ``shard-<k>.stoker`` of earlier versions
SHARD_FILE = re.compile(r"shard-(?:g(?P<generation>[0-9a-f]{8})-)?(?P<index>\d{5,})\.stoker")
_TEMPORARY = re.compile(r"\.(?P<name>.+)" + re.escape(TMP_MARK) + r"\d+-[0-9a-f]+")


def shard_file_name(generation: str, index: int) -> str:
    """The file name of shard ``index`` of generation ``generation``: ``shard-g1f0c9a3e-00007.stoker``."""
    return f"shard-g{generation}-{index:05d}.stoker"


def new_generation() -> str:
    """A fresh generation: 8 random hex digits."""
    return uuid.uuid4().hex[:8]


class CommitPoint(Protocol):
    """Where a folder dataset becomes visible: its manifest, published last and all at once."""

    def current(self) -> bytes | None:
        """The published manifest, or ``None`` when there is none."""
        ...

    def publish(self, manifest: bytes) -> None:
        """Make ``manifest`` the dataset's: a reader sees the previous one or this one, never a part; durable on return."""
        ...


class LocalManifest:
    """The commit point of a local (or shared POSIX) folder: ``manifest.stoker.json`` written by rename.

    :meth:`publish` writes a temporary next to it, fsyncs it, renames it onto
    the manifest and fsyncs the folder (:func:`stoker.format._durable.write_file_atomically`).
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.path = Path(directory) / MANIFEST_NAME

    def current(self) -> bytes | None:
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            return None

    def publish(self, manifest: bytes) -> None:
        write_file_atomically(self.path, manifest)


def write_manifest(directory: str | os.PathLike[str], shards: Sequence[str | os.PathLike[str]]) -> Path:
    """Write ``directory``'s manifest listing ``shards`` in this order (atomically), for files you wrote yourself.

    Every shard must lie in ``directory`` and have the same fields as the
    first. Nothing else is written or deleted: the writers of this library
    commit their own shards (:class:`FolderTransaction`).

    Returns:
        The manifest's path.

    Raises:
        DatasetFormatError: a shard is missing, corrupt, outside the folder, or
            has other fields than the first shard (both named).
    """
    commit = LocalManifest(directory)
    commit.publish(build_manifest(directory, shards, generation=None))
    return commit.path


# ---- the folder's lock -------------------------------------------------------------------------------
_held: set[int] = set()  # lock descriptors of this process, closed in forked children (the lock stays the parent's)
_fork_hook = False


def _close_in_child() -> None:
    for fd in list(_held):
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


def _lock_folder(folder: Path) -> int:
    """An exclusive, non-blocking ``flock`` on the folder itself; returns its descriptor (-1: no locks there).

    Raises:
        RuntimeError: another process (or transaction) holds it: a write into this folder is running.
    """
    global _fork_hook
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(
            f"{folder}: another write into this folder is running (it holds the folder's lock); "
            "a folder dataset is written by one writer at a time: wait for that write to end"
        ) from None
    except OSError:  # a file system without locks: one writer at a time is then the user's to keep
        os.close(fd)
        return -1
    if not _fork_hook and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_close_in_child)
        _fork_hook = True
    _held.add(fd)
    return fd


def _unlock(fd: int) -> None:
    if fd >= 0 and fd in _held:
        _held.discard(fd)
        os.close(fd)


class FolderTransaction:
    """One write of a folder dataset: shards of a new generation, then the manifest, then the old shards removed.

    Use it as a context manager (which also makes SIGTERM unwind through the
    abort, see :func:`~stoker.format._durable.sigterm_unwinds`), or call
    :meth:`begin`, :meth:`commit` and :meth:`abort` yourself (a Ray datasink
    does, from its callbacks)::

        with FolderTransaction(folder) as tx:
            for k, part in enumerate(parts):
                DatasetWriter(tx.shard_path(k), fields).from_arrays(part)
            tx.commit([tx.shard_path(k) for k in range(len(parts))])

    Leaving the block without :meth:`commit` aborts.

    Args:
        directory: the dataset's folder (created if missing).
        overwrite: replace a dataset already published there; ``False``
            refuses one (``FileExistsError``), and refuses shard files of an
            earlier stoker version that no manifest lists.
        commit_point: where the manifest is published; default
            :class:`LocalManifest` of ``directory``.
        generation: the generation's name (8 hex digits); default a fresh one.

    Attributes:
        state: ``"new"``, ``"open"`` (begun), ``"committed"`` or ``"aborted"``.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        overwrite: bool = True,
        commit_point: CommitPoint | None = None,
        generation: str | None = None,
    ) -> None:
        self.folder = Path(directory)
        self.overwrite = bool(overwrite)
        self.commit_point: CommitPoint = commit_point if commit_point is not None else LocalManifest(self.folder)
        self.generation = generation if generation is not None else new_generation()
        if not re.fullmatch(r"[0-9a-f]{8}", self.generation):
            raise ValueError(f"generation must be 8 lowercase hex digits; got {self.generation!r}")
        self.state = "new"
        self._lock = -1
        self._unlocker: weakref.finalize | None = None
        self._session: contextlib.AbstractContextManager[None] | None = None

    # ---- names -----------------------------------------------------------------------------------------
    def shard_name(self, index: int) -> str:
        """The file name of this generation's shard ``index``."""
        return shard_file_name(self.generation, index)

    def shard_path(self, index: int) -> Path:
        """The path of this generation's shard ``index``."""
        return self.folder / self.shard_name(index)

    def _mine(self, name: str) -> bool:
        match = SHARD_FILE.fullmatch(name)
        return match is not None and match["generation"] == self.generation

    # ---- steps -----------------------------------------------------------------------------------------
    def begin(self) -> FolderTransaction:
        """Create and lock the folder, refuse or accept what it holds, delete what earlier writes left.

        Raises:
            FileExistsError: a dataset (or an earlier version's shards) is there and not ``overwrite``.
            RuntimeError: another write into the folder is running, or this transaction was begun before.
        """
        if self.state != "new":
            raise RuntimeError(f"this transaction of {self.folder} is {self.state}; begin() starts a new one only")
        self.folder.mkdir(parents=True, exist_ok=True)
        self._acquire()
        try:
            published, listed = self._published()
            legacy = [] if published else sorted(n for n in self._names() if (m := SHARD_FILE.fullmatch(n)) and not m["generation"])
            if (published or legacy) and not self.overwrite:
                what = MANIFEST_NAME if published else f"{legacy[0]}, ... (shards of an earlier stoker, no manifest)"
                raise FileExistsError(f"{self.folder} already holds a stoker dataset ({what}): pass overwrite=True or use an empty folder")
            self._remove_unlisted(listed)
        except BaseException:
            self._release()
            raise
        self.state = "open"
        return self

    def commit(self, shards: Sequence[str | os.PathLike[str]]) -> Path:
        """Publish the manifest listing ``shards`` (this generation's, in order), then delete the previous generation.

        Returns:
            The manifest's path.

        Raises:
            ValueError: no shards, or a shard of another generation.
            DatasetFormatError: a shard is missing, corrupt, or has other fields than the first.
            RuntimeError: the transaction was committed or aborted already.
        """
        if self.state not in ("new", "open"):
            raise RuntimeError(f"this transaction of {self.folder} is {self.state}; it cannot commit")
        if self.state == "new":
            self._acquire()  # a Ray datasink whose on_write_start did not run: lock for the commit at least
        names = [Path(s).name for s in shards]
        strangers = [n for n in names if not self._mine(n)]
        if strangers:
            raise ValueError(f"commit() lists shards of this generation ({self.shard_name(0)}, ...) only; got {strangers}")
        manifest = build_manifest(self.folder, [self.folder / n for n in names], self.generation)
        self.commit_point.publish(manifest)
        self.state = "committed"
        try:
            self._remove_unlisted(set(names))
        finally:
            self._release()
        return self.folder / MANIFEST_NAME

    def abort(self) -> None:
        """Delete this generation's shards and unlock; the published manifest (if any) is left as it was.

        Does nothing after :meth:`commit`, nor when the manifest already lists
        this generation (the commit published it and was interrupted right after).
        """
        if self.state in ("committed", "aborted"):
            self._done()
            return
        try:
            if self._published_generation() == self.generation:
                self.state = "committed"
                return
            self._delete_generation()
            self.state = "aborted"
        finally:
            self._done()

    def _delete_generation(self) -> None:
        """:meth:`abort`'s deletion: this generation's shards in the folder."""
        for name in self._names():
            if self._mine(name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.folder / name)

    def _done(self) -> None:
        """What ends the transaction, however it ended: unlock."""
        self._release()

    # ---- as a context manager ------------------------------------------------------------------------
    @contextlib.contextmanager
    def _block(self) -> Iterator[None]:
        with sigterm_unwinds():  # SIGTERM, like Ctrl-C, goes through abort() before the process ends
            self.begin()
            try:
                yield
            finally:
                if self.state != "committed":
                    self.abort()

    def __enter__(self) -> FolderTransaction:
        self._session = self._block()
        self._session.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool | None:
        session, self._session = self._session, None
        assert session is not None  # noqa: S101 - __exit__ follows __enter__
        return session.__exit__(exc_type, exc, tb)

    # ---- the folder ------------------------------------------------------------------------------------
    def _names(self) -> list[str]:
        try:
            return [entry.name for entry in os.scandir(self.folder)]
        except FileNotFoundError:
            return []

    def _published(self) -> tuple[bool, set[str]]:
        """Whether a manifest is published, and the shard names it lists.

        A manifest this version cannot read (corrupt, or of a later version)
        may list any file: every file counts as listed until the commit replaces it.
        """
        data = self.commit_point.current()
        if data is None:
            return False, set()
        try:
            manifest = parse_manifest(data, self.folder / MANIFEST_NAME)
        except DatasetFormatError:
            return True, set(self._names())
        return True, {entry["name"] for entry in manifest["shards"]}

    def _published_generation(self) -> str | None:
        data = self.commit_point.current()
        if data is None:
            return None
        try:
            return parse_manifest(data, self.folder / MANIFEST_NAME).get("generation")
        except DatasetFormatError:
            return None

    def _remove_unlisted(self, keep: set[str]) -> None:
        """Delete shard files of other generations that ``keep`` does not name, and temporaries of dead writers."""
        temporaries = set()
        for name in self._names():
            match = SHARD_FILE.fullmatch(name)
            if match is not None and name not in keep and match["generation"] != self.generation:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.folder / name)
            tmp = _TEMPORARY.fullmatch(name)
            if tmp is not None and (SHARD_FILE.fullmatch(tmp["name"]) or tmp["name"] == MANIFEST_NAME):
                temporaries.add(tmp["name"])
        for name in sorted(temporaries):
            clean_stale_temporaries(self.folder / name)  # only those whose process is gone and no one holds locked

    def _acquire(self) -> None:
        self._lock = _lock_folder(self.folder)
        self._unlocker = weakref.finalize(self, _unlock, self._lock)  # a transaction dropped while begun unlocks

    def _release(self) -> None:
        if self._unlocker is not None:
            self._unlocker()
            self._unlocker = None
        self._lock = -1
