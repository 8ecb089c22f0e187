"""Ways a rank can hold a global tensor, for resharding tests.

Each layout maps ``(global tensor, rank, world size)`` to the value the rank puts in its
state (for saving) and, given a zero-filled target, to the value it loads into. The global
truth is an ``arange``-style tensor, so any misplaced element shows up.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import tessera

LAYOUTS = [
    "replicated",
    "dt_shard0",
    "dt_shard1",
    "dt_replicate",
    "dt_2d",
    "dt_2d_nested",
    "sharded_uneven",
    "sharded_cols",
    "flat",
]


def truth(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    n = math.prod(shape)
    base = torch.arange(n, dtype=torch.float64).reshape(shape) * 3 + seed
    if dtype == torch.bool:
        return base.to(torch.int64) % 3 == 0
    if dtype.is_floating_point and torch.finfo(dtype).bits <= 16:
        return (base % 251).to(dtype)  # exactly representable
    return base.to(dtype)


_MESHES: dict[tuple[int, ...], object] = {}


def mesh(shape: tuple[int, ...]):
    """A CPU device mesh, created once per process (creating one is collective and slow)."""
    m = _MESHES.get(shape)
    if m is None:
        m = _MESHES[shape] = init_device_mesh("cpu", shape)
    return m


def _mesh_2d(world: int):
    a = 2 if world % 2 == 0 and world > 2 else world
    return mesh((a, world // a))


def _uneven_bounds(n: int, world: int) -> list[int]:
    # Skewed split points: rank r gets about (r + 1) parts; some ranks may get nothing.
    weights = [r + 1 for r in range(world)]
    total = sum(weights)
    bounds = [0]
    for w in weights:
        bounds.append(min(n, bounds[-1] + max(0, round(n * w / total))))
    bounds[-1] = n
    return bounds


def hold(layout: str, full: torch.Tensor, rank: int, world: int) -> object:
    """What ``rank`` holds of ``full`` under ``layout`` (a view or copy of its part)."""
    if layout == "replicated":
        return full.clone()
    if layout.startswith("dt_"):
        if layout == "dt_2d" or layout == "dt_2d_nested":
            device_mesh = _mesh_2d(world)
            placements = [Shard(0), Shard(1)] if layout == "dt_2d" else [Shard(0), Shard(0)]
        else:
            device_mesh = mesh((world,))
            placements = {"dt_shard0": [Shard(0)], "dt_shard1": [Shard(full.dim() - 1)], "dt_replicate": [Replicate()]}[
                layout
            ]
        return DTensor.from_local(
            _local_of(full, device_mesh, placements), device_mesh, placements, shape=full.shape, stride=full.stride()
        )
    if layout == "sharded_uneven":
        b = _uneven_bounds(full.shape[0], world)
        local = full[b[rank] : b[rank + 1]].clone()
        return tessera.ShardedTensor(local, full.shape, (b[rank],) + (0,) * (full.dim() - 1))
    if layout == "sharded_cols":
        d = full.dim() - 1
        b = _uneven_bounds(full.shape[d], world)
        local = full.narrow(d, b[rank], b[rank + 1] - b[rank]).clone()
        off = [0] * full.dim()
        off[d] = b[rank]
        return tessera.ShardedTensor(local, full.shape, tuple(off))
    if layout == "flat":
        n = full.numel()
        b = _uneven_bounds(n, world)
        local = full.reshape(-1)[b[rank] : b[rank + 1]].clone()
        return tessera.FlatShard(local, full.shape, b[rank])
    raise ValueError(layout)


def _local_of(full: torch.Tensor, device_mesh, placements) -> torch.Tensor:
    """This rank's shard under torch's chunking rules, computed locally (no communication)."""
    local = full
    coord = device_mesh.get_coordinate()
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            n = device_mesh.size(mesh_dim)
            chunks = list(torch.chunk(local, n, dim=p.dim))
            i = coord[mesh_dim]
            local = chunks[i] if i < len(chunks) else local.narrow(p.dim, 0, 0)
    return local.clone()


def local_part(value: object) -> torch.Tensor:
    """The tensor memory a held value fills on load."""
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, tessera.ShardedTensor):
        return value.local
    if isinstance(value, tessera.FlatShard):
        return value.local_1d
    assert isinstance(value, torch.Tensor)
    return value


def zeros_like_held(layout: str, full: torch.Tensor, rank: int, world: int) -> object:
    """A target under ``layout`` whose local memory is zero."""
    held = hold(
        layout,
        torch.zeros_like(full) if full.dtype != torch.bool else torch.zeros(full.shape, dtype=torch.bool),
        rank,
        world,
    )
    return held


def expected_local(layout: str, full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return local_part(hold(layout, full, rank, world))


Check = Callable[[str, torch.Tensor, int, int], None]
