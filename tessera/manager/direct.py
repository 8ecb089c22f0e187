"""The manager's save straight to ``root`` (no local tier), and what follows every commit.

:class:`DirectRoute` runs a step's save, synchronously or through the manager's
:class:`~tessera.manager.background.BackgroundSaves`, keeps retention off the step while it
is saved, and after a step is committed under ``root`` (by this save or by the local tier's
durable copy) lets rank 0 point ``latest`` at it if it is the newest and apply retention.
Failures after the commit are logged, since the step is committed whatever happens next.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ..engine import dist
from ..engine.saving import SaveRequest, start_save
from ..engine.saving.tile_index import Dedup
from ..options import SaveOptions
from ..results import PendingSave, SaveResult
from ..storage import Storage
from .background import BackgroundSaves
from .resume import StepLoadResult
from .retention import Retention
from .shared_tiles import SharedTiles
from .steps import LATEST_NAME, StepDirectory, close_store, is_first_rank

__all__ = ["DirectRoute"]

logger = logging.getLogger(__name__)


class DirectRoute:
    """Saves steps under ``root``, and moves ``latest`` and applies retention after each commit.

    Every rank calls :meth:`save` (collective, like :func:`tessera.save`); only rank 0 does
    the follow-up of a commit.

    Args:
        steps: the root the steps are saved under.
        retention: the root's retention (it spares a step while it is saved).
        saves: the manager's background saves (an asynchronous save's follow-up runs there).
        process_group: the ranks taking part.
        allow_pickle: store values that need pickle.
        save_options: passed to every save.
        retention_before_save: rank 0 applies retention before each save, making room for it.
        shared: the root's shared tile directory (``dedup=True``): saves reference unchanged
            tiles there, and rank 0 collects what no step uses any more after retention.
    """

    def __init__(
        self,
        steps: StepDirectory,
        retention: Retention,
        saves: BackgroundSaves,
        *,
        process_group: Any,
        allow_pickle: bool,
        save_options: SaveOptions | None,
        retention_before_save: bool,
        shared: SharedTiles | None = None,
    ) -> None:
        self.steps = steps
        self.retention = retention
        self.saves = saves
        self.process_group = process_group
        self.allow_pickle = allow_pickle
        self.save_options = save_options
        self.retention_before_save = retention_before_save
        self.shared = shared
        if is_first_rank(process_group):
            steps.check_at_start()  # a stale `latest`, step directories named otherwise: said once

    def loaded(self, result: StepLoadResult) -> StepLoadResult:
        """The manager loaded ``result.step``: the next dedup save builds on it. Returns ``result``."""
        if self.shared is not None:
            self.shared.build_on(result.step)
        return result

    def save(
        self, step: int, state: object, in_background: bool, world: dist.World, t0: float, waited: float
    ) -> SaveResult | PendingSave:
        """:meth:`CheckpointManager.save` without a local tier: the step is saved under ``root``.

        Args:
            step: the step being saved.
            state: what to save.
            in_background: save asynchronously (the follow-up runs in the manager's thread).
            world: the process group's view of this rank.
            t0: when the save started (for the stall).
            waited: seconds spent waiting for the previous save.

        Returns:
            the save's result, or the PendingSave of an asynchronous one.
        """
        url = self.steps.url(step)
        store = self.steps.factory(url)
        if self.retention_before_save and world.is_coordinator:
            # Rank 0 makes room before it joins the save; no rank writes before rank 0 joins.
            try:
                self.retention.apply(making_room_for=step)
            except Exception as e:
                logger.warning("retention before saving step %d under %s failed: %s", step, self.steps.root, e)
        if self.retention_before_save:
            # The ranks of a steady-state save do not wait for each other before writing: this
            # one small all-reduce keeps them from filling the disk rank 0 is making room on.
            dist.all_true(world, True, f"making room for step {step} under {self.steps.root}")
        then = lambda: self.after_commit(step, world)  # noqa: E731
        return self.run(step, url, state, store, in_background, then, t0, waited, dedup=self.shared is not None)

    def run(
        self,
        step: int,
        path: str,
        state: object,
        store: Storage,
        in_background: bool,
        then: Callable[[], None],
        t0: float,
        waited: float,
        *,
        dedup: bool = False,
    ) -> SaveResult | PendingSave:
        """Save ``state`` to ``path`` through ``store``, then call ``then()`` once it is committed.

        Retention spares ``step`` until the save is over, and ``store`` is released either way.
        Synchronous, or (``in_background``) the save runs as ``async_save`` and ``then`` in the
        manager's thread; errors of either reach the returned PendingSave. With ``dedup`` the
        save references unchanged tiles in the root's shared tile directory.
        """
        self.retention.hold(step)
        shared = self.shared.for_save() if dedup and self.shared is not None else None
        request = SaveRequest(
            path,
            state,
            self.process_group,
            store,
            self.allow_pickle,
            self.save_options,
            background=in_background,
            dedup=shared,
        )
        if not in_background:
            try:
                try:
                    result = start_save(request).wait()
                except BaseException:
                    self._failed(shared)
                    raise
                then()
            finally:
                self._forget(step, store)
            return result
        try:
            inner = start_save(request)
        except BaseException:
            self._failed(shared)
            self._forget(step, store)
            raise

        def finish(future: Future[SaveResult]) -> None:
            try:
                result = inner.wait()
                then()
            except BaseException as e:
                self._failed(shared)
                future.set_exception(self.saves.explain(e, step, self.steps.root))
                return
            finally:
                self._forget(step, store)
            future.set_result(result)

        return self.saves.start(inner, finish, path=path, t0=t0, waited=waited)

    def _failed(self, shared: Dedup | None) -> None:
        """A dedup save failed (on every rank): the next one writes every tile, since what it
        would reference may be why this one failed (shared files removed by hand)."""
        if shared is not None and self.shared is not None:
            self.shared.start_over()

    def _forget(self, step: int, store: Storage) -> None:
        """``step`` is no longer being saved (retention may delete it); release its backend."""
        self.retention.release(step)
        try:
            close_store(store)
        except Exception as e:
            logger.warning("closing the storage of %s failed: %s", self.steps.url(step), e)

    def after_commit(self, step: int, world: dist.World) -> None:
        """Rank 0, after ``step`` committed under ``root``: move ``latest``, then apply retention.

        Failures here are logged, not raised: the step is committed whatever happens next.
        """
        if not world.is_coordinator:
            return
        root = self.steps.root
        try:
            found = self.steps.scan()
        except Exception as e:
            logger.warning("step %d: not moving %s/%s nor applying retention: %s", step, root, LATEST_NAME, e)
            return
        try:
            if step >= max((s for s, c in found.items() if c), default=step):
                self.steps.point_at(step)
        except Exception as e:
            logger.warning("step %d is committed but moving %s/%s failed: %s", step, root, LATEST_NAME, e)
        try:
            self.retention.retain(step, found)
        except Exception as e:
            logger.warning("retention under %s failed after step %d: %s", root, step, e)
        self.collect_shared()

    def apply_retention(self, making_room_for: int | None) -> list[int]:
        """:meth:`CheckpointManager.apply_retention`: retention, then collection of shared tiles."""
        deleted = self.retention.apply(making_room_for=making_room_for)
        self.collect_shared()
        return deleted

    def close(self) -> None:
        """Release the shared tile directory's backend (if any)."""
        if self.shared is not None:
            self.shared.close()

    def collect_shared(self) -> None:
        """Rank 0, after retention: remove the shared tiles no step uses any more (logged, never raised)."""
        if self.shared is None:
            return
        try:
            self.shared.collect()
        except Exception as e:
            logger.warning("collecting shared tiles under %s failed: %s", self.steps.root, e)
