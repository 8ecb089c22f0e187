"""The manager's save with a node-local tier (``local_dir``).

:class:`TieredRoute` saves every step to the local tier first, where it is committed with
its replicas on other nodes; durable steps (``durable_every``, or a preemption) are then
copied under ``root``, where ``latest`` and retention follow as for any save (through the
:class:`~tessera.manager.direct.DirectRoute`). Loading from the tier is
:meth:`tessera.manager.local_tier.LocalTier.recover` (see :mod:`tessera.manager.resume`).
"""

from __future__ import annotations

import functools
import logging

from ..engine import dist
from ..results import PendingSave, SaveResult
from . import identity
from .direct import DirectRoute
from .local_tier import LocalTier
from .local_tier.timeline import read_timeline
from .resume import StepLoadResult
from .steps import StepDirectory, close_store

logger = logging.getLogger(__name__)

__all__ = ["TieredRoute"]


class TieredRoute:
    """Saves steps to the local tier, copying the durable ones under ``root``.

    :meth:`save` and :meth:`remove_local` are collective over the process group;
    :meth:`steps_here` is local.

    Args:
        tier: the node-local tier.
        direct: the route under ``root`` (its runner, and what follows a durable commit).
    """

    def __init__(self, tier: LocalTier, direct: DirectRoute) -> None:
        self.tier = tier
        self.direct = direct
        self._in_epoch = False  # whether this manager's saves continue an epoch it opened
        self._last_saved: int | None = None  # the last step saved in it
        self._resumed_from: int | None = None  # the step a load gave since the last save

    def after_load(self, loaded: StepLoadResult) -> StepLoadResult:
        """After a load (not collective): the next save opens a new timeline epoch that goes on
        from the step loaded, so the steps newer than it become unreachable everywhere.

        Returns:
            ``loaded``, as it is.
        """
        self._in_epoch = False
        self._resumed_from = loaded.step
        return loaded

    @property
    def steps(self) -> StepDirectory:
        """The durable root."""
        return self.direct.steps

    def steps_here(self) -> list[int]:
        """The run's local steps this node holds completely (not collective)."""
        root_id, timeline = self.tier.root_id, self.tier.timeline
        if root_id is None or timeline is None:
            root_id = identity.read_root_id(self.steps.store)
            timeline = read_timeline(self.steps.store)
        return self.tier.steps_here(root_id, timeline)

    def save(
        self,
        step: int,
        state: object,
        in_background: bool,
        world: dist.World,
        t0: float,
        waited: float,
        *,
        durable: bool,
    ) -> SaveResult | PendingSave:
        """:meth:`CheckpointManager.save` with a local tier: the local step (committed with its
        replicas), then, if ``durable``, a copy of it under ``root``.

        Args:
            step: the step being saved.
            state: what to save.
            in_background: save asynchronously (the follow-up runs in the manager's thread).
            world: the process group's view of this rank.
            t0: when the save started (for the stall).
            waited: seconds spent waiting for the previous save.
            durable: also copy the step under ``root`` (``durable_every``, or a preemption).

        Returns:
            the save's result, or the PendingSave of an asynchronous one.
        """
        tier = self.tier
        identity.establish(tier, self.steps, world, create=True)  # once: the id each local commit records
        if not self._in_epoch or self._last_saved is None or step <= self._last_saved:
            # A new epoch: this manager's first save, the first after a load, or a step that is
            # not newer than the last one. Within an epoch steps only increase (timeline.py).
            base = step - 1 if self._resumed_from is None else min(self._resumed_from, step - 1)
            identity.begin_epoch(tier, self.steps, world, base)
            self._in_epoch, self._resumed_from = True, None
        self._last_saved = step
        local = tier.step_store(step, world)
        tier.before_save(step, world)
        then = functools.partial(self._finish, step, durable, world)
        return self.direct.run(step, tier.step_label(step), state, local, in_background, then, t0, waited)

    def _finish(self, step: int, durable: bool, world: dist.World) -> None:
        """After the local save of ``step``: replicas and the local commit, then the durable copy."""
        tier = self.tier
        data = tier.commit(step, world)
        if not durable:
            return
        store = self.steps.open_step(step)
        try:
            tier.copy_to_durable(step, data, store, world)
            self.direct.after_commit(step, world)
        finally:
            close_store(store)

    def remove_local(self, world: dist.World) -> list[int]:
        """:meth:`CheckpointManager.remove_local_steps`: node leaders delete the root's steps in
        their node's directory; collective (a failure on any rank raises on every rank)."""
        tier = self.tier
        root = self.steps.root
        placement = tier.placement(world)
        leader = placement.leader(placement.node_of[world.rank]) == world.rank
        error: BaseException | None = None
        removed: list[int] = []
        if leader:
            try:
                removed = tier.remove_all(world)
            except Exception as e:
                error = e
        dist.exchange(world, error, None, f"removing the local steps of {root}")
        if removed:
            logger.info("removed local steps %s of %s from %s", removed, root, tier.node_directory(world))
        return removed
