"""Convert checkpoints between tessera and other formats, streaming with bounded memory.

Export a tessera checkpoint (saved by any number of ranks, in any layout):

* :func:`export_hf` - a Hugging Face safetensors directory (``from_pretrained`` loads it);
* :func:`export_torch_save` - one ``torch.save`` file;
* :func:`export_dcp` - a PyTorch Distributed Checkpoint (``torch.distributed.checkpoint.load``);
* :func:`export_deepspeed_universal` - a DeepSpeed universal checkpoint (``load_universal``).

Import into a new tessera checkpoint:

* :func:`import_hf`, :func:`import_torch_save`, :func:`import_dcp`;
* :func:`import_deepspeed` - DeepSpeed ZeRO stage 1/2/3 checkpoints;
* :func:`import_megatron` - Megatron TP x PP rank files, described by a layout spec
  (:mod:`tessera.adapters.megatron`).

Tools on tessera checkpoints: :func:`diff_checkpoints` (compare two, block by block) and
:func:`rename_tensors` (rename by rewriting the manifest only).

Every function runs in one process, never communicates, and is safe to call from one rank
of a training job (e.g. to export on the fly). Tensors move block by block: neither side is
ever held in memory whole. The ``tessera convert`` command is a thin layer over these.

Example:
    >>> from tessera.convert import export_hf
    >>> export_hf("/ckpt/step100", "/export/hf", prefix="model.", max_shard_size="2GB")
"""

from __future__ import annotations

import os
from enum import Enum

from ..errors import CheckpointNotFoundError
from ..format.dtypes import parse_dtype
from ..format.names import parse_step_dirname
from ..options import parse_size
from ._common import ConvertResult
from .compare import DiffKind, DiffReport, EntryDiff, diff_checkpoints
from .dcp import export_dcp, import_dcp
from .deepspeed import import_deepspeed
from .deepspeed_universal import export_deepspeed_universal
from .hf import export_hf, import_hf
from .megatron import import_megatron, import_torch_dist, is_torch_dist, load_spec
from .rename import RenameRule, rename_tensors
from .torch_save import export_torch_save, import_torch_save


class Format(str, Enum):
    """Checkpoint formats ``tessera convert`` reads or writes."""

    TESSERA = "tessera"
    HF = "hf"
    DCP = "dcp"
    TORCH = "torch"
    DEEPSPEED = "deepspeed"
    MEGATRON = "megatron"


def detect_format(path: str) -> Format:
    """Guess the format of the checkpoint at ``path`` from the files it holds.

    Raises:
        CheckpointNotFoundError: if nothing is there, only an unfinished save, or a folder of
            step directories (the message says which, as ``tessera.load`` does).
        ValueError: if nothing recognisable is there.

    Example:
        >>> detect_format("/ckpt/step100")
        <Format.TESSERA: 'tessera'>
    """
    if os.path.isfile(path):
        if path.endswith(".safetensors"):
            return Format.HF
        if path.endswith((".pt", ".pth", ".bin")):
            return Format.TORCH
        raise ValueError(f"cannot tell the format of file {path}; pass --from")
    if "://" in path or os.path.isfile(os.path.join(path, "manifest.json")):
        return Format.TESSERA
    if is_torch_dist(path):  # Megatron-Core's torch_dist: DCP files plus common.pt and metadata.json
        return Format.MEGATRON
    if os.path.isfile(os.path.join(path, ".metadata")):
        return Format.DCP
    if os.path.isdir(path):
        names = os.listdir(path)
        steps = sorted(n for n in names if parse_step_dirname(n) is not None)
        if any(os.path.isfile(os.path.join(path, n, "manifest.json")) for n in steps):
            # A CheckpointManager root: its `latest` pointer must not pass for DeepSpeed's.
            raise ValueError(
                f"{path} is a tessera CheckpointManager root, not one checkpoint; name a step: "
                f"{os.path.join(path, steps[-1])} (on the command line also {path}@STEP, or the root for its latest step)"
            )
        if any(n.endswith(".safetensors") or n == "model.safetensors.index.json" for n in names):
            return Format.HF
        if any(n.endswith("_optim_states.pt") for n in names) or "latest" in names:
            return Format.DEEPSPEED
        if "latest_checkpointed_iteration.txt" in names or any(n.startswith("mp_rank_") for n in names):
            return Format.MEGATRON
    from ..engine.loading.path_report import PathKind, examine_path

    report = examine_path(path)
    if report.kind in (PathKind.MISSING, PathKind.INCOMPLETE, PathKind.STRAY_STEPS):
        raise CheckpointNotFoundError(report.message())  # what tessera.load says for the same path
    raise ValueError(
        f"cannot tell the format of {path} (no manifest.json, .metadata, *.safetensors or ZeRO files); pass --from"
    )


__all__ = [
    "ConvertResult",
    "DiffKind",
    "DiffReport",
    "EntryDiff",
    "Format",
    "RenameRule",
    "detect_format",
    "diff_checkpoints",
    "export_dcp",
    "export_deepspeed_universal",
    "export_hf",
    "export_torch_save",
    "import_dcp",
    "import_deepspeed",
    "import_hf",
    "import_megatron",
    "import_torch_dist",
    "import_torch_save",
    "load_spec",
    "parse_dtype",
    "parse_size",
    "rename_tensors",
]
