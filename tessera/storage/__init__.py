"""Storage backends, chosen by URL (see :func:`storage_for`)."""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import UnsupportedPathError
from ..format.names import check_relpath
from ._retry import RetryOptions
from .base import Storage
from .fsspec_store import FsspecStorage
from .host_memory import TIER_PREFIX
from .local import FileStorage


def storage_for(
    url: str,
    storage: Storage | None = None,
    *,
    storage_options: Mapping[str, object] | None = None,
) -> Storage:
    """The backend for a checkpoint ``url`` (or ``storage`` itself if the caller passed one).

    * plain paths and ``file://`` URLs: :class:`FileStorage` (``storage_options`` are its
      keyword arguments, e.g. ``{"durable": False}``);
    * ``tier::<url>``: no backend: the prefix names a :class:`~tessera.CheckpointManager`
      root with its local tier in host memory (``CheckpointManager("tier::<url>")``);
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
        tessera.errors.UnsupportedPathError: for a ``tier::`` URL.
        ValueError: if the URL names no known protocol.
        ImportError: if the protocol's fsspec package (e.g. s3fs) is missing.

    Example:
        >>> type(storage_for("/tmp/ckpt/step-10")).__name__
        'FileStorage'
        >>> storage_for("s3://bucket/run/step-10", storage_options={"anon": False})  # doctest: +SKIP
    """
    if url.startswith(TIER_PREFIX):
        # Checked before a configured backend is returned too: the prefix has one meaning.
        raise UnsupportedPathError(
            f"{url!r}: a 'tier::' path is a CheckpointManager root with its local tier in host memory, "
            f"not a checkpoint location. Save and load steps through "
            f"tessera.CheckpointManager({url!r}) (or CheckpointManager(<root>, local_dir=...)), or give "
            f"tessera.save/load the durable location {url[len(TIER_PREFIX) :]!r} itself."
        )
    if storage is not None:
        if not isinstance(storage, Storage):
            raise TypeError(f"storage={storage!r} does not implement tessera.storage.Storage")
        return storage
    if "://" not in url or url.startswith("file://"):
        return FileStorage(url, **dict(storage_options or {}))  # type: ignore[arg-type]
    return FsspecStorage(url, storage_options)


__all__ = [
    "FileStorage",
    "FsspecStorage",
    "RetryOptions",
    "Storage",
    "check_relpath",
    "storage_for",
]
