"""Replicated tensors whose copies differ between ranks, caught before the commit.

A plain tensor held by several ranks is one replicated global tensor (DDP weights, an optimizer
``step``): its holders each write a slab of their own copy (:func:`.plan.derive_rank_plan`), so
copies that differ would commit a tensor no rank ever held. Each rank therefore digests its whole
copy of every plain tensor it holds, in the caller's thread at the call (the state at the call,
as the copy sees it), and puts the digests in its rank report (:mod:`tessera.format.rank_report`);
rank 0 compares them while it assembles the manifest and, on a difference, fails the save on every
rank with :class:`~tessera.errors.ReplicaMismatchError` naming each tensor and which ranks hold
which copy. No collective carries more than before: the reports travel through storage. The
digests are taken at every save, whether its plan was cached, derived or gathered: they describe
the values, which change from save to save, not the layout. Only a plain tensor that a cached
gathered plan shows one rank alone to hold (a pipeline stage's weights) is not digested: no other
copy exists to differ from it, and a rank whose structure changes has no cached plan.

Digests are of the bytes, so ``NaN`` payloads and ``-0.0`` against ``0.0`` count as different, and
equal copies (``NaN`` included) always agree. A copy in host memory is digested with xxh3-64 (about
10 GB/s); a copy on an accelerator with torch reductions on its device (two position-weighted
sums), so no byte leaves the device but the 8-byte result, read when the report is written. The
two kinds are not comparable: copies of one tensor held on different kinds of device are compared
within each kind. Not checked: DTensors (``Replicate`` placements are replicated by construction),
``ShardedTensor`` / ``FlatShard`` boxes (the caller stated their geometry) and
:func:`tessera.per_rank` values (rank-local by definition).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from ...errors import ReplicaMismatchError
from ..flat_state import FlatState

_DEVICE = np.uint64(1 << 63)
"""The top bit of a digest computed on an accelerator (the other kind has it clear)."""
_LOW63 = (1 << 63) - 1
_PIECE_BYTES = 16 << 20
"""Host copies larger than this are digested piece by piece (see :func:`host_digest`)."""
_PARALLEL_BYTES = 32 << 20
"""Below this many host bytes in all, digesting in the caller's thread beats starting threads."""
_CHUNK_WORDS = 1 << 24
"""Words digested per step on a device: bounds the temporaries (64 MiB of int32)."""
_K = 0x2545F491  # odd: position weights 2*(i*K mod 2**31)+1 are odd, so one changed word always shows
_C = 0x9E3779B97F4A7C15 - (1 << 64)  # mixes the plain sum into the weighted one (as int64)


@dataclass(frozen=True, eq=False)
class ReplicaDigests:
    """A rank's digests of its copies of plain tensors, by name (resolved once, off the caller's thread)."""

    names: tuple[str, ...]
    host: list[int | None]
    """The host copies' digests; None where the copy is on a device (see ``device``)."""
    device: dict[torch.device, tuple[list[int], torch.Tensor]]
    """Per device: the indices into ``names`` and the digests, still on the device."""

    def resolve(self) -> np.ndarray:
        """The digests as uint64, in the order of ``names`` (reads each device's few bytes once)."""
        out = np.array([0 if d is None else d for d in self.host], dtype=np.uint64)
        for index, digests in self.device.values():
            out[index] = digests.cpu().numpy().view(np.uint64) | _DEVICE
        return out


def digest_replicas(
    flat: FlatState, world_size: int, threads: int = 1, unshared: frozenset[str] = frozenset()
) -> ReplicaDigests | None:
    """The digests of this rank's plain tensors (copies of replicated tensors); None in a single process.

    ``unshared`` names tensors the save's plan knows no other rank holds (a pipeline stage's own
    weights): their copies have nothing to be compared with and are not digested.

    Runs in the caller's thread: device digests are queued on the current stream, behind the
    caller's work, so they see the state at the call. Host copies of :data:`_PARALLEL_BYTES` or
    more in all are digested by ``threads`` threads (xxh3 releases the GIL).
    """
    pieces = [p for p in flat.tensors if p.replicated_copy and p.fqn not in unshared]
    if world_size < 2 or not pieces:
        return None
    host: list[int | None] = [None] * len(pieces)
    on_host = [i for i, p in enumerate(pieces) if p.data.device.type == "cpu"]
    on_device: dict[torch.device, tuple[list[int], list[torch.Tensor]]] = {}
    for i, p in enumerate(pieces):
        if p.data.device.type != "cpu":
            index, digests = on_device.setdefault(p.data.device, ([], []))
            index.append(i)
            digests.append(device_digest(p.data))
    total = sum(pieces[i].data.numel() * pieces[i].data.element_size() for i in on_host)
    if threads > 1 and total >= _PARALLEL_BYTES and len(on_host) > 0:
        with ThreadPoolExecutor(threads, thread_name_prefix="tessera-replicas") as pool:
            for i, d in zip(on_host, pool.map(lambda i: host_digest(pieces[i].data, pool), on_host)):
                host[i] = d
    else:
        for i in on_host:
            host[i] = host_digest(pieces[i].data)
    device = {d: (index, torch.stack(ds)) for d, (index, ds) in on_device.items()}
    return ReplicaDigests(tuple(p.fqn for p in pieces), host, device)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in logical (row-major) order, as a flat uint8 tensor."""
    t = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def host_digest(t: torch.Tensor, pool: ThreadPoolExecutor | None = None) -> int:
    """The digest of a host tensor's bytes, top bit clear: xxh3-64 of them, or, past
    :data:`_PIECE_BYTES`, xxh3-64 of the xxh3-64s of its fixed-size pieces (hashed in ``pool`` when
    given), so that equal copies digest alike however many threads each rank uses."""
    data = _bytes(t).numpy().data
    if len(data) <= _PIECE_BYTES:
        return xxhash.xxh3_64_intdigest(data) & _LOW63
    views = [data[j : j + _PIECE_BYTES] for j in range(0, len(data), _PIECE_BYTES)]
    sums = (
        list(pool.map(xxhash.xxh3_64_intdigest, views))
        if pool is not None
        else [xxhash.xxh3_64_intdigest(v) for v in views]
    )
    return xxhash.xxh3_64_intdigest(np.array(sums, dtype="<u8").tobytes()) & _LOW63


def device_digest(t: torch.Tensor) -> torch.Tensor:
    """A position-sensitive 64-bit digest of ``t``'s bytes, computed on ``t``'s device (an int64 scalar there).

    The bytes are read as 32-bit words (16- or 8-bit where the byte count is not a multiple of
    4); the digest is ``C * sum(w) + sum(w * m(i))`` with odd position weights ``m(i)``, all
    wrapping, so any single changed word, and almost any reordering, changes it.
    """
    raw = _bytes(t)
    n = raw.numel()
    words = raw.view(torch.int32) if n % 4 == 0 else raw.view(torch.int16) if n % 2 == 0 else raw
    plain = torch.zeros((), dtype=torch.int64, device=t.device)
    weighted = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, words.numel(), _CHUNK_WORDS):
        w = words[start : start + _CHUNK_WORDS].to(torch.int32)
        pos = torch.arange(start, start + w.numel(), dtype=torch.int64, device=t.device)
        m = ((pos * _K) & 0x7FFFFFFF) * 2 + 1
        plain += w.sum(dtype=torch.int64)
        weighted += (w.to(torch.int64) * m).sum()
    return plain * _C + weighted


def check_replicas(path: str, reports: Sequence[tuple[tuple[str, ...], np.ndarray] | None]) -> None:
    """Rank 0: raise if two ranks reported different copies of one plain tensor.

    Args:
        path: the checkpoint, for the message.
        reports: per rank, its ``(names, digests)`` (None: it holds no plain tensor).

    Raises:
        ReplicaMismatchError: naming each tensor whose copies differ and the ranks of each copy.
    """
    first = next((r for r in reports if r is not None), None)
    if first is None:
        return
    if all(r is not None and r[0] == first[0] and np.array_equal(r[1], first[1]) for r in reports):
        return  # the common case: every rank holds the same tensors, alike
    copies: dict[str, dict[int, list[int]]] = {}  # name -> digest -> ranks
    for rank, r in enumerate(reports):
        if r is not None:
            for name, digest in zip(r[0], r[1].tolist()):
                copies.setdefault(name, {}).setdefault(digest, []).append(rank)
    differ = {}
    for name, by_digest in copies.items():
        kinds = {d >> 63 for d in by_digest}
        if any(sum(1 for d in by_digest if d >> 63 == k) > 1 for k in kinds):
            differ[name] = sorted(by_digest.values())
    if not differ:
        return
    lines = [
        f"  '{name}': " + "; ".join(f"ranks {_ranks(rs)} hold one copy" for rs in groups)
        for name, groups in sorted(differ.items())[:20]
    ]
    more = f"\n  ... and {len(differ) - 20} more" if len(differ) > 20 else ""
    raise ReplicaMismatchError(
        f"not committing {path}: {len(differ)} replicated tensor(s) differ between ranks (a plain tensor held by "
        "several ranks is one replicated global tensor, and its holders each write a part of their own copy):\n"
        + "\n".join(lines)
        + more
        + "\nMake the copies equal (broadcast them from one rank), or save a rank-local value with "
        "tessera.per_rank(...) or a slice with tessera.ShardedTensor. Nothing was committed; the previous "
        "checkpoint is unchanged"
    )


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" (+{len(ranks) - 8} more)" if len(ranks) > 8 else "")
