"""The value types a caller puts into a state to describe what its rank holds.

``ShardedTensor`` and ``FlatShard`` describe one piece of a global tensor geometrically;
``per_rank`` marks a value that differs per rank and must not be treated as replicated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

import torch

from .format.geometry import Box, flat_range_to_boxes

T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class ShardedTensor:
    """A box of a global tensor that this rank owns.

    Args:
        local: the rank's data, shaped like the box (any strides).
        global_shape: shape of the whole tensor across ranks.
        global_offset: index of ``local[0, 0, ...]`` in the global tensor.

    Example:
        >>> w = torch.zeros(4, 8)  # rows 4..7 of a (16, 8) tensor
        >>> tessera.ShardedTensor(w, (16, 8), (4, 0))
    """

    local: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]

    def __init__(self, local: torch.Tensor, global_shape: Sequence[int], global_offset: Sequence[int]) -> None:
        if not isinstance(local, torch.Tensor):
            raise TypeError(f"ShardedTensor.local must be a torch.Tensor, got {type(local).__name__}")
        shape = tuple(int(s) for s in global_shape)
        offset = tuple(int(o) for o in global_offset)
        if len(shape) != local.dim() or len(offset) != local.dim():
            raise ValueError(
                f"ShardedTensor: local tensor has {local.dim()} dims but global_shape={shape} "
                f"and global_offset={offset}"
            )
        box = Box(offset, tuple(local.shape))
        if not box.fits_in(shape):
            raise ValueError(f"ShardedTensor: box {box} does not fit in global shape {shape}")
        object.__setattr__(self, "local", local)
        object.__setattr__(self, "global_shape", shape)
        object.__setattr__(self, "global_offset", offset)

    @property
    def box(self) -> Box:
        return Box(self.global_offset, tuple(self.local.shape))


@dataclass(frozen=True, eq=False)
class FlatShard:
    """A range of the row-major flattening of a global tensor that this rank owns.

    This is how FSDP1 flat parameters and ZeRO optimizer partitions hold state: the range
    may start and end in the middle of rows. It is split into at most ``2 * ndim - 1``
    contiguous boxes without any communication.

    Args:
        local_1d: the rank's elements, a 1-D tensor (a view into a flat buffer is fine).
        global_shape: shape of the whole tensor.
        flat_start: index of ``local_1d[0]`` in the flattened global tensor.

    Example:
        >>> flat = torch.zeros(10)  # elements 5..14 of a (4, 6) tensor
        >>> tessera.FlatShard(flat, (4, 6), 5)
    """

    local_1d: torch.Tensor
    global_shape: tuple[int, ...]
    flat_start: int

    def __init__(self, local_1d: torch.Tensor, global_shape: Sequence[int], flat_start: int) -> None:
        if not isinstance(local_1d, torch.Tensor) or local_1d.dim() != 1:
            raise ValueError("FlatShard.local_1d must be a 1-D torch.Tensor")
        shape = tuple(int(s) for s in global_shape)
        start = int(flat_start)
        if start < 0 or start + local_1d.numel() > math.prod(shape):
            raise ValueError(
                f"FlatShard: range [{start}, {start + local_1d.numel()}) is outside a tensor of shape {shape}"
            )
        object.__setattr__(self, "local_1d", local_1d)
        object.__setattr__(self, "global_shape", shape)
        object.__setattr__(self, "flat_start", start)

    @property
    def flat_stop(self) -> int:
        return self.flat_start + self.local_1d.numel()

    def pieces(self) -> list[tuple[Box, torch.Tensor]]:
        """The boxes of the range, each with a view of the matching local elements."""
        out = []
        pos = 0
        for box in flat_range_to_boxes(self.global_shape, self.flat_start, self.flat_stop):
            n = box.numel
            out.append((box, self.local_1d[pos : pos + n].view(box.lengths)))
            pos += n
        return out


@dataclass(frozen=True, eq=False)
class MultiShard:
    """Several pieces of one global tensor that this rank owns, under one name.

    A rank may hold disjoint boxes of the same tensor that are not one box or one flat
    range: Megatron-Core's SwiGLU ``linear_fc1`` weight, for example, puts rank ``r``'s
    gate rows and its up rows ``ffn`` rows apart. Save and load treat each piece as if it
    came alone; the pieces must not overlap and must agree on the global shape.

    Args:
        shards: the pieces (:class:`ShardedTensor` or :class:`FlatShard`), at least one.

    Example:
        >>> gate, up = torch.zeros(2, 4), torch.zeros(2, 4)  # rows 0..1 and 4..5 of (8, 4)
        >>> MultiShard([ShardedTensor(gate, (8, 4), (0, 0)), ShardedTensor(up, (8, 4), (4, 0))])
    """

    shards: tuple[ShardedTensor | FlatShard, ...]

    def __init__(self, shards: Sequence[ShardedTensor | FlatShard]) -> None:
        items = tuple(shards)
        if not items or not all(isinstance(s, (ShardedTensor, FlatShard)) for s in items):
            raise ValueError("MultiShard needs at least one ShardedTensor or FlatShard")
        shapes = {s.global_shape for s in items}
        if len(shapes) != 1:
            raise ValueError(f"MultiShard: the pieces disagree on the global shape ({sorted(shapes)})")
        object.__setattr__(self, "shards", items)


class OnResize(str, Enum):
    """What a per-rank value does when loaded under a different world size."""

    ERROR = "error"
    """Refuse: there is no sensible answer (e.g. a data-loader position of a lost rank)."""
    KEEP = "keep"
    """Leave the caller's value as it is (e.g. re-seeded RNG state)."""
    MODULO = "modulo"
    """Rank ``r`` takes what saved rank ``r % saved_world_size`` held."""


@dataclass(frozen=True, eq=False)
class PerRank(Generic[T]):
    """A rank-local value; see :func:`per_rank`."""

    value: T
    on_resize: OnResize = OnResize.ERROR


def per_rank(value: T, *, on_resize: OnResize | str = OnResize.ERROR) -> PerRank[T]:
    """Mark ``value`` as rank-local: each rank saves and loads its own copy.

    Use it for RNG states, data-loader positions and anything else that differs by rank.
    Loaded under the same world size, rank ``r`` gets exactly what rank ``r`` saved. Under
    a different world size ``on_resize`` decides (see :class:`OnResize`); the default is an
    error, because guessing is how resumed runs silently diverge.

    Args:
        value: the rank's own value (a tensor, a plain value, a nested container).
        on_resize: what a load under another world size does (:class:`OnResize` or its name).

    Returns:
        the marked value, to put in the state in place of ``value``.

    Raises:
        ValueError: for an unknown ``on_resize``.

    Example:
        >>> state = {"rng": tessera.per_rank(torch.get_rng_state())}
    """
    return PerRank(value, OnResize(on_resize))
