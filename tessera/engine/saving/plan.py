"""Save planning: what each rank holds (local plan) -> who writes what (global plan).

Pure functions, no I/O and no communication. A local plan is a compact numpy table of the
boxes a rank holds; the coordinator merges all of them, de-duplicates replicas, checks
that every tensor is covered exactly once, splits large replicated boxes so that writing
is balanced across their holders, and hands each rank a table of the boxes it writes and
which of its files each goes to. Tables stay numpy so that thousands of ranks times
thousands of tensors plan in seconds.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace

import numpy as np

from ...errors import CoverageError
from ...format.dtypes import dtype_from_name, dtype_name, itemsize
from ...format.geometry import Box, check_box_coverage, check_flat_coverage, split_even
from ...options import PlanOptions
from ..flat_state import FlatState


@dataclass(frozen=True)
class TensorMeta:
    """What every rank must agree on about a global tensor."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    per_rank: str | None = None
    """The resize policy of a :func:`tessera.per_rank` tensor, else None."""


@dataclass(frozen=True)
class LocalPlan:
    """The boxes one rank holds, as a numpy table.

    Attributes:
        rank: the rank.
        metas: tensors the rank holds, indexed by the first column of ``boxes``.
        boxes: ``(n, 1 + 2 * ndim)`` int64 rows ``[meta index, offsets..., lengths...]``;
            tensors of lower rank are padded with offset 0 and length 1.
        flats: ``(m, 3)`` rows ``[meta index, start, stop]`` of FlatShard ranges.
        fingerprint: a hash of the above; equal fingerprints mean an unchanged structure.
        metas_digest: a hash of ``metas`` alone, so the coordinator unifies identical
            tensor tables (the common case) once instead of once per rank.
    """

    rank: int
    metas: tuple[TensorMeta, ...]
    boxes: np.ndarray
    flats: np.ndarray
    fingerprint: str
    metas_digest: str = ""
    replicas: np.ndarray | None = None
    """``(n, 2)`` rows ``[index, count]``: this rank's place among the holders of each box (row
    of ``boxes``), where global facts give it; None if some box's holders are not known
    locally (then the plan needs the other ranks' local plans)."""

    @property
    def derivable(self) -> bool:
        """Whether this rank can compute its share of the global plan alone (see :func:`derive_rank_plan`)."""
        return self.replicas is not None and not len(self.flats)


@dataclass(frozen=True)
class RankPlan:
    """What one rank writes: rows ``[meta index, offsets..., lengths..., file]`` into ``metas``."""

    metas: tuple[TensorMeta, ...]
    rows: np.ndarray
    ndim: int
    num_files: int
    unshared: frozenset[str] = frozenset()
    """Tensors of which this rank holds a box no other rank holds (a gathered plan knows them):
    its copy of such a plain tensor is no replica, so it needs no replica digest."""

    def items(self) -> list[tuple[str, Box, int]]:
        """``(fqn, box, file index)`` of every box this rank writes, in file order."""
        out = []
        for row in self.rows.tolist():
            meta = self.metas[row[0]]
            nd = len(meta.shape)
            box = Box(tuple(row[1 : 1 + nd]), tuple(row[1 + self.ndim : 1 + self.ndim + nd]))
            out.append((meta.fqn, box, row[-1]))
        return out


@dataclass(frozen=True)
class GlobalPlan:
    """The coordinator's plan: the tensor table and every rank's :class:`RankPlan`."""

    metas: tuple[TensorMeta, ...]
    rank_plans: tuple[RankPlan, ...]
    fingerprints: tuple[str, ...]

    @property
    def bytes_per_rank(self) -> list[int]:
        out = []
        for rp in self.rank_plans:
            total = 0
            for row in rp.rows.tolist():
                m = rp.metas[row[0]]
                total += math.prod(row[1 + rp.ndim : 1 + rp.ndim + len(m.shape)]) * itemsize(dtype_from_name(m.dtype))
            out.append(total)
        return out


def build_local_plan(flat: FlatState, rank: int) -> LocalPlan:
    """Describe what this rank holds (tensor pieces only; plain values travel at commit).

    Raises:
        ValueError: if two pieces of one tensor disagree on dtype or shape on this rank.
    """
    index: dict[str, int] = {}
    metas: list[TensorMeta] = []
    for p in flat.tensors:
        meta = TensorMeta(p.fqn, dtype_name(p.dtype), tuple(p.shape), p.per_rank.value if p.per_rank else None)
        i = index.get(p.fqn)
        if i is None:
            index[p.fqn] = len(metas)
            metas.append(meta)
        elif metas[i] != meta:
            raise ValueError(f"tensor '{p.fqn}' appears twice on rank {rank} with different dtype/shape")
    nd = max((len(m.shape) for m in metas), default=0)
    boxes = np.zeros((len(flat.tensors), 1 + 2 * nd), dtype=np.int64)
    boxes[:, 1 + nd :] = 1
    flats = []
    for row, p in enumerate(flat.tensors):
        i = index[p.fqn]
        boxes[row, 0] = i
        k = p.box.ndim
        boxes[row, 1 : 1 + k] = p.box.offsets
        boxes[row, 1 + nd : 1 + nd + k] = p.box.lengths
        if p.flat is not None:
            flats.append((i, *p.flat))
    flat_arr = np.array(sorted(set(flats)), dtype=np.int64).reshape(-1, 3)
    replicas = None
    if all(p.replica is not None for p in flat.tensors):
        replicas = np.array([p.replica for p in flat.tensors], dtype=np.int64).reshape(-1, 2)
    metas_digest = hashlib.blake2b(repr(metas).encode(), digest_size=16).hexdigest()
    h = hashlib.blake2b(digest_size=16)
    h.update(metas_digest.encode())
    h.update(boxes.tobytes())
    h.update(flat_arr.tobytes())
    h.update(b"-" if replicas is None else replicas.tobytes())
    return LocalPlan(rank, tuple(metas), boxes, flat_arr, h.hexdigest(), metas_digest, replicas)


def derive_rank_plan(local: LocalPlan, world: int, options: PlanOptions | None = None) -> RankPlan:
    """This rank's share of the global plan, computed from its own local plan alone.

    For layouts where every rank knows who else holds each of its boxes (see
    :attr:`LocalPlan.derivable`) and every rank has the same tensor table (the ranks check a
    digest): a box held once is written by its holder; a replicated box is cut into slabs as
    :func:`build_global_plan` would and holder ``i`` of ``k`` writes slab ``i`` (rotated per
    box, so small boxes that stay whole spread over their holders), which balances the bytes
    within every replica group with no communication. Coverage is not checked here (it needs
    every rank's boxes): rank 0 checks it on the manifest before committing.
    """
    options = options or PlanOptions()
    assert local.replicas is not None, "derive_rank_plan needs a derivable local plan"
    metas, b = local.metas, local.boxes
    nd = (b.shape[1] - 1) // 2
    sizes = np.array([itemsize(dtype_from_name(m.dtype)) for m in metas], dtype=np.int64)
    total = sum(math.prod(m.shape) * int(sizes[i]) for i, m in enumerate(metas))
    piece_bytes = max(options.min_split_bytes, total // max(1, 4 * world))
    nbytes = b[:, 1 + nd :].prod(axis=1) * sizes[b[:, 0]] if len(b) else np.zeros(0, dtype=np.int64)
    rows: list[np.ndarray] = []
    for j in np.flatnonzero(nbytes > 0):
        index, count = (int(x) for x in local.replicas[j])
        row = np.append(b[j], 0)
        if count == 1:
            rows.append(row)
            continue
        slabs = _split_replicated(row, nd, int(nbytes[j]), count, piece_bytes)
        turn = int.from_bytes(
            hashlib.blake2b(row.tobytes() + metas[row[0]].fqn.encode(), digest_size=4).digest(), "little"
        )
        rows.extend(slab for s, slab in enumerate(slabs) if (s + turn) % count == index)
    table = np.array(rows, dtype=np.int64).reshape(-1, 2 + 2 * nd)
    table = table[np.lexsort((table[:, 1] if nd else np.zeros(len(table)), table[:, 0]))] if len(table) else table
    return _with_files(table, sizes, nd, metas, options)


def build_global_plan(local_plans: list[LocalPlan], options: PlanOptions | None = None) -> GlobalPlan:
    """Merge every rank's local plan into who-writes-what.

    Raises:
        CoverageError: a tensor is not covered exactly once, or ranks disagree on a
            tensor's dtype or shape (the message names the tensor and the ranks).
    """
    options = options or PlanOptions()
    world = len(local_plans)
    metas, remap = _unify_metas(local_plans)
    nd = max((len(m.shape) for m in metas), default=0)

    # One table of every held box: [tensor, rank, offsets(nd), lengths(nd)].
    parts = []
    for lp in local_plans:
        b = lp.boxes
        if not len(b):
            continue
        lnd = (b.shape[1] - 1) // 2
        rows = np.zeros((len(b), 2 + 2 * nd), dtype=np.int64)
        rows[:, 2 + nd :] = 1
        rows[:, 0] = remap[lp.rank][b[:, 0]]
        rows[:, 1] = lp.rank
        rows[:, 2 : 2 + lnd] = b[:, 1 : 1 + lnd]
        rows[:, 2 + nd : 2 + nd + lnd] = b[:, 1 + lnd :]
        parts.append(rows)
    table = np.concatenate(parts) if parts else np.zeros((0, 2 + 2 * nd), dtype=np.int64)
    if nd:
        table = table[table[:, 2 + nd :].prod(axis=1) > 0]  # empty boxes hold nothing to write

    # Group identical boxes (replicas): sort by [tensor, offsets, lengths], then by rank.
    keys = np.concatenate([table[:, :1], table[:, 2:]], axis=1)
    order = np.lexsort((table[:, 1],) + tuple(keys[:, c] for c in range(keys.shape[1] - 1, -1, -1)))
    table, keys = table[order], keys[order]
    new_group = np.ones(len(table), dtype=bool)
    if len(table) > 1:
        new_group[1:] = (keys[1:] != keys[:-1]).any(axis=1)
    starts = np.flatnonzero(new_group)
    uniq = keys[starts]  # [tensor, offsets, lengths]
    counts = np.diff(np.append(starts, len(table)))

    _check_coverage(metas, uniq, nd, local_plans, remap)

    sizes = np.array([itemsize(dtype_from_name(m.dtype)) for m in metas], dtype=np.int64)
    nbytes = uniq[:, 1 + nd :].prod(axis=1) * sizes[uniq[:, 0]] if len(uniq) else np.zeros(0, dtype=np.int64)

    load = np.zeros(world, dtype=np.int64)
    single = counts == 1
    writers_single = table[starts[single], 1]
    np.add.at(load, writers_single, nbytes[single])
    out_rows = [np.concatenate([uniq[single], writers_single[:, None]], axis=1)]

    # Replicated boxes: split large ones, then greedily give each piece to its least loaded holder.
    piece_bytes = max(options.min_split_bytes, int(nbytes.sum()) // max(1, 4 * world))
    pieces: list[tuple[int, np.ndarray, np.ndarray]] = []  # (bytes, row, holders)
    for g in np.flatnonzero(~single):
        holders = table[starts[g] : starts[g] + counts[g], 1]
        for piece in _split_replicated(uniq[g], nd, int(nbytes[g]), len(holders), piece_bytes):
            pieces.append((int(piece[1 + nd :].prod() * sizes[piece[0]]), piece, holders))
    pieces.sort(key=lambda p: -p[0])
    rep_rows = np.zeros((len(pieces), 2 + 2 * nd), dtype=np.int64)
    for i, (piece_nbytes, row, holders) in enumerate(pieces):
        w = holders[np.argmin(load[holders])]
        load[w] += piece_nbytes
        rep_rows[i, :-1] = row
        rep_rows[i, -1] = w
    out_rows.append(rep_rows)
    assigned = np.concatenate(out_rows)  # [tensor, offsets, lengths, writer]

    rank_plans = _split_by_rank(assigned, metas, sizes, nd, world, local_plans, remap, options)
    held_once: list[set[str]] = [set() for _ in range(world)]
    for meta, writer in zip(uniq[single, 0].tolist(), writers_single.tolist()):
        held_once[writer].add(metas[meta].fqn)
    rank_plans = [replace(rp, unshared=frozenset(held_once[lp.rank])) for lp, rp in zip(local_plans, rank_plans)]
    return GlobalPlan(tuple(metas), tuple(rank_plans), tuple(lp.fingerprint for lp in local_plans))


def _unify_metas(local_plans: list[LocalPlan]) -> tuple[list[TensorMeta], dict[int, np.ndarray]]:
    """The global tensor table and, per rank, local meta index -> global index."""
    index: dict[str, int] = {}
    metas: list[TensorMeta] = []
    owner: list[int] = []
    remap: dict[int, np.ndarray] = {}
    cache: dict[object, np.ndarray] = {}
    for lp in local_plans:
        key = lp.metas_digest or lp.metas
        hit = cache.get(key)
        if hit is not None:
            remap[lp.rank] = hit
            continue
        ids = np.empty(len(lp.metas), dtype=np.int64)
        for j, m in enumerate(lp.metas):
            i = index.get(m.fqn)
            if i is None:
                i = index[m.fqn] = len(metas)
                metas.append(m)
                owner.append(lp.rank)
            elif metas[i] != m:
                o = metas[i]
                raise CoverageError(
                    f"tensor '{m.fqn}': rank {owner[i]} has dtype {o.dtype} shape {list(o.shape)} but rank {lp.rank} "
                    f"has dtype {m.dtype} shape {list(m.shape)}; every rank must agree on the global tensor"
                )
            ids[j] = i
        cache[key] = ids
        remap[lp.rank] = ids
    return metas, remap


def _check_coverage(
    metas: list[TensorMeta], uniq: np.ndarray, nd: int, local_plans: list[LocalPlan], remap: dict[int, np.ndarray]
) -> None:
    flat_parts = [
        np.column_stack([remap[lp.rank][lp.flats[:, 0]], lp.flats[:, 1:]]) for lp in local_plans if len(lp.flats)
    ]
    flats = np.concatenate(flat_parts) if flat_parts else np.zeros((0, 3), dtype=np.int64)
    flat_tensors = set(np.unique(flats[:, 0]).tolist())
    bounds = (
        np.searchsorted(uniq[:, 0], np.arange(len(metas) + 1))
        if len(uniq)
        else np.zeros(len(metas) + 1, dtype=np.int64)
    )
    for t, m in enumerate(metas):
        k = len(m.shape)
        rows = uniq[bounds[t] : bounds[t + 1]]
        if t in flat_tensors:
            # Ranges are checked as ranges; their boxes are disjoint by construction. A tensor
            # held both as flat ranges and as boxes is checked as boxes below.
            fr = np.unique(flats[flats[:, 0] == t][:, 1:], axis=0)
            covered = int((fr[:, 1] - fr[:, 0]).sum())
            box_volume = int(rows[:, 1 + nd : 1 + nd + k].prod(axis=1).sum()) if len(rows) else 0
            if covered == box_volume:
                check_flat_coverage(m.fqn, math.prod(m.shape), fr)
                continue
        check_box_coverage(m.fqn, m.shape, rows[:, 1 : 1 + k], rows[:, 1 + nd : 1 + nd + k])


def _split_replicated(row: np.ndarray, nd: int, nbytes: int, holders: int, piece_bytes: int) -> list[np.ndarray]:
    """Cut a replicated box (a plan row) into slabs of about ``piece_bytes`` (at most one per holder)."""
    if nbytes <= piece_bytes or holders < 2:
        return [row]
    box = Box(tuple(int(x) for x in row[1 : 1 + nd]), tuple(int(x) for x in row[1 + nd : 1 + 2 * nd]))
    slabs = split_even(box, min(holders, -(-nbytes // piece_bytes)))
    if len(slabs) == 1:
        return [row]
    out = []
    for slab in slabs:
        piece = row.copy()
        piece[1 : 1 + nd] = slab.offsets
        piece[1 + nd : 1 + 2 * nd] = slab.lengths
        out.append(piece)
    return out


def _split_by_rank(
    assigned: np.ndarray,
    metas: list[TensorMeta],
    sizes: np.ndarray,
    nd: int,
    world: int,
    local_plans: list[LocalPlan],
    remap: dict[int, np.ndarray],
    options: PlanOptions,
) -> list[RankPlan]:
    """Each rank's rows (in its own meta indices), in tensor order, with a file per row."""
    order = np.lexsort((assigned[:, 1] if nd else np.zeros(len(assigned)), assigned[:, 0], assigned[:, -1]))
    assigned = assigned[order]
    bounds = np.searchsorted(assigned[:, -1], np.arange(world + 1))
    inverse_cache: dict[int, np.ndarray] = {}
    plans = []
    for lp in local_plans:
        r = lp.rank
        rows = assigned[bounds[r] : bounds[r + 1]]
        ids = remap[r]
        inv = inverse_cache.get(id(ids))
        if inv is None:
            inv = np.full(len(metas), -1, dtype=np.int64)
            inv[ids] = np.arange(len(ids))
            inverse_cache[id(ids)] = inv
        lnd = (lp.boxes.shape[1] - 1) // 2
        out = np.empty((len(rows), 2 + 2 * lnd), dtype=np.int64)
        out[:, 0] = inv[rows[:, 0]]
        out[:, 1 : 1 + lnd] = rows[:, 1 : 1 + lnd]
        out[:, 1 + lnd : 1 + 2 * lnd] = rows[:, 1 + nd : 1 + nd + lnd]
        plans.append(_with_files(out, sizes[ids], lnd, lp.metas, options))
    return plans


def _with_files(
    rows: np.ndarray, sizes: np.ndarray, nd: int, metas: tuple[TensorMeta, ...], options: PlanOptions
) -> RankPlan:
    """A rank's plan from its rows ``[meta, offsets, lengths, -]`` (meta indices into ``metas``,
    item sizes in ``sizes``): consecutive rows fill the rank's files in turn, so each file holds
    about an equal share of its bytes."""
    nb = rows[:, 1 + nd : 1 + 2 * nd].prod(axis=1) * sizes[rows[:, 0]] if len(rows) else np.zeros(0, dtype=np.int64)
    total = int(nb.sum())
    files = max(1, min(options.files_per_rank, total // max(1, options.min_file_bytes)))
    rows[:, -1] = np.minimum(files - 1, (np.cumsum(nb) - nb) * files // max(1, total)) if len(rows) else 0
    return RankPlan(metas, rows, nd, files)
