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
from dataclasses import dataclass
from typing import Any

import numpy as np

CODEC = "blosc2-zstd"
FILTER = "shuffle"
LEVEL = 1
MAX_FRAME_BYTES = 1 << 30
"""The largest logical chunk a frame may declare (blosc2 chunks are limited to 2 GiB)."""
HEADER = b'{"__metadata__":{"format":"tessera-frames","producer":"tessera"}}'
"""The JSON of the 8-byte-length-prefixed header at the start of a compressed data file (padded
with spaces to 128 bytes in all): it declares no tensors, so a safetensors reader refuses the file
instead of misreading frames as tensors."""


class FrameError(ValueError):
    """A frame that does not decode to what the frame table declares (the caller names the tensor,
    file and rank)."""


def file_header() -> bytes:
    """The bytes a compressed data file starts with (128 of them)."""
    body = HEADER + b" " * (120 - len(HEADER))
    return len(body).to_bytes(8, "little") + body


def _blosc2() -> Any:
    import blosc2

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
        done = blosc2.decompress2(frame, dst=out)
    except Exception as e:
        raise FrameError(f"the frame does not decode ({e})") from None
    if done is not None and done != len(out):  # pragma: no cover - blosc2 returns None with dst
        raise FrameError(f"the frame decoded to {done} bytes, expected {len(out)}")


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

    def __post_init__(self) -> None:
        object.__setattr__(self, "_lpos", self.logical_start + np.concatenate([[0], np.cumsum(self.logical)]))
        object.__setattr__(self, "_spos", self.start + np.concatenate([[0], np.cumsum(self.stored)]))

    @property
    def logical_end(self) -> int:
        return int(self._lpos[-1])  # type: ignore[attr-defined]

    @property
    def stored_end(self) -> int:
        return int(self._spos[-1])  # type: ignore[attr-defined]

    def frames(self, lo: int, hi: int) -> range:
        """The frames whose logical bytes meet ``[lo, hi)``."""
        lpos = self._lpos  # type: ignore[attr-defined]
        first = int(np.searchsorted(lpos, lo, side="right")) - 1
        last = int(np.searchsorted(lpos, hi, side="left"))
        return range(max(first, 0), min(last, len(self.logical)))

    def logical_span(self, k: int) -> tuple[int, int]:
        return int(self._lpos[k]), int(self._lpos[k + 1])  # type: ignore[attr-defined]

    def stored_span(self, k: int) -> tuple[int, int]:
        return int(self._spos[k]), int(self._spos[k + 1])  # type: ignore[attr-defined]

    def stored_bytes(self, lo: int, hi: int) -> int:
        """Stored bytes of the frames that meet the logical bytes ``[lo, hi)``."""
        k = self.frames(lo, hi)
        return int(self._spos[k.stop] - self._spos[k.start]) if len(k) else 0  # type: ignore[attr-defined]

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
        }

    @classmethod
    def from_json(cls, raw: Any, *, file_bytes: int, chunk_bytes: int) -> FrameTable:
        """Parse and check a ``frames`` object against its file's stored size.

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
        logical = _parse_column(raw.get("logical"), "logical", most)
        stored = _parse_column(raw.get("stored"), "stored", most)
        if len(logical) != len(stored):
            raise ValueError(f"frames: {len(logical)} logical lengths but {len(stored)} stored lengths")
        if len(logical) and (
            int(logical.min()) < 1 or int(logical.max()) > min(chunk_bytes, MAX_FRAME_BYTES) or int(stored.min()) < 1
        ):
            raise ValueError(f"frames: every chunk must hold 1 to {min(chunk_bytes, MAX_FRAME_BYTES)} bytes")
        if (stored > logical).any():
            raise ValueError("frames: a frame is stored larger than its chunk")
        table = cls(start, lstart, logical, stored)
        if table.stored_end != file_bytes:
            raise ValueError(f"frames: the frames end at byte {table.stored_end} of a file of {file_bytes} bytes")
        if table.logical_end >= 1 << 62:
            raise ValueError("frames: the logical size is too large")
        return table


def _column(a: np.ndarray) -> str:
    """Base64 of the deflated little-endian int64 values."""
    return base64.b64encode(zlib.compress(np.ascontiguousarray(a, dtype="<i8").tobytes(), 1)).decode("ascii")


def _parse_column(text: Any, key: str, most: int) -> np.ndarray:
    if not isinstance(text, str):
        raise ValueError(f"frames.{key} must be a base64 string")
    try:  # bounded: no more values than the file has stored bytes
        buf = zlib.decompressobj().decompress(base64.b64decode(text, validate=True), 8 * most + 1)
    except (binascii.Error, ValueError, zlib.error):
        raise ValueError(f"frames.{key} is not valid base64 of zlib data") from None
    if len(buf) % 8 or len(buf) > 8 * most:
        raise ValueError(f"frames.{key} holds {len(buf)} bytes: not a column of at most {most} int64 values")
    a = np.frombuffer(buf, dtype="<i8").astype(np.int64)
    if len(a) and (int(a.min()) < 0 or int(a.max()) >= 1 << 62):
        raise ValueError(f"frames.{key} values must be non-negative integers below 2**62")
    return a
