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

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import xxhash

from ...errors import ManifestError
from ..names import check_relpath
from .blocks import Geometry, pick_many
from .decoder import head_fields, manifest_from, tensor_header
from .schema import (
    DECODE_RATIO,
    DECODE_SLACK,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    MAX_SECTIONS_BYTES,
    MIN_SECTION_BYTES_PER_TILE,
    SECTIONED_COMPRESSED_VERSION,
    SECTIONED_VERSION,
    FileEntry,
    Manifest,
    TensorEntry,
    TileTable,
)
from .section_doc import parse_section
from .tiles import Budget, Context, as_dict, as_int, check_columns, check_many, column, fail


@dataclass(frozen=True)
class Section:
    """One decoded section: its files and its tiles' details, in the section's order.

    ``tensor`` is each tile's tensor position in the index and ``k`` its place among the
    section's tiles of that tensor: the tile of the index row whose place is ``(section, k)``.
    """

    number: int
    rank: int
    files: tuple[FileEntry, ...]
    tensor: np.ndarray
    k: np.ndarray
    file: np.ndarray
    byte_offset: np.ndarray
    chunks: np.ndarray
    checksums: np.ndarray
    timings: dict | None = None
    """The saving rank's timings of the save (``timings.save.ranks[rank]`` of the manifest read whole)."""


class Index:
    """A decoded version 2 index: the manifest without its sections, and where they are."""

    def __init__(self, source: str, head: tuple, doc: dict, tensors: dict, sizes: dict, table: tuple) -> None:
        self.source = source
        self._doc, self._head = doc, head
        self.version, self.save_id, self.world_size, self.chunking = head[1], head[2], head[3], head[4]
        self.chunk_bytes = self.chunking.chunk_bytes
        self.tensors: dict[str, tuple[str, tuple[int, ...]]] = tensors
        self._sizes = sizes
        self.geometry: dict[str, Geometry] = {}
        self.sections_path, self.sections_bytes, self.offset, self.length, self.checksums = table[:5]
        self.section_rank, self.section_list, self.tensor_lists = table[5:]
        self._shell: Manifest | None = None
        self._counts = np.zeros(0, dtype=np.int64)

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
            return self._section(number, data)
        except ManifestError as e:
            raise ManifestError(f"{where}: {e}") from None
        except RecursionError:
            raise ManifestError(f"{where}: invalid manifest: nested too deeply") from None

    def _section(self, number: int, data: bytes) -> Section:
        framed = self.chunk_bytes if self.version == SECTIONED_COMPRESSED_VERSION else None
        doc = parse_section(data, f"section {number}", frames_chunk_bytes=framed)
        if doc.rank != int(self.section_rank[number]):
            raise fail(
                f"section {number} says it is rank {doc.rank}'s, the index says rank {int(self.section_rank[number])}'s"
            )
        tensors = self.tensor_lists[int(self.section_list[number])]
        n = len(doc.tensor)
        if n and int(doc.tensor.max()) >= len(tensors):
            raise fail(
                f"section {number}: a tile's tensor #{int(doc.tensor.max())} is not in its list of {len(tensors)}"
            )
        tensor = tensors[doc.tensor] if n else doc.tensor
        # k: the place of each tile among the section's tiles of its tensor, in section order.
        order = np.argsort(tensor, kind="stable")
        by = tensor[order]
        at = np.arange(n, dtype=np.int64)
        k = np.empty(n, dtype=np.int64)
        k[order] = at - np.searchsorted(by, by)
        if n and (k >= self._counts[tensor]).any():
            raise fail(f"section {number} holds more tiles of a tensor than the tensor has")
        return Section(
            number, doc.rank, doc.files, tensor, k, doc.file, doc.byte_offset, doc.chunks, doc.checksums, doc.timings
        )

    def rows_for(self, name: str, boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> np.ndarray:
        """Rows of ``name``'s tiles that meet any of ``boxes`` (``(offsets, lengths)``), ascending.

        Only the geometry blocks whose first-dimension range meets a box are inflated: the cost
        is in proportion to the tiles near the boxes, not to the tensor's tiles.
        """
        g = self.geometry[name]
        lo = np.array([o for o, _ in boxes], dtype=np.int64).reshape(len(boxes), g.ndim)
        hi = lo + np.array([ln for _, ln in boxes], dtype=np.int64).reshape(len(boxes), g.ndim)
        try:
            return g.pick(lo, hi)
        except ManifestError as e:
            raise ManifestError(f"{self.source}: {e}") from None

    def rows_for_many(
        self, boxes: Mapping[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]
    ) -> dict[str, np.ndarray]:
        """:meth:`rows_for` of every tensor in ``boxes`` at once (whole-array work, not per tensor)."""
        items = []
        for name, b in boxes.items():
            g = self.geometry[name]
            lo = np.array([o for o, _ in b], dtype=np.int64).reshape(len(b), g.ndim)
            items.append((g, lo, lo + np.array([ln for _, ln in b], dtype=np.int64).reshape(len(b), g.ndim)))
        try:
            return dict(zip(boxes, pick_many(items)))
        except ManifestError as e:
            raise ManifestError(f"{self.source}: {e}") from None

    def sections_of(self, rows: Mapping[str, np.ndarray]) -> list[int]:
        """The sections that hold the given tiles (``tensor name -> rows``), ascending."""
        found = [self._take(n, r)[2][:, 0] for n, r in rows.items() if len(r)]
        return np.unique(np.concatenate(found)).tolist() if found else []

    def _take(self, name: str, rows: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        g = self.geometry[name]
        try:
            if rows is None:
                return g.rows(np.arange(g.block_count))[1:]
            return g.take(rows)
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
        z = np.zeros(0, np.int64)
        ntensors = max(1, len(self.tensors))
        # Every entry read, keyed by (section, tensor, k), and sorted by that key.
        group = np.concatenate([number * ntensors + c.tensor for number, c in zip(numbers, secs)] or [z])
        k = np.concatenate([c.k for c in secs] or [z])
        fidx = np.concatenate([base[number] + c.file for number, c in zip(numbers, secs)] or [z])
        bo = np.concatenate([c.byte_offset for c in secs] or [z])
        chunks = np.concatenate([c.chunks for c in secs] or [z])
        sums = np.concatenate([c.checksums for c in secs] or [np.zeros(0, np.uint64)])
        sum_starts = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int64)
        groups, group_of = np.unique(group, return_inverse=True)
        present = np.zeros(self.section_count, dtype=bool)
        present[numbers] = True
        wanted = []
        for ti, name in enumerate(self.tensors):
            if rows is not None and name not in rows:
                continue
            want = np.arange(self.geometry[name].count) if rows is None else rows[name]
            wanted.append((ti, name, want, *self._take(name, None if rows is None else want)))
        place = np.concatenate([w[5] for w in wanted] or [z.reshape(0, 2)])
        sec, want_k = place[:, 0], place[:, 1]
        tis = np.concatenate([np.full(len(w[2]), w[0], np.int64) for w in wanted] or [z])
        names = list(self.tensors)
        if len(sec) and not present[sec].all():
            i = int(np.flatnonzero(~present[sec])[0])
            raise ManifestError(f"{self.source}: tensor '{names[int(tis[i])]}': section {int(sec[i])} was not read")
        # k is below its tensor's count, below 2**30 (the tiles budget): no key overflows.
        inside = want_k < self._counts[tis]
        want_k = np.where(inside, want_k, 0)
        span = max(int(k.max()) if len(k) else 0, int(want_k.max()) if len(want_k) else 0) + 1
        key = group_of.reshape(-1).astype(np.int64) * span + k
        by_key = np.argsort(key, kind="stable")
        key = key[by_key]
        g = np.searchsorted(groups, sec * ntensors + tis)
        ok = (g < len(groups)) & inside
        ok[ok] = groups[g[ok]] == (sec * ntensors + tis)[ok]
        q = np.where(ok, g, 0) * span + want_k
        at = np.minimum(np.searchsorted(key, q), max(len(key) - 1, 0))
        if len(key):
            ok &= key[at] == q
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            raise ManifestError(
                f"{self.source}: invalid manifest: tensor '{names[int(tis[i])]}': section {int(sec[i])} "
                f"of {self.sections_path} holds fewer of its tiles than the index says (not its tile {int(want_k[i])})"
            )
        pos = by_key[at] if len(key) else z
        if rows is None and (len(want_k) != len(key) or len(np.unique(pos)) != len(pos)):
            raise ManifestError(
                f"{self.source}: invalid manifest: the sections hold {len(key)} tiles, the index places "
                f"{len(np.unique(pos))} of them"
            )
        counts = chunks[pos] if len(pos) else z
        first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        gather = np.arange(int(first[-1]), dtype=np.int64) - np.repeat(first[:-1], counts)
        gather += np.repeat(sum_starts[pos] if len(pos) else z, counts)
        all_sums = sums[gather]
        ctx = Context(self.source, tuple(files), self.chunking, Budget(1 << 62))
        items = []
        at = 0
        for _, name, want, offs, lens, _ in wanted:
            p = pos[at : at + len(want)]
            cols = (
                fidx[p],
                offs,
                lens,
                bo[p],
                counts[at : at + len(want)],
                all_sums[first[at] : first[at + len(want)]],
            )
            at += len(want)
            items.append((name, self.tensors[name][1], self._sizes[name], cols))
        tables = check_many(ctx, items)
        if tables is None:  # something is invalid: find and name it, tensor by tensor
            try:
                tables = [check_columns(ctx, *item) for item in items]
            except ManifestError as e:
                raise ManifestError(f"{self.source}: {e}") from None
        tensors = {
            name: TensorEntry(self.tensors[name][0], shape, table=t) for (name, shape, _, _), t in zip(items, tables)
        }
        m = self._manifest(tensors, tuple(files))
        moved = {s.rank: s.timings for s in secs if s.timings is not None}
        if rows is not None or not moved:
            return m
        # Read whole: the ranks' save timings where version 1 has them.
        save = m.timings.get("save")
        save = save if isinstance(save, dict) else {}
        ranks = save.get("ranks")
        ranks = {**(ranks if isinstance(ranks, dict) else {}), **{str(r): t for r, t in moved.items()}}
        ranks = dict(sorted(ranks.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else -1))
        return dataclasses.replace(m, timings={**m.timings, "save": {**save, "ranks": ranks}})

    def shell(self, tables: Callable[[str], TileTable]) -> Manifest:
        """The manifest with each tensor's tiles from ``tables(name)`` on first use (files: none listed)."""
        tensors = {
            name: TensorEntry(dtype, shape, loader=functools.partial(tables, name), count=self.geometry[name].count)
            for name, (dtype, shape) in self.tensors.items()
        }
        return self._manifest(tensors, ())

    def _manifest(self, tensors: dict[str, TensorEntry], files: tuple[FileEntry, ...]) -> Manifest:
        head = self._head
        return manifest_from(self._doc, self.version, head[2], head[3], head[4], files, tensors)


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
    ranks = column("the index", raw, "rank", count, count, "sections")
    lists = column("the index", raw, "list", count, count, "sections")
    offset = column("the index", raw, "offset", count, count, "sections")
    length = column("the index", raw, "length", count, count, "sections")
    sums = column("the index", raw, "checksums", count, count, "sections")
    if count and ((length < 1).any() or (length > MAX_MANIFEST_BYTES).any() or (offset + length > nbytes).any()):
        raise fail(f"sections: a section's range lies outside {path} ({nbytes} bytes) or is empty or too large")
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    sizes: dict[str, int] = {}
    geometry: dict[str, Geometry] = {}
    raw_tensors = as_dict(doc.get("tensors"), "tensors")
    tensor_lists = _tensor_lists(doc, budget, len(raw_tensors))
    if count and int(lists.max()) >= len(tensor_lists):
        raise fail(f"sections: a section's tensor list #{int(lists.max())} is not among {len(tensor_lists)}")
    for name, raw_entry in raw_tensors.items():
        tdoc = as_dict(raw_entry, f"tensor '{name}'")
        dtype, shape, size = tensor_header(name, tdoc)
        tensors[name], sizes[name] = (dtype, shape), size
        geometry[name] = Geometry(name, tdoc.get("tile_index"), len(shape), count, tiles)
    # Every tensor's block table (first, end, size per block), in tensor order: one column.
    nb = sum(g.block_count for g in geometry.values())
    table = column("the index", doc, "tile_blocks", 4 * nb, nb, "index").reshape(nb, 4)
    ends = np.concatenate([[0], np.cumsum(table[:, 2])]).astype(np.int64)  # each block's end in its tensor's data
    at = 0
    for g in geometry.values():
        g.attach(table[at : at + g.block_count], ends[at : at + g.block_count + 1] - ends[at])
        at += g.block_count
    index = Index(source, head, doc, tensors, sizes, (path, nbytes, offset, length, sums, ranks, lists, tensor_lists))
    index.geometry = geometry
    index._counts = np.fromiter((g.count for g in geometry.values()), dtype=np.int64, count=len(geometry))
    index._manifest({}, ())  # values, per_rank and names: checked now, not on first use
    return index


def _tensor_lists(doc: dict, budget: Budget, ntensors: int) -> list[np.ndarray]:
    """The index's ``tensor_lists``: the lists of tensor positions sections number their tensors in."""
    raw = as_dict(doc.get("tensor_lists"), "tensor_lists")
    count = as_int(raw.get("count"), "tensor_lists.count")
    budget.take(8 * count, f"tensor_lists.count {count}")
    lengths = column("the index", raw, "length", count, count, "tensor_lists")
    total = int(lengths.sum()) if count else 0
    budget.take(8 * total, f"tensor_lists lengths (sum {total})")
    flat = column("the index", raw, "tensor", total, total, "tensor_lists")
    if total and int(flat.max()) >= ntensors:
        raise fail(f"tensor_lists: tensor #{int(flat.max())} but the index has {ntensors}")
    cut = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64).tolist()
    return [flat[cut[i] : cut[i + 1]] for i in range(count)]
