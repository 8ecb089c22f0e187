"""ZeRO-style flat partitions: a rank's slice of a flat buffer as :class:`FlatShard`\\ s per parameter.

ZeRO-1/2 optimizers (DeepSpeed ``stage_1_and_2``, Megatron's distributed optimizer,
FSDP1 flat parameters) concatenate the parameters of a group into one flat buffer, pad
it, and give each data-parallel rank an equal contiguous range of it. The range cuts
across parameter boundaries and through the middle of rows. The fp32 master weights and
the optimizer state (Adam's ``exp_avg``/``exp_avg_sq``) exist only for that range, as
1-D tensors of the partition's size.

This module describes where every parameter lives in the flat buffer
(:class:`FlatLayout`) and which part of it a rank holds (:class:`FlatPartition`), and
turns a partition-sized tensor into one :class:`~tessera.FlatShard` per parameter: views
into the caller's buffer, so saving copies nothing up front and loading fills the buffer
in place. Padding is never saved; on load it is left as it is. The checkpoint holds each
parameter's state as a global tensor of the parameter's shape, keyed by its FQN, so it
loads under any other partitioning, world size or framework (a plain single process
included).

Everything here is pure and local: no communication, and every rank may call it freely.

Example:
    >>> layout = FlatLayout.deepspeed([("w", (4, 6)), ("b", (6,))], dp_size=2)
    >>> part = layout.partition(rank, 2)
    >>> state = {"optim": {"state": part.optimizer_state(
    ...     {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, {"step": step})}}
    >>> tessera.save(path, state)
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..shards import FlatShard

logger = logging.getLogger(__name__)

__all__ = ["FlatEntry", "FlatLayout", "FlatPartition", "PartitionPiece", "zero_partition_state"]

ParamSpec = tuple[str, Sequence[int] | torch.Tensor]
"""``(fqn, shape)``; a tensor (a parameter, possibly on the meta device) stands for its shape."""


@dataclass(frozen=True)
class FlatEntry:
    """Where one parameter lives in a flat buffer.

    Attributes:
        fqn: the parameter's fully qualified name (the checkpoint key of its state).
        shape: the parameter's shape.
        offset: index of the parameter's first element in the flat buffer.
    """

    fqn: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def stop(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class PartitionPiece:
    """The part of one parameter that falls inside a partition.

    Attributes:
        entry: the parameter.
        param_start: first element of the parameter (in its row-major flattening) in the partition.
        param_stop: one past the last such element.
        local_start: where ``param_start`` sits in the partition-sized local tensor.
    """

    entry: FlatEntry
    param_start: int
    param_stop: int
    local_start: int

    @property
    def numel(self) -> int:
        return self.param_stop - self.param_start


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _shape_of(fqn: str, spec: Sequence[int] | torch.Tensor) -> tuple[int, ...]:
    if isinstance(spec, torch.Tensor):
        return tuple(spec.shape)
    try:
        shape = tuple(int(s) for s in spec)
    except TypeError as e:
        raise TypeError(f"parameter '{fqn}': shape must be a sequence of ints or a tensor, got {spec!r}") from e
    if any(s < 0 for s in shape):
        raise ValueError(f"parameter '{fqn}': shape {shape} has a negative size")
    return shape


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter of one group lives in a flat buffer, padding included.

    Build it with :meth:`pack` (parameters back to back, with optional alignment padding
    before each parameter and at the end) or :meth:`deepspeed` (DeepSpeed ZeRO-1/2), or
    directly from explicit offsets. Elements no entry covers are padding.

    Attributes:
        entries: the parameters in buffer order.
        numel: size of the whole flat buffer, padding included.

    Raises:
        ValueError: if entries overlap, run past ``numel`` or repeat an FQN.
    """

    entries: tuple[FlatEntry, ...]
    numel: int
    _stops: list[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "entries", tuple(self.entries))
        seen: set[str] = set()
        end = 0
        for e in self.entries:
            if e.fqn in seen:
                raise ValueError(f"flat layout: parameter '{e.fqn}' appears twice")
            seen.add(e.fqn)
            if e.offset < end:
                raise ValueError(
                    f"flat layout: parameter '{e.fqn}' at offset {e.offset} overlaps the one before it (ends at {end})"
                )
            end = e.stop
        if end > self.numel:
            raise ValueError(f"flat layout: parameters end at element {end}, past the buffer's {self.numel} elements")
        # Entries are sorted and disjoint, so their stops are sorted too: ranges are found by bisection.
        object.__setattr__(self, "_stops", [e.stop for e in self.entries])

    @classmethod
    def pack(cls, params: Iterable[ParamSpec], *, param_alignment: int = 1, total_alignment: int = 1) -> FlatLayout:
        """Parameters back to back in the order given.

        Args:
            params: ``(fqn, shape)`` pairs in buffer order (a tensor may stand for its shape).
            param_alignment: each parameter starts at a multiple of this many elements
                (zero padding before it), as Megatron's distributed optimizer and FSDP1's
                ``_align_addresses`` do. 1: no padding between parameters.
            total_alignment: the buffer's size is rounded up to a multiple of this.

        Returns:
            The layout.

        Example:
            >>> FlatLayout.pack([("w", (3, 3)), ("b", (3,))], param_alignment=4).numel
            15
        """
        if param_alignment < 1 or total_alignment < 1:
            raise ValueError(
                f"alignments must be >= 1, got param_alignment={param_alignment}, total_alignment={total_alignment}"
            )
        entries = []
        pos = 0
        for fqn, spec in params:
            pos = _round_up(pos, param_alignment)
            entry = FlatEntry(str(fqn), _shape_of(fqn, spec), pos)
            entries.append(entry)
            pos = entry.stop
        return cls(tuple(entries), _round_up(pos, total_alignment))

    @classmethod
    def deepspeed(cls, params: Iterable[ParamSpec], dp_size: int, *, alignment_factor: int = 2) -> FlatLayout:
        """The flat buffer of one DeepSpeed ZeRO-1/2 parameter group.

        ``DeepSpeedZeroOptimizer`` flattens a group's trainable parameters back to back (in
        ``round_robin_bit16_groups`` order: pass them in that order) and appends zeros up
        to a multiple of ``nccl_start_alignment_factor * dp_size`` (the factor is 2), so the
        buffer splits into ``dp_size`` equal partitions.

        Args:
            params: ``(fqn, shape)`` pairs in the order of the flat buffer.
            dp_size: size of the group's data-parallel process group.
            alignment_factor: DeepSpeed's ``nccl_start_alignment_factor``.

        Example:
            >>> FlatLayout.deepspeed([("w", (5, 7)), ("b", (7,))], dp_size=2).numel
            44
        """
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        return cls.pack(params, total_alignment=alignment_factor * dp_size)

    def fqns(self) -> list[str]:
        return [e.fqn for e in self.entries]

    def partition(self, rank: int, world_size: int) -> FlatPartition:
        """Rank ``rank``'s range when the buffer is split among ``world_size`` ranks.

        DeepSpeed's split (``get_data_parallel_partitions``): equal parts, the first
        ``numel % world_size`` ranks taking one element more.

        Example:
            >>> layout.partition(1, 2)
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        base, extra = divmod(self.numel, world_size)
        start = rank * base + min(rank, extra)
        return FlatPartition(self, start, start + base + (1 if rank < extra else 0))

    def slice(self, start: int, stop: int) -> FlatPartition:
        """The partition ``[start, stop)`` of the buffer, for frameworks that split differently."""
        return FlatPartition(self, start, stop)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each parameter as a view of the whole flat buffer, shaped like the parameter.

        Use it for state every rank holds whole (ZeRO-1/2 bit16 weights): each view is a
        replicated global tensor, saved once, and loading fills the buffer in place.

        Raises:
            ValueError: if ``flat`` is not a 1-D tensor of ``numel`` elements.

        Example:
            >>> state = {"model": layout.views(optimizer.bit16_groups_flat[0])}
        """
        _check_local("whole flat buffer", flat, self.numel)
        return {e.fqn: flat[e.offset : e.stop].view(e.shape) for e in self.entries}


@dataclass(frozen=True)
class FlatPartition:
    """One rank's contiguous range ``[start, stop)`` of a :class:`FlatLayout`'s buffer.

    Attributes:
        layout: the whole buffer's layout.
        start: first element of the range in the buffer.
        stop: one past the last element.
    """

    layout: FlatLayout
    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.stop <= self.layout.numel:
            raise ValueError(
                f"partition [{self.start}, {self.stop}) is outside a flat buffer of {self.layout.numel} elements"
            )

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def padding(self) -> int:
        """Elements of the range that belong to no parameter."""
        return self.numel - sum(p.numel for p in self.pieces())

    def pieces(self) -> list[PartitionPiece]:
        """The parameters that overlap the range, in buffer order."""
        out = []
        entries = self.layout.entries
        for i in range(bisect.bisect_right(self.layout._stops, self.start), len(entries)):
            e = entries[i]
            if e.offset >= self.stop:
                break
            lo, hi = max(e.offset, self.start), min(e.stop, self.stop)
            if lo < hi:
                out.append(PartitionPiece(e, lo - e.offset, hi - e.offset, lo - self.start))
        return out

    def shards(self, local: torch.Tensor, *, declare_all: bool = True) -> dict[str, FlatShard]:
        """The partition-sized tensor ``local`` as one :class:`FlatShard` per parameter.

        Each shard's data is a view of ``local`` (no copy): saving writes the partition's
        elements as pieces of each parameter's global tensor, and loading fills ``local``
        in place. Padding elements are neither saved nor touched by a load.

        Args:
            local: 1-D tensor holding this rank's range (fp32 master partition, an Adam
                moment, or ``flat[part.start:part.stop]`` of a whole buffer).
            declare_all: also list the parameters outside the range, with an empty shard,
                so every rank names every key (what ``tessera.load(strict=True)`` expects).
                With False only overlapping parameters appear.

        Returns:
            ``{fqn: FlatShard}`` in buffer order.

        Raises:
            ValueError: if ``local`` is not a 1-D tensor of the partition's size.

        Example:
            >>> part.shards(optimizer.single_partition_of_fp32_groups[0])
        """
        _check_local(f"partition [{self.start}, {self.stop})", local, self.numel)
        overlapping = {p.entry.fqn: p for p in self.pieces()}
        if not declare_all:
            return {
                fqn: FlatShard(local[p.local_start : p.local_start + p.numel], p.entry.shape, p.param_start)
                for fqn, p in overlapping.items()
            }
        empty = local[:0]
        out: dict[str, FlatShard] = {}
        for e in self.layout.entries:
            p = overlapping.get(e.fqn)
            if p is not None:
                out[e.fqn] = FlatShard(local[p.local_start : p.local_start + p.numel], e.shape, p.param_start)
            else:
                out[e.fqn] = FlatShard(empty, e.shape, 0)
        return out

    def optimizer_state(
        self,
        per_element: Mapping[str, torch.Tensor],
        per_param: Mapping[str, object] | None = None,
        *,
        declare_all: bool = True,
    ) -> dict[str, dict[str, object]]:
        """Optimizer state keyed by parameter FQN, the way a plain optimizer holds it.

        Args:
            per_element: partition-sized tensors by state name (``{"exp_avg": ...,
                "exp_avg_sq": ...}``); each becomes a :class:`FlatShard` per parameter.
            per_param: values shared by every parameter of the group (``{"step": step}``);
                each parameter gets the same object, a replicated value.
            declare_all: see :meth:`shards`.

        Returns:
            ``{fqn: {name: FlatShard or shared value}}``; nest it under e.g.
            ``state["optim"]["state"]`` to get keys ``optim.state.<fqn>.exp_avg``.

        Example:
            >>> st = base_optimizer.state[fp32_partition]
            >>> part.optimizer_state({"exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"]},
            ...                      {"step": st["step"]})
        """
        per_param = dict(per_param or {})
        clash = set(per_element) & set(per_param)
        if clash:
            raise ValueError(f"optimizer state names {sorted(clash)} are given both per element and per parameter")
        shards = {name: self.shards(t, declare_all=declare_all) for name, t in per_element.items()}
        out: dict[str, dict[str, object]] = {}
        for e in self.layout.entries:
            entry: dict[str, object] = {name: s[e.fqn] for name, s in shards.items() if e.fqn in s}
            if not entry and not declare_all:
                continue
            entry.update(per_param)
            out[e.fqn] = entry
        return out


def _check_local(what: str, t: torch.Tensor, numel: int) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 1:
        got = f"a {t.dim()}-D tensor" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{what}: expected a 1-D tensor of {numel} elements, got {got}")
    if t.numel() != numel:
        raise ValueError(f"{what}: expected a 1-D tensor of {numel} elements, got {t.numel()}")


def zero_partition_state(
    local: torch.Tensor,
    params: Iterable[ParamSpec],
    partition_start: int,
    *,
    param_alignment: int = 1,
    declare_all: bool = True,
) -> dict[str, FlatShard]:
    """One-call form: the partition ``local`` of a packed flat buffer as per-parameter shards.

    Equivalent to ``FlatLayout.pack(params, param_alignment=...).slice(partition_start,
    partition_start + local.numel()).shards(local)``, except that the buffer is taken to
    end where the partition does when it runs past the parameters (tail padding).

    Args:
        local: the rank's 1-D partition (a view into a flat buffer is fine).
        params: ``(fqn, shape)`` of every parameter of the buffer, in buffer order.
        partition_start: index of ``local[0]`` in the flat buffer.
        param_alignment: see :meth:`FlatLayout.pack`.
        declare_all: see :meth:`FlatPartition.shards`.

    Returns:
        ``{fqn: FlatShard}``, views of ``local``.

    Example:
        >>> shards = zero_partition_state(exp_avg, [("w", (4, 6)), ("b", (6,))], 12)
    """
    layout = FlatLayout.pack(params, param_alignment=param_alignment)
    stop = partition_start + local.numel()
    layout = FlatLayout(layout.entries, max(layout.numel, stop))
    return layout.slice(partition_start, stop).shards(local, declare_all=declare_all)
