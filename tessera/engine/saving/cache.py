"""Per process group state kept between saves: cached plans, staging memory, a lock."""

from __future__ import annotations

import threading

from .. import dist
from .handoff import SavePlan
from .staging import StagingBuffer
from .window import WindowBuffers

_MAX_PLANS = 4


class SaveCache:
    """Per process group: cached plans and the reused host staging memory (one full buffer, or
    the small buffers of saves in a memory budget).

    ``lock`` serialises the starts of saves of one group in this process (the save in
    flight itself is tracked by :mod:`tessera.engine.inflight`).
    """

    def __init__(self) -> None:
        self.plans: dict[str, SavePlan] = {}
        self.staging = StagingBuffer()
        self.window = WindowBuffers()  # the buffers of saves in a memory budget
        self.lock = threading.Lock()
        self.saves = 0
        """Saves started in this group (every rank counts alike): part of each save's id."""
        self.nonce: int | None = None
        """Rank 0's random number from the group's last foreground vote: part of each save's id."""
        self.table: str | None = None
        """Digest of the tensor table every rank agreed on for plans each rank derives alone."""

    def forget(self) -> None:
        """The ranks' plans disagreed: every rank plans again at its next save, together."""
        self.plans.clear()
        self.nonce = self.table = None

    def remember(self, plan: SavePlan) -> None:
        """Cache ``plan`` under its fingerprint, dropping the oldest beyond a few."""
        self.plans[plan.fingerprint] = plan
        while len(self.plans) > _MAX_PLANS:
            self.plans.pop(next(iter(self.plans)))


_CACHES: dict[object, SaveCache] = {}
_CONTEXTS_LOCK = threading.Lock()


def cache_for(process_group: object) -> SaveCache:
    """The context of ``process_group`` (created on first use)."""
    # The default group may be named explicitly (dist.group.WORLD) or left as None.
    key = "default" if dist.is_default_group(process_group) else process_group
    with _CONTEXTS_LOCK:
        ctx = _CACHES.get(key)
        if ctx is None:
            ctx = _CACHES[key] = SaveCache()
        return ctx
