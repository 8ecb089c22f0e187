"""Staging: copy the bytes a rank writes into host memory it owns.

Until it is done the saved tensors must not change. ``async_save`` runs it in the background
by default (see :class:`tessera.StagingMode`): the caller records where its CUDA streams are
(:func:`ready_event`, an event on the current stream) and returns; a copy thread then copies.
Staging memory is one buffer per process, allocated at the size the plan needs and reused
by later saves with the same plan; it is pinned when tensors live on an accelerator, and
device-to-host copies run on a separate CUDA stream that first waits for the caller's event
(or, called in the caller's thread, for its current stream). A synchronous save of CPU
tensors skips staging altogether and writes straight from the tensors.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch

from ...format.dtypes import ALIGN, as_bytes

logger = logging.getLogger(__name__)


def host_bytes(nbytes: int, pin: bool) -> torch.Tensor:
    """``nbytes`` (at least 1) of host memory as 1-D uint8, page-locked when ``pin``.

    Pinned memory is a plain allocation registered with CUDA (``cudaHostRegister``, through the
    public ``torch.cuda.cudart()``) rather than a block of torch's caching host allocator, which
    rounds every block up to a power of two: a 3.2 GB staging buffer held 4 GiB there, and the
    window of a 0.8 GB budget 1 GiB. It is unregistered when the tensor is collected.
    """
    buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
    if not pin:
        return buf
    cudart = torch.cuda.cudart()
    ptr = buf.data_ptr()
    err = int(cudart.cudaHostRegister(ptr, buf.numel(), 0))
    if err != 0:  # e.g. a locked-memory limit: the allocator's pinned blocks may still be had
        logger.debug("cudaHostRegister of %d bytes failed (cudaError %d); using torch's pinned allocator", nbytes, err)
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
    weakref.finalize(buf, cudart.cudaHostUnregister, ptr)
    return buf


def is_copied(src: torch.Tensor, copy: bool) -> bool:
    """Whether staging copies ``src`` (``copy``: always); else contiguous CPU tensors are
    written from in place."""
    return copy or src.device.type != "cpu" or not src.is_contiguous()


class StagingBuffer:
    """Host memory reused across saves; grows, never shrinks (until :meth:`release`)."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._stream: torch.cuda.Stream | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self._buf is None else self._buf.numel()

    def _ensure(self, nbytes: int, pin: bool) -> torch.Tensor:
        buf = self._buf
        if buf is None or buf.numel() < nbytes or (pin and not buf.is_pinned()):
            self._buf = None  # free the old buffer before allocating the new one
            buf = host_bytes(nbytes, pin)
            self._buf = buf
            logger.debug("allocated %d bytes of %sstaging memory", nbytes, "pinned " if pin else "")
        return buf

    def release(self) -> None:
        self._buf = None

    def stage(
        self,
        sources: Sequence[torch.Tensor],
        *,
        copy: bool,
        after: object | None = None,
        on_staged: Callable[[int, torch.Tensor], None] | None = None,
        order: Sequence[int] | None = None,
    ) -> list[torch.Tensor]:
        """Host byte views (1-D uint8) of ``sources``, in order.

        Args:
            sources: the tensors to write (any device, any strides).
            copy: always copy into the staging buffer (async saves); when False, contiguous
                CPU tensors are used in place.
            after: a CUDA event from :func:`ready_event`, recorded by the thread that owns
                the tensors; device copies wait for it. None: they wait for the current
                stream of the calling thread.
            on_staged: called with ``(index, host view)`` as soon as each source's bytes are
                in host memory (CPU copies: one by one; device copies: after their stream).
            order: the order to copy the sources in (default: as given).
        """
        out: list[torch.Tensor | None] = [None] * len(sources)
        todo = []
        for i in order if order is not None else range(len(sources)):
            src = sources[i]
            if is_copied(src, copy):
                todo.append(i)
            else:
                out[i] = as_bytes(src)
        todo_set = set(todo)
        stream = None
        if todo:
            offsets = []
            pos = 0
            for i in todo:
                offsets.append(pos)
                n = sources[i].numel() * sources[i].element_size()
                pos += n + (-n % ALIGN)
            on_device = [sources[i] for i in todo if sources[i].device.type != "cpu"]
            pin = bool(on_device) and torch.cuda.is_available()
            buf = self._ensure(pos, pin)
            stream = self._copy_stream(on_device, after)
            ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
            with ctx:
                for i, off in zip(todo, offsets):
                    src = sources[i]
                    n = src.numel() * src.element_size()
                    region = buf[off : off + n]
                    region.view(src.dtype).view(src.shape).copy_(src, non_blocking=stream is not None)
                    out[i] = region
                    if stream is None and on_staged is not None:
                        on_staged(i, region)
            if stream is not None:
                stream.synchronize()
        if on_staged is not None:
            for i, view in enumerate(out):
                if stream is None and i in todo_set:
                    continue  # already reported
                on_staged(i, view)  # type: ignore[arg-type]  # filled above
        return out  # type: ignore[return-value]  # every entry is filled above

    def _copy_stream(self, on_device: list[torch.Tensor], after: object | None) -> torch.cuda.Stream | None:
        if not on_device or not torch.cuda.is_available() or on_device[0].device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=on_device[0].device)
        stream = self._stream
        # Copies must see every kernel the training loop queued before the save.
        if after is not None:
            stream.wait_event(after)  # type: ignore[arg-type]  # a torch.cuda.Event from ready_event
        else:
            stream.wait_stream(torch.cuda.current_stream(on_device[0].device))
        return stream


def ready_event(sources: Sequence[torch.Tensor]) -> object | None:
    """An event on the caller's current CUDA stream, for copies made from another thread.

    CUDA streams are per thread: a copy thread's current stream is not the training loop's,
    so the loop records where its stream is before handing the tensors over. None when no
    source is on a CUDA device.
    """
    device = next((s.device for s in sources if s.device.type == "cuda"), None)
    if device is None or not torch.cuda.is_available():
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class StagedTiles(Sequence[torch.Tensor]):
    """Host views of tiles that a copy running in another thread fills in, one by one.

    Indexing (or iterating) waits until that tile is staged, so a writer can start on the
    first tiles while later ones are still being copied. :meth:`fail` makes every wait for
    a tile not yet staged raise the copy's error.
    """

    def __init__(self, n: int) -> None:
        self._tiles: list[torch.Tensor | None] = [None] * n
        self._cond = threading.Condition()
        self._error: BaseException | None = None

    def put(self, i: int, view: torch.Tensor) -> None:
        with self._cond:
            self._tiles[i] = view
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def __len__(self) -> int:
        return len(self._tiles)

    def __getitem__(self, i: int) -> torch.Tensor:  # type: ignore[override]  # no slices needed
        with self._cond:
            while self._tiles[i] is None:
                if self._error is not None:
                    raise self._error
                self._cond.wait()
            return self._tiles[i]  # type: ignore[return-value]  # not None: checked above

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[i] for i in range(len(self)))

    def part(self, start: int, stop: int) -> _Part:
        """The tiles ``[start, stop)`` (one file's), waiting like this sequence does."""
        return _Part(self, start, stop)


class _Part(Sequence[torch.Tensor]):
    def __init__(self, tiles: StagedTiles, start: int, stop: int) -> None:
        self._tiles, self._start, self._stop = tiles, start, stop

    def __len__(self) -> int:
        return self._stop - self._start

    def __getitem__(self, i: int) -> torch.Tensor:  # type: ignore[override]  # no slices needed
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._tiles[self._start + i]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[i] for i in range(len(self)))
