"""Step directory names: ``step-`` and the step number zero-padded to 8 digits.

Shared by the durable layout (:mod:`tessera.manager`) and the node-local tier
(:mod:`tessera.manager.local_tier`); names not in exactly this form are not steps.
"""

from __future__ import annotations

import re

STEP_PREFIX = "step-"
STEP_DIGITS = 8
_STEP_RE = re.compile(r"^step-(\d{8,})$")


def step_dirname(step: int) -> str:
    """The directory name of ``step``: ``step-`` and the number padded to 8 digits.

    Example:
        >>> step_dirname(100)
        'step-00000100'
    """
    return f"{STEP_PREFIX}{step:0{STEP_DIGITS}d}"


def parse_step_dirname(name: str) -> int | None:
    """The step a directory name stands for, or None if it is not a step directory.

    Only the canonical form :func:`step_dirname` produces is accepted, so no two names map
    to one step.

    Example:
        >>> parse_step_dirname("step-00000100"), parse_step_dirname("step-100")
        (100, None)
    """
    m = _STEP_RE.match(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_dirname(step) == name else None
