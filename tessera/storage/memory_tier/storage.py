"""The memory tier's Storage facade: :class:`MemoryTierStorage` (semantics in the package docstring)."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import sys
import warnings
from collections.abc import Iterable, Mapping

from ... import _knobs
from ...errors import StorageError
from ..base import Buffer, Storage, check_relpath, is_temp_name
from ..capabilities import Locatable
from ..local import FileStorage
from .paths import MANIFEST, TIER_PREFIX, default_memory_root, is_manifest
from .persistence import TierPersistence
from .registry import state_for, wait_last_job

logger = logging.getLogger(__name__)

DEPRECATION = (
    "the one-checkpoint host-memory tier (tessera.storage.MemoryTierStorage, 'tier::' paths given to "
    "tessera.save/load) is deprecated and will be removed in tessera 0.2: host-memory checkpoints are "
    "CheckpointManager's local tier, CheckpointManager('tier::<url>') or CheckpointManager(<url>, "
    "local_dir=...) (replicas on other nodes, recovery from peers; see docs/resilience.md)"
)


def _caller_level() -> int:
    """The stack level of the first frame outside tessera (the user's call), for the warning."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("tessera."):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return level


class MemoryTierStorage(TierPersistence):
    """Deprecated two-stage storage: commit to a host-memory directory, persist to ``durable`` in the background.

    Deprecated (a :class:`DeprecationWarning` at construction): host-memory checkpoints are the
    local tier of :class:`~tessera.CheckpointManager` (``CheckpointManager("tier::<url>")`` or
    ``local_dir=...``), which adds replicas on other nodes and recovery from peers.

    Implements :class:`~tessera.storage.Storage`; see :mod:`tessera.storage.memory_tier` for the exact
    semantics. Thread-safe.

    Args:
        durable: the durable backend, or its URL (resolved with ``storage_for``).
        storage_options: options for the durable backend when ``durable`` is a URL.
        memory_root: directory of the memory copy; default :func:`default_memory_root`.
        auto_persist: persist every commit automatically. ``False``: only :meth:`persist` does.
        max_workers: files copied to the durable backend at once.
        per_rank: with ``auto_persist``, let every rank copy its own files from
            :meth:`after_commit` (rank 0 publishing the manifest once all ranks reported)
            instead of the committing process copying the whole memory directory. Default:
            on when ``WORLD_SIZE != LOCAL_WORLD_SIZE`` (torchrun's variables), the only mode
            that works across nodes.
        commit_timeout_s: per-rank mode: how long rank 0 waits for the other ranks' markers
            before giving the commit up (default ``TESSERA_TIMEOUT_S``, 600 s).

    Raises:
        ValueError: for ``per_rank=False`` with ``auto_persist`` in a multi-node job.

    Example:
        >>> tier = MemoryTierStorage("/mnt/ckpt/step-100", memory_root="/dev/shm/me/step-100")  # doctest: +SKIP
        >>> tier.write_file("data/0-0.safetensors", [payload])  # doctest: +SKIP
        >>> tier.write_atomic("manifest.json", manifest)  # committed in RAM, persisting  # doctest: +SKIP
        >>> tier.wait_persisted()  # now also committed in /mnt/ckpt/step-100  # doctest: +SKIP
    """

    def __init__(
        self,
        durable: Storage | str,
        *,
        storage_options: Mapping[str, object] | None = None,
        memory_root: str | None = None,
        auto_persist: bool = True,
        max_workers: int = 4,
        per_rank: bool | None = None,
        commit_timeout_s: float | None = None,
    ) -> None:
        warnings.warn(DEPRECATION, DeprecationWarning, stacklevel=_caller_level())
        if isinstance(durable, str):
            from .. import storage_for  # the package imports this module; resolve lazily

            durable = storage_for(durable, storage_options=storage_options)
        elif not isinstance(durable, Storage):
            raise TypeError(f"durable={durable!r} does not implement tessera.storage.Storage")
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        world, local = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
        multi_node = bool(world and local and world != local)
        if auto_persist and multi_node and per_rank is False:
            raise ValueError(
                f"MemoryTierStorage({durable.url!r}): per_rank=False needs every rank on one node, but "
                f"WORLD_SIZE={world} and LOCAL_WORLD_SIZE={local}; leave per_rank unset "
                "(see tessera.storage.memory_tier)"
            )
        self.durable: Storage = durable
        self.url = TIER_PREFIX + durable.url
        self.memory = FileStorage(memory_root or default_memory_root(durable.url), durable=False)
        self.auto_persist = auto_persist
        self.per_rank = bool(auto_persist and (multi_node if per_rank is None else per_rank))
        self.commit_timeout_s = _knobs.collective_timeout_s() if commit_timeout_s is None else float(commit_timeout_s)
        self.max_workers = max_workers
        self._s = state_for(self.memory.root)
        self._memory_valid: bool | None = None

    def __repr__(self) -> str:
        return f"MemoryTierStorage({self.durable.url!r}, memory_root={self.memory.root!r})"

    def _wait_pending(self) -> None:
        """Read-your-commits: let this process's pending persistence of the directory land first.

        Only the manifest needs it: data files are found in either copy without waiting,
        so the save's cleanup right after a commit (``list``, ``delete``) does not block.
        """
        with self._s.lock:
            future = self._s.pending
        if future is not None and not future.done():
            concurrent.futures.wait([future])

    def _committing(self) -> bool:
        """Whether this process's own commit of the directory is on its way to the durable store."""
        with self._s.lock:
            return self._s.pending_commit and self._s.pending is not None and not self._s.pending.done()

    def _use_memory(self) -> bool:
        with self._s.lock:
            valid = self._memory_valid
        if valid is None:
            try:
                durable = self.durable.read_file(MANIFEST)
            except FileNotFoundError:
                durable = None
            valid = durable is not None and self._memory_manifest() == durable
            with self._s.lock:
                self._memory_valid = valid
        return valid

    def _read_memory(self, path: str, offset: int, view: memoryview, *, strict: bool) -> bool:
        """Fill ``view`` from the memory copy.

        Returns ``False`` if the file is missing or too short there, unless ``strict``, which
        raises ``FileNotFoundError`` or :class:`StorageError` instead.
        """
        full = os.path.join(self.memory.root, path)
        try:
            # A fresh descriptor per call: a cached one would pin deleted files in RAM.
            fd = os.open(full, os.O_RDONLY)
        except FileNotFoundError:
            if strict:
                raise
            return False
        try:
            got = 0
            while got < len(view):
                n = os.preadv(fd, [view[got:]], offset + got)
                if n == 0:
                    if strict:
                        raise StorageError(
                            f"{full} is truncated: wanted bytes [{offset}, {offset + len(view)}), "
                            f"file ends at {offset + got}"
                        )
                    logger.warning("%s is shorter in memory than requested; reading the durable copy", full)
                    return False
                got += n
            return True
        finally:
            os.close(fd)

    # -- Storage protocol --------------------------------------------------------------------------

    def write_file(self, path: str, chunks: Iterable[Buffer]) -> None:
        """Write ``path`` to the memory copy (persisted with the next commit)."""
        rel = check_relpath(path)
        with self._s.lock:
            self._memory_valid = None
            self._s.deleted.discard(rel)
            self._s.written.add(rel)
            if rel in self._s.deferred_deletes:
                self._s.deferred_deletes = [p for p in self._s.deferred_deletes if p != rel]
        self.memory.write_file(rel, chunks)

    def write_atomic(self, path: str, data: bytes) -> None:
        """Publish ``path`` atomically.

        ``manifest.json`` is committed in memory and, with ``auto_persist``, its persistence
        starts; the call first waits for the process's previous persistence (backpressure;
        a failure of that one is logged and reported by its own :meth:`wait_persisted`). Any other file (a "latest"
        pointer, timings...) is written through to both copies at once.

        Raises:
            ValueError: for a ``manifest.json`` below the root: a tier holds one checkpoint.
        """
        rel = check_relpath(path)
        if rel != MANIFEST and is_manifest(rel):
            raise ValueError(
                f"{self.url}: cannot commit {rel!r} through a tier bound to another checkpoint; "
                f"open a MemoryTierStorage on that checkpoint's own URL"
            )
        if rel != MANIFEST:
            self.memory.write_atomic(rel, data)
            self.durable.write_atomic(rel, data)
            return
        self._commit_manifest(data, None, conditional=False)

    def _commit_manifest(self, data: bytes, expected: str | None, *, conditional: bool) -> None:
        if self.auto_persist:
            # Backpressure: one checkpoint in flight to durable storage per process, whatever
            # its URL, so host memory holds at most the one persisting and the one being saved.
            wait_last_job()
        with self._s.lock:
            self._memory_valid = None
            self._s.deleted.discard(MANIFEST)
        if conditional:
            self.memory.replace_if(MANIFEST, data, expected)
        else:
            self.memory.write_atomic(MANIFEST, data)
        if self.auto_persist and not self.per_rank:  # per-rank mode starts in after_commit
            self.persist()

    # -- commit protocol (see tessera.commit) ------------------------------------------------------

    def version(self, path: str) -> str | None:
        """Version of the memory copy of ``path``: the in-memory commit is the one fenced here.

        The durable publish is fenced separately: it is conditional on the durable manifest
        being the one that was there when the persistence started.
        """
        return self.memory.version(check_relpath(path))

    def replace_if(self, path: str, data: bytes, expected: str | None) -> None:
        """Commit ``manifest.json`` in memory if its memory version is ``expected``, then persist it.

        Raises:
            ConcurrentSaveError: another save committed the memory copy meanwhile.
            ValueError: for any other path.
        """
        rel = check_relpath(path)
        if rel != MANIFEST:
            raise ValueError(f"{self.url}: replace_if is for {MANIFEST}, not {rel!r}")
        self._commit_manifest(data, expected, conditional=True)

    def file_sizes(self, prefix: str) -> dict[str, int]:
        """Sizes of the memory copies under ``prefix`` (what the commit in memory refers to)."""
        return self.memory.file_sizes(prefix)

    @property
    def all_files_visible(self) -> bool:
        """Whether rank 0 sees every rank's files: not in per-rank (multi-node) mode, where each
        node's files are in its own memory and the durable commit waits for every rank's marker."""
        return not self.per_rank

    def location(self) -> str:
        """``tier::`` and the durable backend's location."""
        return TIER_PREFIX + (str(self.durable.location()) if isinstance(self.durable, Locatable) else self.durable.url)

    def read_file(self, path: str) -> bytes:
        """Content of ``path``; a ``manifest.json`` always comes from the durable backend."""
        rel = check_relpath(path)
        if rel == MANIFEST:
            self._wait_pending()
            data = self.durable.read_file(MANIFEST)
            with self._s.lock:
                self._memory_valid = self._memory_manifest() == data
            return data
        if is_manifest(rel):
            return self.durable.read_file(rel)
        if self._use_memory():
            try:
                return self.memory.read_file(rel)
            except FileNotFoundError:
                return self.durable.read_file(rel)
        try:
            return self.durable.read_file(rel)
        except FileNotFoundError:
            return self.memory.read_file(rel)  # written here, not persisted (yet)

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` from the memory copy when it matches the durable commit, else from durable."""
        rel = check_relpath(path)
        view = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        if self._use_memory():
            if not self._read_memory(rel, offset, view, strict=False):
                self.durable.read_into(rel, offset, view)
            return
        try:
            self.durable.read_into(rel, offset, view)
        except FileNotFoundError:
            self._read_memory(rel, offset, view, strict=True)

    def size(self, path: str) -> int:
        rel = check_relpath(path)
        if is_manifest(rel):
            if rel == MANIFEST:
                self._wait_pending()
            return self.durable.size(rel)
        first, second = (self.memory, self.durable) if self._use_memory() else (self.durable, self.memory)
        try:
            return first.size(rel)
        except FileNotFoundError:
            return second.size(rel)

    def exists(self, path: str) -> bool:
        """Whether ``path`` exists.

        A ``manifest.json`` counts once durable, or while this process's own commit of it is
        being persisted (read-your-writes without waiting).
        """
        rel = check_relpath(path)
        if is_manifest(rel):
            return (rel == MANIFEST and self._committing()) or self.durable.exists(rel)
        return self.memory.exists(rel) or self.durable.exists(rel)

    def list(self, prefix: str = "") -> list[str]:
        """Files under ``prefix`` in either copy; a ``manifest.json`` as :meth:`exists` says."""
        committing = self._committing()
        # Temporary files of a publish in progress (the persistence thread's, in the durable
        # store) are no files of the checkpoint: listed, retention could delete one mid-rename.
        durable = [p for p in self.durable.list(prefix) if not is_temp_name(p)]
        memory = [p for p in self.memory.list(prefix) if not is_manifest(p) and not is_temp_name(p)]
        if committing and (not prefix or check_relpath(prefix) == MANIFEST):
            memory.append(MANIFEST)
        return sorted(set(durable) | set(memory))

    def delete(self, paths: Iterable[str]) -> None:
        """Remove ``paths`` from memory now, and from the durable backend once it is safe.

        Safe means the durable manifest is the one committed in memory; until then (a
        persistence pending, or ``auto_persist=False`` before :meth:`persist` commits) the
        durable deletes are deferred to the next durable commit.
        """
        rels = [check_relpath(p) for p in paths]
        if not rels:
            return
        with self._s.lock:
            self._s.deleted.update(rels)
            self._s.written.difference_update(rels)
            self._s.failed_copies.difference_update(rels)  # no manifest will need them
            self._memory_valid = None
            pending = self._s.pending is not None and not self._s.pending.done()
            if pending:
                self._s.deferred_deletes.extend(rels)
        self.memory.delete(rels)
        if pending:
            logger.debug("deferring durable delete of %d files until %s is persisted", len(rels), self.url)
            return
        memory_manifest = self._memory_manifest()
        if memory_manifest is not None:
            try:
                durable_manifest: bytes | None = self.durable.read_file(MANIFEST)
            except FileNotFoundError:
                durable_manifest = None
            if durable_manifest != memory_manifest:
                with self._s.lock:
                    self._s.deferred_deletes.extend(rels)
                logger.debug("deferring durable delete of %d files until %s is committed", len(rels), self.url)
                return
        self.durable.delete(rels)
