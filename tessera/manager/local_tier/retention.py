"""Deleting a node's local steps: retention after a commit, room made before a save, stale
steps of another root id or of an abandoned timeline, and removing a root's steps for good.

Which steps are the run's is decided by their commit markers
(:func:`~tessera.manager.local_tier.inventory.owner_of`). A step is un-committed (its marker removed)
before its data goes, so a deletion cut short leaves an uncommitted step, never a "committed"
one without data. Everything here is local to one node (no communication); only a node's
leader calls it.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading

from ...format.names import step_dirname
from ...storage.host_memory import prune_empty_parents
from .files import remove_quietly
from .inventory import MARKER_NAME, local_steps, marker_epoch, owner_of, read_marker
from .timeline import Timeline

logger = logging.getLogger(__name__)


class LocalRetention:
    """The deletions of one manager's local tier on one node; owns the background deleter.

    Args:
        root: the durable root (markers naming another root are never touched).
        keep_last: committed local steps kept.
    """

    def __init__(self, root: str, keep_last: int) -> None:
        self.root = root
        self.keep_last = keep_last
        self._deleter: threading.Thread | None = None
        self._warned_room = False

    def apply(self, directory: str, root_id: str | None, timeline: Timeline | None, newest: int) -> list[int]:
        """Delete the run's committed steps beyond the newest ``keep_last`` (never ``newest``,
        the step just committed), uncommitted leftovers older than ``newest``, and stale or
        abandoned steps (:meth:`stale`); returns the steps deleted."""
        committed: list[int] = []
        doomed: list[int] = []
        for step, step_dir in local_steps(directory):
            owner = owner_of(read_marker(step_dir), self.root, root_id, timeline)
            if owner == "ours":
                committed.append(step)
            elif owner in ("stale", "abandoned") or (owner == "none" and step < newest):
                doomed.append(step)
            # else: another root's step (a shared local_dir): not ours to count or delete
        kept = [s for s in committed if s <= newest][-self.keep_last :]
        doomed += [s for s in committed if s not in kept and s != newest]
        self.delete(directory, doomed)
        return sorted(set(doomed))

    def stale(self, directory: str, root_id: str | None, timeline: Timeline | None) -> list[tuple[int, str, int]]:
        """The steps never to be loaded: ``(step, kind, epoch)`` with kind ``"stale"`` (the marker
        names this root under another root id, or none: a deleted root's or an earlier run's) or
        ``"abandoned"`` (this run's, but ``timeline`` refuses its epoch: a node that missed a
        rollback or a resume)."""
        out = []
        for s, d in local_steps(directory):
            doc = read_marker(d)
            owner = owner_of(doc, self.root, root_id, timeline)
            if owner in ("stale", "abandoned") and doc is not None:
                out.append((s, owner, marker_epoch(doc)))
        return out

    def make_room(self, directory: str, root_id: str | None, timeline: Timeline | None, step: int) -> list[int]:
        """Before ``step`` is saved into a node directory that cannot hold one more step: delete
        (synchronously) uncommitted leftovers, then the oldest of the run's committed steps, until
        the free space reaches the size of the newest committed step, which stays whatever
        happens; returns the steps deleted (none if there is room).

        Costs a listing of the node directory, its markers, and one ``lstat`` per file of the
        newest step (measured: 0.4 ms for 2 steps of 16 files on tmpfs), so it runs at every save."""
        entries = []
        for s, d in local_steps(directory):
            if s != step:
                entries.append((s, d, owner_of(read_marker(d), self.root, root_id, timeline)))
        committed = [(s, d) for s, d, owner in entries if owner == "ours"]
        if not committed:
            return []
        newest = committed[-1][0]
        need = _footprint(committed[-1][1])
        need += max(_SLACK, need >> 6)
        try:
            free = shutil.disk_usage(directory).free
        except OSError:
            return []
        if free >= need:
            return []
        # Leftovers first (never loadable), then committed steps oldest first, never the newest.
        leftovers = [
            (s, d) for s, d, owner in entries if owner in ("stale", "abandoned") or (owner == "none" and s < newest)
        ]
        deleted = []
        for s, d in leftovers + committed[:-1]:
            if free >= need:
                break
            size = _footprint(d)
            remove_quietly(os.path.join(d, MARKER_NAME))  # un-commit first: a cut-short delete is skipped
            shutil.rmtree(d, ignore_errors=True)
            free += size
            deleted.append(s)
        if deleted and not self._warned_room:
            self._warned_room = True
            logger.warning(
                "local tier at %s: the directory cannot hold local_keep_last=%d steps and one more being saved; "
                "older local steps are deleted before each save to make room (the newest committed one always stays)",
                directory, self.keep_last,
            )  # fmt: skip
        if deleted:
            logger.info(
                "local tier at %s: deleted the older local steps %s to make room for step %d (%d bytes free "
                "now, about %d needed; the newest committed step, %d, stays)",
                directory, sorted(deleted), step, free, need, newest,
            )  # fmt: skip
        return sorted(deleted)

    def delete(self, directory: str, steps: list[int]) -> None:
        """Delete these steps: markers at once, the data in a background thread (joined by
        :meth:`wait`, which every save and recovery calls first)."""
        dirs = [os.path.join(directory, step_dirname(s)) for s in sorted(set(steps))]
        for step_dir in dirs:
            remove_quietly(os.path.join(step_dir, MARKER_NAME))  # un-commit first: a cut-short delete is skipped
        # Freeing the data is off the save's path: a background thread, joined before the next save.
        self.wait()
        if dirs:
            self._deleter = threading.Thread(target=_remove_dirs, args=(dirs,), name="tessera-local-retention")
            self._deleter.daemon = True
            self._deleter.start()

    def wait(self) -> None:
        """Wait for the background deletion, if one runs."""
        deleter, self._deleter = self._deleter, None
        if deleter is not None:
            deleter.join()


def remove_root_steps(directory: str, root: str) -> list[int]:
    """Delete every step of ``root`` in a node directory of the local tier, committed or not
    (steps whose marker names another root stay), then the directory if it is left empty (and
    its parents left empty, within host memory's ``tessera`` directory).
    Not collective; nothing else may be saving into the directory.

    Returns:
        the steps deleted, oldest first.

    Example:
        >>> remove_root_steps("/dev/shm/tessera/local/ckpt/run-7", "/ckpt/run-7")
        [90, 100]
    """
    doomed = []
    for step, step_dir in local_steps(directory):
        if owner_of(read_marker(step_dir), root, None) == "foreign":
            continue
        remove_quietly(os.path.join(step_dir, MARKER_NAME))  # un-commit first: a cut-short delete is skipped
        shutil.rmtree(step_dir, ignore_errors=True)
        doomed.append(step)
    try:
        os.rmdir(directory)
    except OSError:
        return doomed  # not empty (another root's steps) or already gone
    prune_empty_parents(directory)  # a tier:: root's directory nests like its URL
    return doomed


_SLACK = 1 << 20
"""Room wanted beyond the newest step's size (or 1/64 of it, if more): sizes vary a little."""


def _footprint(path: str) -> int:
    """The bytes a directory's files take on their filesystem (allocated blocks)."""
    total = 0
    for d, _, names in os.walk(path):
        for name in names:
            try:
                st = os.lstat(os.path.join(d, name))
            except OSError:
                continue
            total += max(st.st_blocks * 512, st.st_size)
    return total


def _remove_dirs(dirs: list[str]) -> None:
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
