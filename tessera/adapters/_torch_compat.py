"""Private torch internals the framework adapters rely on, each with the reason.

``tessera/_torch_private.py`` isolates the private torch APIs of the core; this module does
the same for the adapters, so that a torch upgrade breaks at most these two files. Each
use is named here with why no public API serves:

- ``_StridedShard`` (FSDP2 over tensor parallel on one dim): the placement class is
  private. We only read its ``dim`` and ``split_factor`` and reproduce torch's index
  arithmetic, to find the box a rank's local shard covers without any communication.
- FSDP1 flat parameters: ``module._handle.flat_param`` with ``_fqns``, ``_shapes``,
  ``_shard_param_infos`` and ``_params``. torch's public sharded state dict for FSDP1
  all-gathers every flat parameter and re-chunks it; these attributes say which range of
  each original parameter a rank's flat shard holds, so it can be saved as-is.
- Module-wrapper prefixes (``_fsdp_wrapped_module.`` and friends) are torch constants in
  private modules; they are spelled out here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from .. import _torch_private
from ..format.geometry import Box

WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
"""Name parts that FSDP1, activation checkpointing and torch.compile add to FQNs."""


def clean_fqn(name: str) -> str:
    """``name`` without the wrapper parts torch inserts (``a._fsdp_wrapped_module.b`` -> ``a.b``)."""
    for p in WRAPPER_PREFIXES:
        name = name.replace(p, "")
    return name


# --------------------------------------------------------------------------------------
# DTensor placements that are not plain Shard/Replicate


def is_strided_shard(placement: object) -> bool:
    """Whether ``placement`` is torch's private ``_StridedShard``."""
    return type(placement).__name__ == "_StridedShard"


def has_strided_shard(dt: DTensor) -> bool:
    return any(is_strided_shard(p) for p in dt.placements)


def _take(runs: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """Positions ``[lo, hi)`` of the concatenation of ``runs`` (a list of index ranges)."""
    out = []
    pos = 0
    for a, b in runs:
        n = b - a
        s, e = max(lo - pos, 0), min(hi - pos, n)
        if s < e:
            out.append((a + s, a + e))
        pos += n
        if pos >= hi:
            break
    return out


def _length(runs: list[tuple[int, int]]) -> int:
    return sum(b - a for a, b in runs)


def _chunk(lo_hi_len: int, n: int, i: int) -> tuple[int, int]:
    """torch.chunk semantics: piece ``i`` of ``n`` of a length, as ``[lo, hi)``."""
    size = -(-lo_hi_len // n) if lo_hi_len else 0
    lo = min(i * size, lo_hi_len)
    return lo, min(lo + size, lo_hi_len)


def strided_local_box(dt: DTensor, name: str) -> Box:
    """The box a DTensor's local shard covers when some placement is ``_StridedShard``.

    torch applies placements left to right on index lists: ``Shard(d)`` keeps chunk ``c``
    of the current indices of dim ``d``; ``_StridedShard(d, split_factor=k)`` first cuts
    them into ``k`` chunks and keeps chunk ``c`` of each (the FSDP shard of each TP shard).
    For FSDP2 over TP the result is one contiguous range per dim, i.e. a box.

    Raises:
        ValueError: for Partial placements, or if the local shard is not one box.
    """
    shape = tuple(int(s) for s in dt.shape)
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError(f"tensor '{name}': this rank is not part of the DTensor's device mesh")
    runs: list[list[tuple[int, int]]] = [[(0, s)] for s in shape]
    for mesh_dim, p in enumerate(dt.placements):
        if isinstance(p, Partial):
            # ValueError like tessera._torch_private: the value, not its type, is unsupported
            raise ValueError(f"tensor '{name}' has a Partial placement ({dt.placements}); reduce it before saving")
        if isinstance(p, Replicate):
            continue
        if not isinstance(p, Shard) and not is_strided_shard(p):  # _StridedShard is no Shard subclass
            raise ValueError(f"tensor '{name}' has a placement tessera cannot describe ({dt.placements})")
        dim: int = p.dim  # type: ignore[attr-defined]  # Shard or _StridedShard
        d = dim if dim >= 0 else dim + len(shape)
        n, c = mesh.size(mesh_dim), coord[mesh_dim]
        cur = runs[d]
        length = _length(cur)
        if is_strided_shard(p):
            k = int(p.split_factor)  # type: ignore[attr-defined]  # _StridedShard's own attribute
            picked: list[tuple[int, int]] = []
            for s in range(k):
                a, b = _chunk(length, k, s)
                lo, hi = _chunk(b - a, n, c)
                picked += _take(cur, a + lo, a + hi)
            runs[d] = picked
        elif isinstance(p, Shard):
            runs[d] = _take(cur, *_chunk(length, n, c))
        else:
            raise ValueError(f"tensor '{name}': unsupported DTensor placement {p!r}")
    offsets, lengths = [], []
    for d, r in enumerate(runs):
        merged: list[tuple[int, int]] = []
        for a, b in r:
            if merged and merged[-1][1] == a:
                merged[-1] = (merged[-1][0], b)
            elif b > a:
                merged.append((a, b))
        if len(merged) > 1:
            raise ValueError(
                f"tensor '{name}': its placements {dt.placements} give this rank (mesh coordinate {coord}) "
                f"the indices {merged} of dim {d}, which is not one box; tessera cannot describe it. "
                "Redistribute it to Shard/Replicate placements before saving"
            )
        offsets.append(merged[0][0] if merged else 0)
        lengths.append(merged[0][1] - merged[0][0] if merged else 0)
    box = Box(tuple(offsets), tuple(lengths))
    local_shape = tuple(_torch_private.local_tensor(dt).shape)
    if local_shape != box.lengths:
        raise ValueError(
            f"tensor '{name}': local shard has shape {list(local_shape)} but its placements "
            f"{dt.placements} give {list(box.lengths)}"
        )
    return box


# --------------------------------------------------------------------------------------
# FSDP1 flat parameters


@dataclass(frozen=True)
class FlatPiece:
    """One original parameter's part of a rank's shard of an FSDP1 flat parameter.

    Attributes:
        fqn: the parameter's name relative to the FSDP unit's wrapped module.
        shape: the parameter's full shape.
        offset: where its elements start in the rank's flat shard (0 if none held).
        numel: how many of its elements the rank holds (0 if none).
        flat_start: index of the first held element in the flattened parameter.
        orig_param: with ``use_orig_params=True``, the original parameter object (a 1-D
            view of exactly the held elements); else None.
    """

    fqn: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    flat_start: int
    orig_param: nn.Parameter | None


@dataclass(frozen=True)
class FlatUnit:
    """An FSDP1 unit: its module name in the wrapped model, flat parameter and pieces."""

    module_name: str
    flat_param: nn.Parameter
    pieces: tuple[FlatPiece, ...]
    use_orig_params: bool


def fsdp1_units(model: nn.Module) -> Iterator[FlatUnit]:
    """The FSDP1 units inside ``model`` (none if it does not use FSDP1)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without FSDP1
        return
    for name, mod in model.named_modules():
        if not isinstance(mod, FullyShardedDataParallel):
            continue
        handle = getattr(mod, "_handle", None)
        if handle is None:
            continue
        fp = handle.flat_param
        uop = bool(getattr(handle, "_use_orig_params", False))
        origs = getattr(fp, "_params", None) if uop else None
        pieces = []
        for i, (fqn, shape, info) in enumerate(zip(fp._fqns, fp._shapes, fp._shard_param_infos)):
            held = bool(info.in_shard)
            pieces.append(
                FlatPiece(
                    fqn=clean_fqn(fqn),
                    shape=tuple(int(s) for s in shape),
                    offset=int(info.offset_in_shard) if held else 0,
                    numel=int(info.numel_in_shard) if held else 0,
                    flat_start=int(info.intra_param_start_idx) if held else 0,
                    orig_param=origs[i] if origs is not None else None,
                )
            )
        yield FlatUnit(name, fp, tuple(pieces), uop)


def compiled_inner(model: nn.Module) -> nn.Module | None:
    """The module a ``torch.compile`` wrapper holds, or None.

    ``OptimizedModule._orig_mod`` is the only way to reach it; torch has no public accessor.
    """
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else None


def persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The module's own (non-recursive) persistent buffers: those its state_dict saves.

    ``_non_persistent_buffers_set`` is private; the public alternative (diffing
    ``state_dict()`` keys) would materialize full tensors for FSDP/DTensor modules.
    """
    skip: set[str] = getattr(module, "_non_persistent_buffers_set", set())
    for name, buf in module.named_buffers(recurse=False):
        if buf is not None and name not in skip:
            yield name, buf
