"""The manifest encoder: a :class:`~tessera.format.manifest.Manifest` to the bytes of ``manifest.json``.

Linear in the number of tiles and without per-tile Python work: tile tables are written as
columns (narrowed, delta-coded and deflated integers; raw checksums, which do not compress),
and their base64 text is spliced into the JSON as bytes instead of going through
``json.dumps`` (which would copy and scan every character again).
"""

from __future__ import annotations

import base64
import json
import zlib
from typing import Any

import numpy as np

from .schema import CHECKSUM_ALGORITHM, COMPRESSED_VERSION, FORMAT, TABLE_MIN_TILES, VERSION, Manifest, TileTable

_SEPARATORS = (",", ":")
_WIDTHS = ((np.int8, "int8"), (np.int16, "int16"), (np.int32, "int32"), (np.int64, "int64"))
_BOUNDS = tuple((int(np.iinfo(t).min), int(np.iinfo(t).max)) for t, _ in _WIDTHS)


def encode(m: Manifest) -> bytes:
    """Serialize a manifest to the bytes of ``manifest.json``.

    Example:
        >>> data = encode(manifest)
        >>> decode(data) == manifest
        True
    """
    file_index = {f.path: i for i, f in enumerate(m.files)}
    remaps: dict[int, tuple[tuple[str, ...], np.ndarray | None]] = {}
    head = {
        "format": FORMAT,
        # The inline form, whichever form ``m`` was read from; version 3 where a file is compressed.
        # (or where tiles are cut into chunks per size: a reader of version 1 would miscount them)
        "version": COMPRESSED_VERSION
        if m.tile_chunking.tile_chunks or any(f.frames is not None for f in m.files)
        else VERSION,
        "save_id": m.save_id,
        "world_size": m.world_size,
        "checksum": {"algorithm": CHECKSUM_ALGORITHM, **m.tile_chunking.to_json()},
        "files": [
            {"path": f.path, "rank": f.rank, "bytes": f.nbytes}
            if f.frames is None
            else {"path": f.path, "rank": f.rank, "bytes": f.nbytes, "frames": f.frames.to_json()}
            for f in m.files
        ],
    }
    tail = manifest_tail(m)
    # The same bytes as json.dumps of the whole document, assembled in parts.
    parts = [_dumps(head)[:-1], b',"tensors":{']
    for i, (name, e) in enumerate(m.tensors.items()):
        if i:
            parts.append(b",")
        parts += [_dumps(name), b':{"dtype":', _dumps(e.dtype), b',"shape":', _dumps(list(e.shape))]
        if e.num_tiles > TABLE_MIN_TILES:
            parts.append(b',"tile_table":')
            _encode_table(parts, e.table, _remap(e.table.paths, file_index, remaps))
        else:
            tiles = [
                [
                    file_index[t.file],
                    list(t.offsets),
                    list(t.lengths),
                    t.byte_offset,
                    [f"{c:016x}" for c in t.checksums],
                ]
                for t in e.tiles
            ]
            parts += [b',"tiles":', _dumps(tiles)]
        parts.append(b"}")
    parts += [b"},", _dumps(tail)[1:]]
    return b"".join(parts)


def manifest_tail(m: Manifest) -> dict[str, Any]:
    """The fields that follow the tensors in either format version: values, per-rank values,
    layout, timings, metadata."""
    return {
        "values": m.values,
        "per_rank": {k: {"on_resize": v.on_resize, "values": list(v.by_rank)} for k, v in m.per_rank.items()},
        "layout": m.layout,
        "timings": m.timings,
        "metadata": m.metadata,
    }


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=_SEPARATORS, allow_nan=False).encode("utf-8")


def _remap(
    paths: tuple[str, ...], file_index: dict[str, int], cache: dict[int, tuple[tuple[str, ...], np.ndarray | None]]
) -> np.ndarray | None:
    """Table file index -> manifest file index, or None where they agree; once per distinct ``paths``.

    Tables of one save share their ``paths`` tuple: without the cache, every tensor would look up
    every file again (tensors x files dictionary lookups).
    """
    hit = cache.get(id(paths))
    if hit is not None and hit[0] is paths:
        return hit[1]
    remap = np.fromiter((file_index[p] for p in paths), dtype=np.int64, count=len(paths))
    out = None if np.array_equal(remap, np.arange(len(paths))) else remap
    cache[id(paths)] = (paths, out)  # the tuple is kept so that its id is not reused
    return out


def _encode_table(parts: list[bytes], t: TileTable, remap: np.ndarray | None) -> None:
    n = len(t)
    file = t.file if remap is None or not n else remap[t.file]
    parts.append(b'{"count":%d,"file":' % n)
    _int_column(parts, file)
    for key, arr in (("offsets", t.offsets), ("lengths", t.lengths), ("byte_offset", t.byte_offset)):
        parts.append(b',"%s":' % key.encode())
        _int_column(parts, arr)
    parts.append(b',"chunks":')
    _int_column(parts, t.chunks)
    # One xxh3 digest per chunk: random bits that deflate cannot shrink, so stored as they are.
    sums = np.ascontiguousarray(t.checksums, dtype="<u8")
    parts += [b',"checksums":{"dtype":"uint64","data":"', base64.b64encode(sums.tobytes()), b'"}}']


def _int_column(parts: list[bytes], arr: np.ndarray) -> None:
    """A non-negative int64 column (``(n,)`` or ``(n, ndim)``) in its narrowest form, deflated.

    Stored as the difference from the previous row unless that needs more bytes per value:
    sorted offsets, byte offsets and file indices step by small, repeating amounts.
    """
    name, delta, data = _int_column_parts(arr)
    parts += [
        b'{"dtype":"%s",' % name.encode(),
        b'"delta":true,' if delta else b"",
        b'"zlib":true,"data":"',
        data,
        b'"}',
    ]


def _int_column_parts(arr: np.ndarray) -> tuple[str, bool, bytes]:
    arr = np.asarray(arr, dtype=np.int64)
    if arr.ndim == 1:
        arr = arr[:, None]
    delta = False
    values = arr
    width = _width(arr)
    if len(arr) > 1 and width > 0:
        diff = np.empty_like(arr)
        diff[0] = arr[0]
        np.subtract(arr[1:], arr[:-1], out=diff[1:])
        diff_width = _width(diff)
        if diff_width <= width:  # as narrow and no less regular: deflates at least as well
            delta, values, width = True, diff, diff_width
    dtype, name = _WIDTHS[width]
    raw = np.ascontiguousarray(values, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()
    return name, delta, base64.b64encode(zlib.compress(raw, 1))


def _width(a: np.ndarray) -> int:
    """Index into :data:`_WIDTHS` of the narrowest signed type holding every value of ``a``."""
    if not a.size:
        return 0
    lo, hi = int(a.min()), int(a.max())
    return next(i for i, (tmin, tmax) in enumerate(_BOUNDS) if tmin <= lo and hi <= tmax)
