"""Reading a version 2 manifest: the index, then the sections a reader needs, by range reads.

A loading rank reads the index (``manifest.json``), finds from the geometry the tiles that
meet its targets, and reads only the sections that hold them: adjacent sections coalesced
into one range read, the reads in parallel, each section verified against its xxh3-64
(:meth:`~tessera.format.manifest.Index.decode_section`). Tools read every section (the whole
sections file, one read) and get the whole manifest, as version 1 gives it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ...errors import CheckpointError, ManifestError, StorageError
from ...format.manifest import Index, Manifest, Section, TileTable
from ...format.manifest.schema import MAX_SECTIONS_BYTES
from ...storage import Storage
from ..gc_pause import gc_paused_call
from .plan import ReadTarget

logger = logging.getLogger(__name__)

READ_THREADS = 16
"""Range reads of sections in flight at once, per rank."""
COALESCE_BYTES = 4 << 20
"""Adjacent sections are read together up to this many bytes per read."""


def read_sections(
    store: Storage, index: Index, numbers: Sequence[int], *, rank: int | None = None, threads: int = READ_THREADS
) -> dict[int, Section]:
    """Sections ``numbers`` of ``index``, read by coalesced range reads in parallel and verified.

    Raises:
        ManifestError: a section fails its checksum or is invalid (naming it and ``rank``).
        StorageError: a read failed (naming the sections file and ``rank``).
    """
    runs: list[list[int]] = []
    for s in sorted(set(numbers)):
        if (
            runs
            and runs[-1][-1] + 1 == s
            and int(index.offset[s] + index.length[s] - index.offset[runs[-1][0]]) <= COALESCE_BYTES
        ):
            runs[-1].append(s)
        else:
            runs.append([s])

    def one(run: list[int]) -> list[Section]:
        start = int(index.offset[run[0]])
        stop = int(index.offset[run[-1]] + index.length[run[-1]])
        buf = bytearray(stop - start)
        try:
            store.read_into(index.sections_path, start, memoryview(buf))
        except CheckpointError:
            raise
        except FileNotFoundError:
            raise ManifestError(
                f"{index.source}: its sections file {index.sections_path} is missing (rank {rank}); "
                "the checkpoint is damaged"
            ) from None
        except Exception as e:
            raise StorageError(
                f"rank {rank}: reading sections {run[0]}..{run[-1]} of {index.sections_path} failed: "
                f"{type(e).__name__}: {e}"
            ) from e
        data = bytes(buf)
        return [
            index.decode_section(
                s, data[int(index.offset[s]) - start : int(index.offset[s] + index.length[s]) - start], rank=rank
            )
            for s in run
        ]

    if not runs:
        return {}
    with ThreadPoolExecutor(min(threads, len(runs)), thread_name_prefix="tessera-sections") as pool:
        return {s.number: s for part in pool.map(one, runs) for s in part}


def read_all_sections(store: Storage, index: Index) -> dict[int, Section]:
    """Every section of ``index``: the whole sections file in one read (size checked first).

    Raises:
        ManifestError: the file's size differs from the index's, or a section is invalid.
    """
    path = index.sections_path
    if not index.section_count:
        return {}
    try:
        size = store.size(path)
        if size != index.sections_bytes or size > MAX_SECTIONS_BYTES:
            raise ManifestError(
                f"{index.source}: its sections file {path} has {size} bytes, the index says {index.sections_bytes}"
                + (f" (over the {MAX_SECTIONS_BYTES}-byte limit)" if size > MAX_SECTIONS_BYTES else "")
            )
        data = store.read_file(path)
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise ManifestError(f"{index.source}: its sections file {path} is missing; the checkpoint is damaged") from None
    except Exception as e:
        raise StorageError(f"reading {path} failed: {type(e).__name__}: {e}") from e
    if len(data) != index.sections_bytes:
        raise ManifestError(f"{index.source}: its sections file {path} changed while it was read")
    return {
        s: index.decode_section(s, data[int(index.offset[s]) : int(index.offset[s] + index.length[s])])
        for s in range(index.section_count)
    }


class SectionedLoad:
    """One rank's view of a version 2 checkpoint while it plans a load.

    :attr:`manifest` has every tensor's dtype and shape and no files; a tensor's tiles are read
    (all of its sections) only if something asks for them. :meth:`narrow` reads the sections
    that the rank's targets meet and returns the manifest its reads are planned with.
    """

    def __init__(self, store: Storage, index: Index, rank: int) -> None:
        self.store, self.index, self.rank = store, index, rank
        self.manifest = index.shell(self._table)
        self.sections_read = 0

    def _table(self, name: str) -> TileTable:
        """All tiles of ``name`` (a fallback for callers outside the planned path)."""
        rows = {name: np.arange(self.index.geometry[name].count)}
        sections = read_sections(self.store, self.index, self.index.sections_of(rows), rank=self.rank)
        return self.index.assemble(sections, rows).tensors[name].table

    @gc_paused_call
    def narrow(self, targets: Sequence[ReadTarget]) -> Manifest:
        """The manifest with only the tiles that meet ``targets``: their sections read, verified."""
        boxes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
        for t in targets:
            if not t.box.is_empty():
                boxes.setdefault(t.fqn, []).append((t.box.offsets, t.box.lengths))
        rows = self.index.rows_for_many(boxes)
        numbers = self.index.sections_of(rows)
        sections = read_sections(self.store, self.index, numbers, rank=self.rank)
        self.sections_read = len(numbers)
        narrowed = self.index.assemble(sections, rows)
        tensors = {n: narrowed.tensors[n] if n in rows else e for n, e in self.manifest.tensors.items()}
        logger.debug("rank %d: read %d of %d manifest sections", self.rank, len(numbers), self.index.section_count)
        return dataclasses.replace(narrowed, tensors=tensors)


Narrow = Callable[[Sequence[ReadTarget]], Manifest]
