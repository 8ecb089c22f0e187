"""Optional backend capabilities: what a backend may offer beyond :class:`~tessera.storage.base.Storage`.

Each capability is a small ``runtime_checkable`` Protocol; storage-independent code asks
``isinstance(store, Capability)`` and never looks methods up by name. A backend without a
capability still works, with the weaker behaviour each protocol's docstring states.

Who uses what, in the order a save and a load meet them:

- :class:`Locatable` (every rank, planning): the location ranks compare before writing.
- :class:`Versioned` / :class:`ConditionalPublish` (rank 0, claim and publish): fencing of
  concurrent writers; without them a later writer silently wins.
- :class:`SyncsDirs` (every rank, after writing): directory entries made durable.
- :class:`ListsSizes` (rank 0, commit check): one listing instead of one ``size`` per file.
- :class:`PartialVisibility` (rank 0, commit check): a node directory of the manager's local
  tier, which cannot see every rank's files (the tier checks them itself).
- :class:`RemovesEmptyDirs` (rank 0, clean-up): directories of saves killed early removed.
- :class:`Uncommits` (rank 0, manager retention): withdraw a manifest under the fence.
- :class:`Recaches` (every rank, after the commit): the files it wrote brought back into the page
  cache for the first load after the save (local files written around it).
- :class:`ReadsBounded` (every rank, load): the manifest in one request, no ``size`` first.
- :class:`MapsRanges` (every rank, load): zero-copy reads from a memory map.
- :class:`Closable` (manager, CLI): release descriptors.
- :class:`~tessera.storage.base.Reopens` (saves and loads of steps that share tiles): the shared
  tile directory (declared beside ``Storage``, since it returns one).

Note that ``isinstance`` against a runtime protocol checks that the members exist, not their
signatures; :func:`tessera.engine.commit` inspects the one optional keyword it relies on (``owner``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

__all__ = [
    "Closable",
    "ConditionalPublish",
    "ListsSizes",
    "Locatable",
    "MapsRanges",
    "PartialVisibility",
    "ReadsBounded",
    "Recaches",
    "RemovesEmptyDirs",
    "SyncsDirs",
    "Uncommits",
    "Versioned",
]


@runtime_checkable
class Locatable(Protocol):
    """A backend that can say where it writes better than its ``url`` (e.g. a resolved path)."""

    def location(self) -> str:
        """The location this backend writes to, as one string all ranks can compare."""
        ...


@runtime_checkable
class Versioned(Protocol):
    """A backend that versions files; the commit reads the manifest's version when it claims."""

    def version(self, path: str) -> str | None:
        """An opaque token that changes whenever ``path`` is replaced; None if it does not exist."""
        ...


@runtime_checkable
class ConditionalPublish(Versioned, Protocol):
    """A backend that publishes a file only over an expected version (the commit's fence)."""

    def replace_if(self, path: str, data: bytes, expected: str | None, *, owner: str | None = None) -> None:
        """:meth:`Storage.write_atomic`, but only if :meth:`version` of ``path`` is still ``expected``.

        With ``owner`` (the save's owner marker), also only while that file exists: retention
        removes a step's markers before its files, so a save whose marker is gone must not
        publish a manifest naming deleted files (see :mod:`tessera.engine.commit`). A backend that
        cannot check both under one fence checks the marker right after publishing and
        withdraws its manifest if the marker is gone.

        Raises:
            tessera.errors.ConcurrentSaveError: if it is not (nothing is written then).
        """
        ...


@runtime_checkable
class ListsSizes(Protocol):
    """A backend that lists the sizes under a prefix in few requests."""

    def file_sizes(self, prefix: str) -> dict[str, int]:
        """``{relative path: size}`` of every file under ``prefix``, in as few requests as possible."""
        ...


@runtime_checkable
class SyncsDirs(Protocol):
    """A filesystem backend whose directory entries need their own fsync."""

    def sync_dirs(self, paths: Iterable[str]) -> None:
        """Make the directory entries of the (already durable) files ``paths`` durable."""
        ...


@runtime_checkable
class RemovesEmptyDirs(Protocol):
    """A filesystem backend that keeps empty directories after their files are deleted."""

    def remove_empty_dirs(self, prefix: str) -> None:
        """Remove the empty directories under ``prefix``."""
        ...


@runtime_checkable
class PartialVisibility(Protocol):
    """A backend that may not see every rank's files (e.g. a node directory of the local tier)."""

    all_files_visible: bool
    """False when rank 0 cannot see the files other ranks wrote; the commit check is skipped."""


@runtime_checkable
class Uncommits(Protocol):
    """A fenced backend that can withdraw a committed manifest (retention under the fence)."""

    def uncommit(self, manifest: str, expected: str | None, markers: Iterable[str]) -> bool:
        """Remove ``manifest`` if it is still at version ``expected`` and no save in ``markers`` is live."""
        ...


@runtime_checkable
class MapsRanges(Protocol):
    """A backend that can hand out read-only memory maps of byte ranges."""

    def map_range(self, path: str, offset: int, length: int) -> memoryview:
        """A read-only, zero-copy view of ``[offset, offset + length)`` of ``path``."""
        ...

    def release_range(self, path: str, offset: int, length: int) -> None:
        """Drop this process's hold on a range returned by :meth:`map_range`."""
        ...


@runtime_checkable
class ReadsBounded(Protocol):
    """A backend that reads a small file whole in one request and stops past a size limit, so
    that a reader refusing oversized files needs no ``size`` request first (every rank's first
    read of a load: the manifest)."""

    def read_bounded(self, path: str, limit: int) -> bytes | int:
        """The bytes of ``path``, or its size (an ``int``, over ``limit``) if it is longer than
        ``limit`` bytes; at most ``limit + 1`` bytes are read either way.

        Raises:
            FileNotFoundError: if ``path`` does not exist.
        """
        ...


@runtime_checkable
class Recaches(Protocol):
    """A backend whose writes bypass a cache that a first read after the save would want filled."""

    def recache(self, paths: Iterable[str], *, supersedes: bool = True) -> None:
        """Start filling the cache with ``paths`` (written by this rank, committed) in the
        background; return at once. With ``supersedes``, what an earlier call filled it with
        is no longer wanted there (False: the new checkpoint still reads those files).
        Never raises for a file that is gone."""
        ...


@runtime_checkable
class Closable(Protocol):
    """A backend holding resources (descriptors, maps, threads) to release when done."""

    def close(self) -> None:
        """Release the backend's resources; the object must not be used afterwards."""
        ...
