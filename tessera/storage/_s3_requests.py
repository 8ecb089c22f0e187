"""S3 requests for :mod:`tessera.storage._s3`: the filesystem, the one retry policy, one call per request.

:class:`S3Requests` is the plumbing :class:`~tessera.storage._s3.S3Objects` builds its operations on:
keys under the root, running coroutines on fsspec's I/O loop, and every request retried by
:mod:`tessera.storage._retry` (botocore's own retries are off, s3fs's are bypassed).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, TypeVar

from ._retry import RetryOptions, acall_with_retry, describe, error_code

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

logger = logging.getLogger(__name__)

T = TypeVar("T")

MiB = 1 << 20
S3_MIN_PART_SIZE = 5 * MiB
"""S3's smallest allowed multipart part (every part but the last)."""
S3_MAX_PARTS = 10_000
"""S3's largest part number."""
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404"})

_FS_CACHE: dict[tuple[int, str], AbstractFileSystem] = {}
_FS_CACHE_LOCK = threading.Lock()


def s3_filesystem(options: Mapping[str, object]) -> AbstractFileSystem:
    """A cached, private ``S3FileSystem`` whose botocore client does not retry on its own.

    Private (``skip_instance_cache``) so that turning off botocore's retries does not change
    the instance other code in the process gets from ``fsspec.filesystem("s3")``. Keyed by
    process id too: a forked child must not reuse its parent's connections.

    Raises:
        ImportError: if s3fs is not installed.
    """
    try:
        import s3fs
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("s3:// checkpoints need s3fs: pip install 'tessera[s3]'") from e
    opts = dict(options)
    config = dict(opts.get("config_kwargs") or {})  # type: ignore[call-overload]
    # botocore would otherwise retry too (legacy mode: 5 attempts) under our own retries.
    config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
    opts["config_kwargs"] = config
    key = (os.getpid(), repr(sorted(opts.items(), key=lambda kv: kv[0])))
    with _FS_CACHE_LOCK:
        fs = _FS_CACHE.get(key)
        if fs is None:
            fs = _FS_CACHE[key] = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
    return fs


class S3Requests:
    """Requests for the objects under ``s3://<bucket>/<prefix>/``, addressed by checked relative paths.

    Args:
        url: the checkpoint root as the user gave it (for messages).
        fs: an ``S3FileSystem`` from :func:`s3_filesystem`.
        bucket: the bucket.
        prefix: the key prefix of the root, without slashes at either end ("" for the bucket).
        part_size: bytes per multipart part and per ranged GET.
        max_concurrency: parts (or ranges) of one file in flight at once.
        retry: the retry policy.
        endpoint: the endpoint URL, for messages.
    """

    def __init__(
        self,
        url: str,
        fs: AbstractFileSystem,
        bucket: str,
        prefix: str,
        *,
        part_size: int,
        max_concurrency: int,
        retry: RetryOptions,
        endpoint: str | None,
    ) -> None:
        if part_size < S3_MIN_PART_SIZE:
            raise ValueError(f"part_size={part_size} is below S3's minimum part size of {S3_MIN_PART_SIZE} bytes")
        self.url = url
        self.fs = fs
        self.bucket = bucket
        self.prefix = prefix
        self.part_size = part_size
        self.max_concurrency = max_concurrency
        self.retry = retry
        self.endpoint = endpoint

    # -- plumbing --------------------------------------------------------------------------------

    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def url_of(self, rel: str) -> str:
        return f"{self.url.rstrip('/')}/{rel}" if rel else self.url

    def _run(self, coro_fn: Callable[..., Awaitable[T]], *args: object) -> T:
        """Run a coroutine on fsspec's I/O loop and wait for it in this thread."""
        from fsspec.asyn import sync

        return sync(self.fs.loop, coro_fn, *args)

    async def _retrying(self, what: str, rel: str, fn: Callable[[], Awaitable[T]]) -> T:
        return await acall_with_retry(
            self.retry, what, self.url_of(rel), fn, endpoint=self.endpoint, bucket=self.bucket
        )

    async def _call(self, method: str, **kwargs: object) -> dict:
        """One S3 request. s3fs's ``_call_s3`` is not used: its own retry loop sleeps even on
        the last attempt and would stack under ours.

        A missing key becomes ``FileNotFoundError`` (chained to the ``ClientError``); any
        other error is raised as the client raised it, for the retry policy to judge.
        """
        await self.fs.set_session()
        client = await self.fs.get_s3(self.bucket)
        fn = getattr(client, method)
        kwargs["Bucket"] = self.bucket
        try:
            # Adds the user's s3_additional_kwargs (SSE, RequestPayer...) that ``method`` accepts.
            kwargs = self.fs._get_s3_method_kwargs(fn, **kwargs)
        except AttributeError:  # pragma: no cover - an s3fs without the helper
            pass
        try:
            return await fn(**kwargs)
        except Exception as e:
            code, status = error_code(e)
            if code in _NOT_FOUND_CODES or (code is None and status == 404):
                raise FileNotFoundError(errno.ENOENT, describe(e)) from e
            raise

    def _request(self, what: str, rel: str, method: str, **kwargs: object) -> dict:
        """A retried request, from a calling thread."""
        return self._run(self._retrying, what, rel, lambda: self._call(method, **kwargs))
