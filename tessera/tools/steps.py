"""Manager roots on the command line: which checkpoint a path names, and verifying every step.

:func:`resolve_checkpoint` is the one place where ``tessera``'s verbs turn what the user typed
into one checkpoint: a ``CheckpointManager`` root means its newest committed step,
``ROOT@STEP`` (or ``ROOT@latest``) names a step, and anything else (a step directory, an
exported file, another framework's checkpoint) is taken as it is. :func:`verify_steps` is the
library behind ``tessera verify ROOT``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import UsageError

if TYPE_CHECKING:
    from .describe import StepInfo
    from .verification import VerifyReport

_AT_STEP = re.compile(r"^(?P<root>.+)@(?P<step>\d+|latest)$")


@dataclass(frozen=True)
class ResolvedPath:
    """What :func:`resolve_checkpoint` made of one path argument."""

    given: str
    """The argument as typed."""
    path: str
    """The checkpoint to read: the chosen step's directory, or ``given`` itself."""
    root: str | None = None
    """The manager root, when ``given`` named one (bare or ``ROOT@STEP``)."""
    step: int | None = None
    """The step chosen under ``root``."""
    latest: bool = False
    """Whether the step was chosen as the root's newest committed step (not named)."""

    @property
    def note(self) -> str | None:
        """One line saying which step was chosen, or None when ``given`` was taken as it is."""
        if self.root is None or self.step is None:
            return None
        if self.latest:
            return f"{self.given}: a checkpoint manager root; using its latest committed step {self.step}: {self.path}"
        return f"{self.given}: step {self.step} of the checkpoint manager root {self.root}: {self.path}"


def _committed(root: str) -> tuple[list[StepInfo], list[StepInfo]]:
    from .describe import list_steps

    steps = list_steps(root)
    return steps, [s for s in steps if s.committed]


def _pick(given: str, root: str, step: str) -> ResolvedPath:
    """The step ``step`` (a number or ``latest``) under the manager root ``root``.

    Anything else is the diagnosis ``tessera.load`` gives for the same path
    (:func:`~tessera.tools.describe.examine_path`).
    """
    from ..errors import CheckpointNotFoundError
    from ..format.names import step_dirname
    from .describe import PathKind, examine_path

    report = examine_path(root)
    if report.kind != PathKind.MANAGER_ROOT:
        raise UsageError(f"{given}: ROOT@STEP needs a checkpoint manager root; {report.message()}")
    steps, committed = _committed(root)
    if not committed:
        raise CheckpointNotFoundError(report.message())
    if step == "latest":
        chosen = committed[-1]
        return ResolvedPath(given, chosen.path, root, chosen.step, latest=True)
    number = int(step)
    found = next((s for s in steps if s.step == number and s.committed), None)
    if found is None:
        path = root + step_dirname(number) if root.endswith("/") else f"{root}/{step_dirname(number)}"
        raise UsageError(f"{given}: {examine_path(path).message()}")
    return ResolvedPath(given, found.path, root, number)


def resolve_checkpoint(given: str, *, root_means_latest: bool = True) -> ResolvedPath:
    """The checkpoint a command-line path names.

    * ``ROOT@STEP``: step ``STEP`` of the manager root ``ROOT`` (``ROOT@latest``: its newest
      committed step). A path that exists as typed is never split at ``@``.
    * a manager root: its newest committed step (the step ``CheckpointManager.load`` starts
      from; the ``latest`` pointer may lag one step behind), unless ``root_means_latest`` is
      False (``inspect`` lists the steps, ``verify`` checks them all): then the root itself.
    * anything else: itself (a step directory, a checkpoint, a file, another format).

    Only lists directories and checks for ``manifest.json``; never communicates.

    Args:
        given: the argument as typed.
        root_means_latest: whether a bare manager root means its newest committed step.

    Returns:
        The path to read, with the root and step chosen (``note`` says which, for stderr).

    Raises:
        UsageError: ``ROOT@STEP`` where ``ROOT`` is no manager root, or ``STEP`` is not a
            committed step of it (the message lists the committed ones).
        CheckpointNotFoundError: a manager root without a committed step.

    Example:
        >>> resolve_checkpoint("/ckpt/run1").path  # doctest: +SKIP
        '/ckpt/run1/step-00000500'
        >>> resolve_checkpoint("/ckpt/run1@400").path  # doctest: +SKIP
        '/ckpt/run1/step-00000400'
    """
    m = _AT_STEP.match(given)
    if m is not None and ("://" in given or not os.path.exists(given)):
        return _pick(given, m.group("root"), m.group("step"))
    if not root_means_latest:
        return ResolvedPath(given, given)
    from .describe import PathKind, classify_path

    if classify_path(given) == PathKind.MANAGER_ROOT:
        return _pick(given, given, "latest")
    return ResolvedPath(given, given)


@dataclass(frozen=True)
class StepsReport:
    """The outcome of :func:`verify_steps`."""

    root: str
    """The manager root."""
    steps: tuple[StepInfo, ...]
    """The steps checked (every step, or the one asked for), committed or not."""
    reports: tuple[tuple[StepInfo, VerifyReport], ...]
    """Each committed step with its verification report, oldest first."""

    @property
    def incomplete(self) -> list[int]:
        """Steps whose save never committed (never loaded)."""
        return [s.step for s in self.steps if not s.committed]

    @property
    def ok(self) -> bool:
        """Whether there is a committed step and every one verified without a problem."""
        return bool(self.reports) and all(r.ok for _, r in self.reports)


def verify_steps(root: str, step: int | None = None) -> StepsReport:
    """Verify every committed step under the manager root ``root`` (or only ``step``).

    Raises:
        UsageError: if ``step`` is given and there is no such step.

    Example:
        >>> verify_steps("/ckpt").ok  # doctest: +SKIP
        True
    """
    from .describe import list_steps
    from .verification import verify

    steps = list_steps(root)
    chosen = steps
    if step is not None:
        chosen = [s for s in steps if s.step == step]
        if not chosen:
            raise UsageError(f"no step {step} under {root}; it has: {', '.join(str(s.step) for s in steps) or 'none'}")
    reports = tuple((s, verify(s.path)) for s in chosen if s.committed)
    return StepsReport(root, tuple(chosen), reports)
