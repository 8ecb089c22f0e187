"""The run's timeline: which local steps a job may still load after rollbacks and resumes.

A job's saves form a timeline. It forks whenever the job goes on from an older point: a
restart that resumes from step ``b`` (whatever newer steps some absent node still holds), an
explicit ``load(step=b)``, or a save whose step is not newer than the previous one. Each fork
opens a new *epoch* and is recorded as ``(epoch, base)``: from epoch ``epoch`` on, the job's
steps follow step ``base``, and every step newer than ``base`` saved in an earlier epoch is
abandoned. Within one epoch steps only increase.

The record lives in the durable root (:data:`TIMELINE_NAME`), written by rank 0 before any
step of the new epoch is committed anywhere, and every local commit marker records the epoch
its step was saved in. So a node that missed a fork (it was away, or its process died before
it heard) still holds markers of the old epoch, and :meth:`Timeline.admits` refuses them,
whichever node asks.

The rule, exactly: a local step ``s`` committed in epoch ``e`` is on the timeline if and
only if ``e <= epoch`` and ``s <= base`` for every recorded fork ``(e', base)`` with
``e' > e``. Two admitted steps never share a step number (an epoch's steps are all newer
than its base), so the newest admitted step is the job's last committed save.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ...errors import StorageError
from ...storage import Storage

__all__ = ["MAX_FORKS", "TIMELINE_NAME", "Timeline", "read_timeline", "write_timeline"]

TIMELINE_NAME = ".tessera-timeline"
"""The file under a durable root holding its timeline (JSON, rewritten atomically at each fork)."""

MAX_FORKS = 256
"""Forks kept in the record. Older ones are folded into :attr:`Timeline.floor`: the steps of
epochs below it are refused (they are at least this many resumes old)."""


@dataclass(frozen=True)
class Timeline:
    """The forks of a run's timeline.

    Attributes:
        epoch: the current epoch (0: no fork recorded yet; markers written before epochs
            existed count as epoch 0).
        forks: ``(epoch, base)`` of the forks that still matter, oldest first, with increasing
            bases (a fork whose base is not below every later one's changes nothing and is dropped).
        floor: epochs below this are refused entirely (their forks were dropped, see :data:`MAX_FORKS`).

    Example:
        >>> t = Timeline().fork(5).fork(3)  # saved up to 5 (or more), resumed from 3
        >>> t.admits(3, epoch=0), t.admits(4, epoch=0), t.admits(4, epoch=2)
        (True, False, True)
    """

    epoch: int = 0
    forks: tuple[tuple[int, int], ...] = ()
    floor: int = 0

    def cutoff(self, epoch: int) -> int | None:
        """The newest step of ``epoch`` still on the timeline (None: no limit)."""
        later = [base for e, base in self.forks if e > epoch]
        return min(later) if later else None

    def admits(self, step: int, *, epoch: int) -> bool:
        """Whether the local step ``step`` committed in ``epoch`` is on the timeline."""
        if epoch > self.epoch or epoch < self.floor:
            return False
        cut = self.cutoff(epoch)
        return cut is None or step <= cut

    def why_not(self, step: int, *, epoch: int) -> str:
        """Why :meth:`admits` refuses ``step`` of ``epoch`` (for messages)."""
        if epoch > self.epoch:
            return f"its epoch {epoch} is newer than the root's timeline (epoch {self.epoch}): the root was replaced"
        if epoch < self.floor:
            return f"its epoch {epoch} is older than the timeline keeps (epoch {self.floor})"
        return f"saved in epoch {epoch}, after which the job went on from step {self.cutoff(epoch)}"

    def fork(self, base: int) -> Timeline:
        """The timeline after the job goes on from step ``base`` (-1: from nothing) in a new epoch."""
        epoch = self.epoch + 1
        forks = [(e, b) for e, b in self.forks if b < base] + [(epoch, base)]
        floor = self.floor
        if len(forks) > MAX_FORKS:
            floor = forks[-MAX_FORKS - 1][0]
            forks = forks[-MAX_FORKS:]
        return Timeline(epoch, tuple(forks), floor)

    def encode(self) -> bytes:
        """The record's bytes."""
        doc = {"format": 1, "epoch": self.epoch, "floor": self.floor, "forks": [list(f) for f in self.forks]}
        return json.dumps(doc, separators=(",", ":")).encode() + b"\n"

    @staticmethod
    def decode(data: bytes, source: str = TIMELINE_NAME) -> Timeline:
        """Parse a record.

        Raises:
            StorageError: it is not a timeline record.
        """
        try:
            doc = json.loads(data)
            forks = tuple((int(e), int(b)) for e, b in doc["forks"])
            t = Timeline(int(doc["epoch"]), forks, int(doc.get("floor", 0)))
        except (ValueError, TypeError, KeyError) as e:
            raise StorageError(
                f"{source} holds {data[:80]!r}, not a timeline record ({e}); delete it only if no local-tier step "
                "of this root must be recovered"
            ) from e
        if any(e > t.epoch for e, _ in forks):
            raise StorageError(f"{source}: a fork is newer than its epoch {t.epoch}: {data[:200]!r}")
        return t


def read_timeline(store: Storage) -> Timeline:
    """The timeline under ``store``'s root (no record: no fork yet). Not collective.

    Raises:
        StorageError: the record exists but cannot be read or parsed.
    """
    try:
        data = store.read_file(TIMELINE_NAME)
    except FileNotFoundError:
        return Timeline()
    return Timeline.decode(data, f"{store.url}/{TIMELINE_NAME}")


def write_timeline(store: Storage, timeline: Timeline) -> None:
    """Replace the record under ``store``'s root atomically (rank 0). Not collective."""
    store.write_atomic(TIMELINE_NAME, timeline.encode())
