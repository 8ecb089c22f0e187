"""Format version 2, writing: a manifest as an index (``manifest.json``) and its sections.

A manifest of millions of tiles is read by every rank of a load; in version 2 each rank reads
only its part. ``manifest.json`` becomes the *index*: everything of version 1 except the
files and the tiles' byte offsets, chunk counts and checksums, which go to *sections* in one
immutable file written before the index (``data/<save id>/manifest.sections``), one section
per saving rank (the rank of the files it lists). Per tensor the index keeps the tiles'
geometry (offsets, lengths) and the section that holds each tile's details; a section table
gives each section's byte range and xxh3-64. See ``docs/format.md``.

A section needs nothing only the index knows: its tensors are numbered in the section's own
list of them (the index maps each list to tensor positions), and a tile of a tensor is the
``k``-th of that tensor in its section, ``k`` being what the index's rows say. So each rank
encodes its own section when it writes (:func:`encode_section`, from its rank report), and
rank 0 only joins the sections' bytes and builds the index from the tiles' geometry
(:func:`build_index`). :func:`encode_sectioned` does both for a whole :class:`Manifest`.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from ..chunking import Chunking
from ..codec import FrameTable
from ..names import DATA_DIR
from .blocks import encode_blocks
from .encoder import _dumps, _int_column, _remap, manifest_tail
from .schema import (
    CHECKSUM_ALGORITHM,
    FORMAT,
    SECTIONED_COMPRESSED_VERSION,
    SECTIONED_VERSION,
    SECTIONS_NAME,
    FileEntry,
    Manifest,
)


@dataclass(frozen=True, eq=False)
class EncodedSections:
    """A version 2 manifest as committed: the index's bytes, the sections file's, and the data
    files the sections list (what the commit checks before it publishes the index)."""

    save_id: str
    index: bytes
    sections: bytes
    files: tuple[FileEntry, ...]


def sections_path(save_id: str) -> str:
    """Where (relative to the checkpoint) the sections of save ``save_id`` are stored."""
    return f"{DATA_DIR}/{save_id}/{SECTIONS_NAME}"


def encode_section(
    rank: int,
    files: Sequence[tuple[str, int]],
    tensor: np.ndarray,
    file: np.ndarray,
    byte_offset: np.ndarray,
    chunks: np.ndarray,
    checksums: np.ndarray,
    timings: dict[str, Any] | None = None,
    frames: Sequence[FrameTable | None] = (),
) -> bytes:
    """One section: rank ``rank``'s files (``(path, bytes)``), its tiles' details and the
    timings of its part of the save (which version 1 keeps in ``timings.save.ranks``).
    ``frames``: each file's frame table where it is compressed (a version 4 manifest's section).

    ``tensor`` numbers each tile's tensor in the section's own list of tensors (the index maps
    the list to tensor positions); the tiles of one tensor must be in the order of their rows
    in the index (a rank orders its tiles of a tensor by offsets, as the index does).
    """
    parts = [
        b'{"rank":%d,"files":' % rank,
        json.dumps(
            [
                [p, rank, n] if i >= len(frames) or frames[i] is None else [p, rank, n, frames[i].to_json()]  # type: ignore[union-attr]
                for i, (p, n) in enumerate(files)
            ],
            separators=(",", ":"),
        ).encode(),
        b',"tiles":{"count":%d' % len(tensor),
    ]
    for key, arr in (("tensor", tensor), ("file", file), ("byte_offset", byte_offset), ("chunks", chunks)):
        parts.append(b',"%s":' % key.encode())
        _int_column(parts, arr)
    sums = np.ascontiguousarray(checksums, dtype="<u8").tobytes()
    parts += [b',"checksums":{"dtype":"uint64","data":"', base64.b64encode(sums), b'"}}']
    if timings is not None:
        parts += [b',"timings":', _dumps(timings)]
    parts.append(b"}")
    return b"".join(parts)


def rank_timings(timings: dict[str, Any], ranks: set[int]) -> tuple[dict[str, Any], dict[int, Any]]:
    """``timings`` without the save timings of ``ranks`` (their sections hold them), and those."""
    save = timings.get("save")
    by_rank = save.get("ranks") if isinstance(save, dict) else None
    if not isinstance(save, dict) or not isinstance(by_rank, dict):
        return timings, {}
    moved = {int(r): t for r, t in by_rank.items() if r.isdigit() and int(r) in ranks and isinstance(t, dict)}
    kept = {r: t for r, t in by_rank.items() if not (r.isdigit() and int(r) in moved)}
    return {**timings, "save": {**save, "ranks": kept}}, moved


def build_index(
    head: tuple[str, int, Chunking],
    tensors: Sequence[tuple[str, str, tuple[int, ...]]],
    tile_tensor: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    section: np.ndarray,
    sections: Sequence[bytes],
    section_ranks: np.ndarray,
    section_lists: np.ndarray,
    name_lists: Sequence[np.ndarray],
    tail: dict[str, Any],
    *,
    compressed: bool = False,
) -> bytes:
    """The bytes of a version 2 ``manifest.json`` (version 4 where ``compressed``: a section lists
    a compressed file).

    Args:
        head: ``(save_id, world_size, chunking)``.
        tensors: ``(name, dtype, shape)`` in index order.
        tile_tensor: every tile's tensor position, ascending (the rows of each tensor in order).
        offsets, lengths: ``(tiles, ndim)`` boxes (padded beyond a tensor's dimensions).
        section: each tile's section; within a tensor never decreasing, and the rows of one
            section in the order the section lists that tensor's tiles.
        sections: every section's bytes (the sections file is their concatenation).
        section_ranks: the rank of each section.
        section_lists: each section's list of tensors, as an index into ``name_lists``.
        name_lists: the distinct lists of tensor positions the sections number their tensors in.
        tail: values, per-rank values, layout, timings, metadata (:func:`manifest_tail`).
    """
    save_id, world_size, chunking = head
    n = len(tile_tensor)
    at = np.arange(n, dtype=np.int64)
    # Each tile's k: its place among the tiles of its tensor in its section (runs of rows).
    change = np.ones(n, dtype=bool)
    if n:
        change[1:] = (tile_tensor[1:] != tile_tensor[:-1]) | (section[1:] != section[:-1])
    k = at - np.maximum.accumulate(np.where(change, at, 0)) if n else at
    bounds = np.searchsorted(tile_tensor, np.arange(len(tensors) + 1))
    parts = [b'"tensors":{']
    blocks = [np.zeros((0, 4), dtype=np.int64)]
    for ti, (name, dtype, shape) in enumerate(tensors):
        a, b = int(bounds[ti]), int(bounds[ti + 1])
        nd = len(shape)
        if ti:
            parts.append(b",")
        parts += [_dumps(name), b':{"dtype":', _dumps(dtype), b',"shape":', _dumps(list(shape)), b',"tile_index":']
        blocks.append(encode_blocks(parts, offsets[a:b, :nd], lengths[a:b, :nd], section[a:b], k[a:b]))
        parts.append(b"}")
    parts.append(b'},"tile_blocks":')
    _int_column(parts, np.concatenate(blocks))
    sizes = np.fromiter((len(s) for s in sections), dtype=np.int64, count=len(sections))
    starts = np.concatenate([[0], np.cumsum(sizes)])[:-1].astype(np.int64)
    digests = np.fromiter((xxhash.xxh3_64_intdigest(s) for s in sections), dtype=np.uint64, count=len(sections))
    doc_head = {
        "format": FORMAT,
        # (or where tiles are cut into chunks per size: a reader of version 2 would miscount them)
        "version": SECTIONED_COMPRESSED_VERSION if compressed or chunking.tile_chunks else SECTIONED_VERSION,
        "save_id": save_id,
        "world_size": world_size,
        "checksum": {"algorithm": CHECKSUM_ALGORITHM, **chunking.to_json()},
    }
    table = [
        _dumps(doc_head)[:-1],
        b',"sections":{"path":',
        _dumps(sections_path(save_id)),
        b',"bytes":%d,"count":%d' % (int(sizes.sum()), len(sections)),
    ]
    for key, arr in (("rank", section_ranks), ("list", section_lists), ("offset", starts), ("length", sizes)):
        table.append(b',"%s":' % key.encode())
        _int_column(table, np.asarray(arr, dtype=np.int64))
    table += [b',"checksums":{"dtype":"uint64","data":"', base64.b64encode(digests.astype("<u8").tobytes()), b'"}}']
    lens = np.fromiter((len(x) for x in name_lists), dtype=np.int64, count=len(name_lists))
    table.append(b',"tensor_lists":{"count":%d,"length":' % len(name_lists))
    _int_column(table, lens)
    table.append(b',"tensor":')
    _int_column(table, np.concatenate([np.asarray(x, dtype=np.int64) for x in name_lists] or [at[:0]]))
    table.append(b"},")
    return b"".join([*table, *parts, b",", _dumps(tail)[1:]])


def encode_sectioned(m: Manifest) -> tuple[bytes, bytes]:
    """Serialize a whole manifest as format version 2 (4 with compressed files): ``(index, sections)``.

    ``index`` is the bytes of ``manifest.json``, ``sections`` those of the file at
    :func:`sections_path` (written, and durable, before the index is published). A save's
    commit does not use this: its ranks encoded their sections themselves.

    Example:
        >>> index, sections = encode_sectioned(manifest)
        >>> store.write_file(sections_path(manifest.save_id), [sections])
        >>> store.write_atomic("manifest.json", index)
    """
    files = m.files
    file_index = {f.path: i for i, f in enumerate(files)}
    # One section per rank that wrote files, in rank order; a file's place in its section's list.
    ranks = np.fromiter((f.rank for f in files), dtype=np.int64, count=len(files))
    section_ranks, file_section = np.unique(ranks, return_inverse=True)
    file_order = np.argsort(file_section, kind="stable")
    file_local = np.empty(len(files), dtype=np.int64)
    counts = np.bincount(file_section, minlength=len(section_ranks))
    firsts = np.concatenate([[0], np.cumsum(counts)])[:-1]
    file_local[file_order] = np.arange(len(files)) - np.repeat(firsts, counts)
    nd = max((len(e.shape) for e in m.tensors.values()), default=0)
    remaps: dict[int, Any] = {}
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("t", "offs", "lens", "sec", "file", "bo", "chunks", "sums")}
    for ti, e in enumerate(m.tensors.values()):
        t = e.table
        n = len(t)
        if not n:
            continue
        remap = _remap(t.paths, file_index, remaps)
        g = t.file if remap is None else remap[t.file]
        sec = file_section[g]
        order = np.argsort(sec, kind="stable")  # rows by section, offsets order within one
        offs = np.zeros((n, nd), dtype=np.int64)
        lens = np.ones((n, nd), dtype=np.int64)
        k = t.offsets.shape[1]
        offs[:, :k], lens[:, :k] = t.offsets[order], t.lengths[order]
        starts = np.concatenate([[0], np.cumsum(t.chunks)]).astype(np.int64)
        c = t.chunks[order]
        first = np.concatenate([[0], np.cumsum(c)])[:-1].astype(np.int64)
        cols["sums"].append(t.checksums[np.arange(int(c.sum()), dtype=np.int64) - np.repeat(first - starts[order], c)])
        cols["t"].append(np.full(n, ti, dtype=np.int64))
        for key, arr in (("offs", offs), ("lens", lens), ("sec", sec[order])):
            cols[key].append(arr)
        for key, arr in (("file", file_local[g][order]), ("bo", t.byte_offset[order]), ("chunks", c)):
            cols[key].append(arr)
    z = np.zeros(0, dtype=np.int64)
    tile_tensor, sec, file, bo, chunks = (np.concatenate(cols[k] or [z]) for k in ("t", "sec", "file", "bo", "chunks"))
    offs, lens = (np.concatenate(cols[k] or [z.reshape(0, nd)]) for k in ("offs", "lens"))
    sums = np.concatenate(cols["sums"] or [np.zeros(0, dtype=np.uint64)])
    sum_at = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int64)
    by_sec = np.argsort(sec, kind="stable")  # a section's tiles: by tensor, then row
    cut = np.searchsorted(sec[by_sec], np.arange(len(section_ranks) + 1))
    files_of: list[list[tuple[str, int]]] = [[] for _ in section_ranks]
    frames_of: list[list[FrameTable | None]] = [[] for _ in section_ranks]
    for f, s in zip(files, file_section.tolist()):
        files_of[s].append((f.path, f.nbytes))
        frames_of[s].append(f.frames)
    tail = manifest_tail(m)
    tail["timings"], moved = rank_timings(m.timings, set(section_ranks.tolist()))
    lists: dict[tuple[int, ...], int] = {}
    section_lists = np.zeros(len(section_ranks), dtype=np.int64)
    blobs = []
    for s in range(len(section_ranks)):
        rows = by_sec[cut[s] : cut[s + 1]]
        present, local = np.unique(tile_tensor[rows], return_inverse=True)
        section_lists[s] = lists.setdefault(tuple(present.tolist()), len(lists))
        c = chunks[rows]
        first = np.concatenate([[0], np.cumsum(c)])[:-1].astype(np.int64)
        picked = sums[np.arange(int(c.sum()), dtype=np.int64) - np.repeat(first - sum_at[rows], c)]
        r = int(section_ranks[s])
        blobs.append(
            encode_section(
                r, files_of[s], local.reshape(-1), file[rows], bo[rows], c, picked, moved.get(r), frames_of[s]
            )
        )
    index = build_index(
        (m.save_id, m.world_size, m.tile_chunking),
        [(name, e.dtype, e.shape) for name, e in m.tensors.items()],
        tile_tensor,
        offs,
        lens,
        sec,
        blobs,
        section_ranks,
        section_lists,
        [np.array(x, dtype=np.int64) for x in lists],
        tail,
        compressed=any(f.frames is not None for f in files),
    )
    return index, b"".join(blobs)
