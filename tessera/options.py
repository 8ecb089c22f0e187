"""Option dataclasses for save and load, grouped by concern."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import _knobs
from .plan import PlanOptions


@dataclass(frozen=True)
class SaveOptions:
    """How a save runs. Defaults suit most jobs; environment knobs override some of them."""

    io_threads: int = field(default_factory=_knobs.io_threads)
    """Threads per rank writing data files."""
    chunk_bytes: int = field(default_factory=_knobs.chunk_bytes)
    """Checksum granularity: a load reads and verifies whole chunks of this size."""
    plan: PlanOptions = field(default_factory=PlanOptions)
    """Planner knobs (replica splitting, files per rank)."""
    layout: dict[str, Any] = field(default_factory=dict)
    """Free-form description of the saving job's layout (mesh shape, TP/PP sizes), stored
    in the manifest for information; loading never depends on it."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """User metadata stored in the manifest (JSON values)."""

    def __post_init__(self) -> None:
        if self.io_threads < 1:
            raise ValueError(f"SaveOptions.io_threads must be >= 1, got {self.io_threads}")
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
