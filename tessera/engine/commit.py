"""The commit protocol: how one save becomes the checkpoint at its path, fenced from others.

Every step a save takes against storage, in order (docs/guarantees.md says why it holds):

1. **Claim** (rank 0, in the background, before any rank writes; the others wait for it):
   read the manifest's current version (``Storage.version``), then create the owner marker
   ``.tessera-saves/<save id>``. Before that, while planning, all ranks agree on one
   location, or every rank fails (:func:`check_locations`).
2. **Write** (every rank): data files only under ``data/<save id>/``, names no committed
   manifest refers to; each fsync'ed, then its directory; a failed write removes its files.
3. **Check** (rank 0, :func:`check_files`): every file the ranks reported exists where the
   manifest will point, with the reported size: one listing of ``data/<save id>/``. A large
   manifest (:func:`sectioned`, format version 2) first writes its sections file there
   (``data/<save id>/manifest.sections``), checked with the data files: the index published
   in 4 points into it.
4. **Publish** (rank 0, :func:`publish`): ``manifest.json`` replaces the version read in 1,
   and only that version (``replace_if``: a ``flock``-guarded rename on filesystems, a
   conditional PUT on S3). If another save committed meanwhile, this one fails with
   :class:`~tessera.errors.ConcurrentSaveError` and removes only its own files.
5. **Clean up** (rank 0, :func:`clean_up`): delete the files of saves that can never commit
   any more: those whose marker existed before step 4 (their version is stale now, so
   their own step 4 must fail), and those with no marker at all (finished or dead).
   Saves that started after step 4 are left alone.

A failed save (:func:`abandon`) removes its own files and marker, nothing else.

The hand-off type is a frozen dataclass, :class:`Claim` (what rank 0 holds from 1 to 5);
steps 3 to 5 take the :class:`~tessera.format.manifest.Manifest` to publish. Optional backend
methods are declared in :mod:`tessera.storage.capabilities` and checked with ``isinstance``.

Two callers: a distributed save (:mod:`tessera.engine.saving`, rank 0 calls :func:`commit_manifest`
with the ranks' files) and single-process writers such as converters, which call
:func:`claim` before their first data file and :func:`commit_single` at the end.
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .. import _knobs
from ..errors import CheckpointError, CommitCheckError, ConcurrentSaveError, LocationMismatchError, StorageError
from ..format.manifest import (
    MANIFEST_NAME,
    EncodedSections,
    FileEntry,
    Manifest,
    encode,
    encode_sectioned,
    sections_path,
)
from ..format.names import DATA_DIR, LOAD_TIMINGS_DIR, OWNER_MARKER_DIR, is_shared_ref
from ..storage.base import Storage
from ..storage.capabilities import (
    ConditionalPublish,
    ListsSizes,
    Locatable,
    PartialVisibility,
    RemovesEmptyDirs,
    Versioned,
)

logger = logging.getLogger(__name__)

MARKER_DIR = OWNER_MARKER_DIR
"""Owner markers of the saves in progress at a checkpoint path (one empty file per save)."""
_STAT_THREADS = 16


@dataclass(frozen=True)
class Claim:
    """Rank 0's hold on a checkpoint path for one save.

    Attributes:
        save_id: the save's unique id; its files live under ``data/<save_id>/``.
        expected: the manifest version the save replaces (None: there was none, or the
            backend has no versions).
        fenced: whether the backend publishes conditionally (``replace_if``).
    """

    save_id: str
    expected: str | None
    fenced: bool

    @property
    def data_prefix(self) -> str:
        return f"{DATA_DIR}/{self.save_id}"

    @property
    def marker(self) -> str:
        return f"{MARKER_DIR}/{self.save_id}"


def location_of(store: Storage) -> str:
    """The location ``store`` writes to, as one string all ranks can compare."""
    return str(store.location()) if isinstance(store, Locatable) else str(store.url)


def check_locations(locations: list[str], path: str) -> None:
    """Raise on every rank if the ranks of one save named different locations.

    Raises:
        LocationMismatchError: naming each distinct location and the ranks that gave it.
    """
    by_location: dict[str, list[int]] = {}
    for rank, loc in enumerate(locations):
        by_location.setdefault(loc, []).append(rank)
    if len(by_location) <= 1:
        return
    shown = "; ".join(f"rank{'s' if len(r) > 1 else ''} {_ranks(r)}: {loc}" for loc, r in list(by_location.items())[:6])
    raise LocationMismatchError(
        f"the ranks saving {path!r} do not agree on where the checkpoint is ({len(by_location)} locations: "
        f"{shown}); every rank must pass the same path, on storage every rank and later loads can reach "
        "(not a node-local directory per rank). Nothing was written"
    )


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (" ..." if len(ranks) > 8 else "")


def claim(store: Storage, save_id: str) -> Claim:
    """Rank 0, before any rank writes: note the manifest's version, then mark the save as live.

    The version is read *before* the marker exists: a save whose marker another save sees
    started from a version that other save's commit makes stale (see :func:`clean_up`).

    Raises:
        StorageError: if the manifest's version cannot be read or the marker not written.
    """
    try:
        expected = store.version(MANIFEST_NAME) if isinstance(store, Versioned) else None
        c = Claim(save_id, expected, isinstance(store, ConditionalPublish))
        store.write_file(c.marker, [b""])
    except CheckpointError:
        raise
    except Exception as e:
        raise StorageError(f"cannot start a save at {location_of(store)}: {type(e).__name__}: {e}") from e
    return c


def check_files(store: Storage, claim: Claim, files: Sequence[FileEntry], path: str) -> None:
    """Rank 0, before publishing: every file the manifest lists exists with its size.

    One listing of ``data/<save id>/`` (``file_sizes``; on S3 one LIST per 1,000 objects),
    or one ``size`` per file in threads for backends without it.

    Raises:
        CommitCheckError: naming the missing or wrong-sized files and the ranks that wrote them.
    """
    # Shared tiles (``@tiles/...``, dedup) live outside the checkpoint; the save checks them itself.
    expected = {f.path: (f.nbytes, f.rank) for f in files if not is_shared_ref(f.path)}
    if not expected or (isinstance(store, PartialVisibility) and not store.all_files_visible):
        return  # a node directory of the local tier: the tier checks every node's files itself
    found = _sizes(store, claim.data_prefix, list(expected))
    problems = []
    for f, (n, rank) in sorted(expected.items(), key=lambda kv: kv[1][1]):
        got = found.get(f)
        if got != n:
            what = "missing" if got is None else f"{got} bytes instead of {n}"
            problems.append(f"{f} (written by rank {rank}): {what}")
    if problems:
        raise CommitCheckError(
            f"not committing {path}: {len(problems)} of {len(expected)} data file(s) are not where the manifest "
            f"would point, as rank 0 sees the storage at {location_of(store)}: "
            + "; ".join(problems[:5])
            + (" ..." if len(problems) > 5 else "")
            + ". Causes: ranks writing to different (e.g. node-local) directories, another job deleting files "
            "at this path, or storage that lost writes. The previous checkpoint is unchanged"
        )


def _sizes(store: Storage, prefix: str, paths: list[str]) -> dict[str, int]:
    if isinstance(store, ListsSizes):
        return dict(store.file_sizes(prefix))

    def one(p: str) -> tuple[str, int | None]:
        try:
            return p, store.size(p)
        except FileNotFoundError:
            return p, None

    with ThreadPoolExecutor(min(_STAT_THREADS, len(paths)), thread_name_prefix="tessera-stat") as pool:
        return {p: n for p, n in pool.map(one, paths) if n is not None}


def live_saves(store: Storage) -> set[str]:
    """Ids of the saves whose owner marker exists at the path."""
    return {posixpath.basename(p) for p in store.list(MARKER_DIR)}


def publish(store: Storage, claim: Claim, data: bytes, path: str) -> None:
    """Rank 0: publish the manifest, unless another save committed since :func:`claim`.

    Raises:
        ConcurrentSaveError: another save committed first (nothing was written).
        StorageError: writing failed (nothing was committed).
    """
    if claim.fenced and isinstance(store, ConditionalPublish):
        store.replace_if(MANIFEST_NAME, data, claim.expected, owner=claim.marker)  # fenced against retention too
        return
    if isinstance(store, Versioned) and store.version(MANIFEST_NAME) != claim.expected:
        raise ConcurrentSaveError(
            f"not committing {path}: another save committed it while this one ran; two jobs are saving "
            "to one path. The other save's checkpoint stands"
        )
    store.write_atomic(MANIFEST_NAME, data)


def clean_up(store: Storage, claim: Claim, live_before: set[str], path: str) -> None:
    """Rank 0, after publishing: remove what no save can commit any more. Never raises.

    ``live_before`` are the markers listed before :func:`publish`. Deleted: files of those
    saves (they started from a version this commit made stale, so they cannot commit), files
    of saves with no marker (finished, failed or dead), those markers, this save's marker,
    and timings of loads of the replaced checkpoint. A save whose marker appeared after
    ``live_before`` was listed may still commit over this one: its files stay.
    """
    ours = claim.save_id
    try:
        data = store.list(DATA_DIR)
        live_now = live_saves(store)  # listed after data: a live save's marker predates its files
        doomed = [
            p for p in data if _save_of(p) != ours and (_save_of(p) in live_before or _save_of(p) not in live_now)
        ]
        doomed += [f"{MARKER_DIR}/{s}" for s in sorted(live_before) if s != ours]
        doomed += store.list(LOAD_TIMINGS_DIR)
        doomed.append(claim.marker)
        store.delete(doomed)
        if isinstance(store, RemovesEmptyDirs):  # filesystems: directories of saves killed before their first file
            store.remove_empty_dirs(DATA_DIR)
    except Exception as e:
        logger.warning("could not remove files of older saves under %s: %s", path, e)


def superseded(store: Storage, claim: Claim, path: str) -> ConcurrentSaveError | None:
    """The error to report if another save committed since :func:`claim` (fenced backends only).

    A save that lost the race may fail before it publishes (the winner's cleanup removed its
    files mid-write); this names that cause instead of the missing file it led to.
    """
    if not claim.fenced or not isinstance(store, Versioned):
        return None
    try:
        current = store.version(MANIFEST_NAME)
    except Exception:
        return None
    if current == claim.expected:
        return None
    return ConcurrentSaveError(
        f"not committing {path}: another save committed it while this one ran (two jobs are saving to one "
        "path); the other save's checkpoint stands and this save's files were removed"
    )


def may_have_committed(store: Storage, claim: Claim) -> bool:
    """After :func:`publish` raised: whether the manifest may be this save's after all.

    False only when the backend can prove the manifest is still the version claimed (say,
    the temporary file could not be written on a full disk): then the save's files can go.
    """
    if not isinstance(store, Versioned):
        return True
    try:
        return store.version(MANIFEST_NAME) != claim.expected
    except Exception:
        return True


def commit_manifest(store: Storage, claim: Claim, manifest: Manifest | EncodedSections, path: str) -> None:
    """Rank 0 of a save: steps 3 to 5 for ``manifest``, or :func:`abandon` if they fail.

    ``manifest`` is a :class:`Manifest`, or a version 2 manifest already encoded from the
    ranks' own sections (:mod:`tessera.engine.saving.sectioned`).

    Checks every file ``manifest.files`` lists (:func:`check_files`), publishes the manifest
    over the version ``claim`` read (:func:`publish`), then removes what no save can commit
    any more (:func:`clean_up`). On failure the save's files and marker are removed, unless
    the manifest may have landed after all (then only the marker goes).

    Raises:
        ConcurrentSaveError: another save committed first.
        CommitCheckError: a listed file is missing or has the wrong size.
        StorageError: reading versions or publishing failed (any non-tessera error is wrapped).
    """
    files = [f.path for f in manifest.files]
    published = False
    try:
        lost = superseded(store, claim, path)
        if lost is not None:
            raise lost
        data, files_to_check = _encoded(store, claim, manifest)
        check_files(store, claim, files_to_check, path)
        live_before = live_saves(store)
        published = True  # from here on, a failure may have committed after all
        publish(store, claim, data, path)
    except Exception as e:
        if not published or isinstance(e, ConcurrentSaveError) or not may_have_committed(store, claim):
            abandon(store, claim, files, path)
        else:  # the manifest may have landed: keep its files; the next save cleans them up
            abandon(store, claim, [], path, keep_data=True)
        if isinstance(e, CheckpointError):
            raise
        raise StorageError(f"committing the manifest of {path} failed: {type(e).__name__}: {e}") from e
    clean_up(store, claim, live_before, path)


def sectioned(store: Storage, manifest: Manifest) -> bool:
    """Whether ``manifest`` is committed in sections (format version 2, or 4 with compressed
    files): when it has at least ``TESSERA_SECTIONED_MANIFEST_TILES`` tiles, and only where every
    rank sees the checkpoint's files (a node directory of the local tier keeps version 1: its peers
    copy ``manifest.json``)."""
    tiles = sum(e.num_tiles for e in manifest.tensors.values())
    # A delta frame is decoded with its parent file's frame table, which may be in another
    # rank's section (or another step's): delta-coded manifests stay inline (version 3).
    delta = any(f.frames is not None and f.frames.delta is not None for f in manifest.files)
    return bool(manifest.files) and not delta and sectioned_for(store, tiles)


def sectioned_for(store: Storage, tiles: int) -> bool:
    """:func:`sectioned` for a manifest of ``tiles`` tiles that lists files."""
    if isinstance(store, PartialVisibility) and not store.all_files_visible:
        return False
    return tiles >= _knobs.sectioned_manifest_tiles()


def _encoded(store: Storage, claim: Claim, manifest: Manifest | EncodedSections) -> tuple[bytes, list[FileEntry]]:
    """The bytes of ``manifest.json`` and the files to check before publishing them.

    A sectioned manifest's sections file is written (durably, under ``data/<save id>/``) first,
    and checked with the data files: the index names it, so it must be there before the index is.
    """
    if isinstance(manifest, EncodedSections):
        index, sections = manifest.index, manifest.sections
    elif not sectioned(store, manifest):
        return encode(manifest), list(manifest.files)
    else:
        index, sections = encode_sectioned(manifest)
    path = sections_path(manifest.save_id)
    if not path.startswith(claim.data_prefix + "/"):
        raise ValueError(f"sections file {path} outside {claim.data_prefix}/ of the save")
    store.write_file(path, [sections])
    return index, [*manifest.files, FileEntry(path, 0, len(sections))]


def commit_single(store: Storage, claim: Claim, manifest: Manifest, path: str) -> None:
    """Commit a checkpoint written by one process (a converter): the same steps as a save.

    Call order: ``c = claim(store, save_id)`` before writing the first data file, then write
    every data file under ``c.data_prefix`` (:func:`tessera.engine.saving.write.write_files`), build the
    manifest (``save_id=c.save_id``) and call this. On an error before this call, call
    ``abandon(store, c, written_paths, path)``.

    Args:
        store: the backend bound to the checkpoint's root.
        claim: what :func:`claim` returned for this save.
        manifest: the manifest to publish; its files must lie under ``claim.data_prefix``.
        path: the checkpoint's path, for messages.

    Raises:
        ValueError: if the manifest is not this claim's (its save id or a file outside
            ``data/<save id>/``); nothing is removed then.
        ConcurrentSaveError, CommitCheckError, StorageError: as :func:`commit_manifest`
            (the save's files and marker are removed).

    Example:
        >>> c = commit.claim(store, save_id)  # doctest: +SKIP
        >>> ...  # write data/<save_id>/..., build the manifest
        >>> commit.commit_single(store, c, manifest, path)  # doctest: +SKIP
    """
    if manifest.save_id != claim.save_id:
        raise ValueError(f"manifest of save {manifest.save_id!r} committed with the claim of save {claim.save_id!r}")
    outside = [f.path for f in manifest.files if not f.path.startswith(claim.data_prefix + "/")]
    if outside:
        raise ValueError(f"{path}: data files outside {claim.data_prefix}/ would be removed by cleanup: {outside[:3]}")
    commit_manifest(store, claim, manifest, path)


def abandon(store: Storage, claim: Claim, files: Iterable[str], path: str, *, keep_data: bool = False) -> None:
    """Rank 0, for a save that will not commit: remove its files and marker only. Never raises.

    With ``keep_data`` only the marker goes (the manifest may refer to the files); without
    a marker, the files are removed by the next save that commits.
    """
    doomed = set() if keep_data else {f for f in files if not is_shared_ref(f)}
    if not keep_data:
        try:
            doomed |= set(store.list(claim.data_prefix))
        except Exception as e:
            logger.debug("listing %s under %s failed: %s", claim.data_prefix, path, e)
    doomed.add(claim.marker)
    try:
        store.delete(sorted(doomed))
    except Exception as e:
        logger.warning("could not remove the files of a failed save under %s: %s", path, e)


def _save_of(path: str) -> str:
    """The save id of a data file path (``data/<id>/<file>``); "" for anything else."""
    parts = path.split("/")
    return parts[1] if len(parts) >= 3 and parts[0] == DATA_DIR else ""
