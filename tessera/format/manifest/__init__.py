"""The on-disk manifest (format version 1): frozen dataclasses, encoder and a strict decoder.

``manifest.json`` is written last and atomically; its presence commits a checkpoint. The
decoder treats the file as hostile: size limit, strict types, dtype whitelist, file
references confined to the checkpoint, tiles inside their tensor. See ``docs/format.md``.

Modules:
    schema: the frozen dataclasses (:class:`Manifest`, :class:`TensorEntry`, :class:`Tile`,
        :class:`TileTable`, :class:`FileEntry`, :class:`PerRankEntry`) and the constants.
    encoder: :func:`encode`, a manifest to bytes.
    decoder: :func:`decode` and :func:`read_bytes`, bytes (or a store) to a validated manifest.
"""

from .decoder import decode, decode_files
from .encoder import encode
from .schema import (
    CHECKSUM_ALGORITHM,
    DECODE_RATIO,
    DECODE_SLACK,
    FORMAT,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    TABLE_MIN_TILES,
    VERSION,
    FileEntry,
    Manifest,
    PerRankEntry,
    TensorEntry,
    Tile,
    TileTable,
)

__all__ = [
    "CHECKSUM_ALGORITHM",
    "DECODE_RATIO",
    "DECODE_SLACK",
    "FORMAT",
    "MANIFEST_NAME",
    "MAX_MANIFEST_BYTES",
    "TABLE_MIN_TILES",
    "VERSION",
    "FileEntry",
    "Manifest",
    "PerRankEntry",
    "TensorEntry",
    "Tile",
    "TileTable",
    "decode",
    "decode_files",
    "encode",
]
