"""The :class:`CheckpointManager` facade: saves and loads by step, with retention.

See the package docstring (:mod:`tessera.manager`) for the layout, crash safety, the
distributed contract and the parts the manager is composed of (one module each, each owning
its state). The facade checks arguments, orders the calls and keeps the lifecycle; no part
knows the facade.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from .. import _args
from ..engine import dist
from ..options import LoadOptions, SaveOptions
from ..results import PendingSave, SaveResult
from ..storage import Storage, storage_for
from .arguments import Kept, check_arguments, local_tier_of, with_budget
from .background import BackgroundSaves, close_at_exit, forget_at_exit
from .direct import DirectRoute
from .policies import SaveDecider, SavePolicy
from .preemption import PreemptionHandler
from .resume import StepLoader, StepLoadResult
from .retention import Retention
from .shared_tiles import SharedTiles
from .steps import StepDirectory, check_step
from .tiered import TieredRoute

__all__ = ["CheckpointManager"]

logger = logging.getLogger(__name__)


class CheckpointManager:
    """Save and resume a training run's checkpoints by step, with retention.

    Args:
        root: directory or URL holding one subdirectory per step. ``tier::<url>`` is ``<url>``
            with the local tier in host memory (``local_dir`` defaults to
            ``/dev/shm/tessera/<store>/<path of url>``).
        keep_last: keep at most this many of the newest committed steps (None: keep all).
        keep_every: also keep every step divisible by this (e.g. 1000), whatever ``keep_last``.
        async_save: default of :meth:`save`: return once the save is planned, and copy, write
            and commit in the background (see :func:`tessera.async_save`).
        process_group: the ranks taking part (default: all).
        allow_pickle: store and load values that need pickle (see :func:`tessera.save`).
        save_options: passed to every save.
        load_options: passed to every load.
        storage_options: options of the backend :func:`~tessera.storage.storage_for` builds.
        storage_factory: builds the backend of a URL (a step directory, or ``root``) instead.
        retention_before_save: also apply retention before each save, keeping room for the
            step being saved (``keep_last - 1`` older steps; never the newest committed one).
        local_dir: a node-local directory (e.g. ``/dev/shm/tessera-{node}``, ``{node}`` being
            the node index) that turns on the replicated local tier: every save goes there
            first. Use one directory per run. See ``docs/resilience.md``.
        local_replicas: copies of each rank's files kept on other nodes' local tiers (0: none;
            None: 1, without the warning an explicit value gives on a single-node job).
        local_parity: ``(k, m)``: instead of replicas, each stripe of ``k`` nodes' files gets ``m``
            parity blocks on other nodes (any ``m`` lost nodes are rebuilt; ``m/k`` extra memory).
            Not with ``local_replicas``. See ``docs/resilience.md``.
        durable_every: with ``local_dir``, only steps divisible by this also go to ``root``
            (None: every step does).
        local_keep_last: committed local steps each node keeps.
        save_policy: what :meth:`should_save` answers (see :mod:`tessera.manager.policies`).
        preemption: install a handler for ``preemption_signal`` (main thread only; restored
            by :meth:`close`), or the :class:`~tessera.manager.PreemptionHandler` given: once any
            rank is preempted, :meth:`should_save` says True, the next :meth:`save` is
            synchronous and durable, then :attr:`reached_preemption` is True.
        preemption_signal: the signal that means preemption (default SIGTERM).
        dedup: write only the tiles that changed since the previous step; unchanged ones are
            referenced in ``<root>/.tessera-tiles``, and every step still loads on its own.
            Not with ``local_dir``. See ``docs/incremental.md``.
        max_staging_bytes, compress: set :attr:`SaveOptions.max_staging_bytes <tessera.SaveOptions.max_staging_bytes>`
            (the host-memory budget of asynchronous saves) and ``SaveOptions.compress`` (tiles stored compressed,
            losslessly: ``docs/compression.md``) of ``save_options`` when given.

    Raises:
        ValueError: for ``keep_last``, ``keep_every``, ``durable_every`` or ``local_keep_last``
            below 1, ``local_replicas`` below 0, or a ``local_dir`` that is a URL.

    Collective contract: every rank constructs the manager alike and calls ``save``/``load``
    in the same order; only rank 0 moves ``latest`` and deletes old steps. Close it (or use
    it as a context manager) before tearing down ``torch.distributed``.

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
        local_replicas: int | None = None,
        local_parity: tuple[int, int] | None = None,
        durable_every: int | None = None,
        local_keep_last: int = 2,
        save_policy: SavePolicy | None = None,
        preemption: bool | PreemptionHandler = False,
        preemption_signal: int = signal.SIGTERM,
        dedup: bool = False,
        max_staging_bytes: int | str | None = None,
        compress: bool | str | None = None,
    ) -> None:
        args = check_arguments(
            root,
            keep_last=keep_last,
            keep_every=keep_every,
            durable_every=durable_every,
            local_keep_last=local_keep_last,
            local_replicas=local_replicas,
            local_dir=local_dir,
            dedup=dedup,
            local_parity=local_parity,
        )
        root, local_dir = args.root, args.local_dir
        tier = local_tier_of(args, keep_last=local_keep_last, process_group=process_group)
        self._steps = StepDirectory(
            root, storage_factory or (lambda url: storage_for(url, storage_options=storage_options))
        )
        self._retention = Retention(self._steps, keep_last=keep_last, keep_every=keep_every)
        self._saves = BackgroundSaves(owner=self)
        self._direct = DirectRoute(
            self._steps,
            self._retention,
            self._saves,
            process_group=process_group,
            allow_pickle=allow_pickle,
            save_options=with_budget(save_options, max_staging_bytes, compress),
            retention_before_save=retention_before_save,
            shared=SharedTiles(self._steps) if dedup else None,
        )
        self._tiered = TieredRoute(tier, self._direct) if tier is not None else None
        self._loader = StepLoader(self._steps, tier, local_dir)
        self.local_replicas, self.local_parity = args.local_replicas, args.local_parity
        self.durable_every = durable_every
        self.async_save = async_save
        self.load_options = load_options
        self._closed = False
        handler = preemption if isinstance(preemption, PreemptionHandler) else None
        if handler is None and preemption:
            handler = PreemptionHandler([preemption_signal])
        self._decider = SaveDecider(save_policy, preemption=handler, process_group=process_group)
        if handler is not None:  # after every argument is checked: a refused manager leaves no handler
            handler.install()
        close_at_exit(self)

    # The arguments are kept as attributes of the same names; these live on the part that uses them.
    root = Kept[str]("_steps")
    keep_last = Kept[int | None]("_retention")
    keep_every = Kept[int | None]("_retention")
    process_group = Kept[Any]("_direct")
    allow_pickle = Kept[bool]("_direct")
    save_options = Kept[SaveOptions | None]("_direct")
    retention_before_save = Kept[bool]("_direct")
    local_dir = Kept[str | None]("_loader")

    # The save in flight and its finishing thread (the lifecycle tests read them).
    _pending = property(lambda self: self._saves.pending)
    _thread = property(lambda self: self._saves.thread)

    # ------------------------------------------------------------------------------------
    # Naming and listing (local: no communication)

    def step_url(self, step: int) -> str:
        """The path or URL of ``step``'s checkpoint (it need not exist).

        Example:
            >>> CheckpointManager("/ckpt/run1").step_url(100)
            '/ckpt/run1/step-00000100'
        """
        return self._steps.url(step)

    def steps(self, *, local: bool = True) -> list[int]:
        """Committed steps, oldest first: those under ``root`` with a ``manifest.json`` and, with
        a local tier, the run's local steps this node holds completely.

        Not collective; reads storage (with a local tier, also the root's identity and this
        node's directory: nodes may disagree after a node loss).

        Args:
            local: count the local tier's steps (False: only the durable steps under ``root``).

        Example:
            >>> mgr.steps()
            [300, 400, 500]
        """
        found = {s for s, committed in self._steps.scan().items() if committed}
        if local and self._tiered is not None:
            found.update(self._tiered.steps_here())
        return sorted(found)

    def latest_step(self) -> int | None:
        """The newest committed step (durable, or local on this node: see :meth:`steps`), or
        None when there is none. Not collective.

        Where :meth:`load` starts; it does not depend on ``latest`` (which may lag after a crash).

        Example:
            >>> start = 0 if mgr.latest_step() is None else mgr.load(state).step + 1
        """
        steps = self.steps()
        return steps[-1] if steps else None

    def pointer_step(self) -> int | None:
        """The step the ``latest`` pointer names (None if absent or unreadable). Not collective."""
        return self._steps.pointer()

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
            :class:`~tessera.SaveResult`, or for an asynchronous save a :class:`~tessera.PendingSave`
            whose ``wait()`` returns after the commit (and, on rank 0, ``latest`` and retention).
            It commits exactly the state at the call: raw tensors are copied before this returns,
            gated Statefuls' while their next step waits (see :class:`tessera.StagingMode`).

        Raises:
            CheckpointError: if the save fails on any rank (the previous steps stay intact);
                :class:`~tessera.errors.StagingMutationError` (from ``wait()``) if a tensor
                copied in the background was changed first.
            ValueError: for a bad step number or a closed manager.

        Example:
            >>> state = {"model": tessera.ModelState(model), "optim": tessera.OptimizerState(model, opt)}
            >>> mgr.save(100, {**state, "step": 100})  # then keep training: opt.step() waits if needed
        """
        _args.check_manager_save(step, state)
        step = check_step(step)
        self._check_open()
        t0 = time.monotonic()  # the stall counts the wait for the previous save too
        self._saves.wait_previous()
        waited = time.monotonic() - t0
        in_background = self.async_save if async_save is None else async_save
        preempted = self._decider.agree_preemption(step)  # collective only with preemption=True
        if preempted:
            in_background = False  # the job exits next: the step must be committed (and durable) first
        self._decider.record_save(step)
        world = dist.world_for(self.process_group)
        self._saves.note_world(world)
        if self._tiered is not None:
            every = self.durable_every
            durable = preempted or every is None or step % every == 0
            return self._tiered.save(step, state, in_background, world, t0, waited, durable=durable)
        return self._direct.save(step, state, in_background, world, t0, waited)

    def apply_retention(self, *, making_room_for: int | None = None) -> list[int]:
        """Rank 0: delete the steps retention does not keep; returns them. Not collective.

        Runs after every commit anyway; call it to free space *before* a save (e.g. after one
        failed on a full disk), or pass ``retention_before_save=True``.

        Args:
            making_room_for: a step about to be saved: one of the ``keep_last`` places is kept
                free for it. The newest committed step is kept whatever ``keep_last`` says.

        Example:
            >>> mgr.apply_retention(making_room_for=step)  # the disk is tight
        """
        return self._direct.apply_retention(making_room_for)

    def should_save(self, step: int) -> bool:
        """Whether to save at ``step``: ``save_policy``, or a preemption any rank received.

        Collective when the policy reads the clock or ``preemption`` is on: call it on every rank.

        Example:
            >>> if mgr.should_save(step):
            ...     mgr.save(step, state)
            >>> if mgr.reached_preemption:
            ...     break  # the preemption checkpoint is committed
        """
        return self._decider.should_save(check_step(step))

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
        self._check_open()
        self._saves.wait_previous()
        world = dist.world_for(self.process_group)
        kwargs = {"strict": strict, "cast_dtypes": cast_dtypes, "options": self.load_options}
        kwargs.update(process_group=self.process_group, allow_pickle=self.allow_pickle)
        step = None if step is None else check_step(step)
        loaded = self._direct.loaded(self._loader.load(state, step, world, kwargs))  # dedup builds on it
        return loaded if self._tiered is None else self._tiered.after_load(loaded)  # so does the timeline

    def remove_local_steps(self) -> list[int]:
        """Delete this root's steps, committed or not, from the local tier on every node; collective.

        Call it when the run is over (host memory is not freed when the job ends); steps under
        ``root`` stay, and the node directory goes if nothing else is left in it. From the
        command line, on each node: ``tessera local-tier remove ROOT``.

        Returns:
            the steps deleted on this rank's node (empty on ranks that are not a node's first).

        Raises:
            ValueError: if the manager has no local tier or is closed.

        Example:
            >>> mgr.save(100, state)
            >>> mgr.remove_local_steps()
            [100]
        """
        if self._tiered is None:
            raise ValueError(f"CheckpointManager({self.root!r}) has no local tier (no local_dir, no tier:: root)")
        self._check_open()
        self._saves.wait_previous()
        return self._tiered.remove_local(dist.world_for(self.process_group))

    # ------------------------------------------------------------------------------------
    # Lifecycle

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"CheckpointManager({self.root!r}) is closed")

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
        return self._saves.wait()

    def close(self) -> None:
        """Finish the pending save and stop accepting new ones. Idempotent.

        Raises:
            CheckpointError: if the pending save failed and nobody has seen that yet.
        """
        if self._closed:
            return
        self._closed = True
        forget_at_exit(self)
        if threading.current_thread() is threading.main_thread():
            self._decider.close()
        try:
            self._saves.wait_previous()
        finally:
            if self._tiered is not None:
                self._tiered.tier.wait_deletions()
            self._direct.close()

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
