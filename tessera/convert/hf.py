"""Hugging Face safetensors directories: export a tessera checkpoint to one, import one.

Export writes what ``transformers``' ``from_pretrained`` reads: ``model.safetensors``, or
``model-00001-of-0000N.safetensors`` shards plus ``model.safetensors.index.json`` when the
tensors exceed ``max_shard_size``. Each shard's header is computed up front and its bytes are
streamed tensor block by tensor block, so memory stays bounded by ``block_bytes`` whatever
the shard size. Import reads row blocks through ``safe_open(...).get_slice`` (memory-mapped)
and streams them into a new tessera checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import torch
from safetensors import safe_open

from ..format.dtypes import SAFETENSORS_DTYPES, as_bytes, cast_for, itemsize, safetensors_dtype_code
from ..format.geometry import Box, split_box
from ..format.names import strip_prefix
from ..format.safetensors_header import encode_header
from ..hf_export.config import HF_CONFIG_KEY, config_of_directory, read_config, write_config
from ..hf_export.files import INDEX_NAME, group_shards, hf_files, index_bytes, remove_model_files, shard_file_names
from ..options import parse_size
from ..storage import Storage, storage_for
from ._common import DEFAULT_BLOCK_BYTES, ConvertResult, Progress, ProgressFn, numel
from .reader import CheckpointReader
from .writer import CheckpointWriter

logger = logging.getLogger(__name__)


class _Entry(NamedTuple):
    """A tensor to export: its Hugging Face name, tessera name, output dtype and size."""

    name: str
    fqn: str
    dtype: torch.dtype
    code: str
    nbytes: int


def export_hf(
    path: str,
    out_dir: str,
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    prefix: str | None = None,
    storage: Storage | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    progress: ProgressFn | None = None,
    config: Mapping[str, Any] | str | None = None,
) -> ConvertResult:
    """Export the tensors of a tessera checkpoint as a Hugging Face safetensors directory.

    Single process; reads only the checkpoint and writes only ``out_dir``'s model files
    (earlier ``model*.safetensors`` files and the index there are replaced; tokenizer files
    are left alone) and ``config.json`` when a config is known: ``config``, else the
    checkpoint's ``metadata["hf_config"]`` (see :mod:`tessera.hf_export.config`). Without
    one, an existing ``config.json`` is left alone.

    Args:
        path: the tessera checkpoint (saved by any number of ranks, any layout).
        out_dir: the directory (or URL) to write.
        max_shard_size: most bytes per shard (``"5GB"``, ``"500MiB"`` or an int).
        dtype: cast floating-point tensors to this dtype (integer tensors are kept).
        prefix: export only tensors whose name starts with ``prefix``, without it
            (``"model."`` turns ``model.lm_head.weight`` into ``lm_head.weight``).
        storage: backend of the checkpoint (default: chosen from ``path``).
        block_bytes: most bytes of a tensor in memory at once.
        progress: called with ``(done_bytes, total_bytes)``.
        config: the Hugging Face config to write as ``config.json``: a dict, a ``config.json``
            file or a model directory holding one; its dtype is set to the dtype written.

    Returns:
        What was written; plain values and per-rank tensors and values are listed in ``skipped``.

    Raises:
        ValueError: if no tensor matches ``prefix``, or ``config`` is not a JSON object.
        FileNotFoundError: if ``config`` names no file.
        TypeError: for a tensor dtype safetensors cannot hold.
        CorruptCheckpointError: for data failing its checksum.

    Example:
        >>> export_hf("/ckpt/step100", "/export/hf", prefix="model.", dtype=torch.bfloat16)
    """
    t0 = time.monotonic()
    src = CheckpointReader(path, storage=storage)
    hf_config = read_config(config) if config is not None else src.manifest.metadata.get(HF_CONFIG_KEY)
    limit = parse_size(max_shard_size)
    per_rank = src.per_rank_tensors()
    names = strip_prefix([n for n in src.manifest.tensors if n not in per_rank], prefix)
    if not names:
        raise ValueError(f"checkpoint {path} has no tensors{f' under prefix {prefix!r}' if prefix else ''} to export")
    specs = []
    for hf_name, fqn in names.items():
        out_dt = cast_for(src.dtype(fqn), dtype)
        code = safetensors_dtype_code(out_dt, fqn)
        specs.append(_Entry(hf_name, fqn, out_dt, code, numel(src.shape(fqn)) * itemsize(out_dt)))

    groups = group_shards([s.nbytes for s in specs], limit)
    shards = [[specs[i] for i in g] for g in groups]
    files = shard_file_names(len(shards))

    out = storage_for(out_dir)
    remove_model_files(out, out_dir)
    total = sum(s.nbytes for s in specs)
    prog = Progress(total, progress)
    for fname, shard in zip(files, shards):
        shard.sort(key=lambda s: -itemsize(s.dtype))  # stable; keeps every tensor aligned to its item size
        out.write_file(fname, _shard_chunks(src, shard, block_bytes, prog))
    if len(files) > 1:
        out.write_file(INDEX_NAME, [index_bytes(total, {s.name: f for f, shard in zip(files, shards) for s in shard})])
    if isinstance(hf_config, Mapping):
        write_config(out, hf_config, {s.dtype for s in specs})
    skipped = [f"{n} (plain value)" for n in src.manifest.values] + [f"{n} (per-rank tensor)" for n in sorted(per_rank)]
    skipped += [f"{n} (per-rank value)" for n in src.manifest.per_rank]
    if prefix:
        skipped = [s for s in skipped if s.startswith(prefix)]
    logger.info(
        "exported %d tensors (%d bytes) from %s to %s in %d file(s)", len(specs), total, path, out_dir, len(files)
    )
    written = len(files) + (len(files) > 1) + isinstance(hf_config, Mapping)
    return ConvertResult(path, out_dir, len(specs), 0, total, written, time.monotonic() - t0, tuple(skipped))


def _shard_chunks(
    src: CheckpointReader, shard: list[_Entry], block_bytes: int, prog: Progress
) -> Iterator[memoryview | bytes]:
    """The bytes of one shard: its header, then each tensor block by block (one buffer reused)."""
    yield encode_header([(s.name, s.code, src.shape(s.fqn), s.nbytes) for s in shard])
    for s in shard:
        for _, block in src.blocks(s.fqn, block_bytes=block_bytes, dtype=s.dtype, reuse=True):
            data = as_bytes(block)
            yield data.numpy().data
            prog.advance(data.numel())


# --------------------------------------------------------------------------------------
# Import


def import_hf(
    src: str,
    path: str,
    *,
    prefix: str | None = None,
    dtype: torch.dtype | None = None,
    storage: Storage | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    file_bytes: int = 256 << 20,
    progress: ProgressFn | None = None,
) -> ConvertResult:
    """Import a Hugging Face safetensors directory (or one file) as a tessera checkpoint.

    Args:
        src: a directory with ``model.safetensors.index.json``, ``model.safetensors`` or other
            ``*.safetensors`` files, or one ``.safetensors`` file.
        path: where to write the tessera checkpoint (replaced atomically).
        prefix: prepended to every tensor name (``"model."`` to match ``{"model": sd}`` states).
        dtype: cast floating-point tensors to this dtype.
        storage: backend of the new checkpoint (default: chosen from ``path``).
        block_bytes: most bytes of a tensor read at once.
        file_bytes: size of the tessera data files written.
        progress: called with ``(done_bytes, total_bytes)``.

    The directory's ``config.json``, if any, is kept in the checkpoint's
    ``metadata["hf_config"]``, so that :func:`export_hf` writes it back.

    Returns:
        What was written.

    Raises:
        FileNotFoundError: if ``src`` holds no safetensors file.
        ValueError: if two files hold the same tensor, or a dtype is unknown.

    Example:
        >>> import_hf("/models/llama", "/ckpt/llama-init", prefix="model.")
    """
    t0 = time.monotonic()
    files = hf_files(src)
    plan: list[tuple[str, str, tuple[int, ...], torch.dtype]] = []
    seen: dict[str, str] = {}
    for fname in files:
        with safe_open(fname, framework="pt") as f:
            for key in f.keys():
                if key in seen:
                    raise ValueError(f"tensor '{key}' is in both {seen[key]} and {fname}")
                seen[key] = fname
                sl = f.get_slice(key)
                code = sl.get_dtype()
                if code not in SAFETENSORS_DTYPES:
                    raise ValueError(f"tensor '{key}' in {fname} has dtype {code}, which tessera does not know")
                plan.append((fname, key, tuple(sl.get_shape()), SAFETENSORS_DTYPES[code]))
    total = sum(itemsize(cast_for(dt, dtype)) * numel(shape) for _, _, shape, dt in plan)
    prog = Progress(total, progress)
    with CheckpointWriter(path, storage=storage, file_bytes=file_bytes) as w:
        for fname in files:
            with safe_open(fname, framework="pt") as handle:
                for _, key, shape, dt in (p for p in plan if p[0] == fname):
                    name = (prefix or "") + key
                    out_dt = cast_for(dt, dtype)
                    w.declare(name, shape, out_dt)
                    if not shape:
                        w.add(name, shape, Box((), ()), handle.get_tensor(key).to(out_dt))
                        prog.advance(itemsize(out_dt))
                        continue
                    sl = handle.get_slice(key)
                    for box in split_box(Box.whole(shape), max(itemsize(dt), itemsize(out_dt)), block_bytes):
                        block = sl[box.slices()].to(out_dt)
                        w.add(name, shape, box, block)
                        prog.advance(block.numel() * block.element_size())
                # Blocks may be views of the file's mapping: write them before it is closed.
                w.flush()
        config = config_of_directory(src)  # kept, so that exporting again writes it back
        w.commit(
            source=f"hf:{src}",
            layout={"format": "huggingface-safetensors", "files": len(files)},
            metadata={HF_CONFIG_KEY: config} if config is not None else None,
        )
        counts = (w.tensors_declared, w.values_added, w.tensor_bytes, w.files_written)
    logger.info("imported %d tensors from %s into %s", len(plan), src, path)
    return ConvertResult(src, path, *counts, time.monotonic() - t0)
