"""The identity of a durable root, which decides which local-tier steps belong to a run.

A manager with a local tier writes a random *root id* into its durable root when it first
saves there (:data:`ROOT_ID_NAME`, written once, never rewritten) and records it in the
commit marker of every local step. A local step is the run's only if its marker names both
the root and that id: the leftovers of a run whose root was deleted (``rm -rf <root>``) or
replaced carry another id, or the root has none, and are never loaded; they are removed,
with one warning from rank 0, when the manager first uses the root. The root *string* alone
proves nothing: a ``tier::`` root's host-memory directory is derived from it, and outlives
the root.
"""

from __future__ import annotations

import logging
import uuid
import warnings

from ..engine import dist
from ..errors import StorageError
from ..storage import Storage
from .local_tier import LocalTier
from .steps import StepDirectory

__all__ = ["ROOT_ID_NAME", "establish", "read_root_id"]

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
    """Collective: learn the id of the durable root ``steps`` (rank 0 reads it, creating it if
    ``create``) and give it to ``tier``, then remove the local steps another id left (rank 0
    says so once, job-wide).

    A no-op once the id is known. Without an id (a load before the first save, or of a
    deleted root) no local step is the run's, and every step of this root in the local tier
    is stale.

    Raises:
        StorageError: on every rank, if rank 0 cannot read (or, saving, create) the id.
    """
    if tier.root_id is not None:
        return
    payload: tuple[str | None, str | None] = (None, None)
    if world.is_coordinator:
        try:
            payload = ((_create_root_id if create else read_root_id)(steps.store), None)
        except Exception as e:
            payload = (None, f"{type(e).__name__}: {e}")
    root_id, error = dist.broadcast(world, payload, "reading the checkpoint root's identity")
    if error is not None:
        raise StorageError(
            f"rank {world.rank}: cannot {'create' if create else 'read'} {steps.root}/{ROOT_ID_NAME}, the identity "
            f"that says which local-tier steps belong to this root: {error}"
        )
    tier.root_id = root_id
    placement = tier.placement(world)
    leader = placement.leader(placement.node_of[world.rank]) == world.rank
    # Gone before any rank of the node writes a step that may reuse a stale step's name.
    stale = tier.remove_stale(world) if leader else []
    found = dist.all_gather(world, stale, "removing stale local-tier steps")
    if world.is_coordinator and any(found):
        where = "; ".join(
            f"node {placement.node_of[r]}: steps {', '.join(map(str, s))}" for r, s in enumerate(found) if s
        )
        why = "it has no root id (deleted, or not saved to yet)" if root_id is None else f"its root id is {root_id}"
        warnings.warn(
            f"the local tier at {tier.local_dir} held steps of {steps.root} written under another root id (a "
            f"deleted root's or an earlier run's; {why}); they are never loaded and were removed: {where}",
            RuntimeWarning,
            stacklevel=4,
        )
