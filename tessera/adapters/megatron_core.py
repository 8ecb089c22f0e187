"""Megatron-Core sharded state dicts, saved and loaded natively by tessera.

Megatron-Core describes what each rank holds with ``model.sharded_state_dict()`` (and the
optimizer's ``sharded_state_dict(model_sharded_state_dict)``): a nested dict whose leaves
are ``dist_checkpointing.mapping`` objects. They map onto tessera's geometry one to one:

============================  =========================================================
Megatron-Core                 tessera
============================  =========================================================
``ShardedTensor``             a :class:`~tessera.ShardedTensor` box of the global tensor
                              named by its ``key`` (``global_offset``, ``local_shape``,
                              ``global_shape``; ``prepend_axis_num`` leading axes of
                              length 1, e.g. the layer or expert index)
several ``ShardedTensor`` s   one :class:`~tessera.shards.MultiShard` (SwiGLU ``linear_fc1``:
of one key on a rank          its gate rows and its up rows)
``ShardedTensor`` with        a :class:`~tessera.FlatShard` when the local chunk is contiguous
``flattened_range``           in the global tensor (megatron-core < 0.14 distributed
                              optimizer); otherwise an error
``allow_shape_mismatch``      on load, the target is zeroed and the saved overlap is read
``replica_id``                only main replicas (``replica_id`` all 0) are saved, as Megatron does
``ShardedObject``             a value named by its ``unique_key`` (``key/shard_<off>_<shape>``)
``ShardedTensorFactory``      built on save (``build()``), merged on load (``merge_fn``)
``LocalNonpersistentObject``  not saved; on load the local object is returned
anything else                 the common part: one value ``common`` (rank 0's)
============================  =========================================================

Checkpoint tensor names are Megatron's keys (``decoder.layers.self_attention.linear_qkv.weight``,
``optimizer.state.exp_avg.decoder.layers...``), the same names a ``torch_dist`` checkpoint
uses, so a converted ``torch_dist`` checkpoint and a natively saved one load the same way.
Loading into another TP / PP / DP / EP layout works because the target's sharded state dict
describes the boxes it wants; nothing about the saving layout is needed.

Distributed contract: :func:`save_sharded_state_dict`, :func:`load_sharded_state_dict` and
``tessera.save``/``tessera.load`` of a :class:`MegatronCoreState` are collective over the
process group, each rank passing its own sharded state dict; the pure functions
:func:`to_tessera_state` / :func:`from_tessera_state` do no communication.

Example:
    >>> from tessera.adapters.megatron_core import save_sharded_state_dict, load_sharded_state_dict
    >>> save_sharded_state_dict("/ckpt/step100", {"model": model.sharded_state_dict(), "iteration": 100})
    >>> sd = load_sharded_state_dict("/ckpt/step100", {"model": model.sharded_state_dict(), "iteration": 0})
    >>> model.load_state_dict(sd["model"])
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ..api import load, read_manifest, save
from ..errors import CheckpointError
from ..options import LoadOptions, SaveOptions
from ..results import LoadResult, SaveResult
from ..storage import Storage
from .megatron_core_mapping import (
    COMMON_KEY,
    TORCH_SAVE,
    TORCH_SAVE_FIRST,
    Conversion,
    from_tessera_state,
    to_tessera_state,
)

logger = logging.getLogger(__name__)

__all__ = [
    "COMMON_KEY",
    "TORCH_SAVE",
    "TORCH_SAVE_FIRST",
    "MegatronCoreState",
    "from_tessera_state",
    "load_sharded_state_dict",
    "save_sharded_state_dict",
    "to_tessera_state",
]

# ---------------------------------------------------------------------------------------
# Entry points.


def save_sharded_state_dict(
    path: str,
    sharded_state_dict: Mapping[str, Any],
    *,
    process_group: Any = None,
    storage: Storage | None = None,
    allow_pickle: bool = False,
    options: SaveOptions | None = None,
    storage_options: dict[str, Any] | None = None,
) -> SaveResult:
    """Save a Megatron-Core sharded state dict with ``tessera.save``; collective.

    Every rank of ``process_group`` calls it with its own sharded state dict (model and
    optimizer together, plus any plain values such as ``iteration``). Boxes held by
    several ranks are written once, by the main replica (``replica_id`` all 0), as in Megatron.

    Args:
        path: checkpoint directory or URL.
        sharded_state_dict: e.g. ``{"model": model.sharded_state_dict(),
            "optimizer": optimizer.sharded_state_dict(model_ssd), "iteration": 100}``.
        process_group, storage, options, storage_options: as for :func:`tessera.save`.
        allow_pickle: store objects that only unpickling restores (tensors, numbers,
            strings and containers of them never need it).

    Returns:
        This rank's :class:`~tessera.SaveResult`.

    Raises:
        PickleNotAllowedError: an object needs pickle and ``allow_pickle`` is False.
        StateMismatchError: keys that collide on this rank, or inconsistent tensor descriptions.

    Example:
        >>> save_sharded_state_dict("/ckpt/step100", {"model": model.sharded_state_dict()})
    """
    state, _ = to_tessera_state(sharded_state_dict, allow_pickle=allow_pickle)
    return save(path, state, process_group=process_group, storage=storage, options=options,
                storage_options=storage_options)  # fmt: skip


def load_sharded_state_dict(
    path: str,
    sharded_state_dict: Mapping[str, Any],
    *,
    strict: bool = True,
    process_group: Any = None,
    storage: Storage | None = None,
    allow_pickle: bool = False,
    cast_dtypes: bool = False,
    options: LoadOptions | None = None,
    storage_options: dict[str, Any] | None = None,
    result: list[LoadResult] | None = None,
) -> dict[str, Any]:
    """Load a checkpoint into a Megatron-Core sharded state dict; collective.

    The counterpart of ``megatron.core.dist_checkpointing.load``: each rank passes the
    sharded state dict of its *current* layout (any TP / PP / DP / EP) and gets back a state
    dict of the same structure with loaded tensors, ready for ``model.load_state_dict`` and
    ``optimizer.load_state_dict``. Tensors with data are filled in place (model parameters
    too); ``allow_shape_mismatch`` tensors (padded vocabularies) are zeroed and the saved
    overlap is read.

    Args:
        path: a tessera checkpoint saved by :func:`save_sharded_state_dict`, or converted
            from Megatron's ``torch_dist`` format by
            :func:`tessera.convert.megatron.import_torch_dist`.
        sharded_state_dict: what this rank wants, e.g. ``{"model": model.sharded_state_dict()}``.
        strict: tensors, objects or common values the checkpoint lacks are an error.
        process_group, storage, cast_dtypes, options, storage_options: as for :func:`tessera.load`.
        allow_pickle: allow objects that only unpickling restores.
        result: if given, the :class:`~tessera.LoadResult` is appended to it.

    Returns:
        The loaded state dict.

    Raises:
        MissingKeysError: with ``strict``, keys the checkpoint lacks.
        StateMismatchError: shapes or dtypes that do not match the checkpoint.

    Example:
        >>> sd = load_sharded_state_dict("/ckpt/step100", {"model": model.sharded_state_dict()})
        >>> model.load_state_dict(sd["model"])
    """
    # Every rank reads the (small) manifest: saved shapes of padded vocabularies, and
    # whether the checkpoint has a common part (a converted torch_dist one may not).
    manifest = read_manifest(path, storage=storage, storage_options=storage_options)
    state, conv = to_tessera_state(
        sharded_state_dict, for_load=True, saved_shapes={k: tuple(e.shape) for k, e in manifest.tensors.items()},
        saved_common=COMMON_KEY in manifest.values,
    )  # fmt: skip
    res = load(path, state, strict=strict, process_group=process_group, storage=storage, allow_pickle=allow_pickle,
               cast_dtypes=cast_dtypes, options=options, storage_options=storage_options)  # fmt: skip
    if result is not None:
        result.append(res)
    return from_tessera_state(state, conv, allow_pickle=allow_pickle)


class MegatronCoreState:
    """A Stateful that saves and loads a Megatron-Core model (and optimizer) through tessera.

    Put it in a tessera state like any model: ``tessera.save(path, {"mcore": MegatronCoreState(model, opt)})``.
    The sharded state dicts are taken when the save or load runs, so the same object
    serves every step. Checkpoint names are the Megatron keys under the state's key.

    Args:
        model: a Megatron-Core module (or list of virtual-pipeline chunks) with
            ``sharded_state_dict()``.
        optimizer: a Megatron-Core optimizer with ``sharded_state_dict(model_sharded_state_dict,
            is_loading=...)``, or None.
        metadata: passed to both ``sharded_state_dict`` calls (e.g.
            ``{"distrib_optim_sharding_type": "fully_reshardable"}``).
        allow_pickle: see :func:`save_sharded_state_dict`.

    Example:
        >>> tessera.save("/ckpt/step100", {"mcore": MegatronCoreState(model, optimizer), "iteration": 100})
    """

    def __init__(self, model: Any, optimizer: Any = None, *, metadata: dict[str, Any] | None = None,
                 allow_pickle: bool = False) -> None:  # fmt: skip
        self.model = model
        self.optimizer = optimizer
        self.metadata = dict(metadata or {})
        self.allow_pickle = allow_pickle
        self._pending: tuple[dict[str, Any], Conversion] | None = None

    def _sharded(self, is_loading: bool) -> dict[str, Any]:
        chunks = self.model if isinstance(self.model, list) else [self.model]
        sds = [_model_sharded(chunk, self.metadata) for chunk in chunks]
        # Virtual pipeline chunks hold distinct layers; their keys never collide.
        model_sd: dict[str, Any] = sds[0] if len(sds) == 1 else {f"model{i}": sd for i, sd in enumerate(sds)}
        out: dict[str, Any] = {"model": model_sd}
        if self.optimizer is not None:
            out["optimizer"] = self.optimizer.sharded_state_dict(
                model_sd, is_loading=is_loading, metadata=self.metadata
            )
        return out

    def state_dict(self) -> dict[str, Any]:
        """The tessera state (save: values; for a load, :meth:`prepare_load` set targets)."""
        if self._pending is not None:
            return self._pending[0]
        state, _ = to_tessera_state(self._sharded(False), allow_pickle=self.allow_pickle)
        return state

    def prepare_load(self, manifest: Any, fqn: str) -> None:
        """Called by ``tessera.load`` before :meth:`state_dict`: build load targets."""
        prefix = f"{fqn}." if fqn else ""
        shapes = {k[len(prefix) :]: tuple(e.shape) for k, e in manifest.tensors.items() if k.startswith(prefix)}
        self._pending = to_tessera_state(
            self._sharded(True), for_load=True, saved_shapes=shapes, saved_common=prefix + COMMON_KEY in manifest.values
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Hand the loaded tensors and values to the model and optimizer."""
        if self._pending is None:
            raise CheckpointError("MegatronCoreState.load_state_dict called without a tessera.load")
        _, conv = self._pending
        self._pending = None
        loaded = from_tessera_state(state, conv, allow_pickle=self.allow_pickle)
        chunks = self.model if isinstance(self.model, list) else [self.model]
        for i, chunk in enumerate(chunks):
            chunk.load_state_dict(loaded["model"] if len(chunks) == 1 else loaded["model"][f"model{i}"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(loaded["optimizer"])


def _model_sharded(chunk: Any, metadata: dict[str, Any]) -> dict[str, Any]:
    return chunk.sharded_state_dict(metadata=metadata) if metadata else chunk.sharded_state_dict()
