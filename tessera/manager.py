"""Checkpoints of a training run: one directory per step, a ``latest`` pointer, retention.

Layout under ``root`` (any URL :func:`tessera.storage.storage_for` accepts)::

    <root>/
      step-00000100/     a checkpoint (see tessera.save): manifest.json + data/
      step-00000200/
      latest             one line: the directory name of the newest committed step

A step directory is ``step-`` followed by the step number zero-padded to 8 digits
(``step-00000100``); steps past 99,999,999 simply get more digits. Names that are not in
exactly this form are ignored, so other files may live under ``root``.

Crash safety: a step is committed when its ``manifest.json`` is (see :func:`tessera.save`);
``latest`` is rewritten atomically only after that, so it never names an uncommitted step,
though after a crash it may lag one step behind. :meth:`CheckpointManager.load` therefore
looks at the step directories themselves and resumes from the newest one that is committed
and intact. Retention deletes a step's ``manifest.json`` before its data, so a deletion cut
short leaves an incomplete step (skipped by loads), never a corrupt "committed" one.

Distributed contract: every rank constructs the manager with the same arguments and calls
:meth:`~CheckpointManager.save` and :meth:`~CheckpointManager.load` together (they are
collective, like :func:`tessera.save`); only rank 0 moves ``latest`` and deletes old steps.
:meth:`~CheckpointManager.steps` and :meth:`~CheckpointManager.latest_step` only read
storage and may be called by any rank alone. A manager is meant for one thread.
"""

from __future__ import annotations

import atexit
import logging
import signal
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

from . import _args, api, dist
from .api import LoadResult, PendingSave, SaveResult
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CollectiveTimeoutError,
    DistributedError,
    StorageError,
)
from .local_tier import LocalTier
from .manifest import MANIFEST_NAME
from .options import LoadOptions, SaveOptions
from .policies import SaveDecider, SavePolicy
from .preemption import PreemptionHandler
from .step_names import parse_step_dirname, step_dirname
from .storage import Storage, storage_for
from .storage.base import OWNER_MARKER_DIR

logger = logging.getLogger(__name__)

LATEST_NAME = "latest"
# Errors that mean "this step's checkpoint is unusable", as opposed to a problem with the
# caller's state or the job. Compared by name because a peer's failure reaches the other
# ranks as text inside a DistributedError.
_SKIPPABLE = frozenset({"CorruptCheckpointError", "ManifestError", "CheckpointNotFoundError"})


def _join(root: str, name: str) -> str:
    return root + name if root.endswith("/") else f"{root}/{name}"


@dataclass(frozen=True)
class StepLoadResult:
    """What :meth:`CheckpointManager.load` loaded.

    Attributes:
        step: the step that was loaded.
        result: the :class:`~tessera.LoadResult` of loading it.
        skipped: newer steps that were passed over, with the reason (incomplete or corrupt).
        source: where the bytes came from, job-wide: ``"local"`` (every node already held
            all the files it needed in its local tier), ``"peers"`` (some nodes fetched
            files from other nodes' local tiers first) or ``"durable"`` (the durable root).
        peer_bytes: bytes this rank received from peers before loading (``"peers"`` only).
    """

    step: int
    result: LoadResult
    skipped: dict[int, str] = field(default_factory=dict)
    source: str = "durable"
    peer_bytes: int = 0


_OPEN: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    # Daemon threads die abruptly at interpreter exit; finish pending saves first.
    for manager in list(_OPEN):
        try:
            manager.close()
        except Exception as e:
            logger.error("checkpoint manager for %s: a pending save failed at exit: %s", manager.root, e)
            # Straight to stderr too: logging may be unconfigured or go to a file nobody reads.
            # (An atexit handler cannot change the exit status; Python ignores it.)
            try:
                sys.stderr.write(
                    f"tessera: ERROR: checkpoint manager for {manager.root}: a pending save failed at exit: {e}\n"
                )
                sys.stderr.flush()
            except Exception:
                pass


class CheckpointManager:
    """Save and resume a training run's checkpoints by step, with retention.

    Args:
        root: directory or URL holding one subdirectory per step.
        keep_last: keep at most this many of the newest committed steps (None: keep all).
        keep_every: also keep every step divisible by this (e.g. 1000), whatever ``keep_last``.
        async_save: default of :meth:`save`: return once the save is planned; copy to host
            memory, write and commit in the background (see :func:`tessera.async_save` for
            when the state may change: ``PendingSave.wait_staged``).
        process_group: the ranks taking part (default: all).
        allow_pickle: store and load values that need pickle (see :func:`tessera.save`).
        save_options: passed to every save.
        load_options: passed to every load.
        storage_options: options of the backend :func:`~tessera.storage.storage_for` builds.
        storage_factory: builds the backend of a URL (a step directory, or ``root``); the
            default is :func:`~tessera.storage.storage_for` with ``storage_options``.
        retention_before_save: also apply retention *before* each save, keeping room for the
            step being saved (``keep_last - 1`` older steps), so that a disk that holds
            ``keep_last`` checkpoints and no more can still take the next one. The newest
            committed step is never deleted before the new one is committed.
        local_dir: a node-local directory (e.g. ``/dev/shm/tessera-{node}``) that turns on the
            replicated local tier: every save goes there first; ``{node}`` is replaced by
            the node index (``GROUP_RANK``, else ``RANK // LOCAL_WORLD_SIZE``). Use one
            directory per run. See ``docs/resilience.md``.
        local_replicas: copies of each rank's files kept on other nodes' local tiers (0: none).
        durable_every: with ``local_dir``, only steps divisible by this also go to ``root``
            (None: every step does).
        local_keep_last: committed local steps each node keeps.
        save_policy: what :meth:`should_save` answers (see :mod:`tessera.policies`).
        preemption: install a handler for ``preemption_signal`` (main thread only): once
            any rank receives it, :meth:`should_save` says True on every rank and the next
            :meth:`save` is synchronous and durable; then :attr:`reached_preemption` is True
            and the loop should exit. Restored by :meth:`close`. A
            :class:`~tessera.PreemptionHandler` is installed as given (its signals, and
            ``trigger()`` for a preemption notice that is not a signal).
        preemption_signal: the signal that means preemption (default SIGTERM).

    Raises:
        ValueError: for ``keep_last``, ``keep_every``, ``durable_every`` or ``local_keep_last``
            below 1, or ``local_replicas`` below 0.

    Collective contract: every rank constructs the manager alike and calls ``save``/``load``
    in the same order; only rank 0 moves ``latest`` and deletes old steps (after a commit,
    never the newest committed step, the one ``latest`` names, or one being saved). Close it
    (or use it as a context manager) before tearing down ``torch.distributed``, so that a
    pending save is finished; interpreter exit also closes it.

    Example:
        >>> with tessera.CheckpointManager("/ckpt/run1", keep_last=3, keep_every=1000, async_save=True) as mgr:
        ...     if mgr.latest_step() is not None:
        ...         start = mgr.load(state).step + 1
        ...     for step in range(start, steps):
        ...         train_step()
        ...         if step % 100 == 0:
        ...             mgr.save(step, state)
    """

    def __init__(
        self,
        root: str,
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        async_save: bool = False,
        process_group: Any = None,
        allow_pickle: bool = False,
        save_options: SaveOptions | None = None,
        load_options: LoadOptions | None = None,
        storage_options: Mapping[str, object] | None = None,
        storage_factory: Callable[[str], Storage] | None = None,
        retention_before_save: bool = False,
        local_dir: str | None = None,
        local_replicas: int = 1,
        durable_every: int | None = None,
        local_keep_last: int = 2,
        save_policy: SavePolicy | None = None,
        preemption: bool | PreemptionHandler = False,
        preemption_signal: int = signal.SIGTERM,
    ) -> None:
        for name, value in (
            ("keep_last", keep_last),
            ("keep_every", keep_every),
            ("durable_every", durable_every),
            ("local_keep_last", local_keep_last),
        ):
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"CheckpointManager({root!r}): {name} must be None or an integer >= 1, got {value!r}")
        if type(local_replicas) is not int or local_replicas < 0:
            raise ValueError(
                f"CheckpointManager({root!r}): local_replicas must be an integer >= 0, got {local_replicas!r}"
            )
        if local_dir is not None and (not isinstance(local_dir, str) or "://" in local_dir or not local_dir):
            raise ValueError(
                f"CheckpointManager({root!r}): local_dir must be a local directory path, got {local_dir!r}"
            )
        self.local_dir = local_dir
        self.local_replicas = local_replicas
        self.durable_every = durable_every
        self._tier = (
            LocalTier(local_dir, root, replicas=local_replicas, keep_last=local_keep_last, process_group=process_group)
            if local_dir is not None
            else None
        )
        self.root = root
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.async_save = async_save
        self.process_group = process_group
        self.allow_pickle = allow_pickle
        self.save_options = save_options
        self.load_options = load_options
        self._factory = storage_factory or (lambda url: storage_for(url, storage_options=storage_options))
        # Listing, the pointer and retention go through one backend bound to root. For a
        # ``tier::`` root that is a memory tier too: it lists committed steps from the durable
        # store, writes ``latest`` through to both copies and deletes both copies of a step.
        self._root_store = self._factory(root)
        self._pending: PendingSave | None = None
        self._thread: threading.Thread | None = None
        self._in_flight: set[int] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.retention_before_save = retention_before_save
        self._distributed = False
        handler = preemption if isinstance(preemption, PreemptionHandler) else None
        if handler is None and preemption:
            handler = PreemptionHandler([preemption_signal])
        self._decider = SaveDecider(save_policy, preemption=handler, process_group=process_group)
        if handler is not None:  # after every argument is checked: a refused manager leaves no handler
            handler.install()
        _OPEN.add(self)

    # ------------------------------------------------------------------------------------
    # Naming and listing (local: no communication)

    def step_url(self, step: int) -> str:
        """The path or URL of ``step``'s checkpoint (it need not exist).

        Example:
            >>> CheckpointManager("/ckpt/run1").step_url(100)
            '/ckpt/run1/step-00000100'
        """
        return _join(self.root, step_dirname(_check_step(step)))

    def _scan(self) -> dict[int, bool]:
        """Every step directory under root: ``{step: committed}``."""
        found: dict[int, bool] = {}
        for rel in self._root_store.list(""):
            head, _, rest = rel.partition("/")
            step = parse_step_dirname(head)
            if step is None or not rest:
                continue
            found[step] = found.get(step, False) or rest == MANIFEST_NAME
        return found

    def steps(self) -> list[int]:
        """Committed steps (those with a ``manifest.json``), oldest first.

        Not collective; reads storage. A committed step may still turn out corrupt on load.

        Example:
            >>> mgr.steps()
            [300, 400, 500]
        """
        return sorted(s for s, committed in self._scan().items() if committed)

    def latest_step(self) -> int | None:
        """The newest committed step, or None when there is none. Not collective.

        This is where :meth:`load` starts; it does not depend on the ``latest`` pointer,
        which may lag one step behind after a crash.

        Example:
            >>> start = 0 if mgr.latest_step() is None else mgr.load(state).step + 1
        """
        steps = self.steps()
        return steps[-1] if steps else None

    def pointer_step(self) -> int | None:
        """The step the ``latest`` pointer names (None if absent or unreadable). Not collective."""
        try:
            text = self._root_store.read_file(LATEST_NAME)
        except FileNotFoundError:
            return None
        step = parse_step_dirname(text.decode("utf-8", "replace").strip())
        if step is None:
            logger.warning("%s/%s does not name a step directory (%r); ignoring it", self.root, LATEST_NAME, text[:80])
        return step

    # ------------------------------------------------------------------------------------
    # Save

    def save(self, step: int, state: object, *, async_save: bool | None = None) -> SaveResult | PendingSave:
        """Save ``state`` as ``step``; collective over the process group.

        Waits for the previous save of this manager first (and raises its error if nobody
        saw it). Once the step is committed, rank 0 points ``latest`` at it (if it is the
        newest) and applies retention. Saving a step that exists replaces it atomically.

        Args:
            step: the training step, an integer >= 0.
            state: what to save, as for :func:`tessera.save`.
            async_save: override the manager's default for this call.

        Returns:
            :class:`~tessera.SaveResult` for a synchronous save; for an asynchronous one a
            :class:`~tessera.PendingSave` whose ``wait()`` returns after the commit and,
            on rank 0, after ``latest`` and retention are done.

        Raises:
            CheckpointError: if the save fails on any rank (the previous steps stay intact).
            ValueError: for a bad step number or a closed manager.

        Example:
            >>> mgr.save(100, {"model": model.state_dict(), "step": 100})
        """
        _args.check_manager_save(step, state)
        step = _check_step(step)
        if self._closed:
            raise ValueError(f"CheckpointManager({self.root!r}) is closed")
        t0 = time.monotonic()  # the stall counts the wait for the previous save too
        self._wait_previous()
        waited = time.monotonic() - t0
        background = self.async_save if async_save is None else async_save
        preempted = self._decider.agree_preemption(step)  # collective only with preemption=True
        if preempted:
            background = False  # the job exits next: the step must be committed (and durable) first
        self._decider.record_save(step)
        url = self.step_url(step)
        world = dist.world_for(self.process_group)
        self._distributed = self._distributed or world.distributed
        if self._tier is not None:
            return self._save_tiered(step, state, background, world, t0, waited, durable=preempted or None)
        store = self._factory(url)
        if self.retention_before_save and world.is_coordinator:
            # Rank 0 makes room before it joins the save; no rank writes before rank 0 joins.
            try:
                self.apply_retention(making_room_for=step)
            except Exception as e:
                logger.warning("retention before saving step %d under %s failed: %s", step, self.root, e)
        with self._lock:
            self._in_flight.add(step)
        kwargs: dict[str, Any] = {
            "process_group": self.process_group,
            "storage": store,
            "allow_pickle": self.allow_pickle,
            "options": self.save_options,
        }
        if not background:
            try:
                result = api.save(url, state, **kwargs)
                self._after_commit(step, store, world)
            finally:
                self._forget(step, store)
            return result
        try:
            inner = api.async_save(url, state, **kwargs)
        except BaseException:
            self._forget(step, store)
            raise
        future: Future[SaveResult] = Future()
        thread = threading.Thread(
            target=self._finish, args=(future, inner, step, store, world), name="tessera-manager", daemon=True
        )
        self._thread = thread
        thread.start()
        stall = time.monotonic() - t0
        parts = dict(inner.stall_parts)
        parts["wait_previous"] = parts.get("wait_previous", 0.0) + waited
        parts["prepare"] = max(0.0, stall - sum(parts.values()))  # storage, retention, threads
        # The gate is the inner save's: wait_staged() here waits for the same copy.
        self._pending = PendingSave(future, stall, path=url, staged_event=inner._staged, stall_parts=parts)
        return self._pending

    def _finish(
        self, future: Future[SaveResult], inner: PendingSave, step: int, store: Storage, world: dist.World
    ) -> None:
        try:
            result = inner.wait()
        except BaseException as e:
            self._forget(step, store)
            future.set_exception(self._explain(e, step))
            return
        try:
            self._after_commit(step, store, world)
        except BaseException as e:
            self._forget(step, store)
            future.set_exception(e)
            return
        self._forget(step, store)
        future.set_result(result)

    def _save_tiered(
        self,
        step: int,
        state: object,
        background: bool,
        world: dist.World,
        t0: float,
        waited: float,
        durable: bool | None = None,
    ) -> SaveResult | PendingSave:
        """``save`` with a local tier: the local step (committed with its replicas), then,
        for durable steps (``durable_every``, or ``durable=True``: a preemption), a copy of it under ``root``."""
        tier = self._tier
        assert tier is not None
        if not durable:
            durable = self.durable_every is None or step % self.durable_every == 0
        local = tier.step_store(step, world)
        tier.before_save(step, world)
        with self._lock:
            self._in_flight.add(step)
        kwargs: dict[str, Any] = {
            "process_group": self.process_group,
            "storage": local,
            "allow_pickle": self.allow_pickle,
            "options": self.save_options,
        }
        label = tier.step_label(step)
        if not background:
            try:
                result = api.save(label, state, **kwargs)
                self._finish_tiered(step, durable, world)
            finally:
                self._forget(step, local)
            return result
        try:
            inner = api.async_save(label, state, **kwargs)
        except BaseException:
            self._forget(step, local)
            raise
        future: Future[SaveResult] = Future()

        def finish() -> None:
            try:
                result = inner.wait()
                self._finish_tiered(step, durable, world)
            except BaseException as e:
                future.set_exception(self._explain(e, step))
                return
            finally:
                self._forget(step, local)
            future.set_result(result)

        thread = threading.Thread(target=finish, name="tessera-manager", daemon=True)
        self._thread = thread
        thread.start()
        stall = time.monotonic() - t0
        parts = dict(inner.stall_parts)
        parts["wait_previous"] = parts.get("wait_previous", 0.0) + waited
        parts["prepare"] = max(0.0, stall - sum(parts.values()))
        self._pending = PendingSave(future, stall, path=label, staged_event=inner._staged, stall_parts=parts)
        return self._pending

    def _finish_tiered(self, step: int, durable: bool, world: dist.World) -> None:
        """After the local save of ``step``: replicas and the local commit, then the durable copy."""
        tier = self._tier
        assert tier is not None
        data = tier.commit(step, world)
        if not durable:
            return
        store = self._factory(self.step_url(step))
        try:
            tier.copy_to_durable(step, data, store, world)
            self._after_commit(step, store, world)
        finally:
            close = getattr(store, "close", None)
            if callable(close):
                close()

    def _forget(self, step: int, store: Storage) -> None:
        with self._lock:
            self._in_flight.discard(step)
        close = getattr(store, "close", None)
        if callable(close):
            try:
                close()
            except Exception as e:
                logger.warning("closing the storage of %s failed: %s", self.step_url(step), e)

    def _after_commit(self, step: int, store: Storage, world: dist.World) -> None:
        """Rank 0, after ``step`` committed: move ``latest``, then apply retention.

        Raises:
            StorageError: if a tiered backend failed to make the step durable (the step then
                exists only in host memory; ``latest`` and retention are left alone).

        Other failures here are logged, not raised: the step is committed whatever happens next.
        """
        if not world.is_coordinator:
            return
        # A tiered backend commits to host memory first. Until the step is durable, neither
        # "latest" nor retention may act on it: older steps are the safe ones.
        wait_persisted = getattr(store, "wait_persisted", None)
        if callable(wait_persisted):
            try:
                wait_persisted()
            except Exception as e:
                raise StorageError(
                    f"step {step} is committed in host memory but copying it to {self.step_url(step)} failed; "
                    f"it is not durable and 'latest' still names an older step: {e}"
                ) from e
        try:
            found = self._scan()
        except Exception as e:
            logger.warning("step %d: not moving %s/%s nor applying retention: %s", step, self.root, LATEST_NAME, e)
            return
        try:
            if step >= max((s for s, c in found.items() if c), default=step):
                self._root_store.write_atomic(LATEST_NAME, (step_dirname(step) + "\n").encode())
        except Exception as e:
            logger.warning("step %d is committed but moving %s/%s failed: %s", step, self.root, LATEST_NAME, e)
        try:
            self._apply_retention(step, found, keep_last=self.keep_last)
        except Exception as e:
            logger.warning("retention under %s failed after step %d: %s", self.root, step, e)

    def _explain(self, e: BaseException, step: int) -> BaseException:
        """``e``, or an error saying what to do if the process group went away under the save."""
        import torch.distributed as tdist

        if not self._distributed or (tdist.is_available() and tdist.is_initialized()):
            return e
        out = CheckpointError(
            f"CheckpointManager({self.root!r}): step {step} was NOT committed: the process group was destroyed "
            f"while its asynchronous save was still running. Call mgr.close() (or mgr.wait()) before "
            f"torch.distributed.destroy_process_group(). Cause: {type(e).__name__}: {e}"
        )
        out.__cause__ = e
        return out

    def apply_retention(self, *, making_room_for: int | None = None) -> list[int]:
        """Rank 0: delete the steps retention does not keep; returns the steps deleted. Not collective.

        Runs after every commit anyway. Call it (or pass ``retention_before_save=True``) to
        free space *before* a save, e.g. after a save failed on a full disk.

        Args:
            making_room_for: a step about to be saved: one of the ``keep_last`` places is kept
                free for it. The newest committed step is kept whatever ``keep_last`` says.

        Example:
            >>> mgr.apply_retention(making_room_for=step)  # the disk is tight
        """
        found = self._scan()
        committed = sorted(s for s, c in found.items() if c)
        if making_room_for is None:
            if not committed:
                return []
            return self._apply_retention(committed[-1], found, keep_last=self.keep_last)
        keep_last = None if self.keep_last is None else max(1, self.keep_last - 1)
        newest = committed[-1] if committed else None
        return self._apply_retention(newest, found, keep_last=keep_last, also_keep=frozenset({making_room_for}))

    def _apply_retention(
        self,
        committed_step: int | None,
        found: dict[int, bool],
        *,
        keep_last: int | None,
        also_keep: frozenset[int] = frozenset(),
    ) -> list[int]:
        committed = sorted(s for s, c in found.items() if c)
        keep = set(committed) if keep_last is None else set(committed[-keep_last:])
        if self.keep_every is not None:
            keep |= {s for s in committed if s % self.keep_every == 0}
        with self._lock:
            keep |= self._in_flight
        keep |= set(also_keep)
        if committed_step is not None:
            keep.add(committed_step)
        if committed:
            keep.add(committed[-1])  # the last good checkpoint survives anything
        pointer = self.pointer_step()
        if pointer is not None:
            keep.add(pointer)
        doomed = [s for s in committed if s not in keep]
        # Leftovers of saves that never committed (a crash); newer ones are left alone,
        # since nothing says their save is over.
        newest = committed_step if committed_step is not None else -1
        doomed += [s for s, c in found.items() if not c and s < newest and s not in keep]
        for s in sorted(doomed):
            self._delete_step(s)
        return sorted(doomed)

    def _delete_step(self, step: int) -> None:
        name = step_dirname(step)
        manifest = f"{name}/{MANIFEST_NAME}"
        uncommit = getattr(self._root_store, "uncommit", None)
        version = getattr(self._root_store, "version", None)
        expected = version(manifest) if callable(uncommit) and callable(version) else None
        files = self._root_store.list(name)  # relative to root: "step-.../data/..."
        # Un-commit first: a deletion cut short must not leave a "committed" step without data.
        if callable(uncommit) and callable(version):
            # Fenced (filesystems): under the step's commit lock, and only if no save committed
            # it meanwhile; the owner markers go with the manifest, so a save still writing
            # into this step (another job's) can no longer publish over the files deleted next.
            markers = [f for f in files if f.startswith(f"{name}/{OWNER_MARKER_DIR}/")]
            if not uncommit(manifest, expected, markers):
                logger.info("not deleting step %d under %s: a save committed it meanwhile", step, self.root)
                return
        else:
            self._root_store.delete([manifest])
        self._root_store.delete([f for f in files if f != manifest])
        logger.info("deleted step %d under %s (%d files)", step, self.root, len(files))

    def should_save(self, step: int) -> bool:
        """Whether to save at ``step``: ``save_policy``, or a preemption any rank received.

        Collective (one tiny all-reduce) when the policy reads the clock or ``preemption``
        is on: call it on every rank after every step; every rank gets the same answer.

        Example:
            >>> if mgr.should_save(step):
            ...     mgr.save(step, state)
            >>> if mgr.reached_preemption:
            ...     break  # the preemption checkpoint is committed
        """
        return self._decider.should_save(_check_step(step))

    @property
    def reached_preemption(self) -> bool:
        """Whether the ranks agreed that the job is being preempted (the same on every rank)."""
        return self._decider.reached_preemption

    # ------------------------------------------------------------------------------------
    # Load

    def load(
        self,
        state: object,
        step: int | None = None,
        *,
        strict: bool = True,
        cast_dtypes: bool = False,
    ) -> StepLoadResult:
        """Load a step into ``state`` in place; collective over the process group.

        With ``step=None``, resumes from the newest committed step that loads cleanly:
        incomplete steps (no ``manifest.json``) and corrupt ones (invalid manifest, missing
        or truncated data, checksum mismatch) are skipped with a warning saying why, and
        the next older step is tried. Rank 0 lists the steps and every rank tries the same
        ones. Errors that are not about the checkpoint (keys or shapes that do not match
        the state, pickle not allowed, a rank failing) are raised at once.

        Note: tensors filled from a step that then fails are overwritten by the older step
        that loads; with ``strict=False``, tensors the older step lacks keep what was read.

        Args:
            state: the structure to fill, as for :func:`tessera.load`.
            step: a specific step to load (no fallback), or None for the newest valid one.
            strict: as for :func:`tessera.load`.
            cast_dtypes: as for :func:`tessera.load`.

        Returns:
            :class:`StepLoadResult`: the step, its LoadResult, and the steps skipped.

        Raises:
            CheckpointNotFoundError: if no step loads (every reason is listed).
            CheckpointError: what loading failed with, for errors that are not skipped.

        Example:
            >>> loaded = mgr.load({"model": model.state_dict(), "step": 0})
            >>> print(f"resumed from step {loaded.step}")
        """
        _args.check_manager_load(state, step)
        if self._closed:
            raise ValueError(f"CheckpointManager({self.root!r}) is closed")
        self._wait_previous()
        world = dist.world_for(self.process_group)
        kwargs: dict[str, Any] = {
            "strict": strict,
            "process_group": self.process_group,
            "allow_pickle": self.allow_pickle,
            "cast_dtypes": cast_dtypes,
            "options": self.load_options,
        }
        if step is not None:
            step = _check_step(step)
        if self._tier is not None:
            recovered = self._recover(state, world, kwargs, step)
            if recovered is not None:
                return recovered
        if step is not None:
            return StepLoadResult(step, self._load_step(step, state, kwargs), {})

        listing: tuple[list[tuple[int, bool]] | None, Any] = (None, None)
        own: BaseException | None = None
        if world.is_coordinator:
            try:
                listing = (sorted(self._scan().items(), reverse=True), None)
            except Exception as e:
                own = e
                listing = (None, dist.error_text(0, e))
        candidates, error = dist.broadcast(world, listing, "listing checkpoint steps")
        if error is not None:  # rank 0's failure record, untouched
            if own is not None and not world.distributed:
                if isinstance(own, CheckpointError):
                    raise own
                raise StorageError(f"listing the steps under {self.root} failed: {type(own).__name__}: {own}") from own
            dist.raise_failures(world, {0: error}, f"listing the steps under {self.root}")
        if candidates is None:
            raise CheckpointError(f"listing {self.root} failed")
        skipped: dict[int, str] = {}
        for s, committed in candidates:
            if not committed:
                self._skip(world, s, skipped, "incomplete: no manifest.json (its save never finished)")
                continue
            try:
                result = self._load_step(s, state, kwargs)
            except CheckpointError as e:
                if not _is_skippable(e):
                    raise
                self._skip(world, s, skipped, f"corrupt or unreadable: {e}")
                continue
            return StepLoadResult(s, result, skipped)
        detail = "".join(f"\n  step {s}: {why}" for s, why in skipped.items())
        raise CheckpointNotFoundError(
            f"no loadable checkpoint under {self.root}" + (f":{detail}" if detail else " (no steps)")
        )

    def _recover(
        self, state: object, world: dist.World, kwargs: dict[str, Any], step: int | None
    ) -> StepLoadResult | None:
        """The local tier's recovery (own node, then peers), or None to fall back to ``root``."""
        tier = self._tier
        assert tier is not None
        newest_durable = None
        if step is None:
            # A durable step newer than anything local (say local saves failed for a while) wins:
            # the newest step that can be assembled from anything that survives. Rank 0 lists.
            listed: int | None = None
            if world.is_coordinator:
                try:
                    listed = max((s for s, c in self._scan().items() if c), default=None)
                except Exception as e:  # the local tier may not need it; the durable path reports it
                    logger.warning("listing %s before recovering from the local tier failed: %s", self.root, e)
            newest_durable = dist.broadcast(world, listed, "listing the durable steps")
        try:
            got = tier.recover(state, world, kwargs, only_step=step, at_least=newest_durable)
        except CheckpointError as e:
            if not _is_skippable(e) and not isinstance(e, StorageError):
                raise
            message = f"the local tier at {self.local_dir} could not be used, falling back to {self.root}: {e}"
            if world.is_coordinator:  # job-wide news: said once, by rank 0
                warnings.warn(message, RuntimeWarning, stacklevel=3)
            logger.debug("%s", message)
            return None
        if got is None:
            return None
        return StepLoadResult(got.step, got.result, {}, source=got.source, peer_bytes=got.peer_bytes)

    def _load_step(self, step: int, state: object, kwargs: dict[str, Any]) -> LoadResult:
        url = self.step_url(step)
        store = self._factory(url)
        try:
            return api.load(url, state, storage=store, **kwargs)
        finally:
            close = getattr(store, "close", None)
            if callable(close):
                close()

    def _skip(self, world: dist.World, step: int, skipped: dict[int, str], why: str) -> None:
        skipped[step] = why
        message = f"skipping checkpoint step {step} under {self.root}: {why}"
        if world.is_coordinator:  # job-wide news: said once, by rank 0
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        else:
            logger.debug("%s", message)

    # ------------------------------------------------------------------------------------
    # Lifecycle

    def _wait_previous(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            wait_futures([pending._future])
            pending._raise_unobserved()  # raises only if nobody saw the failure yet
        finally:
            self._join()

    def _join(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def wait(self) -> SaveResult | None:
        """Block until the pending save (if any) is committed and retention is done.

        Returns:
            the pending save's result, or None if there was none.

        Raises:
            CheckpointError: if the pending save failed.

        Example:
            >>> mgr.save(100, state)  # async
            >>> mgr.wait()
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        try:
            return pending.wait()
        finally:
            self._join()

    def close(self) -> None:
        """Finish the pending save and stop accepting new ones. Idempotent.

        Raises:
            CheckpointError: if the pending save failed and nobody has seen that yet.
        """
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        if threading.current_thread() is threading.main_thread():
            self._decider.close()
        try:
            self._wait_previous()
        finally:
            if self._tier is not None:
                self._tier.wait_deletions()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as e:
            logger.error("closing the checkpoint manager for %s after an error: %s", self.root, e)

    def __repr__(self) -> str:
        return f"CheckpointManager({self.root!r}, keep_last={self.keep_last}, keep_every={self.keep_every})"


def _check_step(step: int) -> int:
    if type(step) is not int or step < 0:
        raise ValueError(f"a checkpoint step must be an integer >= 0, got {step!r}")
    return step


def _is_skippable(e: BaseException) -> bool:
    """Whether a load failed because the checkpoint is unusable, identically on every rank.

    A peer's failure arrives as a DistributedError carrying ``"TypeName: message"`` texts; a
    rank's own failure is the exception itself. Either way the decision depends only on
    the failures every rank was told about, so all ranks skip or raise together.
    """
    if isinstance(e, CollectiveTimeoutError):
        return False
    if isinstance(e, DistributedError):
        if not e.failures:
            return False
        # str() of a failure record is "TypeName: message", whether it is a str or a record object.
        return all(str(text).split(":", 1)[0] in _SKIPPABLE for text in e.failures.values())
    return type(e).__name__ in _SKIPPABLE
