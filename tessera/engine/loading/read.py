"""Reading: run the range reads of a load plan, verify every chunk, copy into the targets.

Needed chunks of one file, coalesced by :func:`~tessera.engine.loading.plan.plan_reads`, are read by a
thread pool, verified against their checksums, and copied straight into the caller's
tensors; a whole-tile overlap over contiguous target memory is read directly into it.

Memory: each I/O thread owns one reusable buffer of at most ``max_read_bytes``, so extra
host memory stays bounded however large the checkpoint is.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import xxhash

from ...errors import CorruptCheckpointError, MissingTilesError, StorageError
from ...format.codec import FrameError
from ...format.dtypes import ALIGN, as_bytes, itemsize
from ...format.geometry import row_major_strides
from ...format.manifest import Manifest
from ...storage.base import Storage
from ...storage.capabilities import MapsRanges
from ..frames import DecodeStats, read_logical
from .plan import ReadRequest, ReadTarget, check_targets, plan_reads

__all__ = ["ReadRequest", "ReadStats", "ReadTarget", "Reader", "check_targets", "plan_reads"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReadStats:
    bytes_read: int
    requests: int
    seconds: float


class _Buffers(threading.local):
    buf: torch.Tensor | None = None

    def get(self, nbytes: int) -> torch.Tensor:
        if self.buf is None or self.buf.numel() < nbytes + ALIGN:
            self.buf = None
            # A multiple of ALIGN bytes, so the buffer can be viewed as any dtype.
            self.buf = torch.empty(-(-(nbytes + ALIGN) // ALIGN) * ALIGN, dtype=torch.uint8)
        return self.buf


class Reader:
    """Executes read requests against one storage, verifying checksums.

    Thread-safe; each call of :meth:`run` uses its own pool.
    """

    def __init__(
        self,
        storage: Storage,
        manifest: Manifest,
        *,
        rank: int,
        verify: bool = True,
        threads: int = 4,
        mmap: bool = True,
    ) -> None:
        self.storage = storage
        self.manifest = manifest
        self.rank = rank
        self.verify = verify
        self.threads = threads
        self.mmap = mmap
        """Use the backend's ``map_range`` (local files) to skip the read buffer."""
        self._buffers = _Buffers()
        self._writer = {f.path: f.rank for f in manifest.files}
        self._frames = {f.path: f.frames for f in manifest.files if f.frames is not None}
        """Compressed files: their logical ranges are decoded from frames (:mod:`.frames`)."""
        self.decode_stats = DecodeStats()

    def _file(self, path: str) -> str:
        """A data file as errors name it: with the rank that wrote it."""
        return f"'{path}' (written by rank {self._writer.get(path, '?')})"

    def run(self, requests: Sequence[ReadRequest]) -> ReadStats:
        t0 = time.monotonic()
        total = sum(r.nbytes for r in requests)
        if len(requests) <= 1 or self.threads == 1:
            for r in requests:
                self._execute(r)
        else:
            # Largest first keeps the pool busy to the end.
            ordered = sorted(requests, key=lambda r: -r.nbytes)
            with ThreadPoolExecutor(
                max_workers=min(self.threads, len(requests)), thread_name_prefix="tessera-read"
            ) as pool:
                for f in [pool.submit(self._execute, r) for r in ordered]:
                    f.result()
        return ReadStats(total, len(requests), time.monotonic() - t0)

    def _execute(self, req: ReadRequest) -> None:
        if req.direct:  # the whole tile, or a piece of it, straight into the target's bytes
            copy = req.copies[0]
            skip = req.start - copy.tile.byte_offset
            dest = as_bytes(copy.target)[skip : skip + req.nbytes]
            self._read(req, dest.numpy().data)
            self._verify(req, dest, req.start)
            return
        if self.mmap and isinstance(self.storage, MapsRanges) and req.file not in self._frames:
            self._execute_mapped(req, self.storage)
            return
        buf = self._buffers.get(req.nbytes)
        # Place file offset ``start`` at an address congruent to it modulo ALIGN, so every
        # tile (aligned to its item size in the file) is aligned in memory too.
        base = (req.start - buf.data_ptr()) % ALIGN
        region = buf[base : base + req.nbytes]
        self._read(req, region.numpy().data)
        self._verify(req, region, req.start)
        for c in req.copies:
            size = itemsize(c.dtype)
            elem0 = (c.tile.byte_offset - req.start + base) // size
            strides = row_major_strides(c.tile.lengths)
            offset = elem0 + sum(o * s for o, s in zip(c.rel.offsets, strides))
            src = torch.as_strided(buf.view(c.dtype), c.rel.lengths, strides, offset)
            with torch.no_grad():
                c.target.copy_(src)

    def _execute_mapped(self, req: ReadRequest, mapper: MapsRanges) -> None:
        """Verify and copy straight from a memory map of the file: no intermediate buffer."""
        try:
            view = mapper.map_range(req.file, req.start, req.nbytes)
        except OSError as e:  # StorageError included
            raise self._read_error(req, e) from e
        self._verify_view(req, view)
        for c in req.copies:
            size = itemsize(c.dtype)
            t = c.tile
            lo = max(req.start, t.byte_offset)  # the tile's bytes inside this request
            hi = min(req.stop, t.byte_offset + t.nbytes)
            first = (lo - t.byte_offset) // size  # tile element at ``lo``
            src_1d = torch.frombuffer(view, dtype=c.dtype, offset=lo - req.start, count=(hi - lo) // size)
            strides = row_major_strides(t.lengths)
            offset = sum(o * st for o, st in zip(c.rel.offsets, strides)) - first
            src = torch.as_strided(src_1d, c.rel.lengths, strides, offset)
            with torch.no_grad():
                c.target.copy_(src)
        mapper.release_range(req.file, req.start, req.nbytes)

    def _read(self, req: ReadRequest, out: memoryview) -> None:
        table = self._frames.get(req.file)
        try:
            if table is None:
                self.storage.read_into(req.file, req.start, out)
            else:
                read_logical(self.storage, req.file, table, req.start, out, self.decode_stats, tables=self._frames)
        except OSError as e:  # StorageError included
            raise self._read_error(req, e) from e
        except FrameError as e:
            raise CorruptCheckpointError(
                f"rank {self.rank}: compressed data file {self._file(req.file)} of tensor(s) {_names(req)} is "
                f"corrupted: {e}"
            ) from None

    def _read_error(self, req: ReadRequest, e: OSError) -> CorruptCheckpointError:
        """The error for a failed read, naming the rank, the file and the tensors."""
        if isinstance(e, MissingTilesError):
            return MissingTilesError(f"rank {self.rank}: tensor(s) {_names(req)}: {e}")
        if isinstance(e, FileNotFoundError) and not isinstance(e, StorageError):
            return CorruptCheckpointError(
                f"rank {self.rank}: data file {self._file(req.file)} of tensor(s) {_names(req)} is missing from the checkpoint"
            )
        if isinstance(e, (IsADirectoryError, NotADirectoryError)):
            return CorruptCheckpointError(
                f"rank {self.rank}: data file {self._file(req.file)} of tensor(s) {_names(req)} is not a regular file "
                f"({type(e).__name__}); the manifest does not match the checkpoint's files"
            )
        return CorruptCheckpointError(
            f"rank {self.rank}: reading {self._file(req.file)} for tensor(s) {_names(req)}: {e}"
        )

    def _verify(self, req: ReadRequest, data: torch.Tensor, start: int) -> None:
        self._verify_view(req, data.numpy().data)

    def _verify_view(self, req: ReadRequest, data: memoryview) -> None:
        """Check every checksum chunk that lies wholly inside ``req`` (``data`` holds its bytes)."""
        if not self.verify:
            return
        chunking = self.manifest.tile_chunking
        start = req.start
        seen: set[tuple[int, int]] = set()
        for c in req.copies:
            t = c.tile
            chunk = chunking.of(t.nbytes)
            first = max(0, (req.start - t.byte_offset + chunk - 1) // chunk)
            for k in range(first, len(t.checksums)):
                a = t.byte_offset + k * chunk
                b = min(a + chunk, t.byte_offset + t.nbytes)
                if b > req.stop:
                    break
                if (a, b) in seen:
                    continue
                seen.add((a, b))
                if xxhash.xxh3_64_intdigest(data[a - start : b - start]) != t.checksums[k]:
                    raise CorruptCheckpointError(
                        f"rank {self.rank}: checksum mismatch in {self._file(t.file)} bytes [{a}, {b}) of tensor "
                        f"'{c.fqn}' tile at {list(t.offsets)}: the data is corrupted"
                    )


def _names(req: ReadRequest) -> str:
    return ", ".join(sorted({f"'{c.fqn}'" for c in req.copies}))
