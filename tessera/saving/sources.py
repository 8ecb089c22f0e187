"""The stage step of a save: the tensors a rank writes, copied into host memory.

The copy runs in the caller's thread (blocking staging) or in the save's background
thread (``StagingMode.BACKGROUND``); either way its result is the staged bytes per file.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Sequence

import torch

from ..errors import CheckpointError, StagingMutationError
from ..geometry import Box
from ..results import PendingSave
from ..stage import StagedTiles, StagingBuffer, as_bytes
from ..state import FlatState, TensorPiece
from .handoff import SavePlan

Staged = Sequence[Sequence[torch.Tensor]]
"""Host byte views (1-D uint8) per data file, in each file's slot order."""


def _source(pieces: dict[str, list[TensorPiece]], fqn: str, box: Box) -> torch.Tensor:
    for p in pieces.get(fqn, ()):
        if all(
            po <= bo and bo + bn <= po + pn
            for po, pn, bo, bn in zip(p.box.offsets, p.box.lengths, box.offsets, box.lengths)
        ):
            rel = box.relative_to(p.box)
            return p.data[rel.slices()] if p.data.dim() else p.data
    raise CheckpointError(f"internal error: no local piece of '{fqn}' holds box {box}")


def sources(plan: SavePlan, flat: FlatState) -> tuple[list[torch.Tensor], list[str]]:
    """The tensors this rank writes, in the plan's slot order, and their names."""
    pieces: dict[str, list[TensorPiece]] = {}
    for p in flat.tensors:
        pieces.setdefault(p.fqn, []).append(p)
    slots = [s for lay in plan.layouts for s in lay.slots]
    return [_source(pieces, s.fqn, s.box) for s in slots], [s.fqn for s in slots]


def stage(
    plan: SavePlan,
    srcs: list[torch.Tensor],
    buffer: StagingBuffer,
    rank: int,
    *,
    copy: bool,
    after: object | None = None,
) -> Staged:
    """Copy ``srcs`` into ``buffer`` (or use contiguous CPU tensors in place unless ``copy``).

    Raises:
        CheckpointError: naming the rank, if the copy failed.
    """
    try:
        flat_staged = buffer.stage(srcs, copy=copy, after=after)
    except Exception as e:
        raise CheckpointError(f"rank {rank}: staging tensors to host memory failed: {e}") from e
    out = []
    i = 0
    for lay in plan.layouts:
        out.append(flat_staged[i : i + len(lay.slots)])
        i += len(lay.slots)
    return out


class OverlappedCopy:
    """The stage step of a background save, overlapped with the write step.

    :meth:`start` starts a copy thread and returns at once with per-file sequences that wait
    tile by tile, so each file's writer starts on its first tiles while later ones are still
    being copied. A failed copy makes the waiting writers raise its error (naming the rank).
    :meth:`join` waits for the copy thread: the staging buffer is free for the next save
    only after it, also when the save failed before writing everything.
    """

    def __init__(
        self,
        plan: SavePlan,
        srcs: list[torch.Tensor],
        buffer: StagingBuffer,
        rank: int,
        after: object | None,
        on_done: Callable[[], None],
    ) -> None:
        self._plan, self._srcs, self._buffer, self._rank = plan, srcs, buffer, rank
        self._after, self._on_done = after, on_done
        self._tiles = StagedTiles(len(srcs))
        self._thread: threading.Thread | None = None

    def start(self) -> Staged:
        """Start the copy; this rank's staged bytes per file, each tile waiting for its copy."""
        self._thread = threading.Thread(target=self._copy, name="tessera-copy", daemon=True)
        self._thread.start()
        out, i = [], 0
        for lay in self._plan.layouts:
            out.append(self._tiles.part(i, i + len(lay.slots)))
            i += len(lay.slots)
        return out

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def _copy(self) -> None:
        try:
            self._buffer.stage(self._srcs, copy=True, after=self._after, on_staged=self._tiles.put)
        except Exception as e:
            error = CheckpointError(f"rank {self._rank}: staging tensors to host memory failed: {e}")
            error.__cause__ = e
            self._tiles.fail(error)  # the writers raise it; the commit step reports it on every rank
        finally:
            self._srcs.clear()  # let the caller's tensors go
            self._on_done()


def fingerprints(srcs: list[torch.Tensor]) -> list[tuple[int, int | None]]:
    """Debug check: each source's version counter and, for CPU tensors, the CRC32 of its bytes."""
    out = []
    for src in srcs:
        crc = zlib.crc32(as_bytes(src.contiguous()).numpy().data) if src.device.type == "cpu" else None
        out.append((src._version, crc))
    return out


def check_unchanged(
    srcs: list[torch.Tensor],
    names: list[str],
    staged: Staged,
    reference: list[tuple[int, int | None]],
    rank: int,
    path: str,
) -> None:
    """Raise if a source changed between ``async_save`` and the end of its copy (a missing gate).

    Raises:
        StagingMutationError: naming the first tensor that changed.
    """
    flat_staged = [t for per_file in staged for t in per_file]
    for src, name, host, (version, crc) in zip(srcs, names, flat_staged, reference):
        changed = src._version != version
        if not changed and crc is not None:
            changed = zlib.crc32(host.numpy().data) != crc
        if changed:
            raise StagingMutationError(
                f"rank {rank}: tensor '{name}' was modified after async_save({path!r}) returned and before "
                f"its bytes were staged (PendingSave.wait_staged()); the checkpoint would not hold the state at "
                f"the time of the call, so the save is abandoned. Call wait_staged() (or step through "
                f"tessera.OptimizerState) before modifying saved tensors"
            )


def install_gates(statefuls: list[object], pending: PendingSave) -> None:
    """Let Stateful objects that know how (``_tessera_gate``) hold their mutations until staged."""
    for obj in statefuls:
        gate = getattr(obj, "_tessera_gate", None)  # a Stateful's hook, not a storage capability
        if callable(gate):
            gate(pending)
