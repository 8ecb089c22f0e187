"""Reading compressed data files: a logical byte range from the frames that hold it.

A compressed file's tiles keep their logical byte offsets (``tessera/format/codec.py``); the
read plan is the same as for a plain file, and :func:`read_logical` turns each of its range
reads into one read of the stored frames that meet it, decoding each frame once, straight into
the destination where the frame lies wholly inside it. A delta frame is decoded, then its parent
chunk (in another file, read the same way, at most ``MAX_CHAIN`` hops) is added to it. Checksums
are verified by the caller, on the decoded (logical) bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import numpy as np

from ..format.codec import FrameError, FrameTable, add_into, decode_chunk
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
    storage: Storage,
    path: str,
    table: FrameTable,
    start: int,
    out: memoryview,
    stats: DecodeStats | None = None,
    *,
    tables: Mapping[str, FrameTable | None] | None = None,
    locate: Callable[[str], str] | None = None,
) -> None:
    """Fill ``out`` with the logical bytes ``[start, start + len(out))`` of the compressed file ``path``.

    Args:
        tables: the frame table of every file of the checkpoint, by manifest reference (the
            parents of delta frames are looked up there).
        locate: a manifest reference to the path ``storage`` reads (identity when None).

    Raises:
        FrameError: the range is outside the file's frames, a frame does not decode to what
            the frame table declares, or a delta frame's parent is not where it says.
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
    stored = _scratch(s1 - s0)  # filled by the read whole: no need to zero it first
    storage.read_into(path if locate is None else locate(path), s0, stored)
    decoded = 0
    delta = table.delta
    for k in frames:
        a, b = table.logical_span(k)
        fa, fb = table.stored_span(k)
        frame = stored[fa - s0 : fb - s0]
        partial = not (start <= a and b <= stop)
        dest = _scratch(b - a) if partial else out[a - start : b - start]
        if fb - fa == b - a:  # stored raw
            dest[:] = frame
        else:
            try:
                decode_chunk(frame, dest)
            except FrameError as e:
                raise FrameError(f"frame {k} (stored bytes [{fa}, {fb}), logical [{a}, {b})): {e}") from None
        if delta is not None and delta.depth[k]:
            _add_parent(storage, path, table, k, dest, tables or {}, locate)
        decoded += b - a
        if partial:
            lo, hi = max(a, start), min(b, stop)
            out[lo - start : hi - start] = dest[lo - a : hi - a]
    if stats is not None:
        stats.add(decoded, s1 - s0)


def _scratch(n: int) -> memoryview:
    """``n`` bytes of uninitialised memory (``bytearray(n)`` zeroes them: a pass over every
    stored byte a load reads, for bytes the read or the decoder overwrites at once)."""
    return np.empty(n, dtype=np.uint8).data


def _add_parent(
    storage: Storage,
    path: str,
    table: FrameTable,
    k: int,
    dest: memoryview,
    tables: Mapping[str, FrameTable | None],
    locate: Callable[[str], str] | None,
) -> None:
    """Add frame ``k``'s parent chunk to its decoded difference in ``dest``."""
    delta = table.delta
    assert delta is not None
    parent = delta.parents[int(delta.parent[k]) - 1]
    at, depth = int(delta.offset[k]), int(delta.depth[k])
    ptable = tables.get(parent)
    if ptable is None:
        raise FrameError(f"frame {k} is a difference from {parent!r}, which is not a compressed file of the checkpoint")
    pf = ptable.frames(at, at + len(dest))
    pdepth = 0 if ptable.delta is None or len(pf) != 1 else int(ptable.delta.depth[pf[0]])
    if len(pf) != 1 or ptable.logical_span(pf[0]) != (at, at + len(dest)) or pdepth != depth - 1:
        raise FrameError(
            f"frame {k} is a difference from logical bytes [{at}, {at + len(dest)}) of {parent!r}, which is not one "
            f"frame {depth - 1} hops from a whole one"
        )
    base = _scratch(len(dest))
    read_logical(storage, parent, ptable, at, base, tables=tables, locate=locate)
    add_into(dest, base, np.dtype(f"<u{int(delta.lanes[k])}"))
