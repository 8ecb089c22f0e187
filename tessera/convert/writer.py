"""Write a tessera checkpoint from a stream of tensor blocks, in a single process.

Converters read a foreign checkpoint block by block and hand each block here with the box of
the global tensor it covers. Blocks are batched into data files of about ``file_bytes``
(laid out by :mod:`tessera.format.tilefile`, streamed and checksummed by :mod:`tessera.engine.saving.write`), so
at most one file's worth of blocks is held at a time. :meth:`CheckpointWriter.commit`
checks that every tensor is covered exactly once and then commits through
:mod:`tessera.engine.commit`, the protocol :func:`tessera.save` follows (claim before the first data
file, check, fenced publish, clean up): until then nothing is committed, an existing
checkpoint at the path stays intact, and afterwards no file of an older save, no load
timings of the replaced checkpoint and no leftover temporary manifest remain.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import numpy as np
import torch

from .._knobs import chunk_bytes as default_chunk_bytes
from .._knobs import compress as default_compress
from ..engine import commit
from ..engine.commit import Claim
from ..engine.saving.write import write_files
from ..format.chunking import Chunking
from ..format.dtypes import as_bytes, dtype_name, itemsize
from ..format.geometry import Box, check_box_coverage, flat_range_to_boxes
from ..format.manifest import FileEntry, Manifest, TensorEntry, Tile
from ..format.tilefile import layout_file
from ..format.values import encode_value
from ..storage import Storage, storage_for
from ..version import __version__

logger = logging.getLogger(__name__)


class CheckpointWriter:
    """Builds a new checkpoint at ``path`` from tensor blocks and plain values.

    Args:
        path: where to write (replaced atomically on :meth:`commit` if it exists).
        storage: a backend to use instead of choosing one from ``path``.
        file_bytes: a data file is written once this many bytes of blocks are pending.
        chunk_bytes: checksum granularity (default: as ``SaveOptions.chunk_bytes``, by ``compress``).
        io_threads: threads writing data files.
        compress: store tiles compressed (``docs/compression.md``; default: the ``TESSERA_COMPRESS``
            knob, so ``TESSERA_COMPRESS=1 tessera convert ...`` writes compressed checkpoints).

    Single process, not thread-safe. Use as a context manager: an exception before
    :meth:`commit` removes the data files written so far.

    Example:
        >>> with CheckpointWriter("/ckpt/imported") as w:
        ...     w.add("w", (4, 3), Box((0, 0), (2, 3)), torch.zeros(2, 3))
        ...     w.add("w", (4, 3), Box((2, 0), (2, 3)), torch.ones(2, 3))
        ...     w.add_value("step", 7)
        ...     w.commit(source="example")
    """

    def __init__(
        self,
        path: str,
        *,
        storage: Storage | None = None,
        file_bytes: int = 256 << 20,
        chunk_bytes: int | None = None,
        io_threads: int = 2,
        compress: bool | str | None = None,
    ) -> None:
        self.path = path
        self.storage = storage_for(path, storage)
        self.file_bytes = file_bytes
        self.io_threads = io_threads
        self.compress = default_compress() if compress is None else compress
        self.chunk_bytes = chunk_bytes or default_chunk_bytes(compressed=self.compress is not False)
        self.chunking = Chunking.for_save(self.chunk_bytes, self.compress)
        self.save_id = uuid.uuid4().hex[:16]
        self._t0 = time.monotonic()
        self._write_s = 0.0
        self._shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._tiles: dict[str, list[Tile]] = {}
        self._pending: list[tuple[str, Box, torch.Tensor]] = []
        self._seen: set[tuple[str, Box]] = set()
        self._tensor_bytes = 0
        self._pending_bytes = 0
        self._files: list[FileEntry] = []
        self._values: dict[str, Any] = {}
        self._claim: Claim | None = None
        self._committed = False

    # ----------------------------------------------------------------------------------
    # Adding data

    def declare(self, fqn: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Announce a tensor (needed for tensors with no elements; implied by :meth:`add`).

        Raises:
            ValueError: if ``fqn`` was declared with another shape or dtype, or is a value.
        """
        shape = tuple(int(s) for s in shape)
        dtype_name(dtype)
        known = self._shapes.get(fqn)
        if known is None:
            if fqn in self._values:
                raise ValueError(f"'{fqn}' is already a plain value; it cannot also be a tensor")
            self._shapes[fqn] = (shape, dtype)
            self._tiles[fqn] = []
        elif known != (shape, dtype):
            raise ValueError(
                f"tensor '{fqn}' was declared as {known[1]} {list(known[0])}, now as {dtype} {list(shape)}"
            )

    def add(self, fqn: str, shape: tuple[int, ...], box: Box, data: torch.Tensor, *, replica: bool = False) -> None:
        """Add the block ``box`` of global tensor ``fqn`` (``data`` shaped like the box).

        The writer keeps a reference to ``data`` until the block is written: do not modify
        it afterwards (pass a copy if the memory is reused).

        Args:
            fqn, shape: the global tensor.
            box: which block of it ``data`` is.
            data: the elements.
            replica: the same box may be added again (by another source rank holding a
                replica); later copies are ignored, as :func:`tessera.save` writes a replica once.

        Raises:
            ValueError: if the block does not fit the tensor, or was added before without
                ``replica``.
        """
        self.declare(fqn, shape, data.dtype)
        if tuple(data.shape) != box.lengths or not box.fits_in(self._shapes[fqn][0]):
            raise ValueError(
                f"tensor '{fqn}': block {box} with data {list(data.shape)} does not fit shape {list(shape)}"
            )
        if box.is_empty():
            return
        if (fqn, box) in self._seen:
            if replica:
                return
            raise ValueError(f"tensor '{fqn}': block {box} was added twice")
        self._seen.add((fqn, box))
        self._tensor_bytes += data.numel() * data.element_size()
        data = data.detach()
        if data.device.type != "cpu" or not data.is_contiguous():
            data = data.to("cpu").contiguous()
        self._pending.append((fqn, box, data))
        self._pending_bytes += data.numel() * data.element_size()
        if self._pending_bytes >= self.file_bytes:
            self.flush()

    def add_flat(self, fqn: str, shape: tuple[int, ...], flat_start: int, data: torch.Tensor) -> None:
        """Add elements ``[flat_start, flat_start + len(data))`` of the row-major flattening of ``fqn``.

        The range is cut into the few boxes it covers (as for :class:`tessera.FlatShard`).
        """
        data = data.reshape(-1)
        self.declare(fqn, shape, data.dtype)
        pos = 0
        for box in flat_range_to_boxes(shape, flat_start, flat_start + data.numel()):
            self.add(fqn, shape, box, data[pos : pos + box.numel].view(box.lengths))
            pos += box.numel

    def add_value(self, key: str, value: object, *, allow_pickle: bool = False) -> None:
        """Store a plain value under ``key``.

        Raises:
            PickleNotAllowedError: if the value is not plain and ``allow_pickle`` is False.
            ValueError: if ``key`` is already a tensor.
        """
        if key in self._shapes:
            raise ValueError(f"'{key}' is already a tensor; it cannot also be a plain value")
        self._values[key] = encode_value(value, key, allow_pickle=allow_pickle)

    @property
    def bytes_written(self) -> int:
        """Bytes of the data files written so far (headers included)."""
        return sum(f.nbytes for f in self._files)

    @property
    def files_written(self) -> int:
        return len(self._files)

    @property
    def tensors_declared(self) -> int:
        return len(self._shapes)

    @property
    def values_added(self) -> int:
        return len(self._values)

    @property
    def tensor_bytes(self) -> int:
        """Bytes of tensor data added (replicas counted once, headers not counted)."""
        return self._tensor_bytes

    def flush(self) -> None:
        """Write the pending blocks to a new data file."""
        if not self._pending:
            return
        t0 = time.monotonic()
        name = f"{self._claimed().data_prefix}/0-{len(self._files)}.safetensors"
        layout = layout_file(name.rsplit("/", 1)[1], [(f, b, d.dtype) for f, b, d in self._pending])
        by_key = {(f, b): d for f, b, d in self._pending}
        staged = [as_bytes(by_key[(s.fqn, s.box)]) for s in layout.slots]
        (written,) = write_files(
            self.storage, [(name, layout, staged)], chunking=self.chunking, threads=1, compress=self.compress
        )
        self._files.append(FileEntry(name, 0, written.nbytes, written.frames))
        for t in written.tiles:
            dt = self._shapes[t.fqn][1]
            self._tiles[t.fqn].append(
                Tile(name, t.box.offsets, t.box.lengths, t.byte_offset, t.box.numel * itemsize(dt), t.checksums)
            )
        self._pending = []
        self._pending_bytes = 0
        self._write_s += time.monotonic() - t0
        logger.debug("wrote %s (%d bytes)", name, written.nbytes)

    # ----------------------------------------------------------------------------------
    # Commit

    def commit(
        self,
        *,
        source: str,
        layout: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Manifest:
        """Check coverage, write the manifest atomically (the commit point), drop stale files.

        Args:
            source: what the checkpoint was converted from (stored in the metadata).
            layout: the source's parallel layout, for information.
            metadata: extra JSON metadata.

        Returns:
            The committed manifest.

        Raises:
            CoverageError: a tensor is not covered exactly once by the blocks added.
            ConcurrentSaveError: another save committed the path while this writer ran.
            CommitCheckError: a data file is not where the manifest would point.
            StorageError: the manifest could not be published.
        """
        self.flush()
        t0 = time.monotonic()
        tensors: dict[str, TensorEntry] = {}
        for fqn, (shape, dtype) in self._shapes.items():
            tiles = sorted(self._tiles[fqn], key=lambda t: t.offsets)
            nd = len(shape)
            offs = np.array([t.offsets for t in tiles], dtype=np.int64).reshape(len(tiles), nd)
            lens = np.array([t.lengths for t in tiles], dtype=np.int64).reshape(len(tiles), nd)
            check_box_coverage(fqn, shape, offs, lens)
            tensors[fqn] = TensorEntry(dtype_name(dtype), shape, tuple(tiles))
        total = sum(f.nbytes for f in self._files)
        manifest = Manifest(
            save_id=self.save_id,
            world_size=1,
            chunk_bytes=self.chunk_bytes,
            chunking=self.chunking,
            tensors=tensors,
            values=dict(self._values),
            files=tuple(self._files),
            layout={"world_size": 1, **(layout or {})},
            timings={
                "convert": {
                    "ranks": {
                        "0": {
                            "read": max(0.0, t0 - self._t0 - self._write_s),
                            "write": self._write_s,
                            "commit": time.monotonic() - t0,
                            "bytes": total,
                        }
                    }
                }
            },
            metadata={
                "tessera_version": __version__,
                "torch_version": torch.__version__,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "tensor_policies": {},
                "converted_from": source,
                **(metadata or {}),
            },
        )
        self._publish(manifest)
        self._committed = True
        logger.info(
            "wrote %s: %d tensors, %d bytes in %d files (%.2fs)",
            self.path, len(tensors), total, len(self._files), time.monotonic() - self._t0,
        )  # fmt: skip
        return manifest

    def _claimed(self) -> Claim:
        """The claim on the path, made before the first data file is written (step 1 of the protocol)."""
        if self._claim is None:
            self._claim = commit.claim(self.storage, self.save_id)
        return self._claim

    def _publish(self, manifest: Manifest) -> None:
        """Check the data files, publish the manifest and clean up (:func:`tessera.engine.commit.commit_single`)."""
        try:
            commit.commit_single(self.storage, self._claimed(), manifest, self.path)
        except Exception:
            self._claim = None  # commit_single removed what had to go: nothing left for abort()
            raise

    def abort(self) -> None:
        """Remove the data files written so far and the claim (nothing was committed)."""
        if self._committed:
            return
        if self._claim is not None:
            commit.abandon(self.storage, self._claim, [f.path for f in self._files], self.path)
            self._claim = None
        self._files = []
        self._pending = []

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if not self._committed:
            self.abort()
