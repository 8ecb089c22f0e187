"""Checkpoints of a training run: one directory per step, a ``latest`` pointer, retention.

Layout under ``root`` (any URL :func:`tessera.storage.storage_for` accepts)::

    <root>/
      step-00000100/     a checkpoint (see tessera.save): manifest.json + data/
      step-00000200/
      latest             one line: the directory name of the newest committed step

A step directory is ``step-`` followed by the step number zero-padded to 8 digits
(``step-00000100``); steps past 99,999,999 simply get more digits. Names that are not in
exactly this form are ignored, so other files may live under ``root``.

Crash safety: a step is committed when its ``manifest.json`` is (see :func:`tessera.save`);
``latest`` is rewritten atomically only after that, so it never names an uncommitted step,
though after a crash it may lag one step behind. :meth:`CheckpointManager.load` therefore
looks at the step directories themselves and resumes from the newest one that is committed
and intact. Retention deletes a step's ``manifest.json`` before its data, so a deletion cut
short leaves an incomplete step (skipped by loads), never a corrupt "committed" one.

Distributed contract: every rank constructs the manager with the same arguments and calls
:meth:`~CheckpointManager.save` and :meth:`~CheckpointManager.load` together (they are
collective, like :func:`tessera.save`); only rank 0 moves ``latest`` and deletes old steps.
:meth:`~CheckpointManager.steps` and :meth:`~CheckpointManager.latest_step` only read
storage and may be called by any rank alone. A manager is meant for one thread.

Modules, one concept each:

- :mod:`~tessera.manager.core`: the :class:`CheckpointManager` facade (save, load, close).
- :mod:`~tessera.manager.steps`: step names, listing, the ``latest`` pointer (no communication).
- :mod:`~tessera.manager.retention`: which steps are kept; deleting a step manifest first.
- :mod:`~tessera.manager.background`: the asynchronous save's thread, waiting for it, closing at exit.
- :mod:`~tessera.manager.direct`: the save under ``root``; ``latest`` and retention after a commit.
- :mod:`~tessera.manager.tiered`: the save with a node-local tier (``local_dir``).
- :mod:`~tessera.manager.resume`: which step a load uses, falling back past unusable ones.
"""

from __future__ import annotations

from .core import CheckpointManager
from .resume import StepLoadResult
from .steps import LATEST_NAME, parse_step_dirname, step_dirname

__all__ = ["LATEST_NAME", "CheckpointManager", "StepLoadResult", "parse_step_dirname", "step_dirname"]
