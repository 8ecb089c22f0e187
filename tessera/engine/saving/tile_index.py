"""What a save with dedup may reference: the stored tiles of the step it builds on.

The manager builds a :class:`TileIndex` per rank (from its last committed save, or from the
newest step's manifest after a restart) and hands it to the engine in a :class:`Dedup`;
:mod:`.dedup` decides, tile by tile, what to reference and what to write.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ...format.chunking import Chunking
from ...format.codec import FrameTable
from ...format.manifest import Manifest
from ...format.names import SHARED_REF, is_shared_ref
from ...storage import Storage

__all__ = ["Dedup", "StoredTile", "TileIndex", "TileKey", "shared_dir"]

TileKey = tuple[str, tuple[int, ...], tuple[int, ...]]
"""A tile's place: tensor name, box offsets, box lengths."""


def shared_dir(path: str) -> str:
    """The save id whose directory holds a shared file reference (``@tiles/<id>/<file>`` -> ``<id>``)."""
    return path[len(SHARED_REF) :].split("/", 1)[0]


@dataclass(frozen=True)
class StoredTile:
    """A committed tile in the shared tile directory, as a new manifest would reference it."""

    path: str
    """The manifest reference (``@tiles/<save id>/<file>``)."""
    dtype: str
    byte_offset: int
    nbytes: int
    checksums: tuple[int, ...]
    file_nbytes: int
    file_frames: FrameTable | None = None
    """The frame table of the file holding it, if that file is compressed (the manifest repeats it)."""


@dataclass(frozen=True)
class TileIndex:
    """The tiles one rank may reference, all committed by one save (its *base*).

    Attributes:
        base_url: the checkpoint the base save committed (a step directory).
        base_save_id: the base save's id; a save references its tiles only if the base is
            still committed when the save pins (checked by rank 0).
        chunking: how the base cut its tiles into checksum chunks (a save cutting them otherwise
            cannot compare).
        tiles: by place.
        dirs: every shared directory the base's manifest references (what a pin protects).
    """

    base_url: str
    base_save_id: str
    chunking: Chunking
    tiles: Mapping[TileKey, StoredTile]
    dirs: frozenset[str]
    files: Mapping[str, tuple[int, FrameTable | None]] = field(default_factory=dict)
    """Every file the base's manifest lists: its size and frame table (delta tiles read their
    parents through these, and a manifest lists every file its delta frames need)."""

    @classmethod
    def of_manifest(cls, manifest: Manifest, url: str) -> TileIndex:
        """Every shared tile of a committed manifest (a step of this root, read at start-up)."""
        sizes = {f.path: f.nbytes for f in manifest.files}
        frames = {f.path: f.frames for f in manifest.files}
        tiles: dict[TileKey, StoredTile] = {}
        renamed = manifest.metadata.get("tile_names") or {}
        for fqn, entry in manifest.tensors.items():
            if fqn in renamed:
                continue  # its tiles carry another name in their files (``tessera rename``): not reused
            table = entry.table
            shared = [i for i, p in enumerate(table.paths) if is_shared_ref(p)]
            if not shared:
                continue
            starts = [0, *table.chunks.cumsum().tolist()]
            sums = table.checksums.tolist()
            for i, (fi, offs, lens, bo, nb) in enumerate(
                zip(
                    table.file.tolist(),
                    table.offsets.tolist(),
                    table.lengths.tolist(),
                    table.byte_offset.tolist(),
                    table.nbytes.tolist(),
                )
            ):
                path = table.paths[fi]
                if not is_shared_ref(path):
                    continue
                tiles[(fqn, tuple(offs), tuple(lens))] = StoredTile(
                    path, entry.dtype, bo, nb, tuple(sums[starts[i] : starts[i + 1]]), sizes[path], frames[path]
                )
        dirs = frozenset(shared_dir(f.path) for f in manifest.files if is_shared_ref(f.path))
        files = {f.path: (f.nbytes, f.frames) for f in manifest.files}
        return cls(url, manifest.save_id, manifest.tile_chunking, tiles, dirs, files)


@dataclass(frozen=True)
class Dedup:
    """The dedup side of one save, as the manager hands it to the engine.

    Attributes:
        tiles: the root's shared tile directory (new data files go there).
        index: what this rank may reference (None: nothing yet, write every tile).
        still_committed: rank 0, after pinning: whether the index's base save is still the
            committed checkpoint at its path (if not, the save references nothing).
        committed: called on every rank once the save committed, with this rank's tiles
            as the next save's index.
    """

    tiles: Storage
    index: TileIndex | None
    still_committed: Callable[[TileIndex], bool]
    committed: Callable[[TileIndex], None]
