"""Format version 2: a tensor's tile geometry in the index, in independently deflated blocks.

A tensor's ``tile_index`` holds its tiles' boxes and sections in blocks of :data:`BLOCK_TILES`
rows; per block the index gives the range its tiles cover along the first dimension
(``first``, ``end``) and its deflated size, so a loading rank inflates only the blocks near
its boxes, not every tile of every tensor it loads. A block inflates to its ``2 ndim + 1`` columns one after
the other (``offsets`` per dimension, ``lengths`` per dimension, ``section``), every value
the difference from the row before it in the block (the block's first row as is), all as
little-endian signed integers of one width (1, 2, 4 or 8 bytes: the inflated size says which).

Decoding is bounded and strict: a block must inflate to exactly its rows' bytes, its values
must be in ``[0, 2**62)``, its sections below the section count, and its tiles inside the
range the index gives for it (the range a reader trusted to skip it). See ``docs/format.md``.
"""

from __future__ import annotations

import base64
import binascii
import threading
import zlib
from typing import Any

import numpy as np

from .encoder import _int_column
from .tiles import Budget, as_dict, as_int, column, fail

BLOCK_TILES = 1024
"""Rows of a tensor's geometry per block (the last block may hold fewer)."""
MAX_BLOCK_TILES = 1 << 20
"""The most rows per block an index may declare (what one inflate may allocate: 8 MiB per column)."""


def encode_blocks(parts: list[bytes], offsets: np.ndarray, lengths: np.ndarray, section: np.ndarray) -> None:
    """Append a ``tile_index`` object (``count``, ``block``, ``first``, ``end``, ``size``, ``data``) to ``parts``."""
    n, nd = offsets.shape if offsets.ndim == 2 else (len(offsets), 0)
    b = BLOCK_TILES
    rows = np.concatenate([offsets.reshape(n, nd), lengths.reshape(n, nd), section.reshape(n, 1)], axis=1)
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    delta = np.empty_like(rows)
    if n:
        delta[0] = rows[0]
        np.subtract(rows[1:], rows[:-1], out=delta[1:])
        delta[::b] = rows[::b]  # each block's first row as is
    blobs = [zlib.compress(_narrow(delta[i : i + b].T), 1) for i in range(0, n, b)]
    if nd and n:
        starts = offsets[:, 0]
        ends = starts + lengths[:, 0]
        nb = len(blobs)
        pad = nb * b - n
        first = np.concatenate([starts, np.full(pad, starts.max())]).reshape(nb, b).min(axis=1)
        end = np.concatenate([ends, np.zeros(pad, np.int64)]).reshape(nb, b).max(axis=1)
    else:
        first = end = np.zeros(len(blobs), dtype=np.int64)
    parts.append(b'{"count":%d,"block":%d,"first":' % (n, b))
    _int_column(parts, first)
    parts.append(b',"end":')
    _int_column(parts, end)
    parts.append(b',"size":')
    _int_column(parts, np.fromiter((len(x) for x in blobs), dtype=np.int64, count=len(blobs)))
    parts += [b',"data":"', base64.b64encode(b"".join(blobs)), b'"}']


def _narrow(values: np.ndarray) -> bytes:
    """``values`` in the narrowest of int8, int16, int32, int64 that holds them all, little-endian."""
    lo, hi = (int(values.min()), int(values.max())) if values.size else (0, 0)
    for t in _TYPES:
        info = np.iinfo(t)
        if info.min <= lo and hi <= info.max:
            break
    return np.ascontiguousarray(values, dtype=t).tobytes()


_TYPES = (np.dtype("<i1"), np.dtype("<i2"), np.dtype("<i4"), np.dtype("<i8"))


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
        nb = -(-self.count // self.block)
        self.first = column(what, raw, "first", nb, nb, "tile_index")
        self.end = column(what, raw, "end", nb, nb, "tile_index")
        size = column(what, raw, "size", nb, nb, "tile_index")
        data = raw.get("data")
        if not isinstance(data, str):
            raise fail(f"{what}: tile_index.data must be a base64 string")
        self._text: str | None = data
        self._size = size
        self._at = np.concatenate([[0], np.cumsum(size)]).astype(np.int64)
        self._data = b""
        self._blocks: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()
        self.inflated = 0
        """Blocks inflated so far (for tests and benchmarks)."""

    @property
    def block_count(self) -> int:
        return len(self._size)

    def blocks_meeting(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Blocks whose first-dimension range meets any ``[lo[k], hi[k])``, ascending."""
        if not self.ndim:
            return np.arange(self.block_count)
        meet = (self.first[None, :] < hi[:, None]) & (self.end[None, :] > lo[:, None])
        return np.flatnonzero(meet.any(axis=0))

    def rows(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(rows, offsets, lengths, section)`` of the tiles of ``blocks`` (ascending)."""
        nd = self.ndim
        if not len(blocks):
            z = np.zeros(0, dtype=np.int64)
            return z, z.reshape(0, nd), z.reshape(0, nd), z
        with self._lock:
            got = [self._inflate(int(i)) for i in blocks]
        arr = np.concatenate(got) if len(got) > 1 else got[0]
        starts = blocks * self.block
        counts = np.minimum(self.block, self.count - starts)
        rows = np.arange(len(arr), dtype=np.int64) + np.repeat(starts - (np.cumsum(counts) - counts), counts)
        return rows, arr[:, :nd], arr[:, nd : 2 * nd], arr[:, 2 * nd]

    def take(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(offsets, lengths, section)`` of ``rows`` (ascending, below :attr:`count`)."""
        blocks = np.unique(rows // self.block)
        have, offs, lens, sec = self.rows(blocks)
        pos = np.searchsorted(have, rows)
        return offs[pos], lens[pos], sec[pos]

    def _inflate(self, i: int) -> np.ndarray:
        hit = self._blocks.get(i)
        if hit is not None:
            return hit
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
        delta = np.frombuffer(buf, dtype=_TYPES[item.bit_length() - 1]).reshape(width, m).T
        # Every difference and every running sum in [-2**62, 2**62) and [0, 2**62): no int64 wraps.
        if int(delta.min()) < -(1 << 62) or int(delta.max()) >= 1 << 62:
            raise fail(f"{what}: values must be non-negative integers below 2**62")
        arr = np.cumsum(delta, axis=0, dtype=np.int64)
        if int(arr.view(np.uint64).max()) >= 1 << 62:
            raise fail(f"{what}: values must be non-negative integers below 2**62")
        nd = self.ndim
        if m and int(arr[:, 2 * nd].max()) >= self.sections:
            raise fail(f"{what}: a tile is in section #{int(arr[:, 2 * nd].max())} but there are {self.sections}")
        if nd and m:
            starts, ends = arr[:, 0], arr[:, 0] + arr[:, nd]
            if int(starts.min()) < int(self.first[i]) or int(ends.max()) > int(self.end[i]):
                raise fail(f"{what}: a tile lies outside the block's range [{int(self.first[i])}, {int(self.end[i])})")
        self._blocks[i] = arr
        self.inflated += 1
        return arr
