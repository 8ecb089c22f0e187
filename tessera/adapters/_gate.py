"""The staging gate: hold a Stateful's mutations until the save in flight has staged its bytes.

``async_save`` copies to host memory in the background (see :class:`tessera.StagingMode`).
Adapters whose tensors change only through known calls install a hook on those calls
(``optimizer.step()``, a module's forward) that waits for the copy first, so that a training
loop never has to call :meth:`tessera.PendingSave.wait_staged` itself.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any


class StagingGate:
    """Waits for the latest pending save of its owner; hooks call :meth:`wait`.

    The hooks stay installed (one per hooked object, registered once) and cost one attribute
    read per call when no save is being staged.
    """

    def __init__(self) -> None:
        self._pending: Any = None
        self._hooked: weakref.WeakSet[Any] | None = None
        self._handles: list[Any] = []

    def arm(self, pending: Any, targets: list[Any], register: Callable[[Any, Callable[..., None]], Any]) -> None:
        """Gate ``targets`` on ``pending``; ``register(target, hook)`` installs a hook once per target."""
        self._pending = pending
        ref = weakref.ref(self)

        def hook(*_args: Any, **_kwargs: Any) -> None:
            gate = ref()
            if gate is not None:
                gate.wait()

        hooked = {id(h[0]) for h in self._handles}
        for target in targets:
            if id(target) not in hooked:
                self._handles.append((target, register(target, hook)))

    def wait(self) -> None:
        """Block until the pending save (if any) has staged; then forget it."""
        pending = self._pending
        if pending is not None:
            pending.wait_staged()
            self._pending = None
