"""A raw ``torch.optim`` state dict as a load target: the entries a fresh optimizer lacks.

``optimizer.state_dict()`` is ``{"state": {index: {name: value}}, "param_groups": [{...,
"params": [index, ...]}]}``. Saved after some steps, its tensors are named
``optim.state.<index>.<name>``; a fresh optimizer's state dict has an empty ``state``, so
nothing in the target names them. As ``torch.distributed.checkpoint`` does for this idiom,
:func:`missing_param_states` makes the entries the checkpoint holds for the parameters the
target's ``param_groups`` list (new tensors of the saved shapes and dtypes, on the CPU;
placeholders for plain values); the loader fills them and puts them into ``state`` only once
the whole load succeeded, so that ``optimizer.load_state_dict(sd["optim"])`` afterwards
restores the saved state exactly (torch moves each state to its parameter's device).

The tensors are whole (unsharded): for sharded models (FSDP2, tensor parallel) use
:class:`tessera.OptimizerState`, which lays each state out like its parameter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from ..format.dtypes import dtype_from_name

if TYPE_CHECKING:
    from ..format.manifest import Manifest

__all__ = ["is_optimizer_state_dict", "missing_param_states"]


def is_optimizer_state_dict(value: object) -> TypeGuard[dict[str, Any]]:
    """Whether ``value`` has the form of ``torch.optim.Optimizer.state_dict()`` (parameters by index)."""
    if not isinstance(value, dict):
        return False
    state, groups = value.get("state"), value.get("param_groups")
    if not isinstance(state, dict) or not isinstance(groups, list) or not groups:
        return False
    if not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        return False
    return all(type(p) is int for g in groups for p in g["params"])


def missing_param_states(sd: dict[str, Any], fqn: str, manifest: Manifest) -> dict[int, Any]:
    """The entries of ``sd["state"]`` the checkpoint holds and ``sd`` lacks, by parameter index.

    Only parameters listed in ``sd["param_groups"]`` get entries; checkpoint keys of other
    indices stay unexpected keys of the load. A tensor becomes a new tensor of its saved shape
    and dtype (filled by the load), a plain value a ``None`` placeholder (replaced by it).

    Args:
        sd: a target that :func:`is_optimizer_state_dict` accepts.
        fqn: its name in the loaded state (``"optim"``).
        manifest: the checkpoint's manifest.

    Example:
        >>> missing_param_states(fresh_opt.state_dict(), "optim", tessera.read_manifest(path))  # doctest: +SKIP
        {0: {'step': tensor(0.), 'exp_avg': tensor([...]), 'exp_avg_sq': tensor([...])}, ...}
    """
    base = f"{fqn}.state." if fqn else "state."
    present = sd["state"]
    index = {str(p): p for g in sd["param_groups"] for p in g["params"] if p not in present}
    out: dict[int, Any] = {}

    def slot(rest: str) -> tuple[int, str] | None:
        pid, _, name = rest.partition(".")
        return (index[pid], name) if pid in index else None

    for key, entry in manifest.tensors.items():
        where = slot(key[len(base) :]) if key.startswith(base) else None
        if where is not None and where[1]:
            out.setdefault(where[0], {})[where[1]] = torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype))
    for key in manifest.values:
        where = slot(key[len(base) :]) if key.startswith(base) else None
        if where is None:
            continue
        pid, name = where
        if not name:  # a parameter's whole state stored as one value (it held no tensor)
            out.setdefault(pid, None)
        elif isinstance(out.setdefault(pid, {}), dict):
            out[pid][name] = None
    return out
