"""Deleting a node's local steps: retention after a commit, fencing after a rollback, stale
steps of another root id, and removing a root's steps for good.

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
from .inventory import MARKER_NAME, local_steps, owner_of, read_marker

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

    def fence_newer(self, directory: str, root_id: str | None, step: int) -> list[int]:
        """Un-commit the run's steps newer than ``step`` (a rollback made them unreachable);
        returns them (:meth:`apply` deletes them)."""
        fenced = []
        for s, step_dir in local_steps(directory):
            if s > step and owner_of(read_marker(step_dir), self.root, root_id) == "ours":
                remove_quietly(os.path.join(step_dir, MARKER_NAME))
                fenced.append(s)
        if fenced:
            logger.warning(
                "local tier at %s: step %d is saved after a rollback; the newer local steps %s are removed",
                directory, step, fenced,
            )  # fmt: skip
        return fenced

    def apply(self, directory: str, root_id: str | None, newest: int, also: list[int]) -> list[int]:
        """Delete the run's committed steps beyond the newest ``keep_last`` (never ``newest``,
        the step just committed), uncommitted leftovers older than ``newest``, the steps in
        ``also``, and stale steps (:meth:`stale`); returns the steps deleted."""
        committed: list[int] = []
        doomed: list[int] = list(also)
        for step, step_dir in local_steps(directory):
            owner = owner_of(read_marker(step_dir), self.root, root_id)
            if owner == "ours":
                committed.append(step)
            elif owner == "stale" or (owner == "none" and step < newest):
                doomed.append(step)
            # else: another root's step (a shared local_dir): not ours to count or delete
        kept = [s for s in committed if s <= newest][-self.keep_last :]
        doomed += [s for s in committed if s not in kept and s != newest]
        self.delete(directory, doomed)
        return sorted(set(doomed))

    def stale(self, directory: str, root_id: str | None) -> list[int]:
        """The steps whose marker names this root under another root id (or none): a deleted
        root's or an earlier run's, never to be loaded."""
        return [s for s, d in local_steps(directory) if owner_of(read_marker(d), self.root, root_id) == "stale"]

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


def _remove_dirs(dirs: list[str]) -> None:
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
