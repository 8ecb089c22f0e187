"""Accelerate: save and resume an ``accelerate.Accelerator``'s training state with tessera.

``Accelerator.save_state`` writes one file per object with ``torch.save``/safetensors and
its pre-hooks can only edit what it then writes, so tessera plugs in as two helpers that
take the accelerator and save what ``save_state`` saves, as one tessera checkpoint:

========================  ==============================================================
key                       what
========================  ==============================================================
``model.<i>``             ``tessera.ModelState`` of each prepared model (plain, DDP, FSDP)
``optim.<i>``             ``tessera.OptimizerState`` of each prepared optimizer, by FQN
``sched.<i>``             each prepared LR scheduler's ``state_dict()``
``scaler``                the ``GradScaler``, when mixed precision uses one
``rng``                   ``tessera.RNGState()``: Python, NumPy, torch (CUDA) generators, per rank
``custom.<i>``            objects given to ``accelerator.register_for_checkpointing``
``step``, ``iteration``   ``accelerator.step`` and ``project_configuration.iteration``
========================  ==============================================================

Because model and optimizer states are keyed by parameter FQN and saved as each rank's
shards, a checkpoint saved by N processes resumes on M. Data-loader positions are not
saved (Accelerate keeps them per process); use ``accelerator.skip_first_batches`` or
``tessera.adapters.DataPosition`` (see docs/integrations.md).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

from .. import api
from ..adapters import ModelState, OptimizerState, RNGState
from ..errors import StateMismatchError
from ..results import LoadResult, PendingSave, SaveResult

__all__ = ["load_state", "save_state", "training_state"]

logger = logging.getLogger(__name__)


def training_state(accelerator: Accelerator, *, rng: bool = True) -> dict[str, Any]:
    """The accelerator's training state as a tessera state dict (see the module docs).

    Every value aliases the live objects, so the same dict serves :func:`tessera.save` and
    :func:`tessera.load`; add your own keys to it before saving.

    Args:
        accelerator: an ``Accelerator`` after ``prepare``.
        rng: include ``tessera.RNGState()``.

    Raises:
        ValueError: if an optimizer's parameters belong to no prepared model or to several.
    """
    models: list[nn.Module] = list(accelerator._models)
    state: dict[str, Any] = {f"model.{i}": ModelState(m) for i, m in enumerate(models)}
    for i, opt in enumerate(accelerator._optimizers):
        inner = getattr(opt, "optimizer", opt)
        state[f"optim.{i}"] = OptimizerState(_owner(models, inner, i), inner)
    for i, sched in enumerate(accelerator._schedulers):
        state[f"sched.{i}"] = sched
    if accelerator.scaler is not None:
        state["scaler"] = accelerator.scaler
    if rng:
        state["rng"] = RNGState()
    for i, obj in enumerate(accelerator._custom_objects):
        state[f"custom.{i}"] = obj
    state["step"] = int(accelerator.step)
    state["iteration"] = int(accelerator.project_configuration.iteration)
    return state


def save_state(
    accelerator: Accelerator, path: str, *, async_save: bool = False, **save_kwargs: Any
) -> SaveResult | PendingSave:
    """Save the accelerator's model(s), optimizer(s), scheduler(s), scaler, RNG and custom objects.

    Collective: every process calls it with the same ``path``; each writes its own shards
    (replicated weights once, the writing spread over the processes).

    Args:
        accelerator: an ``Accelerator`` after ``prepare``.
        path: checkpoint directory or URL (replaced atomically if it exists).
        async_save: return once the state is staged in host memory (:func:`tessera.async_save`);
            call ``.wait()`` on the result before relying on the checkpoint.
        **save_kwargs: passed to :func:`tessera.save` (``options``, ``storage_options``, ...).

    Returns:
        this process's :class:`tessera.SaveResult`, or a :class:`tessera.PendingSave`.

    Example:
        >>> model, opt, sched = accelerator.prepare(model, opt, sched)
        >>> save_state(accelerator, "ckpt/step-100")
    """
    t0 = time.monotonic()
    state = training_state(accelerator)
    result: SaveResult | PendingSave
    if async_save:
        result = api.async_save(path, state, **save_kwargs)
        result.wait_staged()  # raw state dicts: nothing else holds the loop back until staged
    else:
        result = api.save(path, state, **save_kwargs)
    if accelerator.is_main_process:
        logger.info(
            "%s accelerator state to %s in %.2fs", "staged" if async_save else "saved", path, time.monotonic() - t0
        )
    # Accelerate counts saves (for its automatic checkpoint naming); keep counting.
    accelerator.project_configuration.iteration += 1
    return result


def load_state(accelerator: Accelerator, path: str, *, strict: bool = True, **load_kwargs: Any) -> LoadResult:
    """Load a :func:`save_state` checkpoint into the prepared objects, in place, on any process count.

    Collective: every process calls it. The optimizers may be fresh (never stepped). Under
    another process count the RNG states stay as they are (``RNGState``'s default policy).

    Args:
        accelerator: an ``Accelerator`` after ``prepare``, with the same models, optimizers,
            schedulers and registered objects as the saving job.
        path: checkpoint directory or URL.
        strict: missing or unexpected keys are errors.
        **load_kwargs: passed to :func:`tessera.load`.

    Raises:
        StateMismatchError: if the job's objects do not match the checkpoint.

    Example:
        >>> model, opt, sched = accelerator.prepare(model, opt, sched)
        >>> load_state(accelerator, "ckpt/step-100")
    """
    t0 = time.monotonic()
    state = training_state(accelerator)
    result = api.load(path, state, strict=strict, **load_kwargs)
    accelerator.step = int(state["step"])
    accelerator.project_configuration.iteration = int(state["iteration"]) + 1
    if accelerator.is_main_process:
        logger.info("loaded accelerator state from %s in %.2fs", path, time.monotonic() - t0)
    return result


def _owner(models: list[nn.Module], optimizer: torch.optim.Optimizer, index: int) -> nn.Module:
    """The one prepared model whose parameters ``optimizer`` trains."""
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    owners = [m for m in models if any(id(p) in ids for p in m.parameters())]
    if len(owners) != 1:
        raise StateMismatchError(
            f"optimizer {index} trains parameters of {len(owners)} prepared models; tessera needs exactly one "
            "model per optimizer to key its state by parameter name (prepare the model with its optimizer)"
        )
    return owners[0]
