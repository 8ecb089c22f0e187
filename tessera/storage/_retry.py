"""Retrying remote storage requests: which errors are transient, how long to wait, what to report.

Shared by the fsspec and S3 code paths so that both retry the same errors the same way and
fail with the same kind of message: the operation, the URL, the number of attempts, the
store's own words, and what to do about it.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from ..errors import StorageError

logger = logging.getLogger(__name__)

T = TypeVar("T")

# S3-style error codes that mean "try again later", not "you did it wrong".
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "PriorRequestNotComplete",
        "InternalError",
        "ServiceUnavailable",
        "BadDigest",  # the body was corrupted in transit
        "XAmzContentSHA256Mismatch",
        "500",
        "502",
        "503",
        "504",
    }
)
_TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})
_TRANSIENT_ERRNOS = frozenset(
    {errno.EAGAIN, errno.EBUSY, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE}
)
# Transport errors of botocore, aiohttp and fsspec, matched by class name so that no client
# library has to be importable to classify another library's error.
_TRANSIENT_CLASS_NAMES = frozenset(
    {
        "HTTPClientError",  # botocore: ReadTimeoutError, ConnectionClosedError, ResponseStreamingError
        "IncompleteReadError",
        "ResponseParserError",  # throttling answers are sometimes not even valid XML
        "ChecksumError",
        "FlexibleChecksumError",
        "ClientPayloadError",  # aiohttp
        "ClientConnectionError",
        "ServerDisconnectedError",
        "FSTimeoutError",  # fsspec
        "IncompleteRead",
    }
)
_AUTH_CODES = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"})


@dataclass(frozen=True)
class RetryOptions:
    """How remote backends retry transient failures (throttling, timeouts, 5xx, resets).

    The delay before attempt ``n + 1`` is drawn uniformly from ``[d / 2, d]`` with
    ``d = min(max_backoff_s, initial_backoff_s * 2 ** (n - 1))`` ("equal jitter"), so ranks
    that were throttled together do not retry together.
    """

    max_attempts: int = 10
    """Attempts per request, the first one included; 1 disables retries."""
    initial_backoff_s: float = 0.2
    """Upper bound of the first delay, in seconds."""
    max_backoff_s: float = 20.0
    """Cap on any single delay, in seconds."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"RetryOptions.max_attempts must be >= 1, got {self.max_attempts}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("RetryOptions backoffs must be >= 0")

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        d = min(self.max_backoff_s, self.initial_backoff_s * 2 ** (attempt - 1))
        return d / 2 + random.uniform(0, d / 2)


class Truncated(Exception):
    """A ranged read came back short: the file ends at ``end``. Never retried."""

    def __init__(self, end: int) -> None:
        super().__init__(end)
        self.end = end


def client_error(exc: BaseException) -> BaseException | None:
    """The botocore ``ClientError`` behind ``exc`` (itself, or chained as its cause)."""
    e: BaseException | None = exc
    for _ in range(8):
        if e is None:
            return None
        if isinstance(getattr(e, "response", None), dict):
            return e
        e = e.__cause__ or e.__context__
    return None


def error_code(exc: BaseException) -> tuple[str | None, int | None]:
    """``(code, http_status)`` of an S3-style or HTTP error, or ``(None, None)``."""
    ce = client_error(exc)
    if ce is None:
        status = getattr(exc, "code", None)  # e.g. gcsfs's HttpError
        return None, status if isinstance(status, int) else None
    response: dict = ce.response  # type: ignore[attr-defined]
    code = response.get("Error", {}).get("Code")
    return (str(code) if code is not None else None), response.get("ResponseMetadata", {}).get("HTTPStatusCode")


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is worth retrying: throttling, timeouts, dropped connections, 5xx.

    Missing files, permissions, bad requests and programming errors are not.
    """
    if isinstance(exc, (FileNotFoundError, PermissionError, Truncated)):
        return False
    code, status = error_code(exc)
    if code is not None or status is not None:
        return code in _TRANSIENT_CODES or status in _TRANSIENT_STATUS
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    names = {c.__name__ for c in type(exc).__mro__}
    if names & _TRANSIENT_CLASS_NAMES:
        return True
    if "ConnectionError" in names and "SSLError" not in names:  # botocore EndpointConnectionError
        return True
    return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS


def describe(exc: BaseException) -> str:
    """A one-line account of ``exc`` in the store's own words."""
    ce = client_error(exc)
    if ce is not None:
        code, status = error_code(exc)
        message = ce.response.get("Error", {}).get("Message") or str(ce)  # type: ignore[attr-defined]
        return f"{code} (HTTP {status}): {message}"
    return f"{type(exc).__name__}: {exc}"


def hint(exc: BaseException, endpoint: str | None = None, bucket: str | None = None) -> str:
    """What the user should do about ``exc``."""
    code, status = error_code(exc)
    names = {c.__name__ for c in type(exc).__mro__}
    if code == "NoSuchBucket":
        return f"bucket {bucket!r} does not exist (or was deleted); create it or fix the URL"
    if code == "NoSuchUpload":
        return "the multipart upload vanished (aborted, or its bucket was deleted); save again"
    if code in _AUTH_CODES or status == 403 or isinstance(exc, PermissionError):
        return (
            "check the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or "
            "storage_options key/secret) and the bucket policy"
        )
    if "NoCredentialsError" in names:
        return "no credentials found: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or pass storage_options"
    if is_transient(exc):
        where = f"endpoint {endpoint}" if endpoint else "store"
        return f"the {where} kept failing; check that it is reachable and healthy, or raise RetryOptions.max_attempts"
    return "check the URL, the storage_options and the store's logs"


def failure(
    what: str, where: str, exc: BaseException, attempts: int, *, endpoint: str | None = None, bucket: str | None = None
) -> BaseException:
    """The exception to raise when ``what`` on ``where`` failed for good after ``attempts`` tries."""
    if isinstance(exc, FileNotFoundError):
        return FileNotFoundError(errno.ENOENT, f"{where} does not exist", where)
    tries = f" after {attempts} attempts" if attempts > 1 else ""
    return StorageError(f"{what} {where} failed{tries}: {describe(exc)}; {hint(exc, endpoint, bucket)}")


def _log_retry(what: str, where: str, attempt: int, policy: RetryOptions, exc: BaseException, delay: float) -> None:
    logger.info(
        "%s %s: attempt %d/%d failed (%s); retrying in %.2fs",
        what,
        where,
        attempt,
        policy.max_attempts,
        describe(exc),
        delay,
    )


def call_with_retry(
    policy: RetryOptions,
    what: str,
    where: str,
    fn: Callable[[], T],
    *,
    endpoint: str | None = None,
    bucket: str | None = None,
) -> T:
    """Run ``fn`` until it succeeds, fails for good, or runs out of attempts.

    Raises:
        FileNotFoundError: if ``fn`` found nothing at ``where``.
        StorageError: for any other failure, naming ``what``, ``where`` and the cause.
        Truncated: passed through for the caller to describe.
    """
    attempt = 1
    while True:
        try:
            return fn()
        except Truncated:
            raise
        except Exception as e:
            if not is_transient(e) or attempt >= policy.max_attempts:
                raise failure(what, where, e, attempt, endpoint=endpoint, bucket=bucket) from e
            delay = policy.delay(attempt)
            _log_retry(what, where, attempt, policy, e, delay)
            time.sleep(delay)
            attempt += 1


async def acall_with_retry(
    policy: RetryOptions,
    what: str,
    where: str,
    fn: Callable[[], Awaitable[T]],
    *,
    endpoint: str | None = None,
    bucket: str | None = None,
) -> T:
    """:func:`call_with_retry` for coroutines: waits with ``asyncio.sleep``."""
    attempt = 1
    while True:
        try:
            return await fn()
        except Truncated:
            raise
        except Exception as e:
            if not is_transient(e) or attempt >= policy.max_attempts:
                raise failure(what, where, e, attempt, endpoint=endpoint, bucket=bucket) from e
            delay = policy.delay(attempt)
            _log_retry(what, where, attempt, policy, e, delay)
            await asyncio.sleep(delay)
            attempt += 1
