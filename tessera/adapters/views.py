"""How a rank's memory maps onto a global tensor: :class:`ParamView` and :class:`ParamEntry`.

Shared by the model adapter (:mod:`.model`), FSDP1's flat parameters (:mod:`.fsdp1`) and the
optimizer adapter (:mod:`.optimizer`): a view describes geometry only, so an optimizer state
is wrapped exactly like its parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
from torch.distributed.tensor import DTensor

from .. import _torch_private
from ..format.geometry import Box
from ..shards import FlatShard, ShardedTensor
from . import _torch_compat


class ViewKind(str, Enum):
    """How a rank's memory maps onto a global tensor."""

    REPLICATED = "replicated"
    """The local tensor is the whole global tensor."""
    DTENSOR = "dtensor"
    """A DTensor with Shard/Replicate placements; ``box`` is its local shard."""
    BOX = "box"
    """A local tensor that is ``box`` of the global tensor (e.g. a ``_StridedShard`` DTensor)."""
    FLAT = "flat"
    """Elements ``[start, start + numel)`` of 1-D local memory are the global tensor's
    row-major elements from ``flat_start`` on (FSDP1)."""


@dataclass(frozen=True)
class ParamView:
    """Which part of the global tensor ``fqn`` a rank's memory holds."""

    fqn: str
    shape: tuple[int, ...]
    kind: ViewKind
    box: Box | None = None
    start: int = 0
    numel: int = 0
    flat_start: int = 0

    @property
    def sharded(self) -> bool:
        """Whether the rank holds less than the whole tensor (or may, for flat ranges)."""
        if self.kind is ViewKind.FLAT:
            return True
        return self.box is not None and self.box.lengths != self.shape

    def wrap(self, t: torch.Tensor) -> object:
        """Describe ``t`` (memory shaped like the parameter's) as this view, aliasing it."""
        if isinstance(t, DTensor):
            if _torch_compat.has_strided_shard(t):
                box = _torch_compat.strided_local_box(t, self.fqn)
                return ShardedTensor(_torch_private.local_tensor(t).detach(), tuple(t.shape), box.offsets)
            return t.detach()
        t = t.detach()
        if self.kind is ViewKind.REPLICATED:
            return t
        if self.kind is ViewKind.FLAT:
            return FlatShard(t.reshape(-1)[self.start : self.start + self.numel], self.shape, self.flat_start)
        assert self.box is not None
        return ShardedTensor(t, self.shape, self.box.offsets)

    def local_part(self, full: torch.Tensor) -> torch.Tensor:
        """This view's part of a full (global) tensor, shaped like the held memory."""
        if self.kind is ViewKind.REPLICATED:
            return full
        if self.kind is ViewKind.FLAT:
            return full.reshape(-1)[self.flat_start : self.flat_start + self.numel]
        assert self.box is not None
        return full[self.box.slices()]


@dataclass(frozen=True, eq=False)
class ParamEntry:
    """A tensor a framework holds (the key an optimizer uses) and the FQNs it backs."""

    tensor: torch.Tensor
    views: tuple[ParamView, ...]
    is_buffer: bool = False

    @property
    def requires_grad(self) -> bool:
        return bool(self.tensor.requires_grad) and not self.is_buffer

    @property
    def sharded(self) -> bool:
        return any(v.sharded for v in self.views)

    def is_like(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (say an optimizer state) is laid out like this entry's tensor."""
        mine = self.tensor
        if isinstance(mine, DTensor):
            if isinstance(t, DTensor):
                return t.shape == mine.shape
            return t.shape == _torch_private.local_tensor(mine).shape
        return not isinstance(t, DTensor) and t.shape == mine.shape

    def local(self) -> torch.Tensor:
        t = self.tensor
        return (_torch_private.local_tensor(t) if isinstance(t, DTensor) else t).detach()
