"""``save``, ``async_save`` and ``load``: the only module that knows every stage.

save:  flatten -> local plan -> global plan [cached] -> stage -> write -> commit
load:  manifest -> flatten target -> validate -> plan reads -> read + verify + copy -> values

Distributed contract: every rank of the process group calls ``save``/``async_save``/
``load`` with the same path, in the same order. Each call is collective. A failure on any
rank is raised on every rank. At most one save is in flight per process: a new save or a
load first waits for the previous save to finish (and raises its error, if any).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

import torch

from . import dist
from .dist import World
from .broadcast import Broadcast, run_broadcasts, split_replicated
from .dtypes import dtype_from_name, itemsize
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    MissingKeysError,
    StateMismatchError,
    StorageError,
)
from .geometry import Box
from .manifest import MANIFEST_NAME, FileEntry, Manifest, PerRankEntry, TensorEntry, Tile, decode, encode
from .options import LoadOptions, SaveOptions
from .plan import GlobalPlan, RankPlan, build_global_plan, build_local_plan
from .read import ReadTarget, Reader, plan_reads
from .shards import OnResize
from .stage import StagingBuffer
from .state import FlatState, TensorPiece, flatten, restore_values
from .storage import Storage, storage_for
from .tilefile import FileLayout, layout_file
from .values import decode_value, encode_value
from .write import WrittenFile, write_files

logger = logging.getLogger(__name__)

__version__ = "0.1.0"

LOAD_TIMINGS_DIR = "timings"
"""Directory (inside a checkpoint) where each load's per-rank timings are kept."""


# --------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class SaveResult:
    """What a save did, as seen from this rank.

    Attributes:
        path: the checkpoint's path or URL.
        save_id: unique id of this save (also in the manifest).
        bytes_written: bytes this rank wrote (headers included).
        total_bytes: bytes all ranks wrote together.
        timings: this rank's phase durations in seconds (plan, stage, write, commit, total).
        plan_cached: whether the cached global plan was reused (no plan exchange).
        rank_timings: every rank's timings (rank 0 only; empty elsewhere).
    """

    path: str
    save_id: str
    bytes_written: int
    total_bytes: int
    timings: dict[str, float]
    plan_cached: bool
    rank_timings: dict[int, dict[str, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class LoadResult:
    """What a load did on this rank.

    Attributes:
        missing_keys: keys the state asked for that the checkpoint lacks.
        unexpected_keys: checkpoint keys under the state's top-level keys that the state lacks.
        bytes_read: bytes this rank read from storage.
        timings: phase durations in seconds (metadata, plan, read, values, total).
        save_id: the id of the checkpoint that was loaded.
    """

    missing_keys: list[str]
    unexpected_keys: list[str]
    bytes_read: int
    timings: dict[str, float]
    save_id: str


class PendingSave:
    """A save whose bytes are staged and being written in the background.

    ``wait()`` blocks until the checkpoint is committed (or raises what went wrong);
    ``done()`` says whether that has happened. Thread-safe.
    """

    def __init__(self, future: Future[SaveResult], stall_s: float) -> None:
        self._future = future
        self.stall_s = stall_s
        """Seconds the caller was blocked by ``async_save``."""
        self._observed = False

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> SaveResult:
        """The committed save's result.

        Raises:
            CheckpointError: whatever failed in the background, on every rank.
        """
        self._observed = True
        return self._future.result(timeout)

    def _raise_unobserved(self) -> None:
        """Re-raise a background failure nobody has seen yet (called by the next save)."""
        if not self._observed:
            self._observed = True
            self._future.result()


# --------------------------------------------------------------------------------------
# Per-process state: the plan cache, staging memory, the save in flight.


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


def _context(process_group: Any) -> _SaveContext:
    key = process_group if process_group is not None else "default"
    ctx = _CONTEXTS.get(key)
    if ctx is None:
        ctx = _CONTEXTS[key] = _SaveContext()
    return ctx


def _wait_previous(ctx: _SaveContext) -> None:
    pending = ctx.pending
    if pending is not None:
        ctx.pending = None
        wait_futures([pending._future])
        pending._raise_unobserved()


def wait_pending(process_group: Any = None) -> None:
    """Block until this process's save in flight (if any) has committed."""
    _wait_previous(_context(process_group))


# --------------------------------------------------------------------------------------
# Save


class _Timer:
    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.last = self.t0
        self.phases: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        now = time.monotonic()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self.last
        self.last = now

    def total(self) -> dict[str, float]:
        out = dict(self.phases)
        out["total"] = time.monotonic() - self.t0
        return out


def save(
    path: str,
    state: object,
    *,
    process_group: Any = None,
    storage: Storage | None = None,
    allow_pickle: bool = False,
    options: SaveOptions | None = None,
) -> SaveResult:
    """Save ``state`` to ``path`` and commit it; collective over ``process_group``.

    Each rank writes only the tiles the global plan gives it (replicas once, balanced).
    Saving over an existing checkpoint replaces it atomically: readers see the old or the
    new checkpoint, never a mix, also after a crash.

    Args:
        path: directory or URL of the checkpoint.
        state: dict of tensors, DTensors, ShardedTensor/FlatShard, nested containers,
            plain values, per_rank values and Stateful objects.
        process_group: the ranks taking part (default: all). Coordination runs over a
            dedicated gloo group, so NCCL training groups work too.
        storage: a backend instance to use instead of choosing one from ``path``.
        allow_pickle: store values that are not plain (needs the same opt-in to load).
        options: see :class:`SaveOptions`.

    Returns:
        this rank's :class:`SaveResult`.

    Raises:
        CheckpointError: on any rank's failure (the previous checkpoint stays intact).

    Example:
        >>> tessera.save("/ckpt/step100", {"model": model.state_dict(), "step": 100})
    """
    pending = _start_save(path, state, process_group, storage, allow_pickle, options, background=False)
    return pending.wait()


def async_save(
    path: str,
    state: object,
    *,
    process_group: Any = None,
    storage: Storage | None = None,
    allow_pickle: bool = False,
    options: SaveOptions | None = None,
) -> PendingSave:
    """Like :func:`save`, but return once this rank's bytes are staged in host memory.

    Writing and the commit run on a background thread; the training loop may modify the
    state as soon as this returns. Call ``.wait()`` before relying on the checkpoint; an
    error in the background is raised there, and by the next save if nobody waited.

    Example:
        >>> pending = tessera.async_save("/ckpt/step100", state)
        >>> ...  # keep training
        >>> pending.wait()
    """
    return _start_save(path, state, process_group, storage, allow_pickle, options, background=True)


def _start_save(
    path: str,
    state: object,
    process_group: Any,
    storage: Storage | None,
    allow_pickle: bool,
    options: SaveOptions | None,
    *,
    background: bool,
) -> PendingSave:
    opts = options or SaveOptions()
    ctx = _context(process_group)
    with ctx.lock:
        _wait_previous(ctx)
        timer = _Timer()
        world = dist.world_for(process_group)
        store = storage_for(path, storage)
        entry, save_id, cached, flat, values = _plan_save(world, ctx, state, allow_pickle, opts)
        timer.mark("plan")
        staged = _stage(entry, flat, ctx, world, copy=background)
        timer.mark("stage")
        stall = time.monotonic() - timer.t0

        def finish() -> SaveResult:
            return _write_and_commit(world, store, path, entry, staged, save_id, cached, values, opts, timer)

        future: Future[SaveResult] = Future()
        if background:
            thread = threading.Thread(target=_run_into, args=(future, finish), name="tessera-save", daemon=True)
            thread.start()
        else:
            _run_into(future, finish)
        pending = PendingSave(future, stall)
        if background:
            ctx.pending = pending
        else:
            pending._observed = True
        return pending


def _run_into(future: Future[SaveResult], fn: Callable[[], SaveResult]) -> None:
    try:
        future.set_result(fn())
    except BaseException as e:  # noqa: BLE001 - handed to the waiter, never lost
        future.set_exception(e)


def _plan_save(
    world: World, ctx: _SaveContext, state: object, allow_pickle: bool, opts: SaveOptions
) -> tuple[_CachedPlan, str, bool, FlatState, dict[str, Any]]:
    error: BaseException | None = None
    entry = None
    flat = FlatState()
    local = None
    values: dict[str, Any] = {}
    try:
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
    hello = (
        None if error is None else dist.error_text(world.rank, error),
        entry.plan_id if entry is not None else None,
        uuid.uuid4().hex[:16] if world.is_coordinator else None,
    )
    replies = dist.all_gather(world, hello, "starting the save")
    failures = {r: h[0] for r, h in enumerate(replies) if h[0] is not None}
    if failures:
        if error is not None and failures.keys() == {world.rank}:
            raise error  # only this rank failed: its own exception says it best
        dist.raise_failures(world, failures, "preparing the save")
    save_id = replies[0][2]
    plan_ids = {h[1] for h in replies}
    if entry is not None and len(plan_ids) == 1:
        return entry, save_id, True, flat, values

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
    if plan_error is not None:
        raise CheckpointError(f"planning the save failed (on rank 0): {plan_error}")
    layouts = _layouts(rank_plan, world.rank)
    entry = _CachedPlan(plan_id, local.fingerprint, rank_plan, layouts, metas if world.is_coordinator else None)
    ctx.remember(entry)
    return entry, save_id, False, flat, values


def _layouts(rank_plan: RankPlan, rank: int) -> list[FileLayout]:
    files: list[list[tuple[str, Box, torch.dtype]]] = [[] for _ in range(rank_plan.num_files)]
    dtypes = {m.fqn: dtype_from_name(m.dtype) for m in rank_plan.metas}
    for fqn, box, k in rank_plan.items():
        files[k].append((fqn, box, dtypes[fqn]))
    return [layout_file(f"{rank}-{k}.safetensors", tiles) for k, tiles in enumerate(files) if tiles]


def _source(pieces: dict[str, list[TensorPiece]], fqn: str, box: Box) -> torch.Tensor:
    for p in pieces.get(fqn, ()):
        if all(po <= bo and bo + bn <= po + pn for po, pn, bo, bn in zip(p.box.offsets, p.box.lengths, box.offsets, box.lengths)):
            rel = box.relative_to(p.box)
            return p.data[rel.slices()] if p.data.dim() else p.data
    raise CheckpointError(f"internal error: no local piece of '{fqn}' holds box {box}")


def _stage(entry: _CachedPlan, flat: FlatState, ctx: _SaveContext, world: World, *, copy: bool) -> list[list[torch.Tensor]]:
    pieces: dict[str, list[TensorPiece]] = {}
    for p in flat.tensors:
        pieces.setdefault(p.fqn, []).append(p)
    sources = [_source(pieces, s.fqn, s.box) for lay in entry.layouts for s in lay.slots]
    try:
        flat_staged = ctx.staging.stage(sources, copy=copy)
    except Exception as e:
        raise CheckpointError(f"rank {world.rank}: staging tensors to host memory failed: {e}") from e
    out = []
    i = 0
    for lay in entry.layouts:
        out.append(flat_staged[i : i + len(lay.slots)])
        i += len(lay.slots)
    return out


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
    timer: _Timer,
) -> SaveResult:
    error: BaseException | None = None
    written: list[WrittenFile] = []
    prefix = f"data/{save_id}"
    try:
        written = write_files(
            store,
            [(f"{prefix}/{lay.name}", lay, st) for lay, st in zip(entry.layouts, staged)],
            chunk_bytes=opts.chunk_bytes,
            threads=opts.io_threads,
        )
    except CheckpointError as e:
        error = e
    except Exception as e:
        error = StorageError(f"rank {world.rank}: writing data files of {path} failed: {type(e).__name__}: {e}")
        error.__cause__ = e
    timer.mark("write")
    my_bytes = sum(w.nbytes for w in written)
    report = {
        "error": None if error is None else dist.error_text(world.rank, error),
        "files": [(w.path, w.nbytes, [(t.fqn, t.box.offsets, t.box.lengths, t.byte_offset, t.checksums) for t in w.tiles]) for w in written],
        "values": values,
        "timings": {**timer.phases, "bytes": my_bytes},
    }
    reports = dist.gather(world, report, "committing the save")
    outcome: dict[str, Any] = {}
    if world.is_coordinator:
        assert reports is not None
        outcome = _commit(world, store, path, entry, reports, save_id, opts)
    outcome = dist.broadcast(world, outcome, "announcing the commit")
    timer.mark("commit")
    if outcome.get("failures"):
        failures = {int(r): m for r, m in outcome["failures"].items()}
        if error is not None and set(failures) == {world.rank}:
            raise error
        dist.raise_failures(world, failures, f"saving checkpoint {path}")
    rank_timings = {int(r): t for r, t in outcome.get("timings", {}).items()} if world.is_coordinator else {}
    if world.is_coordinator:
        logger.info("saved %s (%d bytes, %d ranks) in %.3fs", path, outcome["total_bytes"], world.size, timer.total()["total"])
    return SaveResult(path, save_id, my_bytes, outcome["total_bytes"], timer.total(), cached, rank_timings)


def _commit(
    world: World, store: Storage, path: str, entry: _CachedPlan, reports: list[dict], save_id: str, opts: SaveOptions
) -> dict[str, Any]:
    """Rank 0: write the manifest if every rank succeeded, then drop unreferenced files."""
    failures = {r: rep["error"] for r, rep in enumerate(reports) if rep["error"] is not None}
    if failures:
        _delete_quietly(store, [f for rep in reports for f, _, _ in rep["files"]])
        return {"failures": failures}
    try:
        manifest = _build_manifest(world, entry, reports, save_id, opts)
        store.write_atomic(MANIFEST_NAME, encode(manifest))
    except Exception as e:
        _delete_quietly(store, [f for rep in reports for f, _, _ in rep["files"]])
        return {"failures": {0: f"committing the manifest failed: {dist.error_text(0, e)}"}}
    keep = {f.path for f in manifest.files} | {MANIFEST_NAME}
    try:
        stale = [p for p in store.list("data") if p not in keep]
        stale += [p for p in store.list("") if p.startswith(MANIFEST_NAME + ".tmp")]
        stale += store.list(LOAD_TIMINGS_DIR)  # timings of loads of the checkpoint just replaced
        store.delete(stale)
    except Exception as e:  # the new checkpoint is committed; garbage is harmless
        logger.warning("could not remove files of older saves under %s: %s", path, e)
    return {"total_bytes": sum(f.nbytes for f in manifest.files), "timings": manifest.timings["save"]["ranks"]}


def _delete_quietly(store: Storage, paths: list[str]) -> None:
    try:
        store.delete(paths)
    except Exception as e:
        logger.warning("could not remove files of a failed save: %s", e)


def _build_manifest(world: World, entry: _CachedPlan, reports: list[dict], save_id: str, opts: SaveOptions) -> Manifest:
    assert entry.metas is not None
    sizes = {m.fqn: itemsize(dtype_from_name(m.dtype)) for m in entry.metas}
    tiles: dict[str, list[Tile]] = {m.fqn: [] for m in entry.metas}
    files = []
    for rank, rep in enumerate(reports):
        for fpath, nbytes, ftiles in rep["files"]:
            files.append(FileEntry(fpath, rank, nbytes))
            for fqn, offsets, lengths, byte_offset, sums in ftiles:
                n = math.prod(lengths) * sizes[fqn]
                tiles[fqn].append(Tile(fpath, tuple(offsets), tuple(lengths), byte_offset, n, tuple(sums)))
    tensors = {
        m.fqn: TensorEntry(m.dtype, m.shape, tuple(sorted(tiles[m.fqn], key=lambda t: t.offsets))) for m in entry.metas
    }
    values: dict[str, Any] = {}
    per_rank: dict[str, list[Any]] = {}
    policies: dict[str, str] = {}
    for rank, rep in enumerate(reports):
        for k, v in rep["values"]["values"].items():
            values.setdefault(k, v)  # lowest rank wins; plain values are meant to be replicated
        for k, (v, policy) in rep["values"]["per_rank"].items():
            per_rank.setdefault(k, [None] * world.size)[rank] = v
            policies[k] = policy
    for m in entry.metas:
        if m.per_rank is not None:
            policies.setdefault(m.fqn, m.per_rank)
    return Manifest(
        save_id=save_id,
        world_size=world.size,
        chunk_bytes=opts.chunk_bytes,
        tensors=tensors,
        values=values,
        per_rank={k: PerRankEntry(policies[k], tuple(v)) for k, v in per_rank.items()},
        files=tuple(files),
        layout={"world_size": world.size, **opts.layout},
        timings={"save": {"ranks": {str(r): rep["timings"] for r, rep in enumerate(reports)}}},
        metadata={
            "tessera_version": __version__,
            "torch_version": torch.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "tensor_policies": {m.fqn: m.per_rank for m in entry.metas if m.per_rank},
            **opts.metadata,
        },
    )


# --------------------------------------------------------------------------------------
# Load


def read_manifest(path: str, *, storage: Storage | None = None) -> Manifest:
    """Read and validate the committed manifest at ``path`` (no communication).

    Raises:
        CheckpointNotFoundError: if nothing is committed there.
        ManifestError: if the manifest is invalid.
    """
    store = storage_for(path, storage)
    try:
        data = store.read_file(MANIFEST_NAME)
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"no committed checkpoint at {path}: {MANIFEST_NAME} is missing (never saved, or the save did not finish)"
        ) from None
    return decode(data, source=f"{path}/{MANIFEST_NAME}")


def _scope(state: object) -> list[str] | None:
    """Top-level keys whose subtrees ``load`` checks for unexpected checkpoint keys."""
    if isinstance(state, dict):
        return [str(k) for k in state]
    return None


def _in_scope(key: str, scope: list[str] | None) -> bool:
    return scope is None or any(key == s or key.startswith(s + ".") for s in scope)


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

    Returns:
        :class:`LoadResult` with missing/unexpected keys, bytes read and timings.

    Raises:
        CheckpointNotFoundError, StateMismatchError, CorruptCheckpointError, DistributedError.

    Example:
        >>> model = build_model()
        >>> tessera.load("/ckpt/step100", {"model": model.state_dict()})
    """
    opts = options or LoadOptions()
    wait_pending(process_group)
    timer = _Timer()
    world = dist.world_for(process_group)
    store = storage_for(path, storage)

    # Metadata: rank 0 reads the manifest once and every rank gets the same bytes.
    data, error = None, None
    if world.is_coordinator:
        try:
            data = store.read_file(MANIFEST_NAME)
        except FileNotFoundError:
            error = f"no committed checkpoint at {path}: {MANIFEST_NAME} is missing (never saved, or the save did not finish)"
        except Exception as e:
            error = f"reading {path}/{MANIFEST_NAME} failed: {dist.error_text(0, e)}"
    data, error = dist.broadcast(world, (data, error), "reading the manifest")
    if error is not None:
        raise CheckpointNotFoundError(error) if "no committed checkpoint" in error else CheckpointError(error)
    manifest = decode(data, source=f"{path}/{MANIFEST_NAME}")
    timer.mark("metadata")

    targets: list[ReadTarget] = []
    missing: list[str] = []
    unexpected: list[str] = []
    flat = FlatState()
    err: BaseException | None = None
    try:
        flat = flatten(state, rank=world.rank, world_size=world.size, for_load=True)
        targets, missing, unexpected = _validate(manifest, flat, world, state, strict=strict, cast=cast_dtypes)
    except Exception as e:
        err = e
    dist.check_all(world, err, f"validating the load of {path}")
    broadcasts: list[Broadcast] = []
    if opts.broadcast_replicated:
        targets, broadcasts = split_replicated(world, targets)
    bytes_read = 0
    try:
        requests = plan_reads(manifest, targets, max_read_bytes=opts.max_read_bytes, rank=world.rank)
        timer.mark("plan")
        reader = Reader(store, manifest, rank=world.rank, verify=opts.verify, threads=opts.io_threads)
        stats = reader.run(requests)
        bytes_read = stats.bytes_read
        timer.mark("read")
    except Exception as e:
        err = e
    if broadcasts and dist.all_true(world, err is None, "checking reads before broadcasting"):
        run_broadcasts(world, broadcasts)
        timer.mark("broadcast")
    if err is None:
        try:
            restore_values(state, flat, lambda k: _lookup_value(manifest, k, world, allow_pickle))
            timer.mark("values")
        except Exception as e:
            err = e
    timings = {**timer.total(), "bytes": bytes_read}
    reports = dist.all_gather(world, (None if err is None else dist.error_text(world.rank, err), timings), f"loading {path}")
    failures = {r: e for r, (e, _) in enumerate(reports) if e is not None}
    if failures:
        if err is not None and set(failures) == {world.rank}:
            raise err
        dist.raise_failures(world, failures, f"loading {path}")
    if world.is_coordinator:
        logger.info("loaded %s (%d bytes on rank 0) in %.3fs", path, bytes_read, timings["total"])
        if opts.record_timings:
            _record_load_timings(store, manifest, [t for _, t in reports])
    return LoadResult(sorted(missing), sorted(unexpected), bytes_read, timer.total(), manifest.save_id)


def _record_load_timings(store: Storage, manifest: Manifest, ranks: list[dict[str, float]]) -> None:
    """Rank 0: keep this load's per-rank timings beside the checkpoint, for ``tessera trace``.

    Best effort: a read-only checkpoint location must not make loading fail.
    """
    doc = {
        "kind": "load",
        "save_id": manifest.save_id,
        "world_size": len(ranks),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "ranks": {str(r): t for r, t in enumerate(ranks)},
    }
    name = f"{LOAD_TIMINGS_DIR}/load-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}.json"
    try:
        store.write_atomic(name, json.dumps(doc, separators=(",", ":")).encode())
    except Exception as e:  # noqa: BLE001
        logger.debug("could not record load timings at %s: %s", name, e)


def _saved_rank(manifest: Manifest, fqn: str, policy: str, world: World) -> int | None:
    """Which saved rank's copy of a per-rank value this rank takes (None: keep the caller's)."""
    if manifest.world_size == world.size:
        return world.rank
    if policy == OnResize.KEEP.value:
        return None
    if policy == OnResize.MODULO.value:
        return world.rank % manifest.world_size
    raise StateMismatchError(
        f"per-rank value '{fqn}' was saved by {manifest.world_size} ranks but is loaded by {world.size}; "
        "there is no sensible mapping. Use per_rank(..., on_resize='keep' or 'modulo') to choose one"
    )


def _validate(
    manifest: Manifest, flat: FlatState, world: World, state: object, *, strict: bool, cast: bool
) -> tuple[list[ReadTarget], list[str], list[str]]:
    """Check the target against the manifest; the reads to do, missing and unexpected keys."""
    targets: list[ReadTarget] = []
    missing: set[str] = set()
    problems: list[str] = []
    for p in flat.tensors:
        entry = manifest.tensors.get(p.fqn)
        if entry is None:
            if p.fqn in manifest.values or p.fqn in manifest.per_rank:
                problems.append(f"'{p.fqn}' is a tensor in the state but a plain value in the checkpoint")
            else:
                missing.add(p.fqn)
            continue
        saved_dtype = dtype_from_name(entry.dtype)
        if saved_dtype != p.dtype and not cast:
            problems.append(
                f"tensor '{p.fqn}': checkpoint has dtype {entry.dtype}, the state has {str(p.dtype).removeprefix('torch.')} "
                "(pass cast_dtypes=True to convert)"
            )
            continue
        if p.per_rank is not None:
            saved_shape = entry.shape[1:]
            if saved_shape != p.shape[1:]:
                problems.append(f"per-rank tensor '{p.fqn}': checkpoint shape {list(saved_shape)}, state {list(p.shape[1:])}")
                continue
            src = _saved_rank(manifest, p.fqn, manifest.metadata.get("tensor_policies", {}).get(p.fqn, p.per_rank.value), world)
            if src is None:
                continue
            box = Box((src,) + (0,) * len(saved_shape), (1, *saved_shape))
            targets.append(ReadTarget(p.fqn, box, p.data))
            continue
        if tuple(entry.shape) != tuple(p.shape):
            problems.append(f"tensor '{p.fqn}': checkpoint has shape {list(entry.shape)}, the state has {list(p.shape)}")
            continue
        targets.append(ReadTarget(p.fqn, p.box, p.data))
    for k in list(flat.values) + list(flat.per_rank_values):
        if k in manifest.tensors:
            problems.append(f"'{k}' is a plain value in the state but a tensor in the checkpoint")
        elif k not in manifest.values and k not in manifest.per_rank:
            missing.add(k)
    scope = _scope(state)
    wanted = flat.keys()
    unexpected = sorted(k for k in manifest.keys() if k not in wanted and _in_scope(k, scope))
    if problems:
        raise StateMismatchError(
            f"rank {world.rank}: the state does not match the checkpoint:\n  " + "\n  ".join(problems[:20])
            + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        )
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {_preview(sorted(missing))}")
        if unexpected:
            parts.append(f"in the checkpoint but not in the state: {_preview(unexpected)}")
        raise MissingKeysError(f"rank {world.rank}: keys do not match (strict=True); " + "; ".join(parts))
    return targets, sorted(missing), unexpected


def _preview(keys: list[str], n: int = 10) -> str:
    shown = ", ".join(f"'{k}'" for k in keys[:n])
    return shown + (f" ... ({len(keys)} in all)" if len(keys) > n else "")


def _lookup_value(manifest: Manifest, key: str, world: World, allow_pickle: bool) -> tuple[bool, Any]:
    if key in manifest.values:
        return True, decode_value(manifest.values[key], key, allow_pickle=allow_pickle)
    entry = manifest.per_rank.get(key)
    if entry is not None:
        src = _saved_rank(manifest, key, entry.on_resize, world)
        if src is None:
            return False, None
        return True, decode_value(entry.values[src], key, allow_pickle=allow_pickle)
    return False, None
