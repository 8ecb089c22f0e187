"""Orchestrating a load: manifest -> flatten target -> validate -> plan reads -> read -> values.

The manifest is read in :mod:`.manifest`, the target checked in :mod:`.validate`.

Every rank reads the manifest itself and plans its own reads (no plan is exchanged); two
fixed-size votes coordinate the load: after validating (every rank succeeded, on one version
of the checkpoint) and after reading (before any Stateful object gets its state), so an error
anywhere is raised everywhere, whatever the number of ranks, tensors or tiles. Restoring the
values is local: an exception from a Stateful's own ``load_state_dict`` is raised on its rank.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from ...errors import CheckpointError, MissingKeysError
from ...format.manifest import Manifest
from ...format.names import LOAD_TIMINGS_DIR
from ...options import LoadOptions
from ...results import LoadResult
from ...storage import Storage, storage_for
from ...storage.shared_tiles import with_shared_tiles
from .. import dist
from ..dist import World
from ..flat_state import FlatState, flatten, restore_values
from ..gc_pause import gc_paused_call
from ..inflight import wait_pending
from ..timing import PhaseTimer
from .broadcast import Broadcast, run_broadcasts, split_replicated
from .manifest import open_manifest
from .read import Reader, ReadRequest, ReadTarget, check_targets, plan_reads
from .sections import Narrow
from .validate import lookup_value, preview, validate, warn_skipped

logger = logging.getLogger(__name__)


def load(
    path: str,
    state: object,
    *,
    strict: bool = True,
    process_group: Any = None,
    storage: Storage | None = None,
    allow_pickle: bool = False,
    cast_dtypes: bool = False,
    options: LoadOptions | None = None,
    storage_options: dict[str, Any] | None = None,
) -> LoadResult:
    """Load the checkpoint at ``path`` into ``state`` in place; collective over ``process_group``.

    Tensors (DTensor locals, ShardedTensor/FlatShard views included) are filled in place
    from whatever layout the checkpoint was saved in; each rank reads only the bytes that
    overlap what it holds. Plain values are replaced in the containers passed in, and
    Stateful objects get ``load_state_dict``. Shapes, dtypes and keys are checked on every
    rank before any byte is copied.

    Args:
        path: directory or URL of a committed checkpoint.
        state: the structure to fill, as for :func:`save`.
        strict: missing keys, and checkpoint keys under the state's top-level keys that the
            state lacks, are errors. With ``strict=False`` they are reported in the result.
            Loading a subset (say ``{"model": ...}`` from a full training checkpoint) is fine.
        process_group: the ranks taking part (default: all).
        storage: a backend instance to use instead of choosing one from ``path``.
        allow_pickle: allow unpickling values saved with ``allow_pickle=True``.
        cast_dtypes: convert tensors whose saved dtype differs instead of failing.
        options: see :class:`LoadOptions`.
        storage_options: backend options when ``storage`` is not given (see :func:`tessera.save`).

    Returns:
        :class:`LoadResult` with missing/unexpected keys, bytes read and timings.

    Raises:
        CheckpointNotFoundError, StateMismatchError, CorruptCheckpointError, DistributedError.

    Example:
        >>> model = build_model()
        >>> tessera.load("/ckpt/step100", {"model": model.state_dict()})
    """
    opts = options or LoadOptions()
    previous = wait_pending(process_group)  # a failed background save fails this load on every rank
    timer = PhaseTimer()
    world = dist.world_for(process_group)
    mine: list[tuple[Storage, Manifest, LoadPlan]] = []
    ballot = dist.Ballot(version="same", some_rank_wants_all="max")

    def prepare() -> None:
        if previous is not None:
            raise previous
        store = storage_for(path, storage, storage_options=storage_options)
        # Lazy: each tile table is decoded (and validated) when this rank first plans reads of it;
        # of a sectioned manifest (version 2) only the sections its targets meet are read.
        manifest, part = open_manifest(store, path, world.rank)
        timer.mark("metadata")
        try:
            plan, manifest = _plan_load(
                world,
                manifest,
                state,
                strict=strict,
                cast=cast_dtypes,
                allow_pickle=allow_pickle,
                opts=opts,
                narrow=part.narrow if part is not None else None,
            )
        except CheckpointError:
            # An invalid tile table this rank did not need to decode is the root cause of
            # anything else failing (a key the state lacks, say): name it first.
            if part is None:
                manifest.validate_all()
            raise
        store = with_shared_tiles(store, manifest, path)
        mine.append((store, manifest, plan))
        ballot["version"] = dist.fingerprint62(manifest.save_id)
        ballot["some_rank_wants_all"] = int(not plan.unexpected)

    # Every rank reads the manifest and plans its own reads; one vote agrees that all of them
    # succeeded, on one version of the checkpoint, before any rank writes into its state.
    tally = dist.vote(world, f"validating the load of {path}", ballot, prepare)
    store, manifest, plan = mine[0]
    if not tally.agreed["version"]:
        raise CheckpointError(
            f"the ranks read different checkpoints at {path}: a save committed there while they loaded; load again"
        )
    unexpected: list[str] = []
    if not tally["some_rank_wants_all"]:  # a key is unexpected only if no rank wants it (pipeline stages)
        everyone = dist.all_gather(world, plan.unexpected, f"validating the load of {path}")
        unexpected = sorted(set(plan.unexpected).intersection(*(set(u) for u in everyone)))
    if strict and unexpected:
        raise MissingKeysError(
            f"keys do not match (strict=True): in the checkpoint but wanted by no rank: {preview(unexpected)}"
        )
    plan = replace(plan, unexpected=unexpected)
    if not strict:
        wanted = plan.flat.keys() if plan.missing else set()
        spare = [k for k in manifest.keys() if k not in wanted] if plan.missing else None
        warn_skipped(world, path, plan.missing, plan.unexpected, spare)
    targets, broadcasts = plan.targets, list[Broadcast]()
    if opts.broadcast_replicated:
        targets, broadcasts = split_replicated(world, plan.targets)
    read_ballot = dist.Ballot(slowest_metadata="max", slowest_plan="max", slowest_read="max")
    stats: list[int] = []  # bytes read, bytes decoded

    def read() -> None:
        requests = plan.requests
        if broadcasts:  # this rank now reads only its share of the replicated targets
            requests = plan_reads(manifest, targets, max_read_bytes=opts.max_read_bytes, rank=world.rank)
        timer.mark("plan")
        reader = Reader(store, manifest, rank=world.rank, verify=opts.verify, threads=opts.io_threads)
        stats.extend((reader.run(requests).bytes_read, reader.decode_stats.decoded))
        timer.mark("read")
        for p in _PHASES:  # the slowest rank of each phase, for the load's timing record
            read_ballot[f"slowest_{p}"] = _slowest(timer.phases.get(p, 0.0), world.rank)

    # Every rank must know the reads succeeded everywhere before broadcasting, or before
    # handing state to Stateful objects whose load_state_dict may itself communicate.
    slowest = dist.vote(world, f"reading the tensors of {path}", read_ballot, read)
    bytes_read = stats[0]
    if broadcasts:
        run_broadcasts(world, broadcasts)
        timer.mark("broadcast")
    restore_values(
        state,
        plan.flat,
        lambda k: plan.decoded[k] if k in plan.decoded else lookup_value(manifest, k, world, allow_pickle),
    )
    timer.mark("values")
    total = timer.total()
    if world.is_coordinator:
        logger.info("loaded %s (%d bytes on rank 0) in %.3fs", path, bytes_read, total["total"])
        if opts.record_timings:
            _record_load_timings(store, manifest, world.size, {**total, "bytes": bytes_read}, slowest)
    return LoadResult(plan.missing, plan.unexpected, bytes_read, total, manifest.save_id, stats[1])


_PHASES = ("metadata", "plan", "read")
_RANK_BITS = 24


def _slowest(seconds: float, rank: int) -> int:
    """A phase's duration (microseconds) and the rank, packed so that the maximum names the slowest rank."""
    return min(int(seconds * 1e6), (1 << (62 - _RANK_BITS)) - 1) << _RANK_BITS | rank


@dataclass(frozen=True)
class LoadPlan:
    """What every rank agreed on before any byte is copied: this rank's reads and values."""

    flat: FlatState
    targets: list[ReadTarget]
    requests: list[ReadRequest]
    decoded: dict[str, tuple[bool, Any]]
    """Plain values, decoded before any tensor is touched."""
    missing: list[str]
    unexpected: list[str]
    """Checkpoint keys no rank wants (the same on every rank)."""


@gc_paused_call
def _plan_load(
    world: World,
    manifest: Manifest,
    state: object,
    *,
    strict: bool,
    cast: bool,
    allow_pickle: bool,
    opts: LoadOptions,
    narrow: Narrow | None = None,
) -> tuple[LoadPlan, Manifest]:
    """This rank's part of the load: validate the target against the manifest and plan the reads.

    ``unexpected`` holds the checkpoint keys *this* rank does not want; the caller keeps those
    no rank wants. ``narrow`` (a sectioned manifest) reads the tiles the targets meet; the
    manifest returned is the one the reads are planned with.

    Raises:
        StateMismatchError, MissingKeysError, CoverageError, ...: this rank's problem.
    """
    flat = flatten(state, rank=world.rank, world_size=world.size, for_load=True, manifest=manifest)
    targets, missing, unexpected = validate(manifest, flat, world, state, strict=strict, cast=cast)
    check_targets(targets, world.rank)  # aliasing: before any rank writes a byte
    if narrow is not None:
        manifest = narrow(targets)
    # Plan every read now: a gap or overlap in the saved tiles (coverage) is then found,
    # and agreed on by every rank, before any rank writes into its targets.
    requests = plan_reads(manifest, targets, max_read_bytes=opts.max_read_bytes, rank=world.rank)
    # Decode plain values now, before any tensor is touched: a refused pickle or a
    # malformed value then leaves the caller's state exactly as it was.
    decoded = {k: lookup_value(manifest, k, world, allow_pickle) for k in [*flat.values, *flat.per_rank_values]}
    return LoadPlan(flat, targets, requests, decoded, sorted(missing), sorted(unexpected)), manifest


def _record_load_timings(
    store: Storage, manifest: Manifest, world_size: int, own: dict[str, float], slowest: dist.Tally
) -> None:
    """Rank 0: keep this load's timings beside the checkpoint, for ``tessera trace``: its own
    phases and, per phase, the slowest rank (what the load's vote carried, a few bytes per rank).

    Best effort: a read-only checkpoint location must not make loading fail.
    """
    mask = (1 << _RANK_BITS) - 1
    doc = {
        "kind": "load",
        "save_id": manifest.save_id,
        "world_size": world_size,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "ranks": {"0": own},
        "slowest": {
            p: {"rank": slowest[f"slowest_{p}"] & mask, "seconds": (slowest[f"slowest_{p}"] >> _RANK_BITS) / 1e6}
            for p in _PHASES
        },
    }
    name = f"{LOAD_TIMINGS_DIR}/load-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}.json"
    try:
        store.write_atomic(name, json.dumps(doc, separators=(",", ":")).encode())
    except Exception as e:
        logger.debug("could not record load timings at %s: %s", name, e)
