"""The node-local tier of :class:`~tessera.CheckpointManager`: frequent steps in host memory
(or local disk), each rank's files replicated to other nodes over ``torch.distributed``
(or protected by parity blocks on other nodes: ``local_parity``), and recovery from whatever
the surviving nodes hold. See ``docs/resilience.md``.

Modules: :mod:`.placement` (node indices, the replica ring), :mod:`.inventory` (what a node
holds, whose steps they are, the choice of step), :mod:`.transfer` (files between ranks),
:mod:`.fetches` (which files move on recovery), :mod:`.recovery` (recovery, with bad copies
replaced), :mod:`.retention` (deleting a node's steps), :mod:`.timeline` (which steps are still
on the job's timeline after rollbacks and resumes), :mod:`.tier` (save, commit); for parity,
:mod:`.stripes` (the layout), :mod:`.codec` (the erasure code), :mod:`.streams` (a node's files
as one byte range) and :mod:`.parity` (encoding and rebuilding over the gloo group).
"""

from __future__ import annotations

from .inventory import NodeInventory, StepHolding, choose_step
from .placement import Placement, node_dir, node_index, place
from .retention import LocalRetention, remove_root_steps
from .tier import LocalTier, Recovery
from .timeline import Timeline

__all__ = [
    "LocalRetention",
    "LocalTier",
    "NodeInventory",
    "Placement",
    "Recovery",
    "StepHolding",
    "Timeline",
    "choose_step",
    "node_dir",
    "node_index",
    "place",
    "remove_root_steps",
]
