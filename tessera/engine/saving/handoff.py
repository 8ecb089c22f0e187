"""The typed hand-offs between the phases of a save, in the order a save meets them.

request (:class:`SaveRequest`) -> prepare step (:class:`PrepareReport` from every rank)
-> plan (:class:`SavePlan`, the coordinator's :class:`PlanAssignment` per rank)
-> :class:`PreparedSave` -> claim (rank 0) -> write (each rank's files, as
:class:`FileReport` s, in its :class:`~tessera.format.rank_report.RankReportDoc`)
-> commit (:class:`CommitOutcome` on rank 0).

All are frozen dataclasses; those crossing ranks are picklable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...format.chunking import Chunking
from ...format.codec import FrameTable
from ...format.rank_report import RankReportDoc, ReportTiles
from ...format.tilefile import FileLayout
from ...options import SaveOptions
from ...storage import Storage
from ..flat_state import FlatState
from .plan import RankPlan, TensorMeta
from .replicas import ReplicaDigests
from .tile_index import Dedup
from .write import WrittenFile


@dataclass(frozen=True)
class SaveRequest:
    """One call of ``save`` or ``async_save``, as the public API received it."""

    path: str
    """Directory or URL of the checkpoint."""
    state: object
    """The state to save (see :func:`tessera.save`)."""
    process_group: Any = None
    """The ranks taking part; None: all."""
    storage: Storage | None = None
    """A backend to use instead of choosing one from ``path``."""
    allow_pickle: bool = False
    """Store values that are not plain."""
    options: SaveOptions | None = None
    """Tunables; None: the defaults."""
    storage_options: dict[str, Any] | None = None
    """Backend options when ``storage`` is None."""
    background: bool = False
    """Write and commit in a background thread (``async_save``)."""
    dedup: Dedup | None = None
    """Write into a root's shared tile directory, referencing unchanged tiles (the manager's ``dedup``)."""


@dataclass(frozen=True)
class EncodedValues:
    """A rank's plain values, encoded when the save was called (the caller may change them later)."""

    values: dict[str, Any]
    """Replicated plain values by key (the lowest rank's copy is kept)."""
    per_rank: dict[str, tuple[Any, str]]
    """Rank-local values by key: (encoded value, resize policy)."""


@dataclass(frozen=True)
class PrepareReport:
    """What each rank announces in the prepare step."""

    plan_id: str | None
    """Id of this rank's cached global plan for its structure, if it has one."""
    save_id: str | None
    """A fresh save id (rank 0's is used)."""
    location: str | None
    """Where this rank's storage writes (all ranks must agree)."""


@dataclass(frozen=True)
class PlanAssignment:
    """The coordinator's answer to one rank in the plan step."""

    plan_id: str
    rank_plan: RankPlan


@dataclass(frozen=True)
class SavePlan:
    """A rank's share of a global plan, as cached per process group for later saves."""

    plan_id: str
    fingerprint: str
    """The local plan's fingerprint: an unchanged structure reuses the plan."""
    rank_plan: RankPlan
    layouts: tuple[FileLayout, ...]
    """The data files this rank writes, in order."""
    metas: tuple[TensorMeta, ...] | None
    """The global tensor table (rank 0 only; None elsewhere)."""
    derived: bool = False
    """Each rank planned alone (no exchange checked coverage): rank 0 checks it before committing."""


@dataclass(frozen=True)
class PreparedSave:
    """Everything a rank knows once the prepare and plan steps succeeded."""

    path: str
    store: Storage
    save_id: str
    plan: SavePlan
    plan_cached: bool
    flat: FlatState
    values: EncodedValues
    options: SaveOptions
    dedup: Dedup | None = None
    location: str = ""
    """Where this rank's storage writes (every rank must agree: checked in the save's vote)."""
    forget_plans: Callable[[], None] | None = None
    """Drops this process group's cached plans (the ranks' plans disagreed: all plan again)."""
    background: bool = False
    """An ``async_save`` (its caller may change the state: it cannot start over)."""
    replicas: ReplicaDigests | None = None
    """This rank's digests of its copies of plain tensors, taken at the call (:mod:`.replicas`)."""

    @property
    def chunking(self) -> Chunking:
        """How this save cuts each tile into checksum chunks (per tile where it may compress)."""
        return Chunking.for_options(self.options)


@dataclass(frozen=True)
class FileReport:
    """A data file one rank wrote, as rank 0 needs it for the manifest.

    The tiles are named columns of plain tuples (index ``i`` of each is tile ``i``), not
    one object per tile: a rank may report tens of thousands of tiles, and plain tuples
    pickle an order of magnitude faster than dataclasses.
    """

    path: str
    nbytes: int
    fqns: tuple[str, ...]
    offsets: tuple[tuple[int, ...], ...]
    lengths: tuple[tuple[int, ...], ...]
    byte_offsets: tuple[int, ...]
    checksums: tuple[tuple[int, ...], ...]
    """Each tile's chunk checksums (xxh3-64), in order."""
    frames: FrameTable | None = None
    """A compressed file's frame table (:mod:`tessera.format.codec`); None for a plain file."""

    @classmethod
    def of(cls, written: WrittenFile, path: str | None = None) -> FileReport:
        """The report of a file :func:`tessera.engine.saving.write.write_tiles` wrote (as ``path``
        in the manifest, when it differs from where it was written)."""
        tiles = written.tiles
        return cls(
            path=written.path if path is None else path,
            nbytes=written.nbytes,
            fqns=tuple(t.fqn for t in tiles),
            offsets=tuple(t.box.offsets for t in tiles),
            lengths=tuple(t.box.lengths for t in tiles),
            byte_offsets=tuple(t.byte_offset for t in tiles),
            checksums=tuple(t.checksums for t in tiles),
            frames=written.frames,
        )


def rank_report(
    rank: int,
    save_id: str,
    files: Sequence[FileReport],
    values: EncodedValues,
    timings: dict[str, float],
    replicas: ReplicaDigests | None = None,
) -> RankReportDoc:
    """What rank ``rank`` reports once its files are durable, as columns (see :mod:`tessera.format.rank_report`)."""
    names = tuple(dict.fromkeys(fqn for f in files for fqn in f.fqns))
    name_of = {n: i for i, n in enumerate(names)}
    nd = max((len(o) for f in files for o in f.offsets), default=0)
    n = sum(len(f.fqns) for f in files)
    offs = np.zeros((n, nd), dtype=np.int64)
    lens = np.ones((n, nd), dtype=np.int64)
    file = np.empty(n, dtype=np.int64)
    name = np.empty(n, dtype=np.int64)
    byte_offset = np.empty(n, dtype=np.int64)
    chunks = np.empty(n, dtype=np.int64)
    row = 0
    for fi, f in enumerate(files):
        for fqn, o, ln, bo, sums in zip(f.fqns, f.offsets, f.lengths, f.byte_offsets, f.checksums):
            offs[row, : len(o)] = o
            lens[row, : len(ln)] = ln
            file[row], name[row], byte_offset[row], chunks[row] = fi, name_of[fqn], bo, len(sums)
            row += 1
    sums_all = np.fromiter((c for f in files for s in f.checksums for c in s), dtype=np.uint64)
    tiles = ReportTiles(
        tuple((f.path, f.nbytes) for f in files),
        names,
        file,
        name,
        offs,
        lens,
        byte_offset,
        chunks,
        sums_all,
        tuple(f.frames for f in files) if any(f.frames is not None for f in files) else (),
    )
    copies = None if replicas is None else (replicas.names, replicas.resolve())
    return RankReportDoc(rank, save_id, tiles, values.values, values.per_rank, timings, copies)


@dataclass(frozen=True)
class CommitOutcome:
    """What rank 0 announces once the manifest is published."""

    total_bytes: int
    """Bytes the save wrote (referenced shared tiles excluded)."""
    rank_timings: dict[int, dict[str, float]]
    shared_dirs: frozenset[str] = frozenset()
    """Under dedup: every shared directory the manifest references (what the next save pins)."""
