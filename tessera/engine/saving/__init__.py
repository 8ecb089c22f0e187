"""Orchestrating a save: flatten -> local plan -> global plan [cached] -> stage -> write -> commit.

One module per step, each handing the next a frozen dataclass (:mod:`.handoff`):

- :mod:`.start`: :func:`start_save`, waits for the save in flight (:mod:`tessera.engine.inflight`),
  then runs the steps below, the last ones in a background thread for ``async_save``;
- :mod:`.cache`: per process group, the cached plans and the reused staging buffer;
- :mod:`.prepare`: the prepare step (flatten, save id, location) and the plan step;
- :mod:`.sources`: the stage step (the tensors to write, copied to host memory);
- :mod:`.fingerprint`: what the CPU tiles an async save copies later held at its call, checked
  against the checksums of what was written;
- :mod:`.finish`: the claim, write and commit steps (rank 0 commits following
  :mod:`tessera.engine.commit`: it claims the path before any rank writes, checks every reported
  file, publishes the manifest only over the version it claimed, then removes files of
  saves that are over);
- :mod:`.assemble`: rank 0 builds the manifest from the ranks' reports.

Every collective step runs through :func:`tessera.engine.dist.collective_step`, which raises any
rank's failure on every rank.
"""

from __future__ import annotations

from ..inflight import wait_pending
from .handoff import SaveRequest
from .start import start_save

__all__ = ["SaveRequest", "start_save", "wait_pending"]
