"""The on-disk manifest (format versions 1 to 4: inline or sectioned, each with or without
compressed files): frozen dataclasses, encoders and strict decoders.

``manifest.json`` is written last and atomically; its presence commits a checkpoint. The
decoder treats the file as hostile: size limit, strict types, dtype whitelist, file
references confined to the checkpoint, tiles inside their tensor. See ``docs/format.md``.

Modules:
    schema: the frozen dataclasses (:class:`Manifest`, :class:`TensorEntry`, :class:`Tile`,
        :class:`TileTable`, :class:`FileEntry`, :class:`PerRankEntry`) and the constants.
    encoder: :func:`encode`, a manifest to bytes.
    decoder: :func:`decode` and :func:`read_bytes`, bytes (or a store) to a validated manifest.
    sections, index: format version 2, ``manifest.json`` as an index of sections a reader reads
        in part (:func:`encode_sectioned`, :func:`decode_index`).
"""

from .decoder import decode, decode_files
from .encoder import encode, manifest_tail
from .index import Index, Section, decode_index
from .schema import (
    CHECKSUM_ALGORITHM,
    DECODE_RATIO,
    DECODE_SLACK,
    FORMAT,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    SECTIONED_COMPRESSED_VERSION,
    SECTIONED_VERSION,
    SECTIONED_VERSIONS,
    SECTIONS_NAME,
    TABLE_MIN_TILES,
    VERSION,
    FileEntry,
    Manifest,
    PerRankEntry,
    TensorEntry,
    Tile,
    TileTable,
)
from .sections import EncodedSections, build_index, encode_section, encode_sectioned, sections_path

__all__ = [
    "CHECKSUM_ALGORITHM",
    "DECODE_RATIO",
    "DECODE_SLACK",
    "FORMAT",
    "MANIFEST_NAME",
    "MAX_MANIFEST_BYTES",
    "SECTIONED_COMPRESSED_VERSION",
    "SECTIONED_VERSION",
    "SECTIONED_VERSIONS",
    "SECTIONS_NAME",
    "TABLE_MIN_TILES",
    "VERSION",
    "EncodedSections",
    "FileEntry",
    "Index",
    "Manifest",
    "PerRankEntry",
    "Section",
    "TensorEntry",
    "Tile",
    "TileTable",
    "build_index",
    "decode",
    "decode_files",
    "decode_index",
    "encode",
    "encode_section",
    "encode_sectioned",
    "manifest_tail",
    "sections_path",
]
