"""Check a checkpoint end to end without loading it: files, headers, checksums, coverage.

:func:`verify` reads every byte of every tile once, streaming through small per-thread
buffers (memory stays bounded whatever the checkpoint or chunk size), and reports every
problem it finds instead of stopping at the first. Each problem names the tensor, the data
file and the rank that wrote the file (``FileEntry.rank``). The ``tessera verify`` command
is built on it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import xxhash

from . import _knobs
from .errors import CorruptCheckpointError, CoverageError, ManifestError, PickleNotAllowedError
from .geometry import Box, check_box_coverage
from .manifest import MANIFEST_NAME, FileEntry, Manifest, TensorEntry, Tile, decode, read_bytes
from .safetensors_header import parse_header
from .storage import Storage, storage_for
from .tilefile import tile_key
from .values import decode_value

logger = logging.getLogger(__name__)

_BUFFER_BYTES = 8 << 20
"""Bytes read at a time per thread; with the thread count this bounds verify's memory."""
_MAX_PROBLEMS_PER_FILE = 20
"""Problems of one kind reported per data file; the rest are counted in one summary."""
_MAX_COORD = 1 << 62
"""Shapes beyond this cannot be checked with int64 arithmetic; no real tensor is that big."""


class ProblemKind(str, Enum):
    """What kind of defect a :class:`Problem` is."""

    MANIFEST = "manifest"
    """``manifest.json`` is missing (not committed), unreadable or invalid."""
    MISSING_FILE = "missing_file"
    """A data file the manifest refers to does not exist."""
    FILE_SIZE = "file_size"
    """A data file is shorter (truncated) or longer than the manifest records."""
    HEADER = "header"
    """A data file is not a valid safetensors file, or its header disagrees with the manifest."""
    CHECKSUM = "checksum"
    """A tile's bytes do not match the recorded checksums (corrupted data, or a wrong offset)."""
    READ = "read"
    """The storage failed while reading a file."""
    COVERAGE = "coverage"
    """A tensor's tiles leave a gap, overlap, or lie outside it."""
    VALUE = "value"
    """A plain value in the manifest is not a valid encoding."""


@dataclass(frozen=True)
class Problem:
    """One defect found by :func:`verify`.

    Attributes:
        kind: what kind of defect.
        message: a full sentence naming the tensor, file and rank where they apply.
        tensor: the tensor (or value) concerned, if any.
        file: the data file concerned, relative to the checkpoint, if any.
        rank: the rank that wrote ``file``, if known.
    """

    kind: ProblemKind
    message: str
    tensor: str | None = None
    file: str | None = None
    rank: int | None = None

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class VerifyReport:
    """The outcome of :func:`verify`.

    Attributes:
        path: the checkpoint checked.
        save_id: its save id (None if the manifest could not be read).
        problems: every defect found (empty when the checkpoint is intact).
        tensors: tensors checked.
        tiles: tiles checked.
        files: data files the manifest refers to.
        bytes_checked: tile bytes read and checksummed.
        seconds: how long verification took.
        unreferenced_files: files under ``data/`` no manifest entry refers to (left by an
            unfinished save, harmless; the next successful save removes them).
        pickled_values: values stored with pickle (they load only with ``allow_pickle=True``).
    """

    path: str
    save_id: str | None
    problems: tuple[Problem, ...]
    tensors: int = 0
    tiles: int = 0
    files: int = 0
    bytes_checked: int = 0
    seconds: float = 0.0
    unreferenced_files: tuple[str, ...] = ()
    pickled_values: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """Whether no problem was found."""
        return not self.problems

    def summary(self, limit: int = 20) -> str:
        """A human-readable summary, listing up to ``limit`` problems."""
        head = (
            f"{self.path}: {'OK' if self.ok else f'{len(self.problems)} problem(s)'} "
            f"({self.tensors} tensors, {self.tiles} tiles, {self.files} files, "
            f"{self.bytes_checked} bytes checked in {self.seconds:.2f}s)"
        )
        lines = [head] + [f"  [{p.kind.value}] {p.message}" for p in self.problems[:limit]]
        if len(self.problems) > limit:
            lines.append(f"  ... and {len(self.problems) - limit} more")
        return "\n".join(lines)

    def raise_if_failed(self) -> None:
        """Raise if any problem was found.

        Raises:
            CorruptCheckpointError: with :meth:`summary` as its message.
        """
        if self.problems:
            raise CorruptCheckpointError(self.summary())


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
class _FileResult:
    problems: list[Problem] = field(default_factory=list)
    bytes_checked: int = 0


def verify(path: str, *, storage: Storage | None = None, threads: int | None = None) -> VerifyReport:
    """Verify the committed checkpoint at ``path`` without loading it.

    Checks that the manifest is valid; that every data file it refers to exists with the
    recorded size and is a safetensors file whose header agrees with the manifest; that
    every chunk of every tile matches its checksum; that the tiles of every tensor cover
    it exactly once; and that every plain value decodes. Reads each tile byte once, with at
    most ``threads`` buffers of 8 MiB. Needs no process group; run it on one process.

    Args:
        path: directory or URL of the checkpoint.
        storage: a backend instance to use instead of choosing one from ``path``.
        threads: files checked at once (default ``TESSERA_IO_THREADS``).

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is True when nothing is wrong. Problems are
        reported, not raised (use ``report.raise_if_failed()`` to raise).

    Example:
        >>> report = tessera.verify("/ckpt/run1/step-00000100")
        >>> if not report.ok:
        ...     print(report.summary())
    """
    t0 = time.monotonic()
    store = storage_for(path, storage)
    try:
        data = read_bytes(store, f"{path}/{MANIFEST_NAME}")
    except ManifestError as e:  # oversized: refused before reading it
        return VerifyReport(
            path, None, (Problem(ProblemKind.MANIFEST, str(e), file=MANIFEST_NAME),), seconds=time.monotonic() - t0
        )
    except FileNotFoundError:
        msg = (
            f"{path}: no {MANIFEST_NAME}; this is not a committed checkpoint (never saved, or the save did not finish)"
        )
        return VerifyReport(
            path, None, (Problem(ProblemKind.MANIFEST, msg, file=MANIFEST_NAME),), seconds=time.monotonic() - t0
        )
    except Exception as e:
        msg = f"{path}: reading {MANIFEST_NAME} failed: {type(e).__name__}: {e}"
        return VerifyReport(
            path, None, (Problem(ProblemKind.READ, msg, file=MANIFEST_NAME),), seconds=time.monotonic() - t0
        )
    try:
        manifest = decode(data, source=f"{path}/{MANIFEST_NAME}")
    except ManifestError as e:
        return VerifyReport(
            path, None, (Problem(ProblemKind.MANIFEST, str(e), file=MANIFEST_NAME),), seconds=time.monotonic() - t0
        )
    except Exception as e:
        msg = f"{path}/{MANIFEST_NAME}: invalid manifest ({type(e).__name__} in the decoder: {e})"
        return VerifyReport(
            path, None, (Problem(ProblemKind.MANIFEST, msg, file=MANIFEST_NAME),), seconds=time.monotonic() - t0
        )

    problems: list[Problem] = []
    problems += _check_coverage(manifest)
    pickled = _check_values(manifest, problems)
    by_file = _tiles_by_file(manifest)
    n = max(1, threads if threads is not None else _knobs.io_threads())
    checked = 0
    with ThreadPoolExecutor(
        max_workers=min(n, max(1, len(manifest.files))), thread_name_prefix="tessera-verify"
    ) as pool:
        futures = [
            pool.submit(_check_file, store, manifest, f, by_file.get(i, [])) for i, f in enumerate(manifest.files)
        ]
        for fut in futures:
            res = fut.result()
            problems += res.problems
            checked += res.bytes_checked
    unreferenced = _unreferenced(store, manifest)
    report = VerifyReport(
        path=path,
        save_id=manifest.save_id,
        problems=tuple(problems),
        tensors=len(manifest.tensors),
        tiles=sum(e.num_tiles for e in manifest.tensors.values()),
        files=len(manifest.files),
        bytes_checked=checked,
        seconds=time.monotonic() - t0,
        unreferenced_files=tuple(unreferenced),
        pickled_values=tuple(pickled),
    )
    logger.info("verified %s: %d problem(s), %d bytes in %.2fs", path, len(problems), checked, report.seconds)
    return report


_Group = tuple[str, TensorEntry, np.ndarray]
"""Tiles of one tensor in one file: (tensor name, entry, tile indices into its table)."""


def _tiles_by_file(manifest: Manifest) -> dict[int, list[_Group]]:
    """File index -> the tiles stored in it, as index arrays (no per-tile objects)."""
    out: dict[int, list[_Group]] = {}
    for fqn, entry in manifest.tensors.items():
        fidx = entry.table.file
        if not len(fidx):
            continue
        order = np.argsort(fidx, kind="stable")
        files, starts = np.unique(fidx[order], return_index=True)
        for f, group in zip(files.tolist(), np.split(order, starts[1:])):
            out.setdefault(f, []).append((fqn, entry, group))
    return out


def _iter_tiles(groups: list[_Group]) -> Iterator[tuple[str, Tile]]:
    for fqn, entry, idx in groups:
        for i in idx.tolist():
            yield fqn, entry.tile(i)


def _check_coverage(manifest: Manifest) -> list[Problem]:
    problems = []
    for fqn, entry in manifest.tensors.items():
        shape = entry.shape
        if any(s >= _MAX_COORD for s in shape) or math.prod(shape) >= _MAX_COORD:
            problems.append(
                Problem(ProblemKind.COVERAGE, f"tensor '{fqn}': shape {list(shape)} is implausibly large", tensor=fqn)
            )
            continue
        table = entry.table
        nd = len(shape)
        # The decoder keeps coordinates below 2**62, so these sums cannot wrap in int64.
        outside = (
            np.flatnonzero((table.offsets + table.lengths > np.asarray(shape, dtype=np.int64)).any(axis=1))
            if nd
            else []
        )
        if len(outside):
            t = entry.tile(int(outside[0]))
            problems.append(
                Problem(
                    ProblemKind.COVERAGE,
                    f"tensor '{fqn}': tile {Box(t.offsets, t.lengths)} in '{t.file}' lies outside its shape {list(shape)}",
                    tensor=fqn,
                    file=t.file,
                )
            )
            continue
        boxes = np.concatenate([table.offsets, table.lengths], axis=1).reshape(len(table), 2 * nd)
        if len(boxes):  # identical boxes are replicas
            boxes = np.unique(boxes, axis=0) if nd else boxes[:1]
        try:
            check_box_coverage(fqn, shape, boxes[:, :nd], boxes[:, nd:])
        except CoverageError as e:
            files = [table.paths[i] for i in np.unique(table.file)[:5].tolist()]
            where = (
                f" (tiles in {', '.join(repr(f) for f in files[:4])}{' ...' if len(files) > 4 else ''})"
                if files
                else ""
            )
            problems.append(Problem(ProblemKind.COVERAGE, f"{e}{where}", tensor=fqn))
    return problems


def _check_values(manifest: Manifest, problems: list[Problem]) -> list[str]:
    pickled = []
    items = [(k, v) for k, v in manifest.values.items()]
    items += [(k, v) for k, e in manifest.per_rank.items() for v in e.values]
    for name, encoded in items:
        try:
            decode_value(encoded, name, allow_pickle=False)
        except PickleNotAllowedError:
            if name not in pickled:
                pickled.append(name)
        except (ManifestError, RecursionError) as e:
            problems.append(Problem(ProblemKind.VALUE, f"value '{name}': {e}", tensor=name))
    return pickled


def _names(groups: list[_Group], limit: int = 5) -> str:
    names = sorted({fqn for fqn, _, _ in groups})
    shown = ", ".join(f"'{n}'" for n in names[:limit])
    return shown + (f" ... ({len(names)} tensors)" if len(names) > limit else "")


def _check_file(store: Storage, manifest: Manifest, entry: FileEntry, tiles: list[_Group]) -> _FileResult:
    out = _FileResult()
    where = f"file '{entry.path}' (written by rank {entry.rank})"

    def problem(kind: ProblemKind, message: str, fqn: str | None = None) -> None:
        out.problems.append(Problem(kind, message, tensor=fqn, file=entry.path, rank=entry.rank))

    try:
        size = store.size(entry.path)
    except FileNotFoundError:
        problem(
            ProblemKind.MISSING_FILE,
            f"{where} is missing; it holds tensor(s) {_names(tiles)}",
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
    buf = bytearray(min(_BUFFER_BYTES, max(size, 1)))
    _check_header(store, entry, size, tiles, problem, _saved_names(manifest))
    _check_checksums(store, manifest, entry, size, tiles, buf, problem, out)
    return out


def _saved_names(manifest: Manifest) -> dict[str, str]:
    """Tensor name -> the name its tiles carry in data files (differs after ``tessera rename``)."""
    names = manifest.metadata.get("tile_names")
    return {str(k): str(v) for k, v in names.items()} if isinstance(names, dict) else {}


def _check_header(
    store: Storage, entry: FileEntry, size: int, tiles: list[_Group], problem: _Report, saved: dict[str, str]
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
    for fqn, tile in _iter_tiles(tiles):
        key = tile_key(saved.get(fqn, fqn), Box(tile.offsets, tile.lengths))
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
                f"tensor '{fqn}' tile {Box(tile.offsets, tile.lengths)} in {where}: the file's safetensors header "
                f"{found} for key '{key}', the manifest says {want} (bytes [{tile.byte_offset}, "
                f"{tile.byte_offset + tile.nbytes}) of the file); the manifest does not match the data",
                fqn,
            )
    if mismatched > _MAX_PROBLEMS_PER_FILE:
        problem(
            ProblemKind.HEADER,
            f"{where}: {mismatched - _MAX_PROBLEMS_PER_FILE} more tile(s) disagree with the file's safetensors header",
        )


def _segments(manifest: Manifest, groups: list[_Group]) -> Iterator[_Segment]:
    """Every checksum chunk of the file's tiles in file order, from arrays (bounded memory)."""
    chunk = manifest.chunk_bytes
    cols: list[tuple[np.ndarray, ...]] = []
    for g, (_, entry, idx) in enumerate(groups):
        t = entry.table
        counts = t.chunks[idx]
        tile = np.repeat(idx, counts)  # one row per chunk
        k = np.arange(len(tile), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        cols.append((np.full(len(tile), g, dtype=np.int64), tile, k, t.byte_offset[tile] + k * chunk))
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
        a = t_obj.byte_offset + kk * chunk
        yield _Segment(a, min(a + chunk, t_obj.byte_offset + t_obj.nbytes), t_obj.checksums[kk], fqn, t_obj, kk)


def _check_checksums(
    store: Storage,
    manifest: Manifest,
    entry: FileEntry,
    size: int,
    tiles: list[_Group],
    buf: bytearray,
    problem: _Report,
    out: _FileResult,
) -> None:
    where = f"file '{entry.path}' (written by rank {entry.rank})"
    view = memoryview(buf)
    block = (0, 0)  # file bytes currently in ``buf``
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
                    store.read_into(entry.path, pos, view[:n])
                    block = (pos, pos + n)
                stop = min(seg.stop, block[1])
                hasher.update(view[pos - block[0] : stop - block[0]])
                out.bytes_checked += stop - pos
                pos = stop
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


def _unreferenced(store: Storage, manifest: Manifest) -> list[str]:
    referenced = {f.path for f in manifest.files}
    try:
        return [p for p in store.list("data") if p not in referenced]
    except Exception as e:
        logger.debug("listing data/ under %s failed: %s", store.url, e)
        return []
