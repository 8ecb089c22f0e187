"""Boxes, flat-range decomposition, contiguous runs and coverage checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.errors import CoverageError
from tessera.format.geometry import (
    Box,
    check_box_coverage,
    check_flat_coverage,
    flat_range_to_boxes,
    intersect,
    is_contiguous_in,
    row_major_strides,
    runs,
    split_box,
    split_even,
)


@st.composite
def shape_and_range(draw: st.DrawFn) -> tuple[tuple[int, ...], int, int]:
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=0, max_size=4)))
    n = math.prod(shape)
    a = draw(st.integers(0, n))
    b = draw(st.integers(a, n))
    return shape, a, b


@given(shape_and_range())
@settings(max_examples=400, deadline=None)
def test_flat_range_boxes_are_exactly_the_range_in_order(case: tuple[tuple[int, ...], int, int]) -> None:
    shape, a, b = case
    boxes = flat_range_to_boxes(shape, a, b)
    full = np.arange(math.prod(shape)).reshape(shape)
    got = np.concatenate([full[box.slices()].reshape(-1) for box in boxes]) if boxes else np.zeros(0, dtype=int)
    assert got.tolist() == list(range(a, b))
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    for box in boxes:
        assert is_contiguous_in(box, shape)
        assert not box.is_empty()


def test_flat_range_examples() -> None:
    # Row-cutting range of a (4, 6) tensor: tail of row 0, rows 1-2, head of row 3.
    assert flat_range_to_boxes((4, 6), 4, 20) == [
        Box((0, 4), (1, 2)),
        Box((1, 0), (2, 6)),
        Box((3, 0), (1, 2)),
    ]
    assert flat_range_to_boxes((4, 6), 6, 18) == [Box((1, 0), (2, 6))]
    assert flat_range_to_boxes((), 0, 1) == [Box((), ())]
    with pytest.raises(ValueError):
        flat_range_to_boxes((4, 6), 3, 25)


def test_intersect() -> None:
    a = Box((0, 0), (4, 4))
    assert intersect(a, Box((2, 3), (5, 5))) == Box((2, 3), (2, 1))
    assert intersect(a, Box((4, 0), (1, 4))) is None
    assert intersect(Box((), ()), Box((), ())) == Box((), ())


@given(shape_and_range(), st.integers(0, 3))
@settings(max_examples=200, deadline=None)
def test_runs_cover_exactly_the_box(case: tuple[tuple[int, ...], int, int], seed: int) -> None:
    shape, _, _ = case
    rng = np.random.default_rng(seed)
    offs = tuple(int(rng.integers(0, s)) for s in shape)
    lens = tuple(int(rng.integers(1, s - o + 1)) for s, o in zip(shape, offs))
    box = Box(offs, lens)
    full = np.arange(math.prod(shape)).reshape(shape)
    want = full[box.slices()].reshape(-1).tolist()
    got = [i for start, n in runs(box, shape) for i in range(start, start + n)]
    assert got == want


def test_runs_fall_back_to_a_span_for_thin_slices() -> None:
    box = Box((0, 0), (10_000, 1))
    (only,) = list(runs(box, (10_000, 8), max_runs=100))
    assert only == (0, 9_999 * 8 + 1)


def test_box_coverage_accepts_grids_and_rejects_gaps_and_overlaps() -> None:
    offs = np.array([[0, 0], [0, 5], [4, 0], [4, 5]])
    lens = np.array([[4, 5], [4, 5], [3, 5], [3, 5]])
    check_box_coverage("w", (7, 10), offs, lens)
    with pytest.raises(CoverageError, match="'w'.*saved by no rank"):
        check_box_coverage("w", (7, 10), offs[:3], lens[:3])
    with pytest.raises(CoverageError, match="overlap"):
        check_box_coverage("w", (7, 10), np.array([[0, 0], [3, 0]]), np.array([[4, 10], [4, 10]]))
    with pytest.raises(CoverageError, match="outside"):
        check_box_coverage("w", (7, 10), np.array([[0, 0]]), np.array([[8, 10]]))


def test_box_coverage_irregular_layout_uses_pairwise_check() -> None:
    # An L-shaped tiling whose row slabs are not aligned.
    offs = np.array([[0, 0], [0, 6], [3, 6]])
    lens = np.array([[6, 6], [3, 4], [3, 4]])
    check_box_coverage("w", (6, 10), offs, lens)
    with pytest.raises(CoverageError):
        check_box_coverage("w", (6, 10), np.array([[0, 0], [0, 5], [3, 6]]), np.array([[6, 6], [3, 5], [3, 4]]))


def test_flat_coverage() -> None:
    check_flat_coverage("f", 10, np.array([[0, 4], [4, 10]]))
    with pytest.raises(CoverageError, match="gap|no rank"):
        check_flat_coverage("f", 10, np.array([[0, 4], [5, 10]]))
    with pytest.raises(CoverageError, match="overlap"):
        check_flat_coverage("f", 10, np.array([[0, 5], [4, 10]]))


def _cells(boxes: list[Box]) -> list[tuple[int, ...]]:
    """Every element index of ``boxes``, box after box, row-major inside each."""
    return [tuple(o + i for o, i in zip(b.offsets, idx)) for b in boxes for idx in np.ndindex(*b.lengths)]


@st.composite
def box_in_shape(draw: st.DrawFn) -> tuple[Box, tuple[int, ...]]:
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=4)))
    offsets = tuple(draw(st.integers(0, s - 1)) for s in shape)
    lengths = tuple(draw(st.integers(1, s - o)) for s, o in zip(shape, offsets))
    return Box(offsets, lengths), shape


@given(box_in_shape(), st.integers(1, 4), st.integers(1, 200))
@settings(max_examples=300, deadline=None)
def test_split_box_blocks_cover_the_box_in_row_major_order(
    case: tuple[Box, tuple[int, ...]], itemsize: int, max_bytes: int
) -> None:
    box, shape = case
    for within in (None, shape):
        blocks = split_box(box, itemsize, max_bytes, within=within)
        # Exactly the box's elements, in the box's own row-major order.
        assert _cells(blocks) == _cells([box])
        strides = row_major_strides(within if within is not None else box.lengths)
        for b in blocks:
            rel = b if within is not None else b.relative_to(box)
            first = sum(o * s for o, s in zip(rel.offsets, strides))
            last = sum((o + n - 1) * s for o, n, s in zip(rel.offsets, rel.lengths, strides))
            assert (last - first + 1) * itemsize <= max_bytes or b.numel == 1


def test_split_box_examples() -> None:
    assert [str(b) for b in split_box(Box((0, 0), (4, 3)), 4, 24)] == ["[0:2, 0:3]", "[2:4, 0:3]"]
    # A row longer than the limit is cut further, never below one element.
    assert [str(b) for b in split_box(Box((0, 0), (1, 3)), 4, 4)] == ["[0:1, 0:1]", "[0:1, 1:2]", "[0:1, 2:3]"]
    # Inside a wider tile, a column box spans whole rows of it: one block per row.
    assert len(split_box(Box((0, 0), (3, 1)), 4, 8, within=(3, 10))) == 3
    assert split_box(Box((), ()), 8, 1) == [Box((), ())]


@given(box_in_shape(), st.integers(1, 8))
@settings(max_examples=200, deadline=None)
def test_split_even_slabs_are_balanced_and_cover_the_box(case: tuple[Box, tuple[int, ...]], parts: int) -> None:
    box, _ = case
    slabs = split_even(box, parts)
    assert _cells(slabs) == _cells([box])  # the dimensions before the cut one have length 1
    assert sum(b.numel for b in slabs) == box.numel
    d = next((d for d in range(box.ndim) if box.lengths[d] > 1), None)
    if d is None:
        assert slabs == [box]
        return
    assert len(slabs) == min(parts, box.lengths[d])
    lengths = [b.lengths[d] for b in slabs]
    assert max(lengths) - min(lengths) <= 1
    assert [b.offsets[d] for b in slabs] == [box.offsets[d] + sum(lengths[:i]) for i in range(len(slabs))]


def test_split_even_along_a_given_dimension() -> None:
    assert [str(b) for b in split_even(Box((2, 0), (5, 4)), 2, dim=0)] == ["[2:4, 0:4]", "[4:7, 0:4]"]
    assert [str(b) for b in split_even(Box((0, 0), (5, 4)), 3, dim=1)] == ["[0:5, 0:1]", "[0:5, 1:2]", "[0:5, 2:4]"]
    assert split_even(Box((0,), (1,)), 4) == [Box((0,), (1,))]
