"""FSDP1 (``FullyShardedDataParallel``): each original parameter's range of a flat shard.

FSDP1 keeps the parameters of a unit in one flat 1-D parameter and gives each rank a
contiguous range of it, cutting through the middle of parameters and rows. torch's
public sharded state dict for FSDP1 all-gathers every flat parameter to re-chunk it; here
each original parameter's piece of the rank's shard becomes a :class:`tessera.FlatShard`
(a view, no copy, no communication), which tessera stores as at most ``2 * ndim - 1``
boxes. Padding inside the flat parameter belongs to no FQN and is never saved.

With ``use_orig_params=False`` the optimizer steps the flat parameter, so its states are
flat too and are cut the same way. With ``use_orig_params=True`` it steps the original
parameters, which FSDP1 makes 1-D views of exactly the elements the rank holds (empty
where the rank holds none): their states are one flat range each.
"""

from __future__ import annotations

from torch import nn

from . import _torch_compat
from .views import ParamEntry, ParamView, ViewKind


def fsdp1_entries(model: nn.Module) -> tuple[list[ParamEntry], dict[int, ParamEntry]]:
    """The FSDP1 flat parameters of ``model`` as entries, and its original parameters.

    Returns:
        ``(flat_entries, orig_entries)``: one entry per flat parameter with one view per
        original FQN (for the model state and for optimizers over flat parameters), and,
        for units with ``use_orig_params=True``, the entry of each original parameter by
        ``id`` (what optimizers over original parameters hold). Both are empty without
        FSDP1.
    """
    flat_entries: list[ParamEntry] = []
    orig_entries: dict[int, ParamEntry] = {}
    for unit in _torch_compat.fsdp1_units(model):
        prefix = _torch_compat.clean_fqn(unit.module_name)
        views = []
        for piece in unit.pieces:
            fqn = f"{prefix}.{piece.fqn}" if prefix else piece.fqn
            view = ParamView(
                fqn, piece.shape, ViewKind.FLAT, start=piece.offset, numel=piece.numel, flat_start=piece.flat_start
            )
            views.append(view)
            if piece.orig_param is not None:
                orig_view = ParamView(
                    fqn, piece.shape, ViewKind.FLAT, start=0, numel=piece.numel, flat_start=piece.flat_start
                )
                orig_entries[id(piece.orig_param)] = ParamEntry(piece.orig_param, (orig_view,))
        flat_entries.append(ParamEntry(unit.flat_param, tuple(views)))
    return flat_entries, orig_entries


def stepped_in_place_of(model: nn.Module) -> dict[int, list[object]]:
    """For each flat parameter of a ``use_orig_params=True`` unit (by ``id``), the original
    parameters an optimizer steps instead of it: its memory changes exactly when theirs does."""
    return {
        id(unit.flat_param): [p.orig_param for p in unit.pieces]
        for unit in _torch_compat.fsdp1_units(model)
        if unit.pieces and all(p.orig_param is not None for p in unit.pieces)
    }
