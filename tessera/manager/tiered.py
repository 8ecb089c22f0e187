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

from ..engine import dist
from ..results import PendingSave, SaveResult
from . import identity
from .direct import after_commit, run_save
from .retention import delete_step
from .steps import LATEST_NAME, close_store, write_pointer

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
    if durable or tier.last_fenced:
        fence_durable(manager, step, world, rolled_back=tier.last_fenced)
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


def fence_durable(manager: CheckpointManager, step: int, world: dist.World, *, rolled_back: bool) -> None:
    """Rank 0, once ``step`` is committed locally: if the job rolled back (newer local steps
    were fenced, or ``latest`` names a newer step), delete the durable steps newer than ``step``
    (manifest first) and point ``latest`` at the newest one left, so that no later load prefers
    the abandoned steps. Failures are logged: ``step`` is committed whatever happens here."""
    if not world.is_coordinator:
        return
    try:
        pointer = manager.pointer_step()
        if not rolled_back and (pointer is None or pointer <= step):
            return  # the usual case: one small read, no listing
        found = manager._scan()
        newer = sorted(s for s in found if s > step)
        for s in newer:
            delete_step(manager._root_store, manager.root, s)
        if pointer is not None and pointer > step:
            left = max((s for s, committed in found.items() if committed and s <= step), default=None)
            if left is None:
                manager._root_store.delete([LATEST_NAME])
            else:
                write_pointer(manager._root_store, left)
        if newer:
            logger.warning(
                "step %d is saved after a rollback: the newer steps %s under %s are deleted", step, newer, manager.root
            )
    except Exception as e:
        logger.warning("step %d: removing the steps newer than it under %s failed: %s", step, manager.root, e)
