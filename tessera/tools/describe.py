"""What is at a path: a checkpoint, a manager's root of steps, a Hugging Face directory, ...

The ``tessera`` command's ``inspect`` and ``verify`` start here, so that pointing them at a
``CheckpointManager`` root or at an exported Hugging Face directory gets an answer about
what is there, not "manifest.json is missing". Also the JSON description ``tessera inspect
--json`` prints, and the model-prefix detection of ``tessera convert --to hf``.

Everything here runs in one process, only reads storage, and never communicates.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..engine.loading.path_report import PathKind, PathReport, examine_path
from ..engine.saving.tile_index import shared_dir
from ..format.manifest import MANIFEST_NAME, Manifest
from ..format.names import is_shared_ref, parse_step_dirname
from ..format.safetensors_header import read_file_header, tensor_entries
from ..storage import storage_for

__all__ = [
    "HFDirectory",
    "PathKind",
    "PathReport",
    "StepInfo",
    "classify_path",
    "describe_hf",
    "detect_model_prefix",
    "examine_path",
    "inspect_data",
    "list_steps",
]

_OPTIM_GROUPS = frozenset({"optim", "optimizer", "optimizers", "opt", "optim_state", "optimizer_state"})
_OPTIM_LEAVES = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta", "sum")


@dataclass(frozen=True)
class StepInfo:
    """One step directory under a manager root.

    Attributes:
        step: the step number.
        path: the step's checkpoint path.
        committed: whether it has a ``manifest.json``.
        latest: whether the ``latest`` pointer names it.
    """

    step: int
    path: str
    committed: bool
    latest: bool = False


@dataclass(frozen=True)
class HFDirectory:
    """A Hugging Face safetensors directory, from its file headers (no tensor data is read).

    Attributes:
        path: the directory (or file).
        files: the safetensors files.
        tensors: number of tensors.
        total_bytes: bytes of tensor data.
        dtypes: ``{safetensors dtype code: number of tensors}``.
        architectures: ``config.json``'s ``architectures`` (empty if there is no config).
        model_type: ``config.json``'s ``model_type``, if any.
    """

    path: str
    files: list[str]
    tensors: int
    total_bytes: int
    dtypes: dict[str, int] = field(default_factory=dict)
    architectures: list[str] = field(default_factory=list)
    model_type: str | None = None


def classify_path(path: str, storage_options: dict[str, Any] | None = None) -> PathKind:
    """What is at ``path``; only lists and reads small files (see :func:`examine_path`, whose
    message every "not found" of tessera gives).

    Example:
        >>> classify_path("/ckpt/run1")
        <PathKind.MANAGER_ROOT: 'manager_root'>
    """
    return examine_path(path, storage_options=storage_options).kind


def list_steps(root: str, storage_options: dict[str, Any] | None = None) -> list[StepInfo]:
    """Every step directory under a manager root, committed or not, oldest first.

    Example:
        >>> [s.step for s in list_steps("/ckpt/run1") if s.committed]
        [300, 400, 500]
    """
    from ..manager import LATEST_NAME, parse_step_dirname, step_dirname
    from ..storage import storage_for
    from ..storage.capabilities import Closable

    store = storage_for(root, storage_options=storage_options)
    try:
        found: dict[int, bool] = {}
        for rel in store.list(""):
            head, _, rest = rel.partition("/")
            step = parse_step_dirname(head)
            if step is not None and rest:
                found[step] = found.get(step, False) or rest == MANIFEST_NAME
        try:
            pointer = parse_step_dirname(store.read_file(LATEST_NAME).decode("utf-8", "replace").strip())
        except FileNotFoundError:
            pointer = None
    finally:
        if isinstance(store, Closable):
            store.close()
    join = (lambda name: root + name) if root.endswith("/") else (lambda name: f"{root}/{name}")
    return [StepInfo(s, join(step_dirname(s)), c, s == pointer) for s, c in sorted(found.items())]


def describe_hf(path: str) -> HFDirectory:
    """Summarise a Hugging Face safetensors directory from its headers and ``config.json``.

    Raises:
        FileNotFoundError: if there is no safetensors file.
        ValueError: if a header is not valid safetensors.

    Example:
        >>> describe_hf("/export/hf").architectures
        ['LlamaForCausalLM']
    """
    from ..hf_export.files import hf_files

    files = hf_files(path)
    tensors = 0
    total = 0
    dtypes: dict[str, int] = {}
    for f in files:
        header, _ = read_file_header(f)
        for entry in tensor_entries(header).values():
            tensors += 1
            start, stop = entry["data_offsets"]
            total += stop - start
            dtypes[entry["dtype"]] = dtypes.get(entry["dtype"], 0) + 1
    config: dict[str, Any] = {}
    cfg = os.path.join(path, "config.json") if os.path.isdir(path) else None
    if cfg and os.path.isfile(cfg):
        with open(cfg) as fh:
            try:
                config = json.load(fh)
            except json.JSONDecodeError:
                config = {}
    return HFDirectory(
        path, [os.path.basename(f) for f in files], tensors, total, dtypes,
        list(config.get("architectures") or []), config.get("model_type"),
    )  # fmt: skip


def detect_model_prefix(names: list[str]) -> tuple[str | None, str]:
    """The prefix of a model's tensors among a checkpoint's tensor names, for an export.

    A training checkpoint holds the model beside its optimizer state; exporting a model
    must take only the former. The rule, on the first component of each name (the
    top-level key of the saved state):

    * no optimizer state (no ``optim.``/``optimizer.`` group, no ``exp_avg``-like
      tensors): nothing to leave out, every tensor is exported (``""``) -- except when all
      of them sit under one ``model.`` group, where stripping it or not cannot be guessed;
    * optimizer state and a ``model`` group: ``"model."``;
    * optimizer state and exactly one other group: that group;
    * otherwise the prefix cannot be told: ``None``.

    Returns:
        ``(prefix, why)``: the prefix (``""`` for every tensor, ``None`` when the caller
        must choose) and a sentence saying why.

    Example:
        >>> detect_model_prefix(["model.w", "optim.state.w.exp_avg"])
        ('model.', "the model's tensors are under 'model.'; 'optim.' (optimizer state) is left out")
    """
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(n.split(".", 1)[0] if "." in n else "", []).append(n)
    optim = sorted(
        g for g, members in groups.items()
        if g in _OPTIM_GROUPS or (g and all(m.rsplit(".", 1)[-1] in _OPTIM_LEAVES + ("step",) for m in members))
    )  # fmt: skip
    optim_like = optim or any(n.rsplit(".", 1)[-1] in _OPTIM_LEAVES[:4] for n in names)
    listing = ", ".join(f"'{g}.'" if g else "(top level)" for g in sorted(groups))
    if not optim_like:
        if set(groups) == {"model"}:
            return None, (
                "every tensor is under 'model.': pass --prefix model. to export them without it (a training "
                "checkpoint's model), or --prefix '' to keep the names as they are"
            )
        return "", "the checkpoint holds no optimizer state; every tensor is exported"
    left = ", ".join(f"'{g}.'" for g in optim) or "optimizer state"
    if "model" in groups:
        return "model.", f"the model's tensors are under 'model.'; {left} (optimizer state) is left out"
    others = [g for g in groups if g not in optim and g]
    if len(others) == 1 and "" not in groups:
        return f"{others[0]}.", f"the model's tensors are under '{others[0]}.'; {left} (optimizer state) is left out"
    return (
        None,
        f"the checkpoint holds optimizer state and the model's prefix is not clear (groups: {listing}); pass --prefix",
    )


def _stored_bytes(m: Manifest, tiles: Any) -> int:
    """Bytes ``tiles`` take in their files: their frames' in compressed files, their own in others."""
    frames = {f.path: f.frames for f in m.files if f.frames is not None}
    total = 0
    for t in tiles:
        table = frames.get(t.file)
        total += t.nbytes if table is None else table.stored_bytes(t.byte_offset, t.byte_offset + t.nbytes)
    return total


def _step_of(m: Manifest, path: str) -> int | None:
    import re

    for source in (m.metadata, m.values):
        v = source.get("step")
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    match = re.search(r"step-(\d+)/?$", path)
    return int(match.group(1)) if match else None


def inspect_data(path: str) -> dict[str, Any]:
    """A JSON-ready description of a checkpoint (what ``tessera inspect --json`` prints).

    Raises:
        CheckpointNotFoundError: if ``path`` holds no committed checkpoint.

    Example:
        >>> inspect_data("/ckpt/step100")["tensors"][0]["name"]
        'model.embed.weight'
    """
    from ..api import read_manifest

    m = read_manifest(path)
    policies = m.metadata.get("tensor_policies") or {}
    stored = {n: _stored_bytes(m, e.tiles) for n, e in m.tensors.items()}
    return {
        "path": path,
        "save_id": m.save_id,
        "format_version": m.version,
        "created": m.metadata.get("created"),
        "step": _step_of(m, path),
        "world_size": m.world_size,
        "layout": m.layout,
        "total_bytes": m.total_bytes,
        "stored_bytes": sum(stored.values()),
        "files": len(m.files),
        "chunk_bytes": m.chunk_bytes,
        "chunking": m.tile_chunking.to_json(),
        "tensors": [
            {
                "name": n,
                "dtype": e.dtype,
                "shape": list(e.shape),
                "tiles": len(e.tiles),
                "bytes": sum(t.nbytes for t in e.tiles),
                "stored_bytes": stored[n],
                **({"per_rank": policies[n]} if n in policies else {}),
            }
            for n, e in m.tensors.items()
        ],
        "values": m.values,
        "per_rank": {k: {"on_resize": v.on_resize, "values": list(v.by_rank)} for k, v in m.per_rank.items()},
        "metadata": {k: v for k, v in m.metadata.items() if k != "tensor_policies"},
        "sharing": sharing(m, path),
    }


def sharing(m: Manifest, path: str) -> dict[str, Any] | None:
    """How a step of a dedup root shares tiles: its own bytes, and the bytes of each earlier save it uses.

    Returns:
        None for a self-contained checkpoint, else ``{"own_bytes", "shared_bytes", "from":
        [{"save_id", "step", "bytes"}, ...]}`` (``step`` None when no step of the root has that save).
    """
    by_dir: dict[str, int] = {}
    for entry in m.tensors.values():
        table = entry.table
        sizes = np.bincount(table.file, weights=table.nbytes, minlength=len(table.paths)).tolist() if len(table) else []
        for p, n in zip(table.paths, sizes):
            key = shared_dir(p) if is_shared_ref(p) else m.save_id
            by_dir[key] = by_dir.get(key, 0) + int(n)
    if set(by_dir) <= {m.save_id}:
        return None
    steps = _steps_by_save_id(path)
    others = sorted((k for k in by_dir if k != m.save_id), key=lambda k: (steps.get(k, -1), k))
    return {
        "own_bytes": by_dir.get(m.save_id, 0),
        "shared_bytes": sum(by_dir[k] for k in others),
        "from": [{"save_id": k, "step": steps.get(k), "bytes": by_dir[k]} for k in others],
    }


def _steps_by_save_id(path: str) -> dict[str, int]:
    """The steps beside ``path`` (a manager root's), by the id of the save that committed them."""
    from ..engine.loading.manifest import read_manifest_files

    parent = path.rstrip("/").rpartition("/")[0] or "."
    found: dict[str, int] = {}
    try:
        names = {rel.split("/", 1)[0] for rel in storage_for(parent).list("")}
    except Exception:
        return found
    for name in names:
        step = parse_step_dirname(name)
        if step is None:
            continue
        try:
            url = f"{parent}/{name}"  # only the save id: the file list, not every tensor, is decoded
            found[read_manifest_files(storage_for(url), url)[0]] = step
        except Exception:
            continue
    return found
