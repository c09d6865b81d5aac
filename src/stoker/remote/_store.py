"""One object store behind a small API: a dataset's prefix in S3, GCS, Azure or on an HTTP(S) server.

:func:`open_store` turns a URL into a :class:`Store` through obstore (chosen by
measurement against fsspec + s3fs: faster downloads and range reads, 10 ms to
import instead of 250 ms; see ``benchmarks/remote_clients.py``). obstore is
the optional dependency ``stoker[remote]``, imported by :func:`open_store`,
not with this module.

Credentials and endpoints are read as the AWS tools read them:
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, then the
profile ``AWS_PROFILE`` (default ``default``) of ``~/.aws/credentials`` and
``~/.aws/config`` (``AWS_SHARED_CREDENTIALS_FILE``, ``AWS_CONFIG_FILE``); the
region from ``AWS_REGION``, ``AWS_DEFAULT_REGION`` or the profile; the endpoint
from ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL`` or the profile's
``endpoint_url``. ``storage_options`` override them (obstore's configuration
keys, e.g. ``access_key_id``, ``endpoint``, ``region``, ``skip_signature``;
``endpoint_url``, ``key``, ``secret`` and ``token`` are accepted as s3fs spells
them). Without credentials an ``s3://`` store is refused at open ("no
credentials found", and how to give them) when an endpoint is configured or
``AWS_EC2_METADATA_DISABLED`` is true: the cloud's instance-metadata service
is asked only on a machine that may have one.

**Faults are ridden through.** A transient error (a timeout, a reset or
refused connection, HTTP 5xx, 429 or S3's ``SlowDown``, a body cut short, a
range answered with fewer bytes than asked) is retried with exponential
backoff and full jitter (the AWS SDKs' rule: wait a random time between 0 and
``min(max_backoff, backoff * 2**n)`` before the n-th retry) for as long as the
request keeps failing within its *retry budget*; a download resumes from the
bytes already received (a range request, ``If-Match`` the object's ETag), and
every byte it receives renews its budget. Only when the budget is spent does
the request fail, with a :class:`~stoker.errors.RemoteError` that names the
URL, the last error, the attempts and how long they took. stoker's own keys
in ``storage_options``:

- ``retry_budget`` (default 600 [seconds]): how long a request may go on
  failing transiently before it fails;
- ``connect_budget`` (default 20 [seconds]): how long a store that has not
  answered once since it was opened may go on being unreachable (a refused
  connection, an unknown host, a failed TLS handshake, an unreachable network)
  before a request fails, with a :class:`~stoker.errors.RemoteError` that names
  the endpoint and the cause; a store that has answered and then cannot be
  reached is in an outage, ridden through within ``retry_budget``;
- ``backoff`` (default 0.1 [seconds]) and ``max_backoff`` (default 20
  [seconds]): the base and the cap of the backoff above;
- ``max_attempts`` (default ``None``: no bound but the budget): at most this
  many tries of a request;
- ``retention`` (default 604800 [seconds], 7 days): how long a rewrite keeps
  the generation it replaced, for the jobs still reading it (see
  :mod:`stoker.dataset._remote_transaction`);
- ``client_options``: obstore's HTTP client options (timeouts, proxies);
  stoker's defaults: ``timeout`` 30 min for a whole request, ``read_timeout``
  60 s without a byte.

**Waits are said** through :mod:`logging` (logger ``stoker.remote``): a
WARNING at the first failure to reach a store that has not answered yet
(the endpoint and the cause), and a WARNING ``retrying <endpoint>: <cause>,
attempt n`` for a request that has been failing for a second or more, at most
one every 5 s per store.

Every retry counts in :meth:`Store.stats` (all of them, and by kind). A
missing object (:class:`~stoker.errors.RemoteNotFoundError`) or a refused
permission (:class:`~stoker.errors.RemotePermissionError`) is not retried.
Messages name the store's URL and the key, never a credential.

**Reads can be interrupted.** Reads run as obstore's asynchronous requests on
an event loop of the calling thread, so that :meth:`Store.interrupt` (from any
thread) stops every read in flight at once, whatever the store's speed, and
Ctrl-C stops the main thread's: a loader's ``close()`` does not wait for the
store.
At exit, the requests still in flight are stopped and obstore's threads
waited for before the interpreter shuts down (:mod:`stoker.remote._exit`):
one that finished a request during the shutdown aborted the process.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, TypeGuard
from urllib.parse import urlsplit, urlunsplit

from stoker.errors import RemoteError, RemoteNotFoundError
from stoker.remote._aws import NO_CREDENTIALS_HINT, aws_options, has_s3_credentials, true
from stoker.remote._exit import RequestLoop, settle
from stoker.remote._multipart import MultipartClient, Unsigned, Upload
from stoker.remote._requests import Requests
from stoker.remote._retry import (
    DEFAULT_BACKOFF,
    DEFAULT_CONNECT_BUDGET,
    DEFAULT_MAX_BACKOFF,
    DEFAULT_RETRY_BUDGET,
    RETRY_KINDS,
    RetryPolicy,
)

__all__ = ["RETRY_KINDS", "RetryPolicy", "Store", "aws_options", "is_url", "open_store"]

INSTALL_HINT = 'pip install "stoker[remote]"'
_SCHEMES = ("s3", "gs", "gcs", "az", "azure", "abfs", "abfss", "http", "https")
#: bytes of a download stream written at a time (obstore yields a chunk once it holds this much)
_CHUNK = 256 << 10
#: the part size of a multipart upload (files larger than this are uploaded in parts) [bytes]
UPLOAD_PART = 5 << 20
#: how long a rewrite keeps the generation it replaced (for the jobs still reading it) [seconds]
DEFAULT_RETENTION = 7 * 24 * 3600.0
#: storage_options keys whose values are secrets (hidden in messages even if the client library echoed them)
_SECRET_KEYS = re.compile(r"secret|token|password|key|sas|credential", re.IGNORECASE)


def is_url(source: object) -> TypeGuard[str]:
    """Whether ``source`` is a string naming an object store: ``s3://``, ``gs://``, ``az://``/``abfs://``, ``http(s)://``."""
    if not isinstance(source, str):
        return False
    scheme, sep, _ = source.partition("://")
    return bool(sep) and scheme.lower() in _SCHEMES


def printable_url(url: str) -> str:
    """``url`` without ``user:password@`` and without its query (signed URLs carry tokens there)."""
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _obstore() -> Any:
    try:
        import obstore
    except ImportError as exc:
        raise ImportError(f"reading or writing an object store (s3://, gs://, az://, https://) needs obstore: {INSTALL_HINT}") from exc
    return obstore


_runtime_pid = 0


def _start_runtime() -> None:
    """Start obstore's runtime threads from a thread that blocks SIGINT and SIGTERM, once per process.

    Threads inherit their creator's signal mask: started from the main thread,
    obstore's threads could take a Ctrl-C that the kernel then does not deliver
    to the main thread waiting for a request (see :mod:`stoker._threads`).
    """
    global _runtime_pid
    if _runtime_pid == os.getpid():
        return
    obs = _obstore()
    from obstore.store import MemoryStore

    from stoker._threads import start_thread

    async def head(memory: Any) -> Any:
        return await obs.head_async(memory, "x")

    def start() -> None:
        memory = MemoryStore()
        obs.put(memory, "x", b"")
        loop = RequestLoop()
        try:
            loop.run_until_complete(head(memory))
            settle()  # (obstore's thread out of call_soon_threadsafe before the loop closes)
        finally:
            loop.close()

    start_thread(start, name="stoker-store-runtime").join()
    _runtime_pid = os.getpid()


class _Download:
    """One download's state across its attempts: the file, the bytes written, the object's ETag."""

    def __init__(self, fh: Any, size: int | None) -> None:
        self.fh = fh
        self.size = size
        self.written = 0
        self.etag: str | None = None
        self.over = False  # the object holds more than ``size``


_ALIASES = {"endpoint_url": "endpoint", "key": "access_key_id", "secret": "secret_access_key", "token": "session_token"}


# ---- the store -----------------------------------------------------------------------------------------
class Store(Requests):
    """One dataset prefix in an object store (``s3://bucket/train/``); keys are names under it.

    Made by :func:`open_store`. Thread-safe: the producer threads of a loader
    share one. Its reads and writes go through :class:`~stoker.remote._requests.Requests`
    (interrupted by :meth:`interrupt`, retried, counted in :meth:`stats`).

    Attributes:
        url: the prefix's URL, ending with ``/``, without credentials.
        writable: ``False`` for ``http(s)://`` stores (read-only).
        retry: how transient errors are retried (:class:`RetryPolicy`).
        retention: how long a rewrite keeps the generation it replaced [seconds].
        endpoint: the endpoint named in messages when the client's error names none (``scheme://host:port``).
    """

    def __init__(
        self,
        url: str,
        inner: Any,
        *,
        writable: bool = True,
        retry: RetryPolicy | None = None,
        retention: float = DEFAULT_RETENTION,
        secrets: tuple[str, ...] = (),
        endpoint: str | None = None,
    ) -> None:
        if isinstance(retention, bool) or not isinstance(retention, (int, float)) or not retention >= 0:
            raise ValueError(f"retention must be a number of seconds >= 0; got {retention!r}")
        parts = urlsplit(printable_url(endpoint or url))
        super().__init__(printable_url(url).rstrip("/") + "/", f"{parts.scheme}://{parts.netloc}", retry=retry, secrets=secrets)
        self.writable = writable
        self.retention = float(retention)
        self._inner = inner

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(f"a Store ({self.url}) is not pickled: open it again with open_store(url, storage_options) in the process")

    @property
    def max_attempts(self) -> int | None:
        """At most this many tries of a request (``None``: the retry budget alone)."""
        return self.retry.max_attempts

    def _writable(self, key: str, what: str) -> None:
        if not self.writable:
            raise RemoteError(self.url, key, f"cannot {what}: an http(s):// store is read-only; write the dataset to s3://, gs:// or az://")

    # ---- reads ---------------------------------------------------------------------------------------
    def read(self, key: str, max_bytes: int | None = None) -> bytes:
        """The whole object ``key``; with ``max_bytes``, at most ``max_bytes + 1`` of its bytes (more means too large).

        Raises:
            RemoteNotFoundError, RemotePermissionError, RemoteError: see the module.
        """
        obs = _obstore()

        async def get() -> bytes:
            result = await obs.get_async(self._inner, key)
            if max_bytes is None:
                return bytes(await result.bytes_async())
            out = bytearray()
            if int(result.meta["size"]) > max_bytes:
                return bytes(max_bytes + 1)  # too large: not read
            async for chunk in result.stream(min_chunk_size=min(_CHUNK, max_bytes + 1)):
                out += chunk
                if len(out) > max_bytes:
                    break
            return bytes(out[: max_bytes + 1])

        data = self._retrying(key, "read", lambda: self._run(key, "read", get))
        self._count(bytes_downloaded=len(data))
        return data

    def read_range(self, key: str, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` of object ``key`` (fewer when the object ends before ``stop``)."""
        return self.read_range_sized(key, start, stop)[0]

    def read_range_sized(self, key: str, start: int, stop: int) -> tuple[bytes, int]:
        """Bytes ``[start, stop)`` of object ``key`` (fewer only when the object ends before ``stop``), and the object's size [bytes].

        An answer with fewer bytes than asked of an object that holds them is
        a fault in transit, retried as any transient error.
        """
        if not 0 <= start <= stop:
            raise ValueError(f"a range needs 0 <= start <= stop; got [{start}, {stop})")
        if start == stop:
            return b"", self.size(key)
        obs = _obstore()

        async def get() -> tuple[bytes, int]:
            result = await obs.get_async(self._inner, key, options={"range": (start, stop)})
            return bytes(await result.bytes_async()), int(result.meta["size"])

        what = f"read bytes {start}-{stop}"
        data, size = self._retrying(key, what, lambda: self._run(key, what, get))
        self._count(bytes_downloaded=len(data))
        return data, size

    def size(self, key: str) -> int:
        """The size of object ``key`` [bytes]."""
        obs = _obstore()

        async def head() -> int:
            return int((await obs.head_async(self._inner, key))["size"])

        return self._retrying(key, "size", lambda: self._run(key, "size", head))

    def download(self, key: str, dest: Path, size: int | None = None) -> int:
        """Stream object ``key`` into the file ``dest`` (created or truncated), chunk by chunk; returns the bytes written.

        A transient error in the middle resumes from the bytes already
        written (a range request, on the condition that the object's ETag is
        unchanged; a changed object is downloaded again from its start),
        retried as any request; each byte received renews the retry budget.
        Only the caller checks the bytes (size, checksum).

        Args:
            key: the object.
            dest: the file to write (the caller's temporary name).
            size: the expected size [bytes], when known: no more than this is
                written, and a larger object returns ``size + 1`` (a mismatch
                for the caller) once its next byte arrives.
        """
        obs = _obstore()
        with open(dest, "wb") as fh:
            state = _Download(fh, size)

            async def stream() -> int:
                options: dict[str, Any] = {}
                if state.written:
                    options["range"] = {"offset": state.written}
                    if state.etag:
                        options["if_match"] = state.etag
                    self._count(resumed_downloads=1)
                fh.seek(state.written)
                fh.truncate()
                result = await obs.get_async(self._inner, key, options=options or None)
                state.etag = result.meta.get("e_tag") or state.etag
                async for chunk in result.stream(min_chunk_size=_CHUNK):
                    self._count(bytes_downloaded=len(chunk))
                    if size is not None and state.written + len(chunk) > size:
                        fh.write(memoryview(chunk)[: size - state.written])
                        state.over = True
                        return size + 1
                    fh.write(chunk)
                    state.written += len(chunk)
                return state.written

            def attempt() -> int:
                try:
                    return self._run(key, "download", stream)
                except Exception as exc:
                    if type(exc).__name__ == "PreconditionError":  # the object was replaced meanwhile: from its start
                        state.written, state.etag = 0, None
                    raise

            return self._retrying(key, "download", attempt, progress=lambda: state.written)

    def list(self, prefix: str = "") -> list[str]:
        """The keys that start with ``prefix`` (relative to the store's URL; a string prefix, not a folder), sorted."""
        return sorted(self.list_meta(prefix))

    def list_meta(self, prefix: str = "") -> dict[str, dict[str, Any]]:
        """The objects whose keys start with ``prefix`` (relative to the store's URL; a string prefix, not a folder):
        key -> ``{"size": bytes, "last_modified": datetime}``."""
        obs = _obstore()
        folder = prefix.rpartition("/")[0]  # (obstore lists a folder: the rest of the prefix is matched here)

        def names() -> dict[str, dict[str, Any]]:
            return {
                meta["path"]: {"size": int(meta["size"]), "last_modified": meta["last_modified"]}
                for batch in obs.list(self._inner, folder or None)
                for meta in batch
                if meta["path"].startswith(prefix)
            }

        return self._retrying(prefix, "list", names)

    # ---- writes --------------------------------------------------------------------------------------
    def write(self, key: str, data: bytes) -> None:
        """Put ``data`` as object ``key`` (one request; replaces an object of that name)."""
        self._writable(key, "write")
        obs = _obstore()
        self._retrying(key, "write", lambda: obs.put(self._inner, key, bytes(data)))
        self._count(bytes_uploaded=len(data))

    def upload(self, key: str, src: Path) -> None:
        """Upload the file ``src`` as object ``key``: multipart (parts in parallel) for files of more than 5 MiB.

        The request runs on the calling thread's event loop, so Ctrl-C stops
        it; an upload that fails or is stopped is aborted (its parts are not
        left in the bucket, see :meth:`abort_uploads`), and so are the
        multipart uploads of attempts that failed before one succeeded.
        """
        self._writable(key, "upload")
        obs = _obstore()
        path = Path(src)
        n = path.stat().st_size
        tries = 0

        async def put() -> None:
            await obs.put_async(self._inner, key, path, chunk_size=UPLOAD_PART, max_concurrency=8)

        def attempt() -> None:
            nonlocal tries
            tries += 1
            self._run(key, "upload", put)

        try:
            self._retrying(key, "upload", attempt)
        except BaseException:
            self._abort_quietly(key)  # (a second Ctrl-C stops this too)
            raise
        if tries > 1:
            self._abort_quietly(key)
        self._count(bytes_uploaded=n)

    # ---- multipart uploads in progress -----------------------------------------------------------------
    def _multipart(self) -> MultipartClient | None:
        """The client of this store's multipart uploads (:mod:`stoker.remote._multipart`); ``None`` where there is none:
        a store other than S3, or credentials that are not in the store's configuration."""
        with self._lock:
            if not hasattr(self, "_uploads_client"):
                client = None
                if type(self._inner).__name__ == "S3Store":
                    with contextlib.suppress(Unsigned, KeyError):
                        client = MultipartClient(self._inner.config, self._inner.prefix)
                self._uploads_client = client
            return self._uploads_client

    def uploads(self, prefix: str = "") -> tuple[Upload, ...]:
        """The multipart uploads in progress whose keys start with ``prefix`` (S3's ``ListMultipartUploads``), each an
        :class:`~stoker.remote._multipart.Upload` (``key``, ``upload_id``, ``initiated``); none where they cannot be
        listed (a store other than S3; credentials not in the store's configuration)."""
        client = self._multipart()
        if client is None:
            return ()
        return tuple(self._retrying(prefix, "list multipart uploads", lambda: client.list(prefix)))

    def abort_uploads(self, prefix: str = "", *, older_than: float = 0.0, keep: Callable[[str], bool] | None = None) -> int:
        """Abort the multipart uploads in progress under ``prefix`` started at least ``older_than`` seconds ago (and whose
        key ``keep`` does not accept); returns how many were aborted. A store that cannot list them aborts none."""
        client = self._multipart()
        if client is None:
            return 0
        now = time.time()
        aborted = 0
        for upload in self.uploads(prefix):
            if now - upload.initiated.timestamp() < older_than or (keep is not None and keep(upload.key)):
                continue
            self._retrying(upload.key, "abort a multipart upload", partial(client.abort, upload.key, upload.upload_id))
            aborted += 1
        return aborted

    def _abort_quietly(self, key: str) -> None:
        """Abort the multipart uploads of ``key`` (this writer's: a shard's key is its writer's), once, errors ignored."""
        client = self._multipart()
        if client is None:
            return
        with contextlib.suppress(Exception):
            for upload in client.list(key):
                if upload.key == key:
                    client.abort(upload.key, upload.upload_id)

    def delete(self, key: str) -> None:
        """Delete object ``key`` (no error when it is missing: S3 does not tell)."""
        self._writable(key, "delete")
        obs = _obstore()
        with contextlib.suppress(RemoteNotFoundError):
            self._retrying(key, "delete", lambda: obs.delete(self._inner, key))

    def check_writable(self) -> None:
        """Check, before anything is encoded, that objects can be written under this prefix: the bucket exists and the
        credentials may write (a small probe object is put, then deleted).

        Raises:
            RemoteNotFoundError: the bucket does not exist.
            RemotePermissionError: writing is denied.
            RemoteError: the store is read-only (``http(s)://``) or fails.
        """
        self._writable("", "write")
        obs = _obstore()
        probe = f".stoker-write-probe-{os.getpid()}-{threading.get_ident()}-{time.time_ns()}"
        what = "cannot write the dataset here (a probe written before anything is encoded)"
        self._retrying("", what, lambda: obs.put(self._inner, probe, b""))
        self._retrying("", what, lambda: obs.delete(self._inner, probe))


# ---- opening -------------------------------------------------------------------------------------------
_STOKER_KEYS = ("retry_budget", "connect_budget", "backoff", "max_backoff", "max_attempts", "retention")


def _split_options(options: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any], RetryPolicy, float]:
    config = {_ALIASES.get(k, k): v for k, v in dict(options or {}).items()}
    client = dict(config.pop("client_options", None) or {})
    ours = {k: config.pop(k) for k in _STOKER_KEYS if k in config}
    policy = RetryPolicy(
        retry_budget=ours.get("retry_budget", DEFAULT_RETRY_BUDGET),
        connect_budget=ours.get("connect_budget", DEFAULT_CONNECT_BUDGET),
        backoff=ours.get("backoff", DEFAULT_BACKOFF),
        max_backoff=ours.get("max_backoff", DEFAULT_MAX_BACKOFF),
        max_attempts=ours.get("max_attempts"),
    )
    return config, client, policy, ours.get("retention", DEFAULT_RETENTION)


def open_store(url: str, storage_options: Mapping[str, Any] | None = None) -> Store:
    """The :class:`Store` of the prefix ``url`` (``s3://bucket/train/``, ``gs://...``, ``az://container/...``, ``https://host/path/``).

    Args:
        url: the dataset's prefix (a "folder" of the store).
        storage_options: overrides of the configuration read from the
            environment, and stoker's own ``retry_budget``, ``connect_budget``, ``backoff``,
            ``max_backoff``, ``max_attempts``, ``retention``,
            ``client_options`` (see the module).

    Raises:
        ImportError: obstore is not installed (the message says ``pip install "stoker[remote]"``).
        ValueError: not a URL of a store that stoker reads, or a bad retry option.
        RemoteError: the store cannot be opened, or (``s3://``) no credentials
            were found where the instance-metadata service is not to be asked.
    """
    if not is_url(url):
        raise ValueError(f"not an object store URL (s3://, gs://, az://, abfs://, http(s)://): {printable_url(str(url))!r}")
    _start_runtime()
    from obstore.store import AzureStore, GCSStore, HTTPStore, S3Store

    scheme = url.partition("://")[0].lower()
    config, client, policy, retention = _split_options(storage_options)
    printable = printable_url(url).rstrip("/") + "/"
    secrets = tuple(str(v) for k, v in config.items() if _SECRET_KEYS.search(k) and isinstance(v, str))
    retry = {"max_retries": 0, "retry_timeout": timedelta(seconds=600)}  # the Store retries, and counts
    # obstore's 30 s bound on a whole request would cut a big shard's download: a stalled read fails instead
    client.setdefault("timeout", timedelta(minutes=30))
    client.setdefault("read_timeout", timedelta(seconds=60))
    base = url.rstrip("/")
    inner: Any
    try:
        if scheme == "s3":
            config = {**aws_options(), **config}
            secrets += tuple(str(v) for k, v in config.items() if _SECRET_KEYS.search(k) and isinstance(v, str))
            if not has_s3_credentials(config, os.environ) and (config.get("endpoint") or true(os.environ.get("AWS_EC2_METADATA_DISABLED"))):
                why = "an endpoint is configured" if config.get("endpoint") else "AWS_EC2_METADATA_DISABLED is set"
                raise RemoteError(
                    printable, "", f"no credentials found (none in storage_options, the environment or ~/.aws; {why}, so the "
                    f"instance-metadata service is not asked); {NO_CREDENTIALS_HINT}"
                )  # fmt: skip
            if str(config.get("endpoint", "")).startswith("http://"):
                client.setdefault("allow_http", True)
            inner = S3Store.from_url(base, config=config, client_options=client or None, retry_config=retry)  # type: ignore[arg-type]
        elif scheme in ("gs", "gcs"):
            inner = GCSStore.from_url("gs://" + base.partition("://")[2], config=config, client_options=client or None, retry_config=retry)  # type: ignore[arg-type]
        elif scheme in ("az", "azure", "abfs", "abfss"):
            inner = AzureStore.from_url(base, config=config, client_options=client or None, retry_config=retry)  # type: ignore[arg-type]
        else:
            if scheme == "http":
                client.setdefault("allow_http", True)
            inner = HTTPStore.from_url(base + "/", client_options=client or None, retry_config=retry)  # type: ignore[arg-type]
    except RemoteError:
        raise
    except Exception as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        for secret in secrets:
            message = message.replace(secret, "***")
        raise RemoteError(printable, "", f"cannot open the store: {message}") from None
    endpoint = str(config.get("endpoint") or "") if scheme == "s3" else ""
    return Store(url, inner, writable=scheme not in ("http", "https"), retry=policy, retention=retention, secrets=secrets,
                 endpoint=endpoint or None)  # fmt: skip
