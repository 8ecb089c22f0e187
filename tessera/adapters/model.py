"""``ModelState``: a model's parameters and buffers by clean FQN, under any framework.

Each parameter (or FSDP1 flat parameter, or buffer) is a :class:`ParamEntry`: the tensor
the framework holds, and one :class:`ParamView` per original FQN that says which part of
the global tensor that memory is. The views describe only geometry, so the optimizer
adapter wraps an ``exp_avg`` exactly like its parameter. Nothing here communicates or
materializes a full tensor: every value handed to tessera aliases the live memory, which
is why a load fills the model in place.

Frameworks: plain modules, DDP (``module.`` is dropped), ``torch.compile`` (``_orig_mod.``),
FSDP2 and tensor parallel (DTensors, ``_StridedShard`` from FSDP2 over TP included) and
FSDP1 (each original parameter's range of the flat shard, see :mod:`.fsdp1`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .. import _torch_private
from ..errors import MissingKeysError, StateMismatchError
from ..format.geometry import Box
from . import _torch_compat
from ._forward_writes import forward_writes
from ._gate import StagingGate, held_by_step
from .fsdp1 import fsdp1_entries, stepped_in_place_of
from .views import ParamEntry, ParamView, ViewKind

logger = logging.getLogger(__name__)


def unwrap(model: nn.Module) -> nn.Module:
    """The module whose FQNs are the checkpoint's: DDP and torch.compile wrappers removed."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel) or type(model).__name__ == "DataParallel":
            inner: object = model.module
        else:
            inner = _torch_compat.compiled_inner(model)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def _as_modules(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    if isinstance(model, nn.Module):
        return [unwrap(model)]
    mods = [unwrap(m) for m in model]
    if not mods or not all(isinstance(m, nn.Module) for m in mods):
        raise TypeError("model must be an nn.Module or a non-empty sequence of them (pipeline stages)")
    return mods


def tensor_entry(t: torch.Tensor, fqn: str, *, is_buffer: bool = False) -> ParamEntry:
    """The entry of a parameter or buffer held as a plain tensor or a DTensor."""
    shape = tuple(int(s) for s in t.shape)
    if isinstance(t, DTensor):
        if _torch_compat.has_strided_shard(t):
            view = ParamView(fqn, shape, ViewKind.BOX, box=_torch_compat.strided_local_box(t, fqn))
        else:
            view = ParamView(fqn, shape, ViewKind.DTENSOR, box=_torch_private.dtensor_local_box(t, fqn))
    else:
        view = ParamView(fqn, shape, ViewKind.REPLICATED, box=Box.whole(shape))
    return ParamEntry(t, (view,), is_buffer)


@dataclass(frozen=True)
class ModelLayout:
    """A model's entries for the model state, and the optimizer-visible entries by tensor id."""

    entries: tuple[ParamEntry, ...]
    by_param: dict[int, ParamEntry]


def collect(model: nn.Module | Sequence[nn.Module]) -> ModelLayout:
    """Find every parameter and persistent buffer of ``model`` and how this rank holds it.

    Tied parameters appear once, under the first FQN ``named_parameters`` gives.

    Raises:
        ValueError: for a DTensor whose local shard is not a box, or two tensors under one FQN.
    """
    entries: list[ParamEntry] = []
    by_param: dict[int, ParamEntry] = {}
    seen: set[int] = set()
    fqns: set[str] = set()

    def add(entry: ParamEntry) -> None:
        for v in entry.views:
            if v.fqn in fqns:
                raise ValueError(f"two different tensors of the model are named '{v.fqn}'")
            fqns.add(v.fqn)
        entries.append(entry)

    for mod in _as_modules(model):
        flat_entries, orig_entries = fsdp1_entries(mod)
        for e in flat_entries:
            seen.add(id(e.tensor))
            by_param[id(e.tensor)] = e
            add(e)
        for pid, e in orig_entries.items():
            seen.add(pid)
            by_param[pid] = e
        for name, p in mod.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            e = tensor_entry(p, _torch_compat.clean_fqn(name))
            by_param[id(p)] = e
            add(e)
        for mname, m in mod.named_modules():
            for bname, b in _torch_compat.persistent_buffers(m):
                if id(b) in seen:
                    continue
                seen.add(id(b))
                add(tensor_entry(b, _torch_compat.clean_fqn(f"{mname}.{bname}" if mname else bname), is_buffer=True))
    return ModelLayout(tuple(entries), by_param)


class ModelState:
    """A model's parameters and persistent buffers as a tessera Stateful, by clean FQN.

    ``state_dict()`` maps each FQN to what this rank holds of it (a tensor, a DTensor, a
    :class:`ShardedTensor` or a :class:`FlatShard`), aliasing the live memory, so
    ``tessera.load`` fills the model in place and ``load_state_dict`` has nothing left
    to copy. A checkpoint saved under one framework or world size loads under any other.

    Args:
        model: the model as the framework wraps it (DDP, FSDP1, FSDP2, TP, compiled), or a
            sequence of pipeline-stage modules whose FQNs are disjoint.

    Example:
        >>> tessera.save(path, {"model": tessera.ModelState(model), "step": step})
        >>> tessera.load(path, {"model": tessera.ModelState(model)})
    """

    def __init__(self, model: nn.Module | Sequence[nn.Module]) -> None:
        self._model = model
        _as_modules(model)  # validate early
        self._handed: dict[str, object] = {}
        self._saved: tuple[ParamEntry, ...] = ()
        self._gate = StagingGate()
        self._forward_gate = StagingGate()

    def hold_mutations(self, pending: Any) -> None:
        """Called by ``async_save``: ``load_state_dict`` and, where needed, a forward pass wait until ``pending`` has staged.

        Parameters change in ``optimizer.step()``: when every tensor this model saved is a
        parameter whose step the same save holds (an :class:`~tessera.OptimizerState` over
        them in the state) and nothing in the forward writes parameters, the forward and
        backward passes run while the bytes are copied and only the step waits. Otherwise a
        forward pre-hook on the model as given (outside any compiled region) holds the forward
        pass until the saved bytes are in host memory: for persistent buffers (a forward may
        change them in place, as batch norm's running statistics), parameters no gated
        optimizer steps, and forward passes known to write parameters (an ``nn.Embedding`` or
        ``nn.EmbeddingBag`` with ``max_norm``, forward hooks of yours: see
        :mod:`._forward_writes`). Other in-place changes (an EMA update, a manual ``p.add_()``
        between the save and the step, a write in your module's own ``forward``) are not held:
        call ``pending.wait_staged()`` before them, or let the save's mutation check
        (``SaveOptions.check_staging``) fail it.
        """
        modules = list(_as_modules(self._model))
        unless = None
        writes = forward_writes(modules)
        if writes:
            logger.debug("ModelState holds the forward while a save copies: %s", "; ".join(writes[:5]))
        elif self._saved and not any(e.is_buffer for e in self._saved):
            instead: dict[int, list[object]] = {}  # FSDP1 flat parameters stepped as their originals
            for m in modules:
                instead.update(stepped_in_place_of(m))
            tensors = [t for e in self._saved for t in instead.get(id(e.tensor), [e.tensor])]
            # asked at the first forward (every gate of the save is armed by then), once per save
            unless = functools.cache(lambda p: held_by_step(p, tensors))
        # first among the forward pre-hooks: a hook of the user's that writes weights runs after the wait
        register = lambda m, hook: m.register_forward_pre_hook(hook, prepend=True)  # noqa: E731
        self._forward_gate.arm(pending, modules, "forward", register, unless=unless)
        self._gate.arm(pending, modules, "load", lambda m, hook: m.register_load_state_dict_pre_hook(hook))

    def state_dict(self) -> dict[str, object]:
        """This rank's part of every parameter and persistent buffer, by FQN (no copies)."""
        layout = collect(self._model)
        out: dict[str, object] = {}
        for e in layout.entries:
            for v in e.views:
                out[v.fqn] = v.wrap(e.tensor)
        self._handed = dict(out)
        self._saved = layout.entries
        return out

    def load_state_dict(self, state_dict: Mapping[str, object], strict: bool = True) -> None:
        """Take values into the model.

        Values ``tessera.load`` filled in place need nothing. Anything else must be a full
        (global) tensor, of which this rank copies the part it holds: so a plain
        ``{fqn: tensor}`` dict (e.g. Hugging Face weights) loads into any layout.

        Raises:
            MissingKeysError: with ``strict``, for FQNs missing from or unknown to the model.
            StateMismatchError: for a value whose shape is not the tensor's global shape.
        """
        layout = collect(self._model)
        known: set[str] = set()
        missing: list[str] = []
        with torch.no_grad():
            for e in layout.entries:
                for v in e.views:
                    known.add(v.fqn)
                    if v.fqn not in state_dict:
                        missing.append(v.fqn)
                        continue
                    value = state_dict[v.fqn]
                    if value is self._handed.get(v.fqn):
                        continue
                    _copy_full(value, e, v)
        unexpected = sorted(k for k in state_dict if k not in known)
        if strict and (missing or unexpected):
            raise MissingKeysError(
                f"ModelState.load_state_dict: missing {sorted(missing)[:10]}, unexpected {unexpected[:10]}"
            )


def _copy_full(value: object, entry: ParamEntry, view: ParamView) -> None:
    """Copy this rank's part of the full tensor ``value`` into the memory behind ``view``."""
    if isinstance(value, DTensor):
        value = value.full_tensor()  # collective: every rank holding the tensor calls it
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"'{view.fqn}': expected a full tensor, got {type(value).__name__}")
    if tuple(value.shape) != view.shape:
        raise StateMismatchError(f"'{view.fqn}': value has shape {list(value.shape)}, the model has {list(view.shape)}")
    local = entry.local()
    if view.kind is ViewKind.FLAT:
        local = local.reshape(-1)[view.start : view.start + view.numel]
    local.copy_(view.local_part(value).to(local.dtype))
