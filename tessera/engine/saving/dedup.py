"""Cross-step dedup: reference tiles already committed under the root instead of writing them again.

With ``CheckpointManager(dedup=True)`` every save writes its data files into the root's
shared tile directory (``<root>/.tessera-tiles/<save id>/``), and a tile whose bytes equal
the tile at the same place (tensor name and box) of the step the save builds on is not
written: the new manifest references the stored copy (``@tiles/<save id>/<file>``), so every
step stays complete on its own.

Equality is decided on the staged bytes, never on ``requires_grad``: the tile's xxh3-64
chunk checksums (those the manifest records anyway) are compared with the stored tile's,
chunk by chunk, stopping at the first difference. A tile that changed therefore costs one
extra chunk hash, and one that did not is hashed once and not written.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ...errors import CommitCheckError
from ...format.chunking import Chunking
from ...format.dtypes import dtype_from_name, dtype_name, itemsize
from ...format.manifest import FileEntry, Manifest
from ...format.names import SHARED_REF, is_shared_ref
from ...format.tilefile import FileLayout, TileSlot, layout_file
from ...storage import Storage
from ...storage.capabilities import ListsSizes
from ..frames import read_logical
from ..tile_pins import PIN_LEASE_S, read_pins, remove_pin, write_pin
from . import compress_choice
from .coded_files import DeltaBase
from .handoff import CommitOutcome, FileReport, PreparedSave
from .tile_index import Dedup, StoredTile, TileIndex, TileKey, shared_dir
from .window import file_write
from .write import FileWrite, WriteRequest, WrittenFile, checksum_chunks, write_tiles

__all__ = ["SharedWrites", "next_index", "shared_reports", "split_writes"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SharedWrites:
    """A rank's write stage under dedup: the files to write and the tiles referenced instead."""

    files: tuple[FileWrite, ...]
    """New data files, at paths relative to the shared tile directory (``<save id>/<file>``)."""
    referenced: tuple[FileReport, ...]
    """Stored tiles used as they are, one report per stored file."""


def split_writes(
    save_id: str,
    layouts: Sequence[FileLayout],
    staged: Sequence[Sequence[torch.Tensor]],
    index: TileIndex | None,
    chunking: Chunking,
    tiles: Storage | None = None,
) -> SharedWrites:
    """Decide, tile by tile, what to write and what to reference (hashing the staged bytes).

    With ``tiles`` (the shared tile directory, for a compressed save), a changed tile whose
    stored version is in a compressed file gets that version as its delta base."""
    if index is not None and index.chunking != chunking:
        index = None  # checksums of another granularity cannot be compared
    if index is None:  # nothing to compare with: every file as planned (staged in full or through a window)
        return SharedWrites(tuple(file_write(f"{save_id}/{lay.name}", lay, v) for lay, v in zip(layouts, staged)), ())
    files: list[FileWrite] = []
    refs: dict[str, list[tuple[TileSlot, StoredTile]]] = defaultdict(list)
    for layout, views in zip(layouts, staged):
        keep: list[tuple[TileSlot, torch.Tensor, tuple[int, ...]]] = []
        bases: dict[tuple[str, object], DeltaBase] = {}
        for slot, view in zip(layout.slots, views):
            stored = None if index is None else index.tiles.get((slot.fqn, slot.box.offsets, slot.box.lengths))
            if stored is None or stored.nbytes != slot.nbytes or stored.dtype != dtype_name(slot.dtype):
                keep.append((slot, view, ()))
                continue
            same, sums = _compare(view, stored.checksums, chunking.of(slot.nbytes))
            if same:
                refs[stored.path].append((slot, stored))
            else:
                keep.append((slot, view, sums))
                if tiles is not None and stored.file_frames is not None:
                    bases[(slot.fqn, slot.box)] = _delta_base(tiles, index, stored)
        if not keep:
            continue
        new = layout_file(layout.name, [(s.fqn, s.box, s.dtype) for s, _, _ in keep])
        by_place = {(s.fqn, s.box): (v, sums) for s, v, sums in keep}
        views_in_order = tuple(by_place[(s.fqn, s.box)][0] for s in new.slots)
        known = {j: sums for j, s in enumerate(new.slots) if (sums := by_place[(s.fqn, s.box)][1])}
        based = {j: bases[(s.fqn, s.box)] for j, s in enumerate(new.slots) if (s.fqn, s.box) in bases}
        files.append(FileWrite(f"{save_id}/{layout.name}", new, views_in_order, known, bases=based))
    return SharedWrites(tuple(files), tuple(_report(p, pairs) for p, pairs in refs.items()))


def _delta_base(tiles: Storage, index: TileIndex, stored: StoredTile) -> DeltaBase:
    """The stored tile as a delta base: its file read (and decoded) through the shared tile directory."""
    table = stored.file_frames
    assert table is not None
    tables = {p: t for p, (_, t) in index.files.items()}

    def read(at: int, out: memoryview) -> None:
        read_logical(tiles, stored.path, table, at, out, tables=tables, locate=lambda r: r[len(SHARED_REF) :])

    return DeltaBase(stored.path, stored.byte_offset, table, read)


def parent_reports(reports: Sequence[FileReport], index: TileIndex | None) -> tuple[FileReport, ...]:
    """Reports (without tiles) of the files that delta frames of ``reports`` need and that they do
    not list, transitively: a manifest lists every file its tiles are decoded from, so retention
    and collection keep them and the step loads after any other is deleted."""
    listed = {r.path for r in reports}
    pending = [
        p for r in reports if r.frames is not None and r.frames.delta is not None for p in r.frames.delta.parents
    ]
    out: list[FileReport] = []
    while pending:
        p = pending.pop()
        if p in listed:
            continue
        if index is None or p not in index.files:
            raise CommitCheckError(f"a delta tile's parent file {p} is not a file of the step it builds on")
        listed.add(p)
        nbytes, table = index.files[p]
        out.append(FileReport(p, nbytes, (), (), (), (), (), frames=table))
        if table is not None and table.delta is not None:
            pending.extend(table.delta.parents)
    return tuple(out)


def _compare(view: torch.Tensor, stored: tuple[int, ...], chunk_bytes: int) -> tuple[bool, tuple[int, ...]]:
    """Whether ``view``'s chunk checksums equal ``stored``, and the checksums computed to find out
    (up to the first that differs: the write goes on from there instead of hashing them again)."""
    data = view.numpy().data if view.numel() else memoryview(b"")
    sums: list[int] = []
    for i, (_, h) in enumerate(checksum_chunks(data, chunk_bytes)):
        sums.append(h)
        if i >= len(stored) or h != stored[i]:
            return False, tuple(sums)
    return len(sums) == len(stored), tuple(sums)


def _report(path: str, pairs: list[tuple[TileSlot, StoredTile]]) -> FileReport:
    return FileReport(
        path=path,
        nbytes=pairs[0][1].file_nbytes,
        fqns=tuple(s.fqn for s, _ in pairs),
        offsets=tuple(s.box.offsets for s, _ in pairs),
        lengths=tuple(s.box.lengths for s, _ in pairs),
        byte_offsets=tuple(t.byte_offset for _, t in pairs),
        checksums=tuple(t.checksums for _, t in pairs),
        frames=pairs[0][1].file_frames,
    )


def shared_reports(written: Iterable[WrittenFile]) -> tuple[FileReport, ...]:
    """Reports of files written into the shared tile directory, with their manifest references."""
    return tuple(FileReport.of(w, path=SHARED_REF + w.path) for w in written)


def next_index(
    save_id: str,
    url: str,
    chunking: Chunking,
    reports: Iterable[FileReport],
    dtypes: Mapping[str, str],
    dirs: frozenset[str],
) -> TileIndex:
    """This rank's index for the next save: every tile it wrote or referenced in this one."""
    tiles: dict[TileKey, StoredTile] = {}
    for r in reports:
        for fqn, offs, lens, bo, sums in zip(r.fqns, r.offsets, r.lengths, r.byte_offsets, r.checksums):
            dtype = dtypes[fqn]
            nbytes = math.prod(lens) * itemsize(dtype_from_name(dtype))
            tiles[(fqn, offs, lens)] = StoredTile(r.path, dtype, bo, nbytes, sums, r.nbytes, r.frames)
    files = {r.path: (r.nbytes, r.frames) for r in reports}
    return TileIndex(url, save_id, chunking, tiles, dirs | {shared_dir(r.path) for r in reports}, files)


# -- The steps of :mod:`.finish` under dedup (each a no-op without it) ---------------------------


def pin(d: Dedup | None, save_id: str, path: str, rank: int) -> bool:
    """Every rank, before it writes: pin the save's directories; whether it may reference stored tiles.

    Only if the base save is still committed *after* the pin exists (the order a concurrent
    collection relies on).
    """
    if d is None:
        return False
    index = d.index
    write_pin(d.tiles, save_id, path, index.dirs if index is not None else frozenset(), rank)
    if index is None:
        return False
    try:
        return d.still_committed(index)
    except Exception as e:
        logger.warning(
            "%s: cannot tell whether %s is still committed (%s); writing every tile", path, index.base_url, e
        )
        return False


def write_shared(
    save: PreparedSave,
    staged: Sequence[Sequence[torch.Tensor]],
    share: bool,
    write: Callable[[Storage, WriteRequest], list[WrittenFile]],
    reports: list[FileReport],
) -> list[WrittenFile]:
    """Every rank: write the tiles that changed into the shared directory; report them and the references."""
    d = save.dedup
    assert d is not None
    index = d.index if share else None
    compress = save.options.compress
    if compress == "auto":  # decided here: only a coded write builds on delta bases
        threads = min(save.options.io_threads, os.cpu_count() or 1)
        compress = compress_choice.CHOICE.should_code(d.tiles.url, threads, None, 1)
    delta = d.tiles if compress else None
    split = split_writes(save.save_id, save.plan.layouts, staged, index, save.chunking, delta)
    if any(f.bases for f in split.files) or save.options.compress == "auto":
        # Delta bases are read through this process's storage; and compress="auto" was decided
        # from this process's measurements, which this write must feed (a writer process keeps its own).
        write = write_tiles
    request = WriteRequest(
        split.files,
        save.chunking,
        save.options.io_threads,
        compress,
        measure=save.options.compress == "auto",
    )
    written = write(d.tiles, request)
    mine = [*shared_reports(written), *split.referenced]
    reports.extend(mine)
    reports.extend(parent_reports(mine, index))
    return written


def abandon(save: PreparedSave) -> None:
    """Rank 0, for a save that will not commit: remove its new shared files and its pin. Never raises."""
    d = save.dedup
    if d is None:
        return
    try:
        d.tiles.delete(d.tiles.list(save.save_id))
    except Exception as e:
        logger.warning("could not remove the shared files of a failed save of %s: %s", save.path, e)
    remove_pin(d.tiles, save.save_id)


def annotate(save: PreparedSave, manifest: Manifest) -> Manifest:
    """Under dedup, record where the step was saved (``saved_at``): a copy made by hand names it in errors."""
    if save.dedup is None:
        return manifest
    return dataclasses.replace(manifest, metadata={**manifest.metadata, "saved_at": save.path})


def check_shared(save: PreparedSave, manifest: Manifest) -> None:
    """Rank 0, before publishing: every shared file the manifest references exists with its size.

    Raises:
        CommitCheckError: naming the missing or wrong-sized files.
    """
    d = save.dedup
    shared = {f.path: f for f in manifest.files if is_shared_ref(f.path)}
    if d is None or not shared:
        return
    found: dict[str, int] = {}
    for sid in sorted({shared_dir(p) for p in shared}):
        sizes = (
            d.tiles.file_sizes(sid)
            if isinstance(d.tiles, ListsSizes)
            else {p: d.tiles.size(p) for p in d.tiles.list(sid)}
        )
        found.update({SHARED_REF + p: n for p, n in sizes.items()})
    problems = [
        f"{p}: {'missing' if found.get(p) is None else f'{found[p]} bytes instead of {f.nbytes}'}"
        for p, f in sorted(shared.items())
        if found.get(p) != f.nbytes
    ]
    if problems:
        missing = {p: f for p, f in shared.items() if p not in found}
        raise CommitCheckError(
            f"not committing {save.path}: {len(problems)} shared tile file(s) under {d.tiles.url} are not as the "
            f"manifest would reference them: {'; '.join(problems[:5])}{' ...' if len(problems) > 5 else ''}. "
            + why_missing(d.tiles, save.save_id, missing)
            + " The previous checkpoint is unchanged"
        )


def why_missing(tiles: Storage, save_id: str, missing: Mapping[str, FileEntry]) -> str:
    """Why shared files that save ``save_id`` references are missing, from the pins ``tiles`` still shows."""
    own = SHARED_REF + save_id + "/"
    writers = sorted({f.rank for p, f in missing.items() if p.startswith(own)})
    try:
        pinned = {p.rank for p in read_pins(tiles) if p.save_id == save_id}
    except Exception as e:
        return f"(Its pins could not be read to tell why: {e}.)"
    unpinned = [r for r in writers if r not in pinned]
    if unpinned:
        return (
            f"The pins of rank(s) {unpinned} of this save are gone too: a collection of the shared tile directory "
            "(a CheckpointManager's retention on this root, of this job or another) removed this save's new tiles "
            "and pins, judging the save over; a collection removes the pins of a save that has not claimed its path "
            f"only past their lease ({PIN_LEASE_S / 3600:g} h), so another process removed them, or the pins were deleted."
        )
    if writers:
        return (
            f"The pins of the ranks that wrote them ({writers}) are in place, so no collection removed them: the "
            "files were deleted by hand or by a job that ignores pins."
        )
    return (
        "They belong to the step this save builds on, which was still committed when this save pinned it: they "
        "were deleted by hand or by a job that ignores pins."
    )


def bytes_written(save: PreparedSave, manifest: Manifest) -> int:
    """Bytes of the files this save wrote: those of its manifest minus the shared tiles it references."""
    own = SHARED_REF + save.save_id + "/"
    return sum(f.nbytes for f in manifest.files if not is_shared_ref(f.path) or f.path.startswith(own))


def dirs_of(save: PreparedSave, manifest: Manifest) -> frozenset[str]:
    """The shared directories ``manifest`` references (empty without dedup)."""
    if save.dedup is None:
        return frozenset()
    return frozenset(shared_dir(f.path) for f in manifest.files if is_shared_ref(f.path))


def committed(save: PreparedSave, reports: Sequence[FileReport], outcome: CommitOutcome) -> None:
    """Every rank, once the save committed: hand the manager this rank's index for the next save."""
    d = save.dedup
    if d is None:
        return
    dtypes = {m.fqn: m.dtype for m in save.plan.rank_plan.metas}
    d.committed(next_index(save.save_id, save.path, save.chunking, reports, dtypes, outcome.shared_dirs))
