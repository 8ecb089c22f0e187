"""Rank 0 assembles the manifest of a save from every rank's :class:`RankReport`."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import torch

from ...errors import CheckpointError
from ...format.chunking import Chunking
from ...format.dtypes import dtype_from_name, itemsize
from ...format.geometry import check_box_coverage
from ...format.manifest import FileEntry, Manifest, PerRankEntry, TensorEntry, TileTable
from ...format.rank_report import RankReportDoc
from ...options import SaveOptions
from ...version import __version__
from ..flat_state import dotted_parents, is_empty_container
from .plan import TensorMeta


def build_manifest(
    world_size: int, metas: tuple[TensorMeta, ...], reports: list[RankReportDoc], save_id: str, opts: SaveOptions
) -> Manifest:
    """The manifest of a save whose ranks reported ``reports`` (rank ``r`` at index ``r``).

    Tiles are merged as numpy columns (one concatenation, one sort), never one object per tile.

    Raises:
        CheckpointError: a report names a tensor the plan does not have (a rank saved a
            different structure than it planned).
    """
    meta_index = {m.fqn: i for i, m in enumerate(metas)}
    nd = max((len(m.shape) for m in metas), default=0)
    files: list[FileEntry] = []
    file_index: dict[str, int] = {}  # under dedup, several ranks may reference one stored file
    name_maps: dict[tuple[str, ...], np.ndarray] = {}
    parts: list[tuple[np.ndarray, ...]] = []
    for rank, rep in enumerate(reports):
        t = rep.tiles
        if t is None or not len(t):
            continue
        names = name_maps.get(t.names)
        if names is None:
            check_planned(rank, t.names, meta_index)
            names = name_maps[t.names] = np.array([meta_index[n] for n in t.names], dtype=np.int64)
        fmap = np.empty(len(t.files), dtype=np.int64)
        for j, (path, nbytes) in enumerate(t.files):
            fi = file_index.setdefault(path, len(files))
            if fi == len(files):
                files.append(FileEntry(path, rank, nbytes, t.frames[j] if t.frames else None))
            fmap[j] = fi
        k = t.offsets.shape[1]
        offs = np.zeros((len(t), nd), dtype=np.int64)
        lens = np.ones((len(t), nd), dtype=np.int64)
        offs[:, :k], lens[:, :k] = t.offsets[:, :nd], t.lengths[:, :nd]
        parts.append((names[t.name], fmap[t.file], offs, lens, t.byte_offset, t.chunks, t.checksums))
    paths = tuple(f.path for f in files)
    tensors = {m.fqn: TensorEntry(m.dtype, m.shape, table=t) for m, t in zip(metas, _tables(paths, metas, nd, parts))}
    rest = manifest_without_tiles(world_size, metas, reports, save_id, opts)
    return dataclasses.replace(rest, tensors=tensors, files=tuple(files))


def manifest_without_tiles(
    world_size: int, metas: tuple[TensorMeta, ...], reports: list[RankReportDoc], save_id: str, opts: SaveOptions
) -> Manifest:
    """The manifest of a save without its tensors and files: values, per-rank values, layout,
    timings and metadata from the ranks' reports."""
    values: dict[str, Any] = {}
    per_rank: dict[str, list[Any]] = {}
    policies: dict[str, str] = {}
    for rank, rep in enumerate(reports):
        for k, v in rep.values.items():
            values.setdefault(k, v)  # lowest rank wins; plain values are meant to be replicated
        for k, (v, policy) in rep.per_rank.items():
            per_rank.setdefault(k, [None] * world_size)[rank] = v
            policies[k] = policy
    for m in metas:
        if m.per_rank is not None:
            policies.setdefault(m.fqn, m.per_rank)
    # A container that is empty on one rank (say, a pipeline stage's share of the model) but
    # holds tensors or values on others is not a value of its own. Only an empty one: a
    # non-empty value beside dotted keys ({"ema.shadow": t, "ema": {"decay": 0.9}}) is kept.
    parents = dotted_parents([m.fqn for m in metas] + list(values) + list(per_rank))
    values = {k: v for k, v in values.items() if k not in parents or not is_empty_container(v)}
    return Manifest(
        save_id=save_id,
        world_size=world_size,
        chunk_bytes=opts.chunk_bytes,
        chunking=Chunking.for_options(opts),
        tensors={},
        values=values,
        per_rank={k: PerRankEntry(policies[k], tuple(v)) for k, v in per_rank.items()},
        files=(),
        layout={"world_size": world_size, **opts.layout},
        timings={"save": {"ranks": {str(r): rep.timings for r, rep in enumerate(reports)}}},
        metadata={
            "tessera_version": __version__,
            "torch_version": torch.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "tensor_policies": {m.fqn: m.per_rank for m in metas if m.per_rank},
            **opts.metadata,
        },
    )


def _tables(
    paths: tuple[str, ...], metas: tuple[TensorMeta, ...], nd: int, parts: list[tuple[np.ndarray, ...]]
) -> list[TileTable]:
    """Every tensor's tile table, tiles sorted by their offsets."""
    if parts:
        meta, file, offs, lens, byte_offset, chunks, sums = (np.concatenate(c) for c in zip(*parts))
    else:
        meta = file = byte_offset = chunks = np.zeros(0, dtype=np.int64)
        offs = lens = np.zeros((0, nd), dtype=np.int64)
        sums = np.zeros(0, dtype=np.uint64)
    starts = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int64)
    order = np.argsort(meta, kind="stable")
    bounds = np.searchsorted(meta[order], np.arange(len(metas) + 1))
    out = []
    for i, m in enumerate(metas):
        rows = order[bounds[i] : bounds[i + 1]]
        k = len(m.shape)
        if k and len(rows) > 1:  # by offsets, first dimension first
            rows = rows[np.lexsort(offs[rows, :k].T[::-1])]
        counts = chunks[rows]
        total = int(counts.sum())
        new_starts = np.concatenate([[0], np.cumsum(counts)])[:-1].astype(np.int64)
        sum_rows = np.arange(total, dtype=np.int64) - np.repeat(new_starts, counts) + np.repeat(starts[rows], counts)
        row_lens = lens[rows, :k]
        nbytes = (row_lens.prod(axis=1) if k else np.ones(len(rows), dtype=np.int64)) * itemsize(
            dtype_from_name(m.dtype)
        )
        out.append(
            TileTable(paths, file[rows], offs[rows, :k], row_lens, byte_offset[rows], nbytes, counts, sums[sum_rows])
        )
    return out


def check_coverage(manifest: Manifest) -> None:
    """Raise unless every tensor's tiles cover it exactly once (for plans no rank checked whole).

    Raises:
        CoverageError: naming the tensor and the gap or overlap.
    """
    for fqn, entry in manifest.tensors.items():
        t = entry.table
        check_box_coverage(fqn, entry.shape, t.offsets, t.lengths)


def check_planned(rank: int, names: tuple[str, ...], meta_index: dict[str, int]) -> None:
    """Raise if ``rank`` reported tiles of a tensor the save's plan does not hold."""
    unknown = [n for n in names if n not in meta_index]
    if unknown:
        raise CheckpointError(
            f"rank {rank} reported tiles of tensors the save did not plan: {unknown[:3]}; its state "
            "changed between planning and writing"
        )
