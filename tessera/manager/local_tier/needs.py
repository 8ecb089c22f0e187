"""Which of a checkpoint's files a rank will read: what a node must fetch before a recovery.

The geometry is the load's own: each tensor piece the rank's state holds (its box) is
intersected with the saved tiles of that tensor, and the files of the overlapping tiles
are needed. It errs on the side of more files: a piece the load would broadcast instead of
read (``LoadOptions.broadcast_replicated``) counts on every rank, per-rank tensors need all
of their files, and if the state cannot be examined here every file is needed (the load
itself then reports what is wrong with the state).
"""

from __future__ import annotations

import logging

import numpy as np

from ...engine.flat_state import flatten
from ...format.manifest import Manifest

logger = logging.getLogger(__name__)


def needed_files(state: object, m: Manifest, *, rank: int, world_size: int) -> np.ndarray:
    """A boolean mask over ``m.files``: the files this rank's load will read. Not collective."""
    index = {f.path: i for i, f in enumerate(m.files)}
    mask = np.zeros(len(m.files), dtype=bool)
    try:
        flat = flatten(state, rank=rank, world_size=world_size, for_load=True, manifest=m)
        for piece in flat.tensors:
            entry = m.tensors.get(piece.fqn)
            if entry is None:
                continue
            table = entry.table
            if len(table) == 0:
                continue
            files = np.asarray([index[p] for p in table.paths], dtype=np.int64)[table.file]
            if piece.per_rank is not None or tuple(entry.shape) != tuple(piece.shape):
                mask[files] = True  # per-rank rows are picked by the load's policy; a mismatch fails there
                continue
            lo = np.maximum(table.offsets, np.asarray(piece.box.offsets, dtype=np.int64))
            hi = np.minimum(
                table.offsets + table.lengths, np.asarray(piece.box.offsets, dtype=np.int64) + piece.box.lengths
            )
            hit = (hi > lo).all(axis=1) if table.offsets.shape[1] else np.ones(len(table), dtype=bool)
            mask[files[hit]] = True
    except Exception as e:  # the load reports it properly; here, fetch everything
        logger.debug("rank %d: cannot tell which files the load reads (%s); fetching all", rank, e)
        mask[:] = True
    return mask
