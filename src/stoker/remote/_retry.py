"""How the storage layer rides through a store's faults: which errors are transient, and how long it retries them.

A transient error (a timeout, a reset or refused connection, HTTP 5xx, 429 or
S3's ``SlowDown``, a body cut short, a range answered with fewer bytes than
asked, an object replaced between two parts of a download) is retried with
exponential backoff and full jitter (the AWS SDKs' rule: wait a random time
between 0 and ``min(max_backoff, backoff * 2**n)`` before the n-th retry) for as
long as the request keeps failing within its *retry budget*; a download's
every byte renews its budget. What is not transient (a missing object, a
refused permission, other 4xx answers, no credentials) fails at once.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

__all__ = ["DEFAULT_BACKOFF", "DEFAULT_MAX_BACKOFF", "DEFAULT_RETRY_BUDGET", "RETRY_KINDS", "RetryPolicy", "seconds_text", "transient_kind"]

#: how long a request may go on failing transiently before it fails, when storage_options do not say [seconds]
DEFAULT_RETRY_BUDGET = 600.0
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
        backoff: the bound of the first retry's wait [seconds]; each next
            bound is twice the last, up to ``max_backoff``.
        max_backoff: the largest bound of a wait [seconds].
        max_attempts: at most this many tries of a request; ``None``: the budget alone.
    """

    retry_budget: float = DEFAULT_RETRY_BUDGET
    backoff: float = DEFAULT_BACKOFF
    max_backoff: float = DEFAULT_MAX_BACKOFF
    max_attempts: int | None = None

    def __post_init__(self) -> None:
        for name in ("retry_budget", "backoff", "max_backoff"):
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
