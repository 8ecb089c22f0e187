"""The manager's save straight to ``root`` (no local tier), and what follows every commit.

After a step is committed under ``root`` (by this save or by the local tier's durable copy),
rank 0 points ``latest`` at it if it is the newest and applies retention; failures after
the commit are logged, since the step is committed whatever happens next.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from .. import api
from ..engine import dist
from ..results import PendingSave, SaveResult
from ..storage import Storage
from .background import explain, finish_in_background
from .retention import retain
from .steps import LATEST_NAME, close_store, write_pointer

if TYPE_CHECKING:
    from .core import CheckpointManager

__all__ = ["after_commit", "forget", "run_save", "save_direct"]

logger = logging.getLogger(__name__)


def save_direct(
    manager: CheckpointManager,
    step: int,
    state: object,
    in_background: bool,
    world: dist.World,
    t0: float,
    waited: float,
) -> SaveResult | PendingSave:
    """:meth:`CheckpointManager.save` without a local tier: the step is saved under ``root``.

    Args:
        manager: the manager.
        step: the step being saved.
        state: what to save.
        in_background: save asynchronously (the follow-up runs in the manager's thread).
        world: the process group's view of this rank.
        t0: when the save started (for the stall).
        waited: seconds spent waiting for the previous save.

    Returns:
        the save's result, or the PendingSave of an asynchronous one.
    """
    url = manager.step_url(step)
    store = manager._factory(url)
    if manager.retention_before_save and world.is_coordinator:
        # Rank 0 makes room before it joins the save; no rank writes before rank 0 joins.
        try:
            manager.apply_retention(making_room_for=step)
        except Exception as e:
            logger.warning("retention before saving step %d under %s failed: %s", step, manager.root, e)
    with manager._lock:
        manager._in_flight.add(step)
    return run_save(
        manager, step, url, state, store, in_background, lambda: after_commit(manager, step, store, world), t0, waited
    )


def run_save(
    manager: CheckpointManager,
    step: int,
    path: str,
    state: object,
    store: Storage,
    in_background: bool,
    then: Callable[[], None],
    t0: float,
    waited: float,
) -> SaveResult | PendingSave:
    """Save ``state`` to ``path`` through ``store``, then call ``then()`` once it is committed;
    ``step`` stops being in flight and ``store`` is released either way.

    Synchronous, or (``in_background``) the save runs as ``async_save`` and ``then`` in the
    manager's thread; errors of either reach the returned PendingSave.
    """
    kwargs: dict[str, Any] = {
        "process_group": manager.process_group,
        "storage": store,
        "allow_pickle": manager.allow_pickle,
        "options": manager.save_options,
    }
    if not in_background:
        try:
            result = api.save(path, state, **kwargs)
            then()
        finally:
            forget(manager, step, store)
        return result
    try:
        inner = api.async_save(path, state, **kwargs)
    except BaseException:
        forget(manager, step, store)
        raise

    def finish(future: Future[SaveResult]) -> None:
        try:
            result = inner.wait()
            then()
        except BaseException as e:
            future.set_exception(explain(manager, e, step))
            return
        finally:
            forget(manager, step, store)
        future.set_result(result)

    return finish_in_background(manager, inner, finish, path=path, t0=t0, waited=waited)


def forget(manager: CheckpointManager, step: int, store: Storage) -> None:
    """``step`` is no longer in flight (retention may delete it); release its backend."""
    with manager._lock:
        manager._in_flight.discard(step)
    try:
        close_store(store)
    except Exception as e:
        logger.warning("closing the storage of %s failed: %s", manager.step_url(step), e)


def after_commit(manager: CheckpointManager, step: int, store: Storage, world: dist.World) -> None:
    """Rank 0, after ``step`` committed: move ``latest``, then apply retention.

    Failures here are logged, not raised: the step is committed whatever happens next.
    """
    if not world.is_coordinator:
        return
    try:
        found = manager._scan()
    except Exception as e:
        logger.warning("step %d: not moving %s/%s nor applying retention: %s", step, manager.root, LATEST_NAME, e)
        return
    try:
        if step >= max((s for s, c in found.items() if c), default=step):
            write_pointer(manager._root_store, step)
    except Exception as e:
        logger.warning("step %d is committed but moving %s/%s failed: %s", step, manager.root, LATEST_NAME, e)
    try:
        retain(manager, step, found, keep_last=manager.keep_last)
    except Exception as e:
        logger.warning("retention under %s failed after step %d: %s", manager.root, step, e)
