"""Megatron-Core ``torch_dist`` checkpoints -> tessera.

Megatron-Core's own distributed format (``--ckpt-format torch_dist``: torch DCP files plus
``common.pt`` and ``metadata.json``) is read chunk by chunk with DCP's ``FileSystemReader``,
optimizer state included, into the names and encoding of :mod:`tessera.adapters.megatron_core`,
so the result loads with ``load_sharded_state_dict`` into any TP / PP / DP / EP layout.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from ..adapters.megatron_core import COMMON_KEY, TORCH_SAVE, TORCH_SAVE_FIRST
from ..errors import CheckpointError
from ..format.dtypes import cast_for
from ..format.geometry import Box
from ..storage import Storage
from ._common import ConvertResult, Progress, ProgressFn
from .dcp_metadata import read_dcp_metadata
from .writer import CheckpointWriter

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
"""The file in a Megatron checkpoint root naming the latest iteration (or ``release``)."""


class _TorchDistPlanner:
    """A minimal DCP ``LoadPlanner``: reads saved chunks into buffers and keeps byte entries raw."""

    def __init__(self) -> None:
        self.targets: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        self.raw: dict[str, bytes] = {}

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        pass

    def load_bytes(self, read_item: Any, value: Any) -> None:
        self.raw[read_item.dest_index.fqn] = value.read()  # unpickled only when loaded (and allowed)

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        t = self.targets[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset or ()))]
        for d, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(d, o, n)
        return t

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        pass


def is_torch_dist(path: str) -> bool:
    """Whether ``path`` is a Megatron-Core ``torch_dist`` checkpoint (an ``iter_*`` directory,
    or a checkpoint root whose tracker names one), not a plain torch DCP directory.

    Megatron writes ``metadata.json`` with ``sharded_backend: torch_dist`` (and ``common.pt``)
    beside DCP's ``.metadata``; plain DCP has neither.
    """
    tracker = os.path.join(path, TRACKER)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            it = f.read().strip()
        if it == "release" or it.isdigit():
            path = os.path.join(path, "release" if it == "release" else f"iter_{int(it):07d}")
    if not os.path.isfile(os.path.join(path, ".metadata")):
        return False
    meta = os.path.join(path, "metadata.json")
    if os.path.isfile(meta):
        try:
            with open(meta) as f:
                return json.load(f).get("sharded_backend") == "torch_dist"
        except (OSError, ValueError, AttributeError):
            return False
    return os.path.isfile(os.path.join(path, "common.pt"))


def import_torch_dist(
    src: str,
    path: str,
    *,
    dtype: torch.dtype | None = None,
    storage: Storage | None = None,
    file_bytes: int = 256 << 20,
    progress: ProgressFn | None = None,
    allow_pickle: bool = False,
) -> ConvertResult:
    """Convert a Megatron-Core ``torch_dist`` checkpoint (model and optimizer) into tessera.

    Tensors keep Megatron's keys (``decoder.layers.self_attention.linear_qkv.weight``,
    ``optimizer.state.exp_avg.decoder...``) with their global shapes (layer and expert
    axes included); every saved chunk becomes one tile. Sharded objects (``key/shard_...``)
    and ``common.pt`` are carried as the bytes Megatron wrote, unpickled only when loaded:
    with ``weights_only`` unless the loader passes ``allow_pickle=True``. Load the result with
    :func:`tessera.adapters.megatron_core.load_sharded_state_dict`.

    The distributed optimizer's ``dp_reshardable`` format (Megatron-Core's default for
    ``torch_dist``) stores its state as flat gradient-buffer buckets whose layout depends
    on the model and DP size; it is imported as is (``optimizer.distributed.*`` tensors) and
    reloads only into the same bucket layout. Save with
    ``--dist-ckpt-optim-fully-reshardable`` (``fully_reshardable``) to reshard optimizer state.

    Args:
        src: the ``iter_*`` directory holding ``.metadata`` and ``common.pt`` (or the
            checkpoint root with ``latest_checkpointed_iteration.txt``).
        path: where to write the tessera checkpoint (replaced atomically).
        dtype: cast floating-point tensors to this dtype.
        storage: backend of the new checkpoint.
        file_bytes: most bytes of chunks read per batch, and the size of tessera data files.
        progress: called with ``(done_bytes, total_bytes)``.
        allow_pickle: unpickle DCP's ``.metadata`` whatever classes it names (only for
            checkpoints you trust); without it, only DCP's and Megatron's own classes are read.

    Returns:
        What was written.

    Raises:
        FileNotFoundError: if ``src`` is not a ``torch_dist`` checkpoint.
        PickleNotAllowedError: if ``.metadata`` names another class (nothing from it is run).
        CorruptCheckpointError: if ``.metadata`` is not well-formed DCP metadata.
        CoverageError: if the chunks do not cover a tensor exactly once.

    Example:
        >>> import_torch_dist("/runs/gpt/checkpoints/iter_0000100", "/ckpt/gpt-iter100")
    """
    t0 = time.monotonic()
    tracker = os.path.join(src, TRACKER)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            it = f.read().strip()
        src = os.path.join(src, "release" if it == "release" else f"iter_{int(it):07d}")
    if not os.path.isfile(os.path.join(src, ".metadata")):
        raise FileNotFoundError(f"{src} is not a Megatron torch_dist checkpoint (no .metadata)")
    info: dict[str, Any] = {}
    if os.path.isfile(os.path.join(src, "metadata.json")):
        with open(os.path.join(src, "metadata.json")) as f:
            info = json.load(f)
    if info and info.get("sharded_backend") not in (None, "torch_dist"):
        raise CheckpointError(f"{src}: sharded backend {info.get('sharded_backend')!r} is not torch_dist")
    metadata = read_dcp_metadata(src, allow_pickle=allow_pickle)  # never DCP's own pickle.load
    reader = dcp.FileSystemReader(src)
    reader.set_up_storage_reader(metadata, True)

    def run(items: list[Any], planner: _TorchDistPlanner) -> None:
        plan = reader.prepare_local_plan(LoadPlan(items))
        (plan,) = reader.prepare_global_plan([plan])
        reader.read_data(plan, planner).wait()  # type: ignore[arg-type]

    chunks = [
        (fqn, tuple(c.offsets), tuple(c.sizes), i, md)
        for fqn, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)
        for i, c in enumerate(md.chunks)
    ]  # fmt: skip
    prog = Progress(sum(math.prod(s) * md.properties.dtype.itemsize for _, _, s, _, md in chunks), progress)
    with CheckpointWriter(path, storage=storage, file_bytes=file_bytes) as w:
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                w.declare(fqn, tuple(md.size), cast_for(md.properties.dtype, dtype))
        start = 0
        while start < len(chunks):
            planner, items, size, stop = _TorchDistPlanner(), [], 0, start
            while stop < len(chunks) and (stop == start or size < file_bytes):
                fqn, offsets, sizes, i, md = chunks[stop]
                planner.targets[(fqn, offsets)] = torch.empty(sizes, dtype=md.properties.dtype)
                if math.prod(sizes):
                    index = MetadataIndex(fqn, offsets, i)
                    zero = torch.Size([0] * len(sizes))
                    items.append(ReadItem(LoadItemType.TENSOR, index, zero, index, zero, torch.Size(sizes)))
                size += math.prod(sizes) * md.properties.dtype.itemsize
                stop += 1
            run(items, planner)
            for fqn, offsets, sizes, _, md in chunks[start:stop]:
                data = planner.targets[(fqn, offsets)]
                data = data.to(cast_for(data.dtype, dtype))
                w.add(fqn, tuple(md.size), Box(offsets, sizes), data)
                prog.advance(data.numel() * data.element_size())
            start = stop
        byte_keys = [k for k, md in metadata.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata)]
        if byte_keys:
            planner = _TorchDistPlanner()
            run([ReadItem(LoadItemType.BYTE_IO, MetadataIndex(k), torch.Size([0]), MetadataIndex(k), torch.Size([0]),
                          torch.Size([0])) for k in byte_keys], planner)  # fmt: skip
            for k in byte_keys:  # Megatron wrote torch.save([obj]) per sharded object
                w.add_value(k, {TORCH_SAVE_FIRST: planner.raw[k]})
        common = os.path.join(src, "common.pt")
        if os.path.isfile(common):
            with open(common, "rb") as fb:
                w.add_value(COMMON_KEY, {TORCH_SAVE: fb.read()})
        w.commit(source=f"megatron-torch_dist:{src}", layout={"format": "megatron-torch_dist", **info})
        counts = (w.tensors_declared, w.values_added, w.tensor_bytes, w.files_written)
    logger.info("converted Megatron torch_dist checkpoint %s into %s", src, path)
    return ConvertResult(src, path, *counts, time.monotonic() - t0, ())
