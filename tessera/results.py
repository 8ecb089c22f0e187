"""What save, load and verify hand back: results, the handle of a save in flight, the verify report."""

from __future__ import annotations

import concurrent.futures
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum

from .errors import CorruptCheckpointError


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
        decoded_bytes: bytes of compressed tiles this rank decoded (whole chunks: the chunks its
            boxes meet), 0 for a checkpoint saved without compression.
    """

    missing_keys: list[str]
    unexpected_keys: list[str]
    bytes_read: int
    timings: dict[str, float]
    save_id: str
    decoded_bytes: int = 0


class PendingSave:
    """A save in flight: its bytes are being copied to host memory and written in the background.

    ``wait_staged()`` blocks until the saved tensors may be modified again (their bytes are
    in host memory) and ``staged()`` says whether they may; ``wait()`` blocks until the
    checkpoint is committed (or raises what went wrong) and ``done()`` says whether that has
    happened. Thread-safe.

    Tensors copied in the background (those of gated Statefuls, or all of them with
    ``StagingMode.BACKGROUND``) must not change before ``wait_staged()`` returns:
    ``tessera.OptimizerState`` and ``tessera.ModelState`` hold ``optimizer.step()``,
    ``load_state_dict`` and (where the model has buffers or writes parameters in it) the forward pass until then,
    and the manager's next save or load
    waits too; a change made some other way fails the save with ``StagingMutationError``
    (the default check of ``SaveOptions.check_staging``).
    """

    def __init__(
        self,
        future: Future[SaveResult],
        stall_s: float,
        *,
        path: str | None = None,
        staged_event: threading.Event | None = None,
        stall_parts: dict[str, float] | None = None,
    ) -> None:
        self._future = future
        self._staged = staged_event
        self.stall_s = stall_s
        """Seconds the call that started this save blocked the caller, all of it: the wait
        for the previous save, planning, and staging (or scheduling the background copy)."""
        self.stall_parts: dict[str, float] = dict(stall_parts or {})
        """``stall_s`` by part, in seconds: ``wait_previous`` (the save before it),
        ``plan``, ``stage`` (the copy to host memory, when it blocked) or ``schedule``
        (when the copy runs in the background), and for a manager's save ``prepare`` (its
        own work: storage, retention). The parts add up to at most ``stall_s``."""
        self.path = path
        """The checkpoint being saved (None where unknown)."""
        self._observed = False

    def staged(self) -> bool:
        """Whether the saved tensors may be modified (their bytes are in host memory, or the save is over)."""
        return self._staged is None or self._staged.is_set() or self._future.done()

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the saved tensors may be modified. Cheap once staged.

        A failure of the copy does not raise here; ``wait()`` (or the next save) raises it.

        Raises:
            TimeoutError: if ``timeout`` seconds passed first.
        """
        if self._staged is None or self._staged.is_set():
            return
        if not self._staged.wait(timeout) and not self._future.done():
            raise TimeoutError(f"the save to {self.path} was not staged within {timeout} s")

    def done(self) -> bool:
        """Whether the save has finished (committed or failed); never blocks."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> SaveResult:
        """The committed save's result.

        Args:
            timeout: seconds to wait at most (None: until the save is over, which every
                timeout of the save itself bounds: ``TESSERA_TIMEOUT_S`` for the other
                ranks, ``TESSERA_WRITER_TIMEOUT_S`` for a stuck writer process).

        Raises:
            TimeoutError: ``timeout`` passed first. The save goes on in the background: call
                ``wait()`` again; its outcome is not lost.
            CheckpointError: whatever failed in the background, on every rank.
        """
        self._observed = True
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError as e:
            if self._future.done():
                raise  # the save itself failed with a timeout: that is its outcome
            # A class of its own before Python 3.11: give every version the builtin one.
            raise TimeoutError(
                f"the save to {self.path} has not finished within {timeout} s; it goes on (call wait() again)"
            ) from e

    def unobserved_error(self) -> BaseException | None:
        """The background failure of a finished save that nobody has seen (without marking it seen)."""
        if self._observed or not self._future.done() or self._future.cancelled():
            return None
        return self._future.exception()

    def _raise_unobserved(self) -> None:
        """Re-raise a background failure nobody has seen yet (called by the next save)."""
        if not self._observed:
            self._observed = True
            self._future.result()


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
