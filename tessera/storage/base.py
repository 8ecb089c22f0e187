"""The storage backend interface.

A backend is bound to one checkpoint root (a directory or URL prefix) and is addressed with
relative POSIX paths such as ``manifest.json`` or ``data/0a1b/0-0.safetensors``.

Call order during a save (every rank holds its own backend object for the same root):
    1. rank 0 reads the manifest's version (:meth:`CommitStorage.version`) and writes the
       save's owner marker ``.tessera-saves/<save id>``;
    2. each rank calls :meth:`Storage.write_file` for the data files it owns, all under
       ``data/<save id>/`` (names no committed manifest refers to), then
       :meth:`CommitStorage.sync_dirs` for them;
    3. after every rank's files are durable, rank 0 alone checks them
       (:meth:`CommitStorage.file_sizes`, one listing) and publishes ``manifest.json`` with
       :meth:`CommitStorage.replace_if` (or :meth:`Storage.write_atomic`): the commit point;
    4. rank 0 may then :meth:`Storage.delete` files of saves that are over (see
       :mod:`tessera.engine.commit`).

The methods of :class:`CommitStorage` are optional: a backend without them still works, with
weaker guarantees (no fencing of concurrent writers, one ``size`` call per file at commit).
Every optional method is declared in :mod:`tessera.storage.capabilities` as a
``runtime_checkable`` Protocol and checked with ``isinstance``.
During a load every rank calls :meth:`Storage.read_file` (manifest) and
:meth:`Storage.read_into` (byte ranges), from several threads at once.

Methods must be thread-safe. Errors are raised as :class:`tessera.errors.StorageError`
(or ``FileNotFoundError`` for a missing path, ``IsADirectoryError`` / ``NotADirectoryError``
for a path that is not a file) after the backend's own retries.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, runtime_checkable

from .capabilities import ConditionalPublish, ListsSizes, SyncsDirs

Buffer = bytes | bytearray | memoryview

TEMP_MARK = ".tmp-"
"""What :func:`temp_name` puts between a path and its random suffix."""
TEMP_RE = re.compile(r"\.tmp-[0-9a-f]{32}$")
"""Matches the end of a name made by :func:`temp_name` (the one temporary-file naming rule)."""


def temp_name(path: str) -> str:
    """A fresh temporary name beside ``path``, for a file published to ``path`` by a rename.

    Every backend names its temporary files this way, so that listings can leave them out
    (:func:`is_temp_name`) and leftovers of a writer that died can be found.

    Args:
        path: the final path (absolute, relative or a URL: only its end changes).

    Returns:
        ``<path>.tmp-<32 hex digits>``, unique per call.

    Example:
        >>> is_temp_name(temp_name("ckpt/manifest.json"))
        True
    """
    return f"{path}{TEMP_MARK}{uuid.uuid4().hex}"


def is_temp_name(name: str, of: str | None = None) -> bool:
    """Whether ``name`` is a temporary file of :func:`temp_name`'s rule.

    Args:
        name: a file name or path.
        of: the final name the temporary file was made for. Given, any ``<of>.tmp-*``
            counts (a leftover to remove before publishing ``of``, whatever wrote it);
            otherwise ``name`` must end like :func:`temp_name`'s names (:data:`TEMP_RE`), so a
            listing leaves out exactly those.

    Returns:
        Whether it is one.

    Example:
        >>> is_temp_name("manifest.json.tmp-0123", of="manifest.json"), is_temp_name("data/a.tmp-notes")
        (True, False)
    """
    if of is not None:
        return name.startswith(of + TEMP_MARK)
    return TEMP_RE.search(name) is not None


def timed_chunks(chunks: Iterable[Buffer], waited: Callable[[float], None]) -> Iterator[Buffer]:
    """``chunks`` as a backend takes them, the seconds spent making each passed to ``waited``, so
    that what is left of a write's time is the storage's own (``compress="auto"`` and
    ``TESSERA_DIRECT_IO=auto`` measure it). A backend that stops early closes the producer."""
    it = iter(chunks)
    try:
        while True:
            t = time.perf_counter()
            try:
                chunk = next(it)
            except StopIteration:
                return
            finally:
                waited(time.perf_counter() - t)
            yield chunk
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()  # the producer's own clean-up runs now


@runtime_checkable
class Storage(Protocol):
    """A place checkpoints live in: local files, host memory, an object store."""

    url: str
    """The root this backend is bound to, as the user gave it."""

    def write_file(self, path: str, chunks: Iterable[Buffer]) -> None:
        """Create (or replace) ``path`` with the concatenation of ``chunks``.

        Saves only ever create new names (``data/<save id>/...``). A backend must never
        truncate an existing file in place: replacing one goes through a new object or a
        rename, so a reader of the old file never sees it change. A failed write leaves
        nothing at ``path`` (where the backend can delete it).

        The chunks are consumed in order and may be large views of staging memory; a backend
        must not keep references to them after returning. On return the file is durable to
        the backend's guarantee (fsync on local disks, a completed upload on object stores).
        """
        ...

    def write_atomic(self, path: str, data: bytes) -> None:
        """Publish small ``data`` at ``path`` all-or-nothing: readers see the old or the new file."""
        ...

    def read_file(self, path: str) -> bytes:
        """The whole content of ``path``."""
        ...

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes of ``path`` at ``[offset, offset + len(out))``.

        Raises:
            StorageError: if the file is shorter than the requested range.
        """
        ...

    def size(self, path: str) -> int:
        """Size of ``path`` in bytes."""
        ...

    def exists(self, path: str) -> bool:
        """Whether ``path`` exists."""
        ...

    def list(self, prefix: str = "") -> list[str]:
        """Relative paths of all files under ``prefix`` (recursively), sorted."""
        ...

    def delete(self, paths: Iterable[str]) -> None:
        """Remove ``paths``; paths that do not exist are ignored."""
        ...


@runtime_checkable
class Reopens(Protocol):
    """A backend that can open the same kind of storage, with the same options, at another URL.

    Used to reach the shared tile directory beside a checkpoint (``CheckpointManager(dedup=True)``)
    from the checkpoint's own backend, so a step loads through ``tessera.load`` with nothing else
    configured. A backend without it cannot load steps that share tiles.
    """

    def reopen(self, url: str) -> Storage:
        """A backend bound to ``url``, configured as this one (credentials, durability, retries)."""
        ...


@runtime_checkable
class CommitStorage(ConditionalPublish, ListsSizes, SyncsDirs, Protocol):
    """The optional methods the commit protocol uses when a backend has them (docs/guarantees.md).

    A backend with all of them is fenced, checked with one listing and directory-durable.
    Code checks each capability on its own (:mod:`tessera.storage.capabilities`), so a
    backend may offer any subset.
    """
