"""The strict manifest decoder: ``manifest.json`` bytes (hostile until proven otherwise) to a Manifest.

Size limit, strict types, dtype whitelist, file references confined to the checkpoint, tiles
inside their tensor, and a budget on how far compressed tile tables may inflate. Tile
tables are validated with whole-column numpy operations (no per-tile Python work), and may
be decoded lazily, on first use of each tensor, so that a reader that needs a few tensors of
a large manifest does not pay for all of them.
"""

from __future__ import annotations

import json
import math
from typing import Any, NamedTuple

import torch

from ...errors import ManifestError
from ..chunking import Chunking
from ..codec import ColumnBudget, FrameTable
from ..dtypes import dtype_from_name, itemsize
from ..names import check_reference
from .schema import (
    CHECKSUM_ALGORITHM,
    COMPRESSED_VERSION,
    DECODE_RATIO,
    DECODE_SLACK,
    FORMAT,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    NEWEST_VERSION,
    SECTIONED_COMPRESSED_VERSION,
    SECTIONED_VERSION,
    VERSION,
    FileEntry,
    Manifest,
    PerRankEntry,
    TensorEntry,
)
from .tiles import Budget, Context, EncodedTiles, as_dict, as_int, fail


def _ints(x: Any, what: str) -> tuple[int, ...]:
    if not isinstance(x, list):
        raise fail(f"{what} must be a list of integers")
    return tuple(as_int(v, what) for v in x)


def decode(data: bytes, *, source: str = MANIFEST_NAME, lazy: bool = False) -> Manifest:
    """Parse and validate ``manifest.json`` bytes.

    Args:
        data: the bytes of ``manifest.json``.
        source: where they come from, for error messages.
        lazy: validate the top level, every tensor's dtype and shape and every tile table's
            declared size now, but decode and validate each tensor's tiles only when they are
            first used (``entry.table``, ``entry.tiles``, ``entry.tile(i)``); an invalid table
            then raises :class:`ManifestError` naming ``source`` and the tensor at that point.
            For readers that need a few tensors of a large manifest (a loading rank).
            :meth:`Manifest.validate_all` decodes the rest. Readers that must find every
            problem up front (``tessera verify``) keep the default.

    Raises:
        ManifestError: naming ``source`` and the first problem found.

    Example:
        >>> m = decode(data, lazy=True)  # parses the JSON; decodes no tile table
        >>> m.tensors["model.w"].table.offsets  # decodes and validates this one
    """
    try:
        return _decode(data, source, lazy)
    except ManifestError as e:
        raise ManifestError(f"{source}: {e}") from None
    except RecursionError:
        raise ManifestError(f"{source}: invalid manifest: nested too deeply") from None


def decode_files(data: bytes, *, source: str = MANIFEST_NAME) -> tuple[str, tuple[FileEntry, ...]]:
    """The save id and file list of ``manifest.json`` bytes, validated, without decoding any tensor.

    For readers that need only which files a checkpoint uses (collection of shared tiles):
    tens of times faster than :func:`decode` on a manifest with many tensors.

    Raises:
        ManifestError: naming ``source`` and the first problem found.
    """
    try:
        head = _head(data)
    except ManifestError as e:
        raise ManifestError(f"{source}: {e}") from None
    except RecursionError:
        raise ManifestError(f"{source}: invalid manifest: nested too deeply") from None
    return head.save_id, head.files


class _Head(NamedTuple):
    doc: dict
    version: int
    save_id: str
    world_size: int
    chunking: Chunking
    files: tuple[FileEntry, ...]


def _head(data: bytes) -> _Head:
    """The top level of a manifest: everything but tensors, values and the informational fields."""
    doc, version, save_id, world_size, chunking = head_fields(data, VERSION)
    files = _files(doc, version, chunking.chunk_bytes, len(data))
    return _Head(doc, version, save_id, world_size, chunking, files)


def head_fields(data: bytes, expected: int) -> tuple[dict, int, str, int, Chunking]:
    """The top level of a manifest of format version ``expected``: the document, version, save id,
    world size and how tiles are cut into checksum chunks (no tensors, files or values)."""
    doc = strict_json(data, "the top level", "; the file is truncated or not a tessera manifest")
    if doc.get("format") != FORMAT:
        raise fail(f"format is {doc.get('format')!r:.40}, expected {FORMAT!r}")
    version = as_int(doc.get("version"), "version", 1)
    if version > NEWEST_VERSION:
        raise fail(f"format version {version} is newer than this tessera reads ({NEWEST_VERSION}); upgrade tessera")
    # Version 3 is the inline form (version 1) with compressed files, version 4 the sectioned one (2).
    form = {COMPRESSED_VERSION: VERSION, SECTIONED_COMPRESSED_VERSION: SECTIONED_VERSION}.get(version, version)
    if form != expected:
        raise fail(
            f"format version {version}: "
            + (
                "an index whose tiles are in sections; read it with tessera.read_manifest (not decode)"
                if form == SECTIONED_VERSION
                else "not an index; read it with tessera.read_manifest"
            )
        )
    save_id = doc.get("save_id")
    if not isinstance(save_id, str):
        raise fail("save_id must be a string")
    world_size = as_int(doc.get("world_size"), "world_size", 1)
    checksum = as_dict(doc.get("checksum"), "checksum")
    if checksum.get("algorithm") != CHECKSUM_ALGORITHM:
        raise fail(f"unknown checksum algorithm {checksum.get('algorithm')!r:.40}")
    chunk_bytes = as_int(checksum.get("chunk_bytes"), "checksum.chunk_bytes", 1)
    try:
        chunking = Chunking.from_json(checksum, chunk_bytes)
    except ValueError as e:
        raise fail(str(e)) from None
    if chunking.tile_chunks and version not in (COMPRESSED_VERSION, SECTIONED_COMPRESSED_VERSION):
        raise fail(f"checksum.tile_chunks is in a version {version} manifest; only versions 3 and 4 cut tiles per size")
    return doc, version, save_id, world_size, chunking


def _files(doc: dict, version: int, chunk_bytes: int, doc_bytes: int) -> tuple[FileEntry, ...]:
    raw_files = doc.get("files")
    if not isinstance(raw_files, list):
        raise fail("files must be a list")
    files = []
    seen_paths: set[str] = set()
    budget = ColumnBudget(doc_bytes)  # all files' frame tables together
    for i, raw_file in enumerate(raw_files):
        f = as_dict(raw_file, f"files[{i}]")
        try:
            path = check_reference(f.get("path"))
        except ManifestError as e:
            raise fail(f"files[{i}]: {e}") from None
        nbytes = as_int(f.get("bytes"), "file bytes")
        frames = None
        if "frames" in f:
            if version != COMPRESSED_VERSION:
                raise fail(f"files[{i}]: a compressed file (frames) in a version {version} manifest")
            try:
                frames = FrameTable.from_json(f["frames"], file_bytes=nbytes, chunk_bytes=chunk_bytes, budget=budget)
            except ValueError as e:
                raise fail(f"files[{i}] ({path}): {e}") from None
        entry = FileEntry(path, as_int(f.get("rank"), "file rank"), nbytes, frames)
        if entry.path in seen_paths:
            raise fail(f"files[{i}]: file {entry.path!r} is listed twice")
        seen_paths.add(entry.path)
        files.append(entry)
    framed = {fe.path for fe in files if fe.frames is not None}
    for fe in files:
        missing = [p for p in (fe.frames.delta.parents if fe.frames and fe.frames.delta else ()) if p not in framed]
        if missing:
            raise fail(f"file {fe.path!r}: its delta frames need {missing[0]!r}, not a compressed file of the manifest")
    return tuple(files)


def _decode(data: bytes, source: str, lazy: bool) -> Manifest:
    doc, version, save_id, world_size, chunking, files = _head(data)
    tensors: dict[str, TensorEntry] = {}
    # Shared by every tensor: per-tensor copies would cost tensors x files.
    ctx = Context(source, files, chunking, Budget(DECODE_RATIO * len(data) + DECODE_SLACK))
    for name, raw_entry in as_dict(doc.get("tensors"), "tensors").items():
        tdoc = as_dict(raw_entry, f"tensor '{name}'")
        dtype, shape, size = tensor_header(name, tdoc)
        encoded = EncodedTiles(ctx, name, tdoc, shape, size)
        if lazy:
            tensors[name] = TensorEntry(dtype, shape, loader=encoded, count=encoded.count)
        else:
            tensors[name] = TensorEntry(dtype, shape, table=encoded.decode())
    return manifest_from(doc, version, save_id, world_size, chunking, files, tensors)


def tensor_header(name: str, tdoc: dict) -> tuple[str, tuple[int, ...], int]:
    """A tensor entry's dtype name, shape and item size, checked."""
    try:
        dt = dtype_from_name(tdoc.get("dtype"))  # type: ignore[arg-type]  # it refuses non-strings
    except ValueError as err:
        raise fail(f"tensor '{name}': {err}") from None
    shape = _ints(tdoc.get("shape"), f"tensor '{name}' shape")
    size = _itemsize(dt)
    if math.prod(shape) * size >= 1 << 62:
        raise fail(f"tensor '{name}': shape {list(shape)} is implausibly large")
    return tdoc["dtype"], shape, size


def manifest_from(
    doc: dict,
    version: int,
    save_id: str,
    world_size: int,
    chunking: Chunking,
    files: tuple[FileEntry, ...],
    tensors: dict[str, TensorEntry],
) -> Manifest:
    """The manifest of a decoded top level ``doc`` with ``files`` and ``tensors``: values and
    per-rank values checked, names unique across the three maps."""
    per_rank = {}
    for name, v in as_dict(doc.get("per_rank", {}), "per_rank").items():
        v = as_dict(v, f"per_rank '{name}'")
        vals = v.get("values")
        if (
            v.get("on_resize") not in ("error", "keep", "modulo")
            or not isinstance(vals, list)
            or len(vals) != world_size
        ):
            raise fail(f"per_rank '{name}' must have on_resize and one value per saving rank")
        per_rank[name] = PerRankEntry(v["on_resize"], tuple(vals))

    values = as_dict(doc.get("values", {}), "values")
    names = set(doc.get("tensors", {})) if isinstance(doc.get("tensors"), dict) else set(tensors)
    for name in (names & set(values)) | ((names | set(values)) & set(per_rank)):
        where = [s for s, d in (("tensors", names), ("values", values), ("per_rank", per_rank)) if name in d]
        raise fail(f"name {name!r:.200} appears in both {where[0]} and {where[1]}; names must be unique")
    return Manifest(
        save_id=save_id,
        world_size=world_size,
        chunk_bytes=chunking.chunk_bytes,
        chunking=chunking,
        tensors=tensors,
        values=values,
        per_rank=per_rank,
        files=tuple(files),
        layout=as_dict(doc.get("layout", {}), "layout"),
        timings=as_dict(doc.get("timings", {}), "timings"),
        metadata=as_dict(doc.get("metadata", {}), "metadata"),
        version=version,
    )


_ITEMSIZES: dict[torch.dtype, int] = {}


def _itemsize(dt: torch.dtype) -> int:
    size = _ITEMSIZES.get(dt)
    if size is None:
        size = _ITEMSIZES[dt] = itemsize(dt)
    return size


def strict_json(data: bytes, what: str, hint: str = "") -> dict:
    """``data`` as one JSON object, refused past :data:`MAX_MANIFEST_BYTES` or with a key given
    twice (``what`` names it in errors; ``hint`` follows a parse error): the manifest, its index
    and its sections are parsed alike."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise fail(f"size {len(data)} bytes is over the {MAX_MANIFEST_BYTES}-byte limit")
    try:
        doc = json.loads(data, object_pairs_hook=unique_keys)
    except ManifestError:
        raise
    except (ValueError, UnicodeDecodeError) as e:
        raise fail(f"not valid JSON ({e}){hint}") from None
    return as_dict(doc, what)


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict, refusing a key given twice (JSON parsers disagree on which wins)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise fail(f"key {dup!r:.200} appears twice in one JSON object")
    return out
