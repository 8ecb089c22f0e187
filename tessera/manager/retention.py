"""Retention: which steps a manager root keeps, and deleting the others safely.

Only rank 0 applies retention. The choice (:func:`doomed_steps`) is a pure function of the
listing; :func:`delete_step` un-commits a step before deleting its data, so that a deletion
cut short leaves an incomplete step (skipped by loads), never a corrupt "committed" one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..format.manifest import MANIFEST_NAME
from ..format.names import OWNER_MARKER_DIR, step_dirname
from ..storage import Storage
from ..storage.capabilities import Uncommits, Versioned

if TYPE_CHECKING:
    from .core import CheckpointManager

__all__ = ["apply_retention", "delete_step", "doomed_steps", "retain"]

logger = logging.getLogger(__name__)


def doomed_steps(
    found: dict[int, bool],
    *,
    committed_step: int | None,
    keep_last: int | None,
    keep_every: int | None,
    keep: Iterable[int] = (),
    pointer: int | None = None,
) -> list[int]:
    """The steps retention deletes, oldest first.

    Args:
        found: every step directory, ``{step: committed}`` (see :func:`~tessera.manager.steps.scan_steps`).
        committed_step: the step just committed (kept; uncommitted leftovers older than it go).
        keep_last: keep this many of the newest committed steps (None: all).
        keep_every: also keep every committed step divisible by this (None: no such rule).
        keep: steps kept whatever the rules say (saves in flight, a step being made room for).
        pointer: the step ``latest`` names (kept).

    Returns:
        the committed steps the rules do not keep, and the leftovers of saves that never
        committed older than ``committed_step``; the newest committed step is always kept.
    """
    committed = sorted(s for s, c in found.items() if c)
    kept = set(committed) if keep_last is None else set(committed[-keep_last:])
    if keep_every is not None:
        kept |= {s for s in committed if s % keep_every == 0}
    kept |= set(keep)
    if committed_step is not None:
        kept.add(committed_step)
    if committed:
        kept.add(committed[-1])  # the last good checkpoint survives anything
    if pointer is not None:
        kept.add(pointer)
    doomed = [s for s in committed if s not in kept]
    # Leftovers of saves that never committed (a crash); newer ones are left alone,
    # since nothing says their save is over.
    newest = committed_step if committed_step is not None else -1
    doomed += [s for s, c in found.items() if not c and s < newest and s not in kept]
    return sorted(doomed)


def delete_step(store: Storage, root: str, step: int) -> None:
    """Delete ``step``'s directory under ``store``: its manifest first, then its data.

    On a fenced backend (:class:`~tessera.storage.capabilities.Uncommits` and
    :class:`~tessera.storage.capabilities.Versioned`) the manifest is withdrawn under the
    step's commit lock, and only if no save committed the step meanwhile (then nothing is
    deleted); the owner markers go with it, so that a save still writing into this step
    (another job's) can no longer publish over the files deleted next.
    """
    name = step_dirname(step)
    manifest = f"{name}/{MANIFEST_NAME}"
    fenced = isinstance(store, Uncommits) and isinstance(store, Versioned)
    expected = store.version(manifest) if fenced and isinstance(store, Versioned) else None
    files = store.list(name)  # relative to root: "step-.../data/..."
    # Un-commit first: a deletion cut short must not leave a "committed" step without data.
    if fenced and isinstance(store, Uncommits):
        markers = [f for f in files if f.startswith(f"{name}/{OWNER_MARKER_DIR}/")]
        if not store.uncommit(manifest, expected, markers):
            logger.info("not deleting step %d under %s: a save committed it meanwhile", step, root)
            return
    else:
        store.delete([manifest])
    store.delete([f for f in files if f != manifest])
    logger.info("deleted step %d under %s (%d files)", step, root, len(files))


def apply_retention(manager: CheckpointManager, *, making_room_for: int | None = None) -> list[int]:
    """:meth:`CheckpointManager.apply_retention`: list ``root``, then :func:`retain`.

    Args:
        manager: the manager whose root is trimmed.
        making_room_for: a step about to be saved (one of the ``keep_last`` places stays free).

    Returns:
        the steps deleted, oldest first.
    """
    found = manager._scan()
    committed = sorted(s for s, c in found.items() if c)
    if making_room_for is None:
        if not committed:
            return []
        return retain(manager, committed[-1], found, keep_last=manager.keep_last)
    keep_last = None if manager.keep_last is None else max(1, manager.keep_last - 1)
    newest = committed[-1] if committed else None
    return retain(manager, newest, found, keep_last=keep_last, also_keep=frozenset({making_room_for}))


def retain(
    manager: CheckpointManager,
    committed_step: int | None,
    found: dict[int, bool],
    *,
    keep_last: int | None,
    also_keep: frozenset[int] = frozenset(),
) -> list[int]:
    """Delete what retention does not keep of ``found``, sparing the manager's saves in flight.

    Args:
        manager: the manager (its rules, saves in flight, root backend and ``latest``).
        committed_step: the step just committed, or None.
        found: the listing, ``{step: committed}``.
        keep_last: the ``keep_last`` rule to apply (the manager's, or one less to make room).
        also_keep: further steps to keep.

    Returns:
        the steps deleted, oldest first.
    """
    with manager._lock:
        keep = set(manager._in_flight)
    doomed = doomed_steps(
        found,
        committed_step=committed_step,
        keep_last=keep_last,
        keep_every=manager.keep_every,
        keep=keep | set(also_keep),
        pointer=manager.pointer_step(),
    )
    for s in doomed:
        delete_step(manager._root_store, manager.root, s)
    return doomed
