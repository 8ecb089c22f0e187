"""The export schedule of :func:`tessera.hf_export.export.save_hf`: pure, computed identically on every rank.

From every rank's pieces (their boxes, exchanged as metadata) the schedule gives the shard files
(same rules, names and index as the offline exporter), a writer rank per file (balanced by
bytes), each tensor cut into blocks of at most ``block_bytes``, the sources of each block,
and the exchange rounds that deliver the blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import CoverageError, StateMismatchError
from ..format.dtypes import dtype_from_name, itemsize
from ..format.geometry import Box, intersect

SEND_BUDGET_BLOCKS = 2
"""Most bytes a rank sends in one exchange round, in blocks (see :func:`_schedule`)."""


@dataclass(frozen=True)
class ExportTensor:
    """One tensor of the export: its names, dtypes, and which ranks hold which boxes of it."""

    name: str  # the Hugging Face name
    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    out_dtype: torch.dtype
    holders: tuple[tuple[Box, tuple[int, ...]], ...]  # distinct boxes, each with the ranks holding it

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.out_dtype)


@dataclass(frozen=True)
class ExportBlock:
    """One block of a tensor a writer assembles, with the pieces it is made of."""

    tensor: ExportTensor
    box: Box
    sources: tuple[tuple[int, Box, Box], ...]  # (owner rank, the piece's box, the part of the block it gives)


@dataclass(frozen=True)
class ExportSchedule:
    """The whole export: files, writers, blocks per rank, and the rounds."""

    tensors: tuple[ExportTensor, ...]
    files: tuple[str, ...]
    shards: tuple[tuple[ExportTensor, ...], ...]  # tensors of each file, in file order
    writers: tuple[int, ...]  # rank writing each file
    blocks: tuple[tuple[ExportBlock, ...], ...]  # per rank: the blocks it writes, in file order
    rounds: tuple[tuple[tuple[int, int], ...], ...]  # per round: (writer, index of its block) pairs


def schedule_export(
    everyone: list[list[tuple[str, tuple[int, ...], str, tuple[int, ...], tuple[int, ...]]]],
    *,
    prefix: str | None,
    dtype: torch.dtype | None,
    limit: int,
    block_bytes: int,
    world_size: int,
) -> ExportSchedule:
    from ..format.dtypes import cast_for, safetensors_dtype_code
    from ..format.geometry import split_box
    from ..format.names import strip_prefix
    from .files import group_shards, shard_file_names

    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    holders: dict[str, dict[Box, list[int]]] = {}
    for rank, metas in enumerate(everyone):
        for fqn, shape, dt, offsets, lengths in metas:
            seen = shapes.setdefault(fqn, (tuple(shape), dt))
            if seen != (tuple(shape), dt):
                raise StateMismatchError(
                    f"tensor '{fqn}': rank {rank} holds a piece of shape {list(shape)} {dt}, "
                    f"another rank of {list(seen[0])} {seen[1]}; every rank must hold the same model"
                )
            holders.setdefault(fqn, {}).setdefault(Box(tuple(offsets), tuple(lengths)), []).append(rank)
    names = strip_prefix(list(shapes), prefix)
    if not names:
        raise ValueError(f"the model has no tensors{f' under prefix {prefix!r}' if prefix else ''} to write")
    tensors = []
    for name, fqn in names.items():
        shape, dt = shapes[fqn]
        src_dtype = dtype_from_name(dt)
        out_dtype = cast_for(src_dtype, dtype)
        safetensors_dtype_code(out_dtype, fqn)  # refuses dtypes safetensors cannot hold
        boxes = tuple((box, tuple(ranks)) for box, ranks in holders[fqn].items())
        tensors.append(ExportTensor(name, fqn, shape, src_dtype, out_dtype, boxes))

    groups = group_shards([t.nbytes for t in tensors], limit)
    # Stable sort by item size, as the offline exporter does: keeps every tensor aligned.
    shards = tuple(tuple(sorted((tensors[i] for i in g), key=lambda t: -itemsize(t.out_dtype))) for g in groups)
    files = tuple(shard_file_names(len(shards)))

    # Largest file first onto the least-loaded rank: with N files, N ranks write at once.
    load = [0] * world_size
    writers = [0] * len(files)
    for i in sorted(range(len(files)), key=lambda i: -sum(t.nbytes for t in shards[i])):
        w = min(range(world_size), key=lambda r: (load[r], r))
        writers[i] = w
        load[w] += sum(t.nbytes for t in shards[i])

    blocks: list[list[ExportBlock]] = [[] for _ in range(world_size)]
    for i, shard in enumerate(shards):
        w = writers[i]
        for t in shard:
            size = max(itemsize(t.dtype), itemsize(t.out_dtype))
            for n, box in enumerate(split_box(Box.whole(t.shape), size, block_bytes)):
                if box.is_empty():  # an empty tensor has a header entry and no bytes
                    continue
                blocks[w].append(ExportBlock(t, box, _sources(t, box, w, n)))
    return ExportSchedule(
        tuple(tensors),
        files,
        shards,
        tuple(writers),
        tuple(tuple(b) for b in blocks),
        _schedule(blocks, world_size, send_budget=SEND_BUDGET_BLOCKS * block_bytes),
    )


def _schedule(
    blocks: list[list[ExportBlock]], world_size: int, *, send_budget: int
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Rounds of (writer, block index): each writer's blocks in order, at most one per round,
    and no rank sending more than ``send_budget`` bytes in a round (a round always takes at
    least one block, so a block larger than the budget still goes through, alone).

    Without the budget a rank owning parts of every writer's block would buffer one block per
    writer; with it, its send buffer stays bounded whatever the number of writers.
    """
    nxt = [0] * world_size
    rounds: list[tuple[tuple[int, int], ...]] = []
    while any(nxt[w] < len(blocks[w]) for w in range(world_size)):
        sent = [0] * world_size
        this: list[tuple[int, int]] = []
        start = len(rounds) % world_size  # rotate, so no writer is always last to be admitted
        for w in ((start + i) % world_size for i in range(world_size)):
            if nxt[w] >= len(blocks[w]):
                continue
            cost: dict[int, int] = {}
            b = blocks[w][nxt[w]]
            for owner, _, part in b.sources:
                if owner != w:
                    cost[owner] = cost.get(owner, 0) + part.numel * itemsize(b.tensor.dtype)
            if this and any(sent[o] + c > send_budget for o, c in cost.items()):
                continue
            for o, c in cost.items():
                sent[o] += c
            this.append((w, nxt[w]))
            nxt[w] += 1
        rounds.append(tuple(sorted(this)))
    return tuple(rounds)


def _sources(t: ExportTensor, block: Box, writer: int, n: int) -> tuple[tuple[int, Box, Box], ...]:
    """Who sends which part of ``block``: the writer if it holds it, else replicas in turn."""
    out = []
    covered = 0
    for box, ranks in t.holders:
        part = intersect(box, block)
        if part is None:
            continue
        owner = writer if writer in ranks else ranks[n % len(ranks)]
        out.append((owner, box, part))
        covered += part.numel
    if covered != block.numel:
        raise CoverageError(
            f"tensor '{t.fqn}': the ranks' pieces cover {covered} of the {block.numel} elements of block {block} "
            f"(pieces: {', '.join(f'{b} on ranks {list(r)}' for b, r in t.holders)}); "
            "every element must be held, and distinct pieces must not overlap"
        )
    return tuple(out)
