"""All communication tessera does, over a dedicated CPU (gloo) process group.

The group and this process's place in it (:class:`World`, :func:`world_for`) come from
:mod:`tessera.engine.groups`; without ``torch.distributed`` initialised every helper here
degrades to a single process with no communication.

Every helper here is collective over the group: all ranks must call it in the same order.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar, cast, overload

import torch
import torch.distributed as dist

from .. import _knobs
from ..errors import CheckpointError, CollectiveTimeoutError, RankFailure, collective_error
from .groups import World as World
from .groups import is_default_group as is_default_group
from .groups import world_for as world_for

logger = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")


def _run(world: World, phase: str, fn: Callable[[], T]) -> T:
    try:
        return fn()
    except RuntimeError as e:  # gloo reports dead peers and timeouts as RuntimeError
        text = str(e).lower()  # gloo says "Timed out waiting ...", "Connection reset/closed ..."
        if any(s in text for s in ("timeout", "timed out", "connection", "closed", "reset", "broken pipe")):
            raise CollectiveTimeoutError(
                f"rank {world.rank}: {phase} did not complete; another rank died or hangs "
                f"(timeout {_knobs.collective_timeout_s():.0f}s, TESSERA_TIMEOUT_S): {e}"
            ) from e
        raise


def _global(world: World, group_rank: int) -> int:
    return dist.get_global_rank(world.group, group_rank)


def gather(world: World, obj: T, phase: str) -> list[T] | None:
    """Objects of all ranks on rank 0 (None elsewhere)."""
    if not world.distributed:
        return [obj]
    out: list[Any] | None = [None] * world.size if world.rank == 0 else None
    _run(world, phase, lambda: dist.gather_object(obj, out, dst=_global(world, 0), group=world.group))
    return out


def broadcast(world: World, obj: T, phase: str) -> T:
    """Rank 0's object on every rank."""
    if not world.distributed:
        return obj
    box = [obj]
    _run(world, phase, lambda: dist.broadcast_object_list(box, src=_global(world, 0), group=world.group))
    return box[0]


def scatter(world: World, objs: list[T] | None, phase: str) -> T:
    """``objs[r]`` from rank 0 on each rank ``r``."""
    if not world.distributed:
        assert objs is not None
        return objs[0]
    out: list[Any] = [None]
    _run(world, phase, lambda: dist.scatter_object_list(out, objs, src=_global(world, 0), group=world.group))
    return out[0]


def all_gather(world: World, obj: T, phase: str) -> list[T]:
    """Every rank's object on every rank."""
    if not world.distributed:
        return [obj]
    out: list[Any] = [None] * world.size
    _run(world, phase, lambda: dist.all_gather_object(out, obj, group=world.group))
    return out


def all_true(world: World, flag: bool, phase: str) -> bool:
    """Whether ``flag`` holds on every rank (one tiny all-reduce)."""
    if not world.distributed:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    _run(world, phase, lambda: dist.all_reduce(t, op=dist.ReduceOp.MIN, group=world.group))
    return bool(t.item())


def error_text(rank: int, e: BaseException, context: str = "") -> RankFailure:
    """The picklable record of ``e`` raised on ``rank``, to hand to the other ranks.

    ``str()`` of the record is ``"TypeName: message"``; :func:`raise_failures` turns
    records back into an error of the original tessera type.
    """
    return RankFailure.of(rank, e, context)


def raise_failures(
    world: World, failures: Mapping[int, RankFailure | str], what: str, own: BaseException | None = None
) -> None:
    """Raise one error carrying every rank's failure, of the same type on all ranks.

    The type is the failed ranks' common tessera error type (see
    :func:`tessera.errors.collective_error`), else :class:`DistributedError`. ``own`` is
    this rank's exception, if it failed: raised itself (with ``failures`` set) when no
    other rank failed, else the ``__cause__``.
    """
    if own is not None and set(failures) == {world.rank}:
        _attach(own, failures)
        raise own
    if failures:
        err = collective_error(
            f"{what} failed on {len(failures)} of {world.size} rank(s) (seen on rank {world.rank}):", failures
        )
        raise err from own


def exchange(world: World, error: BaseException | None, payload: T, what: str) -> list[T]:
    """Collective: every rank's ``payload``, unless some rank passes an error.

    :func:`collective_step` for a caller that has already caught its error (new code
    passes the local work to :func:`collective_step` instead). Raises as it does.
    """

    def local() -> T:
        if error is not None:
            raise error
        return payload

    return collective_step(world, what, local)


def _attach(error: BaseException, failures: Mapping[int, RankFailure | str]) -> None:
    if isinstance(error, CheckpointError) and not error.failures:
        try:
            error.failures = {r: str(f) for r, f in failures.items()}
        except AttributeError:  # a class that forbids it keeps its empty default
            pass


@dataclass(frozen=True)
class Gathered(Generic[T]):
    """What the coordinator of a :func:`collective_step` sees: every rank's payload or failure.

    Attributes:
        payloads: rank ``r``'s payload at index ``r``; None for a rank that failed.
        failures: the failed ranks' records (:func:`error_text`), by rank.
    """

    payloads: list[T | None]
    failures: dict[int, RankFailure]

    @property
    def ok(self) -> bool:
        """Whether every rank's local work succeeded."""
        return not self.failures

    def all(self) -> list[T]:
        """Every rank's payload; only when :attr:`ok` (a failed rank has none)."""
        if not self.ok:
            raise CheckpointError(f"internal error: ranks {sorted(self.failures)} failed and have no payload")
        return cast("list[T]", self.payloads)


@overload
def collective_step(world: World, what: str, local: Callable[[], T]) -> list[T]: ...


@overload
def collective_step(
    world: World,
    what: str,
    local: Callable[[], T],
    coordinate: Callable[[Gathered[T]], R | None],
    *,
    per_rank: Literal[False] = False,
) -> R: ...


@overload
def collective_step(
    world: World,
    what: str,
    local: Callable[[], T],
    coordinate: Callable[[Gathered[T]], Sequence[R] | None],
    *,
    per_rank: Literal[True],
) -> R: ...


def collective_step(
    world: World,
    what: str,
    local: Callable[[], T],
    coordinate: Callable[[Gathered[T]], Any] | None = None,
    *,
    per_rank: bool = False,
) -> Any:
    """Collective: one step of a save or load, with its errors raised on every rank.

    Every rank runs ``local``. Without ``coordinate`` the payloads are exchanged (one
    all-gather) and every rank gets the list. With ``coordinate``, rank 0 gathers them and
    calls ``coordinate`` with what it gathered (also when some rank failed, so that it can
    clean up); its result reaches every rank (one broadcast), or with ``per_rank`` it
    returns one result per rank and rank ``r`` receives element ``r``.

    Errors: an exception from ``local`` (any ``Exception``) is this rank's failure; an
    exception from ``coordinate`` is the step's failure on rank 0 and replaces the ranks'
    failures (the coordinator knows the real cause, say a lost race behind missing files).
    If anything failed, every rank raises: a rank whose own exception is the only failure
    raises it unchanged (with ``failures`` set), the others one error listing each failed
    rank's cause, of the failures' common tessera type (see :func:`raise_failures`). All
    ranks leave the step together, so no rank is left waiting in a later collective.

    Args:
        world: the ranks taking part.
        what: the step, for messages ("planning the save").
        local: this rank's work; its result is this rank's payload (picklable).
        coordinate: rank 0's work on every rank's payloads (None only when some rank
            failed: the step raises then).
        per_rank: ``coordinate`` returns a sequence with one result per rank.

    Returns:
        every rank's payload (no ``coordinate``), else this rank's result from ``coordinate``.

    Raises:
        CheckpointError (or the failures' common subclass): on every rank if any rank failed.

    Example:
        >>> world = World(0, 1)
        >>> collective_step(world, "adding", lambda: 2, lambda g: sum(g.all()))
        2
    """
    own: BaseException | None = None
    payload: T | None = None
    try:
        payload = local()
    except Exception as e:
        own = e
    record = None if own is None else error_text(world.rank, own)
    if coordinate is None:
        replies = all_gather(world, (record, payload), what)
        raise_failures(world, {r: f for r, (f, _) in enumerate(replies) if f is not None}, what, own=own)
        return [p for _, p in replies]
    gathered = gather(world, (record, payload), what)
    Answer = tuple[dict[int, RankFailure], Any]  # (the step's failures, this rank's result)
    answers: list[Answer] | None = None
    if world.is_coordinator:
        assert gathered is not None
        step = Gathered([p for _, p in gathered], {r: f for r, (f, _) in enumerate(gathered) if f is not None})
        result: Any = None
        try:
            result = coordinate(step)
            failures = step.failures
        except Exception as e:
            own, failures = e, {0: error_text(0, e)}
        if failures or result is None:
            answers = [(failures, None)] * (world.size if per_rank else 1)
        else:
            answers = [({}, r) for r in result] if per_rank else [({}, result)]
    answer: Answer
    if per_rank:
        answer = scatter(world, answers, what)
    else:
        answer = broadcast(world, answers[0] if answers is not None else ({}, None), what)
    failures, mine = answer
    raise_failures(world, failures, what, own=own)
    return mine


run_collective = _run  # public name: one collective step; a dead peer or a timeout -> CollectiveTimeoutError


# --- Fixed-size votes: the coordination of a steady-state save or a load -------------------------
#
# A vote is one all-reduce (MAX) of a few int64 numbers, whatever the number of ranks, tensors
# or tiles: every rank learns whether any rank failed and whether the ranks agree on a few
# facts (a plan id, a location, a manifest version). Only when something failed do the ranks
# exchange their error records (a second, variable-size collective on the error path only).

_MASK62 = (1 << 62) - 1
_Kind = Literal["same", "max", "coordinator"]


def fingerprint62(text: str) -> int:
    """A positive 62-bit hash of ``text``, to compare strings across ranks inside a vote."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") & _MASK62) | 1


class Ballot:
    """The facts one rank puts into a :func:`vote`, declared (with their reduction) before
    the rank's work runs, so that a rank failing half-way still votes a vector of the same size.

    Kinds: ``"same"`` asks whether every rank set the same value (values in [0, 2**62));
    ``"max"`` is the maximum (a flag raised by any rank, a count); ``"coordinator"`` hands
    rank 0's value to every rank.
    """

    def __init__(self, **kinds: _Kind) -> None:
        self._kinds = kinds
        self._values = dict.fromkeys(kinds, 0)

    def __setitem__(self, name: str, value: int) -> None:
        if name not in self._kinds:
            raise KeyError(f"ballot has no field {name!r}")
        if not 0 <= int(value) <= _MASK62:
            raise ValueError(f"vote field {name!r} must be in [0, 2**62), got {value}")
        self._values[name] = int(value)

    def vector(self, rank: int) -> list[int]:
        out: list[int] = []
        for name, kind in self._kinds.items():
            v = self._values[name]
            if kind == "same":
                out += [v, -v]
            else:
                out.append(v if kind == "max" or rank == 0 else 0)
        return out

    def tally(self, reduced: list[int]) -> Tally:
        agreed: dict[str, bool] = {}
        values: dict[str, int] = {}
        i = 0
        for name, kind in self._kinds.items():
            if kind == "same":
                agreed[name], values[name] = reduced[i] == -reduced[i + 1], reduced[i]
                i += 2
            else:
                values[name] = reduced[i]
                i += 1
        return Tally(agreed, values)


@dataclass(frozen=True)
class Tally:
    """The outcome of a :func:`vote`: per ``"same"`` field whether every rank agreed, and the
    reduced value of every field (for a ``"same"`` field, the largest value voted)."""

    agreed: dict[str, bool]
    values: dict[str, int]

    def __getitem__(self, name: str) -> int:
        return self.values[name]


def vote(
    world: World,
    what: str,
    ballot: Ballot,
    local: Callable[[], None],
    *,
    failed: Callable[[], BaseException | None] | None = None,
) -> Tally:
    """Collective: every rank runs ``local`` (which fills ``ballot``); one all-reduce of the ballots.

    If ``local`` raised on any rank, ``failed`` runs on every rank (rank 0 removing what it
    claimed, say), then the failed ranks' error records are exchanged (the only
    variable-size collective, on the error path) and every rank raises as
    :func:`collective_step` does. If rank 0's ``failed`` returns an error, that is the real
    cause (a lost race behind missing files, say): it replaces the ranks' failures.

    Returns:
        the :class:`Tally`.

    Example:
        >>> b = Ballot(plan="same")
        >>> vote(World(0, 1), "agreeing", b, lambda: b.__setitem__("plan", 7)).agreed["plan"]
        True
    """
    own: BaseException | None = None
    try:
        local()
    except Exception as e:
        own = e
    vector = ballot.vector(world.rank)
    t = torch.tensor([1 if own is not None else 0, *vector], dtype=torch.int64)
    if world.distributed:
        _run(world, what, lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=world.group))
    reduced = t.tolist()
    if reduced[0]:
        cause = failed() if failed is not None else None
        record = None if own is None else error_text(world.rank, own)
        cause_record = None if cause is None or not world.is_coordinator else error_text(0, cause)
        records = all_gather(world, (record, cause_record), what)
        if records[0][1] is not None:
            raise_failures(world, {0: records[0][1]}, what, own=cause)
        raise_failures(world, {r: f for r, (f, _) in enumerate(records) if f is not None}, what, own=own)
    return ballot.tally(reduced[1:])


def announce(world: World, what: str, decide: Callable[[], list[int]] | None, width: int) -> list[int]:
    """Collective: rank 0's decision (``width`` int64 numbers) on every rank, or its failure.

    Rank 0 runs ``decide`` (the others pass None). On success: one broadcast of a fixed-size
    vector. If ``decide`` raised, a second broadcast carries rank 0's error record and every
    rank raises an error of its type (rank 0 the error itself).
    """
    mine: BaseException | None = None
    failures: dict[int, RankFailure] = {}
    vector = [0] * width
    if world.is_coordinator:
        assert decide is not None
        try:
            vector = list(decide())
            if len(vector) != width:
                raise CheckpointError(f"internal error: {what} decided {len(vector)} numbers, not {width}")
        except Exception as e:
            mine, failures = e, {0: error_text(0, e)}
    t = torch.tensor([1 if failures else 0, *vector], dtype=torch.int64)
    if world.distributed:
        _run(world, what, lambda: dist.broadcast(t, src=_global(world, 0), group=world.group))
    out = t.tolist()
    if out[0]:
        failures = broadcast(world, failures, what)
        raise_failures(world, failures, what, own=mine)
        raise CheckpointError(f"{what} failed")  # unreachable: failures is not empty
    return out[1:]
