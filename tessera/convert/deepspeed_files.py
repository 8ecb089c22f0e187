"""Finding and reading DeepSpeed ZeRO checkpoint files, without DeepSpeed and without unpickling code.

:func:`find_zero_dir` resolves a checkpoint directory (or its parent with a ``latest``
file); :func:`state_files` lists its per-rank ``*_optim_states.pt`` / ``*_model_states.pt``
files; :func:`load_file` reads one with ``torch.load(weights_only=True)`` and
:data:`SAFE_GLOBALS`, plain stand-ins for the few DeepSpeed classes a checkpoint holds.
The conversion itself is :mod:`.deepspeed`.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ..errors import CheckpointError
from .safe_pickle import SafeGlobal, torch_load_restricted

__all__ = ["SAFE_GLOBALS", "find_zero_dir", "load_file", "state_files"]

_RANK = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_(optim|model)_states\.pt$")
"""Entries of a model-states file that are converted as tensors (or are empty); the rest
are kept as plain values under ``deepspeed.<key>`` when they are plain."""


def find_zero_dir(src: str, tag: str | None = None) -> str:
    """The directory holding the ``*_states.pt`` files (following ``latest`` if present).

    Raises:
        FileNotFoundError: if no ZeRO checkpoint is found.

    Example:
        >>> find_zero_dir("/runs/gpt/checkpoints")  # ".../global_step1000" from "latest"
    """
    if tag is not None:
        src = os.path.join(src, tag)
    elif not state_files(src, "optim") and os.path.isfile(os.path.join(src, "latest")):
        with open(os.path.join(src, "latest")) as f:
            src = os.path.join(src, f.read().strip())
    if not state_files(src, "optim"):
        raise FileNotFoundError(f"no DeepSpeed ZeRO checkpoint in {src}: no *_optim_states.pt files")
    return src


def state_files(directory: str, kind: str) -> list[tuple[int, str]]:
    """``(dp rank, path)`` of the ``*_<kind>_states.pt`` files, by rank."""
    if not os.path.isdir(directory):
        return []
    out = []
    for name in os.listdir(directory):
        m = _RANK.search(name)
        if m and m.group(3) == kind:
            if int(m.group(2)) != 0:
                raise CheckpointError(
                    f"{os.path.join(directory, name)}: tensor-parallel ZeRO checkpoints (mp_rank > 0) are not "
                    "supported here; convert the Megatron layout with --from megatron"
                )
            out.append((int(m.group(1)), os.path.join(directory, name)))
    return sorted(out)


class _DeepSpeedObject:
    """An object of a DeepSpeed class, read back as its attributes and nothing else.

    DeepSpeed pickles a few of its own objects into every checkpoint (the loss scaler, the
    optimizer's fragment map). ``weights_only`` unpickling builds these stand-ins instead of
    importing and running DeepSpeed's classes: the attributes arrive as plain values, so the
    files load without ``allow_pickle`` and without DeepSpeed installed.
    """

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


class LossScaler(_DeepSpeedObject):
    """``deepspeed.runtime.fp16.loss_scaler.LossScaler`` (``cur_scale``, ``dynamic``)."""


class DynamicLossScaler(_DeepSpeedObject):
    """``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler`` (fp16 with dynamic loss scaling)."""


class FragmentAddress(_DeepSpeedObject):
    """``deepspeed.utils.tensor_fragment.fragment_address`` (``numel``, ``start``)."""


class Namespace(_DeepSpeedObject):
    """``argparse.Namespace``: the launcher's arguments that Megatron-DeepSpeed jobs save as ``args``."""


def _zero_stage(value: int) -> int:
    """``deepspeed.runtime.zero.config.ZeroStageEnum(value)``, read as the stage number."""
    return int(value)


SAFE_GLOBALS: list[SafeGlobal] = [
    (LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
    (_zero_stage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (Namespace, "argparse.Namespace"),
]
"""The classes that DeepSpeed's own checkpoint files contain, each read as a plain stand-in;
``torch.load(weights_only=True)`` allows exactly these besides torch's defaults. Anything else
in a file still needs ``allow_pickle=True``."""


def load_file(path: str, allow_pickle: bool) -> Any:
    """A DeepSpeed ``*.pt`` file: safe unpickling with :data:`SAFE_GLOBALS`, or full unpickling if allowed.

    Raises:
        PickleNotAllowedError: the file holds objects outside DeepSpeed's usual contents.
    """
    return torch_load_restricted(path, SAFE_GLOBALS, allow_pickle=allow_pickle, what="DeepSpeed checkpoint file")
