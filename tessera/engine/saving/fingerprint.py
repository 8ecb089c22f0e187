"""The call-time fingerprint of an async save: what each CPU tile held when ``async_save`` was called.

A CPU tensor copied in the background can be changed after the call in ways no version counter
shows: a write through ``.data`` or a NumPy view (their own counter, or none), or an in-place
kernel still running when the copy and its check end (on CPU the counter moves only when the
kernel returns). So while the caller is still inside ``async_save`` (nothing of its thread can
run), :class:`CallFingerprint` hashes the exact bytes each such tile will hold: the xxh3-64 of
every checksum chunk of its row-major bytes, the checksums the writer computes anyway from
the copy it writes (:func:`tessera.engine.saving.write.checksum_chunks`). After the writes,
before the commit vote, :meth:`CallFingerprint.verify` compares the two: any byte changed after
the call and before its copy fails the save on every rank, however sparse the write and however
late its kernel returns; a write after a region was copied changes nothing written, so it passes.
No timing assumption, no extra read of the copy. Its cost is one hash pass at the call (the hash
releases the GIL; large states are hashed by several threads).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from ...errors import CheckpointError, StagingMutationError
from ...format.chunking import Chunking
from .handoff import FileReport
from .window import split
from .write import ChunkSums, checksum_chunks

logger = logging.getLogger(__name__)

TileKey = tuple[str, tuple[int, ...], tuple[int, ...]]
"""A tile as the writer reports it: tensor name, box offsets, box lengths."""

_PARALLEL_BYTES = 32 << 20
"""Below this many bytes in all, hashing in the caller's thread beats starting threads."""
_BATCH_BYTES = 16 << 20
"""Bytes per task of the thread pool (whole chunks; a tensor's chunks may span tasks)."""
_PIECE_BYTES = 4 << 20
"""Bytes of a strided tensor made contiguous at a time to be hashed (a bounded scratch copy)."""


def _contiguous_bytes(t: torch.Tensor) -> memoryview:
    return t.detach().reshape(-1).view(torch.uint8).numpy().data


def _strided_sums(t: torch.Tensor, chunk_bytes: int) -> tuple[int, ...]:
    """The chunk checksums of a strided tensor's row-major bytes, a bounded piece at a time."""
    sums = ChunkSums(chunk_bytes)
    for piece in split(t.detach(), _PIECE_BYTES):
        for _ in sums.feed(_contiguous_bytes(piece.contiguous())):
            pass
    return sums.done()


_Task = tuple[int, int, int, memoryview | torch.Tensor]
"""(source index, first chunk index, the tile's chunk size, contiguous bytes from that chunk on, or
a strided tensor)."""


def _run(batch: list[_Task]) -> list[tuple[int, int, tuple[int, ...]]]:
    out = []
    for i, first, chunk_bytes, data in batch:
        if isinstance(data, torch.Tensor):
            out.append((i, first, _strided_sums(data, chunk_bytes)))
        else:
            out.append((i, first, tuple(h for _, h in checksum_chunks(data, chunk_bytes))))
    return out


def _batches(tasks: list[_Task], nbytes: int) -> Iterator[list[_Task]]:
    batch: list[_Task] = []
    size = 0
    for task in tasks:
        batch.append(task)
        data = task[3]
        size += data.numel() * data.element_size() if isinstance(data, torch.Tensor) else len(data)
        if size >= nbytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


class CallFingerprint:
    """What the CPU tiles copied in the background held at the call, as the writer checksums them.

    Built in the caller's thread, inside ``async_save``; :meth:`verify` runs in the save's
    background thread once every file was written.

    Args:
        srcs: the tensors this rank writes, in slot order.
        names: their FQNs (for the error).
        keys: their tiles (name, box offsets, box lengths), as the writer reports them.
        which: indices of the sources to fingerprint (CPU tensors copied after the call returns).
        chunking: how the save cuts each tile into checksum chunks.
        threads: threads that may hash at once (large states).
    """

    def __init__(
        self,
        srcs: Sequence[torch.Tensor],
        names: Sequence[str],
        keys: Sequence[TileKey],
        which: Sequence[int],
        chunking: Chunking,
        threads: int,
    ) -> None:
        t0 = time.monotonic()
        tasks: list[_Task] = []
        total = 0
        for i in which:
            src = srcs[i]
            nbytes = src.numel() * src.element_size()
            total += nbytes
            chunk_bytes = chunking.of(nbytes)
            if not src.is_contiguous():
                tasks.append((i, 0, chunk_bytes, src))
                continue
            data = _contiguous_bytes(src) if nbytes else memoryview(b"")
            per = max(1, _BATCH_BYTES // chunk_bytes) * chunk_bytes  # whole chunks per task
            tasks.extend((i, j // chunk_bytes, chunk_bytes, data[j : j + per]) for j in range(0, nbytes, per))
        parts: dict[int, dict[int, tuple[int, ...]]] = {i: {} for i in which}
        if threads > 1 and total >= _PARALLEL_BYTES and len(tasks) > 1:
            with ThreadPoolExecutor(min(threads, len(tasks)), thread_name_prefix="tessera-fingerprint") as pool:
                done = [r for rs in pool.map(_run, _batches(tasks, _BATCH_BYTES)) for r in rs]
        else:
            done = _run(tasks)
        for i, first, sums in done:
            parts[i][first] = sums
        self._sums: dict[TileKey, tuple[str, tuple[int, ...]]] = {
            keys[i]: (names[i], tuple(h for first in sorted(p) for h in p[first])) for i, p in parts.items()
        }
        self.nbytes = total
        logger.debug("fingerprinted %d CPU tiles (%d bytes) in %.4fs", len(which), total, time.monotonic() - t0)

    def verify(self, reports: Sequence[FileReport], rank: int, path: str) -> None:
        """Compare the checksums the writer computed from the copies with the call's.

        Args:
            reports: every file this rank wrote or referenced (its tiles and their chunk checksums).

        Raises:
            StagingMutationError: naming the tensors whose bytes changed before their copy, the
                rank and the path.
        """
        written: dict[TileKey, tuple[int, ...]] = {}
        for r in reports:
            for fqn, offs, lens, sums in zip(r.fqns, r.offsets, r.lengths, r.checksums):
                written[(fqn, tuple(offs), tuple(lens))] = tuple(sums)
        changed = []
        for key, (name, sums) in self._sums.items():
            got = written.get(key)
            if got is None:
                raise CheckpointError(f"internal error: rank {rank} wrote no tile {key} of {path!r}")
            if got != sums:
                changed.append(name)
        if changed:
            raise mutation_error(
                changed,
                "the bytes copied differ from its fingerprint taken in the call (an in-place op, a write "
                "through an alias such as .data, detach() or a NumPy view, or a kernel still running)",
                rank,
                path,
            )


def mutation_error(names: Sequence[str], how: str, rank: int, path: str) -> StagingMutationError:
    """The error of a save whose tensors ``names`` changed after the call, before their copy."""
    names = list(dict.fromkeys(names))
    more = ""
    if len(names) > 1:
        listed = ", ".join(f"'{n}'" for n in names[1:6]) + (", ..." if len(names) > 6 else "")
        more = f" (also changed: {listed})"
    return StagingMutationError(
        f"rank {rank}: tensor '{names[0]}' was modified after async_save({path!r}) returned and "
        f"before its bytes were copied to host memory: {how}{more}. The checkpoint would mix two moments "
        f"of training, so the save is abandoned on every rank. Change saved tensors only after "
        f"pending.wait_staged(), through calls a gated Stateful holds (optimizer.step() with "
        f"tessera.OptimizerState, a forward with tessera.ModelState, or your own with "
        f"tessera.StagingGate), or save with SaveOptions(staging=StagingMode.AUTO or BLOCKING)"
    )
