"""The manifest's types (format version 1): frozen dataclasses and the format's constants.

See ``docs/format.md`` for the on-disk schema and the glossary of the names used here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..chunking import Chunking
from ..codec import FrameTable

FORMAT = "tessera"
VERSION = 1
"""The inline form: every tile's details in ``manifest.json``."""
SECTIONED_VERSION = 2
"""The sectioned form: ``manifest.json`` is an index, the tiles' details are in sections
(:mod:`tessera.format.manifest.sections`); readers of version 1 refuse it."""
SECTIONS_NAME = "manifest.sections"
"""File name (under ``data/<save id>/``) of a version 2 manifest's sections."""
COMPRESSED_VERSION = 3
"""The inline form with compressed data files (a ``frames`` object on their ``files`` entries);
readers of versions 1 and 2 refuse it."""
SECTIONED_COMPRESSED_VERSION = 4
"""The sectioned form (version 2) whose sections list compressed data files (a frame table as
the fourth element of a section's file entry); readers of versions 1 to 3 refuse it."""
SECTIONED_VERSIONS = (SECTIONED_VERSION, SECTIONED_COMPRESSED_VERSION)
"""The versions whose ``manifest.json`` is an index."""
NEWEST_VERSION = SECTIONED_COMPRESSED_VERSION
MAX_SECTIONS_BYTES = 4 << 30
"""The largest sections file a version 2 index may declare."""
MIN_SECTION_BYTES_PER_TILE = 10
"""Every tile costs its section at least this many bytes (the base64 of one 8-byte checksum):
an index may declare at most ``sections bytes / 10`` tiles, so its highly compressible
geometry cannot inflate beyond what the sections file it names could describe."""
MANIFEST_NAME = "manifest.json"
CHECKSUM_ALGORITHM = "xxh3_64"
MAX_MANIFEST_BYTES = 1 << 30
DECODE_RATIO = 32
"""Tile-table columns may inflate to at most this many times the manifest's size (plus
:data:`DECODE_SLACK`) in all: a real table stores at least one incompressible checksum per
tile and inflates about 4-10x, while a hostile one that declares millions of tiles in a
few compressed bytes is refused before anything is allocated."""
DECODE_SLACK = 1 << 20
TABLE_MIN_TILES = 16
"""Tensors with more tiles than this store them as a columnar ``tile_table`` (base64 of
zlib-compressed little-endian arrays): compact and parsed without per-tile work. Fewer
tiles stay readable JSON lists."""


@dataclass(frozen=True)
class Tile:
    """One stored box of a tensor: where its bytes are and how to check them.

    Attributes:
        file: data file (relative to the checkpoint) holding the bytes.
        offsets, lengths: the box within the global tensor.
        byte_offset: where the box's row-major bytes start in ``file``.
        nbytes: how many bytes (``prod(lengths) * itemsize``).
        checksums: xxh3-64 of each chunk of those bytes (``Manifest.chunking``), in order.
    """

    file: str
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    byte_offset: int
    nbytes: int
    checksums: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class TileTable:
    """A tensor's tiles as columns: what loads and planners read, without per-tile objects.

    Attributes:
        paths: data file paths, indexed by ``file``.
        file: ``(n,)`` index into ``paths`` per tile.
        offsets, lengths: ``(n, ndim)`` boxes.
        byte_offset, nbytes: ``(n,)`` byte ranges in the files.
        chunks: ``(n,)`` number of checksums per tile.
        checksums: all tiles' chunk checksums, concatenated (uint64).
    """

    paths: tuple[str, ...]
    file: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    byte_offset: np.ndarray
    nbytes: np.ndarray
    chunks: np.ndarray
    checksums: np.ndarray

    def __len__(self) -> int:
        return len(self.file)

    @classmethod
    def from_tiles(cls, tiles: tuple[Tile, ...], ndim: int) -> TileTable:
        paths = tuple(dict.fromkeys(t.file for t in tiles))
        index = {p: i for i, p in enumerate(paths)}
        n = len(tiles)
        return cls(
            paths,
            np.array([index[t.file] for t in tiles], dtype=np.int64),
            np.array([t.offsets for t in tiles], dtype=np.int64).reshape(n, ndim),
            np.array([t.lengths for t in tiles], dtype=np.int64).reshape(n, ndim),
            np.array([t.byte_offset for t in tiles], dtype=np.int64),
            np.array([t.nbytes for t in tiles], dtype=np.int64),
            np.array([len(t.checksums) for t in tiles], dtype=np.int64),
            np.array([c for t in tiles for c in t.checksums], dtype=np.uint64),
        )

    def tiles(self) -> tuple[Tile, ...]:
        """Every tile as a :class:`Tile` (builds one object per tile)."""
        sums = self.checksums.tolist()
        out = []
        pos = 0
        for fi, o, ln, bo, nb, k in zip(
            self.file.tolist(),
            self.offsets.tolist(),
            self.lengths.tolist(),
            self.byte_offset.tolist(),
            self.nbytes.tolist(),
            self.chunks.tolist(),
        ):
            out.append(Tile(self.paths[fi], tuple(o), tuple(ln), bo, nb, tuple(sums[pos : pos + k])))
            pos += k
        return tuple(out)


class TensorEntry:
    """A global tensor: dtype name, global shape and the tiles that cover it exactly once.

    Built from :class:`Tile` objects, from a :class:`TileTable`, or (by a lazy
    :func:`~tessera.format.manifest.decode`) from a loader that decodes and validates the
    table on first use. Each form is derived from the others when asked for, so large
    manifests never build per-tile objects unless someone asks for ``tiles``, and a lazily
    decoded one decodes only the tensors that are used.
    """

    __slots__ = ("_count", "_loader", "_starts", "_table", "_tiles", "dtype", "shape")

    def __init__(
        self,
        dtype: str,
        shape: tuple[int, ...],
        tiles: tuple[Tile, ...] | None = None,
        *,
        table: TileTable | None = None,
        loader: Callable[[], TileTable] | None = None,
        count: int | None = None,
    ) -> None:
        if (tiles is not None) + (table is not None) + (loader is not None) != 1:
            raise ValueError("TensorEntry needs exactly one of tiles, table and loader")
        self.dtype = dtype
        self.shape = tuple(shape)
        self._tiles = tuple(tiles) if tiles is not None else None
        self._table = table
        self._loader = loader
        self._count = count
        self._starts: np.ndarray | None = None

    @property
    def tiles(self) -> tuple[Tile, ...]:
        if self._tiles is None:
            self._tiles = self.table.tiles()
        return self._tiles

    @property
    def table(self) -> TileTable:
        """The tiles as columns (decoded and validated now if the entry is lazy).

        Raises:
            ManifestError: if a lazily decoded table is invalid (naming the manifest and tensor).
        """
        table = self._table
        if table is None:
            # The loader returns one table however often (and from however many threads) it is
            # called, so a race here only costs a lock.
            if self._loader is not None:
                table = self._loader()
            else:
                assert self._tiles is not None
                table = TileTable.from_tiles(self._tiles, len(self.shape))
            self._table = table
        return table

    @property
    def num_tiles(self) -> int:
        """How many tiles (for a lazy entry: the count its table declares, without decoding it)."""
        if self._tiles is not None:
            return len(self._tiles)
        if self._table is None and self._count is not None:
            return self._count
        return len(self.table)

    def tile(self, i: int) -> Tile:
        """Tile ``i`` (without building the others)."""
        if self._tiles is not None:
            return self._tiles[i]
        t = self.table
        if len(t) <= 16:  # a few tiles (a narrowed table): all at once, with a few numpy calls
            self._tiles = t.tiles()
            return self._tiles[i]
        if self._starts is None:  # an array, not a list: one int64 per tile, not a Python int
            self._starts = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(t.chunks)])
        start = int(self._starts[i])
        return Tile(
            t.paths[int(t.file[i])],
            tuple(t.offsets[i].tolist()),
            tuple(t.lengths[i].tolist()),
            int(t.byte_offset[i]),
            int(t.nbytes[i]),
            tuple(t.checksums[start : start + int(t.chunks[i])].tolist()),
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorEntry):
            return NotImplemented
        return (self.dtype, self.shape, self.tiles) == (other.dtype, other.shape, other.tiles)

    def __repr__(self) -> str:
        return f"TensorEntry(dtype={self.dtype!r}, shape={self.shape!r}, tiles=<{self.num_tiles}>)"


@dataclass(frozen=True)
class PerRankEntry:
    """A per-rank value: one encoded plain value per saving rank (``None`` where a rank had none).

    Attributes:
        on_resize: what a load under another world size does (``"error"``, ``"keep"``, ``"modulo"``).
        by_rank: the encoded value of each saving rank, indexed by rank.
    """

    on_resize: str
    by_rank: tuple[Any, ...]

    @property
    def values(self) -> tuple[Any, ...]:
        """Deprecated name of :attr:`by_rank` (kept while callers move over)."""
        return self.by_rank


@dataclass(frozen=True)
class FileEntry:
    """A data file: the rank that wrote it and its size."""

    path: str
    rank: int
    nbytes: int
    """The stored size."""
    frames: FrameTable | None = field(default=None, compare=False)
    """A compressed file's frame table (:mod:`tessera.format.codec`); None for a plain file."""

    @property
    def logical_bytes(self) -> int:
        """The size the tiles' byte offsets are relative to: the uncompressed file's."""
        return self.nbytes if self.frames is None else self.frames.logical_end


@dataclass(frozen=True)
class Manifest:
    """A committed checkpoint's table of contents."""

    save_id: str
    world_size: int
    chunk_bytes: int
    tensors: dict[str, TensorEntry]
    values: dict[str, Any] = field(default_factory=dict)
    """Plain values, in the tagged-JSON encoding of :mod:`tessera.format.values`."""
    per_rank: dict[str, PerRankEntry] = field(default_factory=dict)
    files: tuple[FileEntry, ...] = ()
    layout: dict[str, Any] = field(default_factory=dict)
    """How the saving job was laid out; informational only, loading never depends on it."""
    timings: dict[str, Any] = field(default_factory=dict)
    """Per-rank, per-phase durations (seconds) and bytes of the save."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Versions, creation time and user metadata."""
    version: int = VERSION
    chunking: Chunking | None = None
    """How each tile is cut into checksum chunks (None: every tile in ``chunk_bytes`` chunks)."""

    def __post_init__(self) -> None:
        if self.chunking is None:
            object.__setattr__(self, "chunking", Chunking(self.chunk_bytes))
        elif self.chunking.chunk_bytes != self.chunk_bytes:
            raise ValueError(f"chunking {self.chunking} does not have chunk_bytes {self.chunk_bytes}")

    @property
    def tile_chunking(self) -> Chunking:
        """:attr:`chunking`, never None (for type checkers)."""
        assert self.chunking is not None
        return self.chunking

    def keys(self) -> set[str]:
        return set(self.tensors) | set(self.values) | set(self.per_rank)

    def validate_all(self) -> None:
        """Decode and validate every tensor's tiles now.

        A manifest decoded with ``lazy=True`` validates each tensor's table on first use; this
        makes it as checked as an eagerly decoded one. A no-op for tables already decoded.

        Raises:
            ManifestError: naming the manifest and the first invalid tensor.
        """
        for e in self.tensors.values():
            e.table  # noqa: B018  (decodes and validates)

    @property
    def total_bytes(self) -> int:
        return sum(int(e.table.nbytes.sum()) for e in self.tensors.values())
