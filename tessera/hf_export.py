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

No rank ever holds more than about one block per peer of exchange buffers, whatever the
model size: :attr:`HFSaveResult.peak_buffer_bytes` reports the peak this rank held.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn

from . import dist
from .adapters.model import ModelState, unwrap
from .dtypes import dtype_from_name, dtype_name
from .errors import CoverageError, StateMismatchError
from .geometry import Box, intersect
from .state import flatten, is_stateful
from .storage import Storage, storage_for

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_BYTES = 64 << 20
"""Largest block of a tensor assembled on a writer at once."""


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
        return _numel(self.shape) * _itemsize(self.out_dtype)


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
    except Exception as e:  # noqa: BLE001 - reported on every rank by the exchange
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
    except Exception as e:  # noqa: BLE001
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
    except Exception as e:  # noqa: BLE001
        err = e
    dist.exchange(world, err, None, f"writing the Hugging Face index of {out_dir}")
    if len(files) > 1:
        from .convert.hf import INDEX_NAME

        files = (*files, INDEX_NAME)
    seconds = time.monotonic() - t0
    if world.is_coordinator:
        logger.info(
            "wrote %d tensors (%d bytes) to %s in %d file(s) from %d rank(s) in %.2fs",
            len(plan.tensors), total, out_dir, len(plan.files), world.size, seconds,
        )
    return HFSaveResult(
        out_dir, tuple(files), tuple(plan.files[i] for i in mine), len(plan.tensors), total, rank_bytes,
        rounds.peak_bytes, seconds,
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
    shards = tuple(tuple(sorted((tensors[i] for i in g), key=lambda t: -_itemsize(t.out_dtype))) for g in groups)
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
            size = max(_itemsize(t.dtype), _itemsize(t.out_dtype))
            for n, box in enumerate(split_box(Box.whole(t.shape), size, block_bytes)):
                if box.is_empty():  # an empty tensor has a header entry and no bytes
                    continue
                blocks[w].append(_Block(t, box, _sources(t, box, w, n)))
    return _Plan(tuple(tensors), files, shards, tuple(writers), tuple(tuple(b) for b in blocks))


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
        self.count = max((len(b) for b in plan.blocks), default=0)
        self.done = 0
        self.peak_bytes = 0
        self._last_exchange_bytes = 0  # buffers of the latest round, still alive while its block is assembled

    def next_block(self) -> tuple[_Block, torch.Tensor]:
        """Run the next round; this rank's assembled block (in the output dtype)."""
        me = self.world.rank
        mine = self.plan.blocks[me][self.done] if self.done < len(self.plan.blocks[me]) else None
        received = self._exchange()
        if mine is None:
            raise RuntimeError(f"rank {me}: no block left to write in round {self.done - 1}")  # a planning bug
        t = mine.tensor
        buf = torch.empty(mine.box.lengths, dtype=t.dtype)
        for owner, box, part in mine.sources:
            dst = buf[part.relative_to(mine.box).slices()]
            if owner == me:
                dst.copy_(self.local[(t.fqn, box)][part.relative_to(box).slices()])
            else:
                dst.copy_(received[owner].pop(0))
        out = buf if t.out_dtype == t.dtype else buf.to(t.out_dtype)
        held = buf.numel() * buf.element_size() * (1 if out is buf else 2) + self._last_exchange_bytes
        self.peak_bytes = max(self.peak_bytes, held)
        return mine, out

    def drain(self) -> None:
        """Take part in the rounds left (this rank has no more blocks to write)."""
        while self.done < self.count:
            self._exchange()

    def _exchange(self) -> dict[int, list[torch.Tensor]]:
        """Send this rank's parts of everyone's block of this round; receive those of its own."""
        k = self.done
        self.done += 1
        me, size = self.world.rank, self.world.size
        send: list[list[torch.Tensor]] = [[] for _ in range(size)]
        expect: list[list[tuple[Box, torch.dtype]]] = [[] for _ in range(size)]
        for w in range(size):
            if k >= len(self.plan.blocks[w]):
                continue
            b = self.plan.blocks[w][k]
            for owner, box, part in b.sources:
                if owner == w:
                    continue
                if owner == me:
                    piece = self.local[(b.tensor.fqn, box)][part.relative_to(box).slices()]
                    send[w].append(piece.to("cpu").contiguous().reshape(-1).view(torch.uint8))
                if w == me:
                    expect[owner].append((part, b.tensor.dtype))
        in_sizes = [sum(p.numel() for p in parts) for parts in send]
        out_sizes = [sum(box.numel * _itemsize(dt) for box, dt in parts) for parts in expect]
        self._last_exchange_bytes = 2 * sum(in_sizes) + sum(out_sizes)  # parts, their packed copy, the receive buffer
        if not _any_transfer(self.plan, k, size):
            return {}
        flat_in = torch.cat([p for parts in send for p in parts]) if sum(in_sizes) else torch.empty(0, dtype=torch.uint8)
        flat_out = torch.empty(sum(out_sizes), dtype=torch.uint8)
        self.peak_bytes = max(self.peak_bytes, self._last_exchange_bytes)
        dist._run(
            self.world, f"exchanging round {k} of the Hugging Face export",
            lambda: torch_dist.all_to_all_single(flat_out, flat_in, out_sizes, in_sizes, group=self.world.group),
        )
        received: dict[int, list[torch.Tensor]] = {}
        pos = 0
        for src in range(size):
            for box, dt in expect[src]:
                n = box.numel * _itemsize(dt)
                received.setdefault(src, []).append(flat_out[pos : pos + n].view(dt).view(box.lengths))
                pos += n
        return received


def _any_transfer(plan: _Plan, k: int, size: int) -> bool:
    """Whether any rank sends anything in round ``k`` (all ranks agree: the plan is shared)."""
    for w in range(size):
        if k < len(plan.blocks[w]) and any(owner != w for owner, _, _ in plan.blocks[w][k].sources):
            return True
    return False


def _file_chunks(shard: tuple[_Tensor, ...], rounds: _Rounds) -> Iterator[bytes | memoryview]:
    """A shard file's bytes: its header, then each tensor block by block as the rounds deliver them."""
    from .convert._common import safetensors_dtype_code
    from .convert.hf import safetensors_header

    yield safetensors_header([(t.name, safetensors_dtype_code(t.out_dtype, t.fqn), t.shape, t.nbytes) for t in shard])
    remaining = {t.name: _numel(t.shape) for t in shard}
    for t in shard:
        while remaining[t.name]:
            block, data = rounds.next_block()
            if block.tensor.name != t.name:
                raise RuntimeError(f"export plan out of order: got '{block.tensor.name}', expected '{t.name}'")
            remaining[t.name] -= block.box.numel
            yield memoryview(data.contiguous().reshape(-1).view(torch.uint8).numpy())


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


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
