"""Rendering helpers of the ``tessera`` command: sizes, strict JSON, progress bars, values."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..convert._common import ProgressFn

EXIT_OK = 0
"""Success."""
EXIT_PROBLEMS = 1
"""Problems found, or the operation failed."""
EXIT_USAGE = 2
"""Arguments that do not make sense."""


def fmt_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def to_json(doc: object) -> str:
    """Strict JSON: non-finite floats (an infinite difference, say) become the strings "inf"/"nan"."""

    def clean(x: object) -> object:
        if isinstance(x, float) and not math.isfinite(x):
            return str(x)
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    return json.dumps(clean(doc), indent=2, allow_nan=False, default=str)


def shorten(text: str, n: int = 70) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


@contextlib.contextmanager
def progress_bar(args: argparse.Namespace, what: str) -> Iterator[Callable[[int, int], None] | None]:
    """A ``(done, total)`` callback drawing a progress bar on stderr, when it is a terminal."""
    if args.no_progress or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def value_text(encoded: Any, name: str) -> str:
    from ..errors import ManifestError, PickleNotAllowedError
    from ..format.values import decode_value

    try:
        return repr(decode_value(encoded, name, allow_pickle=False))
    except PickleNotAllowedError:
        return "<pickled; needs allow_pickle=True>"
    except ManifestError as e:
        return f"<invalid: {e}>"


def phase_progress(args: argparse.Namespace) -> Callable[[str], AbstractContextManager[ProgressFn | None]]:
    """:func:`progress_bar` for the phases of one command (the ``progress`` of :mod:`tessera.tools`)."""
    return lambda what: progress_bar(args, what)
