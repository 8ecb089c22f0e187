"""Boxes of global tensors: overlap, flat-range decomposition, contiguous runs, coverage.

Everything here is pure (no torch, no I/O, no communication). A *box* is a rectangular
region of a global tensor given by per-dimension offsets and lengths; a 0-dim tensor has
one box with empty offsets and lengths. Coverage checks work on numpy arrays so that the
global plan of thousands of ranks stays fast.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import CoverageError


@dataclass(frozen=True)
class Box:
    """A rectangular region of a global tensor.

    Attributes:
        offsets: global index of the first element in each dimension.
        lengths: extent in each dimension (may be 0: an empty box).
    """

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        offsets, lengths = self.offsets, self.lengths
        if len(offsets) != len(lengths):
            raise ValueError(f"box offsets {offsets} and lengths {lengths} differ in rank")
        if offsets and (min(offsets) < 0 or min(lengths) < 0):  # min: C speed (a load plan makes thousands)
            raise ValueError(f"box offsets {offsets} / lengths {lengths} must be >= 0")

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Box:
        """The box covering a whole tensor of ``shape``."""
        return cls((0,) * len(shape), tuple(int(s) for s in shape))

    @property
    def ndim(self) -> int:
        return len(self.lengths)

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    @property
    def stops(self) -> tuple[int, ...]:
        return tuple(o + n for o, n in zip(self.offsets, self.lengths))

    def is_empty(self) -> bool:
        return self.numel == 0

    def fits_in(self, shape: Sequence[int]) -> bool:
        """Whether the box lies inside a tensor of ``shape``."""
        return len(shape) == self.ndim and all(s <= d for s, d in zip(self.stops, shape))

    def relative_to(self, outer: Box) -> Box:
        """This box in the coordinates of ``outer`` (which must contain it)."""
        return Box(tuple(a - b for a, b in zip(self.offsets, outer.offsets)), self.lengths)

    def slices(self) -> tuple[slice, ...]:
        """Index with these to cut the box out of a tensor laid out like its container."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.lengths))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(self.offsets, self.lengths)) + "]"


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes of the same tensor, or None if they do not overlap.

    For 0-dim boxes the overlap is the (single-element) box itself.
    """
    if a.ndim != b.ndim:
        raise ValueError(f"cannot intersect boxes of rank {a.ndim} and {b.ndim}")
    offsets = []
    lengths = []
    for ao, an, bo, bn in zip(a.offsets, a.lengths, b.offsets, b.lengths):
        lo = max(ao, bo)
        hi = min(ao + an, bo + bn)
        if hi <= lo:
            return None
        offsets.append(lo)
        lengths.append(hi - lo)
    return Box(tuple(offsets), tuple(lengths))


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a contiguous row-major tensor of ``shape``."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * int(shape[d + 1])
    return tuple(strides)


def split_even(box: Box, parts: int, dim: int | None = None) -> list[Box]:
    """Cut ``box`` into ``parts`` slabs of near-equal length along one dimension.

    The slabs are in order and cover the box exactly once; slab ``i`` spans
    ``[n * i // parts, n * (i + 1) // parts)`` of the dimension's length ``n``.

    Args:
        box: the box to cut.
        parts: how many slabs; clamped to ``[1, n]``.
        dim: the dimension to cut; by default the first one longer than 1.

    Returns:
        The slabs; ``[box]`` when there is nothing to cut.

    Example:
        >>> [str(b) for b in split_even(Box((0, 0), (5, 2)), 2)]
        ['[0:2, 0:2]', '[2:5, 0:2]']
    """
    if dim is None:
        dim = next((d for d in range(box.ndim) if box.lengths[d] > 1), None)
        if dim is None:
            return [box]
    n = box.lengths[dim]
    parts = max(1, min(parts, n))
    if parts == 1:
        return [box]
    return [
        _with_dim(box, dim, box.offsets[dim] + n * i // parts, n * (i + 1) // parts - n * i // parts)
        for i in range(parts)
    ]


def split_box(box: Box, itemsize: int, max_bytes: int, *, within: Sequence[int] | None = None) -> list[Box]:
    """Cut ``box`` into row-major blocks whose bytes span at most ``max_bytes`` (never below one element).

    Blocks are cut along the first dimension longer than one, so each block is one
    contiguous run of the box's rows when a row fits; longer rows are cut further. The
    blocks are in row-major order and cover the box exactly once.

    Args:
        box: the box to cut.
        itemsize: bytes per element.
        max_bytes: the largest byte span of a block.
        within: the lengths of the tensor the box is laid out in (row-major), when the
            span to bound is the one the block covers there (from its first to its last
            element, gaps included), as for a range read from a saved tile. By default
            the box is its own contiguous tensor.

    Returns:
        The blocks.

    Example:
        >>> [str(b) for b in split_box(Box((0, 0), (4, 3)), 4, 24)]
        ['[0:2, 0:3]', '[2:4, 0:3]']
    """
    strides = row_major_strides(within) if within is not None else None

    def span(b: Box) -> int:
        if strides is None or b.is_empty():
            return b.numel * itemsize
        first = sum(o * s for o, s in zip(b.offsets, strides))
        last = sum((o + n - 1) * s for o, n, s in zip(b.offsets, b.lengths, strides))
        return (last - first + 1) * itemsize

    out: list[Box] = []
    stack = [box]
    while stack:  # depth first, in order: the blocks come out row-major
        b = stack.pop()
        nbytes = span(b)
        d = next((d for d in range(b.ndim) if b.lengths[d] > 1), None)
        if nbytes <= max_bytes or b.numel <= 1 or d is None:
            out.append(b)
            continue
        n = b.lengths[d]
        per = max(1, n * max_bytes // max(1, nbytes))
        stack.extend(reversed([_with_dim(b, d, b.offsets[d] + lo, min(per, n - lo)) for lo in range(0, n, per)]))
    return out


def _with_dim(box: Box, d: int, offset: int, length: int) -> Box:
    """``box`` with dimension ``d`` set to ``[offset, offset + length)``."""
    return Box(box.offsets[:d] + (offset,) + box.offsets[d + 1 :], box.lengths[:d] + (length,) + box.lengths[d + 1 :])


def flat_range_to_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Decompose ``[start, stop)`` of the row-major flattening of ``shape`` into boxes.

    The boxes are the fewest possible (at most ``2 * ndim - 1``), listed in memory order,
    and each one is contiguous in row-major memory, so the flat range's bytes are exactly
    the concatenation of the boxes' bytes. An empty range gives no boxes.

    Raises:
        ValueError: if the range does not lie inside the tensor.
    """
    shape = tuple(int(s) for s in shape)
    total = math.prod(shape)
    if not 0 <= start <= stop <= total:
        raise ValueError(f"flat range [{start}, {stop}) is outside a tensor of shape {shape}")
    if start == stop:
        return []
    if not shape:
        return [Box((), ())]
    return _split(shape, (), start, stop)


def _split(shape: tuple[int, ...], prefix: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """Boxes for ``[start, stop)`` within the sub-tensor at index ``prefix`` (a helper)."""
    rest = shape[1:]
    row = math.prod(rest)
    nd = len(prefix)
    first, last = start // row, (stop - 1) // row
    if not rest:
        return [Box(prefix + (start,), (1,) * nd + (stop - start,))]
    if first == last and (start % row or stop % row):
        return _split(rest, prefix + (first,), start - first * row, stop - first * row)
    boxes: list[Box] = []
    full_lo, full_hi = first, last + 1
    if start % row:
        boxes += _split(rest, prefix + (first,), start % row, row)
        full_lo = first + 1
    tail = stop % row
    if tail:
        full_hi = last
    if full_hi > full_lo:
        boxes.append(Box(prefix + (full_lo,) + (0,) * len(rest), (1,) * nd + (full_hi - full_lo,) + rest))
    if tail:
        boxes += _split(rest, prefix + (last,), 0, tail)
    return boxes


def is_contiguous_in(inner: Box, outer_lengths: Sequence[int]) -> bool:
    """Whether ``inner`` (relative to a container of ``outer_lengths``) is one memory run."""
    seen_partial = False
    for d in range(inner.ndim - 1, -1, -1):
        if seen_partial and inner.lengths[d] != 1:
            return False
        if inner.offsets[d] != 0 or inner.lengths[d] != outer_lengths[d]:
            seen_partial = True
    return True


def runs(inner: Box, outer_lengths: Sequence[int], max_runs: int = 4096) -> Iterator[tuple[int, int]]:
    """Contiguous element runs ``(flat_start, length)`` of ``inner`` within a row-major container.

    ``inner`` is relative to the container. Adjacent runs are merged. When the box would
    split into more than ``max_runs`` runs, a single covering span is yielded instead, so
    callers stay fast on thin slices of huge tiles (they read a little more, never less).
    """
    if inner.is_empty():
        return
    strides = row_major_strides(outer_lengths)
    # Dimensions from ``k`` on are taken whole, so each run spans them entirely.
    k = inner.ndim
    while k > 0 and inner.offsets[k - 1] == 0 and inner.lengths[k - 1] == outer_lengths[k - 1]:
        k -= 1
    if k == 0:
        yield 0, math.prod(outer_lengths)
        return
    run_len = inner.lengths[k - 1] * strides[k - 1]
    outer_dims = range(k - 1)
    count = math.prod(inner.lengths[d] for d in outer_dims)
    base = sum(o * s for o, s in zip(inner.offsets, strides))
    if count > max_runs:
        last = base + sum((inner.lengths[d] - 1) * strides[d] for d in outer_dims)
        yield base, last + run_len - base
        return
    cur_start, cur_len = -1, 0
    for idx in np.ndindex(*(inner.lengths[d] for d in outer_dims)):
        s = base + sum(i * strides[d] for d, i in enumerate(idx))
        if cur_start >= 0 and cur_start + cur_len == s:
            cur_len += run_len
            continue
        if cur_start >= 0:
            yield cur_start, cur_len
        cur_start, cur_len = s, run_len
    yield cur_start, cur_len


# ---------------------------------------------------------------------------------------
# Coverage: every element of a global tensor written exactly once.


def check_flat_coverage(name: str, numel: int, ranges: np.ndarray) -> None:
    """Check that distinct flat ranges ``(n, 2)`` tile ``[0, numel)`` exactly.

    Raises:
        CoverageError: naming the tensor and the first gap or overlap.
    """
    ranges = ranges[ranges[:, 1] > ranges[:, 0]]
    if len(ranges) == 0:
        if numel:
            raise CoverageError(f"tensor '{name}': no rank saves any of its {numel} elements")
        return
    ranges = ranges[np.lexsort((ranges[:, 1], ranges[:, 0]))]
    starts, stops = ranges[:, 0], ranges[:, 1]
    if starts[0] != 0:
        raise CoverageError(f"tensor '{name}': flat elements [0, {starts[0]}) are saved by no rank")
    if stops[-1] != numel:
        if stops.max() > numel:
            raise CoverageError(f"tensor '{name}': a flat range ends at {stops.max()} > numel {numel}")
        raise CoverageError(f"tensor '{name}': flat elements [{stops[-1]}, {numel}) are saved by no rank")
    bad = np.nonzero(starts[1:] != stops[:-1])[0]
    if len(bad):
        i = int(bad[0])
        a, b = ranges[i], ranges[i + 1]
        what = "overlap" if b[0] < a[1] else "leave a gap between them"
        raise CoverageError(
            f"tensor '{name}': flat ranges [{a[0]}, {a[1]}) and [{b[0]}, {b[1]}) {what}; "
            "each element must be saved by exactly one distinct range"
        )


def check_box_coverage(name: str, shape: Sequence[int], offsets: np.ndarray, lengths: np.ndarray) -> None:
    """Check that distinct boxes (rows of ``offsets``/``lengths``, shape ``(n, ndim)``) tile ``shape``.

    Identical boxes must be de-duplicated by the caller (they are replicas). Boxes must be
    inside the tensor, pairwise disjoint, and their volumes must add up to the tensor's.

    Raises:
        CoverageError: naming the tensor and what is wrong.
    """
    shape = tuple(int(s) for s in shape)
    total = math.prod(shape)
    nonempty = lengths.prod(axis=1) > 0 if lengths.shape[1] else np.ones(len(lengths), dtype=bool)
    offsets, lengths = offsets[nonempty], lengths[nonempty]
    if len(shape) == 0:
        if len(offsets) != 1:
            raise CoverageError(f"tensor '{name}': a 0-dim tensor needs exactly one saved value, got {len(offsets)}")
        return
    stops = offsets + lengths
    outside = np.nonzero((stops > np.asarray(shape)).any(axis=1))[0]
    if len(outside):
        i = int(outside[0])
        box = Box(tuple(map(int, offsets[i])), tuple(map(int, lengths[i])))
        raise CoverageError(f"tensor '{name}': box {box} lies outside its global shape {shape}")
    volume = int(lengths.prod(axis=1).sum())
    overlap = _find_overlap(offsets, lengths)
    if overlap is not None:
        a, b = overlap
        raise CoverageError(
            f"tensor '{name}': boxes {_box_at(offsets, lengths, a)} and {_box_at(offsets, lengths, b)} overlap "
            "with different extents; replicas must hold identical boxes"
        )
    if volume != total:
        raise CoverageError(
            f"tensor '{name}' of shape {shape}: saved boxes cover {volume} of {total} elements; "
            "some part of the tensor is saved by no rank"
        )


def _box_at(offsets: np.ndarray, lengths: np.ndarray, i: int) -> Box:
    return Box(tuple(map(int, offsets[i])), tuple(map(int, lengths[i])))


def _find_overlap(offsets: np.ndarray, lengths: np.ndarray, dim: int = 0) -> tuple[int, int] | None:
    """Indices of two overlapping boxes, or None.

    Sweeps along ``dim``: boxes are grouped into slabs of identical extent in ``dim``; if the
    slabs are disjoint, only boxes within one slab can overlap, and those are checked along
    the next dimension. Grid, row-block and column-block layouts resolve in one or two
    vectorised passes; anything else falls back to a chunked pairwise test.
    """
    n = len(offsets)
    if n < 2:
        return None
    if dim == offsets.shape[1]:
        return (0, 1)  # identical in every dimension: distinct boxes cannot get here
    lo, hi = offsets[:, dim], offsets[:, dim] + lengths[:, dim]
    slabs, inverse = np.unique(np.stack([lo, hi], axis=1), axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    if len(slabs) > 1 and (slabs[1:, 0] < slabs[:-1, 1]).any():
        return _pairwise_overlap(offsets, lengths)
    if len(slabs) == n:
        return None
    order = np.argsort(inverse, kind="stable")
    bounds = np.searchsorted(inverse[order], np.arange(len(slabs) + 1))
    for g in range(len(slabs)):
        members = order[bounds[g] : bounds[g + 1]]
        if len(members) < 2:
            continue
        found = _find_overlap(offsets[members], lengths[members], dim + 1)
        if found is not None:
            return int(members[found[0]]), int(members[found[1]])
    return None


def _pairwise_overlap(offsets: np.ndarray, lengths: np.ndarray, block: int = 512) -> tuple[int, int] | None:
    stops = offsets + lengths
    n = len(offsets)
    for i0 in range(0, n, block):
        a_lo, a_hi = offsets[i0 : i0 + block, None, :], stops[i0 : i0 + block, None, :]
        hit = ((a_lo < stops[None, :, :]) & (offsets[None, :, :] < a_hi)).all(axis=2)
        idx = np.arange(i0, min(i0 + block, n))
        hit[np.arange(len(idx)), idx] = False
        where = np.argwhere(hit)
        if len(where):
            return int(idx[where[0, 0]]), int(where[0, 1])
    return None
