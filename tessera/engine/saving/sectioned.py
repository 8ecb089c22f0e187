"""Rank 0 commits a large save in format version 2 from the ranks' own sections.

Each rank encoded its manifest section when it wrote its report
(:func:`tessera.format.rank_report.split_tiles`); rank 0 reads only the reports' headers and
geometry (:func:`tessera.format.rank_report.decode_report` without details), joins the
sections' bytes as they are, in rank order, and builds the index from the geometry: one stable
grouping of every tile by tensor (a rank's tiles of a tensor keep the order its section lists
them in), the geometry blocks, and the section table. No tile's byte offset or checksum is
decoded or encoded again at rank 0.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ...errors import CheckpointError
from ...format.geometry import check_box_coverage
from ...format.manifest import EncodedSections, FileEntry, build_index, manifest_tail
from ...format.rank_report import RankReportDoc, report_parts
from ...options import SaveOptions
from .assemble import build_manifest
from .plan import TensorMeta


def tile_count(reports: list[RankReportDoc]) -> int:
    """Tiles the ranks reported in all."""
    n = 0
    for rep in reports:
        geo = rep.geometry if rep.geometry is not None else rep.tiles
        n += len(geo) if geo is not None else 0
    return n


def build_sectioned(
    world_size: int,
    metas: tuple[TensorMeta, ...],
    reports: list[RankReportDoc],
    save_id: str,
    opts: SaveOptions,
    *,
    check_coverage: bool = False,
) -> EncodedSections:
    """The version 2 manifest of a save whose ranks reported ``reports`` (rank ``r`` at index ``r``).

    Args:
        check_coverage: check that every tensor's tiles cover it exactly once (for plans no
            rank checked whole).

    Raises:
        CheckpointError: a report names a tensor the plan does not have.
        CoverageError: with ``check_coverage``, naming the tensor and the gap or overlap.
    """
    meta_index = {m.fqn: i for i, m in enumerate(metas)}
    nd = max((len(m.shape) for m in metas), default=0)
    lists: dict[tuple[str, ...], tuple[int, np.ndarray]] = {}
    files: list[FileEntry] = []
    blobs: list[bytes] = []
    ranks: list[int] = []
    section_lists: list[int] = []
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, int]] = []
    for rank, rep in enumerate(reports):
        geo, blob = report_parts(rep)
        if geo is None or blob is None or not geo.files:
            continue
        hit = lists.get(geo.names)
        if hit is None:
            unknown = [n for n in geo.names if n not in meta_index]
            if unknown:
                raise CheckpointError(
                    f"rank {rank} reported tiles of tensors the save did not plan: {unknown[:3]}; its state "
                    "changed between planning and writing"
                )
            hit = lists[geo.names] = (len(lists), np.array([meta_index[n] for n in geo.names], dtype=np.int64))
        files.extend(FileEntry(p, rank, n) for p, n in geo.files)
        section_lists.append(hit[0])
        ranks.append(rank)
        blobs.append(blob)
        if len(geo):
            k = geo.offsets.shape[1]
            offs = np.zeros((len(geo), nd), dtype=np.int64)
            lens = np.ones((len(geo), nd), dtype=np.int64)
            offs[:, :k], lens[:, :k] = geo.offsets[:, :nd], geo.lengths[:, :nd]
            parts.append((hit[1][geo.name], offs, lens, len(blobs) - 1))
    z = np.zeros(0, dtype=np.int64)
    tensor = np.concatenate([p[0] for p in parts] or [z])
    offs = np.concatenate([p[1] for p in parts] or [z.reshape(0, nd)])
    lens = np.concatenate([p[2] for p in parts] or [z.reshape(0, nd)])
    section = np.repeat(np.array([p[3] for p in parts], dtype=np.int64), [len(p[0]) for p in parts])
    # Rows of each tensor: by section (rank), then in the section's order. A stable sort of
    # small integers (a radix sort in numpy): linear in the tiles.
    order = np.argsort(tensor, kind="stable")
    tensor, offs, lens, section = tensor[order], offs[order], lens[order], section[order]
    if check_coverage:
        bounds = np.searchsorted(tensor, np.arange(len(metas) + 1))
        for i, m in enumerate(metas):
            a, b = int(bounds[i]), int(bounds[i + 1])
            check_box_coverage(m.fqn, m.shape, offs[a:b, : len(m.shape)], lens[a:b, : len(m.shape)])
    # Values, per-rank values, timings, metadata: as version 1 assembles them (no tiles).
    tail = build_manifest(world_size, metas, [dataclasses.replace(r, tiles=None) for r in reports], save_id, opts)
    index = build_index(
        (save_id, world_size, opts.chunk_bytes),
        [(m.fqn, m.dtype, m.shape) for m in metas],
        tensor,
        offs,
        lens,
        section,
        blobs,
        np.array(ranks, dtype=np.int64),
        np.array(section_lists, dtype=np.int64),
        [ids for _, ids in sorted(lists.values(), key=lambda x: x[0])],
        manifest_tail(tail),
    )
    return EncodedSections(save_id, index, b"".join(blobs), tuple(files))
