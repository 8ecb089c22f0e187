"""Compare two checkpoints tensor by tensor, streaming block by block with bounded memory.

Tensors present in both with the same shape and dtype are read in matching blocks of at
most ``block_bytes`` from each checkpoint (only the overlapping saved bytes are fetched,
whatever layouts the two were saved in) and compared; nothing else is held in memory. The
``tessera diff`` command is built on :func:`diff_checkpoints`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from ..errors import ManifestError, PickleNotAllowedError
from ..format.dtypes import as_bytes
from ..format.geometry import Box, split_box
from ..format.values import decode_value
from ..storage import Storage
from ._common import Progress, ProgressFn
from .reader import CheckpointReader

logger = logging.getLogger(__name__)


class DiffKind(str, Enum):
    """How an entry differs between checkpoints A and B."""

    ONLY_A = "only_a"
    ONLY_B = "only_b"
    SHAPE = "shape"
    DTYPE = "dtype"
    VALUES = "values"
    KIND = "kind"
    """A tensor in one checkpoint is a plain value in the other."""


@dataclass(frozen=True)
class EntryDiff:
    """One tensor or value that differs.

    Attributes:
        name: the FQN.
        kind: how it differs.
        detail: a short human-readable description (shapes, dtypes, the two values).
        max_abs: largest ``|a - b|`` over the elements (tensors with differing values).
        max_rel: largest ``|a - b| / max(|a|, |b|)``.
        mismatched: elements that differ (beyond the tolerances).
        numel: elements compared.
    """

    name: str
    kind: DiffKind
    detail: str = ""
    max_abs: float | None = None
    max_rel: float | None = None
    mismatched: int = 0
    numel: int = 0


@dataclass(frozen=True)
class DiffReport:
    """The result of :func:`diff_checkpoints`.

    Attributes:
        a, b: the two checkpoints.
        tensors: tensors that differ.
        values: plain and per-rank values that differ.
        same_tensors: tensors identical (within the tolerances).
        same_values: values identical.
        bytes_compared: tensor bytes read from each checkpoint.
        seconds: how long the comparison took.
    """

    a: str
    b: str
    tensors: list[EntryDiff] = field(default_factory=list)
    values: list[EntryDiff] = field(default_factory=list)
    same_tensors: int = 0
    same_values: int = 0
    bytes_compared: int = 0
    seconds: float = 0.0

    @property
    def identical(self) -> bool:
        return not self.tensors and not self.values


def diff_checkpoints(
    a: str,
    b: str,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    storage_a: Storage | None = None,
    storage_b: Storage | None = None,
    block_bytes: int = 16 << 20,
    progress: ProgressFn | None = None,
    strip_a: str | None = None,
    strip_b: str | None = None,
    prefix: str | None = None,
) -> DiffReport:
    """Compare checkpoints ``a`` and ``b``: names, shapes, dtypes, values.

    Names can be mapped first, to compare a training checkpoint with an export of its
    model (``tessera convert ... --prefix model.`` strips ``model.``): ``strip_a="model."``
    compares A's entries under ``model.``, without it, with B's; A's other entries are left
    out. ``prefix`` then keeps only the (mapped) names under it, on both sides. Reported
    names are the mapped ones.

    Two elements are equal when their bits are equal (so NaN equals the same NaN), or when
    ``|a - b| <= atol + rtol * max(|a|, |b|)``. With the default tolerances of 0, any
    difference counts. Single process, no communication; memory is a few ``block_bytes``.

    Args:
        a, b: the checkpoints (any world size and layout each).
        atol, rtol: absolute and relative tolerances.
        storage_a, storage_b: backends to use instead of choosing them from the paths.
        block_bytes: most bytes of one tensor read at once from each checkpoint.
        progress: called with ``(done_bytes, total_bytes)``.
        strip_a, strip_b: compare only the entries of A (of B) under this prefix, without it.
        prefix: compare only the entries (after stripping) whose name starts with this.

    Returns:
        A :class:`DiffReport`; ``report.identical`` when nothing differs.

    Raises:
        CheckpointNotFoundError: if either path holds no committed checkpoint.
        CorruptCheckpointError: for data failing its checksum.

    Example:
        >>> report = diff_checkpoints("/ckpt/a", "/ckpt/b", atol=1e-6)
        >>> [d.name for d in report.tensors]
    """
    t0 = time.monotonic()
    sa = CheckpointReader(a, storage=storage_a)
    sb = CheckpointReader(b, storage=storage_b)
    # {compared name: stored name} per side, for tensors, values and per-rank values.
    ta, tb = _names(sa.manifest.tensors, strip_a, prefix), _names(sb.manifest.tensors, strip_b, prefix)
    va, vb = _names(sa.manifest.values, strip_a, prefix), _names(sb.manifest.values, strip_b, prefix)
    pa, pb = _names(sa.manifest.per_rank, strip_a, prefix), _names(sb.manifest.per_rank, strip_b, prefix)
    report = DiffReport(a, b)
    common = []
    for name in sorted(set(ta) | set(tb)):
        ea = sa.manifest.tensors[ta[name]] if name in ta else None
        eb = sb.manifest.tensors[tb[name]] if name in tb else None
        if ea is None or eb is None:
            other_values = (vb, pb) if ea is None else (va, pa)
            if name in other_values[0] or name in other_values[1]:
                report.tensors.append(
                    EntryDiff(name, DiffKind.KIND, f"a tensor in {'B' if ea is None else 'A'}, a value in the other")
                )
            else:
                kind = DiffKind.ONLY_B if ea is None else DiffKind.ONLY_A
                e = eb if ea is None else ea
                assert e is not None
                report.tensors.append(EntryDiff(name, kind, f"{e.dtype} {list(e.shape)}"))
        elif tuple(ea.shape) != tuple(eb.shape):
            report.tensors.append(EntryDiff(name, DiffKind.SHAPE, f"{list(ea.shape)} vs {list(eb.shape)}"))
        elif ea.dtype != eb.dtype:
            report.tensors.append(EntryDiff(name, DiffKind.DTYPE, f"{ea.dtype} vs {eb.dtype}"))
        else:
            common.append(name)
    prog = Progress(sum(sa.nbytes(ta[n]) for n in common), progress)
    same = 0
    for name in common:
        d = _diff_tensor(sa, sb, name, ta[name], tb[name], atol, rtol, block_bytes, prog)
        if d is None:
            same += 1
        else:
            report.tensors.append(d)
    ma, mb = sa.manifest, sb.manifest
    same_values = _diff_values(
        {k: ma.values[o] for k, o in va.items()}, {k: mb.values[o] for k, o in vb.items()}, "", report, ta, tb
    )
    same_values += _diff_values(
        {k: list(ma.per_rank[o].values) for k, o in pa.items()}, {k: list(mb.per_rank[o].values) for k, o in pb.items()},
        "per-rank ", report, ta, tb,
    )  # fmt: skip
    return dataclasses.replace(
        report, same_tensors=same, same_values=same_values, bytes_compared=prog.done, seconds=time.monotonic() - t0
    )


def _names(entries: object, strip: str | None, prefix: str | None) -> dict[str, str]:
    """``{compared name: stored name}``: under ``strip`` (removed), then under ``prefix``."""
    out = {}
    for n in entries:  # type: ignore[attr-defined]
        if strip:
            if not n.startswith(strip) or len(n) == len(strip):
                continue
            key = n[len(strip) :]
        else:
            key = n
        if not prefix or key.startswith(prefix):
            out[key] = n
    return out


def _diff_tensor(
    sa: CheckpointReader, sb: CheckpointReader, name: str, name_a: str, name_b: str, atol: float, rtol: float,
    block_bytes: int, prog: Progress,
) -> EntryDiff | None:  # fmt: skip
    dtype = sa.dtype(name_a)
    shape = sa.shape(name_a)
    size = torch.empty((), dtype=dtype).element_size()
    max_abs = 0.0
    max_rel = 0.0
    mismatched = 0
    for box in split_box(Box.whole(shape), size, block_bytes):
        if box.is_empty():
            continue
        xa = sa.read(name_a, box)
        xb = sb.read(name_b, box)
        prog.advance(box.numel * size)
        if torch.equal(as_bytes(xa.contiguous()), as_bytes(xb.contiguous())):
            continue
        diff, rel, bad = _compare(xa, xb, atol, rtol)
        max_abs = max(max_abs, diff)
        max_rel = max(max_rel, rel)
        mismatched += bad
    if mismatched == 0:
        return None
    n = math.prod(shape)
    return EntryDiff(name, DiffKind.VALUES, f"{mismatched} of {n} elements differ", max_abs, max_rel, mismatched, n)


def _compare(xa: torch.Tensor, xb: torch.Tensor, atol: float, rtol: float) -> tuple[float, float, int]:
    """``(max |a-b|, max relative difference, elements beyond the tolerances)`` of one block."""
    if xa.dtype == torch.bool:
        bad = int((xa != xb).sum())
        return float(bad > 0), float(bad > 0), bad
    wide = torch.complex128 if xa.is_complex() else torch.float64
    a, b = xa.to(wide).reshape(-1), xb.to(wide).reshape(-1)
    same_bits = (
        as_bytes(xa.contiguous()).view(-1, xa.element_size()) == as_bytes(xb.contiguous()).view(-1, xa.element_size())
    ).all(dim=1)
    diff = (a - b).abs()
    diff = torch.where(same_bits, torch.zeros_like(diff), diff)
    diff = torch.nan_to_num(diff, nan=math.inf)  # NaN against a number
    scale = torch.maximum(a.abs(), b.abs())
    rel = torch.where(diff == 0, torch.zeros_like(diff), diff / scale)
    rel = torch.nan_to_num(rel, nan=math.inf)
    bad = int((diff > atol + rtol * torch.nan_to_num(scale, nan=0.0)).sum())
    return float(diff.max()), float(rel.max()), bad


def _diff_values(va: dict, vb: dict, what: str, report: DiffReport, tensors_a: dict, tensors_b: dict) -> int:
    same = 0
    for name in sorted(set(va) | set(vb)):
        if name in va and name in vb:
            if va[name] == vb[name]:  # the encoded JSON forms compare exactly
                same += 1
            else:
                report.values.append(
                    EntryDiff(name, DiffKind.VALUES, f"{what}{_show(va[name], name)} vs {_show(vb[name], name)}")
                )
        elif name not in (tensors_b if name in va else tensors_a):
            kind = DiffKind.ONLY_A if name in va else DiffKind.ONLY_B
            report.values.append(EntryDiff(name, kind, f"{what}{_show(va.get(name, vb.get(name)), name)}"))
    return same


def _show(encoded: object, name: str, n: int = 60) -> str:
    """A short display of an encoded value (decoded when that needs no pickle)."""
    try:
        text = repr(decode_value(encoded, name, allow_pickle=False))
    except (PickleNotAllowedError, ManifestError):
        text = "<pickled>"
    return text if len(text) <= n else text[: n - 3] + "..."
