"""The claim, write and commit steps of a save (in the background for ``async_save``).

1. **claim** (collective): every rank runs its stage step; rank 0 claims the path
   (:func:`tessera.engine.commit.claim`) only if every rank's stage step succeeded, so no rank
   writes a data file before rank 0's owner marker exists and nobody writes after any rank
   failed. (A background save's stage step only starts the copy, which the writes then
   follow tile by tile: a copy failing later fails the write step, on every rank.)
2. **write** (every rank): :func:`tessera.engine.saving.write.write_tiles`, then the rank's report.
3. **commit** (collective): rank 0 assembles the manifest and commits it
   (:func:`tessera.engine.commit.commit_manifest`), or removes the save's files if any rank failed.

Errors anywhere are raised on every rank by :func:`tessera.engine.dist.collective_step`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ...errors import CheckpointError, CommitCheckError, ConcurrentSaveError, StorageError
from ...format.names import DATA_DIR
from ...options import WriterMode
from ...results import SaveResult
from .. import commit, dist
from ..commit import Claim
from ..dist import Gathered, World
from ..timing import PhaseTimer
from . import dedup
from .assemble import build_manifest
from .handoff import CommitOutcome, FileReport, PreparedSave, RankReport
from .sources import Staged
from .window import WindowedTiles, file_write
from .write import WriteRequest, WrittenFile, write_tiles
from .writer_process import write_tiles_in_process

logger = logging.getLogger(__name__)


def finish_save(
    world: World,
    save: PreparedSave,
    staged: Callable[[], Staged],
    timer: PhaseTimer,
    returned: threading.Event | None = None,
    verdict: Callable[[], None] | None = None,
) -> SaveResult:
    """Collective: claim, write, commit. Runs in the save's background thread (or inline).

    Args:
        world: the ranks taking part.
        save: what the prepare and plan steps agreed on.
        staged: this rank's stage step: returns the staged bytes, or raises what failed.
        timer: the save's phase timer (write and commit phases are charged here).
        returned: set once ``async_save`` returned (its stall is in ``timer.stall`` then);
            None for a synchronous save.
        verdict: for a copy in the background, waits for it to end and raises what it found
            (a source changed under it): checked after the writes, before the commit vote.

    Returns:
        this rank's :class:`SaveResult`.

    Raises:
        CheckpointError: any rank's failure, of the same type on every rank.
    """
    tiles: list[Staged] = []

    def stage_locally() -> str | None:
        tiles.append(staged())
        return dedup.base_of(save)  # under dedup, rank 0 pins what the ranks may reference

    claim, share = dist.collective_step(
        world, f"saving checkpoint {save.path}", stage_locally, lambda g: _claim(g, save)
    )
    written: list[WrittenFile] = []
    reports: list[FileReport] = []

    def write_locally() -> RankReport:
        written.extend(_write(world, save, tiles[0], share, reports))
        if verdict is not None:
            verdict()
        timer.mark("write")
        if returned is not None:
            returned.wait()  # the caller's stall is known once async_save has returned
        timings: dict[str, float] = {**timer.phases, "bytes": sum(w.nbytes for w in written)}
        if timer.stall is not None:
            timings["stall"] = timer.stall
        return RankReport(files=tuple(reports), values=save.values, timings=timings)

    committing = False  # rank 0 reached the commit (it then cleans up a failure itself)

    def commit_step(gathered: Gathered[RankReport]) -> CommitOutcome | None:
        nonlocal committing
        committing = True
        return _commit(gathered, save, claim)

    try:
        outcome = dist.collective_step(world, f"saving checkpoint {save.path}", write_locally, commit_step)
    except BaseException:
        if world.is_coordinator and claim is not None and not committing:
            # The exchange itself failed (a rank died or hangs): nothing was published, so
            # rank 0 removes the save's files and marker, as it would for a reported failure.
            commit.abandon(save.store, claim, [w.path for w in written], save.path)
            dedup.abandon(save)
        # Other ranks keep their files: the exchange failing does not tell them whether rank 0
        # published the manifest before it died, and removing files a committed manifest
        # names would corrupt the checkpoint. If the save did not commit, its files are under
        # data/<save id>/ with its owner marker, and the next commit at the path removes them.
        raise
    timer.mark("commit")
    dedup.committed(save, reports, outcome)
    my_bytes = sum(w.nbytes for w in written)
    if world.is_coordinator:
        logger.info(
            "saved %s (%d bytes, %d ranks) in %.3fs", save.path, outcome.total_bytes, world.size, timer.total()["total"]
        )
    rank_timings = outcome.rank_timings if world.is_coordinator else {}
    return SaveResult(
        save.path, save.save_id, my_bytes, outcome.total_bytes, timer.total(), save.plan_cached, rank_timings
    )


def _claim(gathered: Gathered[str | None], save: PreparedSave) -> tuple[Claim, bool] | None:
    """Rank 0: claim the path once every rank has staged (see :mod:`tessera.engine.commit`).

    Returns:
        the claim, and whether the ranks may reference stored tiles (under dedup).
    """
    if not gathered.ok:
        return None  # nobody claimed, nobody writes: nothing to clean up
    share = dedup.pin(save, gathered.all())
    try:
        return commit.claim(save.store, save.save_id), share
    except BaseException:
        dedup.unpin(save)
        raise


def _write(
    world: World, save: PreparedSave, staged: Staged, share: bool, reports: list[FileReport]
) -> list[WrittenFile]:
    """The write stage of this rank (``reports`` receives what the manifest will list).

    Raises StorageError naming the rank for any non-tessera error.
    """
    windowed = any(isinstance(st, WindowedTiles) for st in staged)
    # A memory budget's copies run in the writing threads, so it writes from this process.
    process = save.options.writer is WriterMode.PROCESS and not windowed
    write = write_tiles_in_process if process else write_tiles
    try:
        if save.dedup is not None:
            return dedup.write_shared(save, staged, share and not windowed, write, reports)
        prefix = f"{DATA_DIR}/{save.save_id}"
        request = WriteRequest(
            files=tuple(file_write(f"{prefix}/{lay.name}", lay, st) for lay, st in zip(save.plan.layouts, staged)),
            chunk_bytes=save.options.chunk_bytes,
            threads=save.options.io_threads,
        )
        written = write(save.store, request)
        reports.extend(FileReport.of(w) for w in written)
        return written
    except CheckpointError:
        raise
    except Exception as e:
        raise StorageError(
            f"rank {world.rank}: writing data files of {save.path} failed: {type(e).__name__}: {e}"
        ) from e


def _commit(gathered: Gathered[RankReport], save: PreparedSave, claim: Claim) -> CommitOutcome | None:
    """Rank 0: commit the manifest, or remove the save's files if some rank failed.

    Raises:
        ConcurrentSaveError: another save committed since the claim (also when ranks
            failed: it is the real cause, as the winner's cleanup removed our files).
        CheckpointError: the commit failed (see :func:`tessera.engine.commit.commit_manifest`).
    """
    if not gathered.ok:
        files = [w.path for rep in gathered.payloads if rep is not None for w in rep.files]
        commit.abandon(save.store, claim, files, save.path)
        dedup.abandon(save)
        lost = commit.superseded(save.store, claim, save.path)
        if lost is not None:
            raise lost
        return None
    reports = gathered.all()
    assert save.plan.metas is not None  # rank 0 holds the global tensor table
    try:
        manifest = dedup.annotate(
            save, build_manifest(len(reports), save.plan.metas, reports, save.save_id, save.options)
        )
        dedup.check_shared(save, manifest)
    except BaseException:
        commit.abandon(save.store, claim, [w.path for rep in reports for w in rep.files], save.path)
        dedup.abandon(save)
        raise
    try:
        commit.commit_manifest(save.store, claim, manifest, save.path)
    except (ConcurrentSaveError, CommitCheckError):
        dedup.abandon(save)  # not committed: its new shared files and pin go (a committed pin stays, see dedup)
        raise
    timings = {r: rep.timings for r, rep in enumerate(reports)}
    return CommitOutcome(dedup.bytes_written(save, manifest), timings, dedup.dirs_of(save, manifest))
