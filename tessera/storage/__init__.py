"""Storage backends, chosen by URL (see :func:`storage_for`)."""

from __future__ import annotations

from .base import Storage, check_relpath
from .local import FileStorage


def storage_for(url: str, storage: Storage | None = None) -> Storage:
    """The backend for a checkpoint ``url`` (or ``storage`` itself if the caller passed one).

    Plain paths and ``file://`` URLs use :class:`FileStorage`.
    """
    if storage is not None:
        if not isinstance(storage, Storage):
            raise TypeError(f"storage={storage!r} does not implement tessera.storage.Storage")
        return storage
    if "://" not in url or url.startswith("file://"):
        return FileStorage(url)
    raise ValueError(f"no storage backend for URL {url!r}")


__all__ = ["FileStorage", "Storage", "check_relpath", "storage_for"]
