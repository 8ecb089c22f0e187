"""Compare two checkpoints of any formats: the library behind ``tessera diff``."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from typing import TYPE_CHECKING

from . import UsageError
from .convert import ConvertOptions, PhaseProgress, _no_progress, import_checkpoint

if TYPE_CHECKING:
    from ..convert import DiffReport


def diff_any(
    a: str,
    b: str,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    strip_a: str | None = None,
    strip_b: str | None = None,
    prefix: str | None = None,
    progress: PhaseProgress = _no_progress,
) -> DiffReport:
    """Compare ``a`` and ``b`` tensor by tensor and value by value.

    A side in another format (a Hugging Face export, a ``torch.save`` file, ...) is read
    through a temporary tessera checkpoint, names as they are (no pickle).

    Args:
        a: the first checkpoint, any format :func:`tessera.convert.detect_format` knows.
        b: the second.
        atol: absolute tolerance (0: exact).
        rtol: relative tolerance (0: exact).
        strip_a: compare A's names under this prefix, without it; the rest of A is left out.
        strip_b: the same for B.
        prefix: compare only names under it (after stripping), in both.
        progress: opens a progress callback per phase.

    Returns:
        The report, with ``a`` and ``b`` as given.

    Raises:
        UsageError: if a side's format cannot be told.

    Example:
        >>> diff_any("/ckpt/step-100", "/export/hf", strip_a="model.").identical  # doctest: +SKIP
        True
    """
    from .. import convert as cv
    from ..convert.compare import diff_checkpoints

    with contextlib.ExitStack() as stack:
        paths = []
        for side in (a, b):
            try:
                fmt = cv.detect_format(side)
            except ValueError as e:
                raise UsageError(str(e)) from e
            if fmt != cv.Format.TESSERA:
                tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix=".tessera-diff-"))
                ckpt = os.path.join(tmp, "ckpt")
                import_checkpoint(fmt, side, ckpt, ConvertOptions(progress=progress), dtype=None, prefix=None)
                side = ckpt
            paths.append(side)
        with progress("comparing") as cb:
            report = diff_checkpoints(
                paths[0], paths[1], atol=atol, rtol=rtol, progress=cb, strip_a=strip_a, strip_b=strip_b, prefix=prefix
            )
    return dataclasses.replace(report, a=a, b=b)
