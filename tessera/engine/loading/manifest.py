"""The manifest of a load: read once, size-checked before reading, decoded strictly.

Every reader goes through here: :func:`load_manifest` gives the whole manifest whichever
format version is committed (version 2: the index and every section), :func:`open_manifest`
what a loading rank needs to read only its part.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ...errors import CheckpointError, CheckpointNotFoundError, ManifestError, StorageError
from ...format.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    SECTIONED_VERSIONS,
    FileEntry,
    Manifest,
    decode,
    decode_files,
    decode_index,
)
from ...storage import Storage, storage_for
from ...storage.capabilities import ReadsBounded
from ..gc_pause import gc_paused_call
from .path_report import examine_path
from .sections import SectionedLoad, read_all_sections

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
    return load_manifest(store, path)


def load_manifest(store: Storage, path: str, *, lazy: bool = False) -> Manifest:
    """The whole manifest committed in ``store`` (at ``path``, for messages), of either format version.

    Version 1 is ``manifest.json`` decoded; version 2 is its index and every section (the whole
    sections file, one read, each section verified). ``lazy`` decodes version 1 tile tables on
    first use (version 2 is decoded whole).

    Raises:
        CheckpointNotFoundError: if nothing is committed there.
        ManifestError: if the manifest (or a section) is invalid.
    """
    return decode_read(store, path, read_manifest_bytes(store, path), lazy=lazy)


def decode_read(store: Storage, path: str, data: bytes, *, lazy: bool = False) -> Manifest:
    """:func:`load_manifest` of the ``manifest.json`` bytes ``data`` already read from ``store``."""
    source = f"{path}/{MANIFEST_NAME}"
    if not is_index(data):
        return decode(data, source=source, lazy=lazy)
    index = decode_index(data, source=source)
    return index.assemble(read_all_sections(store, index))


def read_manifest_files(store: Storage, path: str) -> tuple[str, tuple[FileEntry, ...]]:
    """The save id and data files of the manifest committed in ``store``, validated.

    Version 1 decodes no tensor (:func:`~tessera.format.manifest.decode_files`); version 2
    reads its sections (they list the files).

    Raises:
        CheckpointNotFoundError, ManifestError: as :func:`load_manifest`.
    """
    data = read_manifest_bytes(store, path)
    if not is_index(data):
        return decode_files(data, source=f"{path}/{MANIFEST_NAME}")
    m = decode_read(store, path, data)
    return m.save_id, m.files


@gc_paused_call
def open_manifest(store: Storage, path: str, rank: int) -> tuple[Manifest, SectionedLoad | None]:
    """What a loading rank reads first: a version 1 manifest (decoded lazily) and None, or a
    version 2 index's manifest (dtypes and shapes; tiles read when asked) and the
    :class:`SectionedLoad` whose ``narrow`` reads only the sections the rank's targets meet.

    Raises:
        CheckpointNotFoundError, ManifestError, StorageError: as :func:`manifest_bytes`.
    """
    data = manifest_bytes(store, path)
    source = f"{path}/{MANIFEST_NAME}"
    if not is_index(data):
        return decode(data, source=source, lazy=True), None
    part = SectionedLoad(store, decode_index(data, source=source), rank)
    return part.manifest, part


_INDEX_PREFIXES = tuple(b'{"format":"tessera","version":%d,' % v for v in SECTIONED_VERSIONS)


def is_index(data: bytes) -> bool:
    """Whether ``manifest.json`` bytes are an index (format version 2 or 4; the head tessera
    writes first; any other order is parsed to find out)."""
    if data.startswith(_INDEX_PREFIXES):
        return True
    if data.startswith(b'{"format":"tessera","version":'):
        return False
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False  # the decoder says what is wrong with it
    return isinstance(doc, dict) and doc.get("version") in SECTIONED_VERSIONS


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

    A backend that :class:`~tessera.storage.capabilities.ReadsBounded` reads it in one request
    that stops past the limit; any other is asked its size first (a HEAD on object stores), so
    a huge or sparse file is never read whole. The bytes read are checked again (the file may
    have been replaced in between).

    Raises:
        FileNotFoundError: if there is no manifest.
        ManifestError: naming ``source`` if it is over :data:`MAX_MANIFEST_BYTES`.
    """
    try:
        if isinstance(store, ReadsBounded):  # one request, not a size and a read
            got = store.read_bounded(MANIFEST_NAME, MAX_MANIFEST_BYTES)
            size, data = (got, b"") if isinstance(got, int) else (len(got), got)
        else:
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
