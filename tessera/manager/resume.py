"""Resuming: which step a manager loads, falling back past incomplete or corrupt steps.

:class:`StepLoader` chooses and loads the step. Rank 0 lists the steps and every rank tries the same ones, newest first; a step is skipped
only for a failure that says the checkpoint is unusable (the same decision on every rank).
With a local tier, the tier's recovery (own node, then peers) is tried first.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Any

from .. import api
from ..engine import dist
from ..engine.loading.path_report import examine_path
from ..errors import CheckpointError, CheckpointNotFoundError, StorageError
from ..results import LoadResult
from . import identity
from .local_tier import LocalTier
from .local_tier.recovery import is_unusable
from .steps import StepDirectory, close_store

__all__ = ["StepLoadResult", "StepLoader", "is_skippable"]

logger = logging.getLogger(__name__)

# Warnings name the line that called CheckpointManager.load: from a method that
# StepLoader.load calls, that is 4 frames up (method, StepLoader.load, CheckpointManager.load).
_STACKLEVEL = 4


@dataclass(frozen=True)
class StepLoadResult:
    """What :meth:`CheckpointManager.load` loaded.

    Attributes:
        step: the step that was loaded.
        result: the :class:`~tessera.LoadResult` of loading it.
        skipped: newer steps that were passed over, with the reason (incomplete or corrupt).
        source: where the bytes came from, job-wide: ``"local"`` (every node already held
            all the files it needed in its local tier), ``"peers"`` (some nodes fetched
            files from other nodes' local tiers first) or ``"durable"`` (the durable root).
        peer_bytes: bytes this rank received from peers before loading (``"peers"`` only).
    """

    step: int
    result: LoadResult
    skipped: dict[int, str] = field(default_factory=dict)
    source: str = "durable"
    peer_bytes: int = 0


class StepLoader:
    """Chooses the step a manager loads and loads it; every method is collective.

    Args:
        steps: the durable root.
        tier: the node-local tier, tried first (None: no local tier).
        local_dir: the local tier's directory as given (named in messages).
    """

    def __init__(self, steps: StepDirectory, tier: LocalTier | None, local_dir: str | None) -> None:
        self.steps = steps
        self.tier = tier
        self.local_dir = local_dir

    def load(self, state: object, step: int | None, world: dist.World, kwargs: dict[str, Any]) -> StepLoadResult:
        """:meth:`CheckpointManager.load` once its arguments are checked: the local tier's
        recovery first (if any), then ``step`` under ``root``, or the newest step that loads.

        Args:
            state: the structure to fill.
            step: a specific step (no fallback), or None for the newest valid one.
            world: the process group's view of this rank.
            kwargs: the keyword arguments of :func:`tessera.load`.
        """
        if self.tier is not None:
            recovered = self._recover(self.tier, state, world, kwargs, step)
            if recovered is not None:
                return recovered
        if step is not None:
            return StepLoadResult(step, self.load_step(step, state, kwargs), {})
        return self._load_newest(state, world, kwargs)

    def load_step(self, step: int, state: object, kwargs: dict[str, Any]) -> LoadResult:
        """Load ``step`` under ``root`` into ``state`` (no fallback); collective."""
        url = self.steps.url(step)
        store = self.steps.factory(url)
        try:
            return api.load(url, state, storage=store, **kwargs)
        finally:
            close_store(store)

    def _load_newest(self, state: object, world: dist.World, kwargs: dict[str, Any]) -> StepLoadResult:
        """Load the newest committed step under ``root`` that loads cleanly; collective.

        Raises:
            CheckpointNotFoundError: if no step loads (every reason is listed).
            CheckpointError: what loading failed with, for errors that are not skipped.
        """
        root = self.steps.root
        listing: tuple[list[tuple[int, bool]] | None, Any] = (None, None)
        own: BaseException | None = None
        if world.is_coordinator:
            try:
                listing = (sorted(self.steps.scan().items(), reverse=True), None)
            except Exception as e:
                own = e
                listing = (None, dist.error_text(0, e))
        candidates, error = dist.broadcast(world, listing, "listing checkpoint steps")
        if error is not None:  # rank 0's failure record, untouched
            if own is not None and not world.distributed:
                if isinstance(own, CheckpointError):
                    raise own
                raise StorageError(f"listing the steps under {root} failed: {type(own).__name__}: {own}") from own
            dist.raise_failures(world, {0: error}, f"listing the steps under {root}")
        if candidates is None:
            raise CheckpointError(f"listing {root} failed")
        skipped: dict[int, str] = {}
        for s, committed in candidates:
            if not committed:
                self._skip(world, s, skipped, "incomplete: no manifest.json (its save never finished)")
                continue
            try:
                result = self.load_step(s, state, kwargs)
            except CheckpointError as e:
                if not is_skippable(e):
                    raise
                self._skip(world, s, skipped, f"corrupt or unreadable: {e}")
                continue
            return StepLoadResult(s, result, skipped)
        detail = "".join(f"\n  step {s}: {why}" for s, why in skipped.items())
        local = ""
        if self.tier is not None:
            local = "\n" + (self.tier.last_report or f"the local tier at {self.local_dir} was not used")
        raise CheckpointNotFoundError(
            f"no loadable checkpoint under {root}"
            + (f":{detail}" if detail else f" (no steps): {_what_is_at(root)}")
            + local
        )

    def _recover(
        self, tier: LocalTier, state: object, world: dist.World, kwargs: dict[str, Any], step: int | None
    ) -> StepLoadResult | None:
        """The local tier's recovery (own node, then peers), or None to fall back to ``root``."""
        root = self.steps.root
        identity.establish(tier, self.steps, world, create=False)
        if tier.root_id is None:  # the root has no identity: no local step is this run's
            tier.last_report = f"the local tier at {self.local_dir}: no step of this root ({root} has no root id)"
            return None
        newest_durable = None
        if step is None:
            # A durable step newer than anything local (say local saves failed for a while) wins:
            # the newest step that can be assembled from anything that survives. Rank 0 lists.
            listed: int | None = None
            if world.is_coordinator:
                try:
                    listed = max((s for s, c in self.steps.scan().items() if c), default=None)
                except Exception as e:  # the local tier may not need it; the durable path reports it
                    logger.warning("listing %s before recovering from the local tier failed: %s", root, e)
            newest_durable = dist.broadcast(world, listed, "listing the durable steps")
        try:
            got = tier.recover(state, world, kwargs, only_step=step, at_least=newest_durable)
        except CheckpointError as e:
            if not is_skippable(e) and not isinstance(e, StorageError):
                raise
            message = f"the local tier at {self.local_dir} could not be used, falling back to {root}: {e}"
            tier.last_report = message
            if world.is_coordinator:  # job-wide news: said once, by rank 0
                warnings.warn(message, RuntimeWarning, stacklevel=_STACKLEVEL)
            logger.debug("%s", message)
            return None
        if got is None:
            return None
        return StepLoadResult(got.step, got.result, {}, source=got.source, peer_bytes=got.peer_bytes)

    def _skip(self, world: dist.World, step: int, skipped: dict[int, str], why: str) -> None:
        skipped[step] = why
        message = f"skipping checkpoint step {step} under {self.steps.root}: {why}"
        if world.is_coordinator:  # job-wide news: said once, by rank 0
            warnings.warn(message, RuntimeWarning, stacklevel=_STACKLEVEL + 1)  # via _load_newest
        else:
            logger.debug("%s", message)


def _what_is_at(root: str) -> str:
    """The diagnosis of a root without steps (:mod:`tessera.engine.loading.path_report`), as every load gives it."""
    try:
        return examine_path(root).message()
    except Exception as e:  # a courtesy: never hide the error itself
        logger.debug("examining %s failed: %s", root, e)
        return "no steps"


def is_skippable(e: BaseException) -> bool:
    """Whether a load failed because the checkpoint is unusable, identically on every rank.

    A peer's failure arrives as a DistributedError carrying ``"TypeName: message"`` texts; a
    rank's own failure is the exception itself. Either way the decision depends only on
    the failures every rank was told about, so all ranks skip or raise together.
    """
    return is_unusable(e)
