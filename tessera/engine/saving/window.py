"""Async saves in a fixed host-memory budget: tiles stream through small reused buffers.

With ``SaveOptions(max_staging_bytes=B)``, an ``async_save`` whose background-copied tensors
hold more than ``B`` bytes makes no full host copy. Each writer thread takes one buffer of
``B / threads`` bytes (pinned when the tensors are on an accelerator) for the tile it writes,
copies the tile's next piece into it, hands the piece to the backend, and reuses the buffer
once the backend has taken it (backends copy or write what they are given before asking for
more: the :class:`~tessera.storage.base.Storage` contract). Peak extra host memory is the
budget, whatever the state's size.

The state's mutations stay held (the gate of :mod:`.sources`) until the last piece has been
copied out of the state, which is after all but the last ``B`` bytes were written; then the
staging check runs and the gate opens while the last pieces are written. A write that fails
half-way opens the gate too (nothing will be committed).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from ...errors import CheckpointError, StagingMutationError
from ...format.dtypes import ALIGN
from ...format.tilefile import FileLayout
from .handoff import SavePlan
from .staging import host_bytes
from .write import FileWrite

__all__ = ["Window", "WindowBuffers", "WindowedTiles", "file_write"]


class WindowBuffers:
    """The reused buffers of budget-bound saves (one per writer thread in use), kept per process group."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int, pin: bool) -> torch.Tensor:
        with self._lock:
            while self._free:
                buf = self._free.pop()
                if buf.numel() == nbytes and buf.is_pinned() == pin:
                    return buf
        return host_bytes(nbytes, pin)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)


def split(t: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    """Views of ``t`` whose row-major bytes follow each other and cover ``t``, each at most ``limit``
    bytes (a single element may be larger)."""
    size = t.element_size()
    if t.dim() == 0 or t.numel() * size <= limit:
        yield t
        return
    if t.is_contiguous():
        flat = t.reshape(-1)  # a view: any byte range is a slice
        per = max(1, limit // size)
        for i in range(0, flat.numel(), per):
            yield flat[i : i + per]
        return
    row = t[0].numel() * size
    if row <= limit:
        rows = max(1, limit // row)
        for r in range(0, t.shape[0], rows):
            yield t[r : r + rows]
        return
    for r in range(t.shape[0]):
        yield from split(t[r], limit)


class WindowedTiles(Sequence[torch.Tensor]):
    """One data file's tiles under a budget: their bytes come piece by piece from :meth:`pieces`."""

    def __init__(self, window: Window, start: int, count: int) -> None:
        self._window, self._start, self._count = window, start, count

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i: int) -> torch.Tensor:  # type: ignore[override]  # no slices needed
        raise CheckpointError("internal error: a tile staged through the memory window has no host copy")

    def pieces(self, i: int) -> Iterator[memoryview]:
        """Tile ``i``'s bytes, in order, each piece valid until the next is asked for."""
        return self._window.pieces(self._start + i)


class Window:
    """The stage step of a budget-bound background save, driven by the writers.

    Args:
        plan: the rank's share of the plan (its files, in slot order).
        srcs: the tensors to write, in slot order (the caller's live tensors, held by the gate).
        budget: bytes of host memory for all buffers together.
        threads: writer threads (each holds one buffer at a time).
        buffers: where buffers are taken from and returned to (reused by later saves).
        rank: this rank (for errors).
        after: a CUDA event the copies wait for (see :func:`.staging.ready_event`), or None.
        on_done: called once every byte was copied (the gate opens), or the write gave up.
        check: the staging check (version counters, sampled elements), called with the sources
            before the gate opens; CPU tiles' fingerprints are compared with what the writers
            checksummed instead (:mod:`.fingerprint`).
    """

    def __init__(
        self,
        plan: SavePlan,
        srcs: list[torch.Tensor],
        budget: int,
        threads: int,
        buffers: WindowBuffers,
        rank: int,
        after: object | None,
        on_done: Callable[[], None],
        check: Callable[[Sequence[torch.Tensor]], None] | None = None,
    ) -> None:
        files = max(1, min(threads, len(plan.layouts)))
        self.piece_bytes = max(ALIGN, budget // files // ALIGN * ALIGN)
        self._plan, self._srcs, self._buffers, self._rank = plan, srcs, buffers, rank
        self._after, self._on_done, self._check = after, on_done, check
        self._left = len(srcs)
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._device = next((s.device for s in srcs if s.device.type == "cuda"), None)
        self._stream: torch.cuda.Stream | None = None
        if self._left == 0:
            self._finish()

    def start(self) -> list[WindowedTiles]:
        """The rank's files, their tiles to be copied by the writers."""
        out, i = [], 0
        for lay in self._plan.layouts:
            out.append(WindowedTiles(self, i, len(lay.slots)))
            i += len(lay.slots)
        return out

    def pieces(self, index: int) -> Iterator[memoryview]:
        src = self._srcs[index]
        pin = self._device is not None and torch.cuda.is_available()
        buf = self._buffers.take(self.piece_bytes, pin)
        try:
            for part in split(src, self.piece_bytes):
                n = part.numel() * part.element_size()
                region = buf[:n]
                self._copy(region.view(part.dtype).view(part.shape), part)
                yield region.numpy().data
            self._tile_copied()
        except BaseException as e:
            self._give_up(e)
            raise
        finally:
            self._buffers.give(buf)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if src.device.type != "cuda":
            dst.copy_(src)
            return
        if self._stream is None:
            with self._lock:
                if self._stream is None:
                    stream = torch.cuda.Stream(device=src.device)
                    if self._after is not None:
                        stream.wait_event(self._after)  # type: ignore[arg-type]  # a torch.cuda.Event
                    self._stream = stream
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
        self._stream.synchronize()

    def _tile_copied(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        try:
            if self._check is not None:
                self._check(self._srcs)  # before the gate opens: a held mutation is no mutation
        except StagingMutationError as e:
            self._error = e
        finally:
            self._srcs.clear()  # let the caller's tensors go
            self._done.set()
            self._on_done()

    def _give_up(self, error: BaseException) -> None:
        """A write failed: nothing will be committed, so the state need not be held any more."""
        with self._lock:
            if self._done.is_set():
                return
            self._left = -1  # no later tile can open the gate twice
            if self._error is None:
                self._error = error if isinstance(error, CheckpointError) else None
        self._srcs.clear()
        self._done.set()
        self._on_done()

    def close(self) -> None:
        """The write step is over: if some tile was never copied (a failure elsewhere), open the gate."""
        if not self._done.is_set():
            self._give_up(CheckpointError(f"rank {self._rank}: the save ended before every tile was copied"))

    def join(self) -> None:
        """The save is over (the stage step's interface; the writers did the copying): :meth:`close`."""
        self.close()

    def verdict(self) -> None:
        """Raise what the staging check found (called after the writes, before the commit vote)."""
        self.close()
        if self._error is not None:
            raise self._error


def file_write(path: str, layout: FileLayout, staged: Sequence[torch.Tensor]) -> FileWrite:
    """The write of one data file from its staged tiles: host copies, or pieces through the window."""
    if isinstance(staged, WindowedTiles):
        return FileWrite(path, layout, staged, pieces=staged.pieces)
    return FileWrite(path, layout, staged)
