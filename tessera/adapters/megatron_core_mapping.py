"""Megatron-Core sharded state dicts <-> tessera state: the pure mapping, no communication.

:func:`to_tessera_state` turns a rank's sharded state dict (``dist_checkpointing.mapping``
leaves) into tessera values and load targets; :func:`from_tessera_state` turns loaded values
back into the sharded state dict Megatron expects. The table of what maps to what, and the
collective entry points, are in :mod:`tessera.adapters.megatron_core`.
"""

from __future__ import annotations

import argparse
import io
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CheckpointError, PickleNotAllowedError, StateMismatchError
from ..format.values import is_plain
from ..shards import FlatShard, MultiShard, ShardedTensor

COMMON_KEY = "common"
"""The value holding the common (non-sharded) part of a sharded state dict, like Megatron's common.pt."""
TORCH_SAVE = "__torch_save__"
"""Tag of an object stored as ``torch.save`` bytes (``{TORCH_SAVE: bytes}``)."""
TORCH_SAVE_FIRST = "__torch_save_first__"
"""Tag of an object stored as ``torch.save([obj])`` bytes, as ``torch_dist`` stores sharded objects."""


def _mapping() -> Any:
    try:
        from megatron.core.dist_checkpointing import mapping
    except ImportError as e:  # pragma: no cover - exercised only without megatron-core
        raise ImportError(
            "tessera.adapters.megatron_core needs megatron-core (pip install 'tessera[interop]' or megatron-core)"
        ) from e
    return mapping


# ---------------------------------------------------------------------------------------
# Objects: plain values inline, anything else through torch.save bytes.


def _torch_load(data: bytes, allow_pickle: bool) -> object:
    # Megatron-LM's common.pt holds its ``args``: an argparse.Namespace only sets
    # attributes, so it is allowed without pickle (what it holds is still checked).
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(io.BytesIO(data), weights_only=not allow_pickle, map_location="cpu")


def _encode_object(obj: object, name: str, allow_pickle: bool) -> object:
    if is_plain(obj):
        return obj
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    if not allow_pickle:
        try:
            _torch_load(data, allow_pickle=False)
        except Exception as e:
            raise PickleNotAllowedError(
                f"Megatron object '{name}' ({type(obj).__qualname__}) holds objects that only unpickling can "
                f"restore ({e}); pass allow_pickle=True to save and load if you trust the checkpoint's readers"
            ) from e
    return {TORCH_SAVE: data}


def _decode_object(value: object, name: str, allow_pickle: bool) -> object:
    if isinstance(value, dict) and len(value) == 1 and isinstance(next(iter(value.values())), bytes):
        ((tag, data),) = value.items()
        if tag not in (TORCH_SAVE, TORCH_SAVE_FIRST):
            return value
        try:
            obj = _torch_load(data, allow_pickle)
        except Exception as e:
            if allow_pickle:
                raise
            raise PickleNotAllowedError(
                f"Megatron object '{name}' needs unpickling to load ({e}); pass allow_pickle=True if you trust "
                "the checkpoint"
            ) from e
        if tag == TORCH_SAVE_FIRST:
            if not isinstance(obj, list) or len(obj) != 1:
                raise CheckpointError(
                    f"Megatron object '{name}': expected a one-element list, got {type(obj).__name__}"
                )
            return obj[0]
        return obj
    return value


# ---------------------------------------------------------------------------------------
# Megatron sharded state dict <-> tessera state.


@dataclass
class Conversion:
    """How a tessera state built from a sharded state dict maps back to it (load side)."""

    sharded: Any = None
    """The sharded part (factories built, non-persistent objects removed), a copy of the structure."""
    nonpersistent: Any = None
    """``LocalNonpersistentObject`` values, unwrapped."""
    factories: Any = None
    """The ``ShardedTensorFactory`` objects, for their ``merge_fn``."""
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)
    """id(megatron ShardedTensor) -> the local tensor that the load fills."""
    objects: dict[int, str] = field(default_factory=dict)
    """id(megatron ShardedObject) -> its checkpoint name."""
    has_common: bool = False


def _tensor_shard(st: Any, data: torch.Tensor, global_shape: tuple[int, ...]) -> ShardedTensor | FlatShard | None:
    """The tessera shard of Megatron ShardedTensor ``st`` holding ``data`` (None: empty)."""
    p = st.prepend_axis_num
    offset = tuple(int(o) for o in st.global_offset)
    local_shape = (1,) * p + tuple(int(s) for s in st.local_shape)
    if st.flattened_range is None:
        view = data[(None,) * p] if p else data
        if tuple(view.shape) != local_shape:
            raise StateMismatchError(
                f"Megatron tensor '{st.key}': data of shape {list(data.shape)} does not match local_shape "
                f"{list(st.local_shape)}"
            )
        return ShardedTensor(view, global_shape, offset)
    # megatron-core < 0.14: a flat slice of the local chunk. It is one flat range of the
    # global tensor only when the chunk is contiguous in the global row-major order (it
    # spans every dimension after its first one longer than 1).
    rng = st.flattened_range
    first = next((d for d, n in enumerate(local_shape) if n > 1), len(local_shape))
    if any(local_shape[d] != global_shape[d] for d in range(first + 1, len(local_shape))):
        raise StateMismatchError(
            f"Megatron tensor '{st.key}': flattened_range {rng} of a local chunk {list(local_shape)} at offset "
            f"{list(offset)} in {list(global_shape)} is not one contiguous range of the global tensor; save "
            "the distributed optimizer in the 'fully_reshardable' format instead"
        )
    strides = [math.prod(global_shape[d + 1 :]) for d in range(len(global_shape))]
    chunk_start = sum(o * s for o, s in zip(offset, strides))
    flat = data.reshape(-1)
    if flat.numel() != rng.stop - rng.start:
        raise StateMismatchError(
            f"Megatron tensor '{st.key}': flattened_range {rng} but data holds {flat.numel()} elements"
        )
    return FlatShard(flat, global_shape, chunk_start + rng.start) if flat.numel() else None


def to_tessera_state(
    sharded_state_dict: Mapping[str, Any],
    *,
    for_load: bool = False,
    allow_pickle: bool = False,
    saved_shapes: Mapping[str, tuple[int, ...]] | None = None,
    saved_common: bool = True,
) -> tuple[dict[str, Any], Conversion]:
    """The flat tessera state of a Megatron-Core sharded state dict.

    The dict is preprocessed exactly as ``megatron.core.dist_checkpointing`` does
    (``save_preprocess`` / ``load_preprocess``: factories built, non-persistent objects
    set aside, the common part split off); the caller's dict is not modified.

    Args:
        sharded_state_dict: as returned by ``model.sharded_state_dict()`` (any nesting,
            several models and optimizers together, plain values such as ``iteration``).
        for_load: build load targets: tensors whose ``data`` is None are allocated,
            objects and the common part become placeholders.
        allow_pickle: allow objects that only unpickling restores (save side).
        saved_shapes: checkpoint name -> global shape, for ``allow_shape_mismatch``
            tensors (padded vocabularies) whose saved shape differs: their target is
            zeroed and the overlap is read.
        saved_common: (load) whether the checkpoint has a common part to load.

    Returns:
        ``(state, conversion)``: pass ``state`` to ``tessera.save``/``tessera.load``; after
        a load, ``from_tessera_state(state, conversion)`` gives the loaded state dict.

    Raises:
        StateMismatchError: a tensor whose data does not match its description, or a
            name used by both a tensor and an object.

    Example:
        >>> state, conv = to_tessera_state(model.sharded_state_dict(), for_load=True)
        >>> tessera.load(path, state)
        >>> model.load_state_dict(from_tessera_state(state, conv))
    """
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values, nested_values
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
    from megatron.core.dist_checkpointing.utils import extract_nonpersistent, extract_sharded_base

    m = _mapping()
    if not isinstance(sharded_state_dict, Mapping):
        raise TypeError(f"a Megatron sharded state dict must be a dict, got {type(sharded_state_dict).__name__}")
    conv = Conversion()
    state: dict[str, Any] = {}
    if for_load:
        sharded, conv.nonpersistent, conv.factories = load_preprocess(dict(sharded_state_dict))
        sharded, _ = extract_sharded_base(sharded)
        conv.has_common = saved_common
        if saved_common:
            state[COMMON_KEY] = None
    else:
        sharded, _ = extract_matching_values(dict(sharded_state_dict), lambda x: True)  # a copy of the structure
        m.apply_factories(sharded)
        _, sharded = extract_nonpersistent(sharded)
        sharded, common = extract_sharded_base(sharded)
        state[COMMON_KEY] = _encode_object(common, COMMON_KEY, allow_pickle)
    conv.sharded = sharded

    shards: dict[str, list[ShardedTensor | FlatShard]] = {}
    for x in nested_values(sharded):
        if not for_load and isinstance(x, (m.ShardedTensor, m.ShardedObject)) and not m.is_main_replica(x.replica_id):
            # As Megatron does: only the main replica is written. Replicas are meant to be
            # equal, but e.g. TP-replicated layer norms may drift apart in the last bits;
            # the main replica is the one Megatron's own checkpoint would hold.
            continue
        if isinstance(x, m.ShardedTensor):
            if x.data is None:
                if not for_load:
                    raise StateMismatchError(f"Megatron tensor '{x.key}' has no data to save")
                x.init_data("cpu", init_fn=torch.zeros if x.allow_shape_mismatch else torch.empty)
            data = x.data.detach()
            conv.tensors[id(x)] = data
            shape = tuple(int(s) for s in x.global_shape)
            saved = tuple(saved_shapes[x.key]) if saved_shapes and x.key in saved_shapes else shape
            if for_load and x.allow_shape_mismatch and saved != shape:
                data.zero_()  # padding rows the checkpoint does not have
                shard: ShardedTensor | FlatShard | None = _overlap_shard(x, data, saved)
            else:
                shard = _tensor_shard(x, data, shape)
            # A rank may hold several boxes of one tensor (SwiGLU fc1: its gate rows and up rows).
            if shard is not None:
                shards.setdefault(x.key, []).append(shard)
        elif isinstance(x, m.ShardedObject):
            name = x.unique_key
            if name in state:
                raise StateMismatchError(f"Megatron object '{name}' appears twice in this rank's sharded state dict")
            conv.objects[id(x)] = name
            state[name] = None if for_load else _encode_object(x.data, name, allow_pickle)
    for name, pieces in shards.items():
        if name in state:
            raise StateMismatchError(f"Megatron sharded state dict: '{name}' names both a tensor and an object")
        state[name] = pieces[0] if len(pieces) == 1 else MultiShard(pieces)
    return state, conv


def _overlap_shard(st: Any, data: torch.Tensor, saved: tuple[int, ...]) -> ShardedTensor | None:
    """The part of ``st``'s box inside a saved tensor of another shape (padded vocabularies)."""
    p = st.prepend_axis_num
    view = data[(None,) * p] if p else data
    if len(saved) != view.dim():
        raise StateMismatchError(
            f"Megatron tensor '{st.key}': saved with {len(saved)} dimensions {list(saved)}, the target has "
            f"{view.dim()} ({list(st.global_shape)})"
        )
    offset = tuple(int(o) for o in st.global_offset)
    for d, (o, n) in enumerate(zip(offset, view.shape)):
        keep = max(0, min(n, saved[d] - o))
        if keep == 0:
            return None
        view = view.narrow(d, 0, keep)
    return ShardedTensor(view, saved, offset)


def from_tessera_state(
    state: Mapping[str, Any], conversion: Conversion, *, allow_pickle: bool = False
) -> dict[str, Any]:
    """The loaded state dict, as ``megatron.core.dist_checkpointing.load`` returns it.

    The checkpoint's common part, merged with the loaded tensors and objects and the
    local non-persistent objects; factories are merged back with their ``merge_fn``.

    Example:
        >>> model.load_state_dict(from_tessera_state(state, conv))
    """
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge

    m = _mapping()

    def loaded(x: object) -> object:
        if isinstance(x, m.ShardedTensor):
            return conversion.tensors[id(x)]
        if isinstance(x, m.ShardedObject):
            name = conversion.objects[id(x)]
            return _decode_object(state.get(name), name, allow_pickle)
        return x

    sharded = conversion.sharded
    dict_list_map_inplace(loaded, sharded)
    common = _decode_object(state.get(COMMON_KEY), COMMON_KEY, allow_pickle) if conversion.has_common else {}
    if not isinstance(common, dict):
        raise StateMismatchError(f"the checkpoint's '{COMMON_KEY}' value is a {type(common).__name__}, not a dict")
    merge(common, conversion.nonpersistent)
    merge(common, sharded)
    out = m.apply_factory_merges(common, conversion.factories)
    assert isinstance(out, dict)
    return out
