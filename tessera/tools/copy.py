"""A self-contained copy of a tessera checkpoint: ``tessera convert SRC DST --to tessera``.

A step saved with ``CheckpointManager(dedup=True)`` references tiles in its root's shared
tile directory; its copy holds every byte it references under its own ``data/`` and loads
anywhere. The copy is byte for byte (no tensor is decoded), so every checksum of the
manifest stays valid, and is committed like any save (claim, files, check, manifest).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Iterator

from ..convert._common import ConvertResult
from ..engine import commit
from ..engine.loading.manifest import read_manifest
from ..format.codec import FrameTable
from ..format.manifest import FileEntry, Manifest, TensorEntry
from ..storage import Storage, storage_for
from ..storage.shared_tiles import with_shared_tiles

__all__ = ["copy_checkpoint"]

_COPY_CHUNK = 16 << 20


def copy_checkpoint(src: str, dst: str, *, storage: Storage | None = None) -> ConvertResult:
    """Copy the committed checkpoint ``src`` to ``dst``, bringing in every shared tile it references.

    Args:
        src: the checkpoint (a step of a dedup root, or any tessera checkpoint).
        dst: where the copy is committed (replaced atomically if it holds a checkpoint).
        storage: ``src``'s backend instead of one chosen from its path.

    Returns:
        what was written.

    Raises:
        CheckpointNotFoundError, MissingTilesError, StorageError.

    Example:
        >>> copy_checkpoint("/ckpt/run1/step-00000500", "/export/step-500")  # doctest: +SKIP
    """
    t0 = time.monotonic()
    base = storage_for(src, storage)
    manifest = read_manifest(src, storage=base)
    source = with_shared_tiles(base, manifest, src)
    out = storage_for(dst)
    claim = commit.claim(out, uuid.uuid4().hex[:16])
    renamed = {f.path: f"{claim.data_prefix}/{i}.safetensors" for i, f in enumerate(manifest.files)}
    written: list[str] = []
    try:
        for f in manifest.files:
            out.write_file(renamed[f.path], _chunks(source, f.path, f.nbytes))
            written.append(renamed[f.path])
        copied = _relocated(manifest, claim.save_id, renamed)
    except BaseException:
        commit.abandon(out, claim, written, dst)
        raise
    commit.commit_single(out, claim, copied, dst)
    total = sum(f.nbytes for f in manifest.files)
    return ConvertResult(
        src, dst, len(manifest.tensors), len(manifest.values), total, len(written), time.monotonic() - t0
    )


def _chunks(store: Storage, path: str, nbytes: int) -> Iterator[memoryview]:
    buf = bytearray(min(_COPY_CHUNK, max(nbytes, 1)))
    pos = 0
    while pos < nbytes:
        n = min(len(buf), nbytes - pos)
        view = memoryview(buf)[:n]
        store.read_into(path, pos, view)
        yield view
        pos += n


def _relocated(manifest: Manifest, save_id: str, renamed: dict[str, str]) -> Manifest:
    """``manifest`` with its files at their new paths (tiles, offsets and checksums unchanged)."""
    tensors = {}
    for fqn, entry in manifest.tensors.items():
        table = entry.table
        tensors[fqn] = TensorEntry(
            entry.dtype, entry.shape, table=dataclasses.replace(table, paths=tuple(renamed[p] for p in table.paths))
        )
    files = tuple(FileEntry(renamed[f.path], f.rank, f.nbytes, _moved(f.frames, renamed)) for f in manifest.files)
    metadata = {k: v for k, v in manifest.metadata.items() if k != "saved_at"}
    return dataclasses.replace(manifest, save_id=save_id, tensors=tensors, files=files, metadata=metadata)


def _moved(frames: FrameTable | None, renamed: dict[str, str]) -> FrameTable | None:
    """A compressed file's frame table with its delta frames' parents at their new paths."""
    if frames is None or frames.delta is None:
        return frames
    parents = tuple(renamed.get(p, p) for p in frames.delta.parents)
    return dataclasses.replace(frames, delta=dataclasses.replace(frames.delta, parents=parents))
