"""Write a Hugging Face model directory straight from a sharded training job.

:func:`save_hf` is the live counterpart of :func:`tessera.convert.export_hf` (which reads a
saved tessera checkpoint in one process): every rank of a job calls it with the model as
it is held (plain, DDP, FSDP2, tensor parallel, or a state of :class:`ShardedTensor` /
:class:`FlatShard` pieces) and the ranks write the output files in parallel.

How it works (all ranks, collective):

1. each rank flattens its state to pieces of global tensors (the geometry tessera saves);
2. the pieces' boxes are exchanged (metadata only), and every rank computes the same schedule:
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
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..adapters.model import ModelState, unwrap
from ..engine import dist
from ..engine.flat_state import flatten
from ..format.dtypes import dtype_name
from ..format.geometry import Box
from ..stateful import is_stateful
from ..storage import Storage, storage_for
from .rounds import ExchangeRounds, file_chunks
from .schedule import ExportSchedule, schedule_export

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
    from ..options import parse_size

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
            from .files import remove_model_files

            remove_model_files(out, out_dir)
    except Exception as e:
        err = e
    everyone = dist.exchange(world, err, metas, f"planning the Hugging Face export to {out_dir}")
    plan = schedule_export(
        everyone, prefix=prefix, dtype=dtype, limit=limit, block_bytes=block_bytes, world_size=world.size
    )

    rounds = ExchangeRounds(world, plan, local)
    mine = [i for i, w in enumerate(plan.writers) if w == world.rank]
    rank_bytes = 0
    try:
        for i in mine:
            out.write_file(plan.files[i], file_chunks(plan.shards[i], rounds))
            rank_bytes += sum(t.nbytes for t in plan.shards[i])
    except Exception as e:
        err = e
    rounds.drain()  # the other writers still need this rank's pieces
    dist.exchange(world, err, None, f"writing the Hugging Face shards to {out_dir}")

    total = sum(t.nbytes for t in plan.tensors)
    files = plan.files
    try:
        if world.is_coordinator:
            from .files import INDEX_NAME, index_bytes

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
        from .files import INDEX_NAME

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
# config.json


def _config_of(model: object) -> object | None:
    """The Hugging Face config of ``model`` (wrappers removed), if it has one."""
    if not isinstance(model, nn.Module):
        return None
    cfg = getattr(unwrap(model), "config", None)
    return cfg if callable(getattr(cfg, "to_json_string", None)) else None


def _write_config(out: Storage, config: object, plan: ExportSchedule) -> None:
    """``config.json``, its dtype set to the floating-point dtype written (when there is one)."""
    floats = {t.out_dtype for t in plan.tensors if t.out_dtype.is_floating_point}
    cfg = copy.deepcopy(config)
    if len(floats) == 1:
        (written,) = floats
        setattr(cfg, "dtype" if hasattr(cfg, "dtype") else "torch_dtype", written)
    text = cfg.to_json_string(use_diff=True)  # type: ignore[attr-defined]
    out.write_atomic("config.json", text.encode("utf-8"))
