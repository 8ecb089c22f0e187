"""The per-file checks of :func:`tessera.verify`: existence, size, safetensors header, checksums.

Each data file is checked on its own (files run in parallel threads): its size against the
manifest, its header (parsed by :mod:`tessera.format.safetensors_header`) against the tiles the
manifest places in it, and every checksum chunk of those tiles, streamed through a small
per-thread buffer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import xxhash

from ..errors import MissingTilesError
from ..format.codec import FrameError, file_header
from ..format.dtypes import dtype_from_name
from ..format.geometry import Box
from ..format.manifest import SECTIONED_VERSIONS, FileEntry, Manifest, TensorEntry, Tile, sections_path
from ..format.safetensors_header import parse_header
from ..format.tilefile import tile_header_entry, tile_key
from ..results import Problem, ProblemKind
from ..storage import Storage
from .frames import read_logical

logger = logging.getLogger(__name__)

_BUFFER_BYTES = 8 << 20
"""Bytes read at a time per thread; with the thread count this bounds verify's memory."""
_MAX_PROBLEMS_PER_FILE = 20
"""Problems of one kind reported per data file; the rest are counted in one summary."""


@dataclass
class _Segment:
    """One checksum chunk of one tile: the file bytes ``[start, stop)`` and their xxh3-64."""

    start: int
    stop: int
    expected: int
    fqn: str
    tile: Tile
    index: int


_Report = Callable[..., None]
"""Records a problem about the file being checked: ``(kind, message, tensor=None)``."""


@dataclass
class FileResult:
    problems: list[Problem] = field(default_factory=list)
    bytes_checked: int = 0


TileGroup = tuple[str, TensorEntry, np.ndarray]
"""Tiles of one tensor in one file: (tensor name, entry, tile indices into its table)."""


def tiles_by_file(manifest: Manifest) -> dict[int, list[TileGroup]]:
    """File index -> the tiles stored in it, as index arrays (no per-tile objects)."""
    out: dict[int, list[TileGroup]] = {}
    for fqn, entry in manifest.tensors.items():
        fidx = entry.table.file
        if not len(fidx):
            continue
        order = np.argsort(fidx, kind="stable")
        files, starts = np.unique(fidx[order], return_index=True)
        for f, group in zip(files.tolist(), np.split(order, starts[1:])):
            out.setdefault(f, []).append((fqn, entry, group))
    return out


def iter_tiles(groups: list[TileGroup]) -> Iterator[tuple[str, Tile]]:
    for fqn, entry, idx in groups:
        for i in idx.tolist():
            yield fqn, entry.tile(i)


def _names(groups: list[TileGroup], limit: int = 5) -> str:
    names = sorted({fqn for fqn, _, _ in groups})
    shown = ", ".join(f"'{n}'" for n in names[:limit])
    return shown + (f" ... ({len(names)} tensors)" if len(names) > limit else "")


def check_file(store: Storage, manifest: Manifest, entry: FileEntry, tiles: list[TileGroup]) -> FileResult:
    out = FileResult()
    where = f"file '{entry.path}' (written by rank {entry.rank})"

    def problem(kind: ProblemKind, message: str, fqn: str | None = None) -> None:
        out.problems.append(Problem(kind, message, tensor=fqn, file=entry.path, rank=entry.rank))

    try:
        size = store.size(entry.path)
    except FileNotFoundError as e:
        why = f" ({e})" if isinstance(e, MissingTilesError) else ""
        problem(
            ProblemKind.MISSING_FILE,
            f"{where} is missing; it holds tensor(s) {_names(tiles)}{why}",
            tiles[0][0] if tiles else None,
        )
        return out
    except Exception as e:
        problem(ProblemKind.READ, f"{where}: cannot stat it: {type(e).__name__}: {e}", tiles[0][0] if tiles else None)
        return out
    if size != entry.nbytes:
        how = "truncated" if size < entry.nbytes else "longer than recorded"
        problem(
            ProblemKind.FILE_SIZE,
            f"{where} is {how}: {size} bytes, the manifest records {entry.nbytes}; it holds tensor(s) {_names(tiles)}",
            tiles[0][0] if tiles else None,
        )
    buf = bytearray(min(_BUFFER_BYTES, max(entry.logical_bytes, 1)))
    if entry.frames is None:
        _check_header(store, entry, size, tiles, problem, _saved_names(manifest))
    else:
        _check_frames_header(store, entry, size, problem)
    _check_checksums(store, manifest, entry, size, tiles, buf, problem, out)
    return out


def _check_frames_header(store: Storage, entry: FileEntry, size: int, problem: _Report) -> None:
    """A compressed file starts with the frames header (its frames are checked with the checksums)."""
    head = file_header()
    raw = bytearray(min(len(head), size))
    try:
        store.read_into(entry.path, 0, memoryview(raw))
    except Exception as e:
        problem(ProblemKind.READ, f"file '{entry.path}' (written by rank {entry.rank}): {type(e).__name__}: {e}")
        return
    if bytes(raw) != head:
        problem(
            ProblemKind.HEADER,
            f"file '{entry.path}' (written by rank {entry.rank}) is compressed (the manifest has its frames) but does "
            "not start with the frames header",
        )


def _saved_names(manifest: Manifest) -> dict[str, str]:
    """Tensor name -> the name its tiles carry in data files (differs after ``tessera rename``)."""
    names = manifest.metadata.get("tile_names")
    return {str(k): str(v) for k, v in names.items()} if isinstance(names, dict) else {}


def _check_header(
    store: Storage, entry: FileEntry, size: int, tiles: list[TileGroup], problem: _Report, saved: dict[str, str]
) -> None:
    where = f"file '{entry.path}' (written by rank {entry.rank})"

    def read(start: int, n: int) -> bytes:
        raw = bytearray(n)
        store.read_into(entry.path, start, memoryview(raw))
        return bytes(raw)

    try:
        header, base = parse_header(read, size)
    except Exception as e:
        problem(ProblemKind.HEADER, f"{where} is not a valid safetensors file: {type(e).__name__}: {e}")
        return
    mismatched = 0
    dtypes = {fqn: entry.dtype for fqn, entry, _ in tiles}
    for fqn, tile in iter_tiles(tiles):
        box = Box(tile.offsets, tile.lengths)
        key = tile_key(saved.get(fqn, fqn), box)
        info = header.get(key)
        want = [tile.byte_offset - base, tile.byte_offset - base + tile.nbytes]
        got = info.get("data_offsets") if isinstance(info, dict) else None
        if got != want:
            mismatched += 1
            if mismatched > _MAX_PROBLEMS_PER_FILE:  # counted, summarised below: memory stays bounded
                continue
            found = "has no entry" if info is None else f"has data_offsets {got!r:.60}"
            problem(
                ProblemKind.HEADER,
                f"tensor '{fqn}' tile {box} in {where}: the file's safetensors header "
                f"{found} for key '{key}', the manifest says {want} (bytes [{tile.byte_offset}, "
                f"{tile.byte_offset + tile.nbytes}) of the file); the manifest does not match the data",
                fqn,
            )
            continue
        # The bytes are where the manifest says; a header that describes them as another dtype
        # or shape still makes every other safetensors reader return wrong values.
        code, shape = tile_header_entry(dtype_from_name(dtypes[fqn]), tile.lengths)
        got_code, got_shape = (info.get("dtype"), info.get("shape")) if isinstance(info, dict) else (None, None)
        if got_code != code or got_shape != shape:
            mismatched += 1
            if mismatched > _MAX_PROBLEMS_PER_FILE:
                continue
            problem(
                ProblemKind.HEADER,
                f"tensor '{fqn}' tile {box} in {where}: the file's safetensors header describes key '{key}' as "
                f"dtype {got_code!r:.30} shape {got_shape!r:.80}, the manifest as dtype '{code}' shape {shape} "
                f"({dtypes[fqn]}); other safetensors readers would read wrong values from this file",
                fqn,
            )
    if mismatched > _MAX_PROBLEMS_PER_FILE:
        problem(
            ProblemKind.HEADER,
            f"{where}: {mismatched - _MAX_PROBLEMS_PER_FILE} more tile(s) disagree with the file's safetensors header",
        )


def _segments(manifest: Manifest, groups: list[TileGroup]) -> Iterator[_Segment]:
    """Every checksum chunk of the file's tiles in file order, from arrays (bounded memory)."""
    chunking = manifest.tile_chunking
    cols: list[tuple[np.ndarray, ...]] = []
    for g, (_, entry, idx) in enumerate(groups):
        t = entry.table
        counts = t.chunks[idx]
        tile = np.repeat(idx, counts)  # one row per chunk
        k = np.arange(len(tile), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        cols.append(
            (np.full(len(tile), g, dtype=np.int64), tile, k, t.byte_offset[tile] + k * chunking.sizes(t.nbytes[tile]))
        )
    if not cols:
        return
    group, tile, k, start = (np.concatenate(c) for c in zip(*cols))
    order = np.argsort(start, kind="stable")
    current: tuple[int, int] = (-1, -1)
    t_obj: Tile | None = None
    for j in order.tolist():
        g, i, kk = int(group[j]), int(tile[j]), int(k[j])
        fqn, entry, _ = groups[g]
        if (g, i) != current:
            current, t_obj = (g, i), entry.tile(i)
        assert t_obj is not None
        chunk = chunking.of(t_obj.nbytes)
        a = t_obj.byte_offset + kk * chunk
        yield _Segment(a, min(a + chunk, t_obj.byte_offset + t_obj.nbytes), t_obj.checksums[kk], fqn, t_obj, kk)


def _check_checksums(
    store: Storage,
    manifest: Manifest,
    entry: FileEntry,
    size: int,
    tiles: list[TileGroup],
    buf: bytearray,
    problem: _Report,
    out: FileResult,
) -> None:
    where = f"file '{entry.path}' (written by rank {entry.rank})"
    view = memoryview(buf)
    block = (0, 0)  # file bytes currently in ``buf`` (a compressed file's: logical bytes, decoded)
    frames = entry.frames
    tables = {f.path: f.frames for f in manifest.files}
    if frames is not None:
        if size != entry.nbytes:
            return  # reported above; the frames cannot be located in a file of another size
        size = frames.logical_end
    # Per damaged tile: its first bad chunk and how many; reported for the first
    # _MAX_PROBLEMS_PER_FILE tiles, counted for the rest (memory stays bounded).
    bad: dict[tuple[str, tuple[int, ...]], list] = {}
    more_bad = 0
    cut: set[tuple[str, tuple[int, ...]]] = set()
    for seg in _segments(manifest, tiles):
        key = (seg.fqn, seg.tile.offsets)
        if key in cut:
            continue
        if seg.stop > size:
            cut.add(key)
            if len(cut) > _MAX_PROBLEMS_PER_FILE:
                continue
            problem(
                ProblemKind.FILE_SIZE,
                f"tensor '{seg.fqn}' tile {Box(seg.tile.offsets, seg.tile.lengths)}: its bytes "
                f"[{seg.tile.byte_offset}, {seg.tile.byte_offset + seg.tile.nbytes}) run past the end of {where} "
                f"({size} bytes); the file is truncated",
                seg.fqn,
            )
            continue
        hasher = xxhash.xxh3_64()
        pos = seg.start
        try:
            while pos < seg.stop:
                if not block[0] <= pos < block[1]:
                    n = min(len(buf), size - pos)
                    if frames is None:
                        store.read_into(entry.path, pos, view[:n])
                    else:
                        read_logical(store, entry.path, frames, pos, view[:n], tables=tables)
                    block = (pos, pos + n)
                stop = min(seg.stop, block[1])
                hasher.update(view[pos - block[0] : stop - block[0]])
                out.bytes_checked += stop - pos
                pos = stop
        except FrameError as e:
            problem(
                ProblemKind.CHECKSUM,
                f"tensor '{seg.fqn}' tile {Box(seg.tile.offsets, seg.tile.lengths)} in {where}: a frame holding "
                f"logical byte {pos} is corrupted: {e}",
                seg.fqn,
            )
            return
        except Exception as e:
            problem(ProblemKind.READ, f"reading {where} at byte {pos} failed: {type(e).__name__}: {e}", seg.fqn)
            return
        if hasher.intdigest() != seg.expected:
            if key in bad:
                bad[key][1] += 1
            elif len(bad) < _MAX_PROBLEMS_PER_FILE:
                bad[key] = [seg, 1]
            else:
                more_bad += 1
    for (fqn, _), (first, count) in bad.items():
        tile = first.tile
        problem(
            ProblemKind.CHECKSUM,
            f"tensor '{fqn}' tile {Box(tile.offsets, tile.lengths)} in {where}: checksum mismatch in "
            f"{count} of {len(tile.checksums)} chunk(s), first at file bytes [{first.start}, {first.stop}); "
            "the data is corrupted (or the manifest's offsets or checksums are wrong)",
            fqn,
        )
    if more_bad:
        problem(ProblemKind.CHECKSUM, f"{where}: {more_bad} more chunk(s) of other tiles do not match their checksums")
    if len(cut) > _MAX_PROBLEMS_PER_FILE:
        problem(ProblemKind.FILE_SIZE, f"{where}: {len(cut) - _MAX_PROBLEMS_PER_FILE} more tile(s) run past its end")


def unreferenced_files(store: Storage, manifest: Manifest) -> list[str]:
    referenced = {f.path for f in manifest.files}
    if manifest.version in SECTIONED_VERSIONS:  # the index refers to its sections file
        referenced.add(sections_path(manifest.save_id))
    try:
        return [p for p in store.list("data") if p not in referenced]
    except Exception as e:
        logger.debug("listing data/ under %s failed: %s", store.url, e)
        return []
