"""Flatten a user's state into named pieces of global tensors and plain values, and back.

This is the only module that understands the shapes of user state: nested dicts, lists and
tuples, tensors, DTensors, :class:`ShardedTensor`, :class:`FlatShard`, :func:`per_rank`
values and objects with ``state_dict()``/``load_state_dict()``. Everything downstream
(planning, I/O, the manifest) sees only :class:`TensorPiece` and plain values by FQN.

FQNs join keys with dots: ``{"model": {"layers.0.w": t}}`` is ``model.layers.0.w``. A
container that holds no tensor anywhere inside is one plain value under its own FQN.
Names are unique: two entries of one state that join to the same FQN (``{"a.b": x,
"a": {"b": y}}``, or a list index and a dict key: ``m.x.0``) are an
:class:`~tessera.errors.InvalidStateError` naming both, at save and at load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .. import _torch_private
from ..errors import InvalidStateError
from ..format.dtypes import dtype_name
from ..format.geometry import Box
from ..format.values import MAX_DEPTH, check_depth, encode_value
from ..shards import FlatShard, MultiShard, OnResize, PerRank, ShardedTensor
from ..stateful import GatedStateful, PreparesLoad, Stateful, is_stateful
from .optim_dict import is_optimizer_state_dict, missing_param_states


@dataclass(frozen=True, eq=False)
class TensorPiece:
    """A box of a named global tensor that this rank holds, with its local data.

    Attributes:
        fqn: the tensor's fully qualified name.
        shape: the global shape.
        dtype: the element type.
        box: which part of the global tensor ``data`` is.
        data: the rank's elements, shaped like ``box.lengths`` (any strides).
        flat: for pieces of a :class:`FlatShard`, the flat range the piece was cut from.
        per_rank: for tensors inside :func:`per_rank`, the resize policy; the global tensor
            then has a leading dimension of one entry per rank.
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    box: Box
    data: torch.Tensor
    flat: tuple[int, int] | None = None
    per_rank: OnResize | None = None
    gated: bool = False
    """Whether a :class:`GatedStateful` produced the piece: its mutations can be held until
    an async save has copied it, so the copy may run in the background."""
    replica: tuple[int, int] | None = None
    """``(index, count)`` of this rank among the ranks holding the same box, where that follows
    from global facts (DTensor placements, a plain tensor every rank holds, a per-rank tensor);
    None where it does not (then a first save exchanges plans)."""
    replicated_copy: bool = False
    """A plain tensor: this rank's whole copy of a tensor that every rank holding it must hold
    alike (the save compares the copies: :mod:`tessera.engine.saving.replicas`)."""


@dataclass
class FlatState:
    """A rank's state as tensor pieces and plain values keyed by FQN."""

    tensors: list[TensorPiece] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)
    """Plain values (raw Python objects), treated as identical on every rank."""
    per_rank_values: dict[str, tuple[Any, OnResize]] = field(default_factory=dict)
    """Rank-local plain values with their resize policy."""
    statefuls: list[tuple[Stateful, dict[str, Any]]] = field(default_factory=list)
    """(object, the state dict taken from it), innermost first, for ``load_state_dict``."""
    structures: set[str] = field(default_factory=set)
    """Load: FQNs of dicts without tensors that the checkpoint stores entry by entry (not as one value)."""
    grown: list[tuple[dict[Any, Any], dict[Any, Any]]] = field(default_factory=list)
    """Load: (a dict of the target, entries the checkpoint adds to it once the load succeeded)."""

    def tensor_fqns(self) -> set[str]:
        return {p.fqn for p in self.tensors}

    def keys(self) -> set[str]:
        return self.tensor_fqns() | set(self.values) | set(self.per_rank_values)


def _contains_tensor(value: object, depth: int = 0) -> bool:
    if isinstance(value, (torch.Tensor, ShardedTensor, FlatShard, MultiShard, PerRank)) or is_stateful(value):
        return True
    if isinstance(value, (dict, list, tuple)) and depth >= MAX_DEPTH:
        return False  # a value this deep is refused where it is encoded (or visited), by name
    if isinstance(value, dict):
        return any(_contains_tensor(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_contains_tensor(v, depth + 1) for v in value)
    return False


def _too_deep(fqn: str) -> InvalidStateError:
    return InvalidStateError(
        f"'{fqn}': the state nests containers more than {MAX_DEPTH} levels deep; tessera does not follow such states"
    )


def _step(where: str, key: object) -> str:
    return f"{where}[{key!r}]"


def join(prefix: str, key: object) -> str:
    key = str(key)
    return f"{prefix}.{key}" if prefix else key


def dotted_parents(keys: list[str]) -> set[str]:
    """Every proper dotted prefix of ``keys`` (``a.b.c`` -> ``a``, ``a.b``)."""
    out: set[str] = set()
    for k in keys:
        i = k.find(".")
        while i != -1:
            out.add(k[:i])
            i = k.find(".", i + 1)
    return out


def is_empty_container(encoded: object) -> bool:
    """Whether an encoded plain value (see :mod:`tessera.format.values`) is an empty dict, list or tuple."""
    return encoded in ({}, [], {"__tuple__": []}, {"__dict__": []})


class _Flattener:
    def __init__(self, rank: int, world_size: int, *, for_load: bool, allow_pickle: bool, manifest: object) -> None:
        self.rank = rank
        self.world_size = world_size
        self.for_load = for_load
        self.allow_pickle = allow_pickle
        self.manifest = manifest
        self.out = FlatState()
        self.gated = False  # inside a GatedStateful's state dict
        self.sources: dict[str, str] = {}
        """FQN -> where in the state its entry is (``state['a']['b']``), to name collisions."""
        self.parents: set[str] | None = None
        """Load: every dotted prefix of the checkpoint's keys (computed when first needed)."""
        self.extra: dict[int, dict[Any, Any]] = {}
        """Load: id of a target dict -> entries to visit beside its own (see :mod:`tessera.engine.optim_dict`)."""

    def stored_as_structure(self, value: object, fqn: str) -> bool:
        """Load: whether ``value``, a dict without tensors, is stored entry by entry.

        True when the checkpoint has keys under ``fqn.`` and no value named ``fqn``: the
        saved dict held tensors (an optimizer that had stepped) and the target's does not
        (a fresh one), so its entries are matched by name instead of as one value.
        """
        m = self.manifest
        if not self.for_load or m is None or not fqn or not isinstance(value, dict):
            return False
        if fqn in m.values or fqn in m.per_rank or fqn in m.tensors:  # type: ignore[attr-defined]
            return False
        if self.parents is None:
            self.parents = dotted_parents(list(m.keys()))  # type: ignore[attr-defined]
        return fqn in self.parents

    def claim(self, fqn: str, where: str) -> None:
        """Record that the entry at ``where`` is named ``fqn``; refuse a second entry of that name."""
        first = self.sources.setdefault(fqn, where)
        if first != where:
            raise InvalidStateError(
                f"two entries of the state have the same name '{fqn}': {first} and {where}. "
                "Names join nested keys with dots, so rename one of them"
            )

    def visit(
        self,
        value: object,
        fqn: str,
        per_rank: OnResize | None,
        *,
        container: bool = False,
        where: str = "state",
        depth: int = 0,
    ) -> None:
        if depth > MAX_DEPTH:
            raise _too_deep(fqn)
        if isinstance(value, PerRank):
            if per_rank is not None:
                raise InvalidStateError(f"'{fqn}': per_rank() values cannot be nested")
            self.visit(value.value, fqn, value.on_resize, where=where, depth=depth + 1)
        elif isinstance(value, torch.Tensor):
            self.claim(fqn, where)
            self.tensor(value, fqn, per_rank)
        elif isinstance(value, (ShardedTensor, FlatShard)):
            if per_rank is not None:
                raise InvalidStateError(
                    f"'{fqn}': a {type(value).__name__} cannot be per_rank(); it already names its box"
                )
            self.claim(fqn, where)
            self.shard(value, fqn)
        elif isinstance(value, MultiShard):
            if per_rank is not None:
                raise InvalidStateError(f"'{fqn}': a MultiShard cannot be per_rank(); it already names its boxes")
            self.claim(fqn, where)
            for s in value.shards:
                self.shard(s, fqn)
        elif is_stateful(value) and not isinstance(value, type):
            if self.for_load and self.manifest is not None and isinstance(value, PreparesLoad):
                # Lets e.g. a fresh optimizer create state of the shapes the checkpoint holds.
                value.prepare_load(self.manifest, fqn)
            sd = value.state_dict()
            if not isinstance(sd, dict):
                raise InvalidStateError(
                    f"'{fqn}': {type(value).__name__}.state_dict() returned {type(sd).__name__}, not a dict"
                )
            # A state dict is a structure, not a value: its keys are names even when it holds
            # no tensor (a fresh optimizer saves the same keys as a trained one, minus state).
            outer, self.gated = self.gated, self.gated or isinstance(value, GatedStateful)
            try:
                self.visit(sd, fqn, per_rank, container=True, where=f"{where}.state_dict()", depth=depth + 1)
            finally:
                self.gated = outer
            self.out.statefuls.append((value, sd))
        elif isinstance(value, (dict, list, tuple)) and (
            container or _contains_tensor(value) or not fqn or self.stored_as_structure(value, fqn)
        ):
            if isinstance(value, dict) and not container and not _contains_tensor(value) and fqn:
                self.out.structures.add(fqn)
            if self.for_load and self.manifest is not None and is_optimizer_state_dict(value):
                grown = missing_param_states(value, fqn, self.manifest)  # type: ignore[arg-type]
                if grown:
                    self.extra[id(value["state"])] = grown
                    self.out.grown.append((value["state"], grown))
            items: Any = value.items() if isinstance(value, dict) else enumerate(value)
            if isinstance(value, dict) and id(value) in self.extra:
                items = [*items, *self.extra[id(value)].items()]
            seen: set[str] = set()
            for k, v in items:
                if not isinstance(k, (str, int)):
                    raise InvalidStateError(f"'{fqn}': key {k!r} must be a str or int to form a tensor name")
                name = join(fqn, k)
                if name in seen:
                    raise InvalidStateError(f"two keys of '{fqn}' map to the same name '{name}' ({where})")
                seen.add(name)
                self.visit(v, name, per_rank, where=_step(where, k), depth=depth + 1)
        else:
            self.claim(fqn, where)
            self.plain(value, fqn, per_rank)

    def plain(self, value: object, fqn: str, per_rank: OnResize | None) -> None:
        if not fqn:
            raise InvalidStateError("the state must be a dict (or an object with state_dict()), not a plain value")
        if not self.for_load:
            encode_value(value, fqn, allow_pickle=self.allow_pickle)  # validate before any I/O
        else:
            check_depth(value, fqn)
        if per_rank is not None:
            self.out.per_rank_values[fqn] = (value, per_rank)
        else:
            self.out.values[fqn] = value

    def tensor(self, t: torch.Tensor, fqn: str, per_rank: OnResize | None) -> None:
        if t.is_meta:
            raise InvalidStateError(f"tensor '{fqn}' is on the meta device and has no data; materialize it first")
        if t.is_sparse or (t.layout != torch.strided and not _torch_private.is_dtensor(t)):
            raise InvalidStateError(f"tensor '{fqn}' has layout {t.layout}; only dense (strided) tensors can be stored")
        if t.is_quantized:
            raise InvalidStateError(f"tensor '{fqn}' is quantized; dequantize it before saving")
        dtype_name(t.dtype)
        if _torch_private.is_dtensor(t):
            if per_rank is not None:
                raise InvalidStateError(f"'{fqn}': a DTensor cannot be per_rank()")
            box = _torch_private.dtensor_local_box(t, fqn)
            local = _torch_private.local_tensor(t).detach()  # shares memory: loads still fill the DTensor
            replica = _torch_private.dtensor_replica(t, self.world_size)
            self.add(TensorPiece(fqn, tuple(t.shape), t.dtype, box, local, replica=replica))
            return
        data = t.detach()
        if per_rank is not None:
            shape = (self.world_size, *t.shape)
            box = Box((self.rank,) + (0,) * t.dim(), (1, *t.shape))
            self.add(TensorPiece(fqn, shape, t.dtype, box, data.unsqueeze(0), per_rank=per_rank, replica=(0, 1)))
            return
        # A plain tensor is taken as replicated on every rank (DDP); if some ranks lack it, their
        # tensor tables differ and the save exchanges plans instead.
        whole = TensorPiece(
            fqn,
            tuple(t.shape),
            t.dtype,
            Box.whole(t.shape),
            data,
            replica=(self.rank, self.world_size),
            replicated_copy=True,
        )
        self.add(whole)

    def shard(self, s: ShardedTensor | FlatShard, fqn: str) -> None:
        local = s.local if isinstance(s, ShardedTensor) else s.local_1d
        dtype_name(local.dtype)
        if isinstance(s, ShardedTensor):
            self.add(TensorPiece(fqn, s.global_shape, local.dtype, s.box, local.detach()))
            return
        flat = (s.flat_start, s.flat_stop)
        pieces = s.pieces()
        if not pieces:  # an empty range still declares the tensor on this rank
            empty = Box((0,) * len(s.global_shape), (0,) * len(s.global_shape))
            pieces = [(empty, local.detach()[:0].view(empty.lengths))] if s.global_shape else []
        for box, view in pieces:
            self.add(TensorPiece(fqn, s.global_shape, local.dtype, box, view.detach(), flat=flat))

    def add(self, piece: TensorPiece) -> None:
        if self.gated:
            piece = replace(piece, gated=True)
        self.out.tensors.append(piece)


def flatten(
    state: object,
    *,
    rank: int = 0,
    world_size: int = 1,
    for_load: bool = False,
    allow_pickle: bool = False,
    manifest: object = None,
) -> FlatState:
    """Flatten ``state`` into tensor pieces and plain values keyed by FQN.

    For a save, plain values are validated (pickle opt-in) here, before any rank writes.
    For a load, Stateful objects' ``state_dict()`` results are kept so that
    :func:`restore_values` can fill them and hand them back; a Stateful with a
    ``prepare_load(manifest, fqn)`` method is first shown the checkpoint's ``manifest``.

    Raises:
        InvalidStateError: if two entries have the same FQN (naming both), or the state
            nests too deeply.
        TypeError, ValueError: for values tessera cannot store, naming the FQN.
    """
    f = _Flattener(rank, world_size, for_load=for_load, allow_pickle=allow_pickle, manifest=manifest)
    if not isinstance(state, dict) and not is_stateful(state):
        raise InvalidStateError(
            f"state must be a dict or an object with state_dict()/load_state_dict(), got {type(state).__name__}"
        )
    try:
        f.visit(state, "", None)
    except RecursionError:  # e.g. a Stateful whose state_dict() nests deeply in its own way
        raise InvalidStateError(f"the state nests too deeply to flatten (more than {MAX_DEPTH} levels)") from None
    return f.out


def restore_values(state: object, flat: FlatState, lookup: Callable[[str], tuple[bool, Any]]) -> None:
    """Put loaded plain values back into ``state`` and hand Stateful objects their state.

    ``lookup(fqn)`` returns ``(found, value)``. Dicts and lists are updated in place, tuples
    are rebuilt in their parent; then every Stateful gets ``load_state_dict`` with the state
    dict it produced during :func:`flatten` (now filled), innermost first.
    """
    stateful_sds = {id(obj): sd for obj, sd in flat.statefuls}
    filled: dict[int, dict[str, Any]] = {}
    for target, entries in flat.grown:  # filled by the reads, which all succeeded
        target.update(entries)

    def rebuild(value: object, fqn: str, container: bool = False) -> object:
        if isinstance(value, PerRank):
            return PerRank(rebuild(value.value, fqn), value.on_resize)
        if isinstance(value, (torch.Tensor, ShardedTensor, FlatShard, MultiShard)):
            return value
        if is_stateful(value) and not isinstance(value, type):
            sd = stateful_sds.get(id(value))
            if sd is not None:
                filled[id(value)] = rebuild(sd, fqn, container=True)  # type: ignore[assignment]  # a dict in, the same dict out
            return value
        if isinstance(value, (dict, list, tuple)) and (
            container or _contains_tensor(value) or not fqn or fqn in flat.structures
        ):
            if isinstance(value, dict):
                for k in list(value):
                    value[k] = rebuild(value[k], join(fqn, k))
                return value
            if isinstance(value, list):
                for i in range(len(value)):
                    value[i] = rebuild(value[i], join(fqn, i))
                return value
            items: list[Any] = [rebuild(v, join(fqn, i)) for i, v in enumerate(value)]
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        found, loaded = lookup(fqn)
        return loaded if found else value

    rebuild(state, "")
    for obj, sd in flat.statefuls:
        obj.load_state_dict(filled.get(id(obj), sd))
