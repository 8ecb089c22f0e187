"""A manager's asynchronous saves: the finishing thread, waiting for it, and closing at exit.

A manager has at most one save in flight. Its :class:`~tessera.PendingSave` resolves once
the inner save committed and the manager's own follow-up (``latest``, retention, the local
tier's durable copy) is done; that follow-up runs in one ``tessera-manager`` thread.
Managers still open at interpreter exit are closed (their pending save finished) first.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from ..engine import inflight
from ..errors import CheckpointError
from ..results import PendingSave, SaveResult

if TYPE_CHECKING:
    from .core import CheckpointManager

__all__ = ["close_at_exit", "explain", "finish_in_background", "forget_at_exit", "wait_previous"]

logger = logging.getLogger(__name__)

_OPEN: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()


def close_at_exit(manager: CheckpointManager) -> None:
    """Close ``manager`` at interpreter exit unless it is closed before."""
    _OPEN.add(manager)


def forget_at_exit(manager: CheckpointManager) -> None:
    """Undo :func:`close_at_exit` (the manager was closed)."""
    _OPEN.discard(manager)


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


def finish_in_background(
    manager: CheckpointManager,
    inner: PendingSave,
    finish: Callable[[Future[SaveResult]], None],
    *,
    path: str,
    t0: float,
    waited: float,
) -> PendingSave:
    """Run ``finish`` in the manager's thread; the :class:`~tessera.PendingSave` it resolves.

    Args:
        manager: the manager (its ``_thread`` and ``_pending`` are set).
        inner: the inner asynchronous save (its staging gate and stall parts are reused).
        finish: waits for ``inner``, does the follow-up, and sets the future's result or error.
        path: the path the returned PendingSave names.
        t0: when :meth:`~tessera.CheckpointManager.save` started (the stall counts from there).
        waited: seconds spent waiting for the previous save.
    """
    future: Future[SaveResult] = Future()
    thread = threading.Thread(target=finish, args=(future,), name="tessera-manager", daemon=True)
    manager._thread = thread
    thread.start()
    stall = time.monotonic() - t0
    parts = dict(inner.stall_parts)
    parts["wait_previous"] = parts.get("wait_previous", 0.0) + waited
    parts["prepare"] = max(0.0, stall - sum(parts.values()))  # storage, retention, threads
    # The gate is the inner save's: wait_staged() here waits for the same copy.
    manager._pending = PendingSave(future, stall, path=path, staged_event=inner._staged, stall_parts=parts)
    return manager._pending


def wait_previous(manager: CheckpointManager) -> None:
    """Block until the manager's pending save (if any) and its thread have finished.

    Raises:
        CheckpointError: the pending save's failure, if nobody has observed it yet.
    """
    pending, manager._pending = manager._pending, None
    if pending is None:
        return
    try:
        error = inflight.settle(pending)  # marks the failure as observed
    finally:
        join(manager)
    if error is not None:
        raise error


def join(manager: CheckpointManager) -> None:
    """Join the manager's finishing thread, if any."""
    thread, manager._thread = manager._thread, None
    if thread is not None:
        thread.join()


def explain(manager: CheckpointManager, e: BaseException, step: int) -> BaseException:
    """``e``, or an error saying what to do if the process group went away under the save."""
    import torch.distributed as tdist

    if not manager._distributed or (tdist.is_available() and tdist.is_initialized()):
        return e
    out = CheckpointError(
        f"CheckpointManager({manager.root!r}): step {step} was NOT committed: the process group was destroyed "
        f"while its asynchronous save was still running. Call mgr.close() (or mgr.wait()) before "
        f"torch.distributed.destroy_process_group(). Cause: {type(e).__name__}: {e}"
    )
    out.__cause__ = e
    return out
