"""Compressed data files, written: each tile's chunks coded into frames by a few threads side by
side (blosc2 and xxhash release the GIL), in order, a few chunks ahead of the one the backend is
writing; delta frames against a base tile under dedup (format: :mod:`tessera.format.codec`).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from ...format.chunking import Chunking
from ...format.codec import MAX_CHAIN, DeltaColumns, FrameTable, delta_lanes, encode_chunk, file_header, subtract
from ...format.tilefile import FileLayout
from ...storage.base import Storage, timed_chunks


@dataclass(frozen=True)
class DeltaBase:
    """The tile a changed tile may be stored as a difference from (delta tiles, under dedup)."""

    ref: str
    """The manifest reference of the file holding it."""
    byte_offset: int
    """Its logical offset in that file."""
    table: FrameTable
    """That file's frame table."""
    read: Callable[[int, memoryview], None]
    """Fills the buffer with that file's logical bytes from the offset given."""


class CodingStats:
    """What the writes of one write stage spent (thread-safe): the coding threads' seconds, and
    the seconds the backend waited for its next bytes (staging pieces, checksums, frames; the rest
    of its time it was writing)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.logical = 0
        self.coding_s = 0.0
        self.waited_s = 0.0

    def coded(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.logical += nbytes
            self.coding_s += seconds

    def waited(self, seconds: float) -> None:
        with self._lock:
            self.waited_s += seconds


def _whole_chunks(parts: Iterator[memoryview], chunk_bytes: int) -> Iterator[memoryview]:
    """``parts`` (each valid until the next is asked for) regrouped into whole chunks (the last
    may be shorter); parts that already hold whole chunks are passed through without a copy."""
    buf: bytearray | None = None  # made when first needed: most tiles need none
    filled = 0
    for part in parts:
        pos = 0
        while pos < len(part):
            if not filled and len(part) - pos >= chunk_bytes:
                yield part[pos : pos + chunk_bytes]
                pos += chunk_bytes
                continue
            buf = buf if buf is not None else bytearray(chunk_bytes)
            n = min(chunk_bytes - filled, len(part) - pos)
            buf[filled : filled + n] = part[pos : pos + n]
            filled += n
            pos += n
            if filled == chunk_bytes:
                yield memoryview(buf)
                filled = 0
    if filled:
        assert buf is not None
        yield memoryview(buf)[:filled]


def _slices(view: memoryview, chunk_bytes: int) -> Iterator[memoryview]:
    """A tile staged whole, chunk by chunk (views: no copy)."""
    for j in range(0, len(view), chunk_bytes):
        yield view[j : j + chunk_bytes]


@dataclass(frozen=True)
class _Frame:
    """One chunk of a compressed file as an encoder left it."""

    slot: int
    """The tile (its index in the file's layout) the chunk is of."""
    checksum: int
    """xxh3-64 of the chunk's logical bytes."""
    logical: int
    data: memoryview | bytes
    """What is stored: a frame, the chunk as it is, or a delta frame."""
    parent: str | None = None
    """The manifest reference of the file a delta frame is a difference from."""
    delta: tuple[int, int, int] = (0, 0, 0)
    """A delta frame's parent offset, depth and lanes."""


GROUP_BYTES = 1 << 20
"""Logical bytes of consecutive chunks one coding thread codes per task: a task costs the pool
tens of microseconds, what coding a 32 KiB chunk takes (``docs/compression.md``, "Chunk size")."""

_Chunk = tuple[int, int, "memoryview | bytes"]


def _groups(todo: Iterator[_Chunk], group_bytes: int) -> Iterator[list[_Chunk]]:
    """``todo`` in runs of consecutive chunks of up to ``group_bytes`` (at least one chunk each)."""
    group: list[_Chunk] = []
    size = 0
    for chunk in todo:
        if group and size + len(chunk[2]) > group_bytes:
            yield group
            group, size = [], 0
        group.append(chunk)
        size += len(chunk[2])
    if group:
        yield group


def _in_order(
    fn: Callable[[list[_Chunk]], list[_Frame]],
    todo: Iterator[_Chunk],
    coders: ThreadPoolExecutor | None,
    ahead: int,
    group_bytes: int,
) -> Iterator[_Frame]:
    """``fn`` over ``todo`` in groups of chunks of up to ``group_bytes``, in order; with
    ``coders``, up to ``ahead`` groups (and their frames) ahead of the one yielded, so that coding
    runs on several cores while the backend writes. The chunks must stay valid while in flight
    (views of tiles staged whole); without ``coders`` each chunk is coded alone, as it comes (a
    memory budget's pieces are valid only until the next is asked for)."""
    if coders is None:
        for chunk in todo:
            yield from fn([chunk])
        return
    pending: collections.deque[Future[list[_Frame]]] = collections.deque()
    try:
        for group in _groups(todo, group_bytes):
            pending.append(coders.submit(fn, group))
            if len(pending) >= ahead:
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()
    finally:
        for f in pending:
            f.cancel()


def write_coded(
    storage: Storage,
    path: str,
    layout: FileLayout,
    staged: Sequence[torch.Tensor],
    chunking: Chunking,
    progress: Callable[[int], None] | None,
    pieces: Callable[[int], Iterator[memoryview]] | None,
    bases: Mapping[int, DeltaBase],
    coders: int,
    stats: CodingStats,
) -> tuple[list[tuple[int, ...]], FrameTable]:
    """Write a compressed data file: its header, then one frame per checksum chunk of each tile.

    Returns each tile's chunk checksums (fewer tiles than the layout's if the backend stopped
    early: the caller refuses that) and the file's frame table. The tiles keep their logical byte
    offsets (``layout``'s); the frame table says where each chunk is stored. Checksums are of the
    logical bytes. A chunk of a tile with a base in ``bases`` is stored as its difference from the
    base's chunk where that is smaller. ``coders`` threads code chunks side by side (blosc2 and
    xxhash release the GIL), up to ``coders + 1`` chunks ahead of the one the backend is writing.
    Under a memory budget (``pieces``) chunks are coded one at a time, as they come: a window's
    pieces are valid only until the next is asked for, and holding copies of several would take
    host memory beyond the budget.
    """
    sums_of: list[tuple[int, ...]] = []
    header = file_header()
    logical: list[int] = []
    stored: list[int] = []
    parents: dict[str, int] = {}
    delta_cols: list[tuple[int, int, int, int]] = []  # per frame: parent + 1, offset, depth, lanes

    def tile_chunks(i: int) -> Iterator[memoryview]:
        chunk_bytes = chunking.of(layout.slots[i].nbytes)
        if pieces is not None:
            return _whole_chunks(pieces(i), chunk_bytes)
        return _slices(staged[i].numpy().data if staged[i].numel() else memoryview(b""), chunk_bytes)

    def encode(i: int, k: int, c: memoryview | bytes, parent: _Parent | None) -> _Frame:
        """Chunk ``k`` of slot ``i`` as stored: whole (coded or raw) or as a difference from its base."""
        size = layout.slots[i].dtype.itemsize
        diff = None
        if parent is not None:
            diff = encode_chunk(subtract(c, parent.data, parent.lanes), parent.lanes.itemsize)
            if diff is not None and parent.depth > 1:
                # the base chunk is itself a difference (one was smaller the save before): take
                # this one without coding the chunk whole as well
                return _Frame(i, xxhash.xxh3_64_intdigest(c), len(c), diff, bases[i].ref, parent.delta)
        t = time.perf_counter()
        frame = encode_chunk(c, size)
        stats.coded(len(c), time.perf_counter() - t)
        out = c if frame is None else frame
        if parent is not None and diff is not None and len(diff) < len(out):
            return _Frame(i, xxhash.xxh3_64_intdigest(c), len(c), diff, bases[i].ref, parent.delta)
        return _Frame(i, xxhash.xxh3_64_intdigest(c), len(c), out)

    def encode_group(group: list[_Chunk]) -> list[_Frame]:
        found = _parents(group, bases, lambda i: chunking.of(layout.slots[i].nbytes), layout)
        return [encode(i, k, c, found.get((i, k))) for i, k, c in group]

    def frames() -> Iterator[memoryview | bytes]:
        yield header
        sums: list[list[int]] = [[] for _ in layout.slots]
        todo = ((i, k, c) for i in range(len(layout.slots)) for k, c in enumerate(tile_chunks(i)))
        for f in _in_order(encode_group, todo, pool, coders + 1, GROUP_BYTES):
            sums[f.slot].append(f.checksum)
            if f.parent is None:
                delta_cols.append((0, 0, 0, 0))
            else:
                delta_cols.append((parents.setdefault(f.parent, len(parents)) + 1, *f.delta))
            logical.append(f.logical)
            stored.append(len(f.data))
            yield f.data
            if progress is not None:
                progress(len(f.data))
        sums_of.extend(tuple(got) for got in sums)

    pool = ThreadPoolExecutor(coders, thread_name_prefix="tessera-code") if coders > 1 and pieces is None else None
    try:
        storage.write_file(path, timed_chunks(frames(), stats.waited))
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    first = layout.slots[0].byte_offset if layout.slots else len(layout.header)
    delta = None
    if parents:
        cols = np.array(delta_cols, dtype=np.int64).reshape(-1, 4)
        delta = DeltaColumns(tuple(parents), cols[:, 0], cols[:, 1], cols[:, 2], cols[:, 3])
    lengths = np.array(logical, dtype=np.int64), np.array(stored, dtype=np.int64)
    return sums_of, FrameTable(len(header), first, *lengths, delta)


@dataclass(frozen=True)
class _Parent:
    """The base's chunk a chunk may be stored as a difference from."""

    data: memoryview
    at: int
    """Its logical offset in the base's file."""
    depth: int
    """The difference's depth (the base chunk's, plus one)."""
    lanes: np.dtype

    @property
    def delta(self) -> tuple[int, int, int]:
        """The delta columns of a frame that is a difference from it: offset, depth, lanes."""
        return self.at, self.depth, self.lanes.itemsize


def _parents(
    group: list[_Chunk], bases: Mapping[int, DeltaBase], chunk_bytes: Callable[[int], int], layout: FileLayout
) -> dict[tuple[int, int], _Parent]:
    """The base chunks of the chunks of ``group`` that may be differences, by (slot, chunk):
    read in one call per run of consecutive chunks of a slot, not one per chunk (a base at the
    end of a chain of ``d`` hops costs ``d`` reads of each range it is read in)."""
    want: list[tuple[int, int, int, int, np.dtype, int]] = []  # slot, chunk, parent offset, length, lanes, depth
    for i, k, c in group:
        base = bases.get(i)
        if base is None:
            continue
        at = base.byte_offset + k * chunk_bytes(i)
        lanes = delta_lanes(layout.slots[i].dtype.itemsize, len(c))
        pf = base.table.frames(at, at + len(c))
        if lanes is None or len(pf) != 1 or base.table.logical_span(pf[0]) != (at, at + len(c)):
            continue  # the base's chunk is cut otherwise
        depth = 1 + (int(base.table.delta.depth[pf[0]]) if base.table.delta is not None else 0)
        if depth <= MAX_CHAIN:
            want.append((i, k, at, len(c), lanes, depth))
    found: dict[tuple[int, int], _Parent] = {}
    j = 0
    while j < len(want):
        n = j + 1  # a run: one slot, consecutive chunks whose base chunks are contiguous
        while n < len(want) and want[n][0] == want[j][0] and want[n][2] == want[n - 1][2] + want[n - 1][3]:
            n += 1
        i, at0 = want[j][0], want[j][2]
        data = np.empty(want[n - 1][2] + want[n - 1][3] - at0, dtype=np.uint8).data
        bases[i].read(at0, data)
        for _, k, at, length, lanes, depth in want[j:n]:
            found[(i, k)] = _Parent(data[at - at0 : at - at0 + length], at, depth, lanes)
        j = n
    return found
