"""The protocols user objects implement to take part in a save or load: Stateful and its variants.

Vocabulary: nothing here imports anything of tessera, so every layer may name them.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeGuard, runtime_checkable


@runtime_checkable
class Stateful(Protocol):
    """What tessera saves through ``state_dict()`` and restores through ``load_state_dict()``."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


@runtime_checkable
class GatedStateful(Protocol):
    """A Stateful that holds its own mutations while an async save copies its tensors.

    ``async_save`` calls :meth:`hold_mutations` on every such object in the state before it
    returns; from then until ``pending.wait_staged()`` returns, whatever changes the tensors
    its ``state_dict()`` handed out must wait (:class:`tessera.StagingGate` does the waiting).
    In exchange, the copy of those tensors runs in the background under the default
    ``StagingMode.AUTO`` instead of before ``async_save`` returns. :class:`tessera.ModelState`
    and :class:`tessera.OptimizerState` implement it; so can an EMA model or any object of
    yours whose tensors change only through methods you control.

    Example:
        >>> class EMA:
        ...     def __init__(self, model):
        ...         self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}
        ...         self.gate = tessera.StagingGate()
        ...     def state_dict(self): return self.shadow
        ...     def load_state_dict(self, sd): ...
        ...     def hold_mutations(self, pending): self.gate.hold(pending)
        ...     def update(self, model):
        ...         self.gate.wait()  # returns at once unless a save is still copying
        ...         ...
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...

    def hold_mutations(self, pending: Any) -> None:
        """Make every change to this object's saved tensors wait for ``pending.wait_staged()``."""
        ...


@runtime_checkable
class PreparesLoad(Protocol):
    """A Stateful that must see the checkpoint before ``tessera.load`` takes its ``state_dict()``.

    ``tessera.load`` calls :meth:`prepare_load` first, e.g. so that a fresh optimizer creates
    state of the shapes the checkpoint holds (:class:`tessera.OptimizerState`), or a data
    loader picks its rank's saved position.
    """

    def prepare_load(self, manifest: Any, fqn: str) -> None:
        """Look at ``manifest`` (a :class:`~tessera.format.manifest.Manifest`) for the entries under ``fqn``."""
        ...


def is_stateful(value: object) -> TypeGuard[Stateful]:
    """Whether ``value`` offers ``state_dict()`` and ``load_state_dict()`` (callables, not just names)."""
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))
