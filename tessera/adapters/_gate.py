"""The staging gate: hold a Stateful's mutations until the save in flight has staged its bytes.

``async_save`` copies gated Statefuls' tensors to host memory in the background (see
:class:`tessera.StagingMode`). Objects whose tensors change only through known calls hold
those calls until the copy is done: the adapters install hooks on ``optimizer.step()``, a
module's forward and ``load_state_dict``, so that a training loop never has to call
:meth:`tessera.PendingSave.wait_staged` itself; a user's own Stateful (an EMA model, say)
calls :meth:`StagingGate.wait` at the top of its mutating methods.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

_HELD_BY_STEP: weakref.WeakKeyDictionary[Any, set[int]] = weakref.WeakKeyDictionary()
"""Per save in flight: ids of the parameters whose optimizer step that save's gates hold."""


def hold_by_step(pending: Any, params: Iterable[object]) -> None:
    """Record that ``pending``'s gates hold the optimizer steps that change ``params``."""
    _HELD_BY_STEP.setdefault(pending, set()).update(id(p) for p in params)


def held_by_step(pending: Any, tensors: Iterable[object]) -> bool:
    """Whether every one of ``tensors`` is a parameter whose optimizer step ``pending`` holds."""
    held = _HELD_BY_STEP.get(pending)
    return held is not None and all(id(t) in held for t in tensors)


class StagingGate:
    """Remembers the latest save copying its owner's tensors; :meth:`wait` holds until it has.

    Thread-safe enough for its use: :meth:`hold` runs in the thread that called
    ``async_save``, :meth:`wait` in whichever thread mutates; a wait that starts after the
    save has staged returns at once (one attribute read).

    Example:
        >>> class EMA:  # a Stateful of yours, gated (see tessera.stateful.GatedStateful)
        ...     def __init__(self):
        ...         self.gate = tessera.StagingGate()
        ...     def hold_mutations(self, pending):
        ...         self.gate.hold(pending)
        ...     def update(self, model):
        ...         self.gate.wait()
        ...         ...  # now change the saved tensors
    """

    def __init__(self) -> None:
        self._pending: Any = None
        self._unless: Callable[[Any], bool] | None = None
        self._handles: list[Any] = []

    def hold(self, pending: Any) -> None:
        """Hold mutations until ``pending`` (a :class:`tessera.PendingSave`) has staged."""
        self._pending = pending

    def arm(
        self,
        pending: Any,
        targets: list[Any],
        kind: str,
        register: Callable[[Any, Callable[..., None]], Any],
        *,
        unless: Callable[[Any], bool] | None = None,
    ) -> None:
        """:meth:`hold`, and make ``targets`` wait: ``register(target, hook)`` installs a hook
        of ``kind`` (e.g. ``"forward"``) once per target.

        The hooks stay installed (weakly bound to this gate) and cost one attribute read
        per call when no save is being staged. ``unless(pending)``, if given and true when a
        hook runs, lets that call through without waiting (the save stays held).
        """
        self.hold(pending)
        self._unless = unless  # this save's: a hook is installed once and serves every later save
        ref = weakref.ref(self)

        def hook(*_args: Any, **_kwargs: Any) -> None:
            gate = ref()
            if gate is not None:
                gate.wait(gate._unless)

        hooked = {(id(target), k) for target, k, _ in self._handles}
        for target in targets:
            if (id(target), kind) not in hooked:
                self._handles.append((target, kind, register(target, hook)))

    def wait(self, unless: Callable[[Any], bool] | None = None) -> None:
        """Block until the pending save (if any) has staged; then forget it. With ``unless``,
        return at once (still holding the save) when ``unless(pending)`` is true."""
        pending = self._pending
        if pending is not None:
            if unless is not None and not pending.staged() and unless(pending):
                return
            pending.wait_staged()
            self._pending = None
