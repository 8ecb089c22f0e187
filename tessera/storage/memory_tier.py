"""Host-memory tier: commit a checkpoint to RAM first, persist it to durable storage in the background.

A save through :class:`MemoryTierStorage` finishes at host-memory speed, and a restart on the
same node loads at host-memory speed, while the durable store (S3, a shared filesystem...)
still receives every checkpoint and stays the source of truth.

Usage::

    tessera.save("tier::s3://bucket/run/step-100", state)          # through storage_for
    # or, with options:
    tier = MemoryTierStorage("s3://bucket/run/step-100", storage_options={...})
    tessera.save(tier.url, state, storage=tier)
    tier.wait_persisted()                                          # optional: block until durable

How it works:

* **Layout.** The memory copy lives in a plain directory (a :class:`FileStorage` without
  fsync) laid out exactly like the durable checkpoint, by default
  ``/dev/shm/tessera/<store>/<path of the durable URL>`` (:func:`default_memory_root`). Every
  rank on a node that saves to the same durable URL uses the same directory, and the memory
  copies nest like the checkpoints: a tier opened on a run's root sees (and its deletes
  reach) the memory copies of the run's step checkpoints.
* **Save.** ``write_file`` writes to memory only. ``write_atomic("manifest.json")`` commits in
  memory, then (``auto_persist=True``) schedules the persistence: exactly the files that
  manifest references are copied to the durable backend, several at a time (never files of an
  earlier save still in memory: the durable manifest may reference those), their durable sizes
  are checked, and the manifest bytes committed in memory are published there last,
  conditionally on the durable manifest being the one there when the persistence started. The
  durable store therefore goes from the old complete checkpoint to the new complete one, with
  the same commit point as a direct save. ``write_atomic`` of any other file (a "latest"
  pointer, timings) writes through to both copies at once.
* **Backpressure.** A commit waits for the process's previous persistence to finish (one
  background thread runs them in order), so at most one checkpoint is being persisted and
  one more being saved at any time, whatever their URLs.
* **Deletes.** ``delete`` removes files from memory at once, but from the durable store only
  once the durable manifest is the one committed in memory (after the pending persistence);
  before that the durable manifest may still refer to them.
* **Load.** The durable manifest decides what is committed: ``read_file``, ``exists``,
  ``size`` and ``list`` see a ``manifest.json`` (at any depth) only in the durable store, or
  while this process is persisting its own commit of it. If the memory directory holds a
  byte-identical ``manifest.json``, data files are read from memory (any file missing there,
  e.g. one written by another node, from the durable store); otherwise from the durable
  store, or from memory for a file not persisted yet. ``list`` and ``exists`` see both
  copies. ``read_file("manifest.json")`` first waits for the pending persistence of the
  memory directory in this process (whichever tier object started it), so a process always
  loads its own last save; nothing else waits, so a save's cleanup right after its commit
  does not block on the durable copy.
* **Crashes.** A crash before the durable commit leaves the durable store at its previous
  checkpoint; the newer memory-only commit is ignored by loads (it can be pushed out with
  :meth:`MemoryTierStorage.persist` by a process restarted on the same node). Files left in
  memory by a crash are not copied (no manifest references them) and are removed by the next
  save's cleanup. The memory directory does not survive a reboot; ``/dev/shm`` counts against RAM.
  At interpreter exit, pending persistence is completed before the process ends.

Multi-node jobs (per-rank persistence): each node has its own ``/dev/shm``, so no single
process sees every file. When ``WORLD_SIZE != LOCAL_WORLD_SIZE`` (or with ``per_rank=True``)
the commit in memory starts nothing; instead ``tessera.save`` calls :meth:`after_commit` on
every rank once the save is committed, and each rank copies *its own* files in the
background, then reports to the durable store with a small marker object
(``.tessera-persist/<save id>/<rank>.ok``, or ``.failed`` with the cause). Rank 0 publishes
the manifest once every rank's ``.ok`` marker is there, and removes the markers; a
``.failed`` marker, or markers still missing after ``commit_timeout_s``, fail rank 0's
persistence and the durable store keeps its previous commit. No collective runs in the
background, so saves return at memory speed on every node. Each rank removes from memory
the files it persisted for the previous save (rank 0's cleanup only reaches its own node).
Without ``tessera.save`` (or with ``auto_persist=False``) the same protocol can be driven by
hand: every rank ``persist(files=<its files>, commit=False).result()``, a barrier, then rank
0 ``persist(files=[], commit=True)``.

Assumption shared with the save pipeline: a file referenced by a committed manifest is never
rewritten in place (a new save writes new file names, then commits, then deletes old files).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import posixpath
import re
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from .. import _knobs
from ..errors import StorageError
from .base import OWNER_MARKER_DIR, Buffer, Storage, check_relpath
from .local import FileStorage, local_root

logger = logging.getLogger(__name__)

TIER_PREFIX = "tier::"
"""URL prefix that selects the memory tier in :func:`tessera.storage.storage_for`."""
MANIFEST = "manifest.json"
MARKER_DIR = ".tessera-persist"
"""Directory (in the durable checkpoint) of the per-rank persistence markers, while a commit waits for them."""
_COPY_CHUNK = 16 << 20
_SAVE_ID_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
_TMP_RE = re.compile(r"\.tmp-[0-9a-f]{32}$")  # FileStorage.write_atomic's temporary files


def default_memory_root(durable_url: str) -> str:
    """The memory directory used for ``durable_url`` when none is given.

    ``/dev/shm/tessera/<store>/<path of the URL>``, where ``<store>`` is ``local`` for paths
    and ``file://`` URLs, and ``<scheme>-<host or bucket>-<hash>`` otherwise: for example
    ``s3://ckpts/run-7/step-100`` maps to ``/dev/shm/tessera/s3-ckpts-1f0e2a9c/run-7/step-100``.
    The path is kept (not hashed) so that the memory copies of checkpoints nest like the
    checkpoints do: a tier opened on ``.../run-7`` (e.g. by a checkpoint manager applying
    retention) sees and deletes the memory copies of ``.../run-7/step-*``. Where ``/dev/shm``
    does not exist, the system temporary directory is used instead (possibly disk-backed).
    """
    base = "/dev/shm"
    if not (os.path.isdir(base) and os.access(base, os.W_OK)):
        base = tempfile.gettempdir()
        logger.warning("no writable /dev/shm; the memory tier uses %s, which may be on disk", base)
    scheme, sep, rest = durable_url.partition("://")
    if not sep or scheme == "file":
        store, path = "local", os.path.realpath(local_root(durable_url))  # one copy per directory, however reached
    else:
        authority, _, path = rest.partition("/")
        digest = hashlib.sha256(f"{scheme}://{authority}".encode()).hexdigest()[:8]
        store = f"{re.sub(r'[^A-Za-z0-9._-]', '_', scheme)}-{re.sub(r'[^A-Za-z0-9._-]', '_', authority)}-{digest}"
    # normpath of an absolute path cannot climb above "/": no ".." escapes the tier root.
    rel = posixpath.normpath("/" + path).lstrip("/")
    return os.path.join(base, "tessera", store, rel)


def _manifest_files(manifest: bytes, written: list[str]) -> list[str]:
    """The data files a committed manifest references (``written`` if it is not a tessera manifest)."""
    # The tier is the one backend that reads what it stores: it must persist one save's files
    # and no other's, and only the manifest knows which those are.
    from ..errors import ManifestError
    from ..manifest import decode

    try:
        return [f.path for f in decode(manifest).files]
    except ManifestError:
        return [p for p in written if not p.startswith(OWNER_MARKER_DIR + "/")]


def _size_or_none(store: Storage, path: str) -> int | None:
    try:
        return store.size(path)
    except FileNotFoundError:
        return None


def _is_manifest(rel: str) -> bool:
    return rel == MANIFEST or rel.endswith("/" + MANIFEST)


@dataclass
class _TierState:
    """Persistence state of one memory directory, shared by every tier object on it in a process.

    Shared because ``save`` and ``load`` each open their own backend for a URL: a load must
    still wait for the persistence a save's object started, deferred deletes must wait for
    it, and a commit must wait for the previous one whichever object made it.
    """

    lock: threading.Lock = field(default_factory=threading.Lock)
    pending: concurrent.futures.Future[None] | None = None
    """The last persistence submitted (jobs run one at a time, in order)."""
    pending_commit: bool = False
    """Whether ``pending`` publishes a manifest."""
    deferred_deletes: list[str] = field(default_factory=list)
    """Durable deletes waiting for the next durable commit."""
    deleted: set[str] = field(default_factory=set)
    """Files deleted from memory through a tier object (so a copy may find them gone)."""
    failed_copies: set[str] = field(default_factory=set)
    """Files whose copy failed and that no later copy has replaced: block commits."""
    hooked_save: str | None = None
    """Save id of the last :meth:`MemoryTierStorage.after_commit` (a repeated call is a no-op)."""
    written: set[str] = field(default_factory=set)
    """Files written through a tier object since the last commit in memory."""
    own_files: list[str] = field(default_factory=list)
    """Per-rank mode: files this process persisted for the previous save (dropped from memory next time)."""


_STATES: dict[str, _TierState] = {}
_REGISTRY_LOCK = threading.Lock()
_PERSISTER: concurrent.futures.ThreadPoolExecutor | None = None
_LAST_JOB: concurrent.futures.Future[None] | None = None  # the process's last persistence job


def _state_for(memory_root: str) -> _TierState:
    key = os.path.realpath(memory_root)
    with _REGISTRY_LOCK:
        state = _STATES.get(key)
        if state is None:
            state = _STATES[key] = _TierState()
        return state


def _persister() -> concurrent.futures.ThreadPoolExecutor:
    """The process's persistence thread: one job at a time, in submission order.

    Its thread is not a daemon: at interpreter exit, queued persistence completes first.
    """
    global _PERSISTER
    with _REGISTRY_LOCK:
        if _PERSISTER is None:
            _PERSISTER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tessera-tier-persist")
        return _PERSISTER


class MemoryTierStorage:
    """Two-stage storage: commit to a host-memory directory, persist to ``durable`` in the background.

    Implements :class:`~tessera.storage.Storage`; see the module docstring for the exact
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
        if isinstance(durable, str):
            from . import storage_for  # the package imports this module; resolve lazily

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
        self._s = _state_for(self.memory.root)
        self._memory_valid: bool | None = None

    def __repr__(self) -> str:
        return f"MemoryTierStorage({self.durable.url!r}, memory_root={self.memory.root!r})"

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
        global _LAST_JOB
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
            snapshot = _manifest_files(manifest, written)
        else:
            snapshot = [p for p in self.memory.list() if not _is_manifest(p) and not _TMP_RE.search(p)]
        with self._s.lock:
            if manifest is not None:
                self._s.written.clear()
            future = _persister().submit(self._run_persist, snapshot, manifest)
            self._s.pending = future
            self._s.pending_commit = manifest is not None
        with _REGISTRY_LOCK:
            _LAST_JOB = future
        return future

    def after_commit(self, *, rank: int, world_size: int, save_id: str, files: Iterable[str]) -> None:
        """Start this rank's share of persisting the save just committed (per-rank mode).

        Called by ``tessera.save`` on every rank of the saving group once rank 0 has committed
        ``manifest.json`` through this storage and every rank knows the save succeeded. Not
        collective: it waits only for this process's previous persistence (backpressure), then
        returns; the copy runs on the persistence thread. This rank's files are copied to the
        durable store and reported with a marker; rank 0 then waits for every rank's marker
        and publishes the manifest (see the module docstring). Failures are not raised here:
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
        global _LAST_JOB
        if not self.per_rank:
            return
        if not 0 <= rank < world_size:
            raise ValueError(f"{self.url}: rank {rank} is outside the saving group of {world_size}")
        if not _SAVE_ID_RE.fullmatch(save_id):
            raise ValueError(f"{self.url}: save id {save_id!r} must be a plain name ([A-Za-z0-9._-])")
        mine = [check_relpath(p) for p in files]
        with self._s.lock:
            if self._s.hooked_save == save_id:
                return
            self._s.hooked_save = save_id
        with _REGISTRY_LOCK:
            previous = _LAST_JOB
        if previous is not None:  # one checkpoint in flight per process, as for a one-node commit
            concurrent.futures.wait([previous])
        manifest = self._memory_manifest() if rank == 0 else None
        with self._s.lock:
            future = _persister().submit(self._run_rank_persist, mine, rank, world_size, save_id, manifest)
            self._s.pending = future
            self._s.pending_commit = rank == 0
        with _REGISTRY_LOCK:
            _LAST_JOB = future

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
        markers = f"{MARKER_DIR}/{save_id}"
        expected = self._durable_version() if rank == 0 else None
        try:
            copied = self._copy_files(files)
        except StorageError as e:
            with self._s.lock:  # dropped from memory after the next successful copy
                self._s.own_files.extend(p for p in files if p not in self._s.own_files)
            if world_size > 1:  # tell rank 0 at once rather than let it wait for the timeout
                self._mark(f"{markers}/{rank}.failed", str(e).encode(), rank)
            raise
        # This rank's files of earlier saves: the memory manifest no longer refers to them,
        # and rank 0's cleanup does not reach this node's memory.
        with self._s.lock:
            previous, self._s.own_files = self._s.own_files, list(files)
        keep = set(files)
        self.memory.delete([p for p in previous if p not in keep])
        if world_size > 1:
            self._mark(f"{markers}/{rank}.ok", b"", rank)
        if rank == 0:
            if manifest is None:
                raise StorageError(f"nothing to persist for {self.url}: no {MANIFEST} committed in {self.memory.root}")
            if world_size > 1:
                self._await_markers(markers, world_size)
            self._publish(manifest, expected, [])
            if world_size > 1:
                try:  # this save's markers, and any a rank wrote after an earlier commit gave up
                    self.durable.delete(self.durable.list(MARKER_DIR))
                except Exception as e:
                    logger.warning("could not remove persistence markers under %s: %s", self.durable.url, e)
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

    def _mark(self, path: str, data: bytes, rank: int) -> None:
        try:
            self.durable.write_atomic(path, data)
        except Exception as e:
            raise StorageError(
                f"rank {rank} could not report its persistence of {self.url} at {self.durable.url}/{path}: {e}; "
                "rank 0 will not commit this save"
            ) from e

    def _await_markers(self, markers: str, world_size: int) -> None:
        """Rank 0: wait until every rank's ``.ok`` marker is under ``markers``.

        Raises:
            StorageError: for a ``.failed`` marker (with the rank's cause), or ranks still
                missing after ``commit_timeout_s``.
        """
        deadline = time.monotonic() + self.commit_timeout_s
        delay = 0.02
        while True:
            ok: set[int] = set()
            failed: list[int] = []
            for p in self.durable.list(markers):
                head, _, status = p.rpartition("/")[2].partition(".")
                if head.isdigit() and status == "ok":
                    ok.add(int(head))
                elif head.isdigit() and status == "failed":
                    failed.append(int(head))
            if failed:
                causes = []
                for r in sorted(failed)[:3]:
                    try:
                        causes.append(
                            f"rank {r}: {self.durable.read_file(f'{markers}/{r}.failed').decode(errors='replace')}"
                        )
                    except Exception as e:
                        causes.append(f"rank {r}: (its report could not be read: {e})")
                raise StorageError(
                    f"not committing {self.url}: {len(failed)} rank(s) failed to persist their files; the durable "
                    f"checkpoint keeps its previous commit. " + "; ".join(causes)
                )
            if len(ok) >= world_size:
                return
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - ok)
                shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
                raise StorageError(
                    f"not committing {self.url}: {len(missing)} rank(s) ({shown}) did not report their files "
                    f"persisted within {self.commit_timeout_s:g}s (a rank died, or its copy is still running); "
                    "the durable checkpoint keeps its previous commit"
                )
            time.sleep(delay)
            delay = min(1.0, delay * 1.5)

    def _durable_version(self) -> str | None:
        version = getattr(self.durable, "version", None)
        return version(MANIFEST) if callable(version) else None

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
            replace_if = getattr(self.durable, "replace_if", None)
            if callable(replace_if) and callable(getattr(self.durable, "version", None)):
                replace_if(MANIFEST, manifest, expected)
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
        file_sizes = getattr(self.durable, "file_sizes", None)
        found: dict[str, int] = {}
        for d in sorted({posixpath.dirname(p) for p in files}):
            if callable(file_sizes):
                found.update(file_sizes(d))
        problems = []
        for p in files:
            try:
                want = os.path.getsize(os.path.join(self.memory.root, p))
            except FileNotFoundError:
                continue  # deleted from memory since (no manifest needs it)
            got = found.get(p) if callable(file_sizes) else _size_or_none(self.durable, p)
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
        if failure is None and files:
            sync_dirs = getattr(self.durable, "sync_dirs", None)
            if callable(sync_dirs):  # directory entries durable before any manifest names them
                try:
                    sync_dirs(files)
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

    def _memory_manifest(self) -> bytes | None:
        try:
            return self.memory.read_file(MANIFEST)
        except FileNotFoundError:
            return None

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
        if rel != MANIFEST and _is_manifest(rel):
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
            with _REGISTRY_LOCK:
                previous = _LAST_JOB
            if previous is not None:
                concurrent.futures.wait([previous])
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
        loc = getattr(self.durable, "location", None)
        return TIER_PREFIX + (str(loc()) if callable(loc) else self.durable.url)

    def read_file(self, path: str) -> bytes:
        """Content of ``path``; a ``manifest.json`` always comes from the durable backend."""
        rel = check_relpath(path)
        if rel == MANIFEST:
            self._wait_pending()
            data = self.durable.read_file(MANIFEST)
            with self._s.lock:
                self._memory_valid = self._memory_manifest() == data
            return data
        if _is_manifest(rel):
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
        if _is_manifest(rel):
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
        if _is_manifest(rel):
            return (rel == MANIFEST and self._committing()) or self.durable.exists(rel)
        return self.memory.exists(rel) or self.durable.exists(rel)

    def list(self, prefix: str = "") -> list[str]:
        """Files under ``prefix`` in either copy; a ``manifest.json`` as :meth:`exists` says."""
        committing = self._committing()
        # Temporary files of a publish in progress (the persistence thread's, in the durable
        # store) are no files of the checkpoint: listed, retention could delete one mid-rename.
        durable = [p for p in self.durable.list(prefix) if not _TMP_RE.search(p)]
        memory = [p for p in self.memory.list(prefix) if not _is_manifest(p) and not _TMP_RE.search(p)]
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
