"""DeepSpeed ZeRO checkpoints (stages 1, 2 and 3) -> tessera, one rank's file at a time.

A ZeRO checkpoint directory (``global_step<N>/``, or its parent with a ``latest`` file) holds
``mp_rank_00_model_states.pt`` (stage 3: ``zero_pp_rank_<r>_mp_rank_00_model_states.pt``
per rank) with ``param_shapes``, buffers and frozen parameters, and one
``*zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per data-parallel rank with that rank's
flat fp32 partitions. The geometry is the one DeepSpeed's ``zero_to_fp32.py`` uses:

* stage 1/2 (and ``BF16_Optimizer``'s ``bf16_zero_pp_rank_*`` files): each parameter group
  is one flat vector (the group's parameters in ``param_shapes`` order, each followed by its
  ``param_alignment_paddings`` entry, the whole padded to a multiple of ``2 * world``); rank
  ``r`` holds the ``r``-th equal slice, saved without the tail padding (so the last ranks'
  slices are shorter, or empty).
* stage 3: every parameter is split on its own into ``ceil(numel / world)`` elements per
  rank (the last rank's slice padded); a rank's flat group concatenates its slices.

Each rank's slice of a parameter is a flat range of that parameter: the geometry comes from
:mod:`tessera.adapters.zero` (``FlatLayout``), which yields one :class:`tessera.FlatShard`
per parameter, and each goes to the checkpoint as is, with no gather:
only one rank file is open at a time (memory-mapped). Adam-style optimizer state
(``exp_avg``, ``exp_avg_sq``) has the same geometry and is converted the same way.

The files are found and read by :mod:`.deepspeed_files` (``torch.load(weights_only=True)`` with
:data:`SAFE_GLOBALS`, plain stand-ins for the few DeepSpeed classes a checkpoint holds);
DeepSpeed need not be installed.
The way back is :mod:`tessera.convert.deepspeed_universal`.

Output names: ``<model_prefix><param>`` (fp32 master weights, buffers, frozen parameters),
``<optim_prefix>state.<param>.<key>``, ``<optim_prefix>param_groups`` (with parameter
FQNs in ``params``) and ``<optim_prefix>has_state``: exactly the state of
``{"model": tessera.ModelState(model), "optim": tessera.OptimizerState(model, optimizer)}``
for a plain torch model with the same parameter names, which loads it directly.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

import torch

from ..adapters.zero import FlatEntry, FlatLayout
from ..errors import CorruptCheckpointError
from ..format.dtypes import cast_for
from ..format.values import is_plain
from ..shards import FlatShard
from ..storage import Storage
from ._common import ConvertResult, Progress, ProgressFn

# The stand-in classes too: values pickled under their old path still load.
from .deepspeed_files import (
    SAFE_GLOBALS,
    DynamicLossScaler,
    FragmentAddress,
    LossScaler,
    Namespace,
    find_zero_dir,
    load_file,
    state_files,
)
from .writer import CheckpointWriter

logger = logging.getLogger(__name__)

__all__ = [
    "SAFE_GLOBALS",
    "DynamicLossScaler",
    "FragmentAddress",
    "LossScaler",
    "Namespace",
    "find_zero_dir",
    "import_deepspeed",
]

_MODEL_KEYS = {
    "module", "buffer_names", "param_shapes", "frozen_param_shapes", "frozen_param_fragments", "shared_params",
    "optimizer", "sparse_tensor_module_names",
}  # fmt: skip


class _Out:
    """Adds tensors under their name and every alias (DeepSpeed's shared parameters)."""

    def __init__(
        self, w: CheckpointWriter, aliases: dict[str, list[str]], dtype: torch.dtype | None, prog: Progress
    ) -> None:
        self.w, self.aliases, self.dtype, self.prog = w, aliases, dtype, prog

    def flat(self, name: str, shape: tuple[int, ...], start: int, data: torch.Tensor) -> None:
        data = data.to(cast_for(data.dtype, self.dtype))
        for n in [name, *self.aliases.get(name, ())]:
            self.w.add_flat(n, shape, start, data)
        self.prog.advance(data.numel() * data.element_size())

    def whole(self, name: str, t: torch.Tensor) -> None:
        self.flat(name, tuple(t.shape), 0, t.reshape(-1))


def import_deepspeed(
    src: str,
    path: str,
    *,
    tag: str | None = None,
    model_prefix: str = "model.",
    optim_prefix: str = "optim.",
    include_optimizer: bool = True,
    dtype: torch.dtype | None = None,
    storage: Storage | None = None,
    allow_pickle: bool = False,
    tied_aliases: bool = False,
    file_bytes: int = 256 << 20,
    progress: ProgressFn | None = None,
) -> ConvertResult:
    """Convert a DeepSpeed ZeRO (stage 1, 2 or 3) checkpoint into a tessera checkpoint.

    Every standard checkpoint of DeepSpeed's engine converts (fp32, fp16, bf16 including
    ``BF16_Optimizer``, ``parameter_alignment``, ``round_robin_gradients``, tied and frozen
    parameters, several parameter groups) without ``allow_pickle``: the files are read with
    ``torch.load(weights_only=True)`` and the allow-list :data:`SAFE_GLOBALS` of the few
    DeepSpeed classes they hold.

    Args:
        src: the ``global_step<N>`` directory, or its parent with a ``latest`` file.
        path: where to write the tessera checkpoint (replaced atomically).
        tag: a sub-directory of ``src`` to use instead of ``latest``.
        model_prefix: prefix of parameter and buffer names.
        optim_prefix: prefix of optimizer state names.
        include_optimizer: also convert optimizer state (``exp_avg`` ...) and param groups.
        dtype: cast floating-point tensors (the fp32 master weights too) to this dtype.
        storage: backend of the new checkpoint.
        allow_pickle: unpickle arbitrary objects in the files (only for files you trust);
            DeepSpeed's own files never need it.
        tied_aliases: also write each tied parameter under its alias (``shared_params``,
            e.g. ``head.weight`` beside ``embed.weight``), as ``model.state_dict()`` lists
            it. Off: once under the name ``named_parameters`` gives, as ``ModelState`` holds it;
            the ties are kept as the value ``deepspeed.shared_params``.
        file_bytes: size of the tessera data files written.
        progress: called with ``(done_bytes, total_bytes)``.

    Returns:
        What was written; non-plain entries that were left out are listed in ``skipped``.

    Raises:
        FileNotFoundError: if ``src`` holds no ZeRO checkpoint.
        CorruptCheckpointError: if the files disagree with each other or with ``param_shapes``.

    Example:
        >>> import_deepspeed("/runs/gpt/checkpoints", "/ckpt/gpt-step1000")
    """
    t0 = time.monotonic()
    directory = find_zero_dir(src, tag)
    optim_files = state_files(directory, "optim")
    model_files = state_files(directory, "model")
    first_model = model_files[0][1] if model_files else os.path.join(directory, "mp_rank_00_model_states.pt")
    if not os.path.isfile(first_model):
        raise FileNotFoundError(f"{directory} has optimizer states but no *_model_states.pt file")
    model_sd = load_file(first_model, allow_pickle)
    for key in ("param_shapes", "buffer_names", "module"):
        if key not in model_sd:
            raise CorruptCheckpointError(f"{first_model} is not a DeepSpeed model-states file: '{key}' is missing")
    groups = [{n: tuple(int(x) for x in s) for n, s in g.items()} for g in model_sd["param_shapes"]]
    world = len(optim_files)
    if [r for r, _ in optim_files] != list(range(world)):
        raise CorruptCheckpointError(
            f"{directory}: optimizer-state files for ranks {[r for r, _ in optim_files]}, expected 0..{world - 1}"
        )
    aliases: dict[str, list[str]] = {}
    shared = _shared_params(model_sd.get("shared_params"), first_model)
    for alias, target in shared if tied_aliases else ():
        aliases.setdefault(model_prefix + target, []).append(model_prefix + alias)
    total = sum(math.prod(s) * 4 for g in groups for s in g.values())
    prog = Progress(total * (3 if include_optimizer else 1), progress)
    skipped: list[str] = []
    with CheckpointWriter(path, storage=storage, file_bytes=file_bytes) as w:
        out = _Out(w, aliases, dtype, prog)
        stage = 0
        for rank, fname in optim_files:
            osd = load_file(fname, allow_pickle).get("optimizer_state_dict")
            if isinstance(osd, dict) and "zero_stage" not in osd and "single_partition_of_fp32_groups" in osd:
                stage = 1  # BF16_Optimizer (bf16 + ZeRO-1 + fp32 gradient accumulation): the stage-1 layout
            elif not isinstance(osd, dict) or "zero_stage" not in osd:
                raise CorruptCheckpointError(f"{fname} is not a ZeRO optimizer-states file: 'zero_stage' is missing")
            else:
                stage = int(osd["zero_stage"])
            count = osd.get("partition_count")
            count = max(count) if isinstance(count, (list, tuple)) else count
            if count is not None and int(count) != world:
                raise CorruptCheckpointError(
                    f"{fname}: partition_count is {count} but {world} rank files were found in {directory}"
                )
            if stage in (1, 2):
                _stage12(osd, rank, world, groups, out, model_prefix, optim_prefix, include_optimizer, fname)
            elif stage == 3:
                _stage3(osd, rank, world, groups, out, model_prefix, optim_prefix, include_optimizer, fname)
            else:
                raise CorruptCheckpointError(f"{fname}: unknown ZeRO stage {stage}")
            if rank == 0 and include_optimizer:
                pg = _param_groups(osd, groups)
                if pg is not None:
                    w.add_value(optim_prefix + "param_groups", pg)
                w.add_value(optim_prefix + "has_state", True)
            del osd
        _model_extras(model_sd, model_files, stage, world, out, model_prefix, skipped, allow_pickle)
        if shared:
            w.add_value("deepspeed.shared_params", dict(shared))
        w.commit(
            source=f"deepspeed:{directory}",
            layout={"format": "deepspeed-zero", "zero_stage": stage, "dp_world_size": world},
        )
        counts = (w.tensors_declared, w.values_added, w.tensor_bytes, w.files_written)
    logger.info("converted ZeRO-%d checkpoint %s (%d ranks) into %s", stage, directory, world, path)
    return ConvertResult(src, path, *counts, time.monotonic() - t0, tuple(skipped))


def _optim_state(osd: dict, key: str) -> dict[int, dict]:
    """The wrapped torch optimizer's per-group state: ``{group index: {name: value}}``."""
    base = osd.get(key)
    if isinstance(base, list):  # elastic checkpoints: one (unpadded) state dict per group
        return {i: s for i, s in enumerate(base) if isinstance(s, dict)}
    if isinstance(base, dict) and isinstance(base.get("state"), dict):
        return {int(i): s for i, s in base["state"].items()}
    return {}


def _add_shards(out: _Out, pattern: str, shards: dict[str, FlatShard]) -> None:
    """Add each parameter's shard under ``pattern`` with ``{}`` replaced by the parameter's name."""
    for name, shard in shards.items():
        out.flat(pattern.replace("{}", name, 1), shard.global_shape, shard.flat_start, shard.local_1d)


def _shared_params(shared: Any, fname: str) -> list[tuple[str, str]]:
    """``(alias, target)`` pairs of tied parameters: a dict ``{alias: target}`` (DeepSpeed's
    ``shared_params``) or, in older files, a list of pairs."""
    if not shared:
        return []
    items = shared.items() if isinstance(shared, dict) else shared
    out = []
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and all(isinstance(x, str) for x in item)):
            raise CorruptCheckpointError(
                f"{fname}: 'shared_params' should map parameter names to names, found {item!r}"
            )
        out.append((item[0], item[1]))
    return out


def _stage12_layout(shapes: dict, paddings: Any, world: int, gi: int, fname: str) -> FlatLayout:
    """Group ``gi``'s flat buffer: parameters in ``param_shapes`` order, each followed by its
    ``param_alignment_paddings`` entry (``zero_optimization.parameter_alignment``), the whole
    padded to a multiple of ``2 * world`` (``nccl_start_alignment_factor``)."""
    items = list(shapes.items())
    if paddings is None:
        paddings = [0] * len(items)
    if not isinstance(paddings, (list, tuple)) or len(paddings) != len(items):
        raise CorruptCheckpointError(
            f"{fname}: group {gi} has {len(items)} parameters but param_alignment_paddings {paddings!r}"
        )
    entries, pos = [], 0
    for (name, shape), pad in zip(items, paddings):
        entry = FlatEntry(name, shape, pos)
        entries.append(entry)
        pos = entry.stop + int(pad)
    align = 2 * world
    return FlatLayout(tuple(entries), -(-pos // align) * align)


def _stage12(
    osd: dict, rank: int, world: int, groups: list[dict], out: _Out, mp: str, op: str, optim: bool, fname: str
) -> None:
    parts = osd.get("single_partition_of_fp32_groups")
    if not isinstance(parts, (list, tuple)) or len(parts) != len(groups):
        raise CorruptCheckpointError(
            f"{fname}: expected {len(groups)} fp32 partitions ('single_partition_of_fp32_groups')"
        )
    paddings = osd.get("param_alignment_paddings") or [None] * len(groups)
    state = _optim_state(osd, "base_optimizer_state") if optim else {}
    for gi, (shapes, local) in enumerate(zip(groups, parts)):
        layout = _stage12_layout(shapes, paddings[gi] if gi < len(paddings) else None, world, gi, fname)
        part = layout.partition(rank, world)
        # DeepSpeed saves the partition without the buffer's tail padding (group_paddings), so
        # the last ranks' partitions are shorter; older files and BF16_Optimizer keep it.
        data_end = layout.entries[-1].stop if layout.entries else 0
        needed = max(0, min(part.stop, data_end) - part.start)
        if not needed <= local.numel() <= part.numel:
            raise CorruptCheckpointError(
                f"{fname}: group {gi}'s parameters fill a flat buffer of {layout.numel} elements (padded for {world} "
                f"ranks), so rank {rank}'s partition holds {needed} to {part.numel} elements, but it holds "
                f"{local.numel()}; param_shapes does not match the optimizer states"
            )
        held = layout.slice(part.start, part.start + local.numel())
        _add_shards(out, mp + "{}", held.shards(local, declare_all=False))
        for key, v in state.get(gi, {}).items():
            if isinstance(v, torch.Tensor) and v.dim() == 1 and needed <= v.numel() <= part.numel:
                # Optimizer state may or may not carry the partition's tail padding (elastic checkpoints).
                piece = layout.slice(part.start, part.start + v.numel())
                _add_shards(out, op + "state.{}." + key, piece.shards(v, declare_all=False))
        if rank == 0:
            _scalars(state.get(gi, {}), shapes, out, op)


def _stage3(
    osd: dict, rank: int, world: int, groups: list[dict], out: _Out, mp: str, op: str, optim: bool, fname: str
) -> None:
    parts = osd.get("fp32_flat_groups")
    if not isinstance(parts, (list, tuple)) or len(parts) != len(groups):
        raise CorruptCheckpointError(f"{fname}: expected {len(groups)} fp32 flat groups ('fp32_flat_groups')")
    state = _optim_state(osd, "optimizer_state_dict") if optim else {}
    for gi, (shapes, local) in enumerate(zip(groups, parts)):
        vecs: list[tuple[str, torch.Tensor]] = [(mp + "{}", local)]
        for key, v in state.get(gi, {}).items():
            if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == local.numel():
                vecs.append((op + "state.{}." + key, v))
        pos = 0
        for name, shape in shapes.items():
            # Stage 3 partitions every parameter on its own, padded to a multiple of world.
            part = FlatLayout.pack([(name, shape)], total_alignment=world).partition(rank, world)
            if pos + part.numel > local.numel():
                raise CorruptCheckpointError(
                    f"{fname}: flat group {gi} ends before parameter '{name}' ({pos + part.numel} > {local.numel()} elements); "
                    "param_shapes does not match the optimizer states"
                )
            for pattern, vec in vecs:
                _add_shards(out, pattern, part.shards(vec[pos : pos + part.numel], declare_all=False))
            pos += part.numel
        if pos != local.numel():
            raise CorruptCheckpointError(
                f"{fname}: flat group {gi} holds {local.numel()} elements but its parameters {pos}; "
                "param_shapes does not match the optimizer states"
            )
        if rank == 0:
            _scalars(state.get(gi, {}), shapes, out, op)


def _scalars(group_state: dict, shapes: dict, out: _Out, op: str) -> None:
    """Per-group scalar state (Adam's ``step``) becomes a scalar per parameter, as in torch."""
    for key, v in group_state.items():
        if (isinstance(v, torch.Tensor) and v.dim() == 0) or (isinstance(v, (int, float)) and not isinstance(v, bool)):
            t = v if isinstance(v, torch.Tensor) else torch.tensor(v)
            for name in shapes:
                out.whole(f"{op}state.{name}.{key}", t.detach().clone())


def _param_groups(osd: dict, groups: list[dict]) -> list[dict] | None:
    """The wrapped optimizer's param groups with parameter FQNs in ``params`` (as OptimizerState saves them)."""
    base = osd.get("base_optimizer_state", osd.get("optimizer_state_dict"))
    pgs = base.get("param_groups") if isinstance(base, dict) else None
    if isinstance(base, list) and pgs is None:
        # Elastic checkpoints save no hyperparameters: the groups' members only, so that the
        # checkpoint still loads strictly and the loading optimizer keeps its own values.
        logger.info("the ZeRO checkpoint (elastic) holds no optimizer hyperparameters; param_groups lists members only")
        return [{"params": list(shapes)} for shapes in groups]
    if not isinstance(pgs, list) or len(pgs) != len(groups):
        return None
    out = []
    for pg, shapes in zip(pgs, groups):
        entry = {k: v for k, v in pg.items() if k != "params" and is_plain(v)}
        entry["params"] = list(shapes)
        out.append(entry)
    return out


def _model_extras(
    model_sd: dict,
    model_files: list[tuple[int, str]],
    stage: int,
    world: int,
    out: _Out,
    mp: str,
    skipped: list[str],
    allow_pickle: bool,
) -> None:
    """Buffers, frozen parameters and plain client state of the model-states file(s)."""
    module = model_sd["module"] or {}
    for name in model_sd.get("buffer_names") or []:
        if name in module and isinstance(module[name], torch.Tensor):
            out.whole(mp + name, module[name])
    frozen = model_sd.get("frozen_param_shapes")
    if frozen is None and stage in (1, 2):
        # ZeRO-1 records no frozen_param_shapes (None): its frozen parameters are the module
        # entries that are neither optimized (param_shapes), buffers nor tied aliases.
        known = {n for g in model_sd["param_shapes"] for n in g} | set(model_sd.get("buffer_names") or [])
        known |= {
            alias
            for alias, _ in _shared_params(model_sd.get("shared_params"), model_files[0][1] if model_files else "")
        }
        frozen = {n: t.shape for n, t in module.items() if n not in known and isinstance(t, torch.Tensor)}
    frozen = {n: tuple(int(x) for x in s) for n, s in (frozen or {}).items()}
    if frozen and stage == 3:
        for rank, fname in model_files:
            frags = (model_sd if rank == model_files[0][0] else load_file(fname, allow_pickle)).get(
                "frozen_param_fragments"
            ) or {}
            for name, shape in frozen.items():
                part = FlatLayout.pack([(name, shape)], total_alignment=world).partition(rank, world)
                _add_shards(out, mp + "{}", part.shards(frags[name].reshape(-1)[: part.numel], declare_all=False))
    else:
        # Stage 2 stores frozen parameters whole in frozen_param_fragments; stage 1 only in the module.
        frags = model_sd.get("frozen_param_fragments") or {}
        for name in frozen:
            t = frags.get(name, module.get(name))
            if isinstance(t, torch.Tensor):
                out.whole(mp + name, t)
    for key, v in model_sd.items():
        if key in _MODEL_KEYS or isinstance(v, torch.Tensor):
            continue
        if is_plain(v):
            out.w.add_value(f"deepspeed.{key}", v)
        else:
            skipped.append(f"deepspeed.{key} (not a plain value)")
