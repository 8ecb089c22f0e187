"""What :func:`tessera.verify` reports: the kinds of defect, each problem found, the report."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .errors import CorruptCheckpointError


class ProblemKind(str, Enum):
    """What kind of defect a :class:`Problem` is."""

    MANIFEST = "manifest"
    """``manifest.json`` is missing (not committed), unreadable or invalid."""
    MISSING_FILE = "missing_file"
    """A data file the manifest refers to does not exist."""
    FILE_SIZE = "file_size"
    """A data file is shorter (truncated) or longer than the manifest records."""
    HEADER = "header"
    """A data file is not a valid safetensors file, or its header disagrees with the manifest."""
    CHECKSUM = "checksum"
    """A tile's bytes do not match the recorded checksums (corrupted data, or a wrong offset)."""
    READ = "read"
    """The storage failed while reading a file."""
    COVERAGE = "coverage"
    """A tensor's tiles leave a gap, overlap, or lie outside it."""
    VALUE = "value"
    """A plain value in the manifest is not a valid encoding."""


@dataclass(frozen=True)
class Problem:
    """One defect found by :func:`verify`.

    Attributes:
        kind: what kind of defect.
        message: a full sentence naming the tensor, file and rank where they apply.
        tensor: the tensor (or value) concerned, if any.
        file: the data file concerned, relative to the checkpoint, if any.
        rank: the rank that wrote ``file``, if known.
    """

    kind: ProblemKind
    message: str
    tensor: str | None = None
    file: str | None = None
    rank: int | None = None

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class VerifyReport:
    """The outcome of :func:`verify`.

    Attributes:
        path: the checkpoint checked.
        save_id: its save id (None if the manifest could not be read).
        problems: every defect found (empty when the checkpoint is intact).
        tensors: tensors checked.
        tiles: tiles checked.
        files: data files the manifest refers to.
        bytes_checked: tile bytes read and checksummed.
        seconds: how long verification took.
        unreferenced_files: files under ``data/`` no manifest entry refers to (left by an
            unfinished save, harmless; the next successful save removes them).
        pickled_values: values stored with pickle (they load only with ``allow_pickle=True``).
    """

    path: str
    save_id: str | None
    problems: tuple[Problem, ...]
    tensors: int = 0
    tiles: int = 0
    files: int = 0
    bytes_checked: int = 0
    seconds: float = 0.0
    unreferenced_files: tuple[str, ...] = ()
    pickled_values: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """Whether no problem was found."""
        return not self.problems

    def summary(self, limit: int = 20) -> str:
        """A human-readable summary, listing up to ``limit`` problems."""
        head = (
            f"{self.path}: {'OK' if self.ok else f'{len(self.problems)} problem(s)'} "
            f"({self.tensors} tensors, {self.tiles} tiles, {self.files} files, "
            f"{self.bytes_checked} bytes checked in {self.seconds:.2f}s)"
        )
        lines = [head] + [f"  [{p.kind.value}] {p.message}" for p in self.problems[:limit]]
        if len(self.problems) > limit:
            lines.append(f"  ... and {len(self.problems) - limit} more")
        return "\n".join(lines)

    def raise_if_failed(self) -> None:
        """Raise if any problem was found.

        Raises:
            CorruptCheckpointError: with :meth:`summary` as its message.
        """
        if self.problems:
            raise CorruptCheckpointError(self.summary())
