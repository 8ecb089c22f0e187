"""Rank 0 assembles the manifest of a save from every rank's :class:`RankReport`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...format.dtypes import dtype_from_name, itemsize
from ...format.manifest import FileEntry, Manifest, PerRankEntry, TensorEntry, TileTable
from ...options import SaveOptions
from ...version import __version__
from ..flat_state import dotted_parents, is_empty_container
from .handoff import RankReport
from .plan import TensorMeta


@dataclass
class _Columns:
    """One tensor's tiles as columns, appended to while reading the reports (no per-tile objects)."""

    file: list[int] = field(default_factory=list)
    offsets: list[tuple[int, ...]] = field(default_factory=list)
    lengths: list[tuple[int, ...]] = field(default_factory=list)
    byte_offset: list[int] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)
    """Number of chunk checksums per tile."""
    sums: list[int] = field(default_factory=list)
    """Every tile's chunk checksums, concatenated."""


def build_manifest(
    world_size: int, metas: tuple[TensorMeta, ...], reports: list[RankReport], save_id: str, opts: SaveOptions
) -> Manifest:
    """The manifest of a save whose ranks reported ``reports`` (rank ``r`` at index ``r``)."""
    cols = {m.fqn: _Columns() for m in metas}
    files: list[FileEntry] = []
    index: dict[str, int] = {}  # under dedup, several ranks may reference one stored file
    for rank, rep in enumerate(reports):
        for f in rep.files:
            fi = index.setdefault(f.path, len(files))
            if fi == len(files):
                files.append(FileEntry(f.path, rank, f.nbytes))
            for fqn, offsets, lengths, byte_offset, sums in zip(
                f.fqns, f.offsets, f.lengths, f.byte_offsets, f.checksums
            ):
                c = cols[fqn]
                c.file.append(fi)
                c.offsets.append(offsets)
                c.lengths.append(lengths)
                c.byte_offset.append(byte_offset)
                c.chunks.append(len(sums))
                c.sums.extend(sums)
    paths = tuple(f.path for f in files)
    tensors = {m.fqn: TensorEntry(m.dtype, m.shape, table=_table(paths, m, cols[m.fqn])) for m in metas}
    values: dict[str, Any] = {}
    per_rank: dict[str, list[Any]] = {}
    policies: dict[str, str] = {}
    for rank, rep in enumerate(reports):
        for k, v in rep.values.values.items():
            values.setdefault(k, v)  # lowest rank wins; plain values are meant to be replicated
        for k, (v, policy) in rep.values.per_rank.items():
            per_rank.setdefault(k, [None] * world_size)[rank] = v
            policies[k] = policy
    for m in metas:
        if m.per_rank is not None:
            policies.setdefault(m.fqn, m.per_rank)
    # A container that is empty on one rank (say, a pipeline stage's share of the model) but
    # holds tensors or values on others is not a value of its own. Only an empty one: a
    # non-empty value beside dotted keys ({"ema.shadow": t, "ema": {"decay": 0.9}}) is kept.
    parents = dotted_parents(list(tensors) + list(values) + list(per_rank))
    values = {k: v for k, v in values.items() if k not in parents or not is_empty_container(v)}
    return Manifest(
        save_id=save_id,
        world_size=world_size,
        chunk_bytes=opts.chunk_bytes,
        tensors=tensors,
        values=values,
        per_rank={k: PerRankEntry(policies[k], tuple(v)) for k, v in per_rank.items()},
        files=tuple(files),
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


def _table(paths: tuple[str, ...], meta: TensorMeta, c: _Columns) -> TileTable:
    """A tensor's tile table, tiles sorted by their offsets."""
    n, nd = len(c.file), len(meta.shape)
    offs = np.array(c.offsets, dtype=np.int64).reshape(n, nd)
    lens = np.array(c.lengths, dtype=np.int64).reshape(n, nd)
    counts = np.array(c.chunks, dtype=np.int64)
    order = np.lexsort(offs.T[::-1]) if nd and n else np.arange(n)
    starts = np.concatenate([[0], np.cumsum(counts)])[:-1]
    sum_arr = np.array(c.sums, dtype=np.uint64)
    new_counts = counts[order]
    new_starts = np.concatenate([[0], np.cumsum(new_counts)])[:-1]
    total = int(new_counts.sum())
    sum_order = np.arange(total) - np.repeat(new_starts, new_counts) + np.repeat(starts[order], new_counts)
    nbytes = (lens.prod(axis=1) if nd else np.ones(n, dtype=np.int64)) * itemsize(dtype_from_name(meta.dtype))
    return TileTable(
        paths,
        np.array(c.file, dtype=np.int64)[order],
        offs[order],
        lens[order],
        np.array(c.byte_offset, dtype=np.int64)[order],
        nbytes[order],
        new_counts,
        sum_arr[sum_order],
    )
