"""Format version 2: a tensor's tile geometry in the index, in independently deflated blocks.

A tensor's ``tile_index`` holds its tiles' boxes and sections in blocks of :data:`BLOCK_TILES`
rows; per block the index gives the range its tiles cover along the first dimension
(``first``, ``end``) and its deflated size, so a loading rank inflates only the blocks near
its boxes, not every tile of every tensor it loads. A block inflates to its ``2 ndim + 1`` columns one after
the other (``offsets`` per dimension, ``lengths`` per dimension, ``section``), every value
the difference from the row before it in the block (the block's first row as is), all as
little-endian signed integers of one width (1, 2, 4 or 8 bytes: the inflated size says which).

A tensor's sections never decrease along its rows, so each section's rows are one run; a
row's ``k`` (its place among its section's tiles of the tensor, how the section finds it) is
its distance from the run's start, plus the block's ``lead`` for the block's first run.

Decoding is bounded and strict: a block must inflate to exactly its rows' bytes, its values
must be in ``[0, 2**62)``, its sections below the section count and never decreasing, and its
tiles inside the range the index gives for it (the range a reader trusted to skip it). See
``docs/format.md``.
"""

from __future__ import annotations

import base64
import binascii
import threading
import zlib
from typing import Any

import numpy as np

from .tiles import Budget, as_dict, as_int, fail

BLOCK_TILES = 512
"""The fewest rows of a tensor's geometry per block (the last block may hold fewer): what a
load inflates per tensor it loads. Measured at 16,384 ranks x 1,000 tensors
(``bench/plan_scale.py``): 4,096 rows make a 0.82 MB index, 1,024 rows 1.08 MB and a plan
0.1 s faster, 512 rows 1.43 MB and a plan 0.03-0.04 s faster again."""
MAX_BLOCKS = 32
"""A tensor of more than ``BLOCK_TILES x MAX_BLOCKS`` tiles gets longer blocks (a power of two
times :data:`BLOCK_TILES`): the index holds at most this many blocks per tensor, so its size
grows with the job's ranks only as the tiles' deflated geometry does (at 65,536 ranks: 2.44 MB
with at most 64 blocks per tensor, over what a loading rank should read)."""
MAX_BLOCK_TILES = 1 << 20
"""The most rows per block an index may declare (what one inflate may allocate: 8 MiB per column)."""
BATCH_ROWS = 16384
"""Rows of geometry a load plan searches at once (several blocks side by side)."""


def encode_blocks(
    parts: list[bytes], offsets: np.ndarray, lengths: np.ndarray, section: np.ndarray, k: np.ndarray
) -> np.ndarray:
    """Append a ``tile_index`` object (``count``, ``block``, ``data``) to ``parts``; return its
    block table (``first``, ``end``, ``size``, ``lead`` per block: rows of the index's
    ``tile_blocks``; ``lead`` is ``k`` of the block's first row, its place among its section's
    tiles of the tensor)."""
    n, nd = offsets.shape if offsets.ndim == 2 else (len(offsets), 0)
    b = block_rows(n)
    rows = np.concatenate([offsets.reshape(n, nd), lengths.reshape(n, nd), section.reshape(n, 1)], axis=1)
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    delta = np.empty_like(rows)
    if n:
        delta[0] = rows[0]
        np.subtract(rows[1:], rows[:-1], out=delta[1:])
        delta[::b] = rows[::b]  # each block's first row as is
    blobs = [zlib.compress(x, 1) for x in _narrowed_blocks(delta, b)]
    nb = len(blobs)
    table = np.zeros((nb, 4), dtype=np.int64)
    if nd and n:
        starts = offsets[:, 0]
        ends = starts + lengths[:, 0]
        pad = nb * b - n
        table[:, 0] = np.concatenate([starts, np.full(pad, starts.max())]).reshape(nb, b).min(axis=1)
        table[:, 1] = np.concatenate([ends, np.zeros(pad, np.int64)]).reshape(nb, b).max(axis=1)
    table[:, 2] = np.fromiter((len(x) for x in blobs), dtype=np.int64, count=nb)
    table[:, 3] = k[::b]
    parts += [b'{"count":%d,"block":%d,"data":"' % (n, b), base64.b64encode(b"".join(blobs)), b'"}']
    return table


def block_rows(count: int) -> int:
    """Rows per geometry block of a tensor of ``count`` tiles (:data:`BLOCK_TILES`, :data:`MAX_BLOCKS`)."""
    b = BLOCK_TILES
    while b * MAX_BLOCKS < count:
        b *= 2
    return b


def _narrowed_blocks(delta: np.ndarray, b: int) -> list[bytes]:
    """Each block of ``b`` rows of ``delta`` (``(n, w)``), its columns one after the other, in
    the narrowest of int8, int16, int32, int64 that holds the block's values, little-endian: the widths chosen for all blocks at once, each block cut from
    one conversion per width (a commit encodes tens of thousands of blocks)."""
    n = len(delta)
    if not n:
        return []
    nb = -(-n // b)
    pad = np.concatenate([delta, np.repeat(delta[-1:], nb * b - n, axis=0)]).reshape(nb, -1)
    lo, hi = pad.min(axis=1), pad.max(axis=1)
    width = np.zeros(nb, dtype=np.int64)
    for w, (least, most) in enumerate(_RANGES):  # the narrowest type that holds the block's range
        width[(width == w) & ((lo < least) | (hi > most))] = w + 1
    out: list[bytes] = []
    cast: dict[int, np.ndarray] = {}
    for i, w in enumerate(width.tolist()):
        if w not in cast:
            cast[w] = delta.astype(_TYPES[w])
        out.append(cast[w][i * b : (i + 1) * b].T.tobytes())
    return out


_TYPES = (np.dtype("<i1"), np.dtype("<i2"), np.dtype("<i4"), np.dtype("<i8"))
_RANGES = [(-(1 << (8 * n - 1)), (1 << (8 * n - 1)) - 1) for n in (1, 2, 4)]
"""The values int8, int16 and int32 hold."""


class Geometry:
    """A tensor's ``tile_index``: its block table checked up front, its blocks inflated on use."""

    def __init__(self, name: str, raw: Any, ndim: int, sections: int, tiles: Budget) -> None:
        self.name, self.ndim, self.sections = name, ndim, sections
        what = f"tensor '{name}'"
        raw = as_dict(raw, f"{what} tile_index")
        self.count = as_int(raw.get("count"), f"{what} tile_index count")
        tiles.take(self.count, f"{what}: tile_index.count {self.count}")
        self.block = as_int(raw.get("block"), f"{what} tile_index block", lo=1)
        if self.block > MAX_BLOCK_TILES:
            raise fail(f"{what}: tile_index.block {self.block} is over {MAX_BLOCK_TILES}")
        self.block_count = -(-self.count // self.block)
        data = raw.get("data")
        if not isinstance(data, str):
            raise fail(f"{what}: tile_index.data must be a base64 string")
        self._text: str | None = data
        self.first = self.end = self._at = np.zeros(0, dtype=np.int64)
        self.picked: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        """The last rows :meth:`pick` returned, with their geometry (``take`` of them is free)."""

    def attach(self, table: np.ndarray, at: np.ndarray) -> None:
        """Set the block table: this tensor's rows of the index's ``tile_blocks`` (first, end,
        size, lead), and where each block starts in its data (``at``: the sizes' running sum
        from 0, one more than the blocks)."""
        self.first, self.end, self.lead = table[:, 0], table[:, 1], table[:, 3]
        self._at = at
        self._data = b""
        self._blocks: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()
        self.inflated = 0
        """Blocks inflated so far (for tests and benchmarks)."""

    def blocks_meeting(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Blocks whose first-dimension range meets any ``[lo[k], hi[k])``, ascending."""
        if not self.ndim:
            return np.arange(self.block_count)
        meet = (self.first[None, :] < hi[:, None]) & (self.end[None, :] > lo[:, None])
        return np.flatnonzero(meet.any(axis=0))

    def rows(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(rows, offsets, lengths, place)`` of the tiles of ``blocks`` (ascending); ``place`` is
        ``(section, k)`` per row: its section, and its place among that section's tiles of the tensor."""
        nd = self.ndim
        if not len(blocks):
            z = np.zeros(0, dtype=np.int64)
            return z, z.reshape(0, nd), z.reshape(0, nd), z.reshape(0, 2)
        with self._lock:
            got = [self._inflate(int(i)) for i in blocks]
        arr = np.concatenate(got) if len(got) > 1 else got[0]
        starts = blocks * self.block
        counts = np.minimum(self.block, self.count - starts)
        if len(blocks) == 1:
            rows = np.arange(int(starts[0]), int(starts[0] + counts[0]), dtype=np.int64)
        else:
            rows = np.arange(len(arr), dtype=np.int64) + np.repeat(starts - (np.cumsum(counts) - counts), counts)
        at = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        block_of = np.repeat(np.arange(len(blocks)), counts)
        k = _k(arr[:, 2 * nd], block_of, at, self.lead[blocks], np.arange(len(arr)))
        return rows, arr[:, :nd], arr[:, nd : 2 * nd], np.stack([arr[:, 2 * nd], k], axis=1)

    def pick(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Rows of the tiles that meet any box ``[lo[k], hi[k])`` (``(boxes, ndim)`` arrays), ascending.

        Only the blocks whose first-dimension range meets a box are inflated.
        """
        if not self.ndim:
            return np.arange(self.count)
        rows, offs, lens, sec = self.rows(self.blocks_meeting(lo[:, 0], hi[:, 0]))
        if len(lo) == 1:
            meet = ((offs < hi[0]) & (offs + lens > lo[0])).all(axis=1)
        else:
            meet = ((offs[None] < hi[:, None]) & ((offs + lens)[None] > lo[:, None])).all(axis=2).any(axis=0)
        rows = rows[meet]
        self.picked = (rows, offs[meet], lens[meet], sec[meet])
        return rows

    def take(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(offsets, lengths, place)`` of ``rows`` (ascending, below :attr:`count`); see :meth:`rows`."""
        picked = self.picked
        if picked is not None and picked[0] is rows:
            return picked[1], picked[2], picked[3]
        blocks = np.unique(rows // self.block)
        have, offs, lens, sec = self.rows(blocks)
        pos = np.searchsorted(have, rows)
        return offs[pos], lens[pos], sec[pos]

    def _inflate(self, i: int) -> np.ndarray:
        """Block ``i``'s rows ``(m, 2 ndim + 1)`` (boxes, section), validated (once)."""
        hit = self._blocks.get(i)
        if hit is not None:
            return hit
        cols = self._raw(i)
        _check_block(
            f"tensor '{self.name}': tile_index block {i}", cols, self.ndim, self.sections, self.first[i], self.end[i]
        )
        self._blocks[i] = arr = cols.T
        return arr

    def _raw(self, i: int) -> np.ndarray:
        """Block ``i`` inflated and summed, unchecked but for its size: ``(2 ndim + 1, m)``."""
        return np.cumsum(self._delta(i), axis=1, dtype=np.int64)

    def _delta(self, i: int) -> np.ndarray:
        """Block ``i`` inflated, its differences not yet summed, unchecked but for its size and range."""
        what = f"tensor '{self.name}': tile_index block {i}"
        if self._text is not None:
            try:
                self._data = base64.b64decode(self._text, validate=True)
            except (binascii.Error, ValueError):
                raise fail(f"tensor '{self.name}': tile_index.data is not valid base64") from None
            self._text = None
            if len(self._data) != int(self._at[-1]):
                raise fail(
                    f"tensor '{self.name}': tile_index.data holds {len(self._data)} bytes, its blocks "
                    f"{int(self._at[-1])}"
                )
        m = min(self.block, self.count - i * self.block)
        width = 2 * self.ndim + 1
        most = 8 * m * width
        try:
            buf = zlib.decompressobj().decompress(self._data[self._at[i] : self._at[i + 1]], most + 1)
        except zlib.error:
            raise fail(f"{what} is not valid zlib data") from None
        item = len(buf) // (m * width)
        if item not in (1, 2, 4, 8) or len(buf) != item * m * width:
            raise fail(f"{what} holds {len(buf)} bytes, expected 1, 2, 4 or 8 x {m * width}")
        delta = np.frombuffer(buf, dtype=_TYPES[item.bit_length() - 1]).reshape(width, m)
        # Every difference and every running sum in [-2**62, 2**62) and [0, 2**62) (check_rows): no
        # int64 wraps. Narrower differences cannot wrap 1,048,576 rows.
        if item == 8 and (int(delta.min()) < -(1 << 62) or int(delta.max()) >= 1 << 62):
            raise fail(f"{what}: values must be non-negative integers below 2**62")
        self.inflated += 1
        return delta


def _k(sec: np.ndarray, block_of: np.ndarray, starts: np.ndarray, lead: np.ndarray, at: np.ndarray) -> np.ndarray:
    """k of rows ``at`` of blocks laid one after the other (``sec``: their section column, never
    decreasing within a block; ``starts``: where each block begins; ``lead``: each block's): the
    distance from the first row of its section in its block, plus the lead in the block's first run."""
    blk = block_of[at]
    key = block_of * (1 << 32) + sec  # ascending; sections are below 2**32 (the sections file's size)
    first = np.searchsorted(key, key[at]) - starts[blk]
    return at - starts[blk] - first + np.where(first == 0, lead[blk], 0)


def _check_block(what: str, cols: np.ndarray, nd: int, sections: int, first: int, end: int) -> None:
    """Raise unless a block's decoded columns ``(2 nd + 1, m)`` are below 2**62, name sections
    below ``sections``, never decreasing, and lie in the block's range ``[first, end)``."""
    if not cols.shape[1]:
        return
    if int(cols.view(np.uint64).max()) >= 1 << 62:
        raise fail(f"{what}: values must be non-negative integers below 2**62")
    sec = cols[2 * nd]
    if int(sec.max()) >= sections:
        raise fail(f"{what}: a tile is in section #{int(sec.max())} but there are fewer")
    if (sec[1:] < sec[:-1]).any():
        raise fail(f"{what}: the sections of a tensor's rows must never decrease")
    if nd and (int(cols[0].min()) < first or int((cols[0] + cols[nd]).max()) > end):
        raise fail(f"{what}: a tile lies outside the block's range [{int(first)}, {int(end)})")


def pick_many(items: list[tuple[Geometry, np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    """:meth:`Geometry.pick` of many tensors' boxes at once (``(geometry, lo, hi)`` each), with
    whole-array work per number of dimensions instead of per tensor and block."""
    out: list[np.ndarray] = [np.zeros(0, np.int64)] * len(items)
    by_nd: dict[int, list[int]] = {}
    for k, (g, _, _) in enumerate(items):
        by_nd.setdefault(g.ndim, []).append(k)
    for nd, ks in by_nd.items():
        if not nd:
            for k in ks:
                out[k] = items[k][0].pick(items[k][1], items[k][2])
            continue
        for k, rows in zip(ks, _pick_group([items[k] for k in ks], nd)):
            out[k] = rows
    return out


def _pick_group(items: list[tuple[Geometry, np.ndarray, np.ndarray]], nd: int) -> list[np.ndarray]:
    z = np.zeros(0, dtype=np.int64)
    geos = [g for g, _, _ in items]
    nbs = np.array([g.block_count for g in geos], dtype=np.int64)
    base = np.concatenate([[0], np.cumsum(nbs)]).astype(np.int64)
    first = np.concatenate([g.first for g in geos] or [z])
    end = np.concatenate([g.end for g in geos] or [z])
    lo = np.concatenate([x for _, x, _ in items])
    hi = np.concatenate([x for _, _, x in items])
    owner = np.repeat(np.arange(len(items)), [len(x) for _, x, _ in items])
    # Every (box, block of its tensor) pair; the pairs whose ranges meet along the first dimension.
    per = nbs[owner]
    pair_box = np.repeat(np.arange(len(owner)), per)
    pair_block = np.arange(int(per.sum()), dtype=np.int64) - np.repeat(np.cumsum(per) - per, per)
    pair_block += np.repeat(base[owner], per)
    meet = (first[pair_block] < hi[pair_box, 0]) & (end[pair_block] > lo[pair_box, 0])
    pair_box, pair_block = pair_box[meet], pair_block[meet]
    by_block = np.argsort(pair_block, kind="stable")
    pair_box, pair_block = pair_box[by_block], pair_block[by_block]
    blocks, pair_of = np.unique(pair_block, return_inverse=True)
    item_of = np.searchsorted(base, blocks, side="right") - 1
    local = blocks - base[item_of]
    deltas = [geos[i]._delta(b) for i, b in zip(item_of.tolist(), local.tolist())]
    if not deltas:
        for g in geos:
            g.picked = (z, z.reshape(0, nd), z.reshape(0, nd), z.reshape(0, 2))
        return [z] * len(geos)
    # Blocks side by side in batches of about BATCH_ROWS rows (whole-array work that stays in
    # cache), each searched at once unless one of its blocks needs a block-by-block search (tiles
    # not sorted by their first offset, or offsets too large to share one sorted key).
    rows_at = np.concatenate([[0], np.cumsum([d.shape[1] for d in deltas])]).astype(np.int64)
    cuts = np.unique(np.searchsorted(rows_at, np.arange(0, int(rows_at[-1]), BATCH_ROWS), side="right") - 1)
    spans = list(zip(cuts.tolist(), [*cuts[1:].tolist(), len(deltas)]))
    hits = []
    while spans:
        j0, j1 = spans.pop(0)
        batch = _Blocks(geos, item_of[j0:j1], local[j0:j1], deltas[j0:j1], nd)
        if j1 - j0 > 1 and not batch.searchable:
            spans[:0] = [(j, j + 1) for j in range(j0, j1)]
            continue
        a, b = np.searchsorted(pair_of, [j0, j1]).tolist()
        hits.append(batch.pick(pair_of[a:b] - j0, pair_box[a:b], lo, hi, j0))
    blk, rows, offs, lens, place = (np.concatenate(x) for x in zip(*hits))
    # Hits come block by block, ascending, so each tensor's are one run.
    item = item_of[blk]
    bounds = np.searchsorted(item, np.arange(len(items) + 1)).tolist()
    out = []
    for i, g in enumerate(geos):
        a, b = bounds[i], bounds[i + 1]
        g.picked = (rows[a:b], offs[a:b], lens[a:b], place[a:b])
        out.append(g.picked[0])
    return out


class _Blocks:
    """Blocks of several tensors' geometry of ``nd`` >= 1 dimensions, inflated side by side: one
    ``(2 nd + 1, rows)`` array, so that summing, checking and searching them is whole-array work."""

    def __init__(
        self, geos: list[Geometry], item_of: np.ndarray, local: np.ndarray, deltas: list[np.ndarray], nd: int
    ) -> None:
        self.geos, self.local, self.nd = geos, local, nd
        counts = np.array([d.shape[1] for d in deltas], dtype=np.int64)
        self.at = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.block_of = np.repeat(np.arange(len(deltas), dtype=np.int64), counts)
        flat = np.concatenate([d.astype(np.int64, copy=False) for d in deltas], axis=1)
        # A running sum per block: the running sum of all, less its value before the block (int64
        # arithmetic wraps alike either way, so each block sums exactly as it would alone).
        run = np.cumsum(flat, axis=1)
        before = np.concatenate([np.zeros((flat.shape[0], 1), np.int64), run[:, self.at[1:-1] - 1]], axis=1)
        self.cols = run - np.repeat(before, counts, axis=1)
        self.blocks = [(geos[i], b) for i, b in zip(item_of.tolist(), local.tolist())]
        """Each block's tensor geometry and its number there."""
        self._check()
        start = self.cols[0]
        sorted_ = not ((start[1:] < start[:-1]) & (self.block_of[1:] == self.block_of[:-1])).any()
        self.searchable = sorted_ and int(start.max(initial=0)) + 2 < (1 << 62) // max(1, len(self.at))
        """Whether every block's tiles are sorted by their first offset and the blocks' offsets
        fit one sorted key (block, offset) in int64."""

    def _check(self) -> None:
        """Every block as :func:`_check_block` checks it; the first bad block raises its error."""
        cols, nd, blk = self.cols, self.nd, self.block_of
        first = np.array([g.first[b] for g, b in self.blocks], dtype=np.int64)
        end = np.array([g.end[b] for g, b in self.blocks], dtype=np.int64)
        sections = self.geos[0].sections
        sec = cols[2 * nd]
        bad = (cols.view(np.uint64) >= 1 << 62).any(axis=0) | (sec >= sections)
        bad[1:] |= (sec[1:] < sec[:-1]) & (blk[1:] == blk[:-1])
        bad |= (cols[0] < first[blk]) | (cols[0] + cols[nd] > end[blk])
        if bad.any():
            j = int(blk[int(np.argmax(bad))])
            g, b = self.blocks[j]
            cols_j = cols[:, self.at[j] : self.at[j + 1]]
            _check_block(f"tensor '{g.name}': tile_index block {b}", cols_j, nd, g.sections, g.first[b], g.end[b])

    def pick(
        self, pair_of: np.ndarray, pair_box: np.ndarray, lo: np.ndarray, hi: np.ndarray, tag: int = 0
    ) -> tuple[np.ndarray, ...]:
        """``(block, rows, offsets, lengths, place)`` of the tiles meeting their blocks' boxes
        (``pair_of[p]``: a block here, ``pair_box[p]``: a box meeting it along the first
        dimension); ``block`` is ``tag`` plus the block's position here."""
        cols, nd, at, blk = self.cols, self.nd, self.at, self.block_of
        start = cols[0]
        if self.searchable:
            # The rows that can meet a box: one run of a block's rows found by bisection, with
            # (block, first offset) as one sorted key. Earlier tiles end before lo; later ones
            # start after hi.
            span = int(start.max(initial=0)) + 2
            key = blk * span + start
            longest = np.maximum.reduceat(cols[nd], at[:-1])
            lo0 = np.clip(lo[pair_box, 0] - longest[pair_of], -1, span - 1) + pair_of * span
            hi0 = np.clip(hi[pair_box, 0], 0, span - 1) + pair_of * span
            a = np.searchsorted(key, lo0, side="right")
            n = np.maximum(a, np.searchsorted(key, hi0, side="left")) - a
        else:  # one block whose tiles are not sorted: every row for every box
            a = at[pair_of]
            n = at[pair_of + 1] - a
        cand = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n) + np.repeat(a, n)
        box = np.repeat(pair_box, n)
        offs, lens = cols[:nd, cand].T, cols[nd : 2 * nd, cand].T
        keep = np.unique(cand[((offs < hi[box]) & (offs + lens > lo[box])).all(axis=1)])
        b = blk[keep]
        sec = cols[2 * nd]
        # k: the distance from the first row of the kept row's section in its block, plus the
        # block's lead in the block's first run.
        sec_key = blk * (int(sec.max(initial=0)) + 1) + sec
        run = np.searchsorted(sec_key, sec_key[keep]) - at[b]
        leads = np.array([g.lead[j] for g, j in self.blocks], dtype=np.int64)
        k = keep - at[b] - run + np.where(run == 0, leads[b], 0)
        block_rows = np.array([g.block for g, _ in self.blocks], dtype=np.int64) * self.local
        rows = block_rows[b] + keep - at[b]
        place = np.stack([sec[keep], k], axis=1)
        return b + tag, rows, cols[:nd, keep].T, cols[nd : 2 * nd, keep].T, place
