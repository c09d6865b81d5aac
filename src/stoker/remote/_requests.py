"""How a :class:`~stoker.remote.Store` runs one request: on the calling thread's event loop, retried, described.

The storage layer's rules (:mod:`stoker.remote._store` says them to users) are
kept here, in :class:`Requests`, the part of a store that every read and write
goes through:

- a request runs as obstore's asynchronous request on an event loop of the
  calling thread (:meth:`Requests._run`), so that :meth:`Requests.interrupt`
  (from any thread) or Ctrl-C stops it at once;
- a transient failure is retried with backoff within the retry budget (or the
  connect budget of a store not reached yet), and said through :mod:`logging`
  (:meth:`Requests._retrying`; which errors are transient: :mod:`stoker.remote._retry`);
- a failure that is not retried, or that outlasts its budget, becomes a
  :class:`~stoker.errors.RemoteError` that names the URL, the key and the
  cause in one line, scrubbed of credentials (:meth:`Requests._error`);
- every request, retry and byte counts in :meth:`Requests.stats`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar
from urllib.parse import urlsplit

from stoker.errors import RemoteError, RemoteNotFoundError, RemotePermissionError
from stoker.remote._aws import NO_CREDENTIALS_HINT
from stoker.remote._exit import RequestLoop, watch
from stoker.remote._retry import (
    DENIED,
    METADATA_HOST,
    NOT_FOUND,
    RETRY_KINDS,
    RetryPolicy,
    cause_of,
    endpoint_of,
    seconds_text,
    transient_kind,
    unreachable_cause,
)

__all__ = ["Requests"]

#: a request failing for this long is said (a WARNING) [seconds]
_SAY_AFTER = 1.0
#: at most one retry WARNING per store in this long [seconds]
_SAY_EVERY = 5.0
T = TypeVar("T")
log = logging.getLogger("stoker.remote")


# ---- asynchronous requests on the calling thread's event loop ---------------------------------------------
class _Loop:
    """The calling thread's event loop for store requests, closed with the thread."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop = RequestLoop()
        self.pid = os.getpid()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.loop.close()


_loops = threading.local()


def _thread_loop() -> asyncio.AbstractEventLoop:
    holder = getattr(_loops, "holder", None)
    if holder is None or holder.pid != os.getpid() or holder.loop.is_closed():  # (a forked child makes its own)
        holder = _loops.holder = _Loop()
    return holder.loop


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class _Cancelled(RemoteError):
    """A read stopped by :meth:`Store.interrupt` (a loader closing): not the store's failure."""


class Requests:
    """The requests of one store: each run on the calling thread's event loop, retried within its budget, counted,
    and its failure described with the store's URL and the key (the base of :class:`~stoker.remote.Store`).

    Args:
        url: the store's URL as messages print it (no credentials), ending with ``/``.
        endpoint: the endpoint named in messages when the client's error names none (``scheme://host:port``).
        retry: how transient errors are retried (default: :class:`RetryPolicy`'s defaults).
        secrets: values hidden (``***``) in every message.
    """

    def __init__(self, url: str, endpoint: str, *, retry: RetryPolicy | None = None, secrets: tuple[str, ...] = ()) -> None:
        self.url = url
        self.retry = retry if retry is not None else RetryPolicy()
        self._secrets = tuple(s for s in secrets if len(s) >= 4)
        self._lock = threading.Lock()
        self._stats: dict[str, int | float] = {"requests": 0, "bytes_downloaded": 0, "bytes_uploaded": 0, "retries": 0}
        self._stats.update({f"retries_{kind}": 0 for kind in RETRY_KINDS})
        self._stats.update(retry_wait_s=0.0, resumed_downloads=0)
        self.endpoint = endpoint
        self._answered = False  # the store has answered a request since it was opened (see RetryPolicy.connect_budget)
        self._unreachable_since: float | None = None  # the first failure to reach it, while it has not answered
        self._said_at = -math.inf  # the last retry WARNING (time.monotonic())
        self._interrupted = threading.Event()
        self._inflight: dict[asyncio.Task[Any], asyncio.AbstractEventLoop] = {}
        watch(self)  # stopped, and obstore's threads waited for, at exit (see stoker.remote._exit)

    # ---- bookkeeping ---------------------------------------------------------------------------------
    def _count(self, **amounts: float) -> None:
        with self._lock:
            for name, n in amounts.items():
                self._stats[name] += n

    def stats(self) -> dict[str, int | float]:
        """Counts since the store was opened, ints: ``requests``, ``bytes_downloaded``, ``bytes_uploaded`` [bytes],
        ``retries`` (all), ``retries_<kind>`` for each kind of :data:`RETRY_KINDS`, and ``resumed_downloads``
        (downloads that went on from the bytes received after a fault); and a float, ``retry_wait_s`` (the backoff
        waited [seconds])."""
        with self._lock:
            return dict(self._stats)

    def _scrub(self, text: str) -> str:
        text = re.sub(r"(\w+://)[^/@\s]*@", r"\1", text)  # user:password@ in URLs
        text = re.sub(r"(\w+://[^\s?\"'<>]*)\?[^\s\"'<>]*", r"\1", text)  # URLs' query strings (signed URLs, SAS tokens)
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _describe(self, exc: BaseException) -> str:
        """The error in one line: the client's first line, the store's XML error as ``Code: Message``, scrubbed."""
        text = str(exc).split("Debug source:")[0].strip()
        if not text:
            return type(exc).__name__
        code = re.search(r"<Code>([^<]{1,100})</Code>", text)
        message = re.search(r"<Message>([^<]{1,300})</Message>", text)
        first = text.splitlines()[0]
        xml = first.find("<?xml")
        if xml < 0:
            xml = first.find("<Error>")
        if xml >= 0:
            first = first[:xml].rstrip(" :")
        if code is not None:
            first += f": {code[1]}" + (f" ({message[1]})" if message is not None else "")
        return self._scrub(first)[:400]

    def _error(self, key: str, exc: BaseException, what: str) -> RemoteError:
        first = self._describe(exc)
        text = str(exc)
        name = type(exc).__name__
        if METADATA_HOST.search(text):
            return RemoteError(
                self.url, key, f"{what}: no credentials found (none in storage_options, the environment or ~/.aws, and the "
                f"instance-metadata service gave none); {NO_CREDENTIALS_HINT}"
            )  # fmt: skip
        if "NoSuchBucket" in text:
            bucket = urlsplit(self.url).netloc
            return RemoteNotFoundError(self.url, key, f"{what}: the bucket {bucket!r} does not exist; create it, or check the URL")
        if isinstance(exc, FileNotFoundError) or name == "NotFoundError" or NOT_FOUND.search(first):
            return RemoteNotFoundError(self.url, key, f"{what}: no such object ({first})")
        if isinstance(exc, PermissionError) or name in ("PermissionDeniedError", "UnauthenticatedError") or DENIED.search(text):
            return RemotePermissionError(self.url, key, f"{what}: permission denied; check the credentials and the access policy ({first})")
        return RemoteError(self.url, key, f"{what} failed: {first}")

    @staticmethod
    def _transient(exc: BaseException) -> str | None:
        """The kind of a transient error (one of :data:`RETRY_KINDS`), or ``None`` for an error that is not retried."""
        return transient_kind(exc)

    # ---- interrupting ----------------------------------------------------------------------------------
    def interrupt(self) -> None:
        """Stop every read in flight now (it raises in its thread), and refuse new ones until :meth:`resume`.

        For a loader's ``close()``: its downloads end at once, whatever the store's speed.
        """
        with self._lock:
            self._interrupted.set()
            inflight = list(self._inflight.items())
        for task, loop in inflight:
            with contextlib.suppress(RuntimeError):  # (a loop closed with its thread)
                loop.call_soon_threadsafe(task.cancel)

    def resume(self) -> None:
        """Accept reads again after :meth:`interrupt`."""
        self._interrupted.clear()

    @property
    def interrupted(self) -> bool:
        """Whether reads are refused (between :meth:`interrupt` and :meth:`resume`)."""
        return self._interrupted.is_set()

    def _cancelled(self, key: str, what: str) -> _Cancelled:
        return _Cancelled(self.url, key, f"{what}: stopped (the reader was closed)")

    def _run(self, key: str, what: str, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run the coroutine ``make()`` on this thread's event loop, so that :meth:`interrupt` or Ctrl-C can stop it."""
        if _loop_running():  # this thread runs a loop already (a notebook's): use a helper thread
            return self._in_helper(key, what, make)
        loop = _thread_loop()
        with self._lock:
            if self._interrupted.is_set():
                raise self._cancelled(key, what)
            task: asyncio.Task[T] = loop.create_task(make())
            self._inflight[task] = loop
        try:
            return loop.run_until_complete(task)
        except asyncio.CancelledError:
            raise self._cancelled(key, what) from None
        except BaseException:
            if not task.done():  # Ctrl-C while it ran: the request stops too
                task.cancel()
                with contextlib.suppress(BaseException):
                    loop.run_until_complete(task)
            raise
        finally:
            with self._lock:
                self._inflight.pop(task, None)

    def _in_helper(self, key: str, what: str, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        from stoker._threads import start_thread

        out: list[Any] = []
        done = threading.Event()

        def run() -> None:
            try:
                out.append((True, self._run(key, what, make)))
            except BaseException as exc:
                out.append((False, exc))
            finally:
                done.set()

        start_thread(run, name="stoker-store-request")
        while not done.wait(0.1):
            pass
        ok, value = out[0]
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]

    # ---- retrying --------------------------------------------------------------------------------------
    def _retrying(self, key: str, what: str, call: Callable[[], T], progress: Callable[[], int] | None = None) -> T:
        """``call()``, retried with exponential backoff and full jitter while it fails transiently, within the retry budget.

        ``progress()`` (a download's bytes received) renews the budget and the backoff when it grows between tries.
        """
        policy = self.retry
        started = since = time.monotonic()
        attempts = retries = 0
        reached = progress() if progress is not None else 0
        while True:
            if self._interrupted.is_set():
                raise self._cancelled(key, what)
            attempts += 1
            self._count(requests=1)
            try:
                result = call()
            except _Cancelled:
                raise
            except Exception as exc:
                if isinstance(exc, RemoteError):
                    raise
                unreachable = unreachable_cause(exc)
                if (isinstance(exc, OSError) and exc.errno is not None and not isinstance(exc, (ConnectionError, TimeoutError))
                        and unreachable is None):  # fmt: skip
                    raise  # the local file (a full disk: ENOSPC), not the store
                kind = self._transient(exc)
                if kind != "connection":
                    unreachable = None  # (the instance-metadata service unreachable: no credentials, not the store)
                now = time.monotonic()
                if unreachable is None and kind != "connection":
                    self._answer()  # (an HTTP answer, even an error's: the store is there)
                if kind is None:
                    error = self._error(key, exc, what)
                    if attempts > 1:
                        error.add_note(f"after {attempts} attempts over {seconds_text(now - started)}")
                    raise error from None
                if progress is not None and progress() > reached:  # it moved on: the budget and backoff start again
                    reached, since, retries = progress(), now, 0
                spent = now - since
                left = policy.retry_budget - spent
                if unreachable is not None and not self._answered:  # not reached yet: the short budget
                    with self._lock:
                        first = self._unreachable_since is None
                        if first:
                            self._unreachable_since = now
                        gone = now - (self._unreachable_since or now)
                    budget = min(policy.connect_budget, policy.retry_budget)
                    if first:
                        self._said_at = now
                        log.warning("cannot reach %s (%s) to %s %s%s; retrying for up to %s (storage_options['connect_budget'])",
                                    self._endpoint(exc), unreachable, what, self.url, key, seconds_text(budget))  # fmt: skip
                    if gone >= budget:
                        raise self._unreachable(key, what, exc, unreachable, attempts, gone, budget) from None
                    left = min(left, budget - gone)
                if spent >= policy.retry_budget or (policy.max_attempts is not None and attempts >= policy.max_attempts):
                    raise self._gave_up(key, what, exc, attempts, now - started) from None
                self._say_retry(key, what, exc, attempts, now, now - started, left)
                pause = min(policy.wait(retries), left)
                retries += 1
                self._count(retries=1, retry_wait_s=pause, **{f"retries_{kind}": 1})
                if self._interrupted.wait(pause):
                    raise self._cancelled(key, what) from None
            else:
                self._answer()
                return result

    def _answer(self) -> None:
        """The store answered: from now on, failures to reach it are an outage, under the long budget."""
        if not self._answered:
            with self._lock:
                self._answered, self._unreachable_since = True, None

    def _endpoint(self, exc: BaseException) -> str:
        """The endpoint that the request ``exc`` ended tried (the client's word, else the store's), without credentials."""
        return self._scrub(endpoint_of(str(exc)) or self.endpoint)

    def _say_retry(self, key: str, what: str, exc: BaseException, attempts: int, now: float, failing: float, left: float) -> None:
        """A WARNING for a request failing for a second or more: at most one per store every :data:`_SAY_EVERY` seconds."""
        if failing < _SAY_AFTER:
            return
        with self._lock:
            if now - self._said_at < _SAY_EVERY:
                return
            self._said_at = now
        log.warning("retrying %s: %s, attempt %d (%s %s%s; failing for %s, giving up in %s)", self._endpoint(exc),
                    self._scrub(cause_of(exc)), attempts + 1, what, self.url, key, seconds_text(failing), seconds_text(max(0.0, left)))  # fmt: skip

    def _unreachable(
        self, key: str, what: str, exc: BaseException, cause: str, attempts: int, seconds: float, budget: float
    ) -> RemoteError:
        knob = "connect_budget" if budget < self.retry.retry_budget else "retry_budget"
        where = "the endpoint (storage_options['endpoint'], AWS_ENDPOINT_URL)" if self.url.startswith("s3://") else "the URL"
        return RemoteError(
            self.url,
            key,
            f"{what} failed: cannot reach the store at {self._endpoint(exc)}: {cause} (unreachable since the first try, "
            f"{seconds_text(seconds)} ago; {attempts} attempt{'s' if attempts > 1 else ''} of this request; {knob}={budget:g} s). Check "
            f"{where} and that the store is up, or raise storage_options[{knob!r}]",
        )

    def _gave_up(self, key: str, what: str, exc: BaseException, attempts: int, seconds: float) -> RemoteError:
        policy = self.retry
        if policy.max_attempts is not None and attempts >= policy.max_attempts:
            bound, knob = f"max_attempts={policy.max_attempts}", "storage_options['max_attempts']"
        else:
            bound, knob = f"retry_budget={policy.retry_budget:g} s", "storage_options['retry_budget'] [seconds]"
        return RemoteError(
            self.url,
            key,
            f"{what} failed after {attempts} attempts over {seconds_text(seconds)} ({bound}); the last error: {self._describe(exc)} "
            f"({self._scrub(cause_of(exc))} at {self._endpoint(exc)}). The store did not recover in time: check it, or raise {knob}",
        )
