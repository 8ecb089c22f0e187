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
from collections.abc import Sequence

import torch

from .dtypes import ALIGN

logger = logging.getLogger(__name__)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor's bytes as a 1-D uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


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
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pin)
            self._buf = buf
            logger.debug("allocated %d bytes of %sstaging memory", nbytes, "pinned " if pin else "")
        return buf

    def release(self) -> None:
        self._buf = None

    def stage(self, sources: Sequence[torch.Tensor], *, copy: bool, after: object | None = None) -> list[torch.Tensor]:
        """Host byte views (1-D uint8) of ``sources``, in order.

        Args:
            sources: the tensors to write (any device, any strides).
            copy: always copy into the staging buffer (async saves); when False, contiguous
                CPU tensors are used in place.
            after: a CUDA event from :func:`ready_event`, recorded by the thread that owns
                the tensors; device copies wait for it. None: they wait for the current
                stream of the calling thread.
        """
        out: list[torch.Tensor | None] = [None] * len(sources)
        todo = []
        for i, src in enumerate(sources):
            if not copy and src.device.type == "cpu" and src.is_contiguous():
                out[i] = as_bytes(src)
            else:
                todo.append(i)
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
            if stream is not None:
                stream.synchronize()
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
