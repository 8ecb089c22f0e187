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
    whole_deltas: list[int] = []  # delta frames decoded straight into ``out``: parents added in runs below
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
        decoded += b - a
        if delta is not None and delta.depth[k]:
            if not partial:
                whole_deltas.append(k)
                continue
            _add_parents(storage, path, table, [k], dest, tables or {}, locate)
        if partial:
            lo, hi = max(a, start), min(b, stop)
            out[lo - start : hi - start] = dest[lo - a : hi - a]
    for run in _runs(table, whole_deltas):
        a, b = table.logical_span(run[0])[0], table.logical_span(run[-1])[1]
        _add_parents(storage, path, table, run, out[a - start : b - start], tables or {}, locate)
    if stats is not None:
        stats.add(decoded, s1 - s0)


def _runs(table: FrameTable, frames: list[int]) -> list[list[int]]:
    """``frames`` (delta frames, ascending) in runs whose parents are one contiguous range of one
    file at one depth, in one lane width: each run's parents are read with one call, not one per
    frame (a chain of ``d`` hops otherwise costs ``d`` reads per 32 KiB chunk)."""
    delta = table.delta
    runs: list[list[int]] = []
    if delta is None:
        return runs
    for k in frames:
        if runs:
            j = runs[-1][-1]
            a, b = table.logical_span(j)
            if (
                k == j + 1
                and delta.parent[k] == delta.parent[j]
                and delta.depth[k] == delta.depth[j]
                and delta.lanes[k] == delta.lanes[j]
                and delta.offset[k] == delta.offset[j] + (b - a)
            ):
                runs[-1].append(k)
                continue
        runs.append([k])
    return runs


def _scratch(n: int) -> memoryview:
    """``n`` bytes of uninitialised memory (``bytearray(n)`` zeroes them: a pass over every
    stored byte a load reads, for bytes the read or the decoder overwrites at once)."""
    return np.empty(n, dtype=np.uint8).data


def _add_parents(
    storage: Storage,
    path: str,
    table: FrameTable,
    run: list[int],
    dest: memoryview,
    tables: Mapping[str, FrameTable | None],
    locate: Callable[[str], str] | None,
) -> None:
    """Add the parent chunks of the delta frames ``run`` (one of :func:`_runs`) to their decoded
    differences in ``dest``; each frame's parent must be one frame of its own span, one hop nearer
    to a whole one."""
    delta = table.delta
    assert delta is not None
    k0 = run[0]
    parent = delta.parents[int(delta.parent[k0]) - 1]
    at, depth = int(delta.offset[k0]), int(delta.depth[k0])
    ptable = tables.get(parent)
    if ptable is None:
        raise FrameError(
            f"frame {k0} is a difference from {parent!r}, which is not a compressed file of the checkpoint"
        )
    pf = ptable.frames(at, at + len(dest))
    for k, p in zip(run, pf if len(pf) == len(run) else [None] * len(run)):
        a, b = table.logical_span(k)
        pat = int(delta.offset[k])
        pdepth = 0 if p is None or ptable.delta is None else int(ptable.delta.depth[p])
        if p is None or ptable.logical_span(p) != (pat, pat + b - a) or pdepth != depth - 1:
            raise FrameError(
                f"frame {k} is a difference from logical bytes [{pat}, {pat + b - a}) of {parent!r}, which is not one "
                f"frame {depth - 1} hops from a whole one"
            )
    base = _scratch(len(dest))
    read_logical(storage, parent, ptable, at, base, tables=tables, locate=locate)
    add_into(dest, base, np.dtype(f"<u{int(delta.lanes[k0])}"))
