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
keys, e.g. ``access_key_id``, ``endpoint``, ``region``; ``endpoint_url``,
``key``, ``secret`` and ``token`` are accepted as s3fs spells them), plus:

- ``max_attempts`` (default 5): tries of a request whose error is transient
  (timeout, connection reset, HTTP 5xx, 429 or S3's ``SlowDown``);
- ``backoff`` (default 0.1 [seconds]): the first retry waits about this
  long, each next one twice as long (with jitter: 0.5x to 1.5x), at most 10 s;
- ``client_options``: obstore's HTTP client options (timeouts, proxies);
  stoker's defaults: ``timeout`` 30 min for a whole request, ``read_timeout``
  60 s without a byte (a download cut by either resumes where it stopped).

Every retry counts in :meth:`Store.stats`. A missing object
(:class:`~stoker.errors.RemoteNotFoundError`) or a refused permission
(:class:`~stoker.errors.RemotePermissionError`) is not retried. Messages name
the store's URL and the key, never a credential.
"""

from __future__ import annotations

import configparser
import contextlib
import os
import random
import re
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from stoker.errors import RemoteError, RemoteNotFoundError, RemotePermissionError

__all__ = ["Store", "is_url", "open_store"]

INSTALL_HINT = 'pip install "stoker[remote]"'
_SCHEMES = ("s3", "gs", "gcs", "az", "azure", "abfs", "abfss", "http", "https")
#: bytes of a download stream written at a time (obstore yields a chunk once it holds this much: what a cut request keeps)
_CHUNK = 256 << 10
_MAX_BACKOFF = 10.0
#: storage_options keys whose values are secrets (hidden in messages even if the client library echoed them)
_SECRET_KEYS = re.compile(r"secret|token|password|key|sas|credential", re.IGNORECASE)
_TRANSIENT = re.compile(
    r"status code: (5\d\d|429)|\b(5\d\d|429) |SlowDown|Throttl|RequestTimeout|timed? ?out|timeout|connection|reset|broken pipe"
    r"|error sending request|error decoding response|incomplete|unexpected eof|closed",
    re.IGNORECASE,
)
_DENIED = re.compile(r"status code: (401|403)|AccessDenied|Forbidden|Unauthorized", re.IGNORECASE)
_NOT_FOUND = re.compile(r"status code: 404|NoSuchKey|not found", re.IGNORECASE)

T = TypeVar("T")


def is_url(source: object) -> bool:
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


# ---- configuration as the AWS tools read it ----------------------------------------------------------
def _profile(path: Path, section: str) -> dict[str, str]:
    parser = configparser.RawConfigParser()
    try:
        parser.read(path)
    except (OSError, configparser.Error):
        return {}
    return dict(parser[section]) if parser.has_section(section) else {}


def aws_options(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """obstore's S3 configuration from the environment and the AWS profile, as the AWS CLI reads them.

    Returns:
        A dict with some of ``access_key_id``, ``secret_access_key``,
        ``session_token``, ``region``, ``endpoint``.
    """
    env = os.environ if environ is None else environ
    name = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"
    home = Path(env.get("HOME", "~")).expanduser()
    credentials = _profile(Path(env.get("AWS_SHARED_CREDENTIALS_FILE") or home / ".aws" / "credentials").expanduser(), name)
    config = _profile(
        Path(env.get("AWS_CONFIG_FILE") or home / ".aws" / "config").expanduser(), name if name == "default" else f"profile {name}"
    )
    profile = {**config, **credentials}
    out: dict[str, str] = {}
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        out["access_key_id"] = env["AWS_ACCESS_KEY_ID"]
        out["secret_access_key"] = env["AWS_SECRET_ACCESS_KEY"]
        if env.get("AWS_SESSION_TOKEN"):
            out["session_token"] = env["AWS_SESSION_TOKEN"]
    elif profile.get("aws_access_key_id") and profile.get("aws_secret_access_key"):
        out["access_key_id"] = profile["aws_access_key_id"]
        out["secret_access_key"] = profile["aws_secret_access_key"]
        if profile.get("aws_session_token"):
            out["session_token"] = profile["aws_session_token"]
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or profile.get("region")
    if region:
        out["region"] = region
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or profile.get("endpoint_url")
    if endpoint:
        out["endpoint"] = endpoint
    return out


_ALIASES = {"endpoint_url": "endpoint", "key": "access_key_id", "secret": "secret_access_key", "token": "session_token"}


# ---- the store -----------------------------------------------------------------------------------------
class Store:
    """One dataset prefix in an object store (``s3://bucket/train/``); keys are names under it.

    Made by :func:`open_store`. Thread-safe: the producer threads of a loader
    share one.

    Attributes:
        url: the prefix's URL, ending with ``/``, without credentials.
        writable: ``False`` for ``http(s)://`` stores (read-only).
    """

    def __init__(
        self, url: str, inner: Any, *, writable: bool = True, max_attempts: int = 5, backoff: float = 0.1, secrets: tuple[str, ...] = ()
    ) -> None:
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"max_attempts must be an int >= 1; got {max_attempts!r}")
        if not backoff >= 0:
            raise ValueError(f"backoff must be >= 0 [seconds]; got {backoff!r}")
        self.url = printable_url(url).rstrip("/") + "/"
        self.writable = writable
        self.max_attempts = max_attempts
        self.backoff = float(backoff)
        self._inner = inner
        self._secrets = tuple(s for s in secrets if len(s) >= 4)
        self._lock = threading.Lock()
        self._stats = {"requests": 0, "bytes_downloaded": 0, "bytes_uploaded": 0, "retries": 0}

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(f"a Store ({self.url}) is not pickled: open it again with open_store(url, storage_options) in the process")

    # ---- bookkeeping ---------------------------------------------------------------------------------
    def _count(self, **amounts: int) -> None:
        with self._lock:
            for name, n in amounts.items():
                self._stats[name] += n

    def stats(self) -> dict[str, float]:
        """Counts since the store was opened: ``requests``, ``bytes_downloaded``, ``bytes_uploaded``, ``retries``."""
        with self._lock:
            return {k: float(v) for k, v in self._stats.items()}

    def _scrub(self, text: str) -> str:
        text = re.sub(r"(\w+://)[^/@\s]*@", r"\1", text)  # user:password@ in URLs
        text = re.sub(r"\?[^\s\"'<>]*", "", text)  # query strings (signed URLs, SAS tokens)
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _error(self, key: str, exc: BaseException, what: str) -> RemoteError:
        detail = str(exc).strip().splitlines()
        first = self._scrub(detail[0] if detail else type(exc).__name__)[:300]
        name = type(exc).__name__
        if isinstance(exc, FileNotFoundError) or name == "NotFoundError" or _NOT_FOUND.search(first):
            return RemoteNotFoundError(self.url, key, f"{what}: no such object ({first})")
        if isinstance(exc, PermissionError) or name in ("PermissionDeniedError", "UnauthenticatedError") or _DENIED.search(first):
            return RemotePermissionError(self.url, key, f"{what}: permission denied; check the credentials and the access policy ({first})")
        return RemoteError(self.url, key, f"{what} failed: {first}")

    @staticmethod
    def _transient(exc: BaseException) -> bool:
        if isinstance(exc, (FileNotFoundError, PermissionError)):
            return False
        if isinstance(exc, (TimeoutError, ConnectionError)):
            return True
        if type(exc).__name__ in ("NotFoundError", "PermissionDeniedError", "UnauthenticatedError", "InvalidPathError"):
            return False
        text = str(exc)
        if _DENIED.search(text) or (re.search(r"status code: 4\d\d", text) and not re.search(r"status code: (408|429)", text)):
            return False
        return bool(_TRANSIENT.search(text))

    def _retrying(self, key: str, what: str, call: Callable[[], T]) -> T:
        """``call()``, retried with exponential backoff and jitter while it fails transiently."""
        for attempt in range(self.max_attempts):
            self._count(requests=1)
            try:
                return call()
            except Exception as exc:
                if isinstance(exc, RemoteError):
                    raise
                if isinstance(exc, OSError) and exc.errno is not None and not isinstance(exc, (ConnectionError, TimeoutError)):
                    raise  # the local file (a full disk: ENOSPC), not the store
                if not self._transient(exc) or attempt + 1 == self.max_attempts:
                    error = self._error(key, exc, what)
                    if attempt:
                        error.add_note(f"after {attempt + 1} attempts")
                    raise error from None
                self._count(retries=1)
                time.sleep(min(_MAX_BACKOFF, self.backoff * 2**attempt) * random.uniform(0.5, 1.5))  # jitter
        raise AssertionError("unreachable")  # pragma: no cover

    def _writable(self, key: str, what: str) -> None:
        if not self.writable:
            raise RemoteError(self.url, key, f"cannot {what}: an http(s):// store is read-only; write the dataset to s3://, gs:// or az://")

    # ---- reads ---------------------------------------------------------------------------------------
    def read(self, key: str) -> bytes:
        """The whole object ``key``.

        Raises:
            RemoteNotFoundError, RemotePermissionError, RemoteError: see the module.
        """
        obs = _obstore()
        data = self._retrying(key, "read", lambda: bytes(obs.get(self._inner, key).bytes()))
        self._count(bytes_downloaded=len(data))
        return data

    def read_range(self, key: str, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` of object ``key`` (fewer when the object ends before ``stop``)."""
        if not 0 <= start <= stop:
            raise ValueError(f"a range needs 0 <= start <= stop; got [{start}, {stop})")
        if start == stop:
            return b""
        obs = _obstore()
        data = self._retrying(key, f"read bytes {start}-{stop}", lambda: bytes(obs.get_range(self._inner, key, start=start, end=stop)))
        self._count(bytes_downloaded=len(data))
        return data

    def size(self, key: str) -> int:
        """The size of object ``key`` [bytes]."""
        obs = _obstore()
        return int(self._retrying(key, "size", lambda: obs.head(self._inner, key))["size"])

    def download(self, key: str, dest: Path, size: int | None = None) -> int:
        """Stream object ``key`` into the file ``dest`` (created or truncated), chunk by chunk; returns the bytes written.

        A transient error in the middle resumes from the bytes already
        written (a range request), retried as any request. Only the caller
        checks the bytes (size, checksum).

        Args:
            key: the object.
            dest: the file to write (the caller's temporary name).
            size: the expected size [bytes], when known: no more than this is
                written, and a larger object returns ``size + 1`` (a mismatch
                for the caller) once its next byte arrives.
        """
        obs = _obstore()
        written = 0
        with open(dest, "wb") as fh:

            def stream() -> int:
                nonlocal written
                fh.seek(written)
                fh.truncate()
                result = obs.get(self._inner, key, options={"range": {"offset": written}} if written else None)
                for chunk in result.stream(min_chunk_size=_CHUNK):
                    self._count(bytes_downloaded=len(chunk))
                    if size is not None and written + len(chunk) > size:
                        fh.write(memoryview(chunk)[: size - written])
                        return size + 1
                    fh.write(chunk)
                    written += len(chunk)
                return written

            return self._retrying(key, "download", stream)

    def list(self, prefix: str = "") -> list[str]:
        """The keys under ``prefix`` (relative to the store's URL), sorted."""
        obs = _obstore()

        def names() -> list[str]:
            return sorted(meta["path"] for batch in obs.list(self._inner, prefix or None) for meta in batch)

        return self._retrying(prefix, "list", names)

    # ---- writes --------------------------------------------------------------------------------------
    def write(self, key: str, data: bytes) -> None:
        """Put ``data`` as object ``key`` (one request; replaces an object of that name)."""
        self._writable(key, "write")
        obs = _obstore()
        self._retrying(key, "write", lambda: obs.put(self._inner, key, bytes(data)))
        self._count(bytes_uploaded=len(data))

    def upload(self, key: str, src: Path) -> None:
        """Upload the file ``src`` as object ``key``: multipart (parts in parallel) for files of more than 5 MiB."""
        self._writable(key, "upload")
        obs = _obstore()
        path = Path(src)
        n = path.stat().st_size
        self._retrying(key, "upload", lambda: obs.put(self._inner, key, path, chunk_size=5 << 20, max_concurrency=8))
        self._count(bytes_uploaded=n)

    def delete(self, key: str) -> None:
        """Delete object ``key`` (no error when it is missing: S3 does not tell)."""
        self._writable(key, "delete")
        obs = _obstore()
        with contextlib.suppress(RemoteNotFoundError):
            self._retrying(key, "delete", lambda: obs.delete(self._inner, key))


# ---- opening -------------------------------------------------------------------------------------------
def _split_options(options: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any], int, float]:
    config = {_ALIASES.get(k, k): v for k, v in dict(options or {}).items()}
    client = dict(config.pop("client_options", None) or {})
    attempts = config.pop("max_attempts", 5)
    backoff = config.pop("backoff", 0.1)
    return config, client, attempts, backoff


def open_store(url: str, storage_options: Mapping[str, Any] | None = None) -> Store:
    """The :class:`Store` of the prefix ``url`` (``s3://bucket/train/``, ``gs://...``, ``az://container/...``, ``https://host/path/``).

    Args:
        url: the dataset's prefix (a "folder" of the store).
        storage_options: overrides of the configuration read from the
            environment, and ``max_attempts``, ``backoff``, ``client_options``
            (see the module).

    Raises:
        ImportError: obstore is not installed (the message says ``pip install "stoker[remote]"``).
        ValueError: not a URL of a store that stoker reads.
    """
    if not is_url(url):
        raise ValueError(f"not an object store URL (s3://, gs://, az://, abfs://, http(s)://): {printable_url(str(url))!r}")
    obs = _obstore()
    from obstore.store import AzureStore, GCSStore, HTTPStore, S3Store

    del obs
    scheme = url.partition("://")[0].lower()
    config, client, attempts, backoff = _split_options(storage_options)
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
    except Exception as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        for secret in secrets:
            message = message.replace(secret, "***")
        raise RemoteError(printable_url(url).rstrip("/") + "/", "", f"cannot open the store: {message}") from None
    return Store(url, inner, writable=scheme not in ("http", "https"), max_attempts=attempts, backoff=backoff, secrets=secrets)
