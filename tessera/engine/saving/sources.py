"""The stage step of a save: the tensors a rank writes, copied into host memory.

The copy runs in the caller's thread (blocking staging) or in the save's background
thread (``StagingMode.BACKGROUND``); either way its result is the staged bytes per file.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..._torch_private import version_counter
from ...errors import CheckpointError, StagingMutationError
from ...format.geometry import Box
from ...results import PendingSave
from ...stateful import GatedStateful
from ..flat_state import FlatState, TensorPiece
from .fingerprint import TileKey, mutation_error
from .handoff import SavePlan
from .staging import StagedTiles, StagingBuffer

Staged = Sequence[Sequence[torch.Tensor]]
"""Host byte views (1-D uint8) per data file, in each file's slot order."""


def _source(pieces: dict[str, list[TensorPiece]], fqn: str, box: Box) -> tuple[torch.Tensor, bool]:
    for p in pieces.get(fqn, ()):
        if all(
            po <= bo and bo + bn <= po + pn
            for po, pn, bo, bn in zip(p.box.offsets, p.box.lengths, box.offsets, box.lengths)
        ):
            rel = box.relative_to(p.box)
            return (p.data[rel.slices()] if p.data.dim() else p.data), p.gated
    raise CheckpointError(f"internal error: no local piece of '{fqn}' holds box {box}")


@dataclass
class Sources:
    """The tensors this rank writes, in the plan's slot order, with their names and whether
    a :class:`~tessera.stateful.GatedStateful` holds their mutations."""

    tensors: list[torch.Tensor]
    names: list[str]
    gated: list[bool]
    keys: list[TileKey]
    """Each tile as the writer reports it (name, box offsets, box lengths)."""


def sources(plan: SavePlan, flat: FlatState) -> Sources:
    """The tensors this rank writes, in the plan's slot order."""
    pieces: dict[str, list[TensorPiece]] = {}
    for p in flat.tensors:
        pieces.setdefault(p.fqn, []).append(p)
    slots = [s for lay in plan.layouts for s in lay.slots]
    found = [_source(pieces, s.fqn, s.box) for s in slots]
    keys = [(s.fqn, s.box.offsets, s.box.lengths) for s in slots]
    return Sources([t for t, _ in found], [s.fqn for s in slots], [g for _, g in found], keys)


def stage(
    plan: SavePlan,
    srcs: list[torch.Tensor],
    buffer: StagingBuffer,
    rank: int,
    *,
    copy: bool,
    after: object | None = None,
) -> Staged:
    """Copy ``srcs`` into ``buffer`` (or use contiguous CPU tensors in place unless ``copy``).

    Raises:
        CheckpointError: naming the rank, if the copy failed.
    """
    try:
        flat_staged = buffer.stage(srcs, copy=copy, after=after)
    except Exception as e:
        raise CheckpointError(f"rank {rank}: staging tensors to host memory failed: {e}") from e
    out = []
    i = 0
    for lay in plan.layouts:
        out.append(flat_staged[i : i + len(lay.slots)])
        i += len(lay.slots)
    return out


class OverlappedCopy:
    """The stage step of a background save, overlapped with the write step.

    :meth:`start` starts a copy thread and returns at once with per-file sequences that wait
    tile by tile, so each file's writer starts on its first tiles while later ones are still
    being copied. A failed copy makes the waiting writers raise its error (naming the rank).
    :meth:`join` waits for the copy thread: the staging buffer is free for the next save
    only after it, also when the save failed before writing everything.
    """

    def __init__(
        self,
        plan: SavePlan,
        srcs: list[torch.Tensor],
        buffer: StagingBuffer,
        rank: int,
        after: object | None,
        on_done: Callable[[], None],
        check: Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], None] | None = None,
    ) -> None:
        self._plan, self._srcs, self._buffer, self._rank = plan, srcs, buffer, rank
        self._after, self._on_done, self._check = after, on_done, check
        self._tiles = StagedTiles(len(srcs))
        self._thread: threading.Thread | None = None
        self._error: CheckpointError | None = None

    def start(self) -> Staged:
        """Start the copy; this rank's staged bytes per file, each tile waiting for its copy."""
        self._thread = threading.Thread(target=self._copy, name="tessera-copy", daemon=True)
        self._thread.start()
        out, i = [], 0
        for lay in self._plan.layouts:
            out.append(self._tiles.part(i, i + len(lay.slots)))
            i += len(lay.slots)
        return out

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def verdict(self) -> None:
        """Wait for the copy; raise what it found (a failed copy, a source changed under it).

        The writers may have written every tile before the check ran; the caller raises
        this before the commit vote, so those files are abandoned, never committed.
        """
        self.join()
        if self._error is not None:
            raise self._error

    def _order(self) -> list[int]:
        """The files' tiles taken in turn (first of each file, then second, ...): every writer
        thread gets its first tile early instead of waiting for the files before its own."""
        starts, i = [], 0
        for lay in self._plan.layouts:
            starts.append((i, len(lay.slots)))
            i += len(lay.slots)
        longest = max((n for _, n in starts), default=0)
        return [s + j for j in range(longest) for s, n in starts if j < n]

    def _copy(self) -> None:
        try:
            staged = self._buffer.stage(
                self._srcs, copy=True, after=self._after, on_staged=self._tiles.put, order=self._order()
            )
            if self._check is not None:
                self._check(self._srcs, staged)  # before the gate opens: a held mutation is no mutation
        except StagingMutationError as e:
            self._error = e
        except Exception as e:
            error = CheckpointError(f"rank {self._rank}: staging tensors to host memory failed: {e}")
            error.__cause__ = e
            self._error = error
            self._tiles.fail(error)  # the writers raise it; the commit step reports it on every rank
        finally:
            self._srcs.clear()  # let the caller's tensors go
            self._on_done()


_SAMPLES = 3
"""Elements sampled per CPU tensor by the ``SAMPLED`` check: the first, the middle, the last."""


@dataclass(frozen=True)
class _Sample:
    """A few elements of one source: their byte offsets in the source and in its staged copy."""

    src_offsets: tuple[int, ...]
    staged_offsets: tuple[int, ...]
    itemsize: int
    expected: bytes


def _sample(src: torch.Tensor) -> _Sample | None:
    """Sampled elements of a CPU tensor, read straight from memory (no torch op: microseconds)."""
    n = src.numel()
    if n == 0 or src.device.type != "cpu":
        return None
    size = src.element_size()
    flat = sorted({0, n // 2, n - 1})[:_SAMPLES]
    src_offsets, staged_offsets = [], []
    for k in flat:
        rest, elem = k, 0
        for dim, stride in zip(reversed(src.shape), reversed(src.stride())):
            rest, i = divmod(rest, dim)
            elem += i * stride
        src_offsets.append(elem * size)
        staged_offsets.append(k * size)
    base = src.data_ptr()
    expected = b"".join(ctypes.string_at(base + off, size) for off in src_offsets)
    return _Sample(tuple(src_offsets), tuple(staged_offsets), size, expected)


def _read(t: torch.Tensor, offsets: Sequence[int], itemsize: int) -> bytes:
    """The bytes at ``offsets`` of ``t``'s memory (no torch op)."""
    base = t.data_ptr()
    return b"".join(ctypes.string_at(base + off, itemsize) for off in offsets)


class MutationCheck:
    """What each source copied in the background was at the ``async_save`` call (the cheap part).

    Taken in the caller's thread before it returns: each source's autograd version counter
    and, for CPU tensors, a few sampled elements (``StagingCheck.SAMPLED``; with the default
    ``FULL``, CPU tensors are fingerprinted instead, see :mod:`.fingerprint`, and only device
    tensors are checked here). :meth:`verify` compares them with the sources and their staged
    copies once the copy is over, before the gate opens, and raises if something changed a
    source first (see :class:`~tessera.options.StagingCheck`).

    Args:
        srcs: the sources, in slot order.
        names: their FQNs (for the error).
        skip: indices of sources checked otherwise: private copies made at the call (nobody
            else can change them), fingerprinted CPU tensors.
    """

    def __init__(self, srcs: list[torch.Tensor], names: list[str], skip: set[int]) -> None:
        self._names = names
        self._checked = [i for i in range(len(srcs)) if i not in skip]
        self._versions = {i: version_counter(srcs[i]) for i in self._checked}
        self._samples = {i: _sample(srcs[i]) for i in self._checked}

    def verify(self, srcs: Sequence[torch.Tensor], staged: Sequence[torch.Tensor], rank: int, path: str) -> None:
        """Raise if a source changed between the call and its copy.

        Args:
            srcs: the sources (still held by the copy).
            staged: their host copies (1-D uint8), in the same order.

        Raises:
            StagingMutationError: naming the first tensor found changed, the rank and the path.
        """
        self._check(srcs, lambda i, sample: _read(staged[i], sample.staged_offsets, sample.itemsize), rank, path)

    def verify_sources(self, srcs: Sequence[torch.Tensor], rank: int, path: str) -> None:
        """:meth:`verify` for copies made piece by piece (a memory budget): the sampled elements
        are read from the sources themselves.

        Raises:
            StagingMutationError: naming the first tensor found changed, the rank and the path.
        """
        self._check(srcs, lambda i, sample: _read(srcs[i], sample.src_offsets, sample.itemsize), rank, path)

    def _check(
        self, srcs: Sequence[torch.Tensor], sampled: Callable[[int, _Sample], bytes], rank: int, path: str
    ) -> None:
        for i in self._checked:
            how = None
            if version_counter(srcs[i]) != self._versions[i]:
                how = "an in-place operation changed it (its version counter moved)"
            elif (sample := self._samples[i]) is not None and sampled(i, sample) != sample.expected:
                how = "its bytes changed through an alias (e.g. .data)"
            if how is not None:
                raise mutation_error([self._names[i]], how, rank, path)


def private_copies(srcs: list[torch.Tensor], which: Sequence[int]) -> None:
    """Replace ``srcs[i]`` for ``i`` in ``which`` by a host copy taken now (the caller's thread).

    For tensors nothing holds back from changing: the background copy then reads the private
    copy, which nobody else can reach, instead of the live tensor.
    """
    for i in which:
        srcs[i] = srcs[i].detach().to("cpu", copy=True)


def hold_mutations(statefuls: list[object], pending: PendingSave) -> None:
    """Let every :class:`~tessera.stateful.GatedStateful` in the state hold its mutations until staged."""
    for obj in statefuls:
        if isinstance(obj, GatedStateful):
            obj.hold_mutations(pending)
