"""A checkpoint's backend that also reaches the shared tile directory beside it.

A step saved by ``CheckpointManager(dedup=True)`` references the tiles it shares with other
steps as ``@tiles/<save id>/<file>`` (:data:`~tessera.format.names.SHARED_REF`): files in the
root's ``.tessera-tiles`` directory, beside the step directories. :func:`with_shared_tiles`
wraps the checkpoint's backend so that every reader (load, verify, convert) resolves those
references with no change of its own; a reference that cannot be resolved fails with an
error that says how to make the step self-contained.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

from ..errors import MissingTilesError, UnsupportedPathError
from ..format.manifest import Manifest
from ..format.names import SHARED_REF, is_shared_ref, shared_tiles_url
from .base import Buffer, Reopens, Storage
from .capabilities import Closable, MapsRanges

__all__ = ["SharedTileReads", "references_shared", "with_shared_tiles"]


def references_shared(paths: Iterable[str]) -> bool:
    """Whether any of a manifest's file references points into the shared tile directory."""
    return any(is_shared_ref(p) for p in paths)


def with_shared_tiles(store: Storage, manifest: Manifest, url: str) -> Storage:
    """``store`` itself, or (if ``manifest`` references shared tiles) a view that also reaches them.

    Args:
        store: the checkpoint's backend.
        manifest: the checkpoint's manifest (its ``saved_at`` metadata names the original place).
        url: the checkpoint's path or URL (its parent holds the shared tile directory).

    Raises:
        UnsupportedPathError: the backend cannot open the shared tile directory.
    """
    if isinstance(store, SharedTileReads) or not references_shared(f.path for f in manifest.files):
        return store
    saved_at = manifest.metadata.get("saved_at")
    tiles_url = shared_tiles_url(url)
    if not isinstance(store, Reopens):
        raise UnsupportedPathError(
            f"{url} shares tiles with other steps (files under {tiles_url}), but its storage backend "
            f"{type(store).__name__} cannot open that directory (it lacks reopen()). Load it through "
            "tessera.load with a path or URL, or make it self-contained with "
            f"`tessera convert {url} OUT --to tessera`"
        )
    shared = store.reopen(tiles_url)
    cls = (
        _MappedSharedTileReads if isinstance(store, MapsRanges) and isinstance(shared, MapsRanges) else SharedTileReads
    )
    return cls(store, shared, url, tiles_url, saved_at if isinstance(saved_at, str) else url)


class SharedTileReads:
    """The checkpoint's backend, with ``@tiles/...`` paths answered by the shared tile directory.

    Args:
        checkpoint: the checkpoint's backend (every other path goes there).
        shared: the backend of the shared tile directory.
        url: the checkpoint's path or URL (for errors).
        shared_url: the shared tile directory's URL (for errors).
        saved_at: where the checkpoint was saved (for errors: a copy made by hand differs).
    """

    def __init__(self, checkpoint: Storage, shared: Storage, url: str, shared_url: str, saved_at: str) -> None:
        self.checkpoint = checkpoint
        self.shared = shared
        self.url = checkpoint.url
        self._ckpt_url = url
        self._shared_url = shared_url
        self._saved_at = saved_at

    def _route(self, path: str) -> tuple[Storage, str]:
        if is_shared_ref(path):
            return self.shared, path[len(SHARED_REF) :]
        return self.checkpoint, path

    def _missing(self, path: str) -> MissingTilesError:
        return MissingTilesError(
            f"{self._ckpt_url} references {path}, which is not in the shared tile directory {self._shared_url}: "
            "this step shares tiles with other steps of its CheckpointManager root and is not self-contained "
            f"(was it copied or moved without its root, or the tiles deleted by hand?). It was saved at "
            f"{self._saved_at}: load it there, or make a self-contained copy with "
            f"`tessera convert {self._saved_at} OUT --to tessera`"
        )

    def write_file(self, path: str, chunks: Iterable[Buffer]) -> None:
        store, rel = self._route(path)
        store.write_file(rel, chunks)

    def write_atomic(self, path: str, data: bytes) -> None:
        store, rel = self._route(path)
        store.write_atomic(rel, data)

    @contextlib.contextmanager
    def _explained(self, store: Storage, path: str) -> Iterator[None]:
        """A shared file that is not there is a step without its root: say so."""
        try:
            yield
        except FileNotFoundError as e:
            if store is self.shared:
                raise self._missing(path) from e
            raise

    def read_file(self, path: str) -> bytes:
        store, rel = self._route(path)
        with self._explained(store, path):
            return store.read_file(rel)

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        store, rel = self._route(path)
        with self._explained(store, path):
            store.read_into(rel, offset, out)

    def size(self, path: str) -> int:
        store, rel = self._route(path)
        with self._explained(store, path):
            return store.size(rel)

    def exists(self, path: str) -> bool:
        store, rel = self._route(path)
        return store.exists(rel)

    def list(self, prefix: str = "") -> list[str]:
        """Files of the checkpoint under ``prefix`` (or of the shared directory for ``@tiles/...``)."""
        if is_shared_ref(prefix):
            return [SHARED_REF + p for p in self.shared.list(prefix[len(SHARED_REF) :])]
        return self.checkpoint.list(prefix)

    def delete(self, paths: Iterable[str]) -> None:
        """Delete checkpoint files; shared tiles are never deleted through a checkpoint (retention does it)."""
        self.checkpoint.delete([p for p in paths if not is_shared_ref(p)])

    def close(self) -> None:
        for store in (self.checkpoint, self.shared):
            if isinstance(store, Closable):
                store.close()


class _MappedSharedTileReads(SharedTileReads):
    """:class:`SharedTileReads` over two backends that both map ranges (local files)."""

    def map_range(self, path: str, offset: int, length: int) -> memoryview:
        store, rel = self._route(path)
        assert isinstance(store, MapsRanges)
        with self._explained(store, path):
            return store.map_range(rel, offset, length)

    def release_range(self, path: str, offset: int, length: int) -> None:
        store, rel = self._route(path)
        assert isinstance(store, MapsRanges)
        store.release_range(rel, offset, length)
