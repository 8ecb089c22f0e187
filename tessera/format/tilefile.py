"""Layout of a data file: a standard safetensors file holding a rank's tiles.

A data file is ``[8-byte little-endian header size][JSON header][tile bytes...]``, exactly
the safetensors format, so any safetensors reader can open it. Each tile is stored under the
key ``"<fqn>[<start>:<stop>,...]"``. Dtypes safetensors lacks are stored as raw bytes (U8
with a trailing item-size dimension); the manifest keeps the true dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .dtypes import ALIGN, itemsize, safetensors_code
from .geometry import Box
from .safetensors_header import HeaderEntry, encode_header

HEADER_ALIGN = ALIGN
"""Tile data starts at a multiple of this, and tiles are ordered by decreasing item size,
so every tile is aligned to its item size in the file (and in read buffers)."""


def tile_key(fqn: str, box: Box) -> str:
    """The safetensors key of a tile: the tensor name and the box it covers."""
    return fqn + "[" + ",".join(f"{o}:{o + n}" for o, n in zip(box.offsets, box.lengths)) + "]"


def tile_header_entry(dtype: torch.dtype, lengths: Sequence[int]) -> tuple[str, list[int]]:
    """The ``dtype`` code and ``shape`` of a tile's safetensors header entry.

    A dtype safetensors has no code for is stored as raw bytes: ``U8`` with the item size
    as a last dimension.

    Example:
        >>> tile_header_entry(torch.float32, (2, 3))
        ('F32', [2, 3])
    """
    code, raw = safetensors_code(dtype)
    return code, list(lengths) + ([itemsize(dtype)] if raw else [])


@dataclass(frozen=True)
class TileSlot:
    """Where one tile goes in a data file."""

    fqn: str
    box: Box
    dtype: torch.dtype
    byte_offset: int
    """Absolute offset of the tile's first byte in the file."""
    nbytes: int


@dataclass(frozen=True)
class FileLayout:
    """A data file's header bytes and the position of every tile in it."""

    name: str
    header: bytes
    slots: tuple[TileSlot, ...]

    @property
    def nbytes(self) -> int:
        return len(self.header) + sum(s.nbytes for s in self.slots)


def layout_file(
    name: str, tiles: Sequence[tuple[str, Box, torch.dtype]], metadata: dict[str, str] | None = None
) -> FileLayout:
    """Lay out ``tiles`` (``(fqn, box, dtype)``) in one safetensors file, largest item size first."""
    entries: list[HeaderEntry] = []
    tiles = sorted(tiles, key=lambda t: -itemsize(t[2]))  # stable: keeps order within a size
    sizes = []
    for fqn, box, dtype in tiles:
        n = box.numel * itemsize(dtype)
        code, shape = tile_header_entry(dtype, box.lengths)
        entries.append((tile_key(fqn, box), code, shape, n))
        sizes.append(n)
    header = encode_header(entries, {"producer": "tessera", **(metadata or {})})
    slots = []
    pos = len(header)
    for (fqn, box, dtype), n in zip(tiles, sizes):
        slots.append(TileSlot(fqn, box, dtype, pos, n))
        pos += n
    return FileLayout(name, header, tuple(slots))
