"""``OptimizerState``: optimizer state keyed by parameter FQN, resharded like the parameters.

``state_dict()`` is ``{"state": {fqn: {key: value}}, "param_groups": [...], "has_state": b}``,
so tensors are named ``optim.state.<param fqn>.<key>``. A state tensor laid out like its
parameter (``exp_avg``, ``momentum_buffer``) gets the parameter's geometry (DTensor,
ShardedTensor, FlatShard) and reshards exactly like it. Scalars (``step``) are replicated
tensors or plain values. A state of another shape is replicated if its parameter is not
sharded (Adafactor's factors of a DDP model), passed through if it is itself a DTensor,
and refused otherwise: tessera cannot tell which part of it a rank holds.

``param_groups`` are saved with the FQNs of their parameters instead of indices and are
restored by membership, so groups match across frameworks and world sizes.

Loading into an optimizer that has no state yet: :meth:`OptimizerState.prepare_load`
(called by ``tessera.load`` with the checkpoint's manifest) creates zero states of the
right geometry from the checkpoint's own keys (shapes, dtypes). The states are installed
only by ``load_state_dict``. Saving never steps or changes the optimizer: a fresh one saves
no state, and ``has_state`` records that, so its checkpoint loads back as a fresh optimizer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .. import _torch_private
from ..errors import StateMismatchError
from ..format.dtypes import dtype_from_name
from ..format.manifest import Manifest
from ..format.values import decode_value, is_plain
from ._gate import StagingGate, hold_by_step
from .model import ModelLayout, collect
from .views import ParamEntry, ParamView

logger = logging.getLogger(__name__)

State = dict[Any, Any]


@dataclass(frozen=True, eq=False)
class _Target:
    """Where a value handed out by ``state_dict`` goes back on ``load_state_dict``."""

    optimizer: torch.optim.Optimizer
    param: torch.Tensor
    key: Any
    handed: object
    in_place: bool
    first: bool


class OptimizerState:
    """An optimizer's state as a tessera Stateful, keyed by parameter FQN.

    Args:
        model: the model the optimizer trains, wrapped as for :class:`ModelState`.
        optimizer: a ``torch.optim.Optimizer`` (or a sequence of them, e.g. one per
            pipeline stage) over parameters of ``model``.

    Example:
        >>> state = {"model": tessera.ModelState(model), "optim": tessera.OptimizerState(model, opt)}
        >>> tessera.save(path, state)
        >>> tessera.load(path, state)  # any other layout; opt may be fresh
    """

    def __init__(
        self, model: nn.Module | Sequence[nn.Module], optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]
    ) -> None:
        self._model = model
        self._optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
        if not self._optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in self._optimizers):
            raise TypeError("optimizer must be a torch.optim.Optimizer or a non-empty sequence of them")
        self._pending: dict[int, tuple[torch.optim.Optimizer, torch.Tensor, State]] = {}
        self._prepared = False
        self._load_fresh = False
        self._flagged = True
        """Whether the checkpoint being loaded records ``has_state`` (one written by DCP does not)."""
        self._targets: dict[tuple[str, Any], _Target] = {}
        self._gate = StagingGate()

    def hold_mutations(self, pending: Any) -> None:
        """Called by ``async_save``: ``optimizer.step()`` and ``load_state_dict`` wait until ``pending`` has staged.

        The step mutates the parameters and the optimizer state in place; a step pre-hook
        holds it until their bytes are in host memory (:meth:`tessera.PendingSave.wait_staged`).
        The parameters' forward passes need not wait for them then (:class:`~tessera.ModelState`).
        """
        hold_by_step(pending, (p for opt in self._optimizers for g in opt.param_groups for p in g["params"]))
        self._gate.arm(pending, self._optimizers, "step", lambda opt, hook: opt.register_step_pre_hook(hook))
        self._gate.arm(pending, self._optimizers, "load", lambda opt, hook: opt.register_load_state_dict_pre_hook(hook))

    # ----------------------------------------------------------------------------------
    # Stateful

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state by parameter FQN, aliasing the live state tensors.

        Raises:
            ValueError: for a state tensor of a sharded parameter that is neither laid
                out like the parameter, nor a scalar, nor a DTensor.
        """
        layout = collect(self._model)
        params = list(self._params(layout))
        has_state = any(len(o.state) > 0 for o in self._optimizers)
        loading = self._prepared
        if not loading:
            # Saving: only the state that exists (a fresh optimizer saves none, and saving
            # never steps anything). Loading: tessera.load calls prepare_load first.
            self._pending = {}
            self._load_fresh = False
        self._prepared = False
        out: dict[str, dict[Any, object]] = {}
        self._targets = {}
        for opt, _, p, entry in params:
            if self._load_fresh:
                break  # the checkpoint is of a fresh optimizer: there is no state to fill
            st = opt.state.get(p) or (self._pending[id(p)][2] if id(p) in self._pending else None)
            if not st:
                continue
            for key, val in st.items():
                for i, view in enumerate(entry.views):
                    value, in_place = _describe(entry, view, key, val)
                    out.setdefault(view.fqn, {})[key] = value
                    self._targets[(view.fqn, key)] = _Target(opt, p, key, value, in_place, i == 0)
        groups = []
        for opt in self._optimizers:
            for g in opt.param_groups:
                fqns = [v.fqn for p in g["params"] for v in layout.by_param[id(p)].views]
                groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": fqns})
        if loading:
            # What the checkpoint says, not what this (possibly fresh) optimizer has: a checkpoint
            # without `has_state` (strict=False) then installs the states it holds instead of
            # being taken for one of a fresh optimizer.
            has_state = not self._load_fresh
            if not self._flagged:  # torch's own layout (DCP, get_state_dict): the states say it
                return {"state": out, "param_groups": groups}
        return {"state": out, "param_groups": groups, "has_state": has_state}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Install loaded state: hyperparameters by FQN membership, then the states.

        Takes the dict :meth:`state_dict` returned, filled by ``tessera.load``.

        Raises:
            StateMismatchError: if a parameter group now mixes parameters of different
                saved groups, or a value is not one this object handed out.
        """
        layout = collect(self._model)
        if "param_groups" in state_dict:
            self._apply_groups(layout, state_dict["param_groups"])
        pending, self._pending = self._pending, {}
        if state_dict.get("has_state", True) is False:
            for opt in self._optimizers:
                opt.state.clear()  # the checkpoint is of an optimizer that had not stepped
            return
        for opt, p, st in pending.values():
            opt.state[p] = st
        saved = state_dict.get("state", {})
        for (fqn, key), t in self._targets.items():
            per_param = saved.get(fqn, {}) if isinstance(saved, Mapping) else {}
            if key not in per_param:
                continue
            value = per_param[key]
            if t.in_place and value is t.handed:
                continue
            if not t.first:
                continue  # a scalar shared by several FQNs of one flat parameter: the first wins
            live = t.optimizer.state[t.param]
            if isinstance(live.get(key), torch.Tensor) and isinstance(value, torch.Tensor) and value.dim() == 0:
                live[key].copy_(value)
            elif isinstance(value, torch.Tensor) or not is_plain(value):
                raise StateMismatchError(
                    f"optimizer state '{fqn}.{key}': OptimizerState.load_state_dict takes the dict its "
                    "state_dict() returned (filled by tessera.load), not new tensors"
                )
            else:
                live[key] = value

    # ----------------------------------------------------------------------------------
    # Fresh optimizers

    def prepare_load(self, manifest: Manifest, prefix: str) -> None:
        """Create zero states, shaped from the checkpoint, for parameters that have none.

        Call before ``tessera.load`` (or let ``load`` call it) so that a fresh optimizer
        declares exactly the states the checkpoint holds, with the checkpoint's dtypes and
        each parameter's geometry; nothing is installed until ``load_state_dict``.

        Args:
            manifest: the checkpoint's manifest (``tessera.read_manifest(path)``).
            prefix: the key this object has in the loaded state (``"optim"``).

        Raises:
            StateMismatchError: for a saved state that cannot be laid out like a sharded
                parameter here.

        Example:
            >>> optim_state.prepare_load(tessera.read_manifest(path), "optim")
        """
        layout = collect(self._model)
        has_key = f"{prefix}.has_state" if prefix else "has_state"
        self._load_fresh = manifest.values.get(has_key, True) is False
        base = f"{prefix}.state." if prefix else "state."
        fqns = {v.fqn for e in layout.by_param.values() for v in e.views}
        saved: dict[str, dict[str, tuple[str, Any]]] = {}
        for key, te in manifest.tensors.items():
            split = _split_key(key, base, fqns)
            if split is not None:
                saved.setdefault(split[0], {})[split[1]] = ("tensor", te)
        for key, raw in manifest.values.items():
            if key.startswith(base) and key[len(base) :] in fqns:  # a parameter's state without tensors
                decoded = decode_value(raw, key, allow_pickle=False) if not _is_pickled(raw) else {}
                for k in decoded if isinstance(decoded, dict) else ():
                    saved.setdefault(key[len(base) :], {})[k] = ("value", None)
            split = _split_key(key, base, fqns)
            if split is not None:
                saved.setdefault(split[0], {})[split[1]] = ("value", None)
        # Saved in torch's own layout (``get_state_dict``, DCP): states but no flag. Such a
        # checkpoint is of an optimizer that had stepped, and is loaded without asking for the flag.
        self._flagged = has_key in manifest.values or not saved
        if (
            not saved
            and not self._load_fresh
            and any(o.param_groups and o.param_groups[0]["params"] for o in self._optimizers)
        ):
            logger.warning(
                "the checkpoint holds no optimizer state under '%s' for this model's parameters; "
                "the optimizer keeps its own state (a strict load reports the missing keys)",
                base,
            )
        self._pending = {}
        for opt, group, p, entry in self._params(layout):
            if opt.state.get(p) or not entry.requires_grad:
                continue
            st: State = {}
            for view in entry.views:
                for name, (kind, te) in saved.get(view.fqn, {}).items():
                    if name not in st:
                        st[name] = None if kind == "value" else _zero_state(entry, view, name, te, group)
            if st:
                self._pending[id(p)] = (opt, p, st)
        self._prepared = True

    # ----------------------------------------------------------------------------------

    def _params(self, layout: ModelLayout) -> Iterator[tuple[torch.optim.Optimizer, dict, torch.Tensor, ParamEntry]]:
        for opt in self._optimizers:
            for gi, g in enumerate(opt.param_groups):
                for pi, p in enumerate(g["params"]):
                    entry = layout.by_param.get(id(p))
                    if entry is None:
                        raise ValueError(
                            f"optimizer {type(opt).__name__}: parameter {pi} of group {gi} (shape {list(p.shape)}) "
                            "is not a parameter of the model given to OptimizerState"
                        )
                    yield opt, g, p, entry

    def _apply_groups(self, layout: ModelLayout, saved: Any) -> None:
        if not isinstance(saved, list):
            raise StateMismatchError(
                f"optimizer param_groups: expected a list, the checkpoint has {type(saved).__name__}"
            )
        owner: dict[str, int] = {}
        for i, g in enumerate(saved):
            for fqn in g.get("params", ()):
                owner[fqn] = i
        for opt in self._optimizers:
            for gi, group in enumerate(opt.param_groups):
                fqns = [v.fqn for p in group["params"] for v in layout.by_param[id(p)].views]
                found = {owner[f] for f in fqns if f in owner}
                if len(found) > 1:
                    raise StateMismatchError(
                        f"optimizer {type(opt).__name__} group {gi} holds parameters of saved groups {sorted(found)}; "
                        "build the optimizer's groups from the same parameters as when saving"
                    )
                if not found:
                    if fqns:
                        logger.warning(
                            "optimizer group %d: no saved group has its parameters; hyperparameters kept", gi
                        )
                    continue
                for k, v in saved[found.pop()].items():
                    if k == "params":
                        continue
                    cur = group.get(k)
                    if isinstance(cur, torch.Tensor):
                        if cur is not v:
                            cur.copy_(v) if isinstance(v, torch.Tensor) else cur.fill_(v)
                    else:
                        group[k] = v


def _describe(entry: ParamEntry, view: ParamView, key: Any, val: Any) -> tuple[object, bool]:
    """How one state value of a parameter is handed to tessera, and whether it aliases."""
    if not isinstance(val, torch.Tensor):
        return val, False
    multi = len(entry.views) > 1
    if val.dim() > 0 and entry.is_like(val):
        return view.wrap(val), True
    if val.dim() == 0 and not isinstance(val, DTensor):
        return (val.detach().clone(), False) if multi else (val.detach(), True)
    if isinstance(val, DTensor) and not multi:
        return view.wrap(val), True
    if not entry.sharded:
        return val.detach(), True
    raise ValueError(
        f"optimizer state '{key}' of parameter '{view.fqn}' has shape {list(val.shape)}, unlike the parameter "
        f"(global shape {list(view.shape)}, held as {view.kind.value}); the parameter is sharded, so tessera cannot "
        "tell which part of this state the rank holds. Keep such states as DTensors or shaped like the parameter"
    )


def _zero_state(entry: ParamEntry, view: ParamView, name: str, te: Any, group: dict) -> torch.Tensor:
    """A zero tensor for saved state ``name`` of a parameter, laid out to receive it."""
    dtype = dtype_from_name(te.dtype)
    shape = tuple(te.shape)
    local = entry.tensor.detach()
    device = (_torch_private.local_tensor(local) if isinstance(local, DTensor) else local).device
    if shape == view.shape and shape != ():
        return torch.zeros_like(local, dtype=dtype)
    if shape == ():
        # torch optimizers keep `step` on the CPU unless they are capturable or fused.
        on_device = bool(group.get("capturable")) or bool(group.get("fused"))
        return torch.zeros((), dtype=dtype, device=device if on_device else "cpu")
    if not entry.sharded:
        return torch.zeros(shape, dtype=dtype, device=device)
    raise StateMismatchError(
        f"optimizer state '{view.fqn}.{name}' was saved with shape {list(shape)}, unlike its parameter "
        f"(shape {list(view.shape)}), and the parameter is sharded here; tessera cannot lay it out"
    )


def _split_key(key: str, base: str, fqns: set[str]) -> tuple[str, str] | None:
    """``base + fqn + "." + name`` -> ``(fqn, name)`` for a known parameter FQN."""
    if not key.startswith(base):
        return None
    rest = key[len(base) :]
    i = len(rest)
    while (i := rest.rfind(".", 0, i)) > 0:
        if rest[:i] in fqns:
            return rest[:i], rest[i + 1 :]
    return None


def _is_pickled(raw: Any) -> bool:
    return isinstance(raw, dict) and "__pickle__" in raw
