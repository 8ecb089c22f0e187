"""Write a Hugging Face model directory straight from a sharded training job.

:func:`save_hf` is the live counterpart of :func:`tessera.convert.export_hf` (which reads a
saved tessera checkpoint in one process): every rank of a job calls it with the model as
it is held (plain, DDP, FSDP2, tensor parallel, or a state of :class:`ShardedTensor` /
:class:`FlatShard` pieces) and the ranks write the output files in parallel.

How it works (all ranks, collective):

1. each rank flattens its state to pieces of global tensors (the geometry tessera saves);
2. the pieces' boxes are exchanged (metadata only), and every rank computes the same plan:
   the shard files (same rules, names and index as the offline exporter), a writer rank
   per file (balanced by bytes), and each tensor cut into blocks of at most ``block_bytes``;
3. in rounds, each writer assembles its next block from the owners' pieces, sent with one
   ``all_to_all`` over tessera's CPU (gloo) coordination group, and streams it to its file.
   A writer that holds a piece itself copies it locally; replicas are read once.

Rounds are scheduled so that no rank sends more than two blocks per round, so no rank
holds more than about five blocks of buffers, whatever the model size or the number of
ranks: :attr:`HFSaveResult.peak_buffer_bytes` reports the peak this rank held.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn

from . import dist
from .adapters.model import ModelState, unwrap
from .dtypes import dtype_from_name, dtype_name, itemsize
from .errors import CoverageError, StateMismatchError
from .geometry import Box, intersect
from .safetensors_header import encode_header
from .state import flatten, is_stateful
from .storage import Storage, storage_for

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_BYTES = 64 << 20
"""Largest block of a tensor assembled on a writer at once."""

SEND_BUDGET_BLOCKS = 2
"""Most bytes a rank sends in one exchange round, in blocks (see :func:`_schedule`)."""


@dataclass(frozen=True)
class HFSaveResult:
    """What :func:`save_hf` wrote; the same on every rank except the per-rank fields.

    Attributes:
        out_dir: the directory written.
        files: every model file of the directory (shards, then the index if any).
        written: the shard files this rank wrote.
        tensors: number of tensors in the directory.
        bytes: tensor bytes in the directory (after any dtype cast).
        rank_bytes: tensor bytes this rank wrote.
        peak_buffer_bytes: most bytes of exchange and assembly buffers this rank held at once.
        seconds: wall time on this rank.
    """

    out_dir: str
    files: tuple[str, ...]
    written: tuple[str, ...]
    tensors: int
    bytes: int
    rank_bytes: int
    peak_buffer_bytes: int
    seconds: float


@dataclass(frozen=True)
class _Tensor:
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
class _Block:
    tensor: _Tensor
    box: Box
    sources: tuple[tuple[int, Box, Box], ...]  # (owner rank, the piece's box, the part of the block it gives)


@dataclass(frozen=True)
class _Plan:
    tensors: tuple[_Tensor, ...]
    files: tuple[str, ...]
    shards: tuple[tuple[_Tensor, ...], ...]  # tensors of each file, in file order
    writers: tuple[int, ...]  # rank writing each file
    blocks: tuple[tuple[_Block, ...], ...]  # per rank: the blocks it writes, in file order
    rounds: tuple[tuple[tuple[int, int], ...], ...]  # per round: (writer, index of its block) pairs


def save_hf(
    out_dir: str,
    model: nn.Module | dict[str, Any] | object,
    *,
    process_group: Any = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    prefix: str | None = None,
    config: object | None = None,
    storage: Storage | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> HFSaveResult:
    """Write ``model`` as a Hugging Face safetensors directory, every rank writing in parallel.

    Collective: every rank of ``process_group`` calls it with its part of the same model.
    The directory holds ``model.safetensors``, or ``model-0000i-of-0000N.safetensors``
    shards plus ``model.safetensors.index.json`` (the same names, shard rules and index as
    :func:`tessera.convert.export_hf`), and ``config.json`` when the model has a Hugging Face
    config. Earlier model files there are replaced; other files are left alone. Shards are
    spread over the ranks by size, so with ``N`` shards up to ``N`` ranks write at once.
    The same error is raised on every rank.

    Args:
        out_dir: the directory (or fsspec URL) to write.
        model: an ``nn.Module`` (plain, DDP, FSDP2, tensor parallel, compiled; names are its
            state-dict keys, wrappers removed), or a tessera state (dict or Stateful) of
            tensors, DTensors, :class:`ShardedTensor` and :class:`FlatShard` pieces.
        process_group: the ranks taking part (default: the whole job).
        dtype: cast floating-point tensors to this dtype (integer tensors are kept).
        max_shard_size: most bytes per shard file (``"5GB"``, ``"500MiB"`` or an int).
        prefix: write only tensors whose name starts with ``prefix``, without it.
        config: a Hugging Face config to write as ``config.json`` (default: the model's
            ``config`` attribute, if any).
        storage: the backend of ``out_dir`` (default: chosen from ``out_dir``).
        block_bytes: most bytes of one tensor assembled at once on a writer.

    Returns:
        What was written, with this rank's share and its peak buffer memory.

    Raises:
        ValueError: if no tensor matches ``prefix``.
        StateMismatchError: if ranks disagree on a tensor's shape or dtype.
        CoverageError: if the ranks' pieces do not cover a tensor exactly once.
        DistributedError: if any rank failed (each rank's cause listed).

    Example:
        >>> tessera.save_hf("/export/step1000", model, dtype=torch.bfloat16)  # on every rank
    """
    from .convert._common import parse_size

    t0 = time.monotonic()
    world = dist.world_for(process_group)
    err: BaseException | None = None
    local: dict[tuple[str, Box], torch.Tensor] = {}
    metas: list[tuple[str, tuple[int, ...], str, tuple[int, ...], tuple[int, ...]]] = []
    try:
        out = storage_for(out_dir, storage)
        state = ModelState(model) if isinstance(model, nn.Module) else model
        hf_config = config if config is not None else _config_of(model)
        if not isinstance(state, dict) and not is_stateful(state):
            raise TypeError(f"save_hf takes an nn.Module or a tessera state, not {type(model).__name__}")
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        limit = parse_size(max_shard_size)
        flat = flatten(state, rank=world.rank, world_size=world.size)
        for p in flat.tensors:
            if p.per_rank is not None or p.box.is_empty():
                continue
            local[(p.fqn, p.box)] = p.data
            metas.append((p.fqn, p.shape, dtype_name(p.dtype), p.box.offsets, p.box.lengths))
        if world.is_coordinator:
            from .convert.hf import remove_model_files

            remove_model_files(out, out_dir)
    except Exception as e:
        err = e
    everyone = dist.exchange(world, err, metas, f"planning the Hugging Face export to {out_dir}")
    plan = _plan(everyone, prefix=prefix, dtype=dtype, limit=limit, block_bytes=block_bytes, world_size=world.size)

    rounds = _Rounds(world, plan, local)
    mine = [i for i, w in enumerate(plan.writers) if w == world.rank]
    rank_bytes = 0
    try:
        for i in mine:
            out.write_file(plan.files[i], _file_chunks(plan.shards[i], rounds))
            rank_bytes += sum(t.nbytes for t in plan.shards[i])
    except Exception as e:
        err = e
    rounds.drain()  # the other writers still need this rank's pieces
    dist.exchange(world, err, None, f"writing the Hugging Face shards to {out_dir}")

    total = sum(t.nbytes for t in plan.tensors)
    files = plan.files
    try:
        if world.is_coordinator:
            from .convert.hf import INDEX_NAME, index_bytes

            # Written last, once every shard exists: a reader never finds an index naming a missing file.
            if len(files) > 1:
                weight_map = {t.name: f for f, shard in zip(files, plan.shards) for t in shard}
                out.write_file(INDEX_NAME, [index_bytes(total, weight_map)])
            if hf_config is not None:
                _write_config(out, hf_config, plan)
    except Exception as e:
        err = e
    dist.exchange(world, err, None, f"writing the Hugging Face index of {out_dir}")
    if len(files) > 1:
        from .convert.hf import INDEX_NAME

        files = (*files, INDEX_NAME)
    seconds = time.monotonic() - t0
    if world.is_coordinator:
        logger.info(
            "wrote %d tensors (%d bytes) to %s in %d file(s) from %d rank(s) in %.2fs",
            len(plan.tensors),
            total,
            out_dir,
            len(plan.files),
            world.size,
            seconds,
        )
    return HFSaveResult(
        out_dir,
        tuple(files),
        tuple(plan.files[i] for i in mine),
        len(plan.tensors),
        total,
        rank_bytes,
        rounds.peak_bytes,
        seconds,
    )


# --------------------------------------------------------------------------------------
# Planning: pure, computed identically on every rank from everyone's metadata


def _plan(
    everyone: list[list[tuple[str, tuple[int, ...], str, tuple[int, ...], tuple[int, ...]]]],
    *,
    prefix: str | None,
    dtype: torch.dtype | None,
    limit: int,
    block_bytes: int,
    world_size: int,
) -> _Plan:
    from .convert._common import cast_for, safetensors_dtype_code, split_box, strip_prefix
    from .convert.hf import plan_shards, shard_file_names

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
        tensors.append(_Tensor(name, fqn, shape, src_dtype, out_dtype, boxes))

    groups = plan_shards([t.nbytes for t in tensors], limit)
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

    blocks: list[list[_Block]] = [[] for _ in range(world_size)]
    for i, shard in enumerate(shards):
        w = writers[i]
        for t in shard:
            size = max(itemsize(t.dtype), itemsize(t.out_dtype))
            for n, box in enumerate(split_box(Box.whole(t.shape), size, block_bytes)):
                if box.is_empty():  # an empty tensor has a header entry and no bytes
                    continue
                blocks[w].append(_Block(t, box, _sources(t, box, w, n)))
    return _Plan(
        tuple(tensors),
        files,
        shards,
        tuple(writers),
        tuple(tuple(b) for b in blocks),
        _schedule(blocks, world_size, send_budget=SEND_BUDGET_BLOCKS * block_bytes),
    )


def _schedule(
    blocks: list[list[_Block]], world_size: int, *, send_budget: int
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


def _sources(t: _Tensor, block: Box, writer: int, n: int) -> tuple[tuple[int, Box, Box], ...]:
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


# --------------------------------------------------------------------------------------
# Execution: one all_to_all per round; in round k each writer receives its k-th block


class _Rounds:
    """Runs the exchange rounds in order; every rank takes part in every round."""

    def __init__(self, world: dist.World, plan: _Plan, local: dict[tuple[str, Box], torch.Tensor]) -> None:
        self.world = world
        self.plan = plan
        self.local = local
        self.done = 0
        self.peak_bytes = 0

    def next_block(self) -> tuple[_Block, torch.Tensor]:
        """Run rounds up to the one delivering this rank's next block; that block, in the output dtype."""
        while self.done < len(self.plan.rounds):
            got = self._run()
            if got is not None:
                return got
        raise RuntimeError(f"rank {self.world.rank}: the export plan has no block left for this rank")  # a bug

    def drain(self) -> None:
        """Take part in the rounds left (this rank has no more blocks to write)."""
        while self.done < len(self.plan.rounds):
            self._run()

    def _run(self) -> tuple[_Block, torch.Tensor] | None:
        """One round: send this rank's parts of the writers' blocks, assemble its own block if it has one."""
        entries = self.plan.rounds[self.done]
        self.done += 1
        me, size = self.world.rank, self.world.size
        in_sizes = [0] * size
        out_sizes = [0] * size
        outgoing: list[tuple[int, torch.Tensor]] = []  # (destination, the part), in sending order
        mine: _Block | None = None
        for w, i in entries:
            b = self.plan.blocks[w][i]
            if w == me:
                mine = b
            for owner, box, part in b.sources:
                if owner == w:
                    continue
                n = _padded(part.numel * itemsize(b.tensor.dtype))
                if owner == me:
                    outgoing.append((w, self.local[(b.tensor.fqn, box)][part.relative_to(box).slices()]))
                    in_sizes[w] += n
                if w == me:
                    out_sizes[owner] += n
        received = torch.empty(0, dtype=torch.uint8)
        exchange_bytes = sum(in_sizes) + sum(out_sizes)
        if any(owner != w for w, i in entries for owner, _, _ in self.plan.blocks[w][i].sources):
            # Parts are copied straight into the send buffer, grouped by destination rank.
            send = torch.empty(sum(in_sizes), dtype=torch.uint8)
            pos = 0
            for dest in range(size):
                for d, data in outgoing:
                    if d == dest:
                        n = data.numel() * data.element_size()
                        send[pos : pos + n].view(data.dtype).view(data.shape).copy_(data)
                        pos += _padded(n)
            received = torch.empty(sum(out_sizes), dtype=torch.uint8)
            dist._run(
                self.world,
                f"exchanging round {self.done - 1} of the Hugging Face export",
                lambda: torch_dist.all_to_all_single(received, send, out_sizes, in_sizes, group=self.world.group),
            )
            del send
        self.peak_bytes = max(self.peak_bytes, exchange_bytes)
        if mine is None:
            return None
        t = mine.tensor
        buf = torch.empty(mine.box.lengths, dtype=t.dtype)
        offsets = [sum(out_sizes[:r]) for r in range(size)]  # where each sender's parts start
        for owner, box, part in mine.sources:
            dst = buf[part.relative_to(mine.box).slices()]
            if owner == me:
                dst.copy_(self.local[(t.fqn, box)][part.relative_to(box).slices()])
            else:
                n = part.numel * itemsize(t.dtype)
                dst.copy_(received[offsets[owner] : offsets[owner] + n].view(t.dtype).view(part.lengths))
                offsets[owner] += _padded(n)
        out = buf if t.out_dtype == t.dtype else buf.to(t.out_dtype)
        held = (
            sum(out_sizes)
            + buf.numel() * buf.element_size()
            + (out.numel() * out.element_size() if out is not buf else 0)
        )
        self.peak_bytes = max(self.peak_bytes, held)
        return mine, out


def _file_chunks(shard: tuple[_Tensor, ...], rounds: _Rounds) -> Iterator[bytes | memoryview]:
    """A shard file's bytes: its header, then each tensor block by block as the rounds deliver them."""
    from .convert._common import safetensors_dtype_code

    yield encode_header([(t.name, safetensors_dtype_code(t.out_dtype, t.fqn), t.shape, t.nbytes) for t in shard])
    remaining = {t.name: math.prod(t.shape) for t in shard}
    for t in shard:
        while remaining[t.name]:
            block, data = rounds.next_block()
            if block.tensor.name != t.name:
                raise RuntimeError(f"export plan out of order: got '{block.tensor.name}', expected '{t.name}'")
            remaining[t.name] -= block.box.numel
            yield data.contiguous().reshape(-1).view(torch.uint8).numpy().data
            del block, data  # written: free it before the next round allocates the next block


# --------------------------------------------------------------------------------------
# config.json


def _config_of(model: object) -> object | None:
    """The Hugging Face config of ``model`` (wrappers removed), if it has one."""
    if not isinstance(model, nn.Module):
        return None
    cfg = getattr(unwrap(model), "config", None)
    return cfg if callable(getattr(cfg, "to_json_string", None)) else None


def _write_config(out: Storage, config: object, plan: _Plan) -> None:
    """``config.json``, its dtype set to the floating-point dtype written (when there is one)."""
    floats = {t.out_dtype for t in plan.tensors if t.out_dtype.is_floating_point}
    cfg = copy.deepcopy(config)
    if len(floats) == 1:
        (written,) = floats
        setattr(cfg, "dtype" if hasattr(cfg, "dtype") else "torch_dtype", written)
    text = cfg.to_json_string(use_diff=True)  # type: ignore[attr-defined]
    out.write_atomic("config.json", text.encode("utf-8"))


def _padded(nbytes: int) -> int:
    """``nbytes`` rounded up to 8: every part in an exchange buffer starts aligned for any dtype."""
    return -(-nbytes // 8) * 8
