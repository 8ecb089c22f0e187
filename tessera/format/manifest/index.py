"""Format version 2, reading: the index (``manifest.json``) and the sections a reader needs.

:func:`decode_index` validates the index's top level, every tensor's dtype and shape, the
declared size of every tensor's geometry and the section table; a tensor's geometry is
decoded and validated on first use. :meth:`Index.decode_section` checks one section's bytes
against the table's xxh3-64 and decodes it with the decoder's rules (strict types, confined
file references, inflation bounded by the section's size); :meth:`Index.assemble` joins the
index with the sections read into a :class:`Manifest` (all of them: the whole manifest, as
version 1 gives it; some of them: only the tiles of those sections) that planners and readers
use unchanged. No I/O here: the caller reads the bytes (:mod:`tessera.engine.loading.sections`).
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from ...errors import ManifestError
from ..names import check_relpath
from .decoder import head_fields, manifest_from, tensor_header, unique_keys
from .schema import (
    DECODE_RATIO,
    DECODE_SLACK,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    MAX_SECTIONS_BYTES,
    MIN_SECTION_BYTES_PER_TILE,
    SECTIONED_VERSION,
    FileEntry,
    Manifest,
    TensorEntry,
    TileTable,
)
from .tiles import Budget, Context, as_dict, as_int, check_columns, column, fail


@dataclass(frozen=True)
class Section:
    """One decoded section: its files and its tiles' details, in index order."""

    number: int
    rank: int
    files: tuple[FileEntry, ...]
    tensor: np.ndarray
    file: np.ndarray
    byte_offset: np.ndarray
    chunks: np.ndarray
    checksums: np.ndarray


class _Geometry:
    """A tensor's index columns (offsets, lengths, section), decoded and checked on first use."""

    def __init__(self, name: str, position: int, raw: Any, ndim: int, sections: int, tiles: Budget) -> None:
        self.name, self.position, self.ndim, self.sections = name, position, ndim, sections
        raw = as_dict(raw, f"tensor '{name}' tile_index")
        self.count = as_int(raw.get("count"), f"tensor '{name}' tile_index count")
        tiles.take(self.count, f"tensor '{name}': tile_index.count {self.count}")
        self._raw: dict | None = raw
        self._cols: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._lock = threading.Lock()
        self.longest: int | None = None
        """The longest tile along the first dimension if the tiles are sorted by their first offset, else -1."""
        self.ascending: bool | None = None
        """Whether the section column never decreases (each saving rank's tiles of one tensor together)."""

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        with self._lock:
            if self._cols is None:
                what, raw, n, nd = f"tensor '{self.name}'", self._raw, self.count, self.ndim
                if raw is None:
                    raise fail(f"{what}: tile_index is invalid")
                self._raw = None
                offs = column(what, raw, "offsets", n * nd, n, "tile_index").reshape(n, nd)
                lens = column(what, raw, "lengths", n * nd, n, "tile_index").reshape(n, nd)
                sec = column(what, raw, "section", n, n, "tile_index")
                if n and int(sec.max()) >= self.sections:
                    raise fail(f"{what}: a tile is in section #{int(sec.max())} but there are {self.sections}")
                self._cols = (offs, lens, sec)
            return self._cols


class Index:
    """A decoded version 2 index: the manifest without its sections, and where they are."""

    def __init__(self, source: str, head: tuple, doc: dict, tensors: dict, sizes: dict, table: tuple) -> None:
        self.source = source
        self._doc, self._head = doc, head
        self.version, self.save_id, self.world_size, self.chunk_bytes = head[1], head[2], head[3], head[4]
        self.tensors: dict[str, tuple[str, tuple[int, ...]]] = tensors
        self._sizes = sizes
        self.geometry: dict[str, _Geometry] = {}
        self.sections_path, self.sections_bytes, self.offset, self.length, self.checksums = table
        self._shell: Manifest | None = None

    @property
    def section_count(self) -> int:
        return len(self.offset)

    def decode_section(self, number: int, data: bytes, *, rank: int | None = None) -> Section:
        """Check ``data`` (section ``number``'s bytes) against its xxh3-64 and decode it.

        Args:
            rank: the loading rank, for the error message.

        Raises:
            ManifestError: naming the section, the sections file and the rank.
        """
        where = f"{self.source}: section {number} of {self.sections_path}" + (
            f" (read by rank {rank})" if rank is not None else ""
        )
        if len(data) != int(self.length[number]) or xxhash.xxh3_64_intdigest(data) != int(self.checksums[number]):
            raise ManifestError(
                f"{where}: checksum mismatch ({len(data)} bytes, xxh3 {xxhash.xxh3_64_hexdigest(data)}, expected "
                f"{int(self.length[number])} bytes, xxh3 {int(self.checksums[number]):016x}): the sections file is "
                "damaged or was replaced; run `tessera verify`"
            )
        try:
            return _section(number, data, len(self.tensors))
        except ManifestError as e:
            raise ManifestError(f"{where}: {e}") from None
        except RecursionError:
            raise ManifestError(f"{where}: invalid manifest: nested too deeply") from None

    def rows_for(self, name: str, boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> np.ndarray:
        """Rows of ``name``'s tiles that meet any of ``boxes`` (``(offsets, lengths)``), ascending.

        Tiles sorted by their first offset (as saves store them) are searched by bisection:
        the cost is in proportion to the tiles near a box, not to the tensor's tiles.
        """
        offs, lens, _ = self._columns(name)
        n = len(offs)
        if not n or not offs.shape[1]:
            return np.arange(n)
        g = self.geometry[name]
        if g.longest is None:
            starts = offs[:, 0]
            g.longest = int(lens[:, 0].max()) if bool((starts[1:] >= starts[:-1]).all()) else -1
        found = []
        for o, ln in boxes:
            lo = np.asarray(o, dtype=np.int64)
            hi = lo + np.asarray(ln, dtype=np.int64)
            if g.longest >= 0:  # earlier tiles end before the box, later ones start after it
                a = int(np.searchsorted(offs[:, 0], lo[0] - g.longest, side="right"))
                b = int(np.searchsorted(offs[:, 0], hi[0], side="left"))
                near = np.arange(a, max(a, b))
            else:
                near = np.arange(n)
            meet = ((offs[near] < hi) & (offs[near] + lens[near] > lo)).all(axis=1)
            found.append(near[meet])
        return np.unique(np.concatenate(found)) if len(found) > 1 else found[0]

    def sections_of(self, rows: Mapping[str, np.ndarray]) -> list[int]:
        """The sections that hold the given tiles (``tensor name -> rows``), ascending."""
        found = [self._columns(n)[2][r] for n, r in rows.items() if len(r)]
        return np.unique(np.concatenate(found)).tolist() if found else []

    def _columns(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        try:
            return self.geometry[name].columns()
        except ManifestError as e:
            raise ManifestError(f"{self.source}: {e}") from None

    def assemble(self, sections: Mapping[int, Section], rows: Mapping[str, np.ndarray] | None = None) -> Manifest:
        """The manifest of the index and ``sections``: every tile (``rows`` None: every section
        must be given), or only ``rows`` of each tensor named there (tensors not named have no
        tiles: a manifest for planning the reads of those rows only).

        Raises:
            ManifestError: a section disagrees with the index (naming the tensor and section).
        """
        numbers = sorted(sections)
        files: list[FileEntry] = []
        base = np.zeros(self.section_count + 1, dtype=np.int64)
        seen: set[str] = set()
        for number in numbers:
            base[number] = len(files)
            for f in sections[number].files:
                if f.path in seen:
                    raise ManifestError(f"{self.source}: invalid manifest: file {f.path!r} is listed twice")
                seen.add(f.path)
                files.append(f)
        secs = [sections[number] for number in numbers]
        ntensors = max(1, len(self.tensors))
        key = np.concatenate(
            [number * ntensors + c.tensor for number, c in zip(numbers, secs)] or [np.zeros(0, np.int64)]
        )
        fidx = np.concatenate([base[number] + c.file for number, c in zip(numbers, secs)] or [np.zeros(0, np.int64)])
        bo = np.concatenate([c.byte_offset for c in secs] or [np.zeros(0, np.int64)])
        chunks = np.concatenate([c.chunks for c in secs] or [np.zeros(0, np.int64)])
        sums = np.concatenate([c.checksums for c in secs] or [np.zeros(0, np.uint64)])
        sum_starts = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int64)
        ctx = Context(self.source, tuple(files), self.chunk_bytes, Budget(1 << 62))
        present = np.zeros(self.section_count, dtype=bool)
        present[numbers] = True
        tensors: dict[str, TensorEntry] = {}
        total = 0
        for ti, (name, (dtype, shape)) in enumerate(self.tensors.items()):
            if rows is not None and name not in rows:
                continue
            offs, lens, sec = self._columns(name)
            want = np.arange(len(sec)) if rows is None else rows[name]
            total += len(sec)
            s = sec[want]
            what = f"tensor '{name}'"
            if len(s) and not present[s].all():
                raise ManifestError(f"{self.source}: {what}: section {int(s[~present[s]][0])} was not read")
            # Tile i of a tensor is its k-th tile in section s: that section's k-th row of this tensor.
            g = self.geometry[name]
            if g.ascending is None:
                g.ascending = bool((sec[1:] >= sec[:-1]).all())
            if g.ascending:  # bisection over the wanted rows only
                rank_in = want - np.searchsorted(sec, s, side="left")
            else:
                order = np.argsort(sec, kind="stable")
                every = np.empty(len(sec), dtype=np.int64)
                every[order] = np.arange(len(sec)) - np.searchsorted(sec[order], sec[order])
                rank_in = every[want]
            k = s * ntensors + ti
            pos = np.searchsorted(key, k) + rank_in
            ok = pos < len(key)
            ok[ok] = key[pos[ok]] == k[ok]
            if not ok.all():
                bad = int(s[~ok][0])
                raise ManifestError(
                    f"{self.source}: invalid manifest: {what}: section {bad} of {self.sections_path} holds fewer "
                    "of its tiles than the index says"
                )
            if len(s):  # and no more than the index says, in each section read
                us = np.unique(s)
                if g.ascending:
                    expected = np.searchsorted(sec, us, side="right") - np.searchsorted(sec, us, side="left")
                else:
                    expected = np.bincount(sec, minlength=self.section_count)[us]
                held = np.searchsorted(key, us * ntensors + ti, side="right") - np.searchsorted(key, us * ntensors + ti)
                if not np.array_equal(held, expected):
                    bad = int(us[np.flatnonzero(held != expected)[0]])
                    raise ManifestError(
                        f"{self.source}: invalid manifest: {what}: section {bad} of {self.sections_path} holds "
                        "a different number of its tiles than the index says"
                    )
            counts = chunks[pos]
            first = np.concatenate([[0], np.cumsum(counts)])[:-1].astype(np.int64)
            gather = (
                np.arange(int(counts.sum()), dtype=np.int64)
                - np.repeat(first, counts)
                + np.repeat(sum_starts[pos], counts)
            )
            cols = (fidx[pos], offs[want], lens[want], bo[pos], counts, sums[gather])
            try:
                table = check_columns(ctx, name, shape, self._sizes[name], cols)
            except ManifestError as e:
                raise ManifestError(f"{self.source}: {e}") from None
            tensors[name] = TensorEntry(dtype, shape, table=table)
        if rows is None and total != len(key):
            raise ManifestError(
                f"{self.source}: invalid manifest: the sections hold {len(key)} tiles, the index {total}"
            )
        return self._manifest(tensors, tuple(files))

    def shell(self, tables: Callable[[str], TileTable]) -> Manifest:
        """The manifest with each tensor's tiles from ``tables(name)`` on first use (files: none listed)."""
        tensors = {
            name: TensorEntry(dtype, shape, loader=functools.partial(tables, name), count=self.geometry[name].count)
            for name, (dtype, shape) in self.tensors.items()
        }
        return self._manifest(tensors, ())

    def _manifest(self, tensors: dict[str, TensorEntry], files: tuple[FileEntry, ...]) -> Manifest:
        head = self._head
        return manifest_from(self._doc, SECTIONED_VERSION, head[2], head[3], head[4], files, tensors)


def decode_index(data: bytes, *, source: str = MANIFEST_NAME) -> Index:
    """Parse and validate a version 2 ``manifest.json`` (the index), without its sections.

    Raises:
        ManifestError: naming ``source`` and the first problem (a version 1 manifest too).
    """
    try:
        return _decode_index(data, source)
    except ManifestError as e:
        raise ManifestError(f"{source}: {e}") from None
    except RecursionError:
        raise ManifestError(f"{source}: invalid manifest: nested too deeply") from None


def _decode_index(data: bytes, source: str) -> Index:
    head = head_fields(data, SECTIONED_VERSION)
    doc = head[0]
    raw = as_dict(doc.get("sections"), "sections")
    path = check_relpath(raw.get("path"))  # type: ignore[arg-type]  # check_relpath refuses non-strings
    nbytes = as_int(raw.get("bytes"), "sections.bytes")
    count = as_int(raw.get("count"), "sections.count")
    if nbytes > MAX_SECTIONS_BYTES:
        raise fail(f"sections.bytes {nbytes} is over the {MAX_SECTIONS_BYTES}-byte limit")
    budget = Budget(DECODE_RATIO * len(data) + DECODE_SLACK)
    budget.take(24 * count, f"sections.count {count}")
    # The geometry deflates far better than the checksums that bound version 1 tables: its
    # tiles are bounded by what the sections file the index names can describe instead.
    tiles = Budget(nbytes // MIN_SECTION_BYTES_PER_TILE)
    offset = column("the index", raw, "offset", count, count, "sections")
    length = column("the index", raw, "length", count, count, "sections")
    sums = column("the index", raw, "checksums", count, count, "sections")
    if count and ((length < 1).any() or (length > MAX_MANIFEST_BYTES).any() or (offset + length > nbytes).any()):
        raise fail(f"sections: a section's range lies outside {path} ({nbytes} bytes) or is empty or too large")
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    sizes: dict[str, int] = {}
    geometry: dict[str, _Geometry] = {}
    for i, (name, raw_entry) in enumerate(as_dict(doc.get("tensors"), "tensors").items()):
        tdoc = as_dict(raw_entry, f"tensor '{name}'")
        dtype, shape, size = tensor_header(name, tdoc)
        tensors[name], sizes[name] = (dtype, shape), size
        geometry[name] = _Geometry(name, i, tdoc.get("tile_index"), len(shape), count, tiles)
    index = Index(source, head, doc, tensors, sizes, (path, nbytes, offset, length, sums))
    index.geometry = geometry
    index._manifest({}, ())  # values, per_rank and names: checked now, not on first use
    return index


def _section(number: int, data: bytes, ntensors: int) -> Section:
    if len(data) > MAX_MANIFEST_BYTES:
        raise fail(f"size {len(data)} bytes is over the {MAX_MANIFEST_BYTES}-byte limit")
    try:
        doc = json.loads(data, object_pairs_hook=unique_keys)
    except ManifestError:
        raise
    except (ValueError, UnicodeDecodeError) as e:
        raise fail(f"not valid JSON ({e})") from None
    doc = as_dict(doc, "the section")
    if doc.get("section") != number:
        raise fail(f"the section says it is number {doc.get('section')!r:.40}")
    rank = as_int(doc.get("rank"), "section rank")
    raw_files = doc.get("files")
    if not isinstance(raw_files, list):
        raise fail("section files must be a list")
    files = []
    for i, f in enumerate(raw_files):
        if not isinstance(f, list) or len(f) != 3:
            raise fail(f"section files[{i}] must be [path, rank, bytes]")
        files.append(FileEntry(check_relpath(f[0]), as_int(f[1], "file rank"), as_int(f[2], "file bytes")))
    tiles = as_dict(doc.get("tiles"), "section tiles")
    n = as_int(tiles.get("count"), "section tiles count")
    budget = Budget(DECODE_RATIO * len(data) + DECODE_SLACK)
    budget.take(32 * n, f"section tiles count {n}")
    what = f"section {number}"
    tensor = column(what, tiles, "tensor", n, n, "tiles")
    fidx = column(what, tiles, "file", n, n, "tiles")
    bo = column(what, tiles, "byte_offset", n, n, "tiles")
    chunks = column(what, tiles, "chunks", n, n, "tiles")
    total = int(chunks.sum())
    budget.take(8 * total, f"section chunks (sum {total})")
    sums = column(what, tiles, "checksums", total, total, "tiles")
    if n and (int(tensor.max()) >= ntensors or (np.diff(tensor) < 0).any()):
        raise fail(f"{what}: tile tensors must be ascending indices below {ntensors}")
    if n and int(fidx.max()) >= len(files):
        raise fail(f"{what}: a tile refers to file #{int(fidx.max())} but the section lists {len(files)}")
    return Section(number, rank, tuple(files), tensor, fidx, bo, chunks, sums)
