"""The manager's save with a node-local tier (``local_dir``).

Every step goes to the local tier first and is committed there with its replicas on other
nodes; durable steps (``durable_every``, or a preemption) are then copied under ``root``,
where ``latest`` and retention follow as for any save. Loading from the tier is
:meth:`tessera.local_tier.LocalTier.recover` (see :mod:`tessera.manager.resume`).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

from .. import dist
from ..results import PendingSave, SaveResult
from . import identity
from .direct import after_commit, run_save
from .steps import close_store

if TYPE_CHECKING:
    from .core import CheckpointManager

logger = logging.getLogger(__name__)

__all__ = ["finish_tiered", "remove_local", "save_tiered"]


def save_tiered(
    manager: CheckpointManager,
    step: int,
    state: object,
    background: bool,
    world: dist.World,
    t0: float,
    waited: float,
    durable: bool | None = None,
) -> SaveResult | PendingSave:
    """:meth:`CheckpointManager.save` with a local tier: the local step (committed with its replicas),
    then, for durable steps (``durable_every``, or ``durable=True``: a preemption), a copy of it under ``root``.

    Args:
        manager: the manager (it has a local tier).
        step: the step being saved.
        state: what to save.
        background: save asynchronously (the follow-up runs in the manager's thread).
        world: the process group's view of this rank.
        t0: when the save started (for the stall).
        waited: seconds spent waiting for the previous save.
        durable: force the copy under ``root`` (None: ``durable_every`` decides).

    Returns:
        the save's result, or the PendingSave of an asynchronous one.
    """
    tier = manager._tier
    assert tier is not None
    if not durable:
        durable = manager.durable_every is None or step % manager.durable_every == 0
    identity.establish(manager, world, create=True)  # once: the id each local commit records
    local = tier.step_store(step, world)
    tier.before_save(step, world)
    with manager._lock:
        manager._in_flight.add(step)
    then = functools.partial(finish_tiered, manager, step, durable, world)
    return run_save(manager, step, tier.step_label(step), state, local, background, then, t0, waited)


def finish_tiered(manager: CheckpointManager, step: int, durable: bool, world: dist.World) -> None:
    """After the local save of ``step``: replicas and the local commit, then the durable copy."""
    tier = manager._tier
    assert tier is not None
    data = tier.commit(step, world)
    if not durable:
        return
    store = manager._factory(manager.step_url(step))
    try:
        tier.copy_to_durable(step, data, store, world)
        after_commit(manager, step, store, world)
    finally:
        close_store(store)


def remove_local(manager: CheckpointManager, world: dist.World) -> list[int]:
    """:meth:`CheckpointManager.remove_local_steps`: node leaders delete the root's steps in
    their node's directory; collective (a failure on any rank raises on every rank)."""
    tier = manager._tier
    assert tier is not None
    placement = tier.placement(world)
    leader = placement.leader(placement.node_of[world.rank]) == world.rank
    error: BaseException | None = None
    removed: list[int] = []
    if leader:
        try:
            removed = tier.remove_all(world)
        except Exception as e:
            error = e
    dist.exchange(world, error, None, f"removing the local steps of {manager.root}")
    if removed:
        logger.info("removed local steps %s of %s from %s", removed, manager.root, tier.node_directory(world))
    return removed
