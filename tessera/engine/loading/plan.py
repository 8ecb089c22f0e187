"""Load planning: overlap the boxes a rank wants with the saved tiles, as coalesced range reads.

For every box a rank wants (a :class:`ReadTarget`), the saved tiles of the same tensor that
overlap it are found (by binary search over the tiles sorted by offset, then vectorised over
the few candidates); each overlap needs a set of the tile's checksum chunks. Needed chunks
of one file are coalesced into :class:`ReadRequest` range reads of bounded size; an overlap
that is a whole tile over contiguous target memory is read directly into the target. Pure: no I/O (the reads run in :mod:`tessera.engine.loading.read`); the
save-side counterpart is :mod:`tessera.engine.saving.plan`.
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ...errors import CorruptCheckpointError, CoverageError, StateMismatchError
from ...format.dtypes import dtype_from_name, itemsize
from ...format.geometry import Box, check_box_coverage, row_major_strides, split_box
from ...format.manifest import Manifest, Tile
from ..gc_pause import gc_paused_call

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReadTarget:
    """A box of a saved tensor to fill, and the caller's memory for it."""

    fqn: str
    box: Box
    data: torch.Tensor


@dataclass
class ReadCopy:
    fqn: str
    tile: Tile
    rel: Box  # the overlap, relative to the tile
    target: torch.Tensor  # caller memory shaped like rel.lengths
    dtype: torch.dtype
    span: tuple[int, int]  # chunk-aligned absolute byte range of the file this copy needs


@dataclass
class ReadRequest:
    """One range read of a file and the copies it feeds."""

    file: str
    start: int
    stop: int
    copies: list[ReadCopy] = field(default_factory=list)
    direct: bool = False

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


_CODED_READ_BYTES = 4 << 20
"""Logical bytes per read of a compressed file: a few frames, decoded while other threads read."""

_FEW_TILES = 16
"""Up to this many tiles, a tensor's tiles are tested against a box directly (no bisection)."""


class _TileIndex:
    """Which saved tiles of a tensor meet a box, found by binary search instead of a scan.

    Per tensor, built on first use and kept for the call: the tiles ordered by their first
    offset (a save stores them so; tiles in another order are sorted once) and the longest
    tile along the first dimension. The tiles that can meet a box then start in
    ``(box start - longest, box stop)``: one contiguous run of that order between two binary
    searches, so a target costs time in proportion to the tiles near it, not to the tensor's
    tile count (two passes over the tensor's first column, once, are all it costs besides).
    """

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self._sorted: dict[str, tuple[np.ndarray | None, np.ndarray, int]] = {}
        self._few: dict[str, tuple[list[list[int]], list[list[int]]]] = {}

    def overlaps(self, fqn: str, box: Box) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
        """``(tile index, lo, hi)`` of each tile that meets ``box`` (ascending): the
        intersection's corners in global coordinates."""
        table = self.manifest.tensors[fqn].table
        offs, lens = table.offsets, table.lengths
        if not offs.shape[1] or not len(offs):  # a 0-dim tensor: its one tile is the whole of it
            return [(i, (), ()) for i in range(len(offs))]
        if len(offs) <= _FEW_TILES:
            # A table narrowed to the tiles near the rank's boxes: plain Python over a few
            # tiles costs less than the numpy calls of a search (a load plan makes thousands).
            few = self._few.get(fqn)
            if few is None:
                few = self._few[fqn] = (offs.tolist(), (offs + lens).tolist())
            box_lo, box_hi = box.offsets, box.stops
            out = []
            for i, (o, e) in enumerate(zip(*few)):
                lo_i = tuple(map(max, o, box_lo))
                hi_i = tuple(map(min, e, box_hi))
                if all(map(operator.lt, lo_i, hi_i)):
                    out.append((i, lo_i, hi_i))
            return out
        key = self._sorted.get(fqn)
        if key is None:
            starts = offs[:, 0]
            order = None if bool((starts[1:] >= starts[:-1]).all()) else np.argsort(starts, kind="stable")
            if order is not None:
                starts = starts[order]
            key = self._sorted[fqn] = (order, starts, int(lens[:, 0].max()))
        order, starts, longest = key
        first = int(np.searchsorted(starts, box.offsets[0] - longest, side="right"))  # earlier tiles end before it
        stop = int(np.searchsorted(starts, box.stops[0], side="left"))  # later tiles start after it
        idx = np.arange(first, max(first, stop)) if order is None else np.sort(order[first:stop])
        near = offs[idx]
        lo = np.maximum(near, np.asarray(box.offsets, dtype=np.int64))
        hi = np.minimum(near + lens[idx], np.asarray(box.stops, dtype=np.int64))
        meet = (hi > lo).all(axis=1)
        return list(zip(idx[meet].tolist(), map(tuple, lo[meet].tolist()), map(tuple, hi[meet].tolist())))


def _check_disjoint(fqn: str, box: Box, hits: list[tuple[int, tuple[int, ...], tuple[int, ...]]], rank: int) -> None:
    """Raise unless the tiles' parts ``[lo, hi)`` inside ``box`` (of ``hits``, see
    :meth:`_TileIndex.overlaps`) are pairwise disjoint.

    With their volumes adding up to the box's, this proves the box is covered exactly once,
    whatever the rest of the tensor looks like (a load reads only this box).
    """
    if len(hits) <= 8:  # a few pairs: plain Python
        for x in range(len(hits)):
            _, lo_i, hi_i = hits[x]
            for y in range(x + 1, len(hits)):
                _, lo_j, hi_j = hits[y]
                if all(map(operator.lt, map(max, lo_i, lo_j), map(min, hi_i, hi_j))):
                    raise CorruptCheckpointError(
                        f"tensor '{fqn}': in box {box} that rank {rank} loads, the checkpoint's tiles meeting it at "
                        f"{list(lo_i)}..{list(hi_i)} and {list(lo_j)}..{list(hi_j)} overlap; "
                        "the manifest is inconsistent (run `tessera verify`)"
                    )
        return
    lo = np.array([h[1] for h in hits], dtype=np.int64)
    hi = np.array([h[2] for h in hits], dtype=np.int64)
    if len(lo) <= 64:
        meet = np.asarray((np.maximum(lo[:, None], lo[None]) < np.minimum(hi[:, None], hi[None])).all(axis=2))
        np.fill_diagonal(meet, False)
        if not meet.any():
            return
        i, j = (int(x) for x in np.argwhere(meet)[0])
        detail = (
            f"tiles meeting it at {lo[i].tolist()}..{hi[i].tolist()} and {lo[j].tolist()}..{hi[j].tolist()} overlap"
        )
    else:
        origin = np.asarray(box.offsets, dtype=np.int64)
        try:
            check_box_coverage(fqn, box.lengths, lo - origin, hi - lo)
            return
        except CoverageError as e:
            detail = str(e).removeprefix(f"tensor '{fqn}': ")
            detail = f"tiles overlap: {detail} (coordinates relative to the box)"
    raise CorruptCheckpointError(
        f"tensor '{fqn}': in box {box} that rank {rank} loads, the checkpoint's {detail}; "
        "the manifest is inconsistent (run `tessera verify`)"
    )


_EXACT_OVERLAP_ELEMENTS = 1 << 22
"""Up to this many elements, possible overlaps are settled exactly (one byte per element)."""


def _extent(t: torch.Tensor) -> int:
    """Elements from the first to one past the last that ``t`` can address."""
    return sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1


def _self_overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory (a zero stride, or a view like ``expand``)."""
    dims = sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1)
    reach = 0
    for s, n in dims:  # each stride must step past everything the smaller strides reach
        if s <= reach:
            break
        reach += s * (n - 1)
    else:
        return False
    if any(s == 0 for s, _ in dims) or t.numel() > _EXACT_OVERLAP_ELEMENTS:
        return True
    offsets = np.zeros(1, dtype=np.int64)
    for s, n in dims:
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64) * s).reshape(-1)
    return len(np.unique(offsets)) < len(offsets)


def check_targets(targets: Sequence[ReadTarget], rank: int) -> None:
    """Refuse targets that cannot be filled safely, before any byte is written to any of them.

    A target whose elements share memory (``torch.zeros(1).expand(10)``), two targets that
    partly overlap in memory, and inference tensors outside inference mode are refused.
    Two targets that are the very same view (tied weights listed under two names) are
    fine: both receive their saved bytes, the later one last.

    Raises:
        StateMismatchError: naming the tensors and the rank.
    """
    problems: list[str] = []
    spans: dict[tuple[str, int], list[tuple[int, int, ReadTarget]]] = {}
    for t in targets:
        d = t.data
        if d.numel() == 0:
            continue
        if d.is_inference() and not torch.is_inference_mode_enabled():
            problems.append(
                f"tensor '{t.fqn}' is an inference tensor; load it outside torch.inference_mode() into a normal tensor"
            )
            continue
        if _self_overlaps(d):
            problems.append(
                f"tensor '{t.fqn}': the target's elements share memory (shape {list(d.shape)}, strides {list(d.stride())}, "
                "e.g. from expand()); pass a tensor that owns each element, such as .clone()"
            )
            continue
        size = d.element_size()
        lo = d.data_ptr()
        key = (str(d.device), d.untyped_storage().data_ptr())
        spans.setdefault(key, []).append((lo, lo + _extent(d) * size, t))
    for group in spans.values():
        group.sort(key=lambda x: x[0])
        active: list[tuple[int, ReadTarget]] = []  # (end, target) of spans that may reach later ones
        for lo, hi, t in group:
            active = [(e, a) for e, a in active if e > lo]
            for _, a in active:
                if not _same_view(t.data, a.data) and _overlap(a.data, t.data):
                    problems.append(
                        f"tensors '{a.fqn}' and '{t.fqn}': the targets share memory (overlapping views of one "
                        "storage); loading one would overwrite the other"
                    )
            active.append((hi, t))
    if problems:
        raise StateMismatchError(f"rank {rank}: the state cannot be loaded into:\n  " + "\n  ".join(problems[:20]))


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr(), a.shape, a.stride(), a.dtype) == (b.data_ptr(), b.shape, b.stride(), b.dtype)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two views whose memory ranges intersect share a byte.

    Two dense views (no holes: contiguous, or a permutation of it) share one as soon as their
    byte ranges meet, whatever their size or dtype. Otherwise the question is settled
    exactly, one mark per byte, for views of up to :data:`_EXACT_OVERLAP_ELEMENTS` elements
    (strided column blocks of one matrix interleave without overlapping, and views of
    different dtypes are compared byte by byte); larger strided views that only interleave
    are let through rather than refused on a guess.
    """
    ranges = [(t.data_ptr(), t.data_ptr() + _extent(t) * t.element_size()) for t in (a, b)]
    if not (ranges[0][0] < ranges[1][1] and ranges[1][0] < ranges[0][1]):
        return False
    if _dense(a) and _dense(b):
        return True
    base = min(r[0] for r in ranges)
    span = max(r[1] for r in ranges) - base
    if max(a.numel(), b.numel()) > _EXACT_OVERLAP_ELEMENTS or span > 4 * _EXACT_OVERLAP_ELEMENTS:
        logger.debug(
            "targets of %d and %d elements interleave in memory; too large to check for overlap", a.numel(), b.numel()
        )
        return False
    marks = np.zeros(span, dtype=np.uint8)
    for t in (a, b):
        size = t.element_size()
        offsets = np.full(1, t.data_ptr() - base, dtype=np.int64)
        for n, st in zip(t.shape, t.stride()):
            offsets = (offsets[:, None] + np.arange(n, dtype=np.int64) * (st * size)).reshape(-1)
        offsets = (offsets[:, None] + np.arange(size, dtype=np.int64)).reshape(-1)
        if t is b:
            return bool(marks[offsets].any())
        marks[offsets] = 1
    return False


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory range without holes (any dimension order)."""
    expected = 1
    for s, n in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1):
        if s != expected:
            return False
        expected *= n
    return True


@gc_paused_call
def plan_reads(
    manifest: Manifest,
    targets: Sequence[ReadTarget],
    *,
    max_read_bytes: int = 32 << 20,
    rank: int = 0,
) -> list[ReadRequest]:
    """Range reads that fill every target, grouped and coalesced per file.

    Pure and local (no communication): each rank plans its own reads. The cost of a target
    is proportional to the saved tiles near its box, not to the tensor's tile count, and only
    the tensors that targets name are touched (a lazily decoded manifest decodes just those).

    Raises:
        CorruptCheckpointError: if the saved tiles do not cover a target's box exactly once
            (a gap or overlap in a damaged or hostile manifest).
        ManifestError: if a lazily decoded manifest's table of a target's tensor is invalid.
    """
    index = _TileIndex(manifest)
    chunking = manifest.tile_chunking
    # A compressed file's range is read, then decoded, by one thread: reading it in pieces lets
    # the pool's threads decode one piece while others read the next (docs/compression.md).
    coded = {f.path for f in manifest.files if f.frames is not None}
    coded_limit = min(max_read_bytes, _CODED_READ_BYTES)
    coded_step = max(chunking.chunk_bytes, coded_limit // chunking.chunk_bytes * chunking.chunk_bytes)
    by_file: dict[str, list[ReadCopy]] = {}
    direct: list[ReadRequest] = []
    for t in targets:
        if t.box.is_empty():
            continue
        entry = manifest.tensors[t.fqn]
        dtype = dtype_from_name(entry.dtype)
        size = itemsize(dtype)
        hits = index.overlaps(t.fqn, t.box)
        covered = sum(math.prod(map(operator.sub, hi, lo)) for _, lo, hi in hits)
        if covered != t.box.numel:
            raise CorruptCheckpointError(
                f"tensor '{t.fqn}': the checkpoint's tiles cover {covered} of the {t.box.numel} elements of box "
                f"{t.box} that rank {rank} loads; the manifest is inconsistent (run `tessera verify`)"
            )
        if len(hits) > 1:
            # Volumes prove coverage only if the tiles are disjoint (within the box).
            _check_disjoint(t.fqn, t.box, hits, rank)
        for i, lo, hi in hits:
            tile = entry.tile(i)
            chunk = chunking.of(tile.nbytes)
            inter = Box(lo, tuple(map(operator.sub, hi, lo)))
            tile_box = Box(tile.offsets, tile.lengths)
            if inter == t.box or not t.data.dim():  # the whole target (no view to cut: a few us each)
                view = t.data
            else:
                view = t.data[inter.relative_to(t.box).slices()]
            rel = inter.relative_to(tile_box)
            whole = inter == tile_box
            if (
                whole
                and view.device.type == "cpu"
                and view.dtype == dtype
                and view.is_contiguous()
                and tile.nbytes <= 4 * max_read_bytes
            ):
                # in whole chunks of the tile (a multiple of its chunk size)
                step = max(chunk, coded_limit // chunk * chunk) if tile.file in coded else tile.nbytes
                for a in range(0, max(tile.nbytes, 1), max(step, 1)):
                    span = (tile.byte_offset + a, tile.byte_offset + min(tile.nbytes, a + step))
                    direct.append(
                        ReadRequest(tile.file, *span, [ReadCopy(t.fqn, tile, rel, view, dtype, span)], direct=True)
                    )
                continue
            for piece in split_box(rel, size, max_read_bytes, within=tile.lengths):
                first, last = _byte_span(piece, tile.lengths, size)
                a = first // chunk * chunk
                b = min(tile.nbytes, -(-last // chunk) * chunk)
                target = view[piece.relative_to(rel).slices()] if view.dim() else view
                by_file.setdefault(tile.file, []).append(
                    ReadCopy(t.fqn, tile, piece, target, dtype, (tile.byte_offset + a, tile.byte_offset + b))
                )
    requests = direct
    for file, copies in by_file.items():
        copies.sort(key=lambda c: c.span)
        cur: ReadRequest | None = None
        most = coded_step if file in coded else max_read_bytes
        for c in copies:
            if cur is not None and c.span[0] <= cur.stop and max(cur.stop, c.span[1]) - cur.start <= most:
                cur.stop = max(cur.stop, c.span[1])
                cur.copies.append(c)
            else:
                cur = ReadRequest(file, c.span[0], c.span[1], [c])
                requests.append(cur)
    return requests


def _byte_span(rel: Box, tile_lengths: tuple[int, ...], size: int) -> tuple[int, int]:
    """``[first, last)`` bytes of the tile that ``rel`` touches: from its first element to just
    past its last, in row-major order (O(ndim): no walk over the box's rows)."""
    strides = row_major_strides(tile_lengths)
    first = sum(o * s for o, s in zip(rel.offsets, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(rel.offsets, rel.lengths, strides))
    return first * size, (last + 1) * size
