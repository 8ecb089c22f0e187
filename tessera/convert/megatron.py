"""Megatron-style TP x PP checkpoint files -> tessera, driven by a layout spec.

Megatron's (non-distributed) checkpoints hold one file per tensor- and pipeline-parallel rank::

    <root>/latest_checkpointed_iteration.txt      "100" (or "release")
    <root>/iter_0000100/mp_rank_<tp:02d>/model_optim_rng.pt            (PP = 1)
    <root>/iter_0000100/mp_rank_<tp:02d>_<pp:03d>/model_optim_rng.pt   (PP > 1)
    <root>/iter_0000100/mp_rank_<tp:02d>[_<pp:03d>]_<ep:03d>/...      (EP > 1; with PP = 1 pass expert_parallel=True)

each a dict whose ``"model"`` entry is that rank's local state dict (fused QKV, padded
vocabulary, layers numbered per stage). A :class:`~tessera.adapters.megatron.MegatronSpec`
(for Megatron-core GPT models: :func:`~tessera.adapters.megatron.gpt_spec`) says how each
local tensor maps to boxes of global tensors; this module applies it file by file (one rank's
file memory-mapped at a time), writes every box once (TP replicas are written by the first
rank that holds them) and checks that every global tensor is covered exactly once.

Optimizer state in these files is keyed by parameter index, not name, and is not converted
(listed in ``skipped``); ``iteration`` and ``checkpoint_version`` become plain values.

:func:`import_torch_dist` (Megatron-Core's own distributed format) is
:mod:`.megatron_torch_dist`, re-exported here.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import time
from collections.abc import Mapping
from typing import Any

import torch

from ..adapters.megatron import MegatronSpec, gpt_spec
from ..errors import CorruptCheckpointError
from ..format.dtypes import cast_for
from ..format.geometry import Box
from ..format.values import is_plain
from ..storage import Storage
from ._common import ConvertResult, Progress, ProgressFn
from .megatron_torch_dist import TRACKER, import_torch_dist, is_torch_dist
from .safe_pickle import torch_load_restricted
from .writer import CheckpointWriter

logger = logging.getLogger(__name__)

__all__ = ["TRACKER", "find_rank_files", "import_megatron", "import_torch_dist", "is_torch_dist", "load_spec"]

_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def load_spec(text: str) -> MegatronSpec:
    """A layout spec from a JSON file (``{"gpt": {gpt_spec keyword arguments}}``) or ``module:attr``.

    ``module:attr`` names a :class:`MegatronSpec` or a function returning one.

    Raises:
        ValueError: if ``text`` names neither.

    Example:
        >>> load_spec("spec.json")  # {"gpt": {"num_layers": 4, "vocab_size": 37, ...}}
        >>> load_spec("mypkg.layouts:SPEC")
    """
    if os.path.isfile(text):
        with open(text) as f:
            doc = json.load(f)
        if not isinstance(doc, dict) or set(doc) != {"gpt"} or not isinstance(doc["gpt"], dict):
            raise ValueError(f'layout spec {text}: expected {{"gpt": {{...gpt_spec arguments...}}}}')
        try:
            return gpt_spec(**doc["gpt"])
        except TypeError as e:
            raise ValueError(f"layout spec {text}: {e}") from e
    module, sep, attr = text.partition(":")
    if not sep:
        raise ValueError(f"layout spec {text!r} is neither a JSON file nor 'module:attribute'")
    obj = getattr(importlib.import_module(module), attr)
    if not isinstance(obj, MegatronSpec) and callable(obj):
        obj = obj()
    if not isinstance(obj, MegatronSpec):
        raise ValueError(f"{text} is a {type(obj).__name__}, not a MegatronSpec")
    return obj


def find_rank_files(src: str, *, expert_parallel: bool = False) -> tuple[str, dict[tuple[int, int, int], str]]:
    """The iteration directory and ``{(tp_rank, pp_rank, ep_rank): file}`` of a Megatron checkpoint.

    Megatron-LM names rank directories ``mp_rank_<tp>``, ``mp_rank_<tp>_<pp>`` (PP > 1),
    ``mp_rank_<tp>_<ep>`` (EP > 1, PP = 1) and ``mp_rank_<tp>_<pp>_<ep>``. A name with two
    numbers is TP and PP unless ``expert_parallel`` says the second one is the EP rank.

    Raises:
        FileNotFoundError: if no ``mp_rank_*`` directory is found.
        CorruptCheckpointError: if some TP x PP x EP rank's file is missing.

    Example:
        >>> directory, files = find_rank_files("/runs/gpt/checkpoints")
        >>> files[(0, 1, 0)]  # ".../iter_0000100/mp_rank_00_001/model_optim_rng.pt"
    """
    tracker = os.path.join(src, TRACKER)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            it = f.read().strip()
        src = os.path.join(src, "release" if it == "release" else f"iter_{int(it):07d}")
    files: dict[tuple[int, int, int], str] = {}
    for name in sorted(os.listdir(src)) if os.path.isdir(src) else []:
        m = _RANK_DIR.match(name)
        if not m:
            continue
        d = os.path.join(src, name)
        pts = sorted(n for n in os.listdir(d) if n.endswith(".pt") and n != "distrib_optim.pt")
        if not pts:
            continue
        pick = "model_optim_rng.pt" if "model_optim_rng.pt" in pts else pts[0]
        tp_rank, second, third = int(m.group(1)), int(m.group(2) or 0), m.group(3)
        if third is not None:
            key = (tp_rank, second, int(third))
        else:
            key = (tp_rank, 0, second) if expert_parallel else (tp_rank, second, 0)
        files[key] = os.path.join(d, pick)
    if not files:
        raise FileNotFoundError(f"no Megatron checkpoint in {src}: no mp_rank_* directories with a .pt file")
    tp, pp, ep = (max(k[i] for k in files) + 1 for i in range(3))
    missing = [(t, p, e) for t in range(tp) for p in range(pp) for e in range(ep) if (t, p, e) not in files]
    if missing:
        raise CorruptCheckpointError(
            f"{src}: the files of TP x PP x EP ranks {missing} are missing (found TP={tp}, PP={pp}, EP={ep})"
        )
    return src, files


def _flatten(sd: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in sd.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, name + "."))
        else:
            out[name] = v
    return out


def import_megatron(
    src: str,
    path: str,
    *,
    spec: MegatronSpec | str,
    prefix: str = "model.",
    model_key: str = "model",
    dtype: torch.dtype | None = None,
    storage: Storage | None = None,
    allow_pickle: bool = False,
    file_bytes: int = 256 << 20,
    progress: ProgressFn | None = None,
    expert_parallel: bool = False,
) -> ConvertResult:
    """Convert Megatron TP x PP (x EP) rank files into one tessera checkpoint of global tensors.

    Args:
        src: the checkpoint root (with ``latest_checkpointed_iteration.txt``) or an
            ``iter_*`` directory.
        path: where to write the tessera checkpoint (replaced atomically).
        spec: the layout (a :class:`MegatronSpec`, or a string for :func:`load_spec`).
        prefix: prepended to the global parameter names.
        model_key: the entry of each file holding the local model state dict.
        dtype: cast floating-point tensors to this dtype.
        storage: backend of the new checkpoint.
        allow_pickle: unpickle arbitrary objects in the files (Megatron stores ``args`` as
            an ``argparse.Namespace``; only for files you trust).
        file_bytes: size of the tessera data files written.
        progress: called with ``(done_bytes, total_bytes)`` (total: bytes of the local tensors).
        expert_parallel: rank directories ``mp_rank_<tp>_<n>`` number EP ranks, not PP
            stages (Megatron-LM's names for EP > 1 with PP = 1). Experts are split by the
            expert-tensor-parallel rank, taken to be the TP rank (Megatron's default).

    Returns:
        What was written; entries not converted are listed in ``skipped``.

    Raises:
        FileNotFoundError: if ``src`` holds no rank files.
        StateMismatchError: a local tensor that no rule of the spec explains, or that does
            not fit its rule under the checkpoint's TP size.
        CoverageError: if the ranks' boxes leave part of a global tensor uncovered.
        StateMismatchError: also when the spec's expert count is not divisible by the EP size.

    Example:
        >>> spec = gpt_spec(num_layers=24, vocab_size=50257, num_attention_heads=16, kv_channels=64)
        >>> import_megatron("/runs/gpt/checkpoints", "/ckpt/gpt-iter100", spec=spec)
    """
    t0 = time.monotonic()
    spec = load_spec(spec) if isinstance(spec, str) else spec
    directory, files = find_rank_files(src, expert_parallel=expert_parallel)
    tp, pp, ep = (max(k[i] for k in files) + 1 for i in range(3))
    skipped: list[str] = []
    prog = Progress(sum(os.path.getsize(f) for f in files.values()), progress)
    with CheckpointWriter(path, storage=storage, file_bytes=file_bytes) as w:
        for (tp_rank, pp_rank, ep_rank), fname in sorted(files.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
            sd = _load(fname, allow_pickle)
            local = sd.get(model_key)
            if not isinstance(local, Mapping):
                extra = " (virtual pipeline chunks 'model0', 'model1'... are not supported)" if "model0" in sd else ""
                raise CorruptCheckpointError(f"{fname}: no '{model_key}' state dict{extra}")
            local = {
                k: v for k, v in _flatten(local).items() if isinstance(v, torch.Tensor) or k.endswith("_extra_state")
            }
            for gname, st in spec.to_global(local, tp_rank, tp, pp_rank, pp, ep_rank=ep_rank, ep_size=ep).items():
                data = st.local.to(cast_for(st.local.dtype, dtype))
                w.add(prefix + gname, st.global_shape, Box(st.global_offset, tuple(st.local.shape)), data, replica=True)
                prog.advance(data.numel() * data.element_size())
            if (tp_rank, pp_rank, ep_rank) == (0, 0, 0):
                for key in ("iteration", "checkpoint_version"):
                    if key in sd and is_plain(sd[key]):
                        w.add_value(key, sd[key])
                skipped += [
                    f"{k} (not converted)" for k in sd if k not in (model_key, "iteration", "checkpoint_version")
                ]
            del sd, local
        layout = {"format": "megatron", "tensor_parallel": tp, "pipeline_parallel": pp}
        if ep > 1:
            layout["expert_parallel"] = ep
        w.commit(source=f"megatron:{directory}", layout=layout)
        counts = (w.tensors_declared, w.values_added, w.tensor_bytes, w.files_written)
    logger.info("converted Megatron checkpoint %s (TP=%d, PP=%d, EP=%d) into %s", directory, tp, pp, ep, path)
    return ConvertResult(src, path, *counts, time.monotonic() - t0, tuple(skipped))


def _load(path: str, allow_pickle: bool) -> dict:
    sd = torch_load_restricted(path, [], allow_pickle=allow_pickle, what="Megatron checkpoint file")
    if not isinstance(sd, dict):
        raise CorruptCheckpointError(f"{path} holds a {type(sd).__name__}, not a Megatron checkpoint dict")
    return sd
