"""An opt-in handler that turns a preemption signal (SIGTERM by default) into a flag.

Schedulers (Slurm, Kubernetes, spot/preemptible VMs, torchrun's agent when it is told to
stop) announce the end of a job with SIGTERM and kill it a grace period later. Python's
default reaction ends the process at once, losing everything since the last checkpoint.
:class:`PreemptionHandler` records the signal instead, so that the training loop can write
one last checkpoint at its next step boundary (see :class:`tessera.manager.policies.SaveDecider`,
which makes every rank agree on it) and then exit.

The handler only sets a flag; nothing else runs inside the signal handler. The signal rule:

* every signal that arrives within ``grace_s`` seconds of the first *signal* (default 5 s,
  knob ``TESSERA_PREEMPTION_GRACE_S``) is the same preemption: schedulers and launchers
  often deliver one notice several times a few milliseconds apart (Slurm signals the job
  step and torchrun forwards the signal to its workers), and that must still lead to one
  save at the next step boundary;
* a signal that comes ``grace_s`` or more after the first means "really stop": the previous
  handler is put back and the signal delivered to it, so a job stuck before its next step
  boundary still dies;
* :meth:`PreemptionHandler.trigger` (a notice from code, e.g. a thread polling a cloud
  provider) records a preemption but is not a signal: it never starts the grace period, so
  the scheduler's real signal that follows it is a first signal, not a second one.

Thread-safety: :meth:`PreemptionHandler.install` and :meth:`~PreemptionHandler.uninstall`
must run in the main thread (a Python rule for signal handlers); reading
:attr:`~PreemptionHandler.received` and calling :meth:`~PreemptionHandler.trigger` are safe
from any thread.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

from .. import _knobs

logger = logging.getLogger(__name__)

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class PreemptionHandler:
    """Records that a preemption signal arrived, for a save at the next step boundary.

    Args:
        signals: the signals that mean "you are being preempted" (default SIGTERM).
        grace_s: seconds after the first signal during which further signals are the same
            preemption (None: ``TESSERA_PREEMPTION_GRACE_S``, default 5). A signal that
            arrives later stops the process as it would have without the handler.

    Raises:
        ValueError: for an empty or invalid signal list, or a negative ``grace_s``.

    Not collective: each rank has its own handler and sees its own signals; the ranks
    agree through :class:`tessera.manager.policies.SaveDecider` (one tiny all-reduce).

    Example:
        >>> handler = PreemptionHandler([signal.SIGTERM]).install()
        >>> ...  # training; the scheduler sends SIGTERM
        >>> handler.received
        15
        >>> handler.uninstall()
    """

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM,), *, grace_s: float | None = None) -> None:
        self.signals = tuple(signal.Signals(s) for s in signals)
        if not self.signals:
            raise ValueError("PreemptionHandler: give at least one signal (e.g. signal.SIGTERM)")
        grace = _knobs.preemption_grace_s() if grace_s is None else grace_s
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace >= 0:
            raise ValueError(f"PreemptionHandler: grace_s must be a number of seconds >= 0, got {grace_s!r}")
        self.grace_s = float(grace)
        """Seconds after the first signal during which further signals are the same preemption."""
        self._received: int | None = None
        self._first_signal_at: float | None = None  # monotonic time of the first real signal
        self._previous: dict[int, _Handler] = {}
        self._lock = threading.Lock()

    @property
    def received(self) -> int | None:
        """The first preemption signal that arrived (or was triggered), None if none."""
        return self._received

    @property
    def installed(self) -> bool:
        """Whether the handler is currently installed."""
        return bool(self._previous)

    def install(self) -> PreemptionHandler:
        """Install the handler for every signal; returns self. Main thread only; idempotent.

        Raises:
            ValueError: when called from another thread than the main thread.
        """
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "PreemptionHandler.install() must run in the main thread (Python installs signal handlers only "
                "there); create the CheckpointManager with preemption=True in the main thread"
            )
        with self._lock:
            for s in self.signals:
                if s not in self._previous:
                    self._previous[s] = signal.signal(s, self._handle)
        logger.debug("preemption handler installed for %s", ", ".join(s.name for s in self.signals))
        return self

    def uninstall(self) -> None:
        """Put the previous handlers back. Main thread only; idempotent."""
        with self._lock:
            previous, self._previous = self._previous, {}
        for s, old in previous.items():
            # A handler installed from C (None from signal.signal) cannot be restored from Python.
            signal.signal(s, signal.SIG_DFL if old is None else old)

    def trigger(self, signum: int = signal.SIGTERM) -> None:
        """Record a preemption notice that did not come as a signal (e.g. from a thread
        polling a cloud provider). Safe from any thread.

        ``received`` reports ``signum``; the job saves at its next step boundary. A notice is
        not a signal: the scheduler's signal that usually follows it is still a first signal
        (it starts the grace period), never the "second signal" that stops the job.
        """
        if self._received is None:
            self._received = int(signum)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only flags and a clock read: no I/O, no locks inside a signal handler.
        now = time.monotonic()
        if self._received is None:
            self._received = signum
        if self._first_signal_at is None:
            self._first_signal_at = now
            return
        if now - self._first_signal_at < self.grace_s:
            return  # the same notice delivered again (by the launcher, to the step, ...)
        # A signal well after the first: the job did not reach a step boundary in time.
        # Stop as the process would have without us.
        old = self._previous.get(signum, signal.SIG_DFL)
        self.uninstall()
        if callable(old):
            old(signum, frame)
        elif old != signal.SIG_IGN:
            os.kill(os.getpid(), signum)

    def __repr__(self) -> str:
        names = ", ".join(s.name for s in self.signals)
        return (
            f"PreemptionHandler([{names}], grace_s={self.grace_s}, received={self._received}, "
            f"installed={self.installed})"
        )
