"""Orchestrating a load, the mirror of :mod:`tessera.engine.saving`: manifest -> load plan -> read ->
copy in place.

- :mod:`.core`: :func:`~.core.load`: the order of the steps, each collective;
- :mod:`.manifest`: :func:`~.manifest.read_manifest`, the manifest read once and size-checked;
- :mod:`.path_report`: what is at a path with no committed checkpoint, the one diagnosis of every
  "not found" (``tessera.load``, ``CheckpointManager.load``, the ``tessera`` command);
- :mod:`.validate`: the target state checked against the manifest (keys, shapes, dtypes), values;
- :mod:`.plan`: the load plan, which chunks of which files each target box needs (no I/O);
- :mod:`.read`: reads the planned chunks, verifies their checksums, copies them into the targets;
- :mod:`.broadcast`: one rank reads, the others receive (``LoadOptions(broadcast_replicated=True)``).
"""

from __future__ import annotations

from .core import load
from .manifest import read_manifest

__all__ = ["load", "read_manifest"]
