"""The claim, write, vote and commit steps of a save (in the background for ``async_save``).

1. **claim** (rank 0, before its own writes): :func:`tessera.engine.commit.claim` reads the
   manifest's version and writes the owner marker. Under dedup every rank pins what it will write
   and reference (:func:`tessera.engine.saving.dedup.pin`) before writing. The other ranks
   do not wait for it: until the marker exists only a concurrent save's cleanup at the same path
   could remove their files, and then the commit check fails loudly.
2. **write** (every rank): :func:`tessera.engine.saving.write.write_tiles`, then the rank's report
   (:mod:`tessera.format.rank_report`: its files, tiles, checksums, values, timings) beside its
   data files; the report's size never reaches a collective.
3. **vote** (one fixed-size all-reduce): every rank's bytes and report are durable, and the
   ranks agree on the plan and the location. A rank that failed, or
   had to plan in the foreground, voted already (:mod:`.prepare`). If the vote fails, every rank
   removes what it wrote (rank 0 also the marker) and raises.
4. **commit** (rank 0, then one broadcast): rank 0 reads the reports (in a large job mostly as
   the report groups their leaders write after the vote, :mod:`.report_groups`), assembles and commits the
   manifest (:func:`tessera.engine.commit.commit_manifest`); one fixed-size broadcast tells every
   rank the outcome (a failure's records follow in a second one).

A steady-state save therefore coordinates with two fixed-size collectives (3 and 4), whatever
the number of tensors, tiles or ranks. Where rank 0 cannot see every rank's files (a node-local
tier) the reports are gathered instead, one more collective.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ...errors import (
    CheckpointError,
    CommitCheckError,
    ConcurrentSaveError,
    LocationMismatchError,
    PlanMismatchError,
    StorageError,
)
from ...format.manifest import EncodedSections, Manifest
from ...format.names import DATA_DIR
from ...format.rank_report import RankReportDoc, decode_report, details, encode_report, report_path
from ...options import WriterMode
from ...results import SaveResult
from ...storage import recache
from ...storage.capabilities import PartialVisibility, Recaches
from .. import commit, dist
from ..commit import Claim
from ..dist import World
from ..gc_pause import gc_paused
from ..timing import PhaseTimer
from . import dedup, report_groups
from .assemble import build_manifest, check_coverage
from .handoff import CommitOutcome, FileReport, PreparedSave, rank_report
from .prepare import plan_mismatch, save_ballot
from .replicas import check_replicas
from .sectioned import build_sectioned, tile_count
from .sources import Staged
from .window import WindowedTiles, file_write
from .write import WriteRequest, WrittenFile, write_tiles
from .writer_process import write_tiles_in_process

logger = logging.getLogger(__name__)
_READ_THREADS = 128
"""Reports (or report groups) read at once by rank 0 at the commit."""


def finish_save(
    world: World,
    save: PreparedSave,
    staged: Callable[[], Staged],
    timer: PhaseTimer,
    returned: threading.Event | None = None,
    verdict: Callable[[list[FileReport]], None] | None = None,
) -> SaveResult:
    """Collective: claim, write, vote, commit. Runs in the save's background thread (or inline).

    Args:
        world: the ranks taking part.
        save: what the prepare and plan steps agreed on.
        staged: this rank's stage step: returns the staged bytes, or raises what failed.
        timer: the save's phase timer (write and commit phases are charged here).
        returned: set once ``async_save`` returned (its stall is in ``timer.stall`` then);
            None for a synchronous save.
        verdict: for a copy in the background, waits for it to end and raises what it found
            (a source changed under it, a CPU tile written with other bytes than the call's,
            given the reports of what was written): checked after the writes, before the vote.

    Returns:
        this rank's :class:`SaveResult`.

    Raises:
        CheckpointError: any rank's failure, of the same type on every rank.
    """
    what = f"saving checkpoint {save.path}"
    written: list[WrittenFile] = []
    reports: list[FileReport] = []
    claims: list[Claim] = []
    ballot = save_ballot()

    def write_locally() -> None:
        try:
            write_and_report()
        except Exception as e:
            if _vanished(e):  # before rank 0's marker existed, another save's cleanup took our files
                raise CommitCheckError(
                    f"not committing {save.path}: files of this save were removed while rank {world.rank} wrote them "
                    f"({type(e).__name__}: {e}): another save at this path committed and cleaned up (two jobs "
                    "saving to one path), or another job deleted files there. The previous checkpoint is unchanged"
                ) from e
            raise

    def write_and_report() -> None:
        if world.is_coordinator:
            claims.append(commit.claim(save.store, save.save_id))
        # Under dedup each rank pins what it writes and references before it does (it does
        # not wait for rank 0), then references only a base still committed after its pin.
        share = dedup.pin(save.dedup, save.save_id, save.path, world.rank)
        tiles = staged()
        # A memory budget's copies stream through the writes: such a save references nothing.
        windowed = any(isinstance(st, WindowedTiles) for st in tiles)
        written.extend(_write(world, save, tiles, share and not windowed, reports))
        if verdict is not None:
            verdict(reports)
        timer.mark("write")
        if returned is not None:
            returned.wait()  # the caller's stall is known once async_save has returned
        timings: dict[str, float] = {**timer.phases, "bytes": sum(w.nbytes for w in written)}
        if timer.stall is not None:
            timings["stall"] = timer.stall
        doc = rank_report(world.rank, save.save_id, reports, save.values, timings, save.replicas)
        if world.is_coordinator:
            docs.append(doc)
        elif _through_storage(save):
            path = report_path(save.save_id, world.rank)
            try:
                own.append(encode_report(doc))
                save.store.write_atomic(path, own[0])
            except CheckpointError:
                raise
            except Exception as e:
                raise StorageError(
                    f"rank {world.rank}: writing its report {path} of {save.path} failed: {type(e).__name__}: {e}"
                ) from e
        else:
            blobs.append(encode_report(doc))
        ballot["plan"] = dist.fingerprint62(save.plan.plan_id)
        ballot["background"] = int(save.background)
        ballot["location"] = dist.fingerprint62(save.location)

    docs: list[RankReportDoc] = []
    blobs: list[bytes] = []
    own: list[bytes] = []  # this rank's report as written
    claim_of = lambda: claims[0] if claims else Claim(save.save_id, None, False)  # noqa: E731

    removed: list[bool] = []

    def remove_own() -> BaseException | None:
        """Nothing will commit (rank 0 publishes only after a passing vote): every rank removes
        what it wrote. Rank 0 returns the real cause if another save won the path meanwhile
        (its cleanup removed our files: the failures it led to are only symptoms)."""
        if removed:
            return None
        removed.append(True)
        _remove(world, save, written, claim_of())
        return commit.superseded(save.store, claims[0], save.path) if claims else None

    try:
        tally = dist.vote(world, what, ballot, write_locally, failed=remove_own)
    except BaseException:
        remove_own()  # the vote itself failed (a rank died or hangs)
        raise
    problem = _disagreement(tally, save.path)
    if problem is not None:
        remove_own()
        if isinstance(problem, PlanMismatchError) and save.forget_plans is not None:
            save.forget_plans()
        if isinstance(problem, LocationMismatchError):  # name every location (the error path)
            commit.check_locations(dist.all_gather(world, save.location, what), save.path)
        raise problem
    if not _through_storage(save):
        gathered = dist.gather(world, blobs[0] if blobs else b"", what)
        if gathered is not None:
            blobs[:] = gathered
    group = report_groups.group_size(world.size) if _through_storage(save) else 0
    group_file = None
    if group and own and world.rank % group == 0:  # a group's leader (rank 0 reads its group itself)
        group_file = report_groups.combine(save, world.rank, own[0], world.size, group)
    outcome: list[CommitOutcome] = []
    decide = (lambda: _commit(world, save, claim_of(), docs, blobs, outcome)) if world.is_coordinator else None
    try:
        total_bytes = dist.announce(world, what, decide, 1)[0]
    finally:
        if group_file is not None:  # read by rank 0 or not, it is of no use now
            try:
                save.store.delete([group_file])
            except Exception as e:
                logger.debug("rank %d: could not remove %s: %s", world.rank, group_file, e)
    timer.mark("commit")
    result = outcome[0] if outcome else CommitOutcome(total_bytes, {})
    dedup.committed(save, reports, result)
    _recache(save, written, world.rank)
    my_bytes = sum(w.nbytes for w in written)
    if world.is_coordinator:
        logger.info(
            "saved %s (%d bytes, %d ranks) in %.3fs", save.path, total_bytes, world.size, timer.total()["total"]
        )
    return SaveResult(
        save.path, save.save_id, my_bytes, total_bytes, timer.total(), save.plan_cached, result.rank_timings
    )


def _recache(save: PreparedSave, written: list[WrittenFile], rank: int) -> None:
    """The committed files this rank wrote, back into the page cache for the first load after the
    save, where the backend wrote around it (:mod:`tessera.storage.recache`). Never fails the save."""
    store = save.dedup.tiles if save.dedup is not None else save.store
    if not written or not isinstance(store, Recaches):
        return
    try:
        store.recache([w.path for w in written], supersedes=save.dedup is None)  # dedup reads older files
    except Exception as e:  # a bad TESSERA_RECACHE included: said, not swallowed
        logger.warning("rank %d: not re-caching the files of %s: %s", rank, save.path, e)


def _disagreement(tally: dist.Tally, path: str) -> CheckpointError | None:
    """Why the ranks cannot commit together, from their vote (the same on every rank), or None."""
    if tally["miss"] or not tally.agreed["plan"]:
        return plan_mismatch(path, retry=not tally["background"])
    if not tally.agreed["location"]:
        return LocationMismatchError(f"the ranks saving {path!r} do not agree on where the checkpoint is")
    return None


def _vanished(e: BaseException) -> bool:
    """Whether a write failed because a file or directory of the save disappeared under it."""
    seen: BaseException | None = e
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, FileNotFoundError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _through_storage(save: PreparedSave) -> bool:
    """Whether reports travel through storage: only where rank 0 sees every rank's files."""
    return not (isinstance(save.store, PartialVisibility) and not save.store.all_files_visible)


def _remove(world: World, save: PreparedSave, written: list[WrittenFile], claim: Claim) -> None:
    """Remove this rank's files of a save that will not commit (rank 0: also the marker and pin). Never raises."""
    try:
        if save.dedup is None:
            own = [w.path for w in written]
            if not world.is_coordinator:
                own.append(report_path(save.save_id, world.rank))
            save.store.delete(own)
    except Exception as e:
        logger.warning("rank %d: could not remove the files of a failed save of %s: %s", world.rank, save.path, e)
    if world.is_coordinator:
        commit.abandon(save.store, claim, [], save.path)
        dedup.abandon(save)


def _read_report(save: PreparedSave, path: str, rank: int) -> bytes:
    """A report every rank voted durable; gone means someone removed the save's files meanwhile."""
    try:
        return save.store.read_file(path)
    except FileNotFoundError:
        raise CommitCheckError(
            f"not committing {save.path}: the report {path} of rank {rank} is gone although rank {rank} wrote it "
            f"before the vote, as rank 0 sees the storage at {commit.location_of(save.store)}: another job removed "
            "files at this path (a newer run's retention, say). The previous checkpoint is unchanged"
        ) from None
    except CheckpointError:
        raise
    except Exception as e:
        raise StorageError(f"rank 0: reading the report {path} of rank {rank} failed: {type(e).__name__}: {e}") from e


def _read_reports(save: PreparedSave, world_size: int) -> dict[int, bytes]:
    """Every other rank's report, ``_READ_THREADS`` reads in flight (from report groups in a large job)."""
    return report_groups.read_all(
        save, world_size, lambda r: _read_report(save, report_path(save.save_id, r), r), _READ_THREADS
    )


def _reports(
    world: World, save: PreparedSave, docs: list[RankReportDoc], blobs: list[bytes], *, detailed: bool = True
) -> list[RankReportDoc]:
    """Rank 0: every rank's report, by rank (they are durable: every rank voted after writing its own).

    Without ``detailed`` only their geometry is decoded, their sections kept as written."""
    raw: dict[int, bytes]
    if _through_storage(save):
        raw = _read_reports(save, world.size)
    else:
        raw = dict(enumerate(blobs))
    out = [docs[0]]
    for r in range(1, world.size):
        source = f"{save.path}/{report_path(save.save_id, r)}"
        out.append(decode_report(raw[r], source=source, rank=r, save_id=save.save_id, details=detailed))
    return out


def _write(
    world: World, save: PreparedSave, staged: Staged, share: bool, reports: list[FileReport]
) -> list[WrittenFile]:
    """The write stage of this rank (``reports`` receives what the manifest will list).

    Raises StorageError naming the rank for any non-tessera error.
    """
    recache.yield_to_writes()  # the disk is this save's now (also where a writer process writes)
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
            chunking=save.chunking,
            threads=save.options.io_threads,
            compress=save.options.compress,
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


def _commit(
    world: World,
    save: PreparedSave,
    claim: Claim,
    docs: list[RankReportDoc],
    blobs: list[bytes],
    out: list[CommitOutcome],
) -> list[int]:
    """Rank 0, once every rank voted its bytes durable: commit the manifest.

    Raises:
        ConcurrentSaveError: another save committed since the claim.
        CheckpointError: the commit failed (see :func:`tessera.engine.commit.commit_manifest`).
    """
    assert save.plan.metas is not None  # rank 0 holds the global tensor table
    manifest: Manifest | EncodedSections
    # A large save commits its ranks' own sections (format version 2, or 4 with compressed
    # files) without decoding them; under dedup ranks may list one shared file twice (and delta
    # frames name files of other steps): the manifest is assembled whole then.
    joined = _through_storage(save) and save.dedup is None
    try:
        with gc_paused():  # N reports decoded and joined: no full collections in between
            manifest, reports = _assemble(world, save, docs, blobs, joined)
    except BaseException:
        commit.abandon(save.store, claim, [], save.path)
        dedup.abandon(save)
        lost = commit.superseded(save.store, claim, save.path)
        if lost is not None:
            raise lost from None
        raise
    try:
        commit.commit_manifest(save.store, claim, manifest, save.path)
    except (ConcurrentSaveError, CommitCheckError):
        dedup.abandon(save)  # not committed: its new shared files and pin go (a committed pin stays, see dedup)
        raise
    if world.size > 1 and _through_storage(save):
        try:  # the manifest holds everything they said
            save.store.delete([report_path(save.save_id, r) for r in range(1, world.size)])
        except Exception as e:
            logger.debug("could not remove the rank reports of %s: %s", save.path, e)
    timings = {r: d.timings for r, d in enumerate(reports)}
    if isinstance(manifest, EncodedSections):
        out.append(CommitOutcome(sum(f.nbytes for f in manifest.files), timings))
    else:
        out.append(CommitOutcome(dedup.bytes_written(save, manifest), timings, dedup.dirs_of(save, manifest)))
    return [out[0].total_bytes]


def _assemble(
    world: World, save: PreparedSave, docs: list[RankReportDoc], blobs: list[bytes], joined: bool
) -> tuple[Manifest | EncodedSections, list]:
    """Rank 0: the manifest of every rank's report (their sections joined as they are when
    ``joined``, or the whole manifest assembled), and the reports."""
    assert save.plan.metas is not None  # rank 0 holds the global tensor table
    reports: list = _reports(world, save, docs, blobs, detailed=not joined)
    check_replicas(save.path, [d.replicas for d in reports])
    if joined and commit.sectioned_for(save.store, tile_count(reports)):
        sections = build_sectioned(
            world.size, save.plan.metas, reports, save.save_id, save.options, check_coverage=save.plan.derived
        )
        return sections, reports
    reports = [details(d, f"{save.path}/{report_path(save.save_id, r)}") for r, d in enumerate(reports)]
    manifest = dedup.annotate(save, build_manifest(world.size, save.plan.metas, reports, save.save_id, save.options))
    if save.plan.derived:  # no rank saw the others' boxes: check every tensor is covered once
        check_coverage(manifest)
    dedup.check_shared(save, manifest)
    return manifest, reports
