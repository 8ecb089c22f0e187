"""Read replicated load targets once and broadcast them, instead of reading them on every rank.

When every rank wants the same box of a tensor (a DDP model, a replicated DTensor, an
optimizer step), N ranks reading it from storage costs N times the bytes. With
``LoadOptions(broadcast_replicated=True)`` the ranks agree (one all-gather of names) on the
targets all of them want identically, split those into pieces balanced across ranks, each
rank reads only its pieces, and the pieces are broadcast over the coordination group.

Worth it when storage bandwidth is the bottleneck (object stores, shared filesystems);
on a fast local disk with a warm page cache reading locally is usually as fast.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist_

from ...format.geometry import split_even
from .. import dist
from ..dist import World
from .plan import ReadTarget

logger = logging.getLogger(__name__)

_MIN_PIECE_BYTES = 1 << 20


@dataclass(frozen=True)
class Broadcast:
    """A piece of a replicated target that ``owner`` reads and then sends to everyone."""

    owner: int
    data: torch.Tensor


def _signature(t: ReadTarget) -> tuple | None:
    if t.data.device.type != "cpu" or not t.data.is_contiguous() or t.box.is_empty():
        return None
    return (t.fqn, t.box.offsets, t.box.lengths, str(t.data.dtype))


def split_replicated(world: World, targets: list[ReadTarget]) -> tuple[list[ReadTarget], list[Broadcast]]:
    """Collective: the targets this rank reads, and the broadcasts that complete the rest.

    Targets wanted identically by every rank are cut into row pieces of about equal bytes
    and dealt to ranks least-loaded first; every rank computes the same assignment.
    """
    if not world.distributed:
        return targets, []
    mine = {}
    skipped = 0
    for t in targets:
        sig = _signature(t)
        if sig is not None:
            mine[sig] = t
        elif not t.box.is_empty():
            skipped += 1
    if skipped:
        logger.debug(
            "rank %d: %d device or non-contiguous targets are read locally, not broadcast", world.rank, skipped
        )
    everyone = dist.all_gather(world, sorted(mine), "agreeing on replicated load targets")
    common = set(everyone[0]).intersection(*map(set, everyone[1:]))
    if not common:
        return targets, []
    own: list[ReadTarget] = [t for t in targets if _signature(t) not in common]
    load = [0] * world.size
    pieces: list[tuple[int, ReadTarget]] = []
    for sig in sorted(common):
        t = mine[sig]
        for piece in _row_pieces(t, world.size):
            nbytes = piece.data.numel() * piece.data.element_size()
            owner = min(range(world.size), key=lambda r: (load[r], r))
            load[owner] += nbytes
            pieces.append((owner, piece))
    own += [p for owner, p in pieces if owner == world.rank]
    return own, [Broadcast(owner, p.data) for owner, p in pieces]


def _row_pieces(t: ReadTarget, ranks: int) -> list[ReadTarget]:
    """Cut a target into slabs of rows (one per rank at most, none under ``_MIN_PIECE_BYTES``)."""
    nbytes = t.data.numel() * t.data.element_size()
    if t.data.dim() == 0 or t.box.lengths[0] < 2 or nbytes < 2 * _MIN_PIECE_BYTES:
        return [t]
    out = []
    for slab in split_even(t.box, min(ranks, nbytes // _MIN_PIECE_BYTES), dim=0):
        lo = slab.offsets[0] - t.box.offsets[0]
        out.append(ReadTarget(t.fqn, slab, t.data[lo : lo + slab.lengths[0]]))
    return out


def run_broadcasts(world: World, broadcasts: list[Broadcast]) -> None:
    """Collective: send every piece from its owner to all ranks (same order everywhere)."""
    for b in broadcasts:
        src = dist_.get_global_rank(world.group, b.owner)
        raw = b.data.reshape(-1).view(torch.uint8)  # gloo moves bytes of any dtype this way
        dist.run_collective(
            world,
            "broadcasting replicated tensors",
            functools.partial(dist_.broadcast, raw, src=src, group=world.group),
        )
