"""Option dataclasses for save and load, grouped by concern."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeVar

from . import _knobs

_M = TypeVar("_M", bound=Enum)


class StagingMode(str, Enum):
    """When ``async_save`` copies the state to host memory.

    ``AUTO`` (the default): tensors held by a gated Stateful (:class:`~tessera.ModelState`,
    :class:`~tessera.OptimizerState`, or your own object implementing
    :class:`~tessera.stateful.GatedStateful`) are copied in the background while training goes
    on, and the calls that change them (``optimizer.step()``, ``load_state_dict``, and the
    model's forward pass unless every saved model tensor is a parameter a saved
    ``OptimizerState`` steps and the forward writes none) wait until their bytes are in host
    memory. Every other tensor (raw
    ``model.state_dict()`` / ``optimizer.state_dict()`` tensors, a tensor in a plain dict) is
    copied before ``async_save`` returns, as ``torch.distributed.checkpoint.async_save`` does:
    nothing holds the loop back from changing those.
    ``BACKGROUND``: every tensor is copied in the background, raw ones too. An explicit
    opt-in: the caller promises not to modify a saved tensor before
    :meth:`PendingSave.wait_staged` returns (the mutation check of
    ``SaveOptions.check_staging`` fails the save loudly where it sees a broken promise).
    ``BLOCKING``: ``async_save`` returns after the whole copy (the state may change at once).
    """

    AUTO = "auto"
    BACKGROUND = "background"
    BLOCKING = "blocking"


class StagingCheck(str, Enum):
    """How a save copied in the background checks that nothing changed the state meanwhile.

    The check compares what a tensor was at the ``async_save`` call with what was copied;
    a difference fails the save on every rank with
    :class:`~tessera.errors.StagingMutationError` naming the tensor and the rank, instead of
    committing a checkpoint that mixes two moments.

    ``FULL`` (the default): for CPU tensors, a fingerprint taken in the call (the xxh3-64 of
    every chunk of their bytes, hashed by several threads for large states), compared with
    the checksums the writer computes from the copy it writes: any byte changed after the
    call and before its copy fails the save, whatever wrote it (``.data``, ``detach()``, a
    NumPy view, an in-place kernel still running when the copy ended), with no timing
    assumption. Costs one hash pass over the CPU bytes in the call (about 10 GB/s per
    thread). For device tensors, every tensor's autograd version counter (bumped by any
    in-place op on the tensor, a view or a ``detach()`` of it, at the op's launch): it
    cannot see a write through an alias with a version counter of its own (``.data``, a
    DLPack view) by a kernel launched after the call.
    ``SAMPLED``: version counters for every tensor, plus, for CPU tensors, a few sampled
    elements compared byte for byte. Costs microseconds per tensor at the call. It cannot
    see an alias write on CPU that leaves the sampled elements alone (``p.data[3] = 0``),
    nor an in-place CPU kernel still running when the copy ends.
    ``OFF``: no check.
    """

    SAMPLED = "sampled"
    FULL = "full"
    OFF = "off"


class WriterMode(str, Enum):
    """Where a save's data files are written, checksummed and fsync'ed.

    ``THREAD``: by threads of the saving process (``SaveOptions.io_threads`` of them).
    ``PROCESS``: by a long-lived writer process per training process, fed from shared memory
    (see :mod:`tessera.engine.saving.writer_process`), so background writes never take the training loop's
    GIL; the bytes are copied into the shared arena first. Only local filesystems
    (:class:`~tessera.storage.local.FileStorage`) are written from the writer process; other
    backends fall back to threads. Planning and the commit stay in the saving process.
    A writer process that makes no progress for ``TESSERA_WRITER_TIMEOUT_S`` seconds
    (stopped, or stuck in I/O) is killed and the save fails with
    :class:`~tessera.errors.StorageError` on every rank; its shared memory never outlives
    the two processes.
    """

    THREAD = "thread"
    PROCESS = "process"


@dataclass(frozen=True)
class PlanOptions:
    """Knobs of the global planner."""

    min_split_bytes: int = 256 << 10
    """Replicated boxes are split into pieces of about a quarter of each rank's fair share
    (total bytes / world size), but never smaller than this, so that several holders share
    the writing evenly without creating tiny tiles."""
    files_per_rank: int = 4
    """At most this many data files per rank, so that a rank's writes run in parallel."""
    min_file_bytes: int = 64 << 20
    """A rank opens another file only when each would still hold at least this much."""


@dataclass(frozen=True)
class SaveOptions:
    """How a save runs. Defaults suit most jobs; environment knobs override some of them."""

    io_threads: int = field(default_factory=_knobs.io_threads)
    """Threads per rank writing data files."""
    chunk_bytes: int = 0
    """Checksum granularity: a load reads and verifies whole chunks of this size, and decodes whole
    chunks of a compressed tile. 0 (the default) means 4 MiB, or 256 KiB where ``compress`` is
    on or ``"auto"``; knob ``TESSERA_CHUNK_BYTES``. A save that may compress cuts a tile smaller
    than 32 of these chunks into 32 to 64 smaller ones (32 KiB at least), so that a resharded
    read decodes a small fraction more than it needs of a small tile (docs/compression.md)."""
    plan: PlanOptions = field(default_factory=PlanOptions)
    """Planner knobs (replica splitting, files per rank)."""
    layout: dict[str, Any] = field(default_factory=dict)
    """Free-form description of the saving job's layout (mesh shape, TP/PP sizes), stored
    in the manifest for information; loading never depends on it."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """User metadata stored in the manifest (JSON values)."""
    staging: StagingMode = field(default_factory=lambda: _staging_mode(_knobs.staging_mode()))
    """When ``async_save`` copies to host memory (:class:`StagingMode`, default ``AUTO``;
    knob ``TESSERA_STAGING``). ``tessera.save`` always stages before it writes."""
    check_staging: StagingCheck = field(default_factory=lambda: _staging_check(_knobs.check_staging()))
    """How tensors copied in the background are checked for changes made before their copy
    (:class:`StagingCheck`, default ``FULL``; knob ``TESSERA_CHECK_STAGING``). ``True``
    means ``FULL`` and ``False`` means ``OFF``."""
    writer: WriterMode = field(default_factory=lambda: _writer_mode(_knobs.writer_mode()))
    """Who writes the data files (:class:`WriterMode`; knob ``TESSERA_WRITER``)."""
    max_staging_bytes: int | str | None = field(default_factory=_knobs.max_staging_bytes)
    """Host-memory budget of a save (bytes, or a size such as ``"1GiB"``; knob
    ``TESSERA_MAX_STAGING_BYTES``): when the tensors a save would copy to host memory (all of
    an ``async_save``'s; a sync save's GPU or strided ones) hold more, they stream through
    reused buffers of this many bytes in all instead of one full host copy. Gated tensors'
    mutations stay held until their last byte has been copied; for tensors nothing holds back
    (a raw ``state_dict()``), the call itself returns only then (docs/manager.md, "Async saves
    in a memory budget"). None: one full copy, as fast as the copy allows."""
    compress: bool | str = field(default_factory=_knobs.compress)
    """Store tiles compressed, losslessly (knob ``TESSERA_COMPRESS``, default off): each checksum
    chunk byte-shuffled by item size and coded with zstd (blosc2), or kept raw where that does
    not shrink it; a load decodes only the chunks it reads (docs/compression.md). ``"auto"``: each
    rank codes its files where its writes measured the codec faster than the storage (object
    stores, network filesystems), and writes them plain where the storage is faster (a local
    NVMe disk); a rank's first save to a root is plain, to measure it."""

    def __post_init__(self) -> None:
        if self.max_staging_bytes is not None:
            budget = parse_size(self.max_staging_bytes)
            if budget < 4096:
                raise ValueError(
                    f"SaveOptions.max_staging_bytes must be at least 4 KiB, got {self.max_staging_bytes!r}"
                )
            object.__setattr__(self, "max_staging_bytes", budget)
        object.__setattr__(self, "staging", _staging_mode(self.staging))
        object.__setattr__(self, "check_staging", _staging_check(self.check_staging))
        object.__setattr__(self, "writer", _writer_mode(self.writer))
        if self.compress not in (True, False, "auto"):
            raise ValueError(f"SaveOptions.compress must be True, False or 'auto', got {self.compress!r}")
        if self.io_threads < 1:
            raise ValueError(f"SaveOptions.io_threads must be >= 1, got {self.io_threads}")
        if self.chunk_bytes == 0:
            object.__setattr__(self, "chunk_bytes", _knobs.chunk_bytes(compressed=self.compress is not False))
        if self.chunk_bytes < 4096:
            raise ValueError(f"SaveOptions.chunk_bytes must be >= 4096, got {self.chunk_bytes}")


@dataclass(frozen=True)
class LoadOptions:
    """How a load runs."""

    io_threads: int = field(default_factory=_knobs.io_threads)
    """Threads per rank reading data files."""
    max_read_bytes: int = 32 << 20
    """Largest single range read; with ``io_threads`` this bounds extra host memory."""
    verify: bool = field(default_factory=_knobs.verify_checksums)
    """Verify every chunk read against its checksum."""
    broadcast_replicated: bool = False
    """Read tensors that every rank wants identically (e.g. a DDP model) once, split across
    ranks, and broadcast them over the gloo coordination group; saves storage bandwidth at
    the cost of network traffic. Applies to contiguous CPU targets; device tensors are read
    by each rank as usual."""
    record_timings: bool = True
    """Rank 0 writes the load's per-rank timings to ``timings/load-*.json`` in the checkpoint
    (best effort; skipped silently where the location is read-only)."""

    def __post_init__(self) -> None:
        if self.io_threads < 1:
            raise ValueError(f"LoadOptions.io_threads must be >= 1, got {self.io_threads}")
        if self.max_read_bytes < 1 << 16:
            raise ValueError(f"LoadOptions.max_read_bytes must be >= 65536, got {self.max_read_bytes}")


def _mode(kind: type[_M], value: object, option: str) -> _M:
    """``value`` as a member of the enum ``kind``, or a ValueError naming ``option`` and the choices."""
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in kind)
        raise ValueError(f"{option} must be one of {choices}, got {value!r}") from None


def _staging_mode(value: object) -> StagingMode:
    return _mode(StagingMode, value, "SaveOptions.staging (or TESSERA_STAGING)")


def _staging_check(value: object) -> StagingCheck:
    if value is True:
        return StagingCheck.FULL
    if value is False:
        return StagingCheck.OFF
    return _mode(StagingCheck, value, "SaveOptions.check_staging (or TESSERA_CHECK_STAGING)")


def _writer_mode(value: object) -> WriterMode:
    return _mode(WriterMode, value, "SaveOptions.writer (or TESSERA_WRITER)")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Bytes in a size such as ``"5GB"`` (10^9), ``"512MiB"`` (2^20) or ``1000``.

    Decimal and binary units follow the Hugging Face convention (``"5GB"`` is 5·10^9 bytes).

    Raises:
        ValueError: for anything else, or a size below one byte.

    Example:
        >>> parse_size("2MiB")
        2097152
    """
    if isinstance(text, int):
        n = text
    else:
        m = _SIZE.match(text)
        if m is None:
            raise ValueError(f"cannot read size {text!r}; use e.g. 5GB, 512MiB or a number of bytes")
        unit = (m.group(2) or "b").lower()
        power = {"b": 0, "k": 1, "m": 2, "g": 3, "t": 4}[unit[0]]
        base = 1024 if "i" in unit else 1000
        n = int(float(m.group(1)) * base**power)
    if n < 1:
        raise ValueError(f"size {text!r} must be at least one byte")
    return n
