"""PyTorch Distributed Checkpoint (DCP): export a tessera checkpoint to it, import one.

Export goes through DCP's public ``dcp.save`` with a ``FileSystemWriter`` in this process
alone (``no_dist=True``). The state dict handed to DCP holds *meta* tensors of the right
shape and dtype; a ``DefaultSavePlanner`` subclass reads each tensor from the tessera
checkpoint only when DCP's writer asks for its bytes, and each tensor goes to its own
``.distcp`` file, so memory stays around twice the largest tensor (DCP's writer still holds
the previous tensor while the next one is read), whatever the model's size.
The result is read by ``torch.distributed.checkpoint.load`` under any layout, with the same
flat FQNs tessera uses (``model.layers.0.w``): a nested ``{"model": ...}`` state matches.

Import reads ``.metadata`` with DCP's ``FileSystemReader`` and drives the public
``StorageReader`` protocol (``set_up_storage_reader`` -> ``prepare_*_plan`` ->
``read_data``) with a small ``LoadPlanner`` that asks for the saved chunks themselves, in
batches of at most ``file_bytes``: every chunk (a whole tensor from a single-process save,
a shard from a sharded one) becomes one tessera tile, and no more than a batch of chunks is
in memory (plus one chunk, which DCP's reader deserializes before copying it out). Non-tensor entries are loaded with ``weights_only=True`` unless pickle is allowed.

DCP's ``.metadata`` file is itself a pickle: it is read by :mod:`.dcp_metadata` with an
allow-list of DCP's own classes (anything else needs ``allow_pickle=True``), so importing a
crafted checkpoint never runs code from it.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import time
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)

from ..errors import PickleNotAllowedError
from ..format.dtypes import cast_for, itemsize
from ..format.geometry import Box
from ..format.names import strip_prefix
from ..storage import Storage
from ._common import ConvertResult, Progress, ProgressFn, numel
from .dcp_metadata import read_dcp_metadata
from .reader import CheckpointReader
from .writer import CheckpointWriter

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------
# Export


class _StreamingSavePlanner(dcp.DefaultSavePlanner):
    """A save planner whose meta tensors are read from a tessera checkpoint on demand."""

    def __init__(self, src: CheckpointReader, names: dict[str, str], prog: Progress) -> None:
        super().__init__()
        self._src = src
        self._names = names
        self._prog = prog

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = super().lookup_object(index)
        if isinstance(obj, torch.Tensor) and obj.is_meta:
            fqn = self._names[index.fqn]
            data = self._src.read(fqn, Box.whole(obj.shape), dtype=obj.dtype)
            self._prog.advance(data.numel() * data.element_size())
            return data
        return obj


def export_dcp(
    path: str,
    out_dir: str,
    *,
    prefix: str | None = None,
    dtype: torch.dtype | None = None,
    storage: Storage | None = None,
    include_values: bool = True,
    progress: ProgressFn | None = None,
) -> ConvertResult:
    """Export a tessera checkpoint as a PyTorch DCP checkpoint directory (single process).

    Call it from one process only; it never communicates, even when ``torch.distributed``
    is initialised.

    Args:
        path: the tessera checkpoint.
        out_dir: local directory to write (``.metadata`` and one ``__0_<i>.distcp`` per entry).
        prefix: export only names under ``prefix``, without it.
        dtype: cast floating-point tensors to this dtype.
        storage: backend of the tessera checkpoint.
        include_values: also write plain values (as DCP byte entries).
        progress: called with ``(done_bytes, total_bytes)``.

    Returns:
        What was written; values that need pickle and per-rank values are listed in ``skipped``.

    Raises:
        ValueError: if nothing matches ``prefix``.
        CorruptCheckpointError: for data failing its checksum.

    Example:
        >>> export_dcp("/ckpt/step100", "/export/dcp")
        >>> sd = {"model": model.state_dict()}
        >>> torch.distributed.checkpoint.load(sd, checkpoint_id="/export/dcp")
    """
    t0 = time.monotonic()
    src = CheckpointReader(path, storage=storage)
    names = strip_prefix(list(src.manifest.tensors), prefix)
    values, skipped = src.values() if include_values else ({}, [])
    kept_values = strip_prefix(list(values), prefix)
    if not names and not kept_values:
        raise ValueError(f"checkpoint {path} has nothing{f' under prefix {prefix!r}' if prefix else ''} to export")
    state: dict[str, Any] = {}
    total = 0
    for name, fqn in names.items():
        dt = cast_for(src.dtype(fqn), dtype)
        state[name] = torch.empty(src.shape(fqn), dtype=dt, device="meta")
        total += state[name].numel() * itemsize(dt)
    for name, key in kept_values.items():
        state[name] = values[key]
    planner = _StreamingSavePlanner(src, names, Progress(total, progress))
    # One file per tensor: DCP's writer keeps every tensor of a file alive until the file is
    # closed, so single_file_per_rank=True would hold the whole model in memory.
    writer = dcp.FileSystemWriter(out_dir, single_file_per_rank=False, thread_count=1, overwrite=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        warnings.filterwarnings("ignore", message=".*Detected an existing checkpoint.*")
        dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
    logger.info("exported %d tensors (%d bytes) from %s to DCP %s", len(names), total, path, out_dir)
    # DCP flattens a dict value into one entry (and file) per key: count what it wrote.
    files = sum(1 for n in os.listdir(out_dir) if n.endswith(".distcp") or n == ".metadata")
    return ConvertResult(
        path, out_dir, len(names), len(kept_values), total, files, time.monotonic() - t0,
        src.left_out(skipped, prefix),
    )  # fmt: skip


# --------------------------------------------------------------------------------------
# Import


class _ChunkPlanner(LoadPlanner):
    """Resolves DCP read items to buffers for saved chunks, and collects byte entries."""

    def __init__(self, allow_pickle: bool) -> None:
        self.targets: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        self.loaded: dict[str, Any] = {}
        self.refused: list[str] = []
        self.allow_pickle = allow_pickle

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        pass

    def create_local_plan(self) -> LoadPlan:
        return LoadPlan([])

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            self.loaded[fqn] = torch.load(value, weights_only=not self.allow_pickle)
        except pickle.UnpicklingError as e:  # weights_only refuses arbitrary objects
            if self.allow_pickle:
                raise
            logger.warning("DCP entry '%s' is not a plain value (%s); left out (allow_pickle=True keeps it)", fqn, e)
            self.refused.append(fqn)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        t = self.targets[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset or ()))]
        for d, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(d, o, n)
        return t

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


def _chunk_item(fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...], i: int) -> ReadItem:
    index = MetadataIndex(fqn, offsets, i)
    zero = torch.Size([0] * len(sizes))
    return ReadItem(LoadItemType.TENSOR, index, zero, index, zero, torch.Size(sizes))


def import_dcp(
    src: str,
    path: str,
    *,
    prefix: str | None = None,
    dtype: torch.dtype | None = None,
    storage: Storage | None = None,
    allow_pickle: bool = False,
    file_bytes: int = 256 << 20,
    progress: ProgressFn | None = None,
) -> ConvertResult:
    """Import a PyTorch DCP checkpoint directory (saved by any number of ranks) into tessera.

    Args:
        src: the DCP checkpoint directory (with ``.metadata``).
        path: where to write the tessera checkpoint (replaced atomically).
        prefix: prepended to every name.
        dtype: cast floating-point tensors to this dtype.
        storage: backend of the new checkpoint.
        allow_pickle: keep non-tensor entries that need pickle (stored pickled in tessera too),
            and unpickle ``.metadata`` whatever classes it names (only for checkpoints you trust).
        file_bytes: most bytes of chunks read per batch, and the size of tessera data files.
        progress: called with ``(done_bytes, total_bytes)``.

    Returns:
        What was written; entries that were left out are listed in ``skipped``.

    Raises:
        FileNotFoundError: if ``src`` has no ``.metadata``.
        PickleNotAllowedError: if ``.metadata`` names a class DCP's metadata never holds
            (nothing from it is run); ``allow_pickle=True`` reads it if you trust it.
        CorruptCheckpointError: if ``.metadata`` is not well-formed DCP metadata.
        CoverageError: if the DCP chunks do not cover a tensor exactly once.

    Example:
        >>> import_dcp("/dcp/step100", "/ckpt/step100")
    """
    t0 = time.monotonic()
    metadata = read_dcp_metadata(src, allow_pickle=allow_pickle)  # never DCP's own pickle.load
    reader = dcp.FileSystemReader(src)
    reader.set_up_storage_reader(metadata, True)
    pre = prefix or ""
    chunks: list[tuple[str, tuple[int, ...], tuple[int, ...], int, TensorStorageMetadata]] = []
    byte_keys: list[str] = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            for i, chunk in enumerate(md.chunks):
                chunks.append((fqn, tuple(chunk.offsets), tuple(chunk.sizes), i, md))
        elif isinstance(md, BytesStorageMetadata):
            byte_keys.append(fqn)
    total = sum(numel(s) * itemsize(cast_for(md.properties.dtype, dtype)) for _, _, s, _, md in chunks)
    prog = Progress(total, progress)
    skipped: list[str] = []
    with CheckpointWriter(path, storage=storage, file_bytes=file_bytes) as w:
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                w.declare(pre + fqn, tuple(md.size), cast_for(md.properties.dtype, dtype))
        batch: list[tuple[str, tuple[int, ...], tuple[int, ...], int, TensorStorageMetadata]] = []
        size = 0
        for c in chunks:
            batch.append(c)
            size += numel(c[2]) * itemsize(c[4].properties.dtype)
            if size >= file_bytes:
                _read_batch(reader, batch, w, pre, dtype, prog, allow_pickle)
                batch, size = [], 0
        _read_batch(reader, batch, w, pre, dtype, prog, allow_pickle)
        if byte_keys:
            planner = _ChunkPlanner(allow_pickle)
            items = [
                ReadItem(
                    LoadItemType.BYTE_IO,
                    MetadataIndex(k),
                    torch.Size([0]),
                    MetadataIndex(k),
                    torch.Size([0]),
                    torch.Size([0]),
                )
                for k in byte_keys
            ]
            _run(reader, items, planner)
            skipped += [f"{k} (needs pickle)" for k in planner.refused]
            grouped = regroup_values(
                planner.loaded, metadata.planner_data, set(metadata.state_dict_metadata) - set(byte_keys)
            )
            for k, v in grouped.items():
                try:
                    w.add_value(pre + k, v, allow_pickle=allow_pickle)
                except PickleNotAllowedError:
                    skipped.append(f"{k} (needs pickle)")
        w.commit(source=f"dcp:{src}", layout={"format": "torch-dcp"})
        counts = (w.tensors_declared, w.values_added, w.tensor_bytes, w.files_written)
    logger.info("imported %d tensors from DCP %s into %s", counts[0], src, path)
    return ConvertResult(src, path, *counts, time.monotonic() - t0, tuple(skipped))


def regroup_values(values: dict[str, Any], paths: object, tensors: set[str]) -> dict[str, Any]:
    """Nest DCP's flattened non-tensor entries back into the values ``tessera.save`` would store.

    ``dcp.save`` flattens ``{"sched": scheduler.state_dict()}`` into entries ``sched.last_epoch``,
    ``sched._schedulers.0.T_max``, ... and records their paths in the metadata's
    ``planner_data``. DCP calls ``state_dict()`` on a Stateful before saving, so a scheduler
    saved as ``scheduler`` and as ``scheduler.state_dict()`` cannot be told apart: both are stored
    as tessera stores a Stateful (``{"sched": scheduler}``), one entry per key of the top-level
    dict (``sched.last_epoch``, ``sched._schedulers``), below that a container holding no tensor
    as one value. Such a checkpoint loads into the Stateful and into a plain dict alike
    (``tessera.load`` matches a dict of plain values entry by entry when it was stored so).
    Entries whose path is unknown stay as they are.
    """
    if not isinstance(paths, dict):
        return dict(values)
    tensor_prefixes: set[tuple[Any, ...]] = set()
    for t in tensors:
        path = paths.get(t)
        if isinstance(path, tuple):
            tensor_prefixes.update(path[:i] for i in range(1, len(path) + 1))
    tree: dict[Any, Any] = {}
    out: dict[str, Any] = {}
    for fqn, v in values.items():
        path = paths.get(fqn)
        if not isinstance(path, tuple) or not path:
            out[fqn] = v
            continue
        # The value's key is the shortest prefix of its path whose subtree holds no tensor, and
        # at least a key of a top-level dict (a Stateful's state dict is stored key by key).
        first = 2 if len(path) > 1 and isinstance(path[1], str) else 1
        cut = next(i for i in range(first, len(path) + 1) if path[:i] not in tensor_prefixes)
        key = ".".join(str(p) for p in path[:cut])
        if cut == len(path):
            out[key] = v
            continue
        node = tree.setdefault(key, {})
        for p in path[cut:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = v
    for key, node in tree.items():
        out[key] = _as_lists(node)
    return out


def _as_lists(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    items = {k: _as_lists(v) for k, v in node.items()}
    if items and all(isinstance(k, int) for k in items) and sorted(items) == list(range(len(items))):
        return [items[i] for i in range(len(items))]
    return items


def _read_batch(
    reader: dcp.FileSystemReader,
    batch: list[tuple[str, tuple[int, ...], tuple[int, ...], int, TensorStorageMetadata]],
    w: CheckpointWriter,
    pre: str,
    dtype: torch.dtype | None,
    prog: Progress,
    allow_pickle: bool,
) -> None:
    if not batch:
        return
    planner = _ChunkPlanner(allow_pickle)
    items = []
    for fqn, offsets, sizes, i, md in batch:
        planner.targets[(fqn, offsets)] = torch.empty(sizes, dtype=md.properties.dtype)
        if numel(sizes):
            items.append(_chunk_item(fqn, offsets, sizes, i))
    _run(reader, items, planner)
    for fqn, offsets, sizes, _, md in batch:
        data = planner.targets[(fqn, offsets)]
        data = data.to(cast_for(data.dtype, dtype))
        w.add(pre + fqn, tuple(md.size), Box(offsets, sizes), data)
        prog.advance(data.numel() * data.element_size())


def _run(reader: dcp.FileSystemReader, items: list[ReadItem], planner: LoadPlanner) -> None:
    plan = reader.prepare_local_plan(LoadPlan(items))
    (plan,) = reader.prepare_global_plan([plan])
    reader.read_data(plan, planner).wait()
