"""The prepare and plan steps of a save: flatten, agree on a save id and location, get a plan.

No storage I/O happens here: the path is claimed in the background
(:mod:`tessera.engine.saving.finish`).
"""

from __future__ import annotations

import logging
import secrets
import uuid

import torch

from ...errors import PlanMismatchError
from ...format.dtypes import dtype_from_name
from ...format.geometry import Box
from ...format.tilefile import FileLayout, layout_file
from ...format.values import encode_value
from ...options import SaveOptions
from ...storage import Storage, storage_for
from .. import commit, dist
from ..dist import Gathered, World
from ..flat_state import FlatState, flatten
from .cache import SaveCache
from .handoff import EncodedValues, PlanAssignment, PreparedSave, SavePlan, SaveRequest
from .plan import LocalPlan, RankPlan, TensorMeta, build_global_plan, build_local_plan, derive_rank_plan
from .replicas import ReplicaDigests, digest_replicas

logger = logging.getLogger(__name__)


class _Local:
    """What the prepare step computed on this rank (kept here, not exchanged)."""

    store: Storage
    flat: FlatState
    local_plan: LocalPlan
    values: EncodedValues
    cached: SavePlan | None
    replicas: ReplicaDigests | None


def save_ballot() -> dist.Ballot:
    """The one vote of a save (cast in the foreground by a rank that must plan or failed, else
    after the rank's bytes are durable): the same fields everywhere, so the all-reduces match."""
    return dist.Ballot(
        plan="same",
        location="same",
        miss="max",
        derive="same",
        nonce="coordinator",
        background="max",
    )


def prepare(
    world: World, ctx: SaveCache, request: SaveRequest, opts: SaveOptions, previous: BaseException | None
) -> PreparedSave:
    """This rank's prepared save; collective only on a rank that must plan or failed.

    Once the ranks of a group agreed on a save (the group's first one), a rank plans alone and
    communicates nothing here: where the layout allows (DTensors on a mesh over all ranks, plain
    replicated tensors, per-rank tensors) and the tensor table is the one the ranks agreed on,
    it derives its share of the plan (:func:`derive_rank_plan`, cached); otherwise it reuses the
    gathered plan cached for its structure. Its save id follows from the group's agreed nonce and
    the number of saves since, and it votes once its bytes are durable (:mod:`.finish`).

    A rank that failed, or has no plan for its structure (a group's first save, a new tensor
    table, a new structure of a layout that cannot be derived) votes now; if all ranks do, each
    derives its share when every rank can, else they exchange local plans (flat shards,
    ``ShardedTensor`` s, pipeline stages holding different tensors). If some ranks planned alone
    and others could not, the ranks' structures changed differently: every rank forgets its
    plans and a synchronous save starts over once; an async save fails on every rank with
    :class:`~tessera.errors.PlanMismatchError` (its copies follow the stale plan).
    ``previous`` is the unobserved failure of the save before (it fails this one everywhere).

    Raises:
        CheckpointError: any rank's failure (flattening, planning, the previous save).
    """
    ctx.saves += 1  # in step on every rank: each save call counts, failed or not
    mine = _Local()
    own: BaseException | None = None
    try:
        if previous is not None:
            raise previous
        mine.store = storage_for(request.path, request.storage, storage_options=request.storage_options)
        mine.flat = flatten(request.state, rank=world.rank, world_size=world.size, allow_pickle=request.allow_pickle)
        mine.local_plan = build_local_plan(mine.flat, world.rank)
        mine.cached = ctx.plans.get(mine.local_plan.fingerprint)
        # Plain values are snapshotted now: the caller may change them once we return.
        mine.values = _encode_values(mine.flat, request.allow_pickle)
        # Copies of replicated tensors, digested at the call (rank 0 compares them before committing).
        # (not of tensors a cached gathered plan shows this rank alone to hold).
        unshared = (
            mine.cached.rank_plan.unshared if mine.cached is not None and not mine.cached.derived else frozenset()
        )
        mine.replicas = digest_replicas(mine.flat, world.size, opts.io_threads, unshared)
    except Exception as e:
        own = e
    if own is None and ctx.nonce is not None:
        lp = mine.local_plan
        if lp.derivable and ctx.table == lp.metas_digest:
            plan_id = f"d{ctx.nonce:015x}"
            plan = mine.cached
            if plan is None or plan.plan_id != plan_id:
                plan = _derive(world, ctx, lp, opts, plan_id)
            return _prepared(world, ctx, request, opts, mine, plan, cached=True)
        if mine.cached is not None and not mine.cached.derived:
            return _prepared(world, ctx, request, opts, mine, mine.cached, cached=True)

    ballot = save_ballot()

    def local() -> None:
        if own is not None:
            raise own
        ballot["miss"] = 1
        ballot["location"] = dist.fingerprint62(commit.location_of(mine.store))
        if mine.local_plan.derivable:  # every rank with this tensor table can plan alone
            ballot["derive"] = dist.fingerprint62(mine.local_plan.metas_digest)
        ballot["nonce"] = secrets.randbits(60)
        ballot["background"] = int(request.background)

    tally = dist.vote(world, "preparing the save", ballot, local)
    if not (tally.agreed["plan"] and tally["plan"] == 0):  # some ranks planned alone: see .finish
        ctx.forget()
        raise plan_mismatch(request.path, retry=not tally["background"])
    if not tally.agreed["location"]:  # name every location (this exchange is the error path)
        commit.check_locations(
            dist.all_gather(world, commit.location_of(mine.store), "preparing the save"), request.path
        )
    ctx.nonce = tally["nonce"]
    if tally.agreed["derive"] and tally["derive"]:
        ctx.table = mine.local_plan.metas_digest
        plan = _derive(world, ctx, mine.local_plan, opts, f"d{ctx.nonce:015x}")
    else:
        ctx.table = None
        plan = _plan(world, ctx, mine.local_plan, opts)
    return _prepared(world, ctx, request, opts, mine, plan, cached=False)


def plan_mismatch(path: str, *, retry: bool) -> PlanMismatchError:
    e = PlanMismatchError(
        f"not saving {path}: the state's structure changed since the last save on some ranks but not on others "
        "(their plans disagree), so the ranks cannot agree on who writes what. Nothing of this save was "
        "kept" + ("; the save starts over" if retry else "; every rank plans again at its next save")
    )
    e.retry = retry
    return e


def _prepared(
    world: World,
    ctx: SaveCache,
    request: SaveRequest,
    opts: SaveOptions,
    mine: _Local,
    plan: SavePlan,
    *,
    cached: bool,
) -> PreparedSave:
    return PreparedSave(
        request.path,
        mine.store,
        _save_id(ctx.nonce, ctx.saves),
        plan,
        cached,
        mine.flat,
        mine.values,
        opts,
        dedup=request.dedup,
        location=commit.location_of(mine.store),
        forget_plans=ctx.forget,
        background=request.background,
        replicas=mine.replicas,
    )


def _save_id(nonce: int | None, count: int) -> str:
    """The save id every rank derives alike: from the group's nonce (random, agreed in its last
    foreground vote) and how many saves the group has started."""
    return f"{dist.fingerprint62(f'{nonce}/{count}'):016x}"


def _encode_values(flat: FlatState, allow_pickle: bool) -> EncodedValues:
    return EncodedValues(
        values={k: encode_value(v, k, allow_pickle=allow_pickle) for k, v in flat.values.items()},
        per_rank={
            k: (encode_value(v, k, allow_pickle=allow_pickle), policy.value)
            for k, (v, policy) in flat.per_rank_values.items()
        },
    )


def _derive(world: World, ctx: SaveCache, local: LocalPlan, opts: SaveOptions, plan_id: str) -> SavePlan:
    """Every rank plans its own writes (no exchange): the ranks agreed on the tensor table."""
    rank_plan = derive_rank_plan(local, world.size, opts.plan)
    plan = SavePlan(
        plan_id=plan_id,
        fingerprint=local.fingerprint,
        rank_plan=rank_plan,
        layouts=_layouts(rank_plan, world.rank),
        metas=local.metas if world.is_coordinator else None,
        derived=True,
    )
    ctx.remember(plan)
    return plan


def _plan(world: World, ctx: SaveCache, local: LocalPlan, opts: SaveOptions) -> SavePlan:
    """Collective: rank 0 builds the global plan from every local plan; each rank gets its share."""
    metas: list[tuple[TensorMeta, ...]] = []  # rank 0: the global tensor table

    def coordinate(gathered: Gathered[LocalPlan]) -> list[PlanAssignment]:
        gplan = build_global_plan(gathered.all(), opts.plan)
        metas.append(gplan.metas)
        plan_id = uuid.uuid4().hex[:16]
        return [PlanAssignment(plan_id, rp) for rp in gplan.rank_plans]

    assignment = dist.collective_step(world, "planning the save", lambda: local, coordinate, per_rank=True)
    plan = SavePlan(
        plan_id=assignment.plan_id,
        fingerprint=local.fingerprint,
        rank_plan=assignment.rank_plan,
        layouts=_layouts(assignment.rank_plan, world.rank),
        metas=metas[0] if world.is_coordinator else None,
    )
    ctx.remember(plan)
    return plan


def _layouts(rank_plan: RankPlan, rank: int) -> tuple[FileLayout, ...]:
    files: list[list[tuple[str, Box, torch.dtype]]] = [[] for _ in range(rank_plan.num_files)]
    dtypes = {m.fqn: dtype_from_name(m.dtype) for m in rank_plan.metas}
    for fqn, box, k in rank_plan.items():
        files[k].append((fqn, box, dtypes[fqn]))
    return tuple(layout_file(f"{rank}-{k}.safetensors", tiles) for k, tiles in enumerate(files) if tiles)
