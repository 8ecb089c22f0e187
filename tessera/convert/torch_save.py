"""A single ``torch.save`` file: export a tessera checkpoint to one, import one.

Export writes ``{name: tensor, ..., name: plain value}`` (flat FQN keys, loadable with
``torch.load(f, weights_only=True)``; with ``prefix="model."`` the dict goes straight into
``model.load_state_dict``). ``torch.save`` pickles one object, so to keep memory bounded
each tensor is assembled in a memory-mapped scratch file next to the output (block by
block, straight from tessera's reader) and ``torch.save`` streams from those mappings: the
process never holds more than ``block_bytes`` of anonymous memory per tensor; the page
cache does the rest. The file is written under a temporary name and renamed into place.

Import maps the file with ``torch.load(mmap=True)`` and streams row blocks of every tensor
into a new tessera checkpoint.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from typing import Any

import torch

from ..format.dtypes import cast_for, itemsize
from ..format.geometry import Box, split_box
from ..format.names import strip_prefix
from ..format.values import encode_value
from ..storage import Storage
from ._common import DEFAULT_BLOCK_BYTES, ConvertResult, Progress, ProgressFn, numel
from .reader import CheckpointReader
from .writer import CheckpointWriter

logger = logging.getLogger(__name__)


def export_torch_save(
    path: str,
    out_file: str,
    *,
    prefix: str | None = None,
    dtype: torch.dtype | None = None,
    storage: Storage | None = None,
    include_values: bool = True,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    progress: ProgressFn | None = None,
) -> ConvertResult:
    """Export a tessera checkpoint as one ``torch.save`` file of a flat ``{name: value}`` dict.

    Args:
        path: the tessera checkpoint.
        out_file: the file to write (a local path; replaced atomically).
        prefix: export only names under ``prefix``, without it.
        dtype: cast floating-point tensors to this dtype.
        storage: backend of the checkpoint.
        include_values: also store the plain values.
        block_bytes: most bytes read at once.
        progress: called with ``(done_bytes, total_bytes)``.

    Returns:
        What was written; values that need pickle and per-rank values are listed in ``skipped``.

    Raises:
        ValueError: if nothing matches ``prefix``.

    Example:
        >>> export_torch_save("/ckpt/step100", "/export/model.pt", prefix="model.")
        >>> model.load_state_dict(torch.load("/export/model.pt", weights_only=True))
    """
    t0 = time.monotonic()
    src = CheckpointReader(path, storage=storage)
    names = strip_prefix(list(src.manifest.tensors), prefix)
    values, skipped = src.values() if include_values else ({}, [])
    kept_values = strip_prefix(list(values), prefix)
    if not names and not kept_values:
        raise ValueError(f"checkpoint {path} has nothing{f' under prefix {prefix!r}' if prefix else ''} to export")
    out_file = os.path.abspath(out_file)
    directory = os.path.dirname(out_file)
    os.makedirs(directory, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".tessera-export-", dir=directory)
    tmp_out = os.path.join(scratch, "out.pt")
    total = sum(numel(src.shape(f)) * itemsize(cast_for(src.dtype(f), dtype)) for f in names.values())
    prog = Progress(total, progress)
    try:
        state: dict[str, Any] = {}
        for i, (name, fqn) in enumerate(names.items()):
            dt = cast_for(src.dtype(fqn), dtype)
            shape = src.shape(fqn)
            n = numel(shape)
            if n == 0:
                state[name] = torch.empty(shape, dtype=dt)
                continue
            flat = torch.from_file(os.path.join(scratch, f"{i}.bin"), shared=True, size=n, dtype=dt)
            target = flat.view(shape)
            for box in split_box(Box.whole(shape), max(itemsize(dt), itemsize(src.dtype(fqn))), block_bytes):
                src.read(fqn, box, out=target[box.slices()] if shape else target)
                prog.advance(box.numel * itemsize(dt))
            state[name] = target
        for name, key in kept_values.items():
            state[name] = values[key]
        torch.save(state, tmp_out)
        del state
        os.replace(tmp_out, out_file)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    logger.info("exported %d tensors (%d bytes) from %s to %s", len(names), total, path, out_file)
    return ConvertResult(
        path, out_file, len(names), len(kept_values), total, 1, time.monotonic() - t0,
        src.left_out(skipped, prefix),
    )  # fmt: skip


def import_torch_save(
    src: str,
    path: str,
    *,
    prefix: str | None = None,
    dtype: torch.dtype | None = None,
    storage: Storage | None = None,
    allow_pickle: bool = False,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    file_bytes: int = 256 << 20,
    progress: ProgressFn | None = None,
) -> ConvertResult:
    """Import a ``torch.save`` file (a possibly nested dict of tensors and values) into tessera.

    Nested keys join with dots, as in :func:`tessera.save`.

    Args:
        src: the file.
        path: where to write the tessera checkpoint (replaced atomically).
        prefix: prepended to every name.
        dtype: cast floating-point tensors to this dtype.
        storage: backend of the new checkpoint.
        allow_pickle: unpickle arbitrary objects (only for files you trust) and keep
            non-plain values (pickled in tessera too).
        block_bytes: most bytes copied at once.
        file_bytes: size of the tessera data files written.
        progress: called with ``(done_bytes, total_bytes)``.

    Returns:
        What was written; values left out are listed in ``skipped``.

    Raises:
        pickle.UnpicklingError: if the file needs pickle and ``allow_pickle`` is False.
        TypeError: if the file does not hold a dict.

    Example:
        >>> import_torch_save("/models/model.pt", "/ckpt/init", prefix="model.")
    """
    t0 = time.monotonic()
    obj = torch.load(src, map_location="cpu", mmap=True, weights_only=not allow_pickle)
    if not isinstance(obj, dict):
        raise TypeError(f"{src} holds a {type(obj).__name__}, not a dict of tensors")
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    _walk(obj, prefix or "", tensors, values)
    total = sum(t.numel() * itemsize(cast_for(t.dtype, dtype)) for t in tensors.values())
    prog = Progress(total, progress)
    skipped: list[str] = []
    with CheckpointWriter(path, storage=storage, file_bytes=file_bytes) as w:
        for name, t in tensors.items():
            dt = cast_for(t.dtype, dtype)
            shape = tuple(t.shape)
            w.declare(name, shape, dt)
            for box in split_box(Box.whole(shape), max(t.element_size(), itemsize(dt)), block_bytes):
                block = (t[box.slices()] if shape else t).to(dt)
                w.add(name, shape, box, block)
                prog.advance(block.numel() * block.element_size())
        for key, v in values.items():
            try:
                encode_value(v, key, allow_pickle=allow_pickle)
            except TypeError:
                skipped.append(f"{key} (needs pickle)")
                continue
            w.add_value(key, v, allow_pickle=allow_pickle)
        w.commit(source=f"torch.save:{src}", layout={"format": "torch.save"})
        counts = (w.tensors_declared, w.values_added, w.tensor_bytes, w.files_written)
    logger.info("imported %d tensors from %s into %s", counts[0], src, path)
    return ConvertResult(src, path, *counts, time.monotonic() - t0, tuple(skipped))


def _has_tensor(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_has_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_tensor(v) for v in value)
    return False


def _walk(value: object, name: str, tensors: dict[str, torch.Tensor], values: dict[str, Any]) -> None:
    if isinstance(value, torch.Tensor):
        tensors[name] = value.detach()
    elif isinstance(value, (dict, list, tuple)) and _has_tensor(value):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            _walk(v, f"{name}.{k}" if name and not name.endswith(".") else f"{name}{k}", tensors, values)
    elif name:
        values[name.rstrip(".")] = value
