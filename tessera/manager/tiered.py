"""The manager's save with a node-local tier (``local_dir``).

Every step goes to the local tier first and is committed there with its replicas on other
nodes; durable steps (``durable_every``, or a preemption) are then copied under ``root``,
where ``latest`` and retention follow as for any save. Loading from the tier is
:meth:`tessera.local_tier.LocalTier.recover` (see :mod:`tessera.manager.resume`).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from .. import api, dist
from ..results import PendingSave, SaveResult
from .background import explain, finish_in_background
from .direct import after_commit, forget
from .steps import close_store

if TYPE_CHECKING:
    from .core import CheckpointManager

__all__ = ["finish_tiered", "save_tiered"]


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
    local = tier.step_store(step, world)
    tier.before_save(step, world)
    with manager._lock:
        manager._in_flight.add(step)
    kwargs: dict[str, Any] = {
        "process_group": manager.process_group,
        "storage": local,
        "allow_pickle": manager.allow_pickle,
        "options": manager.save_options,
    }
    label = tier.step_label(step)
    if not background:
        try:
            result = api.save(label, state, **kwargs)
            finish_tiered(manager, step, durable, world)
        finally:
            forget(manager, step, local)
        return result
    try:
        inner = api.async_save(label, state, **kwargs)
    except BaseException:
        forget(manager, step, local)
        raise
    copy = durable

    def finish(future: Future[SaveResult]) -> None:
        try:
            result = inner.wait()
            finish_tiered(manager, step, copy, world)
        except BaseException as e:
            future.set_exception(explain(manager, e, step))
            return
        finally:
            forget(manager, step, local)
        future.set_result(result)

    return finish_in_background(manager, inner, finish, path=label, t0=t0, waited=waited)


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
