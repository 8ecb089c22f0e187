"""Storage backends, chosen by URL (see :func:`storage_for`)."""

from __future__ import annotations

from collections.abc import Mapping

from ._retry import RetryOptions
from .base import Storage, check_relpath
from .fsspec_store import FsspecStorage
from .local import FileStorage
from .memory_tier import TIER_PREFIX, MemoryTierStorage


def storage_for(
    url: str,
    storage: Storage | None = None,
    *,
    storage_options: Mapping[str, object] | None = None,
) -> Storage:
    """The backend for a checkpoint ``url`` (or ``storage`` itself if the caller passed one).

    * plain paths and ``file://`` URLs: :class:`FileStorage` (``storage_options`` are its
      keyword arguments, e.g. ``{"durable": False}``);
    * ``tier::<durable url>``: :class:`MemoryTierStorage` (deprecated: a
      :class:`~tessera.CheckpointManager` root ``tier::<url>`` is the local tier instead),
      committing to host memory first and persisting to the durable URL in the background;
    * any other ``scheme://`` URL (``s3://``, ``gs://``, ``memory://``, ``hdfs://``...):
      :class:`FsspecStorage`, with ``storage_options`` passed to the fsspec filesystem.

    Args:
        url: checkpoint path or URL.
        storage: an already configured backend; returned as is.
        storage_options: backend options, see above.

    Returns:
        A backend bound to ``url``.

    Raises:
        TypeError: if ``storage`` does not implement :class:`Storage`.
        ValueError: if the URL names no known protocol.
        ImportError: if the protocol's fsspec package (e.g. s3fs) is missing.

    Example:
        >>> type(storage_for("/tmp/ckpt/step-10")).__name__
        'FileStorage'
        >>> storage_for("s3://bucket/run/step-10", storage_options={"anon": False})  # doctest: +SKIP
    """
    if storage is not None:
        if not isinstance(storage, Storage):
            raise TypeError(f"storage={storage!r} does not implement tessera.storage.Storage")
        return storage
    if url.startswith(TIER_PREFIX):
        return MemoryTierStorage(url[len(TIER_PREFIX) :], storage_options=storage_options)
    if "://" not in url or url.startswith("file://"):
        return FileStorage(url, **dict(storage_options or {}))  # type: ignore[arg-type]
    return FsspecStorage(url, storage_options)


__all__ = [
    "FileStorage",
    "FsspecStorage",
    "MemoryTierStorage",
    "RetryOptions",
    "Storage",
    "check_relpath",
    "storage_for",
]
