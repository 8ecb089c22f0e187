"""Stream staged tiles into data files, checksumming every chunk on the way.

Each data file is written by one task of a small thread pool; ``xxhash`` and file I/O both
release the GIL, so a rank's files stream in parallel at close to the device's bandwidth.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from ...errors import StorageError
from ...format.codec import MAX_CHAIN, DeltaColumns, FrameTable, delta_lanes, encode_chunk, file_header, subtract
from ...format.geometry import Box
from ...format.tilefile import FileLayout
from ...storage.base import Storage
from ...storage.capabilities import SyncsDirs
from . import compress_choice

logger = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class FileWrite:
    """One data file to write: its path, its layout and the staged bytes of its tiles."""

    path: str
    """Relative to the storage root (``data/<save id>/<rank>-<k>.safetensors``)."""
    layout: FileLayout
    tiles: Sequence[torch.Tensor]
    """Host byte views (1-D uint8), in ``layout.slots`` order."""
    known_sums: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    """The first chunk checksums of some slots (by index), already computed: not computed again."""
    pieces: Callable[[int], Iterator[memoryview]] | None = None
    """Under a memory budget: slot ``i``'s bytes come as consecutive pieces of ``pieces(i)``
    (each valid until the next is asked for) instead of from ``tiles``."""
    bases: Mapping[int, DeltaBase] = field(default_factory=dict)
    """Compressed writes: the tile slot ``i`` may be stored as a difference from (by index)."""


@dataclass(frozen=True)
class WriteRequest:
    """The write stage of one rank's save: every file it writes, and how."""

    files: tuple[FileWrite, ...]
    chunk_bytes: int
    """Checksum granularity."""
    threads: int
    """Files written in parallel."""
    compress: bool | str = False
    """Store each chunk as a frame (:mod:`tessera.format.codec`) instead of the safetensors layout;
    ``"auto"``: where :mod:`.compress_choice` measured the codec faster than the storage."""


@dataclass(frozen=True)
class WrittenTile:
    """A tile as written: where its bytes are in the file and their chunk checksums."""

    fqn: str
    box: Box
    byte_offset: int
    nbytes: int
    checksums: tuple[int, ...]


@dataclass(frozen=True)
class WrittenFile:
    """A data file as written (durably), reported to the coordinator for the manifest."""

    path: str
    nbytes: int
    tiles: tuple[WrittenTile, ...]
    seconds: float
    frames: FrameTable | None = None
    """For a compressed file: where its logical chunks are stored (``nbytes`` is the stored size)."""


def checksum_chunks(data: memoryview, chunk_bytes: int) -> Iterator[tuple[memoryview, int]]:
    """``(chunk, xxh3_64)`` for each ``chunk_bytes`` slice of ``data``."""
    for i in range(0, len(data), chunk_bytes):
        c = data[i : i + chunk_bytes]
        yield c, xxhash.xxh3_64_intdigest(c)


class ChunkSums:
    """The xxh3-64 of each ``chunk_bytes`` chunk of a byte stream fed in pieces of any size: the
    tile checksums, whether the writer streams a tile or the call-time fingerprint hashes it."""

    def __init__(self, chunk_bytes: int) -> None:
        self._chunk = chunk_bytes
        self._h = xxhash.xxh3_64()
        self._filled = 0
        self._sums: list[int] = []

    def feed(self, data: memoryview) -> Iterator[memoryview]:
        """Hash ``data``, yielding it in parts that end at chunk boundaries (lazily: iterate it)."""
        pos = 0
        while pos < len(data):
            n = min(self._chunk - self._filled, len(data) - pos)
            part = data[pos : pos + n]
            self._h.update(part)
            self._filled += n
            pos += n
            if self._filled == self._chunk:
                self._sums.append(self._h.intdigest())
                self._h.reset()
                self._filled = 0
            yield part

    def done(self) -> tuple[int, ...]:
        """The checksums of every chunk fed, the last partial one included."""
        if self._filled:
            self._sums.append(self._h.intdigest())
            self._h.reset()
            self._filled = 0
        return tuple(self._sums)


Progress = Callable[[int], None]
"""Called with a byte count each time the backend has taken that many more bytes (0: a file is done)."""


def _write_one(
    storage: Storage,
    path: str,
    layout: FileLayout,
    staged: Sequence[torch.Tensor],
    chunk_bytes: int,
    progress: Progress | None = None,
    known_sums: Mapping[int, tuple[int, ...]] | None = None,
    pieces: Callable[[int], Iterator[memoryview]] | None = None,
    compress: bool = False,
    bases: Mapping[int, DeltaBase] | None = None,
    coders: int = 1,
    stats: CodingStats | None = None,
) -> WrittenFile:
    t0 = time.monotonic()
    tiles: list[WrittenTile] = []
    known = known_sums or {}
    if compress:
        return _write_framed(storage, path, layout, staged, chunk_bytes, progress, pieces, bases or {}, coders, stats)

    def streamed() -> Iterator[memoryview | bytes]:
        """The tiles' bytes from ``pieces``, checksummed across piece boundaries."""
        assert pieces is not None
        yield layout.header
        for i, slot in enumerate(layout.slots):
            sums = ChunkSums(chunk_bytes)
            for part in pieces(i):
                for c in sums.feed(part):
                    yield c
                    if progress is not None:
                        progress(len(c))
            tiles.append(WrittenTile(slot.fqn, slot.box, slot.byte_offset, slot.nbytes, sums.done()))

    def chunks() -> Iterator[memoryview | bytes]:
        yield layout.header
        for i, (slot, data) in enumerate(zip(layout.slots, staged)):
            view = data.numpy().data if data.numel() else memoryview(b"")
            sums = list(known.get(i, ()))
            done = len(sums) * chunk_bytes  # bytes whose checksums are known
            for j in range(0, min(done, len(view)), chunk_bytes):
                c = view[j : j + chunk_bytes]
                yield c
                if progress is not None:
                    progress(len(c))
            for c, h in checksum_chunks(view[done:], chunk_bytes):
                sums.append(h)
                yield c
                if progress is not None:  # the backend asked for the next chunk: it took this one
                    progress(len(c))
            tiles.append(WrittenTile(slot.fqn, slot.box, slot.byte_offset, slot.nbytes, tuple(sums)))

    storage.write_file(path, _producing(chunks() if pieces is None else streamed(), stats or CodingStats()))
    if progress is not None:
        progress(0)
    if len(tiles) != len(layout.slots):
        # A backend that stopped consuming the stream early must not lead to a commit.
        raise StorageError(f"writing {path}: the storage backend wrote {len(tiles)} of {len(layout.slots)} tiles")
    return WrittenFile(path, layout.nbytes, tuple(tiles), time.monotonic() - t0)


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


def _producing(chunks: Iterator[memoryview | bytes], stats: CodingStats) -> Iterator[memoryview | bytes]:
    """``chunks`` as the backend takes them, the time spent making each counted as waited, so
    that what is left of a write's time is the storage's own (``compress="auto"`` measures it)."""
    try:
        while True:
            t = time.perf_counter()
            try:
                chunk = next(chunks)
            except StopIteration:
                return
            finally:
                stats.waited(time.perf_counter() - t)
            yield chunk
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()  # a backend that stopped early: the producer's own clean-up runs now


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


def _in_order(
    fn: Callable[[int, int, memoryview | bytes], _Frame],
    todo: Iterator[tuple[int, int, memoryview | bytes]],
    coders: ThreadPoolExecutor | None,
    ahead: int,
    *,
    copy: bool,
) -> Iterator[_Frame]:
    """``fn`` over ``todo``, in order; with ``coders``, a few chunks ahead of the one yielded, so
    that coding runs on several cores while the backend writes. ``copy``: the chunks are only
    valid until the next is asked for (a memory budget's pieces), so each is copied before it is
    handed on; at most ``ahead`` chunks (and their frames) are in flight either way."""
    if coders is None:
        for args in todo:
            yield fn(*args)
        return
    pending: collections.deque[Future[_Frame]] = collections.deque()
    try:
        for i, k, c in todo:
            pending.append(coders.submit(fn, i, k, bytes(c) if copy else c))
            if len(pending) >= ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for f in pending:
            f.cancel()


def _write_framed(
    storage: Storage,
    path: str,
    layout: FileLayout,
    staged: Sequence[torch.Tensor],
    chunk_bytes: int,
    progress: Progress | None,
    pieces: Callable[[int], Iterator[memoryview]] | None,
    bases: Mapping[int, DeltaBase],
    coders: int = 1,
    stats: CodingStats | None = None,
) -> WrittenFile:
    """Write a compressed data file: its header, then one frame per checksum chunk of each tile.

    The tiles keep their logical byte offsets (``layout``'s); the returned frame table says where
    each chunk is stored. Checksums are of the logical bytes. A chunk of a tile with a base in
    ``bases`` is stored as its difference from the base's chunk where that is smaller. ``coders``
    threads code chunks side by side (blosc2 and xxhash release the GIL), up to ``coders + 1``
    chunks ahead of the one the backend is writing.
    """
    t0 = time.monotonic()
    stats = stats if stats is not None else CodingStats()
    tiles: list[WrittenTile] = []
    header = file_header()
    logical: list[int] = []
    stored: list[int] = []
    parents: dict[str, int] = {}
    delta_cols: list[tuple[int, int, int, int]] = []  # per frame: parent + 1, offset, depth, lanes

    def tile_chunks(i: int) -> Iterator[memoryview]:
        if pieces is not None:
            return _whole_chunks(pieces(i), chunk_bytes)
        return _slices(staged[i].numpy().data if staged[i].numel() else memoryview(b""), chunk_bytes)

    def encode(i: int, k: int, c: memoryview | bytes) -> _Frame:
        """Chunk ``k`` of slot ``i`` as stored: whole (coded or raw) or as a difference from its base."""
        size = layout.slots[i].dtype.itemsize
        t = time.perf_counter()
        frame = encode_chunk(c, size)
        stats.coded(len(c), time.perf_counter() - t)
        out = c if frame is None else frame
        base = bases.get(i)
        diff = None if base is None else _delta_frame(base, k, c, chunk_bytes, size)
        if base is not None and diff is not None and len(diff[0]) < len(out):
            return _Frame(i, xxhash.xxh3_64_intdigest(c), len(c), diff[0], base.ref, diff[1:])
        return _Frame(i, xxhash.xxh3_64_intdigest(c), len(c), out)

    def frames() -> Iterator[memoryview | bytes]:
        yield header
        sums: list[list[int]] = [[] for _ in layout.slots]
        todo = ((i, k, c) for i in range(len(layout.slots)) for k, c in enumerate(tile_chunks(i)))
        for f in _in_order(encode, todo, pool, coders + 1, copy=pieces is not None):
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
        for slot, got in zip(layout.slots, sums):
            tiles.append(WrittenTile(slot.fqn, slot.box, slot.byte_offset, slot.nbytes, tuple(got)))

    pool = ThreadPoolExecutor(coders, thread_name_prefix="tessera-code") if coders > 1 else None
    try:
        storage.write_file(path, _producing(frames(), stats))
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    if progress is not None:
        progress(0)
    if len(tiles) != len(layout.slots):
        raise StorageError(f"writing {path}: the storage backend wrote {len(tiles)} of {len(layout.slots)} tiles")
    first = layout.slots[0].byte_offset if layout.slots else len(layout.header)
    delta = None
    if parents:
        cols = np.array(delta_cols, dtype=np.int64).reshape(-1, 4)
        delta = DeltaColumns(tuple(parents), cols[:, 0], cols[:, 1], cols[:, 2], cols[:, 3])
    lengths = np.array(logical, dtype=np.int64), np.array(stored, dtype=np.int64)
    table = FrameTable(len(header), first, *lengths, delta)
    return WrittenFile(path, table.stored_end, tuple(tiles), time.monotonic() - t0, table)


def _delta_frame(
    base: DeltaBase, k: int, chunk: memoryview | bytes, chunk_bytes: int, itemsize: int
) -> tuple[bytes, int, int, int] | None:
    """Chunk ``k``'s frame as a difference from the base's chunk ``k``: (frame, parent offset, depth,
    lanes), or None where it cannot be one (the base's chunk is cut otherwise, or its chain is full)."""
    at = base.byte_offset + k * chunk_bytes
    lanes = delta_lanes(itemsize, len(chunk))
    pf = base.table.frames(at, at + len(chunk))
    if lanes is None or len(pf) != 1 or base.table.logical_span(pf[0]) != (at, at + len(chunk)):
        return None
    depth = 1 + (int(base.table.delta.depth[pf[0]]) if base.table.delta is not None else 0)
    if depth > MAX_CHAIN:
        return None
    parent = bytearray(len(chunk))
    base.read(at, memoryview(parent))
    frame = encode_chunk(subtract(chunk, parent, lanes), lanes.itemsize)
    return None if frame is None else (frame, at, depth, lanes.itemsize)


def write_files(
    storage: Storage,
    files: Sequence[tuple[str, FileLayout, Sequence[torch.Tensor]]],
    *,
    chunk_bytes: int,
    threads: int,
    progress: Progress | None = None,
    compress: bool | str = False,
) -> list[WrittenFile]:
    """Write every ``(path, layout, staged tile bytes)``: :func:`write_tiles` for callers with tuples."""
    request = WriteRequest(tuple(FileWrite(p, lay, st) for p, lay, st in files), chunk_bytes, threads, compress)
    return write_tiles(storage, request, progress)


def write_tiles(storage: Storage, request: WriteRequest, progress: Progress | None = None) -> list[WrittenFile]:
    """The write stage: write every file of ``request`` durably and return what was written.

    Durable means: each file fsync'ed by the backend, then (backends with ``sync_dirs``)
    the directories holding them, so that nothing can refer to a file whose directory
    entry a power loss could still undo.

    If any file fails, every file of the call (complete or partial) is removed before the
    error is raised: a failed save leaves nothing behind, so a full disk does not stay full.

    ``progress`` (optional, called from the writing threads) hears of every chunk the backend
    took and of every finished file: the writer process reports it, so that a writer that
    stops making progress can be told from a slow one.

    Raises:
        StorageError: the first failure (the other files are still attempted to the end).
    """
    files, chunk_bytes, threads = request.files, request.chunk_bytes, request.threads
    if not files:
        return []
    parallel = min(threads, os.cpu_count() or 1)  # the rank's files and coders share its cores
    # A compressed file is coded by the threads the rank writes with, however many files it has.
    coders = max(1, parallel // min(threads, len(files)))
    compress = request.compress
    if compress == "auto":
        compress = compress_choice.CHOICE.should_code(storage.url, parallel, *_sample(files, chunk_bytes))
    stats = CodingStats()
    t0 = time.perf_counter()
    try:

        def one(f: FileWrite) -> WrittenFile:
            return _write_one(
                storage,
                f.path,
                f.layout,
                f.tiles,
                chunk_bytes,
                progress,
                f.known_sums,
                f.pieces,
                bool(compress),
                f.bases,
                coders,
                stats,
            )

        if len(files) == 1 or threads == 1:
            written = [one(f) for f in files]
        else:
            with ThreadPoolExecutor(max_workers=min(threads, len(files)), thread_name_prefix="tessera-write") as pool:
                written = list(pool.map(one, files))  # the first failure, once every file was attempted
        if isinstance(storage, SyncsDirs):
            storage.sync_dirs([w.path for w in written])
    except BaseException:
        try:
            storage.delete([f.path for f in files])
        except Exception as e:
            logger.warning("could not remove the files of a failed write under %s: %s", storage.url, e)
        raise
    _measure(storage.url, written, stats, time.perf_counter() - t0, min(threads, len(files)))
    return written


def _sample(files: Sequence[FileWrite], chunk_bytes: int) -> tuple[memoryview | None, int]:
    """A chunk of the write (and its item size) to time the codec on: the first of a tile staged
    whole that holds at least a MiB (shorter codings are timed by their overheads)."""
    for f in files:
        if f.pieces is None:
            for slot, t in zip(f.layout.slots, f.tiles):
                if t.numel() >= 1 << 20:
                    return t.numpy().data[:chunk_bytes], slot.dtype.itemsize
    return None, 1


def _measure(url: str, written: Sequence[WrittenFile], stats: CodingStats, seconds: float, lanes: int) -> None:
    """Feed ``compress="auto"`` what this write stage showed of the storage and the codec."""
    if stats.coding_s > 0:
        compress_choice.CHOICE.record_codec(stats.logical, stats.coding_s)
    # The backend's own time: the stage's, less what the files' writers (``lanes`` at once)
    # waited for their next bytes.
    seconds -= stats.waited_s / max(1, lanes)
    compress_choice.CHOICE.record_storage(url, sum(w.nbytes for w in written), seconds)
