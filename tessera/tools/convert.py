"""Convert a checkpoint between formats: the library behind ``tessera convert``.

:func:`convert_checkpoint` detects the source format, guards the output, and runs one
importer or exporter of :mod:`tessera.convert`, or both through a temporary tessera
checkpoint when neither side is tessera.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import UsageError

if TYPE_CHECKING:
    import torch

    from ..convert import ConvertResult, Format
    from ..convert._common import ProgressFn

PhaseProgress = Callable[[str], AbstractContextManager["ProgressFn | None"]]
"""``progress(description)`` opens one phase (``"reading hf"``, ``"writing tessera"``) and
yields its ``(done_bytes, total_bytes)`` callback, or None for no progress display."""

Notify = Callable[[str], None]
"""Receives one line about a decision taken on the way (a format read, a prefix chosen)."""


def _no_progress(what: str) -> AbstractContextManager[ProgressFn | None]:
    return contextlib.nullcontext(None)


def _quiet(line: str) -> None:
    return None


@dataclass(frozen=True)
class ConvertOptions:
    """How to read and write the formats of one conversion (every field has the command's default)."""

    dtype: torch.dtype | None = None
    """Cast floating-point tensors to this dtype; None keeps them."""
    max_shard_size: int = 5_000_000_000
    """Largest safetensors shard of a Hugging Face export, in bytes."""
    prefix: str | None = None
    """Exports select the names under it and strip it; imports prepend it (``model.`` for deepspeed/megatron)."""
    include_values: bool = True
    """Write plain values too (torch and dcp exports)."""
    allow_pickle: bool = False
    """Unpickle objects in the source (only for files you trust)."""
    tag: str | None = None
    """DeepSpeed: the ``global_step`` directory to read instead of ``latest``, or to write."""
    spec: str | None = None
    """Megatron: the layout spec (JSON) describing per-rank files."""
    hf_config: str | None = None
    """Hugging Face export: the ``config.json`` to write (the file, or a model directory
    holding one); default: the checkpoint's ``metadata["hf_config"]``, if any."""
    progress: PhaseProgress = _no_progress
    """Opens a progress callback per phase."""


def import_checkpoint(
    fmt: Format, src: str, dst: str, options: ConvertOptions, *, dtype: torch.dtype | None, prefix: str | None
) -> ConvertResult:
    """Read ``src`` in format ``fmt`` into a new tessera checkpoint at ``dst``.

    Raises:
        UsageError: for a format that cannot be read, or a Megatron source without a spec.
    """
    from .. import convert as cv

    with options.progress(f"reading {fmt.value}") as cb:
        if fmt == cv.Format.HF:
            return cv.import_hf(src, dst, prefix=prefix, dtype=dtype, progress=cb)
        if fmt == cv.Format.TORCH:
            return cv.import_torch_save(
                src, dst, prefix=prefix, dtype=dtype, allow_pickle=options.allow_pickle, progress=cb
            )
        if fmt == cv.Format.DCP:
            return cv.import_dcp(src, dst, prefix=prefix, dtype=dtype, allow_pickle=options.allow_pickle, progress=cb)
        if fmt == cv.Format.DEEPSPEED:
            return cv.import_deepspeed(
                src, dst, tag=options.tag, model_prefix=prefix if prefix is not None else "model.", dtype=dtype,
                allow_pickle=options.allow_pickle, progress=cb,
            )  # fmt: skip
        if fmt == cv.Format.MEGATRON:
            if cv.is_torch_dist(src):  # Megatron-Core's own format describes itself: no spec needed
                return cv.import_torch_dist(src, dst, dtype=dtype, progress=cb, allow_pickle=options.allow_pickle)
            if not options.spec:
                raise UsageError(
                    "--from megatron needs --spec LAYOUT_SPEC (the JSON layout spec of the per-rank files); "
                    "torch_dist checkpoints need none"
                )
            return cv.import_megatron(
                src, dst, spec=options.spec, prefix=prefix if prefix is not None else "model.", dtype=dtype,
                allow_pickle=options.allow_pickle, progress=cb,
            )  # fmt: skip
    raise UsageError(f"cannot read {fmt.value} checkpoints")


def export_checkpoint(fmt: Format, src: str, dst: str, options: ConvertOptions, *, prefix: str | None) -> ConvertResult:
    """Write the tessera checkpoint ``src`` to ``dst`` in format ``fmt``.

    Raises:
        UsageError: for a format that cannot be written.
    """
    from .. import convert as cv

    dtype = options.dtype
    with options.progress(f"writing {fmt.value}") as cb:
        if fmt == cv.Format.HF:
            return cv.export_hf(
                src, dst, max_shard_size=options.max_shard_size, dtype=dtype, prefix=prefix, progress=cb,
                config=options.hf_config,
            )  # fmt: skip
        if fmt == cv.Format.TORCH:
            return cv.export_torch_save(
                src, dst, dtype=dtype, prefix=prefix, include_values=options.include_values, progress=cb
            )
        if fmt == cv.Format.DCP:
            return cv.export_dcp(
                src, dst, dtype=dtype, prefix=prefix, include_values=options.include_values, progress=cb
            )
        if fmt == cv.Format.DEEPSPEED:
            model_prefix = options.prefix if options.prefix is not None else "model."
            return cv.export_deepspeed_universal(src, dst, tag=options.tag, model_prefix=model_prefix, progress=cb)
    raise UsageError(f"cannot write {fmt.value} checkpoints (write tessera, hf, torch, dcp or deepspeed)")


def hf_export_prefix(src: str, prefix: str | None, notify: Notify = _quiet) -> str:
    """The prefix to export to Hugging Face: ``prefix``, or the model prefix detected in ``src``.

    Raises:
        UsageError: when no model prefix can be told apart.
    """
    if prefix is not None:
        return prefix
    from ..api import read_manifest
    from .describe import detect_model_prefix

    names = list(read_manifest(src).tensors)
    found, why = detect_model_prefix(names)
    if found is None:
        raise UsageError(f"--to hf exports a model; {why}")
    notify(f"exporting the model only: {why} (--prefix chooses another)" if found else f"note: {why}")
    return found


def prepare_output(dst: str, fmt: Format, *, force: bool) -> None:
    """Refuse to write into an existing, non-empty output unless ``force``; with it, make room.

    A tessera destination is replaced atomically by the save itself; any other output
    (a file, an HF or DCP directory) is removed first, so no stale file mixes in.

    Raises:
        UsageError: if ``dst`` is not empty and ``force`` is not set, or holds tessera
            checkpoints that writing another format would delete.
    """
    from .. import convert as cv

    if "://" in dst:
        return  # object stores: the exporters replace their own files
    exists = os.path.isfile(dst) or (os.path.isdir(dst) and bool(os.listdir(dst)))
    if not exists:
        return
    if not force:
        raise UsageError(f"{dst} exists and is not empty; pass --force to replace it")
    if fmt == cv.Format.TESSERA:
        return
    if os.path.isdir(dst):
        from .describe import PathKind, classify_path

        if classify_path(dst) in (PathKind.CHECKPOINT, PathKind.MANAGER_ROOT):
            raise UsageError(
                f"{dst} holds tessera checkpoints; refusing to delete them to write {fmt.value} (choose another output)"
            )
        shutil.rmtree(dst)
    else:
        os.remove(dst)


def convert_checkpoint(
    src: str,
    dst: str,
    *,
    src_format: str | None = None,
    dst_format: str | None = None,
    dtype: str | None = None,
    max_shard_size: str = "5GB",
    force: bool = False,
    options: ConvertOptions | None = None,
    notify: Notify = _quiet,
) -> tuple[Format, ConvertResult]:
    """Convert the checkpoint ``src`` into ``dst``, as ``tessera convert`` does.

    Args:
        src: the source checkpoint (a path; tessera sources may be URLs).
        dst: the output.
        src_format: a :class:`~tessera.convert.Format` value; detected when None.
        dst_format: a :class:`~tessera.convert.Format` value; tessera when None.
        dtype: cast floating-point tensors (``"bf16"``, ``"fp16"``, ``"fp32"``).
        max_shard_size: largest safetensors shard for Hugging Face output (``"5GB"``).
        force: replace an existing, non-empty output.
        options: the rest (prefix, pickle, DeepSpeed tag, Megatron spec, progress); its
            ``dtype`` and ``max_shard_size`` are set from the arguments above.
        notify: receives a line for each step taken on the way.

    Returns:
        ``(destination format, what the last step wrote)``.

    Raises:
        UsageError: for arguments that do not make sense together.

    Example:
        >>> fmt, result = convert_checkpoint("/ckpt/step-100", "/export/hf", dst_format="hf")  # doctest: +SKIP
    """
    from .. import convert as cv
    from ..format.dtypes import parse_dtype
    from ..options import parse_size

    base = options or ConvertOptions()
    steps = _stray_steps(src)
    if steps:
        if dst_format not in (None, cv.Format.TESSERA.value):
            raise UsageError(f"{src} is a folder of steps: it converts into a tessera manager root (no --to)")
        return convert_steps(
            src, dst, steps, src_format=src_format, dtype=dtype, force=force, options=base, notify=notify
        )
    try:
        src_fmt = cv.Format(src_format) if src_format else cv.detect_format(src)
    except (ValueError, FileNotFoundError) as e:  # FileNotFoundError: the diagnosis tessera.load gives
        raise UsageError(str(e)) from e
    dst_fmt = cv.Format(dst_format) if dst_format else cv.Format.TESSERA
    if src_fmt == dst_fmt and src_fmt != cv.Format.TESSERA:
        raise UsageError(f"source and destination are both {src_fmt.value}; choose another format with --to")
    try:
        cast = parse_dtype(dtype) if dtype else None
        shard = parse_size(max_shard_size)
    except ValueError as e:
        raise UsageError(str(e)) from e
    if os.path.abspath(src) == os.path.abspath(dst):
        raise UsageError("the source and the destination are the same path")
    if base.hf_config is not None and dst_fmt != cv.Format.HF:
        raise UsageError("--config applies to --to hf (the config.json written beside the model)")
    opts = dataclasses.replace(base, dtype=cast, max_shard_size=shard)
    prepare_output(dst, dst_fmt, force=force)
    if src_fmt != cv.Format.TESSERA and dst_fmt != cv.Format.TESSERA:
        # Two steps through a temporary tessera checkpoint next to the destination (or in the
        # system's temporary directory when the destination is a URL).
        parent = None if "://" in dst else os.path.dirname(os.path.abspath(dst))
        if parent:
            os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tessera-convert-", dir=parent)
        try:
            first = import_checkpoint(src_fmt, src, tmp, opts, dtype=None, prefix=None)
            notify(f"read {first.tensors} tensors from {src} ({src_fmt.value})")
            prefix = hf_export_prefix(tmp, opts.prefix, notify) if dst_fmt == cv.Format.HF else opts.prefix
            return dst_fmt, export_checkpoint(dst_fmt, tmp, dst, opts, prefix=prefix)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if src_fmt == dst_fmt:  # tessera to tessera: a self-contained copy (shared tiles brought in)
        if opts.dtype is not None or opts.prefix is not None:
            raise UsageError("a tessera-to-tessera copy is byte for byte: --dtype and --prefix do not apply")
        from .copy import copy_checkpoint

        return dst_fmt, copy_checkpoint(src, dst)
    if src_fmt == cv.Format.TESSERA:
        prefix = hf_export_prefix(src, opts.prefix, notify) if dst_fmt == cv.Format.HF else opts.prefix
        return dst_fmt, export_checkpoint(dst_fmt, src, dst, opts, prefix=prefix)
    return dst_fmt, import_checkpoint(src_fmt, src, dst, opts, dtype=cast, prefix=opts.prefix)


def _stray_steps(src: str) -> dict[int, str]:
    """``{step: directory}`` of a folder of step directories the manager does not recognise
    (``step-6``: DCP's and most scripts' naming); empty for anything else."""
    from .describe import PathKind, examine_path

    if "://" in src or not os.path.isdir(src):
        return {}
    report = examine_path(src)
    if report.kind != PathKind.STRAY_STEPS:
        return {}
    from ..engine.loading.path_report import stray_step

    return {stray_step(n) or 0: os.path.join(src, n) for n in report.stray}


def convert_steps(
    src: str,
    dst: str,
    steps: dict[int, str],
    *,
    src_format: str | None = None,
    dtype: str | None = None,
    force: bool = False,
    options: ConvertOptions | None = None,
    notify: Notify = _quiet,
) -> tuple[Format, ConvertResult]:
    """Convert a folder of step directories (``step-6``, ``step-12``: DCP's naming) into a
    :class:`~tessera.CheckpointManager` root at ``dst``, the step numbers kept
    (``step-00000006``), ``latest`` naming the newest; what ``tessera convert FOLDER OUT`` does.

    A step directory that cannot be read (a save killed before DCP wrote ``.metadata``) is
    left out with a line through ``notify``; the others are converted.

    Returns:
        ``(tessera, the totals)``.

    Raises:
        UsageError: if ``dst`` is not empty (without ``force``), or no step could be read.

    Example:
        >>> convert_checkpoint("/dcp-run", "/tessera-run")  # doctest: +SKIP
    """
    import time

    from .. import convert as cv
    from ..convert import ConvertResult
    from ..format.names import step_dirname
    from ..manager.steps import StepDirectory
    from ..storage import storage_for

    t0 = time.monotonic()
    prepare_output(dst, cv.Format.TESSERA, force=force)
    done: list[tuple[int, ConvertResult]] = []
    skipped: list[str] = []
    for step, path in sorted(steps.items()):
        out = os.path.join(dst, step_dirname(step))
        try:
            fmt = cv.Format(src_format) if src_format else cv.detect_format(path)
        except (ValueError, FileNotFoundError):
            notify(f"step {step}: left out: {path} holds no checkpoint it can read (a save that never finished?)")
            skipped.append(f"{os.path.basename(path)} (no checkpoint)")
            continue
        _, result = convert_checkpoint(path, out, src_format=fmt.value, dtype=dtype, force=force, options=options)
        notify(f"step {step}: read {fmt.value} {path}, wrote {out}")
        done.append((step, result))
        skipped += [f"step {step}: {x}" for x in result.skipped]
    if not done:
        raise UsageError(f"{src}: none of its step directories holds a checkpoint it can read")
    StepDirectory(dst, storage_for).point_at(done[-1][0])
    notify(f"{dst}: a checkpoint manager root with steps {', '.join(str(s) for s, _ in done)}; latest: {done[-1][0]}")
    total = ConvertResult(
        src, dst, sum(r.tensors for _, r in done), sum(r.values for _, r in done), sum(r.bytes for _, r in done),
        sum(r.files for _, r in done), time.monotonic() - t0, tuple(skipped),
    )  # fmt: skip
    return cv.Format.TESSERA, total
