"""The manifest encoder: a :class:`~tessera.format.manifest.Manifest` to the bytes of ``manifest.json``."""

from __future__ import annotations

import base64
import json
import zlib
from typing import Any

import numpy as np

from .schema import CHECKSUM_ALGORITHM, FORMAT, TABLE_MIN_TILES, Manifest, TileTable


def encode(m: Manifest) -> bytes:
    """Serialize a manifest to the bytes of ``manifest.json``."""
    file_index = {f.path: i for i, f in enumerate(m.files)}
    tensors = {}
    for name, e in m.tensors.items():
        entry: dict[str, Any] = {"dtype": e.dtype, "shape": list(e.shape)}
        if e.num_tiles > TABLE_MIN_TILES:
            entry["tile_table"] = _encode_table(e.table, file_index)
        else:
            entry["tiles"] = [
                [
                    file_index[t.file],
                    list(t.offsets),
                    list(t.lengths),
                    t.byte_offset,
                    [f"{c:016x}" for c in t.checksums],
                ]
                for t in e.tiles
            ]
        tensors[name] = entry
    doc = {
        "format": FORMAT,
        "version": m.version,
        "save_id": m.save_id,
        "world_size": m.world_size,
        "checksum": {"algorithm": CHECKSUM_ALGORITHM, "chunk_bytes": m.chunk_bytes},
        "files": [{"path": f.path, "rank": f.rank, "bytes": f.nbytes} for f in m.files],
        "tensors": tensors,
        "values": m.values,
        "per_rank": {k: {"on_resize": v.on_resize, "values": list(v.by_rank)} for k, v in m.per_rank.items()},
        "layout": m.layout,
        "timings": m.timings,
        "metadata": m.metadata,
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")


def _b64(arr: np.ndarray, dtype: str) -> str:
    """base64 of the zlib-compressed little-endian array (offsets compress 10x or more)."""
    return base64.b64encode(zlib.compress(np.ascontiguousarray(arr, dtype=dtype).tobytes(), 1)).decode("ascii")


def _encode_table(t: TileTable, file_index: dict[str, int]) -> dict[str, Any]:
    remap = np.array([file_index[p] for p in t.paths], dtype=np.int64)
    return {
        "count": len(t),
        "file": _b64(remap[t.file] if len(t) else t.file, "<i8"),
        "offsets": _b64(t.offsets, "<i8"),
        "lengths": _b64(t.lengths, "<i8"),
        "byte_offset": _b64(t.byte_offset, "<i8"),
        "chunks": _b64(t.chunks, "<i8"),
        "checksums": _b64(t.checksums, "<u8"),
    }
