"""Checking a load target against the manifest before any byte is copied, and the values it takes."""

from __future__ import annotations

import logging
from typing import Any

from ...errors import MissingKeysError, StateMismatchError
from ...format.dtypes import dtype_from_name
from ...format.geometry import Box
from ...format.manifest import Manifest
from ...format.values import decode_value
from ...shards import OnResize
from ..dist import World
from ..flat_state import FlatState, dotted_parents
from .read import ReadTarget

logger = logging.getLogger(__name__)


def _scope(state: object) -> list[str] | None:
    """Top-level keys whose subtrees ``load`` checks for unexpected checkpoint keys."""
    if isinstance(state, dict):
        return [str(k) for k in state]
    return None


def _in_scope(key: str, scope: list[str] | None) -> bool:
    return scope is None or any(key == s or key.startswith(s + ".") for s in scope)


def warn_skipped(
    world: World, path: str, missing: list[str], unexpected: list[str], spare: list[str] | None = None
) -> None:
    """``strict=False``: say what the load leaves out, so that it never skips state silently.

    Missing keys differ by rank (each rank says its own); unexpected keys are the same on
    every rank (rank 0 says them). ``spare`` (the checkpoint's keys the state does not ask
    for, under any top-level key) adds where the missing keys may be, as the strict error does.
    """
    unexpected = unexpected if world.is_coordinator else []
    if not missing and not unexpected:
        return
    parts = []
    if missing:
        parts.append(
            f"{len(missing)} key(s) of the state are not in the checkpoint and keep their values: {preview(missing)}"
        )
    if unexpected:
        parts.append(f"{len(unexpected)} key(s) of the checkpoint are not in the state: {preview(unexpected)}")
    if missing and spare:
        parts[-1] += counterpart_hint(missing, spare)
    logger.warning(
        "rank %d: loading %s with strict=False skipped %s (LoadResult.missing_keys / unexpected_keys list them)",
        world.rank,
        path,
        "; ".join(parts),
    )


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


def validate(
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
            f"rank {world.rank}: keys do not match (strict=True): missing from the checkpoint: {preview(sorted(missing))}"
            + _structure_hint(manifest, flat, missing)
            + counterpart_hint(sorted(missing), [k for k in manifest.keys() if k not in wanted])
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
                f"stores {len(under)} entries under '{k}.' ({preview(under, 3)}): give '{k}' the structure that "
                "was saved (a dict holding those names; for an optimizer, tessera.OptimizerState(model, optimizer))"
            )
    return ""


def counterpart_hint(missing: list[str], spare: list[str]) -> str:
    """Where the checkpoint keeps what the state misses: a prefix that explains them, or the nearest names.

    ``spare`` holds the checkpoint's keys the state does not ask for (under any top-level key).
    A prefix explains the missing keys when the checkpoint holds them under it (DCP's tutorial
    layout ``{"app": AppState}``: ``app.model.w`` for ``model.w``) or without it; otherwise
    the nearest spare names are shown, one per missing key (a rename that went astray).
    """
    if not missing or not spare:
        return ""
    spare_set = set(spare)
    extra: dict[str, int] = {}  # the checkpoint has PREFIX + missing key
    short: dict[str, int] = {}  # the checkpoint has the missing key without PREFIX
    by_leaf: dict[str, list[str]] = {}
    for k in spare:
        for i in range(len(k)):
            if k[i] == "." and i + 1 < len(k):
                by_leaf.setdefault(k[i + 1 :], []).append(k[: i + 1])
    for m in missing:
        for prefix in set(by_leaf.get(m, ())):
            extra[prefix] = extra.get(prefix, 0) + 1
        for i in range(len(m)):
            if m[i] == "." and m[i + 1 :] in spare_set:
                short[m[: i + 1]] = short.get(m[: i + 1], 0) + 1
    half = (len(missing) + 1) // 2
    best = max(extra.items(), key=lambda kv: (kv[1], -len(kv[0])), default=None)
    if best is not None and best[1] >= half:
        p, n = best
        return (
            f". The checkpoint holds {n} of the {len(missing)} missing keys under '{p}' ('{p}{missing[0]}'): "
            f"nest the state under it ({{'{p[:-1]}': ...}}), or rename the checkpoint's keys once with "
            f"`tessera rename CKPT --map {p}=`"
        )
    best = max(short.items(), key=lambda kv: (kv[1], len(kv[0])), default=None)
    if best is not None and best[1] >= half:
        p, n = best
        return (
            f". The checkpoint holds {n} of the {len(missing)} missing keys without the prefix '{p}' "
            f"('{missing[0][len(p) :]}' for '{missing[0]}'): pass the state's '{p[:-1]}' entries at its top level, or "
            f"rename the checkpoint's keys once with `tessera rename CKPT --regex '^={p}'`"
        )
    import difflib

    pairs = []
    for m in missing[:5]:
        leaf = m.rsplit(".", 1)[-1]
        pool = spare if len(spare) <= 5000 else [k for k in spare if k.rsplit(".", 1)[-1] == leaf][:5000]
        near = difflib.get_close_matches(m, pool, n=1, cutoff=0.6)
        if near:
            pairs.append(f"'{near[0]}' (for '{m}')")
    if not pairs:
        return f". The checkpoint holds {len(spare)} key(s) the state does not ask for: {preview(sorted(spare), 5)}"
    return f". Nearest keys the checkpoint holds and the state does not ask for: {', '.join(pairs)}"


def preview(keys: list[str], n: int = 10) -> str:
    shown = ", ".join(f"'{k}'" for k in keys[:n])
    return shown + (f" ... ({len(keys)} in all)" if len(keys) > n else "")


def lookup_value(manifest: Manifest, key: str, world: World, allow_pickle: bool) -> tuple[bool, Any]:
    if key in manifest.values:
        return True, decode_value(manifest.values[key], key, allow_pickle=allow_pickle)
    entry = manifest.per_rank.get(key)
    if entry is not None:
        src = _saved_rank(manifest, key, entry.on_resize, world)
        if src is None:
            return False, None
        return True, decode_value(entry.values[src], key, allow_pickle=allow_pickle)
    return False, None
