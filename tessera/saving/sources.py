"""The stage step of a save: the tensors a rank writes, copied into host memory.

The copy runs in the caller's thread (blocking staging) or in the save's background
thread (``StagingMode.BACKGROUND``); either way its result is the staged bytes per file.
"""

from __future__ import annotations

import zlib

import torch

from ..errors import CheckpointError, StagingMutationError
from ..geometry import Box
from ..results import PendingSave
from ..stage import StagingBuffer, as_bytes
from ..state import FlatState, TensorPiece
from .handoff import SavePlan

Staged = list[list[torch.Tensor]]
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
