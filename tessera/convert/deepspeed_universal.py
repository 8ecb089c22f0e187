"""tessera -> DeepSpeed universal checkpoint (UCP), which a DeepSpeed engine resumes from at any DP size.

DeepSpeed's own route between data-parallel sizes is the *universal checkpoint*: its
``ds_to_universal.py`` turns a ZeRO checkpoint into one directory per parameter holding the
whole fp32 master weight and each whole optimizer state, and an engine configured with
``"checkpoint": {"load_universal": true}`` slices its own partitions out of them in
``load_checkpoint``. A tessera checkpoint already holds every tensor as a global tensor keyed
by FQN, so it is written straight in that layout, whatever layout (and framework) saved it::

    <out>/latest_universal                       the tag, as ds_to_universal.py leaves it
    <out>/<tag>/mp_rank_00_model_states.pt       engine metadata (steps, DP size, shapes)
    <out>/<tag>/zero_pp_rank_0_mp_rank_00_model_states.pt   the same, for ZeRO-3 engines
    <out>/<tag>/zero/optimizer_state.pt          param_groups (hyperparameters) and global state
    <out>/<tag>/zero/<param>/fp32.pt             {"param": fp32 master weight, whole}
    <out>/<tag>/zero/<param>/exp_avg.pt          {"param": ...} likewise for every state shaped like it
    <out>/<tag>/zero/<param>/step.pt             the optimizer step (a scalar)

Names: ``<model_prefix><param>`` is the weight and ``<optim_prefix>state.<param>.<key>`` its
optimizer state, ``<optim_prefix>param_groups`` the hyperparameters: exactly what
``tessera.ModelState`` / ``tessera.OptimizerState`` save and :func:`import_deepspeed` writes.

DeepSpeed's universal loading restores the optimized parameters and their optimizer state
(and the ZeRO-1/2 bit16 weights from them). Like checkpoints made by ``ds_to_universal.py``, it
does not restore buffers or frozen parameters (``module`` is not read): those come from the
model the engine was built with. They are still written into ``module`` of the model-states
file for reference.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Any

import torch

from ..format.geometry import Box
from ..storage import Storage
from ._common import ConvertResult, Progress, ProgressFn
from .reader import CheckpointReader

logger = logging.getLogger(__name__)

DS_VERSION = "0.19.8"
"""The DeepSpeed version recorded in the files (DeepSpeed checks it is >= 0.3.17); the one
these files were tested against."""


def export_deepspeed_universal(
    path: str,
    out_dir: str,
    *,
    tag: str | None = None,
    model_prefix: str = "model.",
    optim_prefix: str = "optim.",
    storage: Storage | None = None,
    progress: ProgressFn | None = None,
) -> ConvertResult:
    """Write a tessera checkpoint as a DeepSpeed universal checkpoint (single process).

    A DeepSpeed engine built with ``"checkpoint": {"load_universal": true}`` then resumes from
    ``out_dir`` with ``engine.load_checkpoint(out_dir)`` at any data-parallel size and ZeRO
    stage, with fp32 master weights and Adam-style state (``exp_avg``, ``exp_avg_sq``,
    ``step``) restored exactly. Call it from one process; it never communicates.

    Args:
        path: the tessera checkpoint (saved under any layout).
        out_dir: the directory to write (the engine's ``load_dir``); an existing tag is replaced.
        tag: the checkpoint directory's name; default ``global_step<N>`` with the checkpoint's
            ``deepspeed.global_steps`` value or optimizer step.
        model_prefix: prefix of the parameters' names in the checkpoint.
        optim_prefix: prefix of the optimizer state (``<optim_prefix>state.<param>.<key>``).
        storage: backend of the tessera checkpoint.
        progress: called with ``(done_bytes, total_bytes)``.

    Returns:
        What was written; tensors that are not a parameter's state are listed in ``skipped``.

    Raises:
        ValueError: if the checkpoint has no tensor under ``model_prefix``, or no optimizer
            state for them under ``optim_prefix``.
        CorruptCheckpointError: for data failing its checksum.

    Example:
        >>> export_deepspeed_universal("/ckpt/step1000", "/runs/gpt/universal")
        >>> # ds_config: {"checkpoint": {"load_universal": true}, ...}
        >>> engine.load_checkpoint("/runs/gpt/universal")
    """
    t0 = time.monotonic()
    src = CheckpointReader(path, storage=storage)
    values, _ = src.values()
    params = {k[len(model_prefix) :]: k for k in src.manifest.tensors if k.startswith(model_prefix)}
    if not params:
        raise ValueError(f"checkpoint {path} has no tensor under {model_prefix!r} to export")
    state_base = optim_prefix + "state."
    states: dict[str, dict[str, str]] = {}
    skipped: list[str] = []
    for key in src.manifest.tensors:
        if not key.startswith(state_base):
            continue
        split = _split(key[len(state_base) :], params)
        if split is None:
            skipped.append(f"{key} (not the state of a parameter under {model_prefix!r})")
            continue
        states.setdefault(split[0], {})[split[1]] = key
    optimized = {n for n in params if n in states}
    if not optimized:
        raise ValueError(
            f"checkpoint {path} holds no optimizer state under {state_base!r} for the parameters under {model_prefix!r}; "
            "a DeepSpeed universal checkpoint restores optimized parameters with their state (save the optimizer with "
            "tessera.OptimizerState, or pass optim_prefix)"
        )
    steps = [
        float(src.read(k, Box.whole(())).item())
        for n in sorted(optimized)
        for s, k in states[n].items()
        if s == "step" and src.shape(k) == ()
    ]
    global_steps = int(values.get("deepspeed.global_steps", max(steps, default=0)))
    tag = tag or f"global_step{global_steps}"
    root = os.path.join(out_dir, tag)
    if os.path.isdir(root):
        shutil.rmtree(root)
    zero = os.path.join(root, "zero")
    os.makedirs(zero)
    total = sum(src.nbytes(params[n]) for n in optimized) + sum(
        src.nbytes(k) for n in optimized for k in states[n].values()
    )
    prog = Progress(total, progress)
    files = tensors = nbytes = 0
    step_value: torch.Tensor | None = None
    for name in sorted(optimized):
        d = os.path.join(zero, name)
        os.makedirs(d, exist_ok=True)
        shape = src.shape(params[name])
        weight = src.read(params[name], Box.whole(shape), dtype=torch.float32)
        torch.save({"param": weight}, os.path.join(d, "fp32.pt"))
        files, tensors, nbytes = files + 1, tensors + 1, nbytes + weight.numel() * 4
        prog.advance(src.nbytes(params[name]))
        for key, fqn in sorted(states[name].items()):
            sshape = src.shape(fqn)
            data = src.read(fqn, Box.whole(sshape))
            prog.advance(src.nbytes(fqn))
            if sshape == ():
                if key != "step":
                    skipped.append(f"{fqn} (a scalar state other than 'step' has no place in a universal checkpoint)")
                    continue
                step_value = data if step_value is None else step_value
                torch.save(data, os.path.join(d, "step.pt"))
            elif sshape == shape:
                torch.save({"param": data}, os.path.join(d, f"{key}.pt"))
            else:
                skipped.append(f"{fqn} (shape {list(sshape)}, not its parameter's {list(shape)})")
                continue
            files, tensors, nbytes = files + 1, tensors + 1, nbytes + data.numel() * data.element_size()
    groups = _param_groups(values.get(optim_prefix + "param_groups"))
    optimizer_state = {
        "param_groups": groups,
        # ZeRO-3 reads the step and hyperparameters from the wrapped optimizer's state dict.
        "optimizer_state_dict": {
            "state": {0: {"step": step_value}} if step_value is not None else {},
            "param_groups": groups,
        },
        "ds_version": DS_VERSION,
    }
    torch.save(optimizer_state, os.path.join(zero, "optimizer_state.pt"))
    rest = {n: k for n, k in params.items() if n not in optimized}
    module = {n: src.read(k, Box.whole(src.shape(k))) for n, k in rest.items()}
    model_states: dict[str, Any] = {
        "module": module,
        "buffer_names": [],
        "optimizer": None,
        "param_shapes": [{n: torch.Size(src.shape(params[n])) for n in sorted(optimized)}],
        "frozen_param_shapes": None,
        "shared_params": values.get("deepspeed.shared_params") or {},
        "lr_scheduler": None,
        "data_sampler": None,
        "random_ltd": None,
        "sparse_tensor_module_names": set(),
        "skipped_steps": int(values.get("deepspeed.skipped_steps", 0)),
        "global_steps": global_steps,
        "global_samples": int(values.get("deepspeed.global_samples", 0)),
        "dp_world_size": int(values.get("deepspeed.dp_world_size", 1)),
        "mp_world_size": 1,
        "ds_version": DS_VERSION,
    }
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        torch.save(model_states, os.path.join(root, name))
    with open(os.path.join(out_dir, "latest_universal"), "w") as f:
        f.write(tag)
    files += 4
    logger.info("exported %d parameters of %s as DeepSpeed universal checkpoint %s", len(optimized), path, root)
    return ConvertResult(path, root, tensors, len(groups), nbytes, files, time.monotonic() - t0, tuple(skipped))


def _split(rest: str, params: dict[str, str]) -> tuple[str, str] | None:
    """``<param>.<key>`` -> ``(param, key)`` for a known parameter name (the longest that fits)."""
    i = len(rest)
    while (i := rest.rfind(".", 0, i)) > 0:
        if rest[:i] in params:
            return rest[:i], rest[i + 1 :]
    return None


def _param_groups(saved: Any) -> list[dict[str, Any]]:
    """The saved hyperparameters per group, in order, without parameter names."""
    if not isinstance(saved, list):
        return []
    return [{k: v for k, v in g.items() if k != "params"} | {"params": []} for g in saved if isinstance(g, dict)]
