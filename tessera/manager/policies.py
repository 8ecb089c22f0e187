"""When to save: composable save policies that every rank decides alike.

A policy answers :meth:`SavePolicy.should_save` for a :class:`SaveContext` (the step, the
last step saved, the seconds since that save, and whether the job is being preempted).
Policies are pure functions of the context and compose::

    AnyOf(EveryNSteps(500), EveryNSeconds(1800), OnPreemption())

Two inputs can differ between ranks: each rank's clock, and whether a preemption signal
reached it (a scheduler may signal one process only). :class:`SaveDecider` agrees on both
first, with one tiny all-reduce (MAX of ``[preempted, seconds since save]``) over the
training loop's process group (asynchronous commits run on tessera's own gloo group), so
every rank gets the same context and therefore the same answer: no rank ever saves alone. :meth:`tessera.CheckpointManager.should_save` is a ``SaveDecider``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as tdist

from ..engine import dist
from .preemption import PreemptionHandler

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveContext:
    """What a policy decides from; identical on every rank when built by :class:`SaveDecider`.

    Attributes:
        step: the step that just finished.
        last_saved_step: the step of the last save through this decider (None if none yet).
        seconds_since_save: seconds since that save (since the decider was created if none),
            the largest any rank measured.
        preempted: whether any rank received a preemption signal.
    """

    step: int
    last_saved_step: int | None
    seconds_since_save: float
    preempted: bool


@runtime_checkable
class SavePolicy(Protocol):
    """Decides whether to save at a step. Must be a pure function of the context.

    ``uses_clock`` (optional, default True) tells :class:`SaveDecider` whether the policy
    reads ``seconds_since_save``; a policy that does not, with no preemption handler,
    lets the decider skip its collective.
    """

    def should_save(self, context: SaveContext) -> bool:
        """Whether to save at ``context.step``."""
        ...


def _uses_clock(policy: SavePolicy) -> bool:
    return bool(getattr(policy, "uses_clock", True))


def _check_positive(owner: str, name: str, value: float, kind: type | tuple[type, ...], what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
        raise ValueError(f"{owner}: {name} must be a positive {what}, got {value!r}")


@dataclass(frozen=True)
class EveryNSteps:
    """Save at every step divisible by ``n`` (step 0 included).

    Example:
        >>> EveryNSteps(100).should_save(SaveContext(200, 100, 3.0, False))
        True
    """

    n: int
    uses_clock = False

    def __post_init__(self) -> None:
        _check_positive("EveryNSteps", "n", self.n, int, "integer")

    def should_save(self, context: SaveContext) -> bool:
        """Whether to save at ``context.step`` (see the class docstring)."""
        return context.step % self.n == 0


@dataclass(frozen=True)
class AtSteps:
    """Save at the listed steps.

    Example:
        >>> AtSteps([10, 20]).should_save(SaveContext(10, None, 0.0, False))
        True
    """

    steps: frozenset[int]
    uses_clock = False

    def __init__(self, steps: Iterable[int]) -> None:
        object.__setattr__(self, "steps", frozenset(int(s) for s in steps))

    def should_save(self, context: SaveContext) -> bool:
        """Whether to save at ``context.step`` (see the class docstring)."""
        return context.step in self.steps


@dataclass(frozen=True)
class EveryNSeconds:
    """Save once ``seconds`` have passed since the last save (as agreed across ranks).

    Example:
        >>> EveryNSeconds(600).should_save(SaveContext(7, 3, 601.5, False))
        True
    """

    seconds: float
    uses_clock = True

    def __post_init__(self) -> None:
        _check_positive("EveryNSeconds", "seconds", self.seconds, (int, float), "number")

    def should_save(self, context: SaveContext) -> bool:
        """Whether to save at ``context.step`` (see the class docstring)."""
        return context.seconds_since_save >= self.seconds


@dataclass(frozen=True)
class OnPreemption:
    """Save when any rank received a preemption signal.

    Example:
        >>> OnPreemption().should_save(SaveContext(7, 3, 1.0, True))
        True
    """

    uses_clock = False

    def should_save(self, context: SaveContext) -> bool:
        """Whether to save at ``context.step`` (see the class docstring)."""
        return context.preempted


class AnyOf:
    """Save when any of ``policies`` says so.

    Example:
        >>> AnyOf(EveryNSteps(100), OnPreemption()).should_save(SaveContext(7, 3, 1.0, True))
        True
    """

    def __init__(self, *policies: SavePolicy) -> None:
        for p in policies:
            if not callable(getattr(p, "should_save", None)):
                raise TypeError(f"AnyOf: {p!r} is not a save policy (it has no should_save(context) method)")
        self.policies = tuple(policies)
        self.uses_clock = any(_uses_clock(p) for p in self.policies)

    def should_save(self, context: SaveContext) -> bool:
        """Whether to save at ``context.step`` (see the class docstring)."""
        return any(p.should_save(context) for p in self.policies)

    def __repr__(self) -> str:
        return f"AnyOf({', '.join(map(repr, self.policies))})"


class AllOf(AnyOf):
    """Save when all of ``policies`` say so (e.g. every 10 steps, but at most every 60 s).

    Example:
        >>> AllOf(EveryNSteps(10), EveryNSeconds(60)).should_save(SaveContext(20, 10, 5.0, False))
        False
    """

    def should_save(self, context: SaveContext) -> bool:
        """Whether to save at ``context.step`` (see the class docstring)."""
        return all(p.should_save(context) for p in self.policies)

    def __repr__(self) -> str:
        return f"AllOf({', '.join(map(repr, self.policies))})"


class SaveDecider:
    """Applies a policy at each step, with every rank agreeing on the clock and on preemption.

    Args:
        policy: the policy (None: save only on preemption, when a handler is given).
        preemption: a handler whose signal means "save now, then exit" (None: no preemption).
        clock: seconds, monotonic (default :func:`time.monotonic`); ranks' clocks may disagree.
        process_group: the ranks taking part (default: all).

    Collective contract: :meth:`should_save` and :meth:`agree_preemption` are collective
    over the process group (one all-reduce of two numbers on that group itself, in the
    calling thread, ordered like the training loop's own collectives) whenever the answer
    could differ between ranks, i.e. when the policy reads the clock or a handler is
    installed: call them on every rank at the same steps. :meth:`record_save` is local.
    Not thread-safe.

    Example:
        >>> decider = SaveDecider(AnyOf(EveryNSteps(100), EveryNSeconds(900)))
        >>> if decider.should_save(step):
        ...     tessera.save(f"/ckpt/{step}", state)
        ...     decider.record_save(step)
    """

    def __init__(
        self,
        policy: SavePolicy | None = None,
        *,
        preemption: PreemptionHandler | None = None,
        clock: Callable[[], float] = time.monotonic,
        process_group: Any = None,
    ) -> None:
        if policy is not None and not callable(getattr(policy, "should_save", None)):
            raise TypeError(f"save_policy {policy!r} is not a save policy (it has no should_save(context) method)")
        self.policy = policy
        self.preemption = preemption
        self.clock = clock
        self.process_group = process_group
        self.last_saved_step: int | None = None
        self._last_save_time = clock()
        self._preempted = False  # agreed by every rank; never goes back to False
        self._preemption_saved = False
        self._agree_world: dist.World | None = None
        self._device = torch.device("cpu")

    @property
    def reached_preemption(self) -> bool:
        """Whether the ranks agreed that the job is being preempted (the same on every rank)."""
        return self._preempted

    def _agree(self, use_clock: bool) -> tuple[bool, float]:
        """``(any rank preempted, max seconds since save)``; collective when it must be."""
        local_preempted = self.preemption is not None and self.preemption.received is not None
        elapsed = max(0.0, self.clock() - self._last_save_time)
        if self._preempted:
            local_preempted = True
        if not use_clock and self.preemption is None:
            return False, elapsed  # nothing can differ between ranks: no collective
        world = self._world()
        if not world.distributed:
            return local_preempted, elapsed
        t = torch.tensor([1.0 if local_preempted else 0.0, elapsed], dtype=torch.float64, device=self._device)
        phase = "agreeing on whether to save (preemption, clock)"
        dist.run_collective(world, phase, lambda: tdist.all_reduce(t, op=tdist.ReduceOp.MAX, group=world.group))
        return bool(t[0].item() > 0), float(t[1].item())

    def _world(self) -> dist.World:
        """The ranks of the process group, for an agreement on the training loop's own group.

        The agreement runs where :meth:`should_save` is called, in the training loop, so it
        uses the training group (gloo on a CPU tensor, NCCL on the current CUDA device) in
        program order with the loop's other collectives. Not tessera's coordination group:
        an asynchronous save's background commit runs collectives on that one meanwhile,
        and two threads must never interleave collectives on one group. Nor a new group:
        under torchrun a restarted job reuses the agent's store, where a group created
        after start-up may read a dead worker's address.
        """
        if self._agree_world is not None:
            return self._agree_world
        if not (tdist.is_available() and tdist.is_initialized()):
            if self.process_group is not None:
                raise ValueError("process_group was given but torch.distributed is not initialised")
            self._agree_world = dist.World(0, 1, None)
            return self._agree_world
        group = tdist.group.WORLD if dist.is_default_group(self.process_group) else self.process_group
        if tdist.get_backend(group) == "nccl":
            self._device = torch.device("cuda", torch.cuda.current_device())
        self._agree_world = dist.World(tdist.get_rank(group), tdist.get_world_size(group), group)
        return self._agree_world

    def _note(self, preempted: bool, step: int) -> None:
        if preempted and not self._preempted:
            self._preempted = True
            mine = self.preemption.received if self.preemption is not None else None
            how = f"received signal {mine}" if mine is not None else "joined"
            # Job-wide news from rank 0 only; every rank says at INFO whether it saw the signal.
            if self._world().rank == 0:
                logger.warning("step %d: preemption agreed by all ranks; saving a checkpoint before exit", step)
            logger.info("step %d: preemption: this rank %s", step, how)

    def should_save(self, step: int) -> bool:
        """Whether every rank should save at ``step`` (the same answer on every rank).

        Raises:
            CollectiveTimeoutError: if another rank died or does not call it.
        """
        use_clock = self.policy is not None and _uses_clock(self.policy)
        preempted, elapsed = self._agree(use_clock)
        self._note(preempted, step)
        context = SaveContext(step, self.last_saved_step, elapsed, self._preempted)
        if self._preempted and not self._preemption_saved:
            return True
        return self.policy is not None and bool(self.policy.should_save(context))

    def agree_preemption(self, step: int) -> bool:
        """Whether any rank received a preemption signal (collective only with a handler).

        Used at the save boundary: a save that starts after this returns True must be
        durable and complete before the job exits.
        """
        if self.preemption is None or self._preempted:
            return self._preempted
        preempted, _ = self._agree(False)
        self._note(preempted, step)
        return self._preempted

    def record_save(self, step: int) -> None:
        """Note that ``step`` was saved: restarts the clock. Local."""
        self.last_saved_step = step
        self._last_save_time = self.clock()
        if self._preempted:
            self._preemption_saved = True

    def close(self) -> None:
        """Uninstall the preemption handler (main thread), if any."""
        if self.preemption is not None:
            self.preemption.uninstall()
