"""Stoker's exceptions: one hierarchy, so ``except StokerError`` catches them all.

::

    StokerError
    ├── DatasetFormatError     the file is not a valid stoker file (not ours, other
    │   │                      version, truncated, corrupt, offsets out of bounds)
    │   └── DatasetNotFoundError   the dataset's path (a file, a shard, a folder, a
    │                              glob's matches) does not exist; also a
    │                              FileNotFoundError, so ``except FileNotFoundError``
    │                              catches it
    ├── SampleError            one sample could not be written or decoded; names
    │                          the sample index and the field
    ├── PipelineError          a pipeline could not be built (bad operation,
    │                          unknown field, shape/dtype mismatch)
    ├── LoaderError            an error raised while producing a batch; names the
    │                          field, the operation and the sample index
    ├── StageError             a flow stage's function failed on one item; names
    │                          the stage and the item (stoker.flow.StageError)
    ├── RemoteError            an object store refused or failed a request (after
    │   │                      the retries of transient errors); names the URL and
    │   │                      the key, never credentials
    │   ├── RemoteNotFoundError     the object does not exist
    │   └── RemotePermissionError   access denied (403) or not authenticated (401)
    ├── CacheFullError         the shard cache cannot hold a shard within its limit
    │                          (pinned shards fill it) or its disk is full; names
    │                          the cache folder, the limit and the sizes
    └── UnsafeCacheError       a cache folder that others could write into (owned by
                               another user, writable by others, a planted link);
                               names it and says how to fix it

Every message states the rule, the value found and, where there is one, the fix.
"""

from __future__ import annotations

import errno
import os

__all__ = [
    "CacheFullError",
    "DatasetFormatError",
    "DatasetNotFoundError",
    "LoaderError",
    "PipelineError",
    "RemoteError",
    "RemoteNotFoundError",
    "RemotePermissionError",
    "SampleError",
    "StokerError",
    "UnsafeCacheError",
]


class StokerError(Exception):
    """Base class of every error that stoker raises on purpose."""


class DatasetFormatError(StokerError):
    """The file is not a valid stoker dataset.

    Raised at open (or by :meth:`stoker.format.Reader.validate_metadata` /
    :meth:`~stoker.format.Reader.verify`), never from inside compiled code.
    """

    def __init__(self, path: object, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem

    def __reduce__(self) -> tuple[type, tuple[str, str], dict[str, object]]:
        return (type(self), (self.path, self.problem), self.__dict__)


class DatasetNotFoundError(DatasetFormatError, FileNotFoundError):
    """The dataset's path does not exist: a file, a shard its manifest lists, a folder, or a glob pattern's matches.

    Both a :class:`DatasetFormatError` (what stoker raised before it) and a
    :class:`FileNotFoundError`, so ``except FileNotFoundError`` (and ``except OSError``)
    catches it; ``errno`` is ``ENOENT`` and ``filename`` the missing path.
    """

    def __init__(self, path: object, problem: str) -> None:
        super().__init__(path, problem)
        self.errno = errno.ENOENT
        self.strerror = os.strerror(errno.ENOENT)
        self.filename = str(path)

    def __str__(self) -> str:  # (OSError's would be "[Errno 2] No such file or directory: ...", without the problem)
        return f"{self.path}: {self.problem}"


class SampleError(StokerError):
    """A sample could not be encoded (writer) or decoded (loader).

    Attributes:
        index: the sample's index in the source dataset (writer) or in the
            stoker file (loader).
        field: the field's name, or ``None`` when the whole sample is at fault.
    """

    def __init__(self, index: int, field: str | None, problem: str) -> None:
        where = f"sample {index}" + (f", field '{field}'" if field is not None else "")
        super().__init__(f"{where}: {problem}")
        self.index = index
        self.field = field
        self.problem = problem

    def __reduce__(self) -> tuple[type, tuple[int, str | None, str], dict[str, object]]:
        # the state carries __notes__ (e.g. the traceback from a writer process) across processes
        return (type(self), (self.index, self.field, self.problem), self.__dict__)


class PipelineError(StokerError):
    """A pipeline could not be built from the operations given."""


class LoaderError(StokerError):
    """An operation failed while the loader produced a batch.

    Attributes:
        field: the field whose pipeline failed.
        operation: the name of the failing operation.
        index: the sample index (in the dataset file) that made it fail, or
            ``None`` when the failure does not depend on one sample.
    """

    def __init__(self, field: str, operation: str, index: int | None, problem: str) -> None:
        where = f"field '{field}', operation {operation}"
        if index is not None:
            where += f", sample {index}"
        super().__init__(f"{where}: {problem}")
        self.field = field
        self.operation = operation
        self.index = index
        self.problem = problem

    def __reduce__(self) -> tuple[type, tuple[str, str, int | None, str], dict[str, object]]:
        return (type(self), (self.field, self.operation, self.index, self.problem), self.__dict__)


class RemoteError(StokerError):
    """A request to an object store failed (transient errors only after their retries).

    Attributes:
        url: the store's printable URL (no credentials).
        key: the object's key under ``url`` (``""`` for the store itself).
        problem: what went wrong.
    """

    def __init__(self, url: str, key: str, problem: str) -> None:
        super().__init__(f"{url}{key}: {problem}")
        self.url = url
        self.key = key
        self.problem = problem

    def __reduce__(self) -> tuple[type, tuple[str, str, str], dict[str, object]]:
        return (type(self), (self.url, self.key, self.problem), self.__dict__)


class RemoteNotFoundError(RemoteError):
    """The object does not exist in the store (not retried)."""


class RemotePermissionError(RemoteError):
    """The store denied access to the object (HTTP 403) or the credentials (HTTP 401); not retried."""


class CacheFullError(StokerError):
    """The shard cache cannot take a shard: its limit is held by pinned shards, or its disk is full.

    Attributes:
        cache_dir: the cache's folder.
        limit: the cache's limit [bytes] (``None``: no limit).
        problem: the sizes involved and what to do.
    """

    def __init__(self, cache_dir: str, limit: int | None, problem: str) -> None:
        bound = "no limit" if limit is None else f"limit {limit} bytes"
        super().__init__(f"shard cache {cache_dir} ({bound}): {problem}")
        self.cache_dir = cache_dir
        self.limit = limit
        self.problem = problem

    def __reduce__(self) -> tuple[type, tuple[str, int | None, str], dict[str, object]]:
        return (type(self), (self.cache_dir, self.limit, self.problem), self.__dict__)


class UnsafeCacheError(StokerError):
    """A cache folder is not safe to read from: it belongs to another user, others can write into it, or a link stands
    where stoker keeps a folder.

    Attributes:
        path: the folder.
        problem: what is wrong with it, and what to do.
    """

    def __init__(self, path: object, problem: str) -> None:
        super().__init__(f"cache folder {path}: {problem}")
        self.path = str(path)
        self.problem = problem

    def __reduce__(self) -> tuple[type, tuple[str, str], dict[str, object]]:
        return (type(self), (self.path, self.problem), self.__dict__)
