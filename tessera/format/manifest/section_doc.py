"""One section of a sectioned manifest (format versions 2 and 4), decoded and checked on its own:
from the sections file (:meth:`~tessera.format.manifest.index.Index.decode_section`) or from the
rank report that carries it to rank 0 (:mod:`tessera.format.rank_report`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..codec import ColumnBudget, FrameTable
from ..names import check_relpath
from .decoder import strict_json
from .schema import DECODE_RATIO, DECODE_SLACK, FileEntry
from .tiles import Budget, as_dict, as_int, column, fail


@dataclass(frozen=True)
class SectionDoc:
    """A section as its rank wrote it (tensors numbered in its own list), checked on its own."""

    rank: int
    files: tuple[FileEntry, ...]
    tensor: np.ndarray
    file: np.ndarray
    byte_offset: np.ndarray
    chunks: np.ndarray
    checksums: np.ndarray
    timings: dict | None = None


def parse_section(
    data: bytes, what: str, *, frames_chunk_bytes: int | None = None, delta_frames: bool = False
) -> SectionDoc:
    """A section's bytes, decoded and checked on their own (types, confined file references,
    inflation bounded by the section's size, tiles referring to its files).

    Args:
        frames_chunk_bytes: the checksum chunk size of a version 4 manifest, whose sections may
            list compressed files (``[path, rank, bytes, frames]``); None: a version 2 one, whose
            may not.
        delta_frames: whether those frame tables may hold delta frames (a rank report's section
            may; a committed index's may not: a delta frame's parent can be in another section).

    Raises:
        ManifestError: naming ``what``.
    """
    doc = strict_json(data, "the section")
    rank = as_int(doc.get("rank"), "section rank")
    raw_files = doc.get("files")
    if not isinstance(raw_files, list):
        raise fail("section files must be a list")
    files = []
    frame_budget = ColumnBudget(len(data))  # all the section's frame tables together
    for i, f in enumerate(raw_files):
        framed = isinstance(f, list) and len(f) == 4
        if not isinstance(f, list) or not (len(f) == 3 or (framed and frames_chunk_bytes is not None)):
            raise fail(
                f"section files[{i}] must be [path, rank, bytes]"
                + (" or [path, rank, bytes, frames]" if frames_chunk_bytes is not None else " (version 2)")
            )
        path, nbytes = check_relpath(f[0]), as_int(f[2], "file bytes")
        table = None
        if framed:
            assert frames_chunk_bytes is not None
            try:
                if not delta_frames and isinstance(f[3], dict) and "delta" in f[3]:
                    # Its parents' frame tables may be in other sections: a delta-coded manifest stays inline.
                    raise ValueError("delta frames in a section (a delta-coded manifest is inline, version 3)")
                table = FrameTable.from_json(
                    f[3], file_bytes=nbytes, chunk_bytes=frames_chunk_bytes, budget=frame_budget
                )
            except ValueError as e:
                raise fail(f"section files[{i}] ({path}): {e}") from None
        files.append(FileEntry(path, as_int(f[1], "file rank"), nbytes, table))
    tiles = as_dict(doc.get("tiles"), "section tiles")
    n = as_int(tiles.get("count"), "section tiles count")
    budget = Budget(DECODE_RATIO * len(data) + DECODE_SLACK)
    budget.take(32 * n, f"section tiles count {n}")
    tensor = column(what, tiles, "tensor", n, n, "tiles")
    fidx = column(what, tiles, "file", n, n, "tiles")
    bo = column(what, tiles, "byte_offset", n, n, "tiles")
    chunks = column(what, tiles, "chunks", n, n, "tiles")
    total = int(chunks.sum())
    budget.take(8 * total, f"section chunks (sum {total})")
    sums = column(what, tiles, "checksums", total, total, "tiles")
    if n and int(fidx.max()) >= len(files):
        raise fail(f"{what}: a tile refers to file #{int(fidx.max())} but the section lists {len(files)}")
    timings = doc.get("timings")
    if timings is not None:
        timings = as_dict(timings, "section timings")
    return SectionDoc(rank, tuple(files), tensor, fidx, bo, chunks, sums, timings)
