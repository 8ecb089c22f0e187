"""Stream staged tiles into data files, checksumming every chunk on the way.

Each data file is written by one task of a small thread pool; ``xxhash`` and file I/O both
release the GIL, so a rank's files stream in parallel at close to the device's bandwidth.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import xxhash

from ...errors import StorageError
from ...format.chunking import Chunking
from ...format.codec import FrameTable
from ...format.geometry import Box
from ...format.tilefile import FileLayout
from ...storage.base import Storage, timed_chunks
from ...storage.capabilities import SyncsDirs
from . import compress_choice
from .coded_files import CodingStats, DeltaBase, write_coded

logger = logging.getLogger(__name__)


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
    chunking: Chunking
    """How each tile is cut into checksum chunks (and frames)."""
    threads: int
    """Files written in parallel."""
    compress: bool | str = False
    """Store each chunk as a frame (:mod:`tessera.format.codec`) instead of the safetensors layout;
    ``"auto"``: where :mod:`.compress_choice` measured the codec faster than the storage."""
    measure: bool = False
    """Measure the storage and the codec for ``compress="auto"`` (implied by ``compress="auto"``;
    a caller that decided auto itself, as dedup does, sets it). Other writes measure nothing."""


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


WRITE_PIECE_BYTES = 1 << 20
"""The least a plain write hands the backend at a time where chunks are smaller (a tile cut in
32 KiB chunks by a save that may compress): one piece per chunk cost a few microseconds each,
1-2% of such a save (``docs/compression.md``, "Chunk size")."""


def _piece_bytes(chunk_bytes: int) -> int:
    """The whole chunks a plain write hands the backend at once: at least :data:`WRITE_PIECE_BYTES`."""
    return max(1, WRITE_PIECE_BYTES // chunk_bytes) * chunk_bytes


def checksum_chunks(data: memoryview, chunk_bytes: int) -> Iterator[tuple[memoryview, int]]:
    """``(chunk, xxh3_64)`` for each ``chunk_bytes`` slice of ``data``."""
    for i in range(0, len(data), chunk_bytes):
        c = data[i : i + chunk_bytes]
        yield c, xxhash.xxh3_64_intdigest(c)


def checksum_pieces(data: memoryview, chunk_bytes: int) -> Iterator[tuple[memoryview, list[int]]]:
    """``(piece, xxh3_64 of each of its chunks)``: ``data`` in pieces of whole ``chunk_bytes``
    chunks (the last may be shorter), each at least :data:`WRITE_PIECE_BYTES` where chunks are
    smaller. Each piece is hashed just before it is handed on, as a chunk of the plain size is."""
    per = _piece_bytes(chunk_bytes)
    for i in range(0, len(data), per):
        piece = data[i : i + per]
        yield piece, [h for _, h in checksum_chunks(piece, chunk_bytes)]


class ChunkSums:
    """The xxh3-64 of each ``chunk_bytes`` chunk of a byte stream fed in pieces of any size: the
    tile checksums, whether the writer streams a tile or the call-time fingerprint hashes it."""

    def __init__(self, chunk_bytes: int) -> None:
        self._chunk = chunk_bytes
        self._h = xxhash.xxh3_64()
        self._filled = 0
        self._sums: list[int] = []

    def feed(self, data: memoryview) -> Iterator[memoryview]:
        """Hash ``data``, yielding it in parts that end at chunk boundaries, of at least
        :data:`WRITE_PIECE_BYTES` where chunks are smaller (lazily: each part is hashed when
        asked for)."""
        pos = start = 0
        while pos < len(data):
            n = min(self._chunk - self._filled, len(data) - pos)
            self._h.update(data[pos : pos + n])
            self._filled += n
            pos += n
            if self._filled == self._chunk:
                self._sums.append(self._h.intdigest())
                self._h.reset()
                self._filled = 0
            if pos - start >= WRITE_PIECE_BYTES or pos == len(data):
                yield data[start:pos]
                start = pos

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
    chunking: Chunking,
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

    def streamed() -> Iterator[memoryview | bytes]:
        """The tiles' bytes from ``pieces``, checksummed across piece boundaries."""
        assert pieces is not None
        yield layout.header
        for i, slot in enumerate(layout.slots):
            sums = ChunkSums(chunking.of(slot.nbytes))
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
            chunk_bytes = chunking.of(slot.nbytes)
            sums = list(known.get(i, ()))
            done = len(sums) * chunk_bytes  # bytes whose checksums are known
            per = _piece_bytes(chunk_bytes)
            for j in range(0, min(done, len(view)), per):
                c = view[j : min(j + per, done)]
                yield c
                if progress is not None:
                    progress(len(c))
            for c, hs in checksum_pieces(view[done:], chunk_bytes):
                sums.extend(hs)
                yield c
                if progress is not None:  # the backend asked for the next chunk: it took this one
                    progress(len(c))
            tiles.append(WrittenTile(slot.fqn, slot.box, slot.byte_offset, slot.nbytes, tuple(sums)))

    table = None
    if compress:
        sums_of, table = write_coded(
            storage, path, layout, staged, chunking, progress, pieces, bases or {}, coders, stats or CodingStats()
        )
        tiles.extend(WrittenTile(t.fqn, t.box, t.byte_offset, t.nbytes, sums) for t, sums in zip(layout.slots, sums_of))
    else:
        stream = chunks() if pieces is None else streamed()
        storage.write_file(path, stream if stats is None else timed_chunks(stream, stats.waited))
    if progress is not None:
        progress(0)
    if len(tiles) != len(layout.slots):
        # A backend that stopped consuming the stream early must not lead to a commit.
        raise StorageError(f"writing {path}: the storage backend wrote {len(tiles)} of {len(layout.slots)} tiles")
    nbytes = layout.nbytes if table is None else table.stored_end  # a compressed file: its stored size
    return WrittenFile(path, nbytes, tuple(tiles), time.monotonic() - t0, table)


def write_files(
    storage: Storage,
    files: Sequence[tuple[str, FileLayout, Sequence[torch.Tensor]]],
    *,
    chunking: Chunking,
    threads: int,
    progress: Progress | None = None,
    compress: bool | str = False,
) -> list[WrittenFile]:
    """Write every ``(path, layout, staged tile bytes)``: :func:`write_tiles` for callers with tuples."""
    request = WriteRequest(tuple(FileWrite(p, lay, st) for p, lay, st in files), chunking, threads, compress)
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
    files, chunking, threads = request.files, request.chunking, request.threads
    if not files:
        return []
    parallel = min(threads, os.cpu_count() or 1)  # the rank's files and coders share its cores
    # A compressed file is coded by the threads the rank writes with, however many files it has.
    coders = max(1, parallel // min(threads, len(files)))
    compress = request.compress
    if compress == "auto":
        compress = compress_choice.CHOICE.should_code(storage.url, parallel, *_sample(files, chunking.chunk_bytes))
    # Only writes for compress="auto" time their chunks: nothing is added to the others' path.
    stats = CodingStats() if request.compress == "auto" or request.measure else None
    t0 = time.perf_counter()
    try:

        def one(f: FileWrite) -> WrittenFile:
            return _write_one(
                storage,
                f.path,
                f.layout,
                f.tiles,
                chunking,
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
    if stats is not None:
        _measure(storage.url, written, stats, time.perf_counter() - t0, min(threads, len(files)), bool(compress))
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


def _measure(
    url: str, written: Sequence[WrittenFile], stats: CodingStats, seconds: float, lanes: int, coded: bool
) -> None:
    """Feed ``compress="auto"`` what this write stage showed of the storage and the codec."""
    if stats.coding_s > 0:
        compress_choice.CHOICE.record_codec(stats.logical, stats.coding_s)
    logical = sum(t.nbytes for w in written for t in w.tiles)
    compress_choice.CHOICE.record_write(url, logical, seconds, coded)  # what the save paid, waits included
    # The backend's own time: the stage's, less what the files' writers (``lanes`` at once)
    # waited for their next bytes.
    seconds -= stats.waited_s / max(1, lanes)
    compress_choice.CHOICE.record_storage(url, sum(w.nbytes for w in written), seconds)
