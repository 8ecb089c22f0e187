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

import numpy as np

from ...format.chunking import Chunking
from ...format.geometry import check_box_coverage
from ...format.manifest import EncodedSections, FileEntry, build_index, manifest_tail
from ...format.manifest.sections import rank_timings
from ...format.rank_report import RankReportDoc, report_parts
from ...options import SaveOptions
from .assemble import check_planned, manifest_without_tiles
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
    """The version 2 manifest (4 where a rank wrote compressed files) of a save whose ranks
    reported ``reports`` (rank ``r`` at index ``r``).

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
    geos = []
    known: dict[int, tuple[int, np.ndarray]] = {}
    alive: list[tuple[str, ...]] = []
    for rank, rep in enumerate(reports):
        geo, blob = report_parts(rep)
        if geo is None or blob is None or not geo.files:
            continue
        hit = known.get(id(geo.names))  # reports of one job share a few name tuples: hashing one costs
        if hit is None:
            check_planned(rank, geo.names, meta_index)
            hit = lists.get(geo.names)
            if hit is None:
                hit = lists[geo.names] = (len(lists), np.array([meta_index[n] for n in geo.names], dtype=np.int64))
            known[id(geo.names)] = hit
            alive.append(geo.names)  # its id stays its own
        framed = geo.frames or (None,) * len(geo.files)
        files.extend(FileEntry(p, rank, n, fr) for (p, n), fr in zip(geo.files, framed))
        section_lists.append(hit[0])
        ranks.append(rank)
        blobs.append(blob)
        geos.append(geo)
    # Every tile at once: its section, its tensor (through its section's list), its box.
    z = np.zeros(0, dtype=np.int64)
    counts = np.fromiter((len(g) for g in geos), dtype=np.int64, count=len(geos))
    section = np.repeat(np.arange(len(geos), dtype=np.int64), counts)
    by_id = [ids for _, ids in sorted(lists.values(), key=lambda x: x[0])]
    list_at = np.concatenate([[0], np.cumsum([len(x) for x in by_id])]).astype(np.int64)
    name = np.concatenate([g.name for g in geos] or [z])
    flat = np.concatenate(by_id or [z])
    tensor = flat[list_at[np.array(section_lists, dtype=np.int64)][section] + name] if len(name) else z
    if all(g.offsets.shape[1] == nd for g in geos):
        offs = np.concatenate([g.offsets for g in geos] or [z.reshape(0, nd)])
        lens = np.concatenate([g.lengths for g in geos] or [z.reshape(0, nd)])
    else:  # ranks that hold only tensors of fewer dimensions: padded (offset 0, length 1)
        offs = np.zeros((len(name), nd), dtype=np.int64)
        lens = np.ones((len(name), nd), dtype=np.int64)
        at = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64).tolist()
        for i, g in enumerate(geos):
            k = min(nd, g.offsets.shape[1])
            offs[at[i] : at[i + 1], :k], lens[at[i] : at[i + 1], :k] = g.offsets[:, :k], g.lengths[:, :k]
    # Rows of each tensor: by section (rank), then in the section's order. A stable sort of
    # small integers (a radix sort in numpy): linear in the tiles.
    small = np.int16 if len(metas) < 1 << 15 else np.int32 if len(metas) < 1 << 31 else np.int64
    order = np.argsort(tensor.astype(small), kind="stable")  # 16 bits: a radix sort
    tensor, offs, lens, section = tensor[order], offs[order], lens[order], section[order]
    if check_coverage:
        bounds = np.searchsorted(tensor, np.arange(len(metas) + 1))
        for i, m in enumerate(metas):
            a, b = int(bounds[i]), int(bounds[i + 1])
            check_box_coverage(m.fqn, m.shape, offs[a:b, : len(m.shape)], lens[a:b, : len(m.shape)])
    # Values, per-rank values, timings, metadata: as version 1 assembles them.
    tail = manifest_tail(manifest_without_tiles(world_size, metas, reports, save_id, opts))
    tail["timings"] = rank_timings(tail["timings"], set(ranks))[0]  # a section holds its rank's
    index = build_index(
        (save_id, world_size, Chunking.for_options(opts)),
        [(m.fqn, m.dtype, m.shape) for m in metas],
        tensor,
        offs,
        lens,
        section,
        blobs,
        np.array(ranks, dtype=np.int64),
        np.array(section_lists, dtype=np.int64),
        by_id,
        tail,
        compressed=any(f.frames is not None for f in files),
    )
    return EncodedSections(save_id, index, b"".join(blobs), tuple(files))
