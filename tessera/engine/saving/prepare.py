"""The prepare and plan steps of a save: flatten, agree on a save id and location, get a plan.

No storage I/O happens here: the path is claimed later, in the background
(:mod:`tessera.engine.saving.finish`).
"""

from __future__ import annotations

import uuid

import torch

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
from .handoff import EncodedValues, PlanAssignment, PreparedSave, PrepareReport, SavePlan, SaveRequest
from .plan import LocalPlan, RankPlan, TensorMeta, build_global_plan, build_local_plan


class _Local:
    """What the prepare step computed on this rank (kept here, not exchanged)."""

    store: Storage
    flat: FlatState
    local_plan: LocalPlan
    values: EncodedValues
    cached: SavePlan | None


def prepare(
    world: World, ctx: SaveCache, request: SaveRequest, opts: SaveOptions, previous: BaseException | None
) -> PreparedSave:
    """Collective: this rank's prepared save, or the same typed error on every rank.

    ``previous`` is the unobserved failure of the save before (it fails this one everywhere).

    Raises:
        LocationMismatchError: the ranks named different locations.
        CheckpointError: any rank's failure (flattening, planning, the previous save).
    """
    mine = _Local()

    def local() -> PrepareReport:
        if previous is not None:
            raise previous
        mine.store = storage_for(request.path, request.storage, storage_options=request.storage_options)
        mine.flat = flatten(request.state, rank=world.rank, world_size=world.size, allow_pickle=request.allow_pickle)
        mine.local_plan = build_local_plan(mine.flat, world.rank)
        mine.cached = ctx.plans.get(mine.local_plan.fingerprint)
        # Plain values are snapshotted now: the caller may change them once we return.
        mine.values = _encode_values(mine.flat, request.allow_pickle)
        return PrepareReport(
            plan_id=mine.cached.plan_id if mine.cached is not None else None,
            save_id=uuid.uuid4().hex[:16] if world.is_coordinator else None,
            location=commit.location_of(mine.store),
        )

    reports = dist.collective_step(world, "preparing the save", local)
    commit.check_locations([str(r.location) for r in reports], request.path)
    save_id = reports[0].save_id
    assert save_id is not None
    plan = mine.cached
    cached = plan is not None and len({r.plan_id for r in reports}) == 1
    if plan is None or not cached:
        plan = _plan(world, ctx, mine.local_plan, opts)
    return PreparedSave(
        request.path, mine.store, save_id, plan, cached, mine.flat, mine.values, opts, dedup=request.dedup
    )


def _encode_values(flat: FlatState, allow_pickle: bool) -> EncodedValues:
    return EncodedValues(
        values={k: encode_value(v, k, allow_pickle=allow_pickle) for k, v in flat.values.items()},
        per_rank={
            k: (encode_value(v, k, allow_pickle=allow_pickle), policy.value)
            for k, (v, policy) in flat.per_rank_values.items()
        },
    )


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
