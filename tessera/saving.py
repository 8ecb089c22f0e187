"""Orchestrating a save: flatten -> local plan -> global plan [cached] -> stage -> write -> commit.

Per process group, a :class:`_SaveContext` keeps the cached global plans, the reused host
staging buffer and the save in flight. Rank 0 commits following :mod:`tessera.commit`: it
claims the path before any rank writes (in the background, so the claim's I/O never adds
to the stall), checks every reported file, publishes the manifest only over the version it
claimed, and then removes files of saves that are over.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import commit, dist
from .commit import LOAD_TIMINGS_DIR, Claim, RankReport
from .dist import World
from .dtypes import dtype_from_name, itemsize
from .errors import CheckpointError, ConcurrentSaveError, StagingMutationError, StorageError
from .geometry import Box
from .manifest import FileEntry, Manifest, PerRankEntry, TensorEntry, TileTable, encode
from .options import SaveOptions, StagingMode
from .plan import RankPlan, build_global_plan, build_local_plan
from .results import PendingSave, SaveResult
from .stage import StagingBuffer, as_bytes, ready_event
from .state import FlatState, TensorPiece, dotted_parents, flatten, is_empty_container
from .storage import Storage, storage_for
from .tilefile import FileLayout, layout_file
from .timing import PhaseTimer
from .values import encode_value
from .version import __version__
from .write import WrittenFile, write_files

logger = logging.getLogger(__name__)

__all__ = ["LOAD_TIMINGS_DIR", "start_save", "wait_pending"]


@dataclass
class _CachedPlan:
    plan_id: str
    fingerprint: str
    rank_plan: RankPlan
    layouts: list[FileLayout]
    metas: tuple | None  # the global tensor table (rank 0 only)


class _SaveContext:
    """Per process group: cached plans, staging memory and the background writer."""

    def __init__(self) -> None:
        self.plans: dict[str, _CachedPlan] = {}
        self.staging = StagingBuffer()
        self.pending: PendingSave | None = None
        self.lock = threading.Lock()

    def remember(self, entry: _CachedPlan) -> None:
        self.plans[entry.fingerprint] = entry
        while len(self.plans) > 4:
            self.plans.pop(next(iter(self.plans)))


_CONTEXTS: dict[object, _SaveContext] = {}


_CONTEXTS_LOCK = threading.Lock()


def _context(process_group: Any) -> _SaveContext:
    # The default group may be named explicitly (dist.group.WORLD) or left as None.
    key = "default" if dist.is_default_group(process_group) else process_group
    with _CONTEXTS_LOCK:
        ctx = _CONTEXTS.get(key)
        if ctx is None:
            ctx = _CONTEXTS[key] = _SaveContext()
        return ctx


def _wait_previous(ctx: _SaveContext) -> BaseException | None:
    """Wait for the save in flight; its error if nobody has seen it yet.

    The error is returned, not raised: callers hand it to the next collective exchange, so
    that every rank fails together (whether a rank already observed it is per process).
    """
    pending = ctx.pending
    if pending is None:
        return None
    ctx.pending = None
    wait_futures([pending._future])
    try:
        pending._raise_unobserved()
    except BaseException as e:
        return e
    return None


@atexit.register
def _report_unobserved() -> None:
    """At exit: say on stderr which background saves failed with nobody waiting for them.

    Written straight to stderr, not logged: with no logging configured, or logging to a
    file, the failure would otherwise go unnoticed. (Python ignores an exit status set by
    an atexit handler, so the process's exit code cannot be changed from here safely.)
    Non-daemon save threads have been joined by the time atexit handlers run.
    """
    with _CONTEXTS_LOCK:
        pendings = [ctx.pending for ctx in _CONTEXTS.values() if ctx.pending is not None]
    for pending in pendings:
        e = pending.unobserved_error()
        if e is None:
            continue
        pending._observed = True
        try:
            sys.stderr.write(
                f"tessera: ERROR: the asynchronous save to {pending.path} failed in the background and nothing "
                f"waited for it (call .wait() on the PendingSave); the checkpoint was NOT committed: "
                f"{type(e).__name__}: {e}\n"
            )
            sys.stderr.flush()
        except Exception:
            pass


def wait_pending(process_group: Any = None) -> BaseException | None:
    """Block until this process's save in flight (if any) has finished.

    Returns:
        the save's error if it failed and nobody has observed it yet, else None.
    """
    return _wait_previous(_context(process_group))


def start_save(
    path: str,
    state: object,
    process_group: Any,
    storage: Storage | None,
    allow_pickle: bool,
    options: SaveOptions | None,
    storage_options: dict[str, Any] | None = None,
    *,
    background: bool,
) -> PendingSave:
    opts = options or SaveOptions()
    timer = PhaseTimer()  # before the wait for the previous save: the stall counts it
    ctx = _context(process_group)
    with ctx.lock:
        early = _wait_previous(ctx)
        timer.mark("wait_previous")
        world = dist.world_for(process_group)
        store: Storage | None = None
        if early is None:
            try:
                store = storage_for(path, storage, storage_options=storage_options)
            except Exception as e:  # reported in the first exchange, like any other rank's error
                early = e
        entry, save_id, cached, flat, values = _plan_save(world, ctx, path, store, state, allow_pickle, opts, early)
        assert store is not None
        timer.mark("plan")
        overlap = background and opts.staging is StagingMode.BACKGROUND
        staged: list[list[torch.Tensor]] = []
        stage_error: BaseException | None = None
        staged_event: threading.Event | None = None
        # The background report waits for the caller's stall, known once this returns.
        returned = threading.Event() if background else None
        if not overlap:
            try:
                staged = _stage(entry, flat, ctx, world, copy=background)
            except Exception as e:  # reported in the commit exchange, so that every rank hears of it
                stage_error = e
            timer.mark("stage")

            def finish() -> SaveResult:
                return _write_and_commit(
                    world, store, path, entry, staged, save_id, cached, values, opts, timer, stage_error, returned
                )

        else:
            sources, names = _sources(entry, flat)
            after = ready_event(sources)
            reference = _fingerprints(sources) if opts.check_staging else None
            staged_event = threading.Event()

            def finish() -> SaveResult:
                copy_error: BaseException | None = None
                out: list[list[torch.Tensor]] = []
                try:
                    out = _stage_sources(entry, sources, ctx, world, copy=True, after=after)
                    if reference is not None:
                        _check_unchanged(sources, names, out, reference, world, path)
                except Exception as e:  # reported in the commit exchange, so that every rank hears of it
                    copy_error = e
                finally:
                    sources.clear()  # let the caller's tensors go
                    staged_event.set()
                timer.mark("copy")
                return _write_and_commit(
                    world, store, path, entry, out, save_id, cached, values, opts, timer, copy_error, returned
                )

            timer.mark("schedule")
        future: Future[SaveResult] = Future()
        if stage_error is not None:
            timer.stall = time.monotonic() - timer.t0
            if returned is not None:
                returned.set()
            _run_into(future, finish)  # join the peers' commit exchange now, then raise here
            future.result()
        if background:
            # Not a daemon: at interpreter exit Python waits for the commit to finish (bounded
            # by TESSERA_TIMEOUT_S if a peer is gone) instead of killing it half-way.
            thread = threading.Thread(target=_run_into, args=(future, finish), name="tessera-save", daemon=False)
            thread.start()
        else:
            _run_into(future, finish)
        parts = {k: timer.phases[k] for k in ("wait_previous", "plan", "stage", "schedule") if k in timer.phases}
        pending = PendingSave(future, 0.0, path=path, staged_event=staged_event, stall_parts=parts)
        if overlap:
            _install_gates([obj for obj, _ in flat.statefuls], pending)
        pending.stall_s = time.monotonic() - timer.t0
        if returned is not None and not returned.is_set():
            timer.stall = pending.stall_s
            returned.set()
        if background:
            ctx.pending = pending
        else:
            pending._observed = True
        return pending


def _run_into(future: Future[SaveResult], fn: Callable[[], SaveResult]) -> None:
    try:
        future.set_result(fn())
    except BaseException as e:
        future.set_exception(e)


def _plan_save(
    world: World,
    ctx: _SaveContext,
    path: str,
    store: Storage | None,
    state: object,
    allow_pickle: bool,
    opts: SaveOptions,
    early: BaseException | None,
) -> tuple[_CachedPlan, str, bool, FlatState, dict[str, Any]]:
    """Flatten, agree on a save id and on the location, and get this rank's plan.

    Returns ``(plan, save id, plan was cached, flat state, values)``. No storage I/O: the
    path is claimed later, in the background (:func:`_claim`).
    """
    error: BaseException | None = early
    entry = None
    flat = FlatState()
    local = None
    values: dict[str, Any] = {}
    try:
        if error is not None:
            raise error
        assert store is not None
        flat = flatten(state, rank=world.rank, world_size=world.size, allow_pickle=allow_pickle)
        local = build_local_plan(flat, world.rank)
        entry = ctx.plans.get(local.fingerprint)
        # Plain values are snapshotted now: the caller may change them once we return.
        values = {
            "values": {k: encode_value(v, k, allow_pickle=allow_pickle) for k, v in flat.values.items()},
            "per_rank": {
                k: (encode_value(v, k, allow_pickle=allow_pickle), policy.value)
                for k, (v, policy) in flat.per_rank_values.items()
            },
        }
    except Exception as e:  # reported on every rank below
        error = e
    location = commit.location_of(store) if store is not None else None
    save_id = uuid.uuid4().hex[:16] if world.is_coordinator else None
    hello = (entry.plan_id if entry is not None else None, save_id, location)
    replies = dist.exchange(world, error, hello, "preparing the save")
    commit.check_locations([h[2] for h in replies], path)
    save_id = replies[0][1]
    plan_ids = {h[0] for h in replies}
    if entry is not None and len(plan_ids) == 1:
        return entry, save_id, True, flat, values
    entry = _exchange_plans(world, ctx, local, opts)
    return entry, save_id, False, flat, values


def _claim(
    world: World, store: Storage, save_id: str, error: BaseException | None
) -> tuple[Claim, bool, BaseException | None]:
    """Rank 0 claims the path; every rank learns whether it may write. Collective, background.

    Returns ``(claim, may write, this rank's error)``. No rank writes a data file before rank
    0's owner marker exists (the cleanup rule of :mod:`tessera.commit` depends on it). If rank
    0 could not claim (or failed before), no rank writes, and rank 0's error is reported in
    the commit exchange like any write error.
    """
    claim = Claim(save_id, None, False)
    if world.is_coordinator and error is None:
        try:
            claim = commit.claim(store, save_id)
        except Exception as e:
            error = e
    may_write = dist.broadcast(world, world.is_coordinator and error is None, "claiming the checkpoint path")
    return claim, bool(may_write), error


def _exchange_plans(world: World, ctx: _SaveContext, local: Any, opts: SaveOptions) -> _CachedPlan:
    assert local is not None
    locals_ = dist.gather(world, local, "exchanging save plans")
    payloads: list[Any] | None = None
    if world.is_coordinator:
        assert locals_ is not None
        try:
            gplan = build_global_plan(locals_, opts.plan)
            plan_id = uuid.uuid4().hex[:16]
            payloads = [(plan_id, rp, None) for rp in gplan.rank_plans]
            metas: tuple | None = gplan.metas
        except Exception as e:
            payloads = [(None, None, dist.error_text(0, e))] * world.size
            metas = None
    plan_id, rank_plan, plan_error = dist.scatter(world, payloads, "distributing save plans")
    if plan_error is not None:  # rank 0's failure record: the planner's error type on every rank
        dist.raise_failures(world, {0: plan_error}, "planning the save")
    layouts = _layouts(rank_plan, world.rank)
    entry = _CachedPlan(plan_id, local.fingerprint, rank_plan, layouts, metas if world.is_coordinator else None)
    ctx.remember(entry)
    return entry


def _layouts(rank_plan: RankPlan, rank: int) -> list[FileLayout]:
    files: list[list[tuple[str, Box, torch.dtype]]] = [[] for _ in range(rank_plan.num_files)]
    dtypes = {m.fqn: dtype_from_name(m.dtype) for m in rank_plan.metas}
    for fqn, box, k in rank_plan.items():
        files[k].append((fqn, box, dtypes[fqn]))
    return [layout_file(f"{rank}-{k}.safetensors", tiles) for k, tiles in enumerate(files) if tiles]


def _source(pieces: dict[str, list[TensorPiece]], fqn: str, box: Box) -> torch.Tensor:
    for p in pieces.get(fqn, ()):
        if all(
            po <= bo and bo + bn <= po + pn
            for po, pn, bo, bn in zip(p.box.offsets, p.box.lengths, box.offsets, box.lengths)
        ):
            rel = box.relative_to(p.box)
            return p.data[rel.slices()] if p.data.dim() else p.data
    raise CheckpointError(f"internal error: no local piece of '{fqn}' holds box {box}")


def _sources(entry: _CachedPlan, flat: FlatState) -> tuple[list[torch.Tensor], list[str]]:
    """The tensors this rank writes, in the plan's slot order, and their names."""
    pieces: dict[str, list[TensorPiece]] = {}
    for p in flat.tensors:
        pieces.setdefault(p.fqn, []).append(p)
    slots = [s for lay in entry.layouts for s in lay.slots]
    return [_source(pieces, s.fqn, s.box) for s in slots], [s.fqn for s in slots]


def _stage(
    entry: _CachedPlan, flat: FlatState, ctx: _SaveContext, world: World, *, copy: bool
) -> list[list[torch.Tensor]]:
    return _stage_sources(entry, _sources(entry, flat)[0], ctx, world, copy=copy)


def _stage_sources(
    entry: _CachedPlan,
    sources: list[torch.Tensor],
    ctx: _SaveContext,
    world: World,
    *,
    copy: bool,
    after: object | None = None,
) -> list[list[torch.Tensor]]:
    try:
        flat_staged = ctx.staging.stage(sources, copy=copy, after=after)
    except Exception as e:
        raise CheckpointError(f"rank {world.rank}: staging tensors to host memory failed: {e}") from e
    out = []
    i = 0
    for lay in entry.layouts:
        out.append(flat_staged[i : i + len(lay.slots)])
        i += len(lay.slots)
    return out


def _fingerprints(sources: list[torch.Tensor]) -> list[tuple[int, int | None]]:
    """Debug check: each source's version counter and, for CPU tensors, the CRC32 of its bytes."""
    out = []
    for src in sources:
        crc = zlib.crc32(as_bytes(src.contiguous()).numpy()) if src.device.type == "cpu" else None
        out.append((src._version, crc))
    return out


def _check_unchanged(
    sources: list[torch.Tensor],
    names: list[str],
    staged: list[list[torch.Tensor]],
    reference: list[tuple[int, int | None]],
    world: World,
    path: str,
) -> None:
    """Raise if a source changed between ``async_save`` and the end of its copy (a missing gate).

    Raises:
        StagingMutationError: naming the first tensor that changed.
    """
    flat_staged = [t for per_file in staged for t in per_file]
    for src, name, host, (version, crc) in zip(sources, names, flat_staged, reference):
        changed = src._version != version
        if not changed and crc is not None:
            changed = zlib.crc32(host.numpy()) != crc
        if changed:
            raise StagingMutationError(
                f"rank {world.rank}: tensor '{name}' was modified after async_save({path!r}) returned and before "
                f"its bytes were staged (PendingSave.wait_staged()); the checkpoint would not hold the state at "
                f"the time of the call, so the save is abandoned. Call wait_staged() (or step through "
                f"tessera.OptimizerState) before modifying saved tensors"
            )


def _install_gates(statefuls: list[object], pending: PendingSave) -> None:
    """Let Stateful objects that know how (``_tessera_gate``) hold their mutations until staged."""
    for obj in statefuls:
        gate = getattr(obj, "_tessera_gate", None)
        if callable(gate):
            gate(pending)


def _write_and_commit(
    world: World,
    store: Storage,
    path: str,
    entry: _CachedPlan,
    staged: list[list[torch.Tensor]],
    save_id: str,
    cached: bool,
    values: dict[str, Any],
    opts: SaveOptions,
    timer: PhaseTimer,
    stage_error: BaseException | None = None,
    returned: threading.Event | None = None,
) -> SaveResult:
    claim, may_write, error = _claim(world, store, save_id, stage_error)
    written: list[WrittenFile] = []
    prefix = f"{commit.DATA_DIR}/{save_id}"
    try:
        if error is not None:
            raise error
        if not may_write:  # rank 0 failed to claim: it reports why; nobody writes
            raise _NotClaimed
        written = write_files(
            store,
            [(f"{prefix}/{lay.name}", lay, st) for lay, st in zip(entry.layouts, staged)],
            chunk_bytes=opts.chunk_bytes,
            threads=opts.io_threads,
        )
    except _NotClaimed:
        pass
    except CheckpointError as e:
        error = e
    except Exception as e:
        error = StorageError(f"rank {world.rank}: writing data files of {path} failed: {type(e).__name__}: {e}")
        error.__cause__ = e
    timer.mark("write")
    my_bytes = sum(w.nbytes for w in written)
    if returned is not None:
        returned.wait()  # the caller's stall is known once async_save has returned
    timings: dict[str, float] = {**timer.phases, "bytes": my_bytes}
    if timer.stall is not None:
        timings["stall"] = timer.stall
    report = RankReport(
        error=None if error is None else dist.error_text(world.rank, error),
        files=tuple(
            (w.path, w.nbytes, [(t.fqn, t.box.offsets, t.box.lengths, t.byte_offset, t.checksums) for t in w.tiles])
            for w in written
        ),
        values=values,
        timings=timings,
    )
    reports = dist.gather(world, report, "committing the save")
    outcome: dict[str, Any] = {}
    commit_error: BaseException | None = None
    if world.is_coordinator:
        assert reports is not None
        outcome, commit_error = _commit(world, store, path, entry, reports, claim, opts)
    outcome = dist.broadcast(world, outcome, "announcing the commit")
    timer.mark("commit")
    if outcome.get("failures"):
        failures = {int(r): m for r, m in outcome["failures"].items()}
        if not world.is_coordinator and written:
            # Rank 0 removed what it can see; files on this rank's node-local storage too.
            _delete_quietly(store, [w.path for w in written])
        own = commit_error if commit_error is not None else error
        dist.raise_failures(world, failures, f"saving checkpoint {path}", own=own)
    after_commit = getattr(store, "after_commit", None)
    if after_commit is not None:  # e.g. the memory tier: start this rank's copy to durable storage
        after_commit(rank=world.rank, world_size=world.size, save_id=save_id, files=[w.path for w in written])
    rank_timings = {int(r): t for r, t in outcome.get("timings", {}).items()} if world.is_coordinator else {}
    if world.is_coordinator:
        logger.info(
            "saved %s (%d bytes, %d ranks) in %.3fs", path, outcome["total_bytes"], world.size, timer.total()["total"]
        )
    return SaveResult(path, save_id, my_bytes, outcome["total_bytes"], timer.total(), cached, rank_timings)


class _NotClaimed(Exception):
    """This rank skips writing: rank 0 could not claim the path (and reports why)."""


def _commit(
    world: World,
    store: Storage,
    path: str,
    entry: _CachedPlan,
    reports: list[RankReport],
    claim: Claim,
    opts: SaveOptions,
) -> tuple[dict[str, Any], BaseException | None]:
    """Rank 0: check, publish and clean up (see :mod:`tessera.commit`).

    Returns:
        the outcome announced to every rank, and rank 0's own commit error (if any).
    """
    failures = {r: rep.error for r, rep in enumerate(reports) if rep.error is not None}
    files = [f for rep in reports for f, _, _ in rep.files]
    if failures:
        commit.abandon(store, claim, files, path)
        superseded = commit.superseded(store, claim, path)
        if superseded is not None:  # the real cause: another save committed and removed our files
            return {"failures": {0: dist.error_text(0, superseded)}}, superseded
        return {"failures": failures}, None
    published = False
    try:
        superseded = commit.superseded(store, claim, path)
        if superseded is not None:
            raise superseded
        commit.check_files(store, claim, reports, path)
        live_before = commit.live_saves(store)
        manifest = _build_manifest(world, entry, reports, claim.save_id, opts)
        data = encode(manifest)
        published = True  # from here on, a failure may have committed after all
        commit.publish(store, claim, data, path)
    except Exception as e:
        err: BaseException = e
        if not isinstance(e, CheckpointError):
            err = StorageError(f"committing the manifest of {path} failed: {type(e).__name__}: {e}")
            err.__cause__ = e
        if not published or isinstance(e, ConcurrentSaveError) or not commit.may_have_committed(store, claim):
            commit.abandon(store, claim, files, path)
        else:  # the manifest may have landed: keep its files; the next save cleans them up
            commit.abandon(store, claim, [], path, keep_data=True)
        return {"failures": {0: dist.error_text(0, err)}}, err
    commit.clean_up(store, claim, live_before, path)
    return {"total_bytes": sum(f.nbytes for f in manifest.files), "timings": manifest.timings["save"]["ranks"]}, None


def _delete_quietly(store: Storage, paths: list[str]) -> None:
    try:
        store.delete(paths)
    except Exception as e:
        logger.warning("could not remove files of a failed save: %s", e)


def _build_manifest(
    world: World, entry: _CachedPlan, reports: list[RankReport], save_id: str, opts: SaveOptions
) -> Manifest:
    assert entry.metas is not None
    # Columns per tensor, gathered from every rank's report; no per-tile objects.
    cols: dict[str, list[list[Any]]] = {m.fqn: [[], [], [], [], [], []] for m in entry.metas}
    files = []
    for rank, rep in enumerate(reports):
        for fpath, nbytes, ftiles in rep.files:
            fi = len(files)
            files.append(FileEntry(fpath, rank, nbytes))
            for fqn, offsets, lengths, byte_offset, sums in ftiles:
                c = cols[fqn]
                c[0].append(fi)
                c[1].append(offsets)
                c[2].append(lengths)
                c[3].append(byte_offset)
                c[4].append(len(sums))
                c[5].extend(sums)
    paths = tuple(f.path for f in files)
    tensors = {m.fqn: TensorEntry(m.dtype, m.shape, table=_table(paths, m, *cols[m.fqn])) for m in entry.metas}
    values: dict[str, Any] = {}
    per_rank: dict[str, list[Any]] = {}
    policies: dict[str, str] = {}
    for rank, rep in enumerate(reports):
        for k, v in rep.values["values"].items():
            values.setdefault(k, v)  # lowest rank wins; plain values are meant to be replicated
        for k, (v, policy) in rep.values["per_rank"].items():
            per_rank.setdefault(k, [None] * world.size)[rank] = v
            policies[k] = policy
    for m in entry.metas:
        if m.per_rank is not None:
            policies.setdefault(m.fqn, m.per_rank)
    # A container that is empty on one rank (say, a pipeline stage's share of the model) but
    # holds tensors or values on others is not a value of its own. Only an empty one: a
    # non-empty value beside dotted keys ({"ema.shadow": t, "ema": {"decay": 0.9}}) is kept.
    parents = dotted_parents(list(tensors) + list(values) + list(per_rank))
    values = {k: v for k, v in values.items() if k not in parents or not is_empty_container(v)}
    return Manifest(
        save_id=save_id,
        world_size=world.size,
        chunk_bytes=opts.chunk_bytes,
        tensors=tensors,
        values=values,
        per_rank={k: PerRankEntry(policies[k], tuple(v)) for k, v in per_rank.items()},
        files=tuple(files),
        layout={"world_size": world.size, **opts.layout},
        timings={"save": {"ranks": {str(r): rep.timings for r, rep in enumerate(reports)}}},
        metadata={
            "tessera_version": __version__,
            "torch_version": torch.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "tensor_policies": {m.fqn: m.per_rank for m in entry.metas if m.per_rank},
            **opts.metadata,
        },
    )


def _table(
    paths: tuple[str, ...],
    meta: Any,
    file: list[int],
    offsets: list,
    lengths: list,
    byte_offset: list[int],
    chunks: list[int],
    sums: list[int],
) -> TileTable:
    """A tensor's tile table, tiles sorted by their offsets."""
    n, nd = len(file), len(meta.shape)
    offs = np.array(offsets, dtype=np.int64).reshape(n, nd)
    lens = np.array(lengths, dtype=np.int64).reshape(n, nd)
    counts = np.array(chunks, dtype=np.int64)
    order = np.lexsort(offs.T[::-1]) if nd and n else np.arange(n)
    starts = np.concatenate([[0], np.cumsum(counts)])[:-1]
    sum_arr = np.array(sums, dtype=np.uint64)
    new_counts = counts[order]
    new_starts = np.concatenate([[0], np.cumsum(new_counts)])[:-1]
    total = int(new_counts.sum())
    sum_order = np.arange(total) - np.repeat(new_starts, new_counts) + np.repeat(starts[order], new_counts)
    nbytes = (lens.prod(axis=1) if nd else np.ones(n, dtype=np.int64)) * itemsize(dtype_from_name(meta.dtype))
    return TileTable(
        paths,
        np.array(file, dtype=np.int64)[order],
        offs[order],
        lens[order],
        np.array(byte_offset, dtype=np.int64)[order],
        nbytes[order],
        new_counts,
        sum_arr[sum_order],
    )
