"""Deprecated one-checkpoint host-memory tier: commit a checkpoint to RAM first, persist it in the background.

Deprecated: host-memory checkpoints are the local tier of :class:`~tessera.CheckpointManager`
(:mod:`tessera.local_tier`; ``CheckpointManager("tier::<url>")`` or ``local_dir=...``), which
keeps whole steps per node, replicates them to other nodes and recovers from peers. A
``tier::`` root of a manager is that local tier; this package serves only ``tier::`` paths
given to :func:`tessera.save` / :func:`tessera.load` and :class:`MemoryTierStorage` itself,
and is removed in tessera 0.2.

A save through :class:`MemoryTierStorage` finishes at host-memory speed, and a restart on the
same node loads at host-memory speed, while the durable store (S3, a shared filesystem...)
still receives every checkpoint and stays the source of truth.

Usage::

    tessera.save("tier::s3://bucket/run/step-100", state)          # through storage_for
    # or, with options:
    tier = MemoryTierStorage("s3://bucket/run/step-100", storage_options={...})
    tessera.save(tier.url, state, storage=tier)
    tier.wait_persisted()                                          # optional: block until durable

How it works:

* **Layout.** The memory copy lives in a plain directory (a :class:`FileStorage` without
  fsync) laid out exactly like the durable checkpoint, by default
  ``/dev/shm/tessera/<store>/<path of the durable URL>`` (:func:`default_memory_root`). Every
  rank on a node that saves to the same durable URL uses the same directory, and the memory
  copies nest like the checkpoints: a tier opened on a run's root sees (and its deletes
  reach) the memory copies of the run's step checkpoints.
* **Save.** ``write_file`` writes to memory only. ``write_atomic("manifest.json")`` commits in
  memory, then (``auto_persist=True``) schedules the persistence: exactly the files that
  manifest references are copied to the durable backend, several at a time (never files of an
  earlier save still in memory: the durable manifest may reference those), their durable sizes
  are checked, and the manifest bytes committed in memory are published there last,
  conditionally on the durable manifest being the one there when the persistence started. The
  durable store therefore goes from the old complete checkpoint to the new complete one, with
  the same commit point as a direct save. ``write_atomic`` of any other file (a "latest"
  pointer, timings) writes through to both copies at once.
* **Backpressure.** A commit waits for the process's previous persistence to finish (one
  background thread runs them in order), so at most one checkpoint is being persisted and
  one more being saved at any time, whatever their URLs.
* **Deletes.** ``delete`` removes files from memory at once, but from the durable store only
  once the durable manifest is the one committed in memory (after the pending persistence);
  before that the durable manifest may still refer to them.
* **Load.** The durable manifest decides what is committed: ``read_file``, ``exists``,
  ``size`` and ``list`` see a ``manifest.json`` (at any depth) only in the durable store, or
  while this process is persisting its own commit of it. If the memory directory holds a
  byte-identical ``manifest.json``, data files are read from memory (any file missing there,
  e.g. one written by another node, from the durable store); otherwise from the durable
  store, or from memory for a file not persisted yet. ``list`` and ``exists`` see both
  copies. ``read_file("manifest.json")`` first waits for the pending persistence of the
  memory directory in this process (whichever tier object started it), so a process always
  loads its own last save; nothing else waits, so a save's cleanup right after its commit
  does not block on the durable copy.
* **Crashes.** A crash before the durable commit leaves the durable store at its previous
  checkpoint; the newer memory-only commit is ignored by loads (it can be pushed out with
  :meth:`MemoryTierStorage.persist` by a process restarted on the same node). Files left in
  memory by a crash are not copied (no manifest references them) and are removed by the next
  save's cleanup. The memory directory does not survive a reboot; ``/dev/shm`` counts against RAM.
  At interpreter exit, pending persistence is completed before the process ends.

Multi-node jobs (per-rank persistence): each node has its own ``/dev/shm``, so no single
process sees every file. When ``WORLD_SIZE != LOCAL_WORLD_SIZE`` (or with ``per_rank=True``)
the commit in memory starts nothing; instead ``tessera.save`` calls :meth:`after_commit` on
every rank once the save is committed, and each rank copies *its own* files in the
background, then reports to the durable store with a small marker object
(``.tessera-persist/<save id>/<rank>.ok``, or ``.failed`` with the cause). Rank 0 publishes
the manifest once every rank's ``.ok`` marker is there, and removes the markers; a
``.failed`` marker, or markers still missing after ``commit_timeout_s``, fail rank 0's
persistence and the durable store keeps its previous commit. No collective runs in the
background, so saves return at memory speed on every node. Each rank removes from memory
the files it persisted for the previous save (rank 0's cleanup only reaches its own node).
Without ``tessera.save`` (or with ``auto_persist=False``) the same protocol can be driven by
hand: every rank ``persist(files=<its files>, commit=False).result()``, a barrier, then rank
0 ``persist(files=[], commit=True)``.

Assumption shared with the save pipeline: a file referenced by a committed manifest is never
rewritten in place (a new save writes new file names, then commits, then deletes old files).

Modules, one concept each:

- :mod:`~tessera.storage.memory_tier.paths`: where the memory copy of a durable URL lives,
  and which paths are manifests;
- :mod:`~tessera.storage.memory_tier.registry`: the process-wide state of each memory
  directory and the one persistence thread;
- :mod:`~tessera.storage.memory_tier.markers`: the per-rank marker protocol in the durable store;
- :mod:`~tessera.storage.memory_tier.persistence`: copying to, checking and publishing in the
  durable store;
- :mod:`~tessera.storage.memory_tier.storage`: the :class:`MemoryTierStorage` facade (the
  :class:`~tessera.storage.Storage` methods).
"""

from __future__ import annotations

from .markers import MARKER_DIR
from .paths import MANIFEST, TIER_PREFIX, default_memory_root
from .storage import MemoryTierStorage

__all__ = ["MANIFEST", "MARKER_DIR", "TIER_PREFIX", "MemoryTierStorage", "default_memory_root"]
