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

The manager is composed of parts that own their state, one module each; none of them
imports :mod:`~tessera.manager.core` or knows the facade (``tests/test_manager_parts.py``
checks it):

- :mod:`~tessera.manager.core`: :class:`CheckpointManager`, the facade: checks arguments,
  composes the parts, orders the calls, keeps the lifecycle (save, load, close).
- :mod:`~tessera.manager.arguments`: checking the constructor's arguments; attributes kept by a part.
- :mod:`~tessera.manager.steps`: :class:`~.steps.StepDirectory`: the root's backend, step names,
  listing, the ``latest`` pointer, deleting a step manifest first (no communication).
- :mod:`~tessera.manager.retention`: :class:`~.retention.Retention`: ``keep_last``/``keep_every``,
  the steps being saved (never deleted), applying the policy.
- :mod:`~tessera.manager.background`: :class:`~.background.BackgroundSaves`: the save in flight,
  its finishing thread, waiting for it; closing open managers at exit.
- :mod:`~tessera.manager.direct`: :class:`~.direct.DirectRoute`: the save under ``root``; ``latest``
  and retention after a commit.
- :mod:`~tessera.manager.tiered`: :class:`~.tiered.TieredRoute`: the save through the node-local
  tier (``local_dir``), its durable copy, removing local steps.
- :mod:`~tessera.manager.identity`: the durable root's id, which says which local steps are the run's.
- :mod:`~tessera.manager.resume`: :class:`~.resume.StepLoader`: which step a load uses, falling
  back past unusable ones.
"""

from __future__ import annotations

from .core import CheckpointManager
from .policies import (
    AllOf,
    AnyOf,
    AtSteps,
    EveryNSeconds,
    EveryNSteps,
    OnPreemption,
    SaveContext,
    SaveDecider,
    SavePolicy,
)
from .preemption import PreemptionHandler
from .resume import StepLoadResult
from .steps import LATEST_NAME, parse_step_dirname, step_dirname

__all__ = [
    "LATEST_NAME",
    "AllOf",
    "AnyOf",
    "AtSteps",
    "CheckpointManager",
    "EveryNSeconds",
    "EveryNSteps",
    "OnPreemption",
    "PreemptionHandler",
    "SaveContext",
    "SaveDecider",
    "SavePolicy",
    "StepLoadResult",
    "parse_step_dirname",
    "step_dirname",
]
