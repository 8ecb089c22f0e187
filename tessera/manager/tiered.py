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

    @property
    def steps(self) -> StepDirectory:
        """The durable root."""
        return self.direct.steps

    def steps_here(self) -> list[int]:
        """The run's local steps this node holds completely (not collective)."""
        root_id = self.tier.root_id
        if root_id is None:
            root_id = identity.read_root_id(self.steps.store)
        return self.tier.steps_here(root_id)

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
        local = tier.step_store(step, world)
        tier.before_save(step, world)
        then = functools.partial(self._finish, step, durable, world)
        return self.direct.run(step, tier.step_label(step), state, local, in_background, then, t0, waited)

    def _finish(self, step: int, durable: bool, world: dist.World) -> None:
        """After the local save of ``step``: replicas and the local commit, then the durable copy."""
        tier = self.tier
        data = tier.commit(step, world)
        if durable or tier.last_fenced:
            self._fence_durable(step, world, rolled_back=tier.last_fenced)
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

    def _fence_durable(self, step: int, world: dist.World, *, rolled_back: bool) -> None:
        """Rank 0, once ``step`` is committed locally: if the job rolled back (newer local steps
        were fenced, or ``latest`` names a newer step), delete the durable steps newer than ``step``
        (manifest first) and point ``latest`` at the newest one left, so that no later load prefers
        the abandoned steps. Failures are logged: ``step`` is committed whatever happens here."""
        if not world.is_coordinator:
            return
        steps = self.steps
        try:
            pointer = steps.pointer()
            if not rolled_back and (pointer is None or pointer <= step):
                return  # the usual case: one small read, no listing
            found = steps.scan()
            newer = sorted(s for s in found if s > step)
            for s in newer:
                steps.delete(s)
            if pointer is not None and pointer > step:
                left = max((s for s, committed in found.items() if committed and s <= step), default=None)
                if left is None:
                    steps.remove_pointer()
                else:
                    steps.point_at(left)
            if newer:
                logger.warning(
                    "step %d is saved after a rollback: the newer steps %s under %s are deleted",
                    step,
                    newer,
                    steps.root,
                )
        except Exception as e:
            logger.warning("step %d: removing the steps newer than it under %s failed: %s", step, steps.root, e)
