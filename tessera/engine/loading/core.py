"""Orchestrating a load: manifest -> flatten target -> validate -> plan reads -> read -> values.

Rank 0 reads the manifest once and broadcasts it; every rank validates its target against
it (all ranks agree before any byte is copied), reads only the bytes that overlap what it
holds, and the ranks agree on success at the end, so an error anywhere is raised everywhere.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from ...errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ManifestError,
    MissingKeysError,
    StateMismatchError,
    StorageError,
)
from ...format.dtypes import dtype_from_name
from ...format.geometry import Box
from ...format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, decode
from ...format.values import decode_value
from ...options import LoadOptions
from ...results import LoadResult
from ...shards import OnResize
from ...storage import Storage, storage_for
from .. import dist
from ..commit import LOAD_TIMINGS_DIR
from ..dist import Gathered, World
from ..flat_state import FlatState, dotted_parents, flatten, restore_values
from ..inflight import wait_pending
from ..timing import PhaseTimer
from .broadcast import Broadcast, run_broadcasts, split_replicated
from .read import Reader, ReadRequest, ReadTarget, check_targets, plan_reads

logger = logging.getLogger(__name__)


def read_manifest(
    path: str, *, storage: Storage | None = None, storage_options: dict[str, Any] | None = None
) -> Manifest:
    """Read and validate the committed manifest at ``path`` (no communication).

    Args:
        path: directory or URL of the checkpoint.
        storage: a backend instance to use instead of choosing one from ``path``.
        storage_options: backend options when ``storage`` is not given (see docs/storage.md).

    Returns:
        the decoded :class:`~tessera.format.manifest.Manifest` (tensors, tiles, files, values).

    Example:
        >>> m = tessera.read_manifest("/ckpt/step100")
        >>> m.tensors["model.w"].shape

    Raises:
        CheckpointNotFoundError: if nothing is committed there.
        ManifestError: if the manifest is invalid.
    """
    store = storage_for(path, storage, storage_options=storage_options)
    return decode(_read_manifest_bytes(store, path), source=f"{path}/{MANIFEST_NAME}")


def _read_manifest_bytes(store: Storage, path: str) -> bytes:
    try:
        return read_bytes(store, f"{path}/{MANIFEST_NAME}")  # the size limit is checked before reading
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"no committed checkpoint at {path}: {MANIFEST_NAME} is missing (never saved, or the save did not finish)"
        ) from None


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
    stores: list[Storage] = []

    def open_storage() -> None:
        if previous is not None:
            raise previous
        stores.append(storage_for(path, storage, storage_options=storage_options))

    # Metadata: rank 0 reads the manifest once and every rank gets the same bytes.
    data = dist.collective_step(
        world, f"reading {path}/{MANIFEST_NAME}", open_storage, lambda g: _manifest_bytes(g, stores, path)
    )
    store = stores[0]
    manifest = decode(data, source=f"{path}/{MANIFEST_NAME}")
    timer.mark("metadata")
    plan = _plan_load(
        world, manifest, state, path, strict=strict, cast=cast_dtypes, allow_pickle=allow_pickle, opts=opts
    )
    if not strict:
        _warn_skipped(world, path, plan.missing, plan.unexpected)
    targets, broadcasts = plan.targets, list[Broadcast]()
    if opts.broadcast_replicated:
        targets, broadcasts = split_replicated(world, plan.targets)

    def read() -> int:
        requests = plan.requests
        if broadcasts:  # this rank now reads only its share of the replicated targets
            requests = plan_reads(manifest, targets, max_read_bytes=opts.max_read_bytes, rank=world.rank)
        timer.mark("plan")
        reader = Reader(store, manifest, rank=world.rank, verify=opts.verify, threads=opts.io_threads)
        stats = reader.run(requests)
        timer.mark("read")
        return stats.bytes_read

    # Every rank must know the reads succeeded everywhere before broadcasting, or before
    # handing state to Stateful objects whose load_state_dict may itself communicate.
    bytes_read = dist.collective_step(world, f"reading the tensors of {path}", read)[world.rank]
    if broadcasts:
        run_broadcasts(world, broadcasts)
        timer.mark("broadcast")

    def restore() -> dict[str, float]:
        restore_values(
            state,
            plan.flat,
            lambda k: plan.decoded[k] if k in plan.decoded else _lookup_value(manifest, k, world, allow_pickle),
        )
        timer.mark("values")
        return {**timer.total(), "bytes": bytes_read}

    reports = dist.collective_step(world, f"loading {path}", restore)
    if world.is_coordinator:
        logger.info("loaded %s (%d bytes on rank 0) in %.3fs", path, bytes_read, reports[0]["total"])
        if opts.record_timings:
            _record_load_timings(store, manifest, reports)
    return LoadResult(plan.missing, plan.unexpected, bytes_read, timer.total(), manifest.save_id)


def _manifest_bytes(gathered: Gathered[None], stores: list[Storage], path: str) -> bytes | None:
    """Rank 0: the manifest's bytes, once every rank has opened its storage."""
    if not gathered.ok:
        return None
    try:
        return _read_manifest_bytes(stores[0], path)
    except CheckpointError:  # CheckpointNotFoundError, ManifestError (oversized, a directory), StorageError, ...
        raise
    except Exception as e:
        raise StorageError(f"rank 0: reading {path}/{MANIFEST_NAME} failed: {type(e).__name__}: {e}") from e


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


def _plan_load(
    world: World,
    manifest: Manifest,
    state: object,
    path: str,
    *,
    strict: bool,
    cast: bool,
    allow_pickle: bool,
    opts: LoadOptions,
) -> LoadPlan:
    """Collective: validate the target against the manifest and plan the reads, on every rank.

    Raises:
        StateMismatchError, MissingKeysError, CoverageError, ...: on every rank if any rank failed.
    """
    mine: list[LoadPlan] = []

    def local() -> list[str]:
        flat = flatten(state, rank=world.rank, world_size=world.size, for_load=True, manifest=manifest)
        targets, missing, unexpected = _validate(manifest, flat, world, state, strict=strict, cast=cast)
        check_targets(targets, world.rank)  # aliasing: before any rank writes a byte
        # Plan every read now: a gap or overlap in the saved tiles (coverage) is then found,
        # and agreed on by every rank, before any rank writes into its targets.
        requests = plan_reads(manifest, targets, max_read_bytes=opts.max_read_bytes, rank=world.rank)
        # Decode plain values now, before any tensor is touched: a refused pickle or a
        # malformed value then leaves the caller's state exactly as it was.
        decoded = {k: _lookup_value(manifest, k, world, allow_pickle) for k in [*flat.values, *flat.per_rank_values]}
        mine.append(LoadPlan(flat, targets, requests, decoded, sorted(missing), []))
        return unexpected

    replies = dist.collective_step(world, f"validating the load of {path}", local)
    # A key is unexpected only if no rank wants it: a pipeline stage holds only its layers.
    unexpected = sorted(set(replies[world.rank]).intersection(*(set(u) for u in replies)))
    if strict and unexpected:
        raise MissingKeysError(
            f"keys do not match (strict=True): in the checkpoint but wanted by no rank: {_preview(unexpected)}"
        )
    return replace(mine[0], unexpected=unexpected)


def _warn_skipped(world: World, path: str, missing: list[str], unexpected: list[str]) -> None:
    """``strict=False``: say what the load leaves out, so that it never skips state silently.

    Missing keys differ by rank (each rank says its own); unexpected keys are the same on
    every rank (rank 0 says them).
    """
    unexpected = unexpected if world.is_coordinator else []
    if not missing and not unexpected:
        return
    parts = []
    if missing:
        parts.append(
            f"{len(missing)} key(s) of the state are not in the checkpoint and keep their values: {_preview(missing)}"
        )
    if unexpected:
        parts.append(f"{len(unexpected)} key(s) of the checkpoint are not in the state: {_preview(unexpected)}")
    logger.warning(
        "rank %d: loading %s with strict=False skipped %s (LoadResult.missing_keys / unexpected_keys list them)",
        world.rank,
        path,
        "; ".join(parts),
    )


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
    except Exception as e:
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
                problems.append(
                    f"per-rank tensor '{p.fqn}': checkpoint shape {list(saved_shape)}, state {list(p.shape[1:])}"
                )
                continue
            policies = manifest.metadata.get("tensor_policies")  # informational metadata: untrusted
            policy = policies.get(p.fqn, p.per_rank.value) if isinstance(policies, dict) else p.per_rank.value
            src = _saved_rank(manifest, p.fqn, policy, world)
            if src is None:
                continue
            box = Box((src,) + (0,) * len(saved_shape), (1, *saved_shape))
            targets.append(ReadTarget(p.fqn, box, p.data))
            continue
        if tuple(entry.shape) != tuple(p.shape):
            problems.append(
                f"tensor '{p.fqn}': checkpoint has shape {list(entry.shape)}, the state has {list(p.shape)}"
            )
            continue
        targets.append(ReadTarget(p.fqn, p.box, p.data))
    parents: set[str] | None = None
    for k in list(flat.values) + list(flat.per_rank_values):
        if k in manifest.tensors:
            problems.append(f"'{k}' is a plain value in the state but a tensor in the checkpoint")
        elif k not in manifest.values and k not in manifest.per_rank:
            value = flat.values.get(k)
            if isinstance(value, (dict, list, tuple)) and not value:
                if parents is None:
                    parents = dotted_parents(list(manifest.keys()))
                if k in parents:  # an empty container where the checkpoint has entries: wants nothing
                    continue
            missing.add(k)
    scope = _scope(state)
    wanted = flat.keys()
    unexpected = sorted(k for k in manifest.keys() if k not in wanted and _in_scope(k, scope))
    if problems:
        raise StateMismatchError(
            f"rank {world.rank}: the state does not match the checkpoint:\n  "
            + "\n  ".join(problems[:20])
            + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        )
    if strict and missing:
        raise MissingKeysError(
            f"rank {world.rank}: keys do not match (strict=True): missing from the checkpoint: {_preview(sorted(missing))}"
            + _structure_hint(manifest, flat, missing)
        )
    return targets, sorted(missing), unexpected


def _structure_hint(manifest: Manifest, flat: FlatState, missing: set[str]) -> str:
    """For a missing key that is one plain value in the state but whose entries the checkpoint stores: say so."""
    keys = sorted(manifest.keys())
    for k in sorted(missing):
        if k not in flat.values:
            continue
        under = [n for n in keys if n.startswith(k + ".")]
        if under:
            return (
                f". '{k}' is one plain value in the state ({type(flat.values[k]).__name__}), but the checkpoint "
                f"stores {len(under)} entries under '{k}.' ({_preview(under, 3)}): give '{k}' the structure that "
                "was saved (a dict holding those names; for an optimizer, tessera.OptimizerState(model, optimizer))"
            )
    return ""


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


def read_bytes(store: Storage, source: str) -> bytes:
    """The bytes of ``manifest.json`` in ``store``, refusing an oversized file before reading it.

    The size is checked with a stat (a HEAD on object stores) first, so a huge or sparse
    file is never read whole, and again on the bytes read (the file may have been replaced
    in between).

    Raises:
        FileNotFoundError: if there is no manifest.
        ManifestError: naming ``source`` if it is over :data:`MAX_MANIFEST_BYTES`.
    """
    try:
        size = store.size(MANIFEST_NAME)
        if size <= MAX_MANIFEST_BYTES:
            data = store.read_file(MANIFEST_NAME)
    except (IsADirectoryError, NotADirectoryError) as e:
        raise ManifestError(f"{source}: invalid manifest: not a regular file ({type(e).__name__})") from None
    if size > MAX_MANIFEST_BYTES:
        raise ManifestError(
            f"{source}: invalid manifest: size {size} bytes is over the {MAX_MANIFEST_BYTES}-byte limit"
        )
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(
            f"{source}: invalid manifest: size {len(data)} bytes is over the {MAX_MANIFEST_BYTES}-byte limit"
        )
    return data
