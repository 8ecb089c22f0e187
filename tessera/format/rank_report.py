"""A rank's report of a save: the data files it wrote, their tiles, its plain values and timings.

Each rank writes its report beside its data files once they are durable
(``data/<save id>/reports/<rank>.json``) and rank 0 reads them all to assemble the manifest.
Reports travel through storage, not collectives: the ranks of a steady-state save exchange a
fixed few bytes whatever the number of tiles, and rank 0 reads only what it must write.

A report is strict JSON (no pickle) with the tile columns as base64 of little-endian arrays,
followed by a newline and the xxh3-64 of the JSON in hex: a torn or altered report is refused.
"""

from __future__ import annotations

import base64
import binascii
import json
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from ..errors import ManifestError
from .codec import MAX_FRAME_BYTES, FrameTable
from .names import DATA_DIR

REPORT_FORMAT = "tessera-rank-report"
REPORT_VERSION = 2
"""2: integer tile columns and the names deflated (a tenth of the bytes rank 0 reads)."""
REPORTS_DIR = "reports"
MAX_REPORT_BYTES = 1 << 30


def report_dir(save_id: str) -> str:
    """Where the reports of save ``save_id`` live, inside the checkpoint."""
    return f"{DATA_DIR}/{save_id}/{REPORTS_DIR}"


def report_path(save_id: str, rank: int) -> str:
    return f"{report_dir(save_id)}/{rank}.json"


@dataclass(frozen=True, eq=False)
class ReportTiles:
    """The tiles of one rank's files as columns (tile ``i`` at index ``i`` of each).

    Boxes of tensors of lower rank are padded to ``ndim`` with offset 0 and length 1.
    """

    files: tuple[tuple[str, int], ...]
    """``(path, bytes)`` of each file the rank wrote or references."""
    names: tuple[str, ...]
    file: np.ndarray
    name: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    byte_offset: np.ndarray
    chunks: np.ndarray
    checksums: np.ndarray
    frames: tuple[FrameTable | None, ...] = ()
    """The frame table of each file of ``files`` that is compressed (empty: none is)."""

    def __len__(self) -> int:
        return len(self.file)


@dataclass(frozen=True)
class RankReportDoc:
    """What a rank reports once its part of a save is durable (a failure travels in the save's vote)."""

    rank: int
    save_id: str
    tiles: ReportTiles | None
    values: dict[str, Any]
    per_rank: dict[str, tuple[Any, str]]
    timings: dict[str, float]
    replicas: tuple[tuple[str, ...], np.ndarray] | None = None
    """Names and uint64 digests of the rank's copies of plain (replicated) tensors, which rank 0
    compares across ranks (:mod:`tessera.engine.saving.replicas`); None when it holds none."""


def _b64(arr: np.ndarray, dtype: str) -> str:
    return base64.b64encode(np.ascontiguousarray(arr, dtype=dtype).tobytes()).decode("ascii")


def _deflated(arr: np.ndarray) -> str:
    """An integer column: base64 of the deflated little-endian int64 values (small, repeating
    values: a tenth of the raw size)."""
    raw = np.ascontiguousarray(arr, dtype="<i8").tobytes()
    return base64.b64encode(zlib.compress(raw, 1)).decode("ascii")


def encode_report(doc: RankReportDoc) -> bytes:
    """The bytes of a report file."""
    body: dict[str, Any] = {
        "format": REPORT_FORMAT,
        "version": REPORT_VERSION,
        "rank": doc.rank,
        "save_id": doc.save_id,
        "values": doc.values,
        "per_rank": {k: [v, policy] for k, (v, policy) in doc.per_rank.items()},
        "timings": doc.timings,
    }
    if doc.replicas is not None:
        names, digests = doc.replicas
        body["replicas"] = {"names": list(names), "digests": _b64(digests, "<u8")}
    t = doc.tiles
    if t is not None:
        body["files"] = [
            [p, n] if not t.frames or t.frames[i] is None else [p, n, t.frames[i].to_json()]  # type: ignore[union-attr]
            for i, (p, n) in enumerate(t.files)
        ]
        # Deflated: a rank's tensor names repeat prefixes, and ranks of one job often report the
        # very same list, which rank 0 then parses once (:func:`_names`).
        packed = zlib.compress(json.dumps(list(t.names), separators=(",", ":")).encode(), 1)
        body["names"] = {"zlib": base64.b64encode(packed).decode("ascii")}
        # The columns of a manifest's tile table (rank 0 reads one report per rank: their size
        # is what the commit waits for).
        body["tiles"] = {
            "count": len(t),
            "ndim": int(t.offsets.shape[1]) if t.offsets.ndim == 2 else 0,
            "file": _deflated(t.file),
            "name": _deflated(t.name),
            "offsets": _deflated(t.offsets),
            "lengths": _deflated(t.lengths),
            "byte_offset": _deflated(t.byte_offset),
            "chunks": _deflated(t.chunks),
            "checksums": _b64(t.checksums, "<u8"),
        }
    data = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    return data + b"\n" + xxhash.xxh3_64_hexdigest(data).encode()


def decode_report(data: bytes, *, source: str, rank: int, save_id: str) -> RankReportDoc:
    """Parse and check a report file written by rank ``rank`` for save ``save_id``.

    Raises:
        ManifestError: naming ``source`` if the report is torn, altered, or not the one expected.
    """

    def fail(what: str) -> ManifestError:
        return ManifestError(f"{source}: invalid report of rank {rank}: {what}")

    if len(data) > MAX_REPORT_BYTES:
        raise fail(f"{len(data)} bytes is over the {MAX_REPORT_BYTES}-byte limit")
    body, sep, digest = data.rpartition(b"\n")
    if not sep or xxhash.xxh3_64_hexdigest(body).encode() != digest:
        raise fail("its checksum does not match (torn or altered)")
    try:
        doc = json.loads(body)
    except ValueError as e:
        raise fail(f"not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != REPORT_FORMAT or doc.get("version") != REPORT_VERSION:
        raise fail("not a tessera rank report of this version")
    if doc.get("rank") != rank or doc.get("save_id") != save_id:
        raise fail(f"it is rank {doc.get('rank')!r:.20}'s report of save {doc.get('save_id')!r:.40}")
    values, per_rank, timings = doc.get("values"), doc.get("per_rank"), doc.get("timings")
    if not isinstance(values, dict) or not isinstance(per_rank, dict) or not isinstance(timings, dict):
        raise fail("values, per_rank and timings must be objects")
    if not all(isinstance(v, list) and len(v) == 2 and isinstance(v[1], str) for v in per_rank.values()):
        raise fail("per_rank entries must be [value, policy]")
    return RankReportDoc(
        rank,
        save_id,
        _tiles(doc, fail),
        values,
        {k: (v[0], v[1]) for k, v in per_rank.items()},
        {str(k): float(v) for k, v in timings.items() if isinstance(v, int | float)},
        _replicas(doc.get("replicas"), fail),
    )


def _replicas(raw: Any, fail: Any) -> tuple[tuple[str, ...], np.ndarray] | None:
    if raw is None:
        return None
    names = raw.get("names") if isinstance(raw, dict) else None
    text = raw.get("digests") if isinstance(raw, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or not isinstance(text, str):
        raise fail("replicas must be {names: [...], digests: base64}")
    try:
        buf = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise fail("replicas.digests is not valid base64") from None
    if len(buf) != 8 * len(names):
        raise fail(f"replicas.digests holds {len(buf)} bytes for {len(names)} names")
    return tuple(names), np.frombuffer(buf, dtype="<u8").astype(np.uint64)


_NAMES: dict[str, tuple[str, ...]] = {}
"""Name lists already decoded, by their packed text (the ranks of one save mostly share a few)."""


def _names(raw: Any, fail: Any) -> tuple[str, ...]:
    text = raw.get("zlib") if isinstance(raw, dict) else None
    if not isinstance(text, str):
        raise fail('names must be {"zlib": base64 of a deflated JSON list of strings}')
    hit = _NAMES.get(text)
    if hit is not None:
        return hit
    try:
        inflated = zlib.decompressobj().decompress(base64.b64decode(text, validate=True), MAX_REPORT_BYTES)
        names = json.loads(inflated)
    except (binascii.Error, ValueError, zlib.error):
        raise fail("names are not valid base64 of a deflated JSON list") from None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise fail("names must be a list of strings")
    if len(_NAMES) >= 256:
        _NAMES.clear()
    out = _NAMES[text] = tuple(names)
    return out


def _tiles(doc: dict[str, Any], fail: Any) -> ReportTiles:
    files, raw = doc.get("files"), doc.get("tiles")
    names = _names(doc.get("names"), fail)
    if not isinstance(files, list) or not all(
        isinstance(f, list) and len(f) in (2, 3) and isinstance(f[0], str) and type(f[1]) is int and f[1] >= 0
        for f in files
    ):
        raise fail("files must be [[path, bytes] or [path, bytes, frames], ...]")
    frames: list[FrameTable | None] = []
    for f in files:
        try:
            frames.append(
                None if len(f) == 2 else FrameTable.from_json(f[2], file_bytes=f[1], chunk_bytes=MAX_FRAME_BYTES)
            )
        except ValueError as e:
            raise fail(f"file {f[0]!r:.80}: {e}") from None
    if not isinstance(raw, dict):
        raise fail("tiles must be an object")
    n, nd = raw.get("count"), raw.get("ndim")
    if type(n) is not int or type(nd) is not int or n < 0 or not 0 <= nd <= 64:
        raise fail("tiles.count and tiles.ndim must be small non-negative integers")

    def column(key: str, count: int, deflated: bool = True) -> np.ndarray:
        text = raw.get(key)
        if not isinstance(text, str) or len(text) > 4 * MAX_REPORT_BYTES // 3 + 4:
            raise fail(f"tiles.{key} must be a base64 string")
        try:
            buf = base64.b64decode(text, validate=True)
            if deflated:  # bounded: a column cannot inflate past what ``count`` declares
                buf = zlib.decompressobj().decompress(buf, 8 * count + 1)
        except (binascii.Error, ValueError, zlib.error):
            raise fail(f"tiles.{key} is not valid base64{' of zlib data' if deflated else ''}") from None
        if len(buf) != 8 * count:
            raise fail(f"tiles.{key} holds {len(buf)} bytes, expected {8 * count}")
        return np.frombuffer(buf, dtype="<i8" if deflated else "<u8").astype(np.int64 if deflated else np.uint64)

    cols = [column(k, c) for k, c in (("file", n), ("name", n), ("offsets", n * nd), ("lengths", n * nd))]
    byte_offset, chunks = column("byte_offset", n), column("chunks", n)
    ints = [*cols, byte_offset, chunks]
    if any(len(a) and ((a < 0).any() or a.max() >= 1 << 62) for a in ints):
        raise fail("tile columns must be non-negative integers below 2**62")
    file, name, offs, lens = cols
    if n and (file.max() >= len(files) or name.max() >= len(names)):
        raise fail("a tile refers to a file or name the report does not list")
    return ReportTiles(
        tuple((f[0], f[1]) for f in files),
        names,
        file,
        name,
        offs.reshape(n, nd),
        lens.reshape(n, nd),
        byte_offset,
        chunks,
        column("checksums", int(chunks.sum()), deflated=False),
        tuple(frames) if any(fr is not None for fr in frames) else (),
    )
