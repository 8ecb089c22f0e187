"""A manager's asynchronous saves: the finishing thread, waiting for it, and closing at exit.

:class:`BackgroundSaves` owns a manager's one save in flight: its
:class:`~tessera.PendingSave`, which resolves once the inner save committed and the manager's
own follow-up (``latest``, retention, the local tier's durable copy) is done, and the one
``tessera-manager`` thread that runs that follow-up. Managers still open at interpreter exit
are closed (their pending saves finished) first: :func:`close_at_exit`.
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
from typing import Protocol

from ..engine import dist, inflight
from ..errors import CheckpointError
from ..results import PendingSave, SaveResult

__all__ = ["BackgroundSaves", "Closes", "close_at_exit", "forget_at_exit"]

logger = logging.getLogger(__name__)


class Closes(Protocol):
    """What is closed at interpreter exit: a manager (its ``root`` names it in messages)."""

    @property
    def root(self) -> str: ...

    def close(self) -> None: ...


_OPEN: weakref.WeakSet[Closes] = weakref.WeakSet()


def close_at_exit(manager: Closes) -> None:
    """Close ``manager`` at interpreter exit unless it is closed before."""
    _OPEN.add(manager)


def forget_at_exit(manager: Closes) -> None:
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


def _run(finish: Callable[[Future[SaveResult]], None], future: Future[SaveResult], owner: Closes | None) -> None:
    finish(future)


class BackgroundSaves:
    """A manager's save in flight (at most one) and the thread finishing it.

    Call order: :meth:`start` once the inner asynchronous save is started; :meth:`wait_previous`
    before the next save or load; :meth:`wait` when the user waits. Used from the manager's
    caller thread only (the finishing thread touches only its future).
    """

    def __init__(self, owner: Closes | None = None) -> None:
        # The manager, weakly (no cycle); a finishing thread holds it while a save is in flight.
        self._owner = weakref.ref(owner) if owner is not None else None
        self.pending: PendingSave | None = None
        self.thread: threading.Thread | None = None
        # Whether a save ran in a process group: if the group is gone when a background save
        # fails, the error says to close the manager before destroying the group.
        self._distributed = False

    def note_world(self, world: dist.World) -> None:
        """Record the process group of a save that is starting (see :meth:`explain`)."""
        self._distributed = self._distributed or world.distributed

    def start(
        self,
        inner: PendingSave,
        finish: Callable[[Future[SaveResult]], None],
        *,
        path: str,
        t0: float,
        waited: float,
    ) -> PendingSave:
        """Run ``finish`` in the finishing thread; the :class:`~tessera.PendingSave` it resolves.

        Args:
            inner: the inner asynchronous save (its staging gate and stall parts are reused).
            finish: waits for ``inner``, does the follow-up, and sets the future's result or error.
            path: the path the returned PendingSave names.
            t0: when :meth:`~tessera.CheckpointManager.save` started (the stall counts from there).
            waited: seconds spent waiting for the previous save.
        """
        future: Future[SaveResult] = Future()
        owner = self._owner() if self._owner is not None else None
        # The thread's arguments hold the manager until the thread ends: a manager the caller
        # dropped with a save in flight is still closed at exit, its save finished or reported.
        thread = threading.Thread(target=_run, args=(finish, future, owner), name="tessera-manager", daemon=True)
        self.thread = thread
        thread.start()
        stall = time.monotonic() - t0
        parts = dict(inner.stall_parts)
        parts["wait_previous"] = parts.get("wait_previous", 0.0) + waited
        parts["prepare"] = max(0.0, stall - sum(parts.values()))  # storage, retention, threads
        # The gate is the inner save's: wait_staged() here waits for the same copy.
        self.pending = PendingSave(future, stall, path=path, staged_event=inner._staged, stall_parts=parts)
        return self.pending

    def wait_previous(self) -> None:
        """Block until the pending save (if any) and its thread have finished.

        Raises:
            CheckpointError: the pending save's failure, if nobody has observed it yet.
        """
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            error = inflight.settle(pending)  # marks the failure as observed
        finally:
            self._join()
        if error is not None:
            raise error

    def wait(self) -> SaveResult | None:
        """:meth:`CheckpointManager.wait`: the pending save's result (None if there was none).

        Raises:
            CheckpointError: if the pending save failed.
        """
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        try:
            return pending.wait()
        finally:
            self._join()

    def _join(self) -> None:
        thread, self.thread = self.thread, None
        if thread is not None:
            thread.join()

    def explain(self, e: BaseException, step: int, root: str) -> BaseException:
        """``e``, or an error saying what to do if the process group went away under the save."""
        import torch.distributed as tdist

        if not self._distributed or (tdist.is_available() and tdist.is_initialized()):
            return e
        out = CheckpointError(
            f"CheckpointManager({root!r}): step {step} was NOT committed: the process group was destroyed "
            f"while its asynchronous save was still running. Call mgr.close() (or mgr.wait()) before "
            f"torch.distributed.destroy_process_group(). Cause: {type(e).__name__}: {e}"
        )
        out.__cause__ = e
        return out
