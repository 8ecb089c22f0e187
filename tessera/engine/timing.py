"""Per-phase wall-clock timing of a save or load."""

from __future__ import annotations

import time


class PhaseTimer:
    """Accumulates ``time.monotonic()`` durations of named phases, in order."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.last = self.t0
        self.phases: dict[str, float] = {}
        self.stall: float | None = None
        """Seconds the caller was blocked (an async save's stall), once known."""

    def mark(self, phase: str) -> None:
        """Charge the time since the previous mark to ``phase``."""
        now = time.monotonic()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self.last
        self.last = now

    def total(self) -> dict[str, float]:
        """The phases so far plus ``total`` since the timer started."""
        out = dict(self.phases)
        out["total"] = time.monotonic() - self.t0
        return out
