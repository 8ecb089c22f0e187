"""Lossless compression of tile bytes: frames of one checksum chunk each, decodable alone.

A compressed data file holds, after a short header, one *frame* per checksum chunk of each of
its tiles, in the tiles' order: the chunk's bytes shuffled into byte planes by the tile's item
size and coded with zstd by blosc2 (one blosc2 chunk per frame), or the chunk's bytes as they
are when coding does not make them smaller. A frame is raw exactly when its stored length
equals its logical length. The tiles keep their *logical* byte offsets (where they would be in
the uncompressed file); the file's :class:`FrameTable` (in the manifest) maps logical chunks to
stored frames, so a reader decodes only the frames its byte ranges meet. Checksums are of the
logical bytes. The codec was chosen by measuring on trained state (``bench/bench_compress.py``,
``docs/compression.md``).
"""

from __future__ import annotations

import base64
import binascii
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

CODEC = "blosc2-zstd"
FILTER = "shuffle"
LEVEL = 1
MAX_CHAIN = 8
"""A delta frame is at most this many hops from a frame stored whole."""
MAX_FRAME_BYTES = 1 << 30
"""The largest logical chunk a frame may declare (blosc2 chunks are limited to 2 GiB)."""
HEADER = b'{"__metadata__":{"format":"tessera-frames","producer":"tessera"}}'
"""The JSON of the 8-byte-length-prefixed header at the start of a compressed data file (padded
with spaces to 128 bytes in all): it declares no tensors, so a safetensors reader refuses the file
instead of misreading frames as tensors."""


class ColumnBudget:
    """The bytes the frame tables of one document (a manifest, a section, a rank report) may
    inflate to, all their files together: ``FRAME_COLUMN_RATIO`` times the document's size plus
    ``FRAME_COLUMN_SLACK``. A column is inflated only up to what is left, so a document of a few
    bytes cannot declare gigabytes of frames, whatever file sizes it claims (not thread-safe: one
    per decoding)."""

    def __init__(self, document_bytes: int) -> None:
        self.left = FRAME_COLUMN_RATIO * document_bytes + FRAME_COLUMN_SLACK

    def take(self, n: int, what: str) -> None:
        if n > self.left:
            raise ValueError(f"{what}: the frame tables inflate past {FRAME_COLUMN_RATIO}x the document's size")
        self.left -= n


FRAME_COLUMN_RATIO = 256
"""A document's frame columns inflate to at most this many times its size (plus the slack): a
column of equal chunk lengths deflates about 1,000 to 1, so the bound is on the document, not on
each column (and a delta-coded step's manifest lists whole frame tables of files it shares)."""
FRAME_COLUMN_SLACK = 16 << 20


class FrameError(ValueError):
    """A frame that does not decode to what the frame table declares (the caller names the tensor,
    file and rank)."""


def file_header() -> bytes:
    """The bytes a compressed data file starts with (128 of them)."""
    body = HEADER + b" " * (120 - len(HEADER))
    return len(body).to_bytes(8, "little") + body


_GIL_RELEASED = False


def _blosc2() -> Any:
    global _GIL_RELEASED
    import blosc2

    if not _GIL_RELEASED:
        # blosc2 holds the GIL while it codes unless told otherwise (a process-wide setting): a
        # writer's or reader's threads then code one at a time, and a thread writing to storage
        # waits for the GIL behind them. Released, two threads code 4 MiB chunks at twice the rate
        # of one on the 2-core machine (docs/compression.md); the cost is one GIL hand-off per call.
        blosc2.set_releasegil(True)
        _GIL_RELEASED = True
    return blosc2


def encode_chunk(data: memoryview | bytes, itemsize: int) -> bytes | None:
    """The frame of one logical chunk, or None when coding does not make it smaller (store it raw)."""
    n = len(data)
    if n < 64:
        return None
    blosc2 = _blosc2()
    typesize = itemsize if 1 <= itemsize <= 255 and n % itemsize == 0 else 1
    frame = blosc2.compress2(
        data,
        typesize=typesize,
        codec=blosc2.Codec.ZSTD,
        clevel=LEVEL,
        filters=[blosc2.Filter.SHUFFLE],
        splitmode=blosc2.SplitMode.ALWAYS_SPLIT,
        nthreads=1,
    )
    return frame if len(frame) < n else None


def decode_chunk(frame: memoryview | bytes, out: memoryview) -> None:
    """Decode ``frame`` into ``out`` (exactly the chunk's logical length).

    The sizes the frame declares are checked against ``len(out)`` and ``len(frame)`` before
    anything is decoded, so a lying frame allocates nothing.

    Raises:
        FrameError: the frame is malformed, declares other sizes, or does not decode.
    """
    blosc2 = _blosc2()
    if len(frame) < 32:
        raise FrameError(f"a frame of {len(frame)} bytes is shorter than its header")
    try:
        nbytes, cbytes, _ = blosc2.get_cbuffer_sizes(bytes(frame[:32]))
    except Exception as e:  # blosc2 raises plain errors on a bad header
        raise FrameError(f"the frame's header is not valid ({e})") from None
    if nbytes != len(out) or cbytes != len(frame):
        raise FrameError(
            f"the frame declares {nbytes} bytes from {cbytes} stored, the frame table {len(out)} from {len(frame)}"
        )
    try:
        # one thread: the reader's own threads decode frames side by side (blosc2's default of
        # one thread per core made a 256 KiB frame decode at 1.2 GB/s instead of 1.9)
        done = blosc2.decompress2(frame, dst=out, nthreads=1)
    except Exception as e:
        raise FrameError(f"the frame does not decode ({e})") from None
    if done is not None and done != len(out):  # pragma: no cover - blosc2 returns None with dst
        raise FrameError(f"the frame decoded to {done} bytes, expected {len(out)}")


def delta_lanes(itemsize: int, n: int) -> np.dtype | None:
    """The unsigned integer a chunk of ``n`` bytes of items of ``itemsize`` is differenced in, or
    None where it cannot be (a length that is not a whole number of lanes)."""
    width = {1: 1, 2: 2, 4: 4, 8: 8, 16: 8}.get(itemsize, 1)
    return np.dtype(f"<u{width}") if n % width == 0 else None


def subtract(new: memoryview | bytes, base: memoryview | bytes | bytearray, lanes: np.dtype) -> bytes:
    """``new - base`` lane by lane, modulo 2**bits: exact and invertible (:func:`add_into`)."""
    return (np.frombuffer(new, lanes) - np.frombuffer(base, lanes)).tobytes()


def add_into(out: memoryview, base: memoryview | bytes | bytearray, lanes: np.dtype) -> None:
    """``out += base`` lane by lane, modulo 2**bits (``out`` holds a decoded difference)."""
    a = np.frombuffer(out, lanes)
    np.add(a, np.frombuffer(base, lanes), out=a)


@dataclass(frozen=True, eq=False)
class DeltaColumns:
    """Which frames of a file are differences from a chunk of another file (delta tiles).

    Attributes:
        parents: manifest references of the files differenced against.
        parent: ``(n,)`` per frame, 1 + the index into ``parents``, or 0 for a frame stored whole.
        offset: ``(n,)`` the logical offset of the parent chunk in its file (0 where none).
        depth: ``(n,)`` hops to a frame stored whole (0: this one is); a parent frame's depth is
            one less, so a chain always ends, in at most :data:`MAX_CHAIN` hops.
        lanes: ``(n,)`` bytes per lane of the difference (1, 2, 4 or 8; 0 where none).
    """

    parents: tuple[str, ...]
    parent: np.ndarray
    offset: np.ndarray
    depth: np.ndarray
    lanes: np.ndarray

    def to_json(self) -> dict[str, Any]:
        return {
            "parents": list(self.parents),
            **{k: _column(getattr(self, k)) for k in ("parent", "offset", "depth", "lanes")},
        }

    @classmethod
    def from_json(cls, raw: Any, n: int, budget: ColumnBudget | None = None) -> DeltaColumns:
        if not isinstance(raw, dict) or not isinstance(raw.get("parents"), list):
            raise ValueError("frames.delta must be an object with a list of parents")
        parents = raw["parents"]
        if not all(isinstance(p, str) for p in parents) or len(parents) > n:
            raise ValueError("frames.delta.parents must be at most one file reference per frame")
        cols = {k: _parse_column(raw.get(k), f"delta.{k}", n, budget) for k in ("parent", "offset", "depth", "lanes")}
        if any(len(c) != n for c in cols.values()):
            raise ValueError(f"frames.delta columns must hold one value per frame ({n})")
        parent, depth, lanes = cols["parent"], cols["depth"], cols["lanes"]
        if n and (int(parent.max()) > len(parents) or int(depth.max()) > MAX_CHAIN):
            raise ValueError(f"frames.delta: a parent index past the parents, or a chain over {MAX_CHAIN} hops")
        if ((parent == 0) != (depth == 0)).any() or ((parent == 0) != (lanes == 0)).any():
            raise ValueError("frames.delta: a frame has a parent exactly when its depth and lanes are not 0")
        if not np.isin(lanes, (0, 1, 2, 4, 8)).all():
            raise ValueError("frames.delta.lanes must be 1, 2, 4 or 8 bytes")
        return cls(tuple(parents), parent, cols["offset"], depth, lanes)


@dataclass(frozen=True, eq=False)
class FrameTable:
    """Where a compressed data file's logical chunks are stored.

    Attributes:
        start: the file offset of the first frame (after the file's header).
        logical_start: the logical offset of the first chunk (where the first tile would start
            in the uncompressed file); chunks follow each other with no gap.
        logical: ``(n,)`` each chunk's logical length.
        stored: ``(n,)`` each frame's stored length (equal to ``logical``: stored raw).
    """

    start: int
    logical_start: int
    logical: np.ndarray
    stored: np.ndarray
    delta: DeltaColumns | None = None
    """Which frames are differences from another file's chunks (None: none is)."""
    _lpos: np.ndarray = field(init=False, repr=False)
    _spos: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_lpos", self.logical_start + np.concatenate([[0], np.cumsum(self.logical)]))
        object.__setattr__(self, "_spos", self.start + np.concatenate([[0], np.cumsum(self.stored)]))

    @property
    def logical_end(self) -> int:
        return int(self._lpos[-1])

    @property
    def stored_end(self) -> int:
        return int(self._spos[-1])

    def frames(self, lo: int, hi: int) -> range:
        """The frames whose logical bytes meet ``[lo, hi)``."""
        lpos = self._lpos
        first = int(np.searchsorted(lpos, lo, side="right")) - 1
        last = int(np.searchsorted(lpos, hi, side="left"))
        return range(max(first, 0), min(last, len(self.logical)))

    def logical_span(self, k: int) -> tuple[int, int]:
        return int(self._lpos[k]), int(self._lpos[k + 1])

    def stored_span(self, k: int) -> tuple[int, int]:
        return int(self._spos[k]), int(self._spos[k + 1])

    def stored_bytes(self, lo: int, hi: int) -> int:
        """Stored bytes of the frames that meet the logical bytes ``[lo, hi)``."""
        k = self.frames(lo, hi)
        return int(self._spos[k.stop] - self._spos[k.start]) if len(k) else 0

    def to_json(self) -> dict[str, Any]:
        """The manifest's ``frames`` object of a file (``docs/format.md``)."""
        return {
            "codec": CODEC,
            "filter": FILTER,
            "level": LEVEL,
            "start": self.start,
            "logical_start": self.logical_start,
            "logical": _column(self.logical),
            "stored": _column(self.stored),
            **({"delta": self.delta.to_json()} if self.delta is not None else {}),
        }

    @classmethod
    def from_json(
        cls, raw: Any, *, file_bytes: int, chunk_bytes: int, budget: ColumnBudget | None = None
    ) -> FrameTable:
        """Parse and check a ``frames`` object against its file's stored size.

        ``budget``: what the columns of the document it is part of may still inflate to (None:
        only this file's size bounds them); the columns are inflated no further than that.

        Raises:
            ValueError: naming the field that is wrong (the caller names the manifest and file).
        """
        if not isinstance(raw, dict):
            raise ValueError("frames must be an object")
        if raw.get("codec") != CODEC or raw.get("filter") != FILTER:
            raise ValueError(
                f"frames: codec {raw.get('codec')!r:.40} with filter {raw.get('filter')!r:.40} is not one this "
                f"tessera reads ({CODEC!r} with {FILTER!r}); upgrade tessera"
            )
        start, lstart = raw.get("start"), raw.get("logical_start")
        if not all(type(v) is int and 0 <= v < 1 << 62 for v in (start, lstart, raw.get("level"))):
            raise ValueError("frames: start, logical_start and level must be non-negative integers")
        assert isinstance(start, int) and isinstance(lstart, int)
        # At most one frame per stored byte: the columns cannot declare more than the file holds.
        most = max(0, file_bytes - start)
        logical = _parse_column(raw.get("logical"), "logical", most, budget)
        stored = _parse_column(raw.get("stored"), "stored", most, budget)
        if len(logical) != len(stored):
            raise ValueError(f"frames: {len(logical)} logical lengths but {len(stored)} stored lengths")
        if len(logical) and (
            int(logical.min()) < 1 or int(logical.max()) > min(chunk_bytes, MAX_FRAME_BYTES) or int(stored.min()) < 1
        ):
            raise ValueError(f"frames: every chunk must hold 1 to {min(chunk_bytes, MAX_FRAME_BYTES)} bytes")
        if (stored > logical).any():
            raise ValueError("frames: a frame is stored larger than its chunk")
        delta = DeltaColumns.from_json(raw["delta"], len(logical), budget) if "delta" in raw else None
        if delta is not None and (stored[delta.depth > 0] >= logical[delta.depth > 0]).any():
            raise ValueError("frames: a delta frame is not smaller than its chunk (it would read as raw)")
        table = cls(start, lstart, logical, stored, delta)
        if table.stored_end != file_bytes:
            raise ValueError(f"frames: the frames end at byte {table.stored_end} of a file of {file_bytes} bytes")
        if table.logical_end >= 1 << 62:
            raise ValueError("frames: the logical size is too large")
        return table


def _column(a: np.ndarray) -> str:
    """Base64 of the deflated little-endian int64 values."""
    return base64.b64encode(zlib.compress(np.ascontiguousarray(a, dtype="<i8").tobytes(), 1)).decode("ascii")


def _parse_column(text: Any, key: str, most: int, budget: ColumnBudget | None = None) -> np.ndarray:
    if not isinstance(text, str):
        raise ValueError(f"frames.{key} must be a base64 string")
    limit = 8 * most if budget is None else min(8 * most, budget.left)
    try:  # bounded: no more values than the file has stored bytes, nor than the document may declare
        buf = zlib.decompressobj().decompress(base64.b64decode(text, validate=True), limit + 1)
    except (binascii.Error, ValueError, zlib.error):
        raise ValueError(f"frames.{key} is not valid base64 of zlib data") from None
    if budget is not None and len(buf) > limit and limit < 8 * most:
        budget.take(len(buf), f"frames.{key}")  # raises: past what the document may declare
    if len(buf) % 8 or len(buf) > 8 * most:
        raise ValueError(f"frames.{key} holds {len(buf)} bytes: not a column of at most {most} int64 values")
    if budget is not None:
        budget.take(len(buf), f"frames.{key}")
    a = np.frombuffer(buf, dtype="<i8").astype(np.int64)
    if len(a) and (int(a.min()) < 0 or int(a.max()) >= 1 << 62):
        raise ValueError(f"frames.{key} values must be non-negative integers below 2**62")
    return a
