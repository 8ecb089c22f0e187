"""Orchestrating a load, the mirror of :mod:`tessera.engine.saving`: manifest -> load plan -> read ->
copy in place.

- :mod:`.core`: :func:`~.core.load` and :func:`~.core.read_manifest`: reads and checks the
  manifest, matches it against the target state, and copies values in place;
- :mod:`.plan`: the load plan, which chunks of which files each target box needs (no I/O);
- :mod:`.read`: reads the planned chunks, verifies their checksums, copies them into the targets;
- :mod:`.broadcast`: one rank reads, the others receive (``LoadOptions(broadcast=...)``).
"""
