"""Which models write saved parameters in their forward pass, so that ``ModelState`` holds it.

``ModelState`` lets the forward pass run while an async save copies the model when every saved
tensor is a parameter the same save's ``OptimizerState`` steps: parameters change in
``optimizer.step()``. Some forward passes write parameters in place all the same; for those the
forward waits for the copy, as it does for a model with buffers, so that the save commits
instead of failing the staging check:

- ``nn.Embedding`` and ``nn.EmbeddingBag`` with ``max_norm``: the rows looked up are
  renormalised in place (``torch.embedding_renorm_``). They are the only ``torch.nn`` modules
  whose forward writes a parameter: every other in-place write in ``torch.nn``'s forwards is to
  buffers (batch, instance and sync batch norm's running statistics, ``spectral_norm``'s ``u``
  and ``v`` in both styles, pruning masks, quantization observers), and a model that saves
  buffers holds its forward anyway.
- forward pre-hooks and forward hooks of the user's, on any module of the model or global:
  they may write parameters (weight clipping in a hook is a common idiom). Hooks defined by
  torch itself (``weight_norm``, pruning, ``spectral_norm``, FSDP) or by tessera write buffers
  at most.

Not held, by decision (the staging check covers them: on CPU its fingerprint sees any byte
written, on a GPU the version counter sees an in-place op on the parameter, its views and
``detach()``):

- parametrizations: a parametrization's forward computes the weight from the original and
  is pure by contract (autograd records through it: writing the original needs ``.data`` or
  ``no_grad``); torch's own (``orthogonal``, ``weight_norm``, ``spectral_norm``) write
  nothing but ``spectral_norm``'s buffers.
- an RNN's ``flatten_parameters()`` on CUDA: it re-lays the weights into one buffer only when
  they are not in one already, with their values unchanged: nothing to mix.
- the model's own ``forward`` code: holding every forward for what a user's code might do
  would give up the overlap for every model.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence

from torch import nn

from .. import _torch_private

_KNOWN = ("torch.", "tessera.")
"""Packages whose forward hooks write no parameter (buffers at most)."""


def _origin(hook: object) -> str:
    """The module that defines ``hook`` (a function, a bound method, a partial or a callable object)."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    hook = getattr(hook, "__func__", hook)  # a bound method: its function
    if inspect.isfunction(hook) or inspect.isbuiltin(hook):
        return getattr(hook, "__module__", None) or ""
    return type(hook).__module__


def _is_users(hook: object) -> bool:
    return not _origin(hook).startswith(_KNOWN)


def forward_writes(modules: Sequence[nn.Module]) -> list[str]:
    """Why the forward pass of ``modules`` may write their parameters in place; empty if it does not."""
    why = [f"global forward hook {h!r}" for h in _torch_private.forward_hooks(None) if _is_users(h)]
    for root in modules:
        for name, m in root.named_modules():
            where = f"'{name}'" if name else "the model"
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None:
                why.append(f"{where} is an {type(m).__name__} with max_norm (renormalises rows in place)")
            why.extend(f"{where} has a forward hook {h!r}" for h in _torch_private.forward_hooks(m) if _is_users(h))
    return why
