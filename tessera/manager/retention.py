"""Retention: which steps a manager root keeps, and deleting the others safely.

Only rank 0 applies retention. The choice (:func:`doomed_steps`) is a pure function of the
listing; :func:`delete_step` un-commits a step before deleting its data, so that a deletion
cut short leaves an incomplete step (skipped by loads), never a corrupt "committed" one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from ..manifest import MANIFEST_NAME
from ..step_names import step_dirname
from ..storage import Storage
from ..storage.base import OWNER_MARKER_DIR
from ..storage.capabilities import Uncommits, Versioned

__all__ = ["delete_step", "doomed_steps"]

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
