"""Small file and error helpers shared by the local tier's modules."""

from __future__ import annotations

import os

from ...errors import CheckpointError, StorageError


def remove_quietly(path: str) -> None:
    """Remove ``path``; a file already gone is fine (another rank or a cleanup got there first)."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def as_storage_error(e: BaseException, what: str) -> CheckpointError:
    """``e`` if it is already tessera's, else a ``StorageError`` saying ``what`` failed and why."""
    if isinstance(e, CheckpointError):
        return e
    out = StorageError(f"{what}: {type(e).__name__}: {e}")
    out.__cause__ = e
    return out
