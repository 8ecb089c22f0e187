"""Persistence of the memory tier: copy a save's files to the durable store, check them, publish.

:class:`TierPersistence` is the half of :class:`~tessera.storage.memory_tier.MemoryTierStorage`
that talks to the durable store in the background: :meth:`~TierPersistence.persist` (one
process copies a whole save) and :meth:`~TierPersistence.after_commit` (every rank copies its
own files and reports with a marker, :mod:`~tessera.storage.memory_tier.markers`). The jobs run
on the process's persistence thread (:mod:`~tessera.storage.memory_tier.registry`). Optional
durable capabilities (fenced publish, one listing, directory sync) are used when the backend
declares them (:mod:`tessera.storage.capabilities`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import posixpath
import time
from collections.abc import Iterable, Iterator

from ...errors import StorageError
from ..base import Storage, check_relpath, is_temp_name
from ..capabilities import ConditionalPublish, ListsSizes, SyncsDirs, Versioned
from ..local import FileStorage
from .markers import await_markers, check_save_id, marker_dir, remove_markers, write_marker
from .paths import MANIFEST, is_manifest, manifest_files
from .registry import TierState, submit, wait_last_job

logger = logging.getLogger(__name__)

_COPY_CHUNK = 16 << 20


def _size_or_none(store: Storage, path: str) -> int | None:
    try:
        return store.size(path)
    except FileNotFoundError:
        return None


class TierPersistence:
    """The persistence half of :class:`~tessera.storage.memory_tier.MemoryTierStorage` (a mixin).

    The facade sets the attributes below in its ``__init__``.
    """

    url: str
    durable: Storage
    memory: FileStorage
    per_rank: bool
    commit_timeout_s: float
    max_workers: int
    _s: TierState
    _memory_valid: bool | None

    # -- persistence ---------------------------------------------------------------------------

    def persist(self, files: Iterable[str] | None = None, *, commit: bool = True) -> concurrent.futures.Future[None]:
        """Copy the memory copy to the durable backend in the background.

        Args:
            files: files to copy; ``None`` means exactly the files the memory ``manifest.json``
                references (with ``commit``), or every file under the memory directory except
                manifests (without).
            commit: after the files, publish the memory ``manifest.json`` (as it is now) to the
                durable backend with ``write_atomic``, then apply deferred deletes.

        Returns:
            A future that completes when the copy (and commit) is durable, or holds the
            :class:`StorageError` that stopped it; the durable store then still holds its
            previous commit.

        Raises:
            StorageError: if ``commit`` and nothing is committed in memory.

        Example:
            >>> tier.persist().result()  # push a memory-only commit out after a restart  # doctest: +SKIP
        """
        manifest: bytes | None = None
        if commit:
            try:
                manifest = self.memory.read_file(MANIFEST)
            except FileNotFoundError as e:
                raise StorageError(
                    f"nothing to persist for {self.url}: no {MANIFEST} committed in {self.memory.root}"
                ) from e
        if files is not None:
            snapshot = [check_relpath(p) for p in files]
        elif manifest is not None:
            # Exactly the files of the save being persisted: the memory directory may still
            # hold files of an earlier save (its cleanup comes later), and those may be files
            # the durable manifest references; copying them again would rewrite committed files.
            # The manifest says which; for bytes that are not a tessera manifest, the files
            # written through the tier since its last commit.
            with self._s.lock:
                written = sorted(self._s.written)
            snapshot = manifest_files(manifest, written)
        else:
            snapshot = [p for p in self.memory.list() if not is_manifest(p) and not is_temp_name(p)]
        if manifest is not None:
            with self._s.lock:
                self._s.written.clear()
        return submit(self._s, self._run_persist, snapshot, manifest, commit=manifest is not None)

    def after_commit(self, *, rank: int, world_size: int, save_id: str, files: Iterable[str]) -> None:
        """Start this rank's share of persisting the save just committed (per-rank mode).

        Called by ``tessera.save`` on every rank of the saving group once rank 0 has committed
        ``manifest.json`` through this storage and every rank knows the save succeeded. Not
        collective: it waits only for this process's previous persistence (backpressure), then
        returns; the copy runs on the persistence thread. This rank's files are copied to the
        durable store and reported with a marker; rank 0 then waits for every rank's marker
        and publishes the manifest (see :mod:`tessera.storage.memory_tier`). Failures are not raised here:
        :meth:`wait_persisted` reports them (on rank 0, every rank's). A no-op unless
        ``per_rank`` is on, and for a ``save_id`` this process already handled.

        Args:
            rank: this process's rank in the saving group; rank 0 publishes the manifest.
            world_size: ranks in the saving group, i.e. markers rank 0 waits for.
            save_id: the save's unique id (names the markers).
            files: the data files this rank wrote for the save.

        Raises:
            ValueError: for a rank outside ``[0, world_size)`` or a save id that is not a
                plain name.

        Example:
            >>> tier.after_commit(rank=3, world_size=16, save_id="5f0c...", files=["data/5f0c.../3-0.safetensors"])  # doctest: +SKIP
        """
        if not self.per_rank:
            return
        if not 0 <= rank < world_size:
            raise ValueError(f"{self.url}: rank {rank} is outside the saving group of {world_size}")
        check_save_id(save_id, self.url)
        mine = [check_relpath(p) for p in files]
        with self._s.lock:
            if self._s.hooked_save == save_id:
                return
            self._s.hooked_save = save_id
        wait_last_job()  # one checkpoint in flight per process, as for a one-node commit
        manifest = self._memory_manifest() if rank == 0 else None
        submit(self._s, self._run_rank_persist, mine, rank, world_size, save_id, manifest, commit=rank == 0)

    def wait_persisted(self, timeout: float | None = None) -> None:
        """Block until the memory directory's last persistence in this process is durable.

        That is the last one started by any tier object of this process on the directory.

        Raises:
            StorageError: if it failed (the durable store holds its previous commit).
            TimeoutError: if it is still running after ``timeout`` seconds.
        """
        with self._s.lock:
            future = self._s.pending
        if future is None:
            return
        try:
            future.result(timeout)
        except concurrent.futures.TimeoutError as e:
            raise TimeoutError(f"persisting {self.url} still running after {timeout}s") from e

    def close(self) -> None:
        """Wait for pending persistence (see :meth:`wait_persisted`). Holds no other resource."""
        self.wait_persisted()

    def _memory_manifest(self) -> bytes | None:
        try:
            return self.memory.read_file(MANIFEST)
        except FileNotFoundError:
            return None

    def _run_persist(self, files: list[str], manifest: bytes | None) -> None:
        t0 = time.monotonic()
        expected = self._durable_version() if manifest is not None else None
        copied = self._copy_files(files)
        if manifest is not None:
            self._publish(manifest, expected, files)
        logger.info(
            "persisted %s: %d files, %d bytes%s in %.2fs",
            self.url,
            len(files),
            copied,
            ", committed" if manifest is not None else "",
            time.monotonic() - t0,
        )

    def _run_rank_persist(
        self, files: list[str], rank: int, world_size: int, save_id: str, manifest: bytes | None
    ) -> None:
        """Per-rank mode: copy this rank's files, report them; rank 0 then commits for everyone."""
        t0 = time.monotonic()
        markers = marker_dir(save_id)
        expected = self._durable_version() if rank == 0 else None
        try:
            copied = self._copy_files(files)
        except StorageError as e:
            with self._s.lock:  # dropped from memory after the next successful copy
                self._s.own_files.extend(p for p in files if p not in self._s.own_files)
            if world_size > 1:  # tell rank 0 at once rather than let it wait for the timeout
                write_marker(self.durable, f"{markers}/{rank}.failed", str(e).encode(), rank, self.url)
            raise
        # This rank's files of earlier saves: the memory manifest no longer refers to them,
        # and rank 0's cleanup does not reach this node's memory.
        with self._s.lock:
            previous, self._s.own_files = self._s.own_files, list(files)
        keep = set(files)
        self.memory.delete([p for p in previous if p not in keep])
        if world_size > 1:
            write_marker(self.durable, f"{markers}/{rank}.ok", b"", rank, self.url)
        if rank == 0:
            if manifest is None:
                raise StorageError(f"nothing to persist for {self.url}: no {MANIFEST} committed in {self.memory.root}")
            if world_size > 1:
                await_markers(self.durable, markers, world_size, self.commit_timeout_s, self.url)
            self._publish(manifest, expected, [])
            if world_size > 1:
                remove_markers(self.durable)
        logger.info(
            "persisted %s (rank %d of %d): %d files, %d bytes%s in %.2fs",
            self.url,
            rank,
            world_size,
            len(files),
            copied,
            ", committed" if rank == 0 else "",
            time.monotonic() - t0,
        )

    def _durable_version(self) -> str | None:
        return self.durable.version(MANIFEST) if isinstance(self.durable, Versioned) else None

    def _publish(self, manifest: bytes, expected: str | None, files: list[str]) -> None:
        """Commit ``manifest`` in the durable store, then apply the deferred deletes.

        ``expected`` is the durable manifest's version when this persistence started: the
        publish is conditional on it (backends with ``replace_if``), so a save committed
        straight to the durable store meanwhile is not overwritten. ``files`` (the ones just
        copied) are checked to be there with their memory sizes first.
        """
        with self._s.lock:
            missing = sorted(self._s.failed_copies)
        if missing:
            # An earlier persist(commit=False) lost these files: a manifest published now
            # could refer to files the durable store does not have.
            raise StorageError(
                f"not committing {self.url}: {len(missing)} file(s) failed to persist earlier "
                f"({', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}); persist them again first"
            )
        self._check_durable(files)
        try:
            if isinstance(self.durable, ConditionalPublish):
                self.durable.replace_if(MANIFEST, manifest, expected)
            else:
                self.durable.write_atomic(MANIFEST, manifest)
        except Exception as e:
            logger.error("committing %s to %s failed: %s", MANIFEST, self.durable.url, e)
            raise StorageError(f"persisting {self.url} failed committing {MANIFEST}: {e}") from e
        with self._s.lock:
            deletes, self._s.deferred_deletes = self._s.deferred_deletes, []
            self._memory_valid = None
        if deletes:
            try:
                self.durable.delete(deletes)
            except Exception as e:  # garbage left behind is safe; the commit stands
                logger.warning("deferred delete of %d files under %s failed: %s", len(deletes), self.durable.url, e)

    def _check_durable(self, files: list[str]) -> None:
        """Every copied file is in the durable store with its memory size (one listing per directory)."""
        if not files:
            return
        lists_sizes = isinstance(self.durable, ListsSizes)
        found: dict[str, int] = {}
        if isinstance(self.durable, ListsSizes):
            for d in sorted({posixpath.dirname(p) for p in files}):
                found.update(self.durable.file_sizes(d))
        problems = []
        for p in files:
            try:
                want = os.path.getsize(os.path.join(self.memory.root, p))
            except FileNotFoundError:
                continue  # deleted from memory since (no manifest needs it)
            got = found.get(p) if lists_sizes else _size_or_none(self.durable, p)
            if got != want:
                problems.append(f"{p}: {'missing' if got is None else f'{got} bytes instead of {want}'}")
        if problems:
            raise StorageError(
                f"not committing {self.url}: {len(problems)} copied file(s) are not in {self.durable.url} as written: "
                + "; ".join(problems[:5])
                + "; the durable checkpoint keeps its previous commit"
            )

    def _copy_files(self, files: list[str]) -> int:
        """Copy ``files`` from memory to the durable backend, ``max_workers`` at a time; bytes copied.

        Raises:
            StorageError: naming the first file that failed (every copy has ended by then).
        """
        jobs: dict[concurrent.futures.Future[int], str] = {}
        copiers = concurrent.futures.ThreadPoolExecutor(self.max_workers, thread_name_prefix="tessera-tier-copy")
        for p in files:
            try:
                jobs[copiers.submit(self._copy_file, p)] = p
            except RuntimeError:
                # The interpreter is exiting and refuses new pool work: copy in this thread,
                # so that a persistence already under way still completes.
                inline: concurrent.futures.Future[int] = concurrent.futures.Future()
                try:
                    inline.set_result(self._copy_file(p))
                except BaseException as e:
                    inline.set_exception(e)
                jobs[inline] = p
        copiers.shutdown(wait=False)  # its threads exit once the submitted copies are done
        copied = 0
        failure: tuple[str, BaseException] | None = None
        for fut in concurrent.futures.as_completed(jobs):
            try:
                copied += fut.result()
                with self._s.lock:
                    self._s.failed_copies.discard(jobs[fut])
            except BaseException as e:  # keep draining so no copy outlives this job
                with self._s.lock:
                    self._s.failed_copies.add(jobs[fut])
                failure = failure or (jobs[fut], e)
        # Directory entries durable before any manifest names them.
        if failure is None and files and isinstance(self.durable, SyncsDirs):
            try:
                self.durable.sync_dirs(files)
            except Exception as e:
                failure = (files[0], e)
        if failure is not None:
            path, cause = failure
            logger.error(
                "persisting %s failed on %s: %s; the durable copy still holds its previous commit",
                self.url,
                path,
                cause,
            )
            raise StorageError(
                f"persisting {self.url} failed copying {path}: {cause}; the durable checkpoint at "
                f"{self.durable.url} still holds its previous commit"
            ) from cause
        return copied

    def _copy_file(self, path: str) -> int:
        full = os.path.join(self.memory.root, path)
        try:
            f = open(full, "rb")  # noqa: SIM115 - entered below, once we know it exists
        except FileNotFoundError:
            with self._s.lock:
                deleted = path in self._s.deleted
            if deleted:  # removed by a delete() after the snapshot: no manifest needs it
                return 0
            raise StorageError(f"{full} vanished from the memory tier before it was persisted") from None
        with f:
            size = os.fstat(f.fileno()).st_size

            def chunks() -> Iterator[bytes]:
                left = size
                while left > 0:
                    data = f.read(min(_COPY_CHUNK, left))
                    if not data:
                        raise StorageError(f"{full} shrank while being persisted")
                    left -= len(data)
                    yield data

            self.durable.write_file(path, chunks())
        return size
