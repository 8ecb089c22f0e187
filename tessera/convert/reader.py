"""Read boxes of the tensors of a committed tessera checkpoint, block by block.

A thin layer over :mod:`tessera.engine.loading.read`: every box is read with ``ReadTarget``/``plan_reads``/
``Reader``, so only the overlapping byte ranges are fetched and every chunk is verified.
Works the same for checkpoints saved by any number of ranks in any layout.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from ..api import read_manifest
from ..engine.loading.read import Reader, ReadTarget, plan_reads
from ..errors import PickleNotAllowedError
from ..format.dtypes import dtype_from_name, itemsize
from ..format.geometry import Box, split_box
from ..format.manifest import Manifest
from ..format.values import decode_value
from ..storage import Storage, storage_for
from ..storage.shared_tiles import with_shared_tiles
from ._common import DEFAULT_BLOCK_BYTES, numel

logger = logging.getLogger(__name__)


class CheckpointReader:
    """A committed checkpoint opened for reading boxes of its tensors (no communication).

    Args:
        path: the checkpoint's path or URL.
        storage: a backend to use instead of choosing one from ``path``.
        verify: verify every chunk read against its checksum.
        io_threads: threads reading byte ranges.
        max_read_bytes: largest single range read (bounds the read buffers).

    Raises:
        CheckpointNotFoundError: if nothing is committed at ``path``.
        ManifestError: if the manifest is invalid.

    Thread-safety: one caller at a time.
    """

    def __init__(
        self,
        path: str,
        *,
        storage: Storage | None = None,
        verify: bool = True,
        io_threads: int = 4,
        max_read_bytes: int = 32 << 20,
    ) -> None:
        self.path = path
        base = storage_for(path, storage)
        self.manifest: Manifest = read_manifest(path, storage=base)
        self.storage = with_shared_tiles(base, self.manifest, path)
        self.max_read_bytes = max_read_bytes
        self._reader = Reader(self.storage, self.manifest, rank=0, verify=verify, threads=io_threads)

    def dtype(self, fqn: str) -> torch.dtype:
        return dtype_from_name(self.manifest.tensors[fqn].dtype)

    def shape(self, fqn: str) -> tuple[int, ...]:
        return tuple(self.manifest.tensors[fqn].shape)

    def nbytes(self, fqn: str) -> int:
        return numel(self.shape(fqn)) * itemsize(self.dtype(fqn))

    def per_rank_tensors(self) -> set[str]:
        """Tensors saved with :func:`tessera.per_rank` (a leading dimension of one entry per rank)."""
        return set(self.manifest.metadata.get("tensor_policies", {}) or {})

    def read(
        self, fqn: str, box: Box, out: torch.Tensor | None = None, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The elements of ``box`` of tensor ``fqn``, in ``out`` if given (cast to its dtype).

        Raises:
            CorruptCheckpointError: a checksum mismatch or a missing/truncated data file.
        """
        if out is None:
            out = torch.empty(box.lengths, dtype=dtype or self.dtype(fqn))
        if box.is_empty():
            return out
        requests = plan_reads(self.manifest, [ReadTarget(fqn, box, out)], max_read_bytes=self.max_read_bytes)
        self._reader.run(requests)
        return out

    def read_many(self, targets: list[ReadTarget]) -> None:
        """Fill several targets with one batch of coalesced reads."""
        targets = [t for t in targets if not t.box.is_empty()]
        if targets:
            self._reader.run(plan_reads(self.manifest, targets, max_read_bytes=self.max_read_bytes))

    def blocks(
        self,
        fqn: str,
        *,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        dtype: torch.dtype | None = None,
        reuse: bool = False,
    ) -> Iterator[tuple[Box, torch.Tensor]]:
        """``(box, data)`` for consecutive row-major blocks of tensor ``fqn``.

        Args:
            fqn: the tensor.
            block_bytes: most bytes per block.
            dtype: cast to this dtype while reading.
            reuse: fill one buffer for every block; each block is only valid until the
                next one is produced (saves allocations when the caller streams bytes out).
        """
        dt = dtype or self.dtype(fqn)
        size = max(itemsize(dt), itemsize(self.dtype(fqn)))
        buf: torch.Tensor | None = None
        for box in split_box(Box.whole(self.shape(fqn)), size, block_bytes):
            if reuse:
                if buf is None or buf.numel() < box.numel:
                    buf = torch.empty(max(box.numel, 1), dtype=dt)
                out = buf[: box.numel].view(box.lengths)
            else:
                out = torch.empty(box.lengths, dtype=dt)
            yield box, self.read(fqn, box, out)

    def values(self, *, allow_pickle: bool = False) -> tuple[dict[str, Any], list[str]]:
        """The plain values, decoded; and the keys left out because they need pickle."""
        out: dict[str, Any] = {}
        skipped: list[str] = []
        for k, v in self.manifest.values.items():
            try:
                out[k] = decode_value(v, k, allow_pickle=allow_pickle)
            except PickleNotAllowedError:
                skipped.append(k)
        return out, skipped

    def left_out(self, pickled: list[str], prefix: str | None) -> tuple[str, ...]:
        """Why values an export cannot carry were left out: pickled and per-rank values."""
        out = [f"{k} (needs pickle)" for k in pickled] + [f"{k} (per-rank value)" for k in self.manifest.per_rank]
        return tuple(s for s in out if not prefix or s.startswith(prefix))
