"""How a save cuts each tile into checksum chunks: one size for every tile, or a size per tile.

A chunk is the unit a load verifies and, in a compressed file, the unit it decodes (one frame
per chunk): a resharded read that needs part of a tile verifies, and decodes, every chunk its
box meets, whole. A plain save cuts every tile in ``chunk_bytes`` chunks (4 MiB: a partial chunk
costs a read). A compressed save cuts a small tile finer, in ``tile_chunks`` to twice as many
chunks of a power of two bytes, never under ``min_chunk_bytes`` nor over ``chunk_bytes``: a box then decodes
a small fraction more than it needs however small the tile, while a large tile keeps chunks
large enough to code at the codec's full speed (``docs/compression.md``, "Chunk size").

The rule is a pure function of the tile's byte length, so a reader derives each tile's chunk
size from the manifest's ``checksum`` object (``docs/format.md``) and the tile alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ..options import SaveOptions

TILE_CHUNKS = 32
"""A compressed save's target number of chunks in a tile smaller than ``TILE_CHUNKS`` chunks of
its ``chunk_bytes``: a box cut across such a tile decodes about ``2 / TILE_CHUNKS`` of it more
than it needs."""
MIN_CHUNK_BYTES = 32 << 10
"""The smallest chunk a compressed save cuts: blosc2 codes 32 KiB chunks at about 0.6 of its
speed in 256 KiB ones, 16 KiB chunks at about half (a fixed ~20 us per call; docs/compression.md)."""
_MAX_TILE_CHUNKS = 1 << 20


@dataclass(frozen=True)
class Chunking:
    """The chunk size of every tile of one checkpoint.

    Attributes:
        chunk_bytes: the largest chunk (every chunk, where ``tile_chunks`` is 0).
        tile_chunks: 0, or how many chunks (up to twice as many) a tile shorter than
            ``tile_chunks`` x ``chunk_bytes`` is cut into.
        min_chunk_bytes: the smallest chunk size the rule gives (where ``tile_chunks`` is set).
    """

    chunk_bytes: int
    tile_chunks: int = 0
    min_chunk_bytes: int = 0

    @classmethod
    def for_save(cls, chunk_bytes: int, compress: bool | str) -> Chunking:
        """A save's chunking: per tile where it may compress (``True`` or ``"auto"``)."""
        if compress is False:
            return cls(chunk_bytes)
        return cls(chunk_bytes, TILE_CHUNKS, min(MIN_CHUNK_BYTES, chunk_bytes))

    @classmethod
    def for_options(cls, opts: SaveOptions) -> Chunking:
        """The chunking a save with these options cuts its tiles by."""
        return cls.for_save(opts.chunk_bytes, opts.compress)

    @property
    def whole_below(self) -> int:
        """A tile of at most this many bytes is one chunk."""
        return self.min_chunk_bytes if self.tile_chunks else self.chunk_bytes

    def of(self, nbytes: int) -> int:
        """The chunk size of a tile of ``nbytes`` bytes."""
        if not self.tile_chunks:
            return self.chunk_bytes
        want = max(1, nbytes // self.tile_chunks)
        return min(self.chunk_bytes, max(self.min_chunk_bytes, 1 << (want.bit_length() - 1)))

    def sizes(self, nbytes: np.ndarray) -> np.ndarray:
        """:meth:`of` for each of an array of tile byte lengths (int64)."""
        n = np.asarray(nbytes, dtype=np.int64)
        if not self.tile_chunks:
            return np.full(n.shape, self.chunk_bytes, dtype=np.int64)
        want = np.maximum(n // self.tile_chunks, 1)
        _, exp = np.frexp(want.astype(np.float64))  # want = m * 2**exp, 0.5 <= m < 1: exact below 2**53
        pow2 = np.left_shift(np.int64(1), (exp - 1).astype(np.int64))
        return np.minimum(self.chunk_bytes, np.maximum(self.min_chunk_bytes, pow2))

    def counts(self, nbytes: np.ndarray) -> np.ndarray:
        """How many chunks (checksums) each tile of ``nbytes`` bytes has (0 for an empty tile)."""
        n = np.asarray(nbytes, dtype=np.int64)
        return -(-n // self.sizes(n))

    def to_json(self) -> dict[str, Any]:
        """The chunking keys of the manifest's ``checksum`` object."""
        out: dict[str, Any] = {"chunk_bytes": self.chunk_bytes}
        if self.tile_chunks:
            out.update(tile_chunks=self.tile_chunks, min_chunk_bytes=self.min_chunk_bytes)
        return out

    @classmethod
    def from_json(cls, checksum: dict[str, Any], chunk_bytes: int) -> Chunking:
        """The chunking of a manifest's ``checksum`` object whose ``chunk_bytes`` was read.

        Raises:
            ValueError: ``tile_chunks`` or ``min_chunk_bytes`` is malformed or out of range.
        """
        tile_chunks, floor = checksum.get("tile_chunks"), checksum.get("min_chunk_bytes")
        if tile_chunks is None and floor is None:
            return cls(chunk_bytes)
        if type(tile_chunks) is not int or not 1 <= tile_chunks <= _MAX_TILE_CHUNKS:
            raise ValueError(f"checksum.tile_chunks must be an integer from 1 to {_MAX_TILE_CHUNKS}")
        if type(floor) is not int or not 1 <= floor <= chunk_bytes:
            raise ValueError(f"checksum.min_chunk_bytes must be an integer from 1 to chunk_bytes ({chunk_bytes})")
        return cls(chunk_bytes, tile_chunks, floor)

    def __str__(self) -> str:
        if not self.tile_chunks:
            return f"{self.chunk_bytes} bytes"
        return f"about {self.tile_chunks} per tile, {self.min_chunk_bytes} to {self.chunk_bytes} bytes"
