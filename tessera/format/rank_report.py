"""A rank's report of a save: the data files it wrote, their tiles, its plain values and timings.

Each rank writes its report beside its data files once they are durable
(``data/<save id>/reports/<rank>.json``) and rank 0 reads them all to assemble the manifest.
Reports travel through storage, not collectives: the ranks of a steady-state save exchange a
fixed few bytes whatever the number of tiles, and rank 0 reads only what it must write.

A report is one line of strict JSON (no pickle), then (if the rank wrote tiles) three binary
parts whose sizes the JSON gives, then a newline and the xxh3-64 of all that in hex: a torn
or altered report is refused.
Its tiles travel as the rank's **manifest section** (format version 2: files, byte offsets,
chunks, checksums, encoded by the rank itself, :func:`~tessera.format.manifest.encode_section`)
plus their geometry (tensor, offsets, lengths): rank 0 joins the sections' bytes as they are and
builds the index from the geometry alone; a version 1 manifest decodes the sections.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from ..errors import ManifestError
from .codec import MAX_FRAME_BYTES, ColumnBudget, FrameTable
from .manifest.section_doc import parse_section
from .manifest.sections import encode_section
from .names import DATA_DIR

REPORT_FORMAT = "tessera-rank-report"
REPORT_VERSION = 3
"""2: integer tile columns and the names deflated (a tenth of the bytes rank 0 reads).
3: the tiles as the rank's manifest section and one geometry table, after the JSON line."""
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
    geometry: ReportGeometry | None = None
    """The tiles' geometry, in the order of :attr:`section` (a report read without details has
    only this and the section, not :attr:`tiles`)."""
    section: bytes | None = None
    """The rank's manifest section, as it encoded it."""


@dataclass(frozen=True, eq=False)
class ReportGeometry:
    """What rank 0 needs of a rank's tiles to build a version 2 index: which tensor (in
    :attr:`names`) each tile is of and its box, in the order of the rank's section."""

    files: tuple[tuple[str, int], ...]
    names: tuple[str, ...]
    name: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    frames: tuple[FrameTable | None, ...] = ()
    """As :attr:`ReportTiles.frames`."""

    def __len__(self) -> int:
        return len(self.name)


def split_tiles(rank: int, t: ReportTiles, timings: dict[str, float] | None = None) -> tuple[ReportGeometry, bytes]:
    """A rank's tiles as its section (encoded here, at write time) and their geometry.

    The tiles are ordered by tensor, then by offsets (first dimension first): the order the
    index lists a tensor's rows of one section in.
    """
    n = len(t)
    nd = t.offsets.shape[1] if t.offsets.ndim == 2 else 0
    order = np.lexsort((*(t.offsets[:, d] for d in reversed(range(nd))), t.name)) if n else np.zeros(0, np.int64)
    chunks = t.chunks[order]
    starts = np.concatenate([[0], np.cumsum(t.chunks)]).astype(np.int64)
    first = np.concatenate([[0], np.cumsum(chunks)])[:-1].astype(np.int64)
    sums = t.checksums[np.arange(int(chunks.sum()), dtype=np.int64) - np.repeat(first - starts[order], chunks)]
    section = encode_section(
        rank, t.files, t.name[order], t.file[order], t.byte_offset[order], chunks, sums, timings, t.frames
    )
    return ReportGeometry(t.files, t.names, t.name[order], t.offsets[order], t.lengths[order], t.frames), section


def _b64(arr: np.ndarray, dtype: str) -> str:
    return base64.b64encode(np.ascontiguousarray(arr, dtype=dtype).tobytes()).decode("ascii")


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
    geo, section = report_parts(doc)
    blobs: list[bytes] = []
    if geo is not None and section is not None:
        body["files"] = [
            [p, n] if not geo.frames or geo.frames[i] is None else [p, n, geo.frames[i].to_json()]  # type: ignore[union-attr]
            for i, (p, n) in enumerate(geo.files)
        ]
        # Deflated: a rank's tensor names repeat prefixes, and ranks of one job often report the
        # very same list, which rank 0 then parses once (:func:`_names`).
        packed = zlib.compress(json.dumps(list(geo.names), separators=(",", ":")).encode(), 1)
        # One table (tensor, offsets, lengths per tile) in its narrowest integer type, read by
        # rank 0 without inflating; the rest of the tiles is the section, which rank 0 only copies.
        nd = int(geo.offsets.shape[1]) if geo.offsets.ndim == 2 else 0
        n = len(geo)
        rows = np.concatenate([geo.name.reshape(n, 1), geo.offsets.reshape(n, nd), geo.lengths.reshape(n, nd)], axis=1)
        width = _width(rows)
        body["tiles"] = {"count": n, "ndim": nd, "width": width}
        blobs = [packed, section, np.ascontiguousarray(rows, dtype=f"<i{width}").tobytes()]
        body["parts"] = [len(b) for b in blobs]
    data = b"\n".join([json.dumps(body, separators=(",", ":"), allow_nan=False).encode(), *blobs[:1]]) + b"".join(
        blobs[1:]
    )
    return data + b"\n" + xxhash.xxh3_64_hexdigest(data).encode()


def _width(rows: np.ndarray) -> int:
    """Bytes per value (1, 2, 4 or 8) of the narrowest signed type that holds every value of ``rows``."""
    top = int(rows.max()) if rows.size else 0
    return next(w for w in (1, 2, 4, 8) if top < 1 << (8 * w - 1))


def report_parts(doc: RankReportDoc) -> tuple[ReportGeometry | None, bytes | None]:
    """``(geometry, section)`` of a report (encoded from its tiles if it was not read from a file)."""
    if doc.geometry is not None or doc.tiles is None:
        return doc.geometry, doc.section
    return split_tiles(doc.rank, doc.tiles, doc.timings)


def decode_report(data: bytes, *, source: str, rank: int, save_id: str, details: bool = True) -> RankReportDoc:
    """Parse and check a report file written by rank ``rank`` for save ``save_id``.

    With ``details`` the section is decoded into :attr:`RankReportDoc.tiles` too; without,
    only the geometry is (what a version 2 index needs: the section's bytes are kept as read).

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
    header, _, tail = body.partition(b"\n")
    try:
        doc = json.loads(header)
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
    geo, section = _geometry(doc, tail, fail, len(data))
    return RankReportDoc(
        rank,
        save_id,
        with_details(geo, section, fail) if details and geo is not None else None,
        values,
        {k: (v[0], v[1]) for k, v in per_rank.items()},
        {str(k): float(v) for k, v in timings.items() if isinstance(v, int | float)},
        _replicas(doc.get("replicas"), fail),
        geo,
        section,
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


_NAMES: dict[bytes, tuple[str, ...]] = {}
"""Name lists already decoded, by their packed bytes (the ranks of one save mostly share a few)."""


def _names(packed: bytes, fail: Any) -> tuple[str, ...]:
    hit = _NAMES.get(packed)
    if hit is not None:
        return hit
    try:
        names = json.loads(zlib.decompressobj().decompress(packed, MAX_REPORT_BYTES))
    except (ValueError, zlib.error):
        raise fail("names are not a deflated JSON list") from None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise fail("names must be a list of strings")
    if len(_NAMES) >= 256:
        _NAMES.clear()
    out = _NAMES[packed] = tuple(names)
    return out


def _geometry(
    doc: dict[str, Any], tail: bytes, fail: Any, report_bytes: int
) -> tuple[ReportGeometry | None, bytes | None]:
    """The tiles' geometry and the section, from the parts after the report's JSON line:
    the deflated names, the section's bytes, the geometry table (sizes in ``parts``)."""
    files, raw, parts = doc.get("files"), doc.get("tiles"), doc.get("parts")
    if raw is None and files is None and parts is None:
        return None, None
    if not isinstance(files, list) or not all(
        isinstance(f, list) and len(f) in (2, 3) and isinstance(f[0], str) and type(f[1]) is int and f[1] >= 0
        for f in files
    ):
        raise fail("files must be [[path, bytes] or [path, bytes, frames], ...]")
    frames: list[FrameTable | None] = []
    budget = ColumnBudget(report_bytes)  # the report's frame tables together
    for f in files:
        try:
            frames.append(
                None
                if len(f) == 2
                else FrameTable.from_json(f[2], file_bytes=f[1], chunk_bytes=MAX_FRAME_BYTES, budget=budget)
            )
        except ValueError as e:
            raise fail(f"file {f[0]!r:.80}: {e}") from None
    if not isinstance(raw, dict) or not isinstance(parts, list) or len(parts) != 3:
        raise fail("tiles must be an object and parts a list of 3 sizes")
    n, nd, width = raw.get("count"), raw.get("ndim"), raw.get("width")
    if type(n) is not int or type(nd) is not int or n < 0 or not 0 <= nd <= 64 or width not in (1, 2, 4, 8):
        raise fail("tiles.count, tiles.ndim and tiles.width must be small non-negative integers")
    cols = 1 + 2 * nd
    if not all(type(x) is int and x >= 0 for x in parts) or sum(parts) != len(tail) or parts[2] != n * cols * width:
        raise fail(f"its parts {parts!r:.80} do not add up to its {len(tail)} bytes for {n} tiles")
    names = _names(tail[: parts[0]], fail)
    section = tail[parts[0] : parts[0] + parts[1]]
    rows = np.frombuffer(tail, dtype=f"<i{width}", count=n * cols, offset=parts[0] + parts[1])
    rows = rows.reshape(n, cols).astype(np.int64)
    if n and (int(rows.min()) < 0 or int(rows[:, 0].max()) >= len(names)):
        raise fail("tile geometry must be non-negative integers naming listed tensors")
    geo = ReportGeometry(
        tuple((f[0], f[1]) for f in files),
        names,
        rows[:, 0],
        rows[:, 1 : 1 + nd],
        rows[:, 1 + nd :],
        tuple(frames) if any(fr is not None for fr in frames) else (),
    )
    return geo, section


def with_details(geo: ReportGeometry, section: bytes | None, fail: Any) -> ReportTiles:
    """The full tiles of a report: its geometry joined with its decoded section."""
    try:
        s = parse_section(section or b"", "the section", frames_chunk_bytes=MAX_FRAME_BYTES, delta_frames=True)
    except ManifestError as e:
        raise fail(str(e)) from None
    if len(s.tensor) != len(geo) or not np.array_equal(s.tensor, geo.name):
        raise fail("its section and its geometry list different tiles")
    framed = [fr is not None for fr in geo.frames] if geo.frames else [False] * len(geo.files)
    if tuple((f.path, f.nbytes) for f in s.files) != geo.files or [f.frames is not None for f in s.files] != framed:
        raise fail("its section and its report list different files")
    return ReportTiles(
        geo.files,
        geo.names,
        s.file,
        geo.name,
        geo.offsets,
        geo.lengths,
        s.byte_offset,
        s.chunks,
        s.checksums,
        geo.frames,
    )


def details(doc: RankReportDoc, source: str) -> RankReportDoc:
    """``doc`` with :attr:`~RankReportDoc.tiles` decoded from its section (a no-op if it has them)."""
    if doc.tiles is not None or doc.geometry is None:
        return doc

    def fail(what: str) -> ManifestError:
        return ManifestError(f"{source}: invalid report of rank {doc.rank}: {what}")

    return dataclasses.replace(doc, tiles=with_details(doc.geometry, doc.section, fail))
