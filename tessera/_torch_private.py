"""The one place tessera touches private torch APIs, each with the reason.

Keeping them here means a torch upgrade breaks at most this file, and each use has a
public fallback or a clear error.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypeGuard

import torch

from .format.geometry import Box

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

_DTENSOR_MODULE = "torch.distributed.tensor"
"""Imported only when a DTensor exists (importing it costs about a second: sympy, the op registry);
a save of plain tensors in a fresh process does not pay for it."""


def dtensor_local_box(dt: DTensor, name: str) -> Box:
    """The box of the global tensor held by this rank's local shard of ``dt``.

    torch has no public API for a shard's global offset; DCP uses the private
    ``compute_local_shape_and_global_offset``, which also knows torch's uneven-shard and
    nested-sharding rules (several mesh dims sharding one tensor dim). We call it when it
    exists and otherwise compute the offset for plain ``Shard``/``Replicate`` placements.

    Raises:
        ValueError: for ``Partial`` placements (the shard is not a box of the tensor).
    """
    from torch.distributed.tensor import Partial, Replicate, Shard

    placements = dt.placements
    for p in placements:
        if isinstance(p, Partial):
            raise ValueError(
                f"tensor '{name}' is a DTensor with a Partial placement ({placements}); "
                "reduce it (e.g. .redistribute(placements=[Replicate()])) before saving"
            )
        if not isinstance(p, (Shard, Replicate)):
            # _StridedShard (FSDP2 over TP on one dim) is not a box; adapters handle it.
            raise ValueError(
                f"tensor '{name}': DTensor placement {p!r} does not describe a box of the global tensor; "
                "tessera.ModelState handles FSDP2+TP models"
            )
    local = dt.to_local()
    shape = tuple(dt.shape)
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # pragma: no cover - torch without the helper
        lshape, offset = _box_from_placements(dt)
    else:
        lshape, offset = compute_local_shape_and_global_offset(shape, dt.device_mesh, placements)
        lshape, offset = tuple(int(s) for s in lshape), tuple(int(o) for o in offset)
    if tuple(local.shape) != lshape:
        raise ValueError(
            f"tensor '{name}': DTensor local shard has shape {tuple(local.shape)} but its placements "
            f"{placements} imply {lshape}"
        )
    # torch reports offset == global size along a sharded dim for empty shards; clamp so the
    # (empty) box still lies inside the tensor.
    offset = tuple(min(o, s) for o, s in zip(offset, shape))
    return Box(offset, lshape)


def _box_from_placements(dt: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Fallback: torch.chunk semantics, applied mesh dim by mesh dim."""
    from torch.distributed.tensor import Shard

    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError("this rank is not in the DTensor's device mesh")
    shape = list(dt.shape)
    offset = [0] * len(shape)
    for mesh_dim, p in enumerate(dt.placements):
        if isinstance(p, Shard):
            d = p.dim if p.dim >= 0 else p.dim + len(shape)
            n = mesh.size(mesh_dim)
            chunk = -(-shape[d] // n) if shape[d] else 0
            i = coord[mesh_dim]
            lo = min(i * chunk, shape[d])
            hi = min(lo + chunk, shape[d])
            offset[d] += lo
            shape[d] = hi - lo
    return tuple(shape), tuple(offset)


def dtensor_replica(dt: DTensor, world_size: int) -> tuple[int, int] | None:
    """``(index, count)`` of this rank among the ranks holding the same box of ``dt``, or None.

    The holders of one box differ only in their mesh coordinates along ``Replicate`` dims, a
    global fact every rank knows: so a save can decide who writes a replicated box without
    asking the others. Only when the mesh spans the whole saving group (else ranks outside the
    mesh may hold copies too: the save then exchanges plans).
    """
    from torch.distributed.tensor import Replicate

    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None or mesh.size() != world_size:
        return None
    index, count = 0, 1
    for mesh_dim, p in enumerate(dt.placements):
        if isinstance(p, Replicate):
            index = index * mesh.size(mesh_dim) + coord[mesh_dim]
            count *= mesh.size(mesh_dim)
    return index, count


def is_dtensor(value: object) -> TypeGuard[DTensor]:
    """Whether ``value`` is a DTensor; no DTensor can exist before its module was imported."""
    module = sys.modules.get(_DTENSOR_MODULE)
    return module is not None and isinstance(value, module.DTensor)


def local_tensor(dt: DTensor) -> torch.Tensor:
    """The rank's local shard, sharing storage with ``dt`` (writes go into the DTensor)."""
    return dt._local_tensor if hasattr(dt, "_local_tensor") else dt.to_local()


def version_counter(t: torch.Tensor) -> int:
    """``t``'s autograd version counter: bumped by every in-place op on ``t``, its views and ``detach()``es.

    ``Tensor._version`` is the only way to read it (autograd's own saved-tensor check uses
    it); there is no public accessor. The staging mutation check reads it at ``async_save``
    and again after the background copy.
    """
    return int(t._version)


def forward_hooks(module: torch.nn.Module | None) -> list[object]:
    """The forward pre-hooks and forward hooks of ``module`` (None: the global ones, which run
    for every module), as registered.

    torch has no public way to list a module's hooks (``Module._forward_pre_hooks`` and
    ``_forward_hooks``, ``torch.nn.modules.module._global_forward_pre_hooks`` and
    ``_global_forward_hooks`` are where ``register_*_hook`` puts them). ``ModelState`` reads
    them to find code of the user's that runs with the forward pass and may write the saved
    parameters (a hook that clamps weights), so that it holds the forward while a save copies.
    Missing attributes (another torch) read as no hooks.
    """
    if module is None:
        from torch.nn.modules import module as torch_module

        holders = [
            getattr(torch_module, "_global_forward_pre_hooks", {}),
            getattr(torch_module, "_global_forward_hooks", {}),
        ]
    else:
        holders = [getattr(module, "_forward_pre_hooks", {}), getattr(module, "_forward_hooks", {})]
    return [hook for holder in holders for hook in list(holder.values())]


def dcp_metadata_private_classes() -> list[tuple[object, str]]:
    """The private classes DCP pickles into ``.metadata``, as ``(class, "module.Name")``.

    DCP's ``FileSystemWriter`` pickles each entry's location as ``filesystem._StorageInfo``
    (and Megatron-Core's plans name ``filesystem._StoragePrefix``); ``TensorProperties``
    pickles its memory format as ``metadata._MEM_FORMAT_ENCODING``. Importing a DCP
    checkpoint without unpickling arbitrary code needs these exact classes allow-listed
    (``FileSystemReader`` reads the first back by attribute). A class a torch release drops
    is left out, so a checkpoint that names it is refused with a clear error.
    """
    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.metadata as md

    out: list[tuple[object, str]] = []
    for module, name in ((fs, "_StorageInfo"), (fs, "_StoragePrefix"), (md, "_MEM_FORMAT_ENCODING")):
        cls = getattr(module, name, None)
        if cls is not None:
            out.append((cls, f"{module.__name__}.{name}"))
    return out
