"""Format version 2, writing: a manifest as an index (``manifest.json``) and its sections.

A manifest of millions of tiles is read by every rank of a load; in version 2 each rank reads
only its part. ``manifest.json`` becomes the *index*: everything of version 1 except the
files and the tiles' byte offsets, chunk counts and checksums, which go to *sections* in one
immutable file written before the index (``data/<save id>/manifest.sections``), one section
per saving rank (the rank of the files it lists). Per tensor the index keeps the tiles'
geometry (offsets, lengths) and the section that holds each tile's details; a section table
gives each section's byte range and xxh3-64. See ``docs/format.md``.

Linear in the tiles, without per-tile Python work: one stable sort of all tiles by section,
then one slice per section.
"""

from __future__ import annotations

import base64
import json
import zlib
from typing import Any

import numpy as np
import xxhash

from ..names import DATA_DIR
from .blocks import encode_blocks
from .encoder import _WIDTHS, _dumps, _int_column, _remap, _width, manifest_tail
from .schema import CHECKSUM_ALGORITHM, FORMAT, SECTIONED_VERSION, SECTIONS_NAME, Manifest


def sections_path(save_id: str) -> str:
    """Where (relative to the checkpoint) the sections of save ``save_id`` are stored."""
    return f"{DATA_DIR}/{save_id}/{SECTIONS_NAME}"


def encode_sectioned(m: Manifest) -> tuple[bytes, bytes]:
    """Serialize a manifest as format version 2: ``(index, sections)``.

    ``index`` is the bytes of ``manifest.json``, ``sections`` those of the file at
    :func:`sections_path` (written, and durable, before the index is published).

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

    remaps: dict[int, Any] = {}
    tensor_ids, row_cols, sec_cols, local_cols, bo_cols, chunk_cols, sum_cols = [], [], [], [], [], [], []
    parts = [b'"tensors":{']
    blocks = [np.zeros((0, 3), dtype=np.int64)]
    for ti, (name, e) in enumerate(m.tensors.items()):
        t = e.table
        n = len(t)
        remap = _remap(t.paths, file_index, remaps)
        g = t.file if remap is None or not n else remap[t.file]
        sec = file_section[g] if n else np.zeros(0, dtype=np.int64)
        if ti:
            parts.append(b",")
        parts += [_dumps(name), b':{"dtype":', _dumps(e.dtype), b',"shape":', _dumps(list(e.shape))]
        parts.append(b',"tile_index":')
        blocks.append(encode_blocks(parts, t.offsets, t.lengths, sec))
        parts.append(b"}")
        if n:
            tensor_ids.append(np.full(n, ti, dtype=np.int64))
            row_cols.append(np.arange(n, dtype=np.int64))
            sec_cols.append(sec)
            local_cols.append(file_local[g])
            bo_cols.append(t.byte_offset)
            chunk_cols.append(t.chunks)
            sum_cols.append(t.checksums)
    parts.append(b'},"tile_blocks":')
    _int_column(parts, np.concatenate(blocks))
    blobs = _sections(
        m, section_ranks, file_section, tensor_ids, row_cols, sec_cols, local_cols, bo_cols, chunk_cols, sum_cols
    )
    sizes = np.fromiter((len(b) for b in blobs), dtype=np.int64, count=len(blobs))
    offsets = np.concatenate([[0], np.cumsum(sizes)])[:-1].astype(np.int64)
    digests = np.fromiter((xxhash.xxh3_64_intdigest(b) for b in blobs), dtype=np.uint64, count=len(blobs))
    head = {
        "format": FORMAT,
        "version": SECTIONED_VERSION,
        "save_id": m.save_id,
        "world_size": m.world_size,
        "checksum": {"algorithm": CHECKSUM_ALGORITHM, "chunk_bytes": m.chunk_bytes},
    }
    table = [
        _dumps(head)[:-1],
        b',"sections":{"path":',
        _dumps(sections_path(m.save_id)),
        b',"bytes":%d,"count":%d,"offset":' % (int(sizes.sum()), len(blobs)),
    ]
    _int_column(table, offsets)
    table.append(b',"length":')
    _int_column(table, sizes)
    table += [b',"checksums":{"dtype":"uint64","data":"', base64.b64encode(digests.astype("<u8").tobytes()), b'"}},']
    index = b"".join([*table, *parts, b",", _dumps(manifest_tail(m))[1:]])
    return index, b"".join(blobs)


def _sections(
    m: Manifest,
    section_ranks: np.ndarray,
    file_section: np.ndarray,
    tensor_ids: list[np.ndarray],
    row_cols: list[np.ndarray],
    sec_cols: list[np.ndarray],
    local_cols: list[np.ndarray],
    bo_cols: list[np.ndarray],
    chunk_cols: list[np.ndarray],
    sum_cols: list[np.ndarray],
) -> list[bytes]:
    """Each section's bytes: its files, then its tiles (in index order) as columns."""
    z = np.zeros(0, dtype=np.int64)
    tensor = np.concatenate(tensor_ids) if tensor_ids else z
    row = np.concatenate(row_cols) if row_cols else z
    sec = np.concatenate(sec_cols) if sec_cols else z
    local = np.concatenate(local_cols) if local_cols else z
    bo = np.concatenate(bo_cols) if bo_cols else z
    chunks = np.concatenate(chunk_cols) if chunk_cols else z
    sums = np.concatenate(sum_cols) if sum_cols else np.zeros(0, dtype=np.uint64)
    starts = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int64)
    order = np.argsort(sec, kind="stable")  # within a section: tensor order, then tile order
    bounds = np.searchsorted(sec[order], np.arange(len(section_ranks) + 1))
    counts = chunks[order]
    # Every tile's checksums, in section order (one per tile, the common case: no gather).
    if len(counts) and int(counts.max()) == 1 == int(counts.min()):
        sorted_sums = sums[starts[order]]
    else:
        first = np.concatenate([[0], np.cumsum(counts)])[:-1].astype(np.int64)
        idx = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(first, counts) + np.repeat(starts[order], counts)
        sorted_sums = sums[idx]
    sum_bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)[bounds]
    sum_bytes = sorted_sums.astype("<u8").tobytes()
    # Each integer column coded once for all sections (one width, delta-coded within each
    # section), then cut: per section only slicing, deflating and base64 remain.
    columns = [_column_for_sections(c[order], bounds) for c in (tensor, row, local, bo, chunks)]
    files_of: list[list[list[Any]]] = [[] for _ in section_ranks]
    for f, s in zip(m.files, file_section.tolist()):
        files_of[s].append([f.path, f.rank, f.nbytes])
    out = []
    b = bounds.tolist()
    sb = sum_bounds.tolist()
    for s in range(len(section_ranks)):
        parts = [
            b'{"section":%d,"rank":%d,"files":' % (s, int(section_ranks[s])),
            json.dumps(files_of[s], separators=(",", ":")).encode(),
            b',"tiles":{"count":%d' % (b[s + 1] - b[s]),
        ]
        for key, (head, data, size) in zip((b"tensor", b"row", b"file", b"byte_offset", b"chunks"), columns):
            parts += [
                b',"',
                key,
                b'":',
                head,
                base64.b64encode(zlib.compress(data[b[s] * size : b[s + 1] * size], 1)),
                b'"}',
            ]
        parts += [
            b',"checksums":{"dtype":"uint64","data":"',
            base64.b64encode(sum_bytes[sb[s] * 8 : sb[s + 1] * 8]),
            b'"}}}',
        ]
        out.append(b"".join(parts))
    return out


def _column_for_sections(values: np.ndarray, bounds: np.ndarray) -> tuple[bytes, bytes, int]:
    """``(column object head, little-endian bytes, item size)`` of a non-negative column cut into
    sections at ``bounds``: delta-coded within each section where that is no wider."""
    width = _width(values)
    delta = False
    if len(values) > 1 and width > 0:
        diff = np.empty_like(values)
        diff[0] = values[0]
        np.subtract(values[1:], values[:-1], out=diff[1:])
        firsts = bounds[:-1][bounds[:-1] < len(values)]
        diff[firsts] = values[firsts]  # each section's first row as is
        diff_width = _width(diff)
        if diff_width <= width:
            delta, values, width = True, diff, diff_width
    dtype, name = _WIDTHS[width]
    head = b'{"dtype":"%s",%s"zlib":true,"data":"' % (name.encode(), b'"delta":true,' if delta else b"")
    return (
        head,
        np.ascontiguousarray(values, dtype=np.dtype(dtype).newbyteorder("<")).tobytes(),
        np.dtype(dtype).itemsize,
    )
