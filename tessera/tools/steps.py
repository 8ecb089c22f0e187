"""Verify every committed step under a checkpoint manager root: the library behind ``tessera verify ROOT``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import UsageError

if TYPE_CHECKING:
    from ..describe import StepInfo
    from ..verify import VerifyReport


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
    from ..describe import list_steps
    from ..verify import verify

    steps = list_steps(root)
    chosen = steps
    if step is not None:
        chosen = [s for s in steps if s.step == step]
        if not chosen:
            raise UsageError(f"no step {step} under {root}; it has: {', '.join(str(s.step) for s in steps) or 'none'}")
    reports = tuple((s, verify(s.path)) for s in chosen if s.committed)
    return StepsReport(root, tuple(chosen), reports)
