"""The manifest of a load: read once, size-checked before reading, decoded strictly."""

from __future__ import annotations

import logging
from typing import Any

from ...errors import CheckpointError, CheckpointNotFoundError, ManifestError, StorageError
from ...format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, decode
from ...storage import Storage, storage_for
from .path_report import examine_path

logger = logging.getLogger(__name__)


def read_manifest(
    path: str, *, storage: Storage | None = None, storage_options: dict[str, Any] | None = None
) -> Manifest:
    """Read and validate the committed manifest at ``path`` (no communication).

    Args:
        path: directory or URL of the checkpoint.
        storage: a backend instance to use instead of choosing one from ``path``.
        storage_options: backend options when ``storage`` is not given (see docs/storage.md).

    Returns:
        the decoded :class:`~tessera.format.manifest.Manifest` (tensors, tiles, files, values).

    Example:
        >>> m = tessera.read_manifest("/ckpt/step100")
        >>> m.tensors["model.w"].shape

    Raises:
        CheckpointNotFoundError: if nothing is committed there.
        ManifestError: if the manifest is invalid.
    """
    store = storage_for(path, storage, storage_options=storage_options)
    return decode(read_manifest_bytes(store, path), source=f"{path}/{MANIFEST_NAME}")


def read_manifest_bytes(store: Storage, path: str) -> bytes:
    try:
        return read_bytes(store, f"{path}/{MANIFEST_NAME}")  # the size limit is checked before reading
    except FileNotFoundError:
        raise not_found(path, store) from None


def not_found(path: str, store: Storage | None = None) -> CheckpointNotFoundError:
    """The error for a path with no committed checkpoint, saying what is there instead (:mod:`.path_report`)."""
    try:
        message = examine_path(path, storage=None if "://" not in path else store).message()
    except Exception as e:  # the diagnosis is a courtesy: never let it hide the error itself
        logger.debug("examining %s failed: %s", path, e)
        message = (
            f"no committed checkpoint at {path}: {MANIFEST_NAME} is missing (never saved, or the save did not finish)"
        )
    return CheckpointNotFoundError(message)


def manifest_bytes(store: Storage, path: str) -> bytes:
    """Any rank: the manifest's bytes, with any storage failure named as one."""
    try:
        return read_manifest_bytes(store, path)
    except CheckpointError:  # CheckpointNotFoundError, ManifestError (oversized, a directory), StorageError, ...
        raise
    except Exception as e:
        raise StorageError(f"reading {path}/{MANIFEST_NAME} failed: {type(e).__name__}: {e}") from e


def read_bytes(store: Storage, source: str) -> bytes:
    """The bytes of ``manifest.json`` in ``store``, refusing an oversized file before reading it.

    The size is checked with a stat (a HEAD on object stores) first, so a huge or sparse
    file is never read whole, and again on the bytes read (the file may have been replaced
    in between).

    Raises:
        FileNotFoundError: if there is no manifest.
        ManifestError: naming ``source`` if it is over :data:`MAX_MANIFEST_BYTES`.
    """
    try:
        size = store.size(MANIFEST_NAME)
        if size <= MAX_MANIFEST_BYTES:
            data = store.read_file(MANIFEST_NAME)
    except (IsADirectoryError, NotADirectoryError) as e:
        raise ManifestError(f"{source}: invalid manifest: not a regular file ({type(e).__name__})") from None
    if size > MAX_MANIFEST_BYTES:
        raise ManifestError(
            f"{source}: invalid manifest: size {size} bytes is over the {MAX_MANIFEST_BYTES}-byte limit"
        )
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(
            f"{source}: invalid manifest: size {len(data)} bytes is over the {MAX_MANIFEST_BYTES}-byte limit"
        )
    return data
