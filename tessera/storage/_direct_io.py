"""Durable data-file writes that bypass the page cache: ``O_DIRECT`` through an aligned buffer.

Used by :meth:`tessera.storage.local.FileStorage.write_file` for durable writes, where the
filesystem takes the flag (:func:`_set_direct`); tmpfs and some network filesystems do not,
and get buffered writes.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from collections.abc import Iterable

from .base import Buffer

_BLOCK = 4096
"""What ``O_DIRECT`` writes are aligned to: memory address, length and file offset."""

_BOUNCE_BYTES = 1 << 20
"""The aligned buffer a direct write goes through (per file being written)."""


def _write_all(fd: int, view: memoryview) -> None:
    while len(view):
        view = view[os.write(fd, view) :]


def _set_direct(fd: int, on: bool) -> bool:
    """Turn ``O_DIRECT`` on or off for ``fd``; False where the filesystem refuses it (tmpfs, some
    network filesystems) or the platform has no such flag."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | flag) if on else (flags & ~flag))
    except OSError:
        return False
    return True


def _write_direct(fd: int, chunks: Iterable[Buffer]) -> bool:
    """Write ``chunks`` to ``fd`` (opened with ``O_DIRECT``) through a 1 MiB page-aligned buffer;
    False where part of the file had to be written buffered after all (see below).

    Buffered writes of checkpoint-sized files cost the kernel a copy into the page cache and the
    writeback after it: on the 2-core VM of docs/benchmarks.md, 0.15-1.5 s of system CPU and
    0.4-1.8 s per 512 MB fsync'ed, against 0.1 s of CPU and 0.4 s through ``O_DIRECT``; the
    CPU is what a training loop beside a background save loses. Each chunk is copied into the
    buffer before the next is asked for (the window of a memory budget reuses its buffers), full
    buffers are written directly, and the last, partial block is written with ``O_DIRECT``
    turned off. A filesystem that accepts the flag but refuses a direct write (``EINVAL``) gets
    the rest buffered.
    """
    bounce = mmap.mmap(-1, _BOUNCE_BYTES)  # anonymous memory: page-aligned
    buf = memoryview(bounce)
    direct = True
    fill = 0

    def buffered() -> None:
        nonlocal direct
        if direct:
            direct = False
            _set_direct(fd, False)

    def flush(n: int) -> None:
        written = 0
        if direct:
            try:
                written = os.write(fd, buf[:n])
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: this file cannot take direct writes after all
                    raise
                buffered()
            if written % _BLOCK:  # a short write off the block grid: finish it buffered
                buffered()
        _write_all(fd, buf[written:n])

    try:
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            while len(view):
                n = min(len(view), _BOUNCE_BYTES - fill)
                buf[fill : fill + n] = view[:n]
                fill += n
                view = view[n:]
                if fill == _BOUNCE_BYTES:
                    flush(fill)
                    fill = 0
        whole = fill // _BLOCK * _BLOCK
        if whole:
            flush(whole)
        stayed = direct  # the last, partial block is buffered by design, not by a refusal
        if fill > whole:
            buffered()
            _write_all(fd, buf[whole:fill])
        return stayed
    finally:
        try:
            buf.release()
            bounce.close()
        except BufferError:  # a view is still referenced (an error's traceback): freed with it
            pass
