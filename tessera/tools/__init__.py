"""What the ``tessera`` command does, as library functions (the CLI only parses and prints).

Modules:
    convert: :func:`~tessera.tools.convert.convert_checkpoint`, any supported format to any
        other (through a temporary tessera checkpoint when neither side is tessera), with the
        output guard of ``tessera convert``.
    diff: :func:`~tessera.tools.diff.diff_any`, two checkpoints of any formats compared tensor by tensor.
    steps: :func:`~tessera.tools.steps.verify_steps`, every committed step under a manager root verified.
    verification: :func:`tessera.verify`, one checkpoint's files checked against its manifest.
    describe: what ``tessera inspect`` shows (a checkpoint, a step root, an HF directory).
    trace: per-rank save and load timings, and stragglers (``tessera trace``).

Each function raises :class:`UsageError` for arguments that do not make sense together (the
command's exit code 2), and the library's own errors otherwise.
"""

from __future__ import annotations


class UsageError(ValueError):
    """Arguments that do not make sense together (``tessera`` exits with code 2)."""


__all__ = ["UsageError"]
