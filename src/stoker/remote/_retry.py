"""How the storage layer rides through a store's faults: which errors are transient, and how long it retries them.

A transient error (a timeout, a reset or refused connection, HTTP 5xx, 429 or
S3's ``SlowDown``, a body cut short, a range answered with fewer bytes than
asked, an object replaced between two parts of a download) is retried with
exponential backoff and full jitter (the AWS SDKs' rule: wait a random time
between 0 and ``min(max_backoff, backoff * 2**n)`` before the n-th retry) for as
long as the request keeps failing within its *retry budget*; a download's
every byte renews its budget. What is not transient (a missing object, a
refused permission, other 4xx answers, no credentials) fails at once.

A store that cannot be reached at all is not throttling: a refused
connection, an unknown host, a failed TLS handshake, an unreachable network
(:func:`unreachable_cause`) while the store has not answered once since it was
opened fail after a short budget of their own (``connect_budget``, 20 s), not
the long one; once the store has answered, the same failures are an outage,
ridden through within the long budget.
"""

from __future__ import annotations

import math
import random
import re
import socket
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = [
    "DEFAULT_BACKOFF",
    "DEFAULT_CONNECT_BUDGET",
    "DEFAULT_MAX_BACKOFF",
    "DEFAULT_RETRY_BUDGET",
    "RETRY_KINDS",
    "RetryPolicy",
    "cause_of",
    "endpoint_of",
    "seconds_text",
    "transient_kind",
    "unreachable_cause",
]

#: how long a request may go on failing transiently before it fails, when storage_options do not say [seconds]
DEFAULT_RETRY_BUDGET = 600.0
#: how long a store that has not answered once may go on being unreachable (refused, unknown host, TLS) [seconds]
DEFAULT_CONNECT_BUDGET = 20.0
#: the first retry's backoff bound, and the cap of every backoff [seconds]
DEFAULT_BACKOFF = 0.1
DEFAULT_MAX_BACKOFF = 20.0
DENIED = re.compile(r"status code: (401|403)|AccessDenied|Forbidden|Unauthorized|InvalidAccessKeyId|SignatureDoesNotMatch", re.IGNORECASE)
NOT_FOUND = re.compile(r"status code: 404|NoSuchKey|NoSuchBucket|not found", re.IGNORECASE)
_CLIENT_ERROR = re.compile(r"status code: 4\d\d")
#: transient errors by kind (the first that matches): the counters of Store.stats() are named after them
_KINDS = (
    ("throttled", re.compile(r"status code: 429|\b429 |SlowDown|Throttl|TooManyRequests|RequestLimitExceeded", re.IGNORECASE)),
    ("server", re.compile(r"status code: (5\d\d|408)|\b5\d\d |RequestTimeout\b|InternalError|ServiceUnavailable", re.IGNORECASE)),
    (
        "cut",
        re.compile(r"Requested \d+\.\.\d+, got|body error|incomplete|unexpected eof|error decoding response|end of file", re.IGNORECASE),
    ),
    ("connection", re.compile(r"timed? ?out|timeout|connection|reset|broken pipe|error sending request|refused|closed|dns", re.IGNORECASE)),
)
#: the kinds of transient error, as Store.stats() counts their retries (``retries_<kind>``)
RETRY_KINDS = ("throttled", "server", "cut", "connection", "changed")
METADATA_HOST = re.compile(r"169\.254\.169\.254|fd00:ec2::254|metadata\.google\.internal|/latest/api/token", re.IGNORECASE)


# ---- a store that cannot be reached: what the client library's error holds (hyper/reqwest's source, or Python's) ------
_CONNECT = re.compile(r"kind: Connect\b|ConnectError|\(\s*Connect,|tcp connect error", re.IGNORECASE)
_REFUSED = re.compile(r"ConnectionRefused|Connection refused", re.IGNORECASE)
_DNS = re.compile(r"dns error|failed to lookup address|Name or service not known|nodename nor servname|No address associated|"
                  r"Temporary failure in name resolution", re.IGNORECASE)  # fmt: skip
_NO_ROUTE = re.compile(r"NetworkUnreachable|Network is unreachable|HostUnreachable|No route to host", re.IGNORECASE)
_TLS = (  # rustls's errors (Debug and Display forms), then any TLS words
    (re.compile(r"InvalidCertificate\(\s*(\w+)"), "invalid peer certificate ({})"),
    (re.compile(r"invalid peer certificate: (\w+)"), "invalid peer certificate ({})"),
    (re.compile(r"InvalidMessage\(\s*(\w+)"), "invalid handshake message ({}): does the endpoint speak TLS (https://)?"),
    (re.compile(r"AlertReceived\(\s*(\w+)"), "the server refused the handshake ({})"),
    (re.compile(r"PeerIncompatible\(\s*(\w+)"), "the server's TLS is incompatible ({})"),
    (re.compile(r"PeerMisbehaved\(\s*(\w+)"), "the server broke the protocol ({})"),
    (re.compile(r"(certificate verify failed[^\n\"]{0,80}|\bSSL\b[^\n\"]{0,80}|\bTLS\b[^\n\"]{0,80}|handshake[^\n\"]{0,80})"), "{}"),
)
_PERFORMING = re.compile(r"Error performing \w+ (\w+://[^\s,)]+)|uri: Some\(\s*(\w+://[^\s,)]+)")
_STATUS = re.compile(r"status code: (\d{3})")
_XML_CODE = re.compile(r"<Code>([^<]{1,100})</Code>")


def endpoint_of(text: str) -> str | None:
    """The endpoint (``scheme://host:port``) that a client error says it tried, or ``None``."""
    found = _PERFORMING.search(text)
    if found is None:
        return None
    parts = urlsplit(found[1] or found[2])
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}" if parts.netloc else None


def unreachable_cause(exc: BaseException) -> str | None:
    """Why the store could not be reached at all, in a few words (``"connection refused"``, ``"unknown host"``,
    ``"TLS: ..."``, ``"network unreachable"``, ``"connect timed out"``), or ``None`` for any other error: no
    connection was made, so the store did not answer (not throttling, not a fault in transit)."""
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, socket.gaierror):
        return "unknown host"
    if isinstance(exc, ssl.SSLError):
        return f"TLS: {exc.reason or exc}"
    text = str(exc)
    if not _CONNECT.search(text) and not isinstance(exc, OSError):
        return None
    if _REFUSED.search(text):
        return "connection refused"
    if _DNS.search(text):
        return "unknown host"
    if _NO_ROUTE.search(text):
        return "network unreachable"
    for pattern, words in _TLS:
        found = pattern.search(text)
        if found is not None:
            return "TLS: " + words.format(found[1].strip())
    if re.search(r"TimedOut|timed out", text):
        return "connect timed out"
    return None


def cause_of(exc: BaseException) -> str:
    """The cause of a failed request in a few words, for a message: why the store could not be reached, its HTTP
    status (and S3's error code), or the client's one-line description."""
    unreachable = unreachable_cause(exc)
    if unreachable is not None:
        return unreachable
    text = str(exc)
    if type(exc).__name__ == "PreconditionError":
        return "the object changed during the download"
    status = _STATUS.search(text)
    if status is not None:
        code = _XML_CODE.search(text)
        return f"HTTP {status[1]}" + (f" {code[1]}" if code is not None else "")
    if re.search(r"ConnectionReset|connection reset", text, re.IGNORECASE):
        return "connection reset"
    if re.search(r"IncompleteMessage|connection closed before message completed", text, re.IGNORECASE):
        return "connection closed before the answer"
    if isinstance(exc, TimeoutError) or re.search(r"TimedOut|timed out", text, re.IGNORECASE):  # (not retry_timeout)
        return "timed out"
    first = text.split("Debug source:")[0].strip().splitlines()
    return first[0].rpartition(" - ")[2][:200] if first else type(exc).__name__


def seconds_text(value: float) -> str:
    """``75.3`` -> ``'1 min 15 s'``; ``2.5`` -> ``'2.5 s'``."""
    if value < 60:
        return f"{value:.1f} s"
    minutes, secs = divmod(round(value), 60)
    return f"{minutes} min {secs} s" if secs else f"{minutes} min"


def transient_kind(exc: BaseException) -> str | None:
    """The kind of a transient error (one of :data:`RETRY_KINDS`), or ``None`` for an error that is not retried."""
    if isinstance(exc, (FileNotFoundError, PermissionError)):
        return None
    name = type(exc).__name__
    if name == "PreconditionError":  # the object changed between two parts of a download (If-Match)
        return "changed"
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return "connection"
    if name in ("NotFoundError", "PermissionDeniedError", "UnauthenticatedError", "InvalidPathError", "UnknownConfigurationKeyError"):
        return None
    text = str(exc)
    if METADATA_HOST.search(text) or DENIED.search(text):
        return None
    if unreachable_cause(exc) is not None:  # (a Python socket.gaierror or ssl.SSLError, too)
        return "connection"
    status = _CLIENT_ERROR.search(text)
    if status is not None and not re.search(r"status code: (408|429)", text):
        return None
    for kind, pattern in _KINDS:
        if pattern.search(text):
            return kind
    return None


@dataclass(frozen=True)
class RetryPolicy:
    """How a :class:`Store` retries transient errors (see the module).

    Attributes:
        retry_budget: how long a request may go on failing transiently, since its
            first try or its last progress [seconds].
        connect_budget: how long a store that has not answered once since it
            was opened may go on being unreachable (:func:`unreachable_cause`)
            before its request fails [seconds]; at most ``retry_budget``.
        backoff: the bound of the first retry's wait [seconds]; each next
            bound is twice the last, up to ``max_backoff``.
        max_backoff: the largest bound of a wait [seconds].
        max_attempts: at most this many tries of a request; ``None``: the budget alone.
    """

    retry_budget: float = DEFAULT_RETRY_BUDGET
    connect_budget: float = DEFAULT_CONNECT_BUDGET
    backoff: float = DEFAULT_BACKOFF
    max_backoff: float = DEFAULT_MAX_BACKOFF
    max_attempts: int | None = None

    def __post_init__(self) -> None:
        for name in ("retry_budget", "connect_budget", "backoff", "max_backoff"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"storage_options[{name!r}] must be a number of seconds >= 0; got {value!r}")
        n = self.max_attempts
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"storage_options['max_attempts'] must be an int >= 1, or None for no bound but the retry budget; got {n!r}")

    def wait(self, retry: int) -> float:
        """The wait before retry number ``retry`` (0 first) [seconds]: full jitter below the exponential bound."""
        bound = min(self.max_backoff, self.backoff * 2.0 ** min(retry, 60))
        return random.uniform(0.0, bound)
