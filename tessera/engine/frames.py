"""Reading compressed data files: a logical byte range from the frames that hold it.

A compressed file's tiles keep their logical byte offsets (``tessera/format/codec.py``); the
read plan is the same as for a plain file, and :func:`read_logical` turns each of its range
reads into one read of the stored frames that meet it, decoding each frame once, straight into
the destination where the frame lies wholly inside it. Checksums are verified by the caller, on
the decoded (logical) bytes.
"""

from __future__ import annotations

import threading

from ..format.codec import FrameError, FrameTable, decode_chunk
from ..storage.base import Storage


class DecodeStats:
    """Bytes a reader decoded and stored bytes it read for compressed files (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.decoded = 0
        self.stored = 0

    def add(self, decoded: int, stored: int) -> None:
        with self._lock:
            self.decoded += decoded
            self.stored += stored


def read_logical(
    storage: Storage, path: str, table: FrameTable, start: int, out: memoryview, stats: DecodeStats | None = None
) -> None:
    """Fill ``out`` with the logical bytes ``[start, start + len(out))`` of the compressed file ``path``.

    Raises:
        FrameError: the range is outside the file's frames, or a frame does not decode to what
            the frame table declares.
        OSError: the storage read failed (as ``Storage.read_into`` raises it).
    """
    stop = start + len(out)
    if start < table.logical_start or stop > table.logical_end:
        raise FrameError(
            f"logical bytes [{start}, {stop}) are outside the frames' [{table.logical_start}, {table.logical_end})"
        )
    if stop == start:
        return
    frames = table.frames(start, stop)
    s0 = table.stored_span(frames[0])[0]
    s1 = table.stored_span(frames[-1])[1]
    stored = bytearray(s1 - s0)
    storage.read_into(path, s0, memoryview(stored))
    decoded = 0
    for k in frames:
        a, b = table.logical_span(k)
        fa, fb = table.stored_span(k)
        frame = memoryview(stored)[fa - s0 : fb - s0]
        partial = not (start <= a and b <= stop)
        dest = memoryview(bytearray(b - a)) if partial else out[a - start : b - start]
        if fb - fa == b - a:  # stored raw
            dest[:] = frame
        else:
            try:
                decode_chunk(frame, dest)
            except FrameError as e:
                raise FrameError(f"frame {k} (stored bytes [{fa}, {fb}), logical [{a}, {b})): {e}") from None
        decoded += b - a
        if partial:
            lo, hi = max(a, start), min(b, stop)
            out[lo - start : hi - start] = dest[lo - a : hi - a]
    if stats is not None:
        stats.add(decoded, s1 - s0)
