"""Writing a dataset to an object store: the folder transaction with the store as its commit point.

Every writer that accepts a folder accepts a URL (``s3://bucket/train/``,
``gs://...``, ``az://...``) through :func:`open_transaction`, which gives a
:class:`~stoker.dataset._transaction.FolderTransaction` for a folder and a
:class:`RemoteTransaction` for a URL. The steps are those of the folder::

    begin     check that the prefix can be written (the bucket exists, writing
              is allowed: a probe object put and deleted), before anything is
              encoded; a local staging folder (a fresh temporary one); refuse
              an existing dataset (the store's manifest) unless overwrite
    write     shard k is written in the staging folder as shard-g<GEN>-<k>.stoker,
              then finish_shard: its header read (for the manifest), the file
              uploaded (multipart when large) and its local copy deleted
    commit    the manifest (the same bytes build_manifest makes for a folder,
              and the retired generations, see below) put last: the one
              request that makes the new dataset visible; then what the
              retention allows is deleted
    abort     this generation's uploaded shards are deleted (listed in the
              store, so a Ray worker's uploads too); the manifest is unchanged

A reader reads the store through its manifest only, so it sees the previous
dataset or the new one, never a part.

**Generations outlive their readers.** A job reading the store holds no open
file there: it downloads shards as its epochs need them, from the manifest it
read at ``Loader()``. So a rewrite does not delete the generation it replaces:
the new manifest records it as *retired* (its name, its shards, since when),
and the generation is deleted by the first write after ``retention`` seconds
have passed (``storage_options={"retention": ...}``, default 7 days, as Delta
Lake keeps the files a table no longer references; 0 deletes it at once). A
running job finishes its epochs on the version it opened, for that long; a new
``Loader()`` reads the new version. The same write deletes the leftovers of
writes that never committed (killed outright, or a Ray task that uploaded after
its driver aborted): shards no manifest names, listed or retired, whose
generation's newest shard is older than ``retention`` (a write running now
uploads fresh shards, so it is never taken for a dead one). An object store
has no lock: two writes into one prefix at the same time are the user's to
avoid (the last manifest put wins). A previous manifest this stoker cannot
read (a newer version's, or corrupt) may name any shard: every shard of
another generation is then kept, recorded as retired since now, and the write
logs why.

**Nothing is left behind.** An upload that fails or is stopped aborts its
multipart upload (:meth:`~stoker.remote.Store.upload`); the staging folder
(``$TMPDIR/stoker-upload-<pid>-<random>``, locked by its writer) goes with the
transaction, however it ends. A writer killed outright leaves both: the commit
of a later write aborts the multipart uploads of shards under the prefix
started ``retention`` seconds ago or more (S3's ``ListMultipartUploads``, see
:mod:`stoker.remote._multipart`), and its :meth:`~RemoteTransaction.begin`
removes the staging folders of writers that are gone (:func:`remove_stale_staging`).

Ray's write tasks (:mod:`stoker.convert.ray`) upload their own shards:
each returns the shard's :class:`~stoker.dataset._manifest.ShardInfo`, and the
driver records it (:meth:`RemoteTransaction.record`) before the commit.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import tempfile
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stoker.dataset._manifest import MANIFEST_NAME, ShardInfo, manifest_bytes, parse_manifest, shard_info
from stoker.dataset._transaction import SHARD_FILE, FolderTransaction, _lock_folder, _unlock
from stoker.errors import DatasetFormatError, RemoteNotFoundError

if TYPE_CHECKING:
    from stoker.remote._store import Store

__all__ = [
    "RemoteTransaction",
    "StoreManifest",
    "finish_shard",
    "info_from_dict",
    "info_to_dict",
    "open_transaction",
    "remove_stale_staging",
    "staging_folder",
]

log = logging.getLogger(__name__)

#: the staging folders of writers to a store, in ``$TMPDIR``: ``stoker-upload-<pid>-<random>``
STAGING_PREFIX = "stoker-upload-"
_STAGING = re.compile(re.escape(STAGING_PREFIX) + r"(?:(?P<pid>\d+)-)?[a-z0-9_]+")
#: a staging folder whose lock is free this long after its last change is stale even if its pid lives (a reused pid) [s]
STALE_STAGING_S = 3600.0
#: a staging folder of an earlier stoker (no pid, no lock) is taken for stale this long after its last change [s]
LEGACY_STAGING_S = 24 * 3600.0


# ---- staging folders ---------------------------------------------------------------------------------
def new_staging(*, lock: bool = True) -> tuple[Path, Callable[[], None]]:
    """A fresh staging folder ``$TMPDIR/stoker-upload-<pid>-<random>``, ``flock``-ed while this writer lives, and the
    function that removes it (and unlocks). A writer killed outright leaves it; :func:`remove_stale_staging` removes it.

    ``lock=False``: the caller locks the folder itself (a transaction's :meth:`~FolderTransaction.begin` does).
    """
    folder = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-"))
    fd = _lock_folder(folder) if lock else -1  # (-1 on a file system without locks: the pid in the name says whose it is)

    def remove() -> None:
        shutil.rmtree(folder, ignore_errors=True)
        _unlock(fd)

    return folder, remove


@contextlib.contextmanager
def staging_folder() -> Iterator[Path]:
    """A staging folder (:func:`new_staging`) for the block, removed when it ends, however it ends."""
    folder, remove = new_staging()
    try:
        yield folder
    finally:
        remove()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (another user's process: alive)
        return True
    return True


def remove_stale_staging(tmp: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove the staging folders of writers that are gone from ``tmp`` (default ``$TMPDIR``); returns those removed.

    Only this user's folders named ``stoker-upload-*`` are looked at. One is
    stale when no process holds its lock and its writer's pid is gone (or,
    the pid reused, it has not changed for :data:`STALE_STAGING_S`); one of an
    earlier stoker (no pid in its name) when it has not changed for
    :data:`LEGACY_STAGING_S`. A live writer's folder is never taken for
    stale: its pid lives, and it holds the folder's lock while it writes.
    """
    folder = Path(tmp if tmp is not None else tempfile.gettempdir())
    removed: list[Path] = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        match = _STAGING.fullmatch(entry.name)
        if match is None:
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            age = now - entry.stat(follow_symlinks=False).st_mtime
        except OSError:
            continue
        pid = int(match["pid"]) if match["pid"] else None
        if pid is None:
            stale = age >= LEGACY_STAGING_S
        else:
            stale = (pid != os.getpid() and not _alive(pid)) or age >= STALE_STAGING_S
        if stale and _remove_unlocked(Path(entry.path)):
            removed.append(Path(entry.path))
    return removed


def _remove_unlocked(path: Path) -> bool:
    """Remove the folder ``path`` unless a process holds its lock (taken here while it is removed)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its writer lives
        except OSError:
            pass  # a file system without locks: the pid and the age decided
        shutil.rmtree(path, ignore_errors=True)
        return not path.exists()
    finally:
        os.close(fd)


def is_url(destination: object) -> bool:
    """Whether ``destination`` names an object store (see :func:`stoker.remote.is_url`)."""
    from stoker.remote._store import is_url as _is_url

    return _is_url(destination)


class StoreManifest:
    """The commit point of a dataset in an object store: ``<url>/manifest.stoker.json``, put in one request."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def current(self) -> bytes | None:
        from stoker.errors import RemoteNotFoundError

        try:
            return self.store.read(MANIFEST_NAME)
        except RemoteNotFoundError:
            return None

    def publish(self, manifest: bytes) -> None:
        self.store.write(MANIFEST_NAME, manifest)


def info_to_dict(info: ShardInfo) -> dict[str, Any]:
    """A shard's info as plain data (a Ray task's return value)."""
    return {
        "name": info.path.name,
        "num_samples": info.num_samples,
        "file_size": info.file_size,
        "header_crc": info.header_crc,
        "fields_sha256": info.fields_sha256,
        "head": info.head,
    }


def info_from_dict(data: Mapping[str, Any]) -> ShardInfo:
    """The inverse of :func:`info_to_dict`."""
    return ShardInfo(Path(data["name"]), int(data["num_samples"]), int(data["file_size"]), int(data["header_crc"]), data["fields_sha256"],
                     data.get("head"))  # fmt: skip


class RemoteTransaction(FolderTransaction):
    """One write of a dataset into an object store prefix: shards staged locally, uploaded one by one, manifest last.

    Args:
        url: the dataset's prefix (``s3://bucket/train/``).
        storage_options: see :func:`stoker.remote.open_store`.
        overwrite: replace a dataset already published there; ``False``
            refuses one (``FileExistsError``).
        generation: the generation's name (8 hex digits); default a fresh one.
        store: an open store of ``url`` (default: opened here).

    Attributes:
        url: the store's printable URL.
        destination: the URL as given.
        store: the store.
        folder: the local staging folder (deleted at commit or abort).
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        overwrite: bool = True,
        generation: str | None = None,
        store: Store | None = None,
    ) -> None:
        from stoker.remote._store import open_store

        self.store = store if store is not None else open_store(url, storage_options)
        self.url = self.store.url
        self.destination = url  # as given (a Ray task opens its own store of it)
        self.storage_options = dict(storage_options or {})
        staging, remove = new_staging(lock=False)  # under $TMPDIR: room for one shard at a time; begin() locks it
        self._cleanup = weakref.finalize(self, remove)  # also a transaction dropped unused, and at exit
        super().__init__(staging, overwrite=overwrite, commit_point=StoreManifest(self.store), generation=generation)
        self._infos: dict[str, ShardInfo] = {}

    def begin(self) -> RemoteTransaction:
        """Check that the prefix can be written (before anything is encoded), then begin as a folder's transaction.

        Raises:
            RemoteNotFoundError: the bucket (or container) does not exist.
            RemotePermissionError: writing there is denied.
            RemoteError: the store is read-only (``http(s)://``) or fails.
            FileExistsError, RuntimeError: as :meth:`FolderTransaction.begin`.
        """
        if self.state == "new":
            self.store.check_writable()
            with contextlib.suppress(Exception):  # what killed writers left in $TMPDIR (their uploads: at the commit)
                remove_stale_staging()
        super().begin()
        return self

    def location(self, index: int) -> str:
        """The URL of this generation's shard ``index``."""
        return self.url + self.shard_name(index)

    def finish_shard(self, path: str | os.PathLike[str]) -> ShardInfo:
        """Upload the complete shard file ``path`` (of this generation), record its header, delete the local file."""
        p = Path(path)
        if not self._mine(p.name):
            raise ValueError(f"finish_shard() takes shards of this generation ({self.shard_name(0)}, ...); got {p.name}")
        info = shard_info(p, record=True)
        self.store.upload(p.name, p)
        self.record(info)
        p.unlink()
        return info

    def record(self, info: ShardInfo) -> None:
        """Note a shard that is already in the store (uploaded by a Ray task) for the manifest."""
        self._infos[info.path.name] = info

    def commit(self, shards: Sequence[str | os.PathLike[str]]) -> Path:
        """Put the manifest listing ``shards`` (their names, in order), then delete what the retention no longer keeps.

        Shards still in the staging folder are uploaded first. The manifest
        records the generation it replaces as retired (kept ``retention``
        seconds for the jobs reading it); generations retired longer ago, and
        shards no manifest names whose generation is older than
        ``retention``, are deleted once the manifest is up.

        Returns:
            ``Path(MANIFEST_NAME)``: the manifest's key in the store (its URL is ``self.url + MANIFEST_NAME``).

        Raises:
            ValueError: no shards, a shard of another generation, or one neither finished nor staged.
            RemoteError: the store failed (the previous manifest is then unchanged, unless the put itself was the failure).
        """
        if self.state not in ("new", "open"):
            raise RuntimeError(f"this transaction of {self.url} is {self.state}; it cannot commit")
        if self.state == "new":
            self.begin()
        names = [Path(s).name for s in shards]
        strangers = [n for n in names if not self._mine(n)]
        if strangers:
            raise ValueError(f"commit() lists shards of this generation ({self.shard_name(0)}, ...) only; got {strangers}")
        for name in names:
            if name not in self._infos:
                if not (self.folder / name).exists():
                    raise ValueError(f"{name} was neither uploaded (finish_shard, record) nor written in {self.folder}")
                self.finish_shard(self.folder / name)
        now = time.time()
        kept, expired = self._retire(set(names), now)
        self.commit_point.publish(manifest_bytes([self._infos[n] for n in names], self.generation, kept))
        self.state = "committed"
        try:
            with contextlib.suppress(Exception):  # the new dataset is up: a leftover left is not a failed write
                self._clean(set(names), kept, expired, now)
            with contextlib.suppress(Exception):
                self._abort_uploads()
        finally:
            self._done()
        return Path(MANIFEST_NAME)

    def _retire(self, names: set[str], now: float) -> tuple[list[dict[str, Any]], set[str]]:
        """The generations the new manifest keeps for their readers (the one it replaces, and those retired less than
        ``retention`` seconds ago), and the shard names whose retention is over."""
        data = self.commit_point.current()
        if data is None:
            return [], set()
        try:
            previous = parse_manifest(data, self.url + MANIFEST_NAME)
        except DatasetFormatError as exc:
            return self._keep_unreadable(names, now, exc), set()
        records: list[dict[str, Any]] = [
            {"generation": previous.get("generation"), "since": now, "shards": [e["name"] for e in previous["shards"]]}
        ]
        records += previous.get("retired", [])
        kept: list[dict[str, Any]] = []
        expired: set[str] = set()
        for record in records:
            shards = [n for n in record["shards"] if n not in names]
            if not shards:
                continue
            if now - float(record["since"]) < self.store.retention:
                kept.append({"generation": record.get("generation"), "since": float(record["since"]), "shards": shards})
            else:
                expired.update(shards)
        return kept, expired

    def _keep_unreadable(self, names: set[str], now: float, exc: DatasetFormatError) -> list[dict[str, Any]]:
        """A previous manifest this stoker cannot read (a newer version's, or corrupt) may name any shard, and jobs may be
        reading them: every shard of another generation is kept, recorded as retired since now (the retention then
        applies to them as to any generation replaced), and none is deleted by this write."""
        shards = sorted(k for k in self.store.list("shard-") if SHARD_FILE.fullmatch(k) and k not in names and not self._mine(k))
        log.warning(
            "%s: cannot read the manifest this write replaces (%s); its shards are unknown, so the %d shard(s) of other "
            "generations in the store are kept as retired (deleted by a write after retention=%gs), none deleted now",
            self.url + MANIFEST_NAME, exc, len(shards), self.store.retention,
        )  # fmt: skip
        return [{"generation": None, "since": now, "shards": shards}] if shards else []

    def _abort_uploads(self) -> None:
        """Abort the multipart uploads of shards left in progress under the prefix: this generation's (none is running once
        it commits), and those of other writes started at least ``retention`` seconds ago (writers killed outright)."""
        mine = f"shard-g{self.generation}-"
        self.store.abort_uploads("shard-", keep=lambda key: SHARD_FILE.fullmatch(key) is None or key.startswith(mine),
                                 older_than=self.store.retention)  # fmt: skip
        self.store.abort_uploads(mine)

    def _clean(self, names: set[str], kept: list[dict[str, Any]], expired: set[str], now: float) -> None:
        """Delete the retired shards whose retention is over, and the shards of writes that never committed (no manifest
        names them, and their generation's newest shard is older than ``retention``)."""
        keep = set(names).union(*(r["shards"] for r in kept))
        for name in sorted(expired - keep):
            self.store.delete(name)
        objects = self.store.list_meta("shard-")
        newest: dict[str | None, float] = defaultdict(float)
        for key, meta in objects.items():
            match = SHARD_FILE.fullmatch(key)
            if match is not None and key not in keep:
                newest[match["generation"]] = max(newest[match["generation"]], meta["last_modified"].timestamp())
        for key in sorted(objects):
            match = SHARD_FILE.fullmatch(key)
            if match is None or key in keep or key in expired or match["generation"] == self.generation:
                continue
            if now - newest[match["generation"]] >= self.store.retention:
                with contextlib.suppress(RemoteNotFoundError):
                    self.store.delete(key)

    def _delete_generation(self) -> None:
        """:meth:`abort`'s deletion: this generation's shards in the store, and its multipart uploads in progress."""
        names = set(self._infos)
        with contextlib.suppress(Exception):
            names.update(k for k in self.store.list(f"shard-g{self.generation}-") if self._mine(k))
        for name in sorted(names):
            with contextlib.suppress(Exception):
                self.store.delete(name)
        with contextlib.suppress(Exception):  # a Ray task's, or one that an interrupt left
            self.store.abort_uploads(f"shard-g{self.generation}-")

    def _done(self) -> None:
        """What ends the transaction, however it ended: unlock, and remove the staging folder."""
        self._release()
        self._cleanup()


def open_transaction(
    destination: str | os.PathLike[str], *, overwrite: bool, storage_options: Mapping[str, Any] | None = None
) -> FolderTransaction:
    """The transaction of a write into ``destination``: a :class:`RemoteTransaction` for a URL, else a folder's."""
    if is_url(destination):
        return RemoteTransaction(str(destination), storage_options, overwrite=overwrite)
    if storage_options:
        raise ValueError(f"storage_options are for a URL destination (s3://, gs://, az://); got the folder {os.fspath(destination)!r}")
    return FolderTransaction(destination, overwrite=overwrite)


def finish_shard(tx: FolderTransaction, path: Path) -> None:
    """Tell the transaction that shard ``path`` is complete: a remote one uploads it now; a folder's keeps it."""
    if isinstance(tx, RemoteTransaction):
        tx.finish_shard(path)
