"""The identity of a durable root and its timeline, which decide which local-tier steps a run loads.

A manager with a local tier writes a random *root id* into its durable root when it first
saves there (:data:`ROOT_ID_NAME`, written once, never rewritten) and records it in the
commit marker of every local step. A local step is the run's only if its marker names both
the root and that id: the leftovers of a run whose root was deleted (``rm -rf <root>``) or
replaced carry another id, or the root has none, and are never loaded; they are removed,
with one warning from rank 0, when the manager first uses the root. The root *string* alone
proves nothing: a ``tier::`` root's host-memory directory is derived from it, and outlives
the root.

The root also holds the run's timeline (:mod:`tessera.manager.local_tier.timeline`): each
resume or rollback that a save follows opens a new epoch (:func:`begin_epoch`), and a local
step of an epoch the job left behind, held by a node that missed the fork, is never loaded.
"""

from __future__ import annotations

import logging
import uuid
import warnings

from ..engine import dist
from ..errors import StorageError
from ..storage import Storage
from .local_tier import LocalTier
from .local_tier.timeline import TIMELINE_NAME, Timeline, read_timeline, write_timeline
from .steps import StepDirectory

__all__ = ["ROOT_ID_NAME", "begin_epoch", "establish", "read_root_id"]

logger = logging.getLogger(__name__)

ROOT_ID_NAME = ".tessera-root-id"
"""The file under a durable root holding its identity: one line, 32 hex digits."""


def read_root_id(store: Storage) -> str | None:
    """The root id under ``store``'s root, or None if it has none (deleted, or never saved to
    by a manager with a local tier). Not collective.

    Raises:
        StorageError: the file exists but cannot be read or is not a root id.
    """
    try:
        text = store.read_file(ROOT_ID_NAME)
    except FileNotFoundError:
        return None
    value = text.decode("utf-8", "replace").strip()
    if len(value) != 32 or any(c not in "0123456789abcdef" for c in value):
        raise StorageError(
            f"{ROOT_ID_NAME} under the checkpoint root holds {text[:80]!r}, not a root id; "
            "delete it only if no local-tier step of this root must be recovered"
        )
    return value


def _create_root_id(store: Storage) -> str:
    """Write a fresh root id unless one exists; the id the root has afterwards."""
    existing = read_root_id(store)
    if existing is not None:
        return existing
    store.write_atomic(ROOT_ID_NAME, (uuid.uuid4().hex + "\n").encode())
    # Read back: were two first saves racing, both adopt the one that stayed.
    value = read_root_id(store)
    if value is None:
        raise StorageError(f"{ROOT_ID_NAME} vanished right after it was written")
    return value


def establish(tier: LocalTier, steps: StepDirectory, world: dist.World, *, create: bool) -> None:
    """Collective: learn the id and the timeline of the durable root ``steps`` (rank 0 reads
    them, creating the id if ``create``) and give them to ``tier``, then remove the local steps
    that are never to be loaded, another id's or an abandoned timeline's (rank 0 says so once,
    job-wide).

    A no-op once the id is known. Without an id (a load before the first save, or of a
    deleted root) no local step is the run's, and every step of this root in the local tier
    is stale.

    Raises:
        StorageError: on every rank, if rank 0 cannot read (or, saving, create) the id or read
            the timeline.
    """
    if tier.root_id is not None:
        return
    payload: tuple[str | None, Timeline, str | None] = (None, Timeline(), None)
    if world.is_coordinator:
        try:
            root_id = (_create_root_id if create else read_root_id)(steps.store)
            payload = (root_id, read_timeline(steps.store), None)
        except Exception as e:
            payload = (None, Timeline(), f"{type(e).__name__}: {e}")
    root_id, timeline, error = dist.broadcast(world, payload, "reading the checkpoint root's identity")
    if error is not None:
        raise StorageError(
            f"rank {world.rank}: cannot {'create' if create else 'read'} {steps.root}/{ROOT_ID_NAME} and "
            f"{TIMELINE_NAME}, the identity that says which local-tier steps belong to this root: {error}"
        )
    tier.root_id, tier.timeline = root_id, timeline
    _remove_refused(tier, steps, world)


def begin_epoch(tier: LocalTier, steps: StepDirectory, world: dist.World, base: int) -> None:
    """Collective, before the first save of a new epoch: the job goes on from step ``base``
    (the step it loaded, or the one before the step it saves), and every newer step saved so
    far is abandoned, on every node and under ``root``.

    In this order, so that a crash at any point leaves no abandoned step loadable: rank 0
    deletes the durable steps newer than ``base`` (manifest first) and points ``latest`` at
    the newest one left; then it records the fork in the root's timeline; then every node
    removes its local steps the new timeline refuses (those of nodes absent now are refused
    by every later recovery, wherever they turn up). No step of the new epoch is committed
    before this returns.

    Raises:
        StorageError: on every rank, if rank 0 could not delete the newer durable steps or
            record the fork (nothing of the new epoch is written then).
    """
    payload: tuple[Timeline | None, str | None] = (None, None)
    if world.is_coordinator:
        try:
            _delete_durable_after(steps, base)
            forked = read_timeline(steps.store).fork(base)
            write_timeline(steps.store, forked)
            payload = (forked, None)
        except Exception as e:
            payload = (None, f"{type(e).__name__}: {e}")
    timeline, error = dist.broadcast(world, payload, "recording the timeline's fork")
    if error is not None or timeline is None:
        raise StorageError(
            f"rank {world.rank}: cannot record in {steps.root}/{TIMELINE_NAME} that the job goes on from step {base} "
            f"(needed before the local tier commits a step after a resume or a rollback): {error}"
        )
    tier.timeline = timeline
    logger.debug("%s: timeline epoch %d goes on from step %d", steps.root, timeline.epoch, base)
    _remove_refused(tier, steps, world)


def _delete_durable_after(steps: StepDirectory, base: int) -> None:
    """Rank 0: delete the durable steps newer than ``base`` (manifest first) and point ``latest``
    at the newest committed step left (or remove it)."""
    found = steps.scan()
    newer = sorted(s for s in found if s > base)
    for s in newer:
        steps.delete(s)
    pointer = steps.pointer()
    if pointer is not None and pointer > base:
        left = max((s for s, committed in found.items() if committed and s <= base), default=None)
        if left is None:
            steps.remove_pointer()
        else:
            steps.point_at(left)
    committed = [s for s in newer if found[s]]
    if committed:
        logger.warning(
            "the job goes on from step %d: the newer steps %s under %s are of an abandoned timeline and are deleted",
            base, committed, steps.root,
        )  # fmt: skip


def _remove_refused(tier: LocalTier, steps: StepDirectory, world: dist.World) -> None:
    """Collective: node leaders delete their node's steps that are never to be loaded; rank 0
    says which, on which node, once."""
    placement = tier.placement(world)
    leader = placement.leader(placement.node_of[world.rank]) == world.rank
    # Gone before any rank of the node writes a step that may reuse a stale step's name.
    refused = tier.remove_stale(world) if leader else []
    found = dist.all_gather(world, refused, "removing stale local-tier steps")
    if not world.is_coordinator or not any(found):
        return
    node_of = placement.node_of
    stale = [
        f"node {node_of[r]}: steps {', '.join(str(s) for s, kind, _ in f if kind == 'stale')}"
        for r, f in enumerate(found)
        if any(kind == "stale" for _, kind, _ in f)
    ]
    if stale:
        root_id = tier.root_id
        why = "it has no root id (deleted, or not saved to yet)" if root_id is None else f"its root id is {root_id}"
        warnings.warn(
            f"the local tier at {tier.local_dir} held steps of {steps.root} written under another root id (a "
            f"deleted root's or an earlier run's; {why}); they are never loaded and were removed: {'; '.join(stale)}",
            RuntimeWarning,
            stacklevel=5,
        )
    timeline = tier.timeline or Timeline()
    abandoned = [
        f"step {s} on node {node_of[r]} ({timeline.why_not(s, epoch=epoch)})"
        for r, f in enumerate(found)
        for s, kind, epoch in f
        if kind == "abandoned"
    ]
    if abandoned:
        warnings.warn(
            f"the local tier at {tier.local_dir} held steps of an abandoned timeline of {steps.root} (a node that "
            f"missed a rollback or a resume); they are never loaded and were removed: {'; '.join(abandoned)}",
            RuntimeWarning,
            stacklevel=5,
        )
        logger.warning("local tier at %s: removed the abandoned steps: %s", tier.local_dir, "; ".join(abandoned))
