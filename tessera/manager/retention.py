"""Retention: which steps a manager root keeps, and deleting the others safely.

:class:`Retention` owns the policy (``keep_last``, ``keep_every``) and the steps being saved
right now, which it never deletes. Only rank 0 applies it. The choice (:func:`doomed_steps`)
is a pure function of the listing; deleting goes through
:meth:`~tessera.manager.steps.StepDirectory.delete`, manifest first.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from .steps import StepDirectory

__all__ = ["Retention", "doomed_steps"]

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
        found: every step directory, ``{step: committed}`` (see :meth:`StepDirectory.scan`).
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


class Retention:
    """The retention policy of one manager root, and the saves it must spare.

    Thread-safety: :meth:`hold` and :meth:`release` may be called from the caller's thread
    while retention runs in the manager's background thread (a lock guards the held steps).

    Args:
        steps: the root whose steps are deleted.
        keep_last: keep at most this many of the newest committed steps (None: all).
        keep_every: also keep every step divisible by this (None: no such rule).
    """

    def __init__(self, steps: StepDirectory, *, keep_last: int | None, keep_every: int | None) -> None:
        self.steps = steps
        self.keep_last = keep_last
        self.keep_every = keep_every
        self._held: set[int] = set()
        self._lock = threading.Lock()

    def hold(self, step: int) -> None:
        """``step`` is being saved: never delete it until :meth:`release`."""
        with self._lock:
            self._held.add(step)

    def release(self, step: int) -> None:
        """``step``'s save is over (committed or not): retention may delete it again."""
        with self._lock:
            self._held.discard(step)

    def apply(self, *, making_room_for: int | None = None) -> list[int]:
        """:meth:`CheckpointManager.apply_retention`: list the root, then delete what is not kept.

        Args:
            making_room_for: a step about to be saved (one of the ``keep_last`` places stays free).

        Returns:
            the steps deleted, oldest first.
        """
        found = self.steps.scan()
        committed = sorted(s for s, c in found.items() if c)
        if making_room_for is None:
            if not committed:
                return []
            return self.retain(committed[-1], found)
        keep_last = None if self.keep_last is None else max(1, self.keep_last - 1)
        newest = committed[-1] if committed else None
        return self._delete_unkept(newest, found, keep_last, frozenset({making_room_for}))

    def retain(self, committed_step: int, found: dict[int, bool]) -> list[int]:
        """After ``committed_step`` committed: delete what the policy does not keep of ``found``.

        Args:
            committed_step: the step just committed.
            found: the listing, ``{step: committed}``.

        Returns:
            the steps deleted, oldest first.
        """
        return self._delete_unkept(committed_step, found, self.keep_last, frozenset())

    def _delete_unkept(
        self, committed_step: int | None, found: dict[int, bool], keep_last: int | None, also_keep: frozenset[int]
    ) -> list[int]:
        with self._lock:
            keep = set(self._held)
        doomed = doomed_steps(
            found,
            committed_step=committed_step,
            keep_last=keep_last,
            keep_every=self.keep_every,
            keep=keep | set(also_keep),
            pointer=self.steps.pointer(),
        )
        for s in doomed:
            self.steps.delete(s)
        return doomed
