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
import threading
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


def _write_direct(fd: int, chunks: Iterable[Buffer]) -> None:
    """Write ``chunks`` to ``fd`` (opened with ``O_DIRECT``) through a 1 MiB page-aligned buffer.

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
        if fill > whole:
            buffered()
            _write_all(fd, buf[whole:fill])
    finally:
        try:
            buf.release()
            bounce.close()
        except BufferError:  # a view is still referenced (an error's traceback): freed with it
            pass


_DIRECT_READ_MIN = 1 << 20
"""Ranges shorter than this are read through the page cache: a direct read pays a whole block
at each end and a request of its own, which only large ranges amortise."""


def is_uncached(fd: int, offset: int, length: int) -> bool:
    """Whether pages at a quarter, half and three quarters of ``[offset, offset + length)`` of ``fd``
    are absent from the page cache (``preadv2`` with ``RWF_NOWAIT``, which refuses rather than
    waits for the disk); False where the platform cannot tell, so the caller keeps the page-cache
    path.

    Not the ends: a data file's header and its last partial block are written through the page
    cache (:func:`_write_direct`), and the first and last tiles share their pages.
    """
    flag = getattr(os, "RWF_NOWAIT", 0)
    if not flag or length <= 0:
        return False
    probe = bytearray(1)
    for at in (offset + length // 4, offset + length // 2, offset + 3 * length // 4):
        try:
            os.preadv(fd, [probe], at, flag)
        except BlockingIOError:
            continue
        except OSError:  # EOPNOTSUPP and the like: this file cannot tell
            return False
        return False  # a page is cached: the page cache serves this range
    return True


class DirectReads:
    """Large reads of data that is not in the page cache, with ``O_DIRECT``, into page-aligned
    buffers.

    Why: on the VM of docs/benchmarks.md, reading data files that were just written with
    ``O_DIRECT`` (the first load after a save) through memory maps took 1.21 s for 512 MB with 4
    threads (median of 8), against 0.54 s with ``O_DIRECT`` reads of the same bytes: the
    checkpoint a job just wrote is exactly the one not in the page cache. Cached data keeps the
    page-cache path (a memory map), which is faster still.

    Thread-safe. Buffers are lent by :meth:`read` until :meth:`release` and kept for the next
    read (at most :data:`_KEPT_BUFFERS`, shared by every storage object of the process), so a
    load does not fault in fresh memory for every range.
    """

    def __init__(self) -> None:
        self._fds: dict[str, int | None] = {}
        self._lent: dict[tuple[str, int], mmap.mmap] = {}
        self._lock = threading.Lock()

    def wants(self, fd: int, offset: int, length: int) -> bool:
        """Whether ``[offset, offset + length)`` of the file open as ``fd`` should be read directly."""
        return length >= _DIRECT_READ_MIN and is_uncached(fd, offset, length)

    def read(self, full: str, offset: int, length: int) -> memoryview | None:
        """The bytes ``[offset, offset + length)`` of ``full`` read with ``O_DIRECT``, in a buffer lent
        until :meth:`release` of the same range, or None where the file cannot be read so (the
        caller reads it the ordinary way). A view shorter than ``length`` means the file ends early."""
        fd = self._direct_fd(full)
        if fd is None:
            return None
        start = offset - offset % _BLOCK
        stop = -(-(offset + length) // _BLOCK) * _BLOCK
        buf = _borrow(stop - start)
        view = memoryview(buf)
        got = 0
        try:
            while got < stop - start:
                n = os.preadv(fd, [view[got : stop - start]], start + got)
                if n == 0:
                    break
                got += n
        except OSError as e:
            view.release()
            _give_back(buf)
            if e.errno != errno.EINVAL:
                raise
            with self._lock:  # this file takes the flag but not the reads: never again
                self._fds[full] = None
            os.close(fd)
            return None
        with self._lock:
            old = self._lent.pop((full, offset), None)
            self._lent[(full, offset)] = buf
        if old is not None:
            _give_back(old)
        end = max(offset - start, min(got, offset + length - start))
        return view[offset - start : end]

    def release(self, full: str, offset: int) -> bool:
        """Take back the buffer lent for ``offset`` of ``full``; False if none was."""
        with self._lock:
            buf = self._lent.pop((full, offset), None)
        if buf is None:
            return False
        _give_back(buf)
        return True

    def _direct_fd(self, full: str) -> int | None:
        with self._lock:
            if full in self._fds:
                return self._fds[full]
            flag = getattr(os, "O_DIRECT", 0)
            fd: int | None = None
            if flag:
                try:
                    fd = os.open(full, os.O_RDONLY | flag)
                except OSError as e:
                    if e.errno != errno.EINVAL:  # EINVAL: this filesystem refuses O_DIRECT
                        raise
            if len(self._fds) >= 256:
                self._close_fds()
            self._fds[full] = fd
            return fd

    def close(self) -> None:
        """Close the cached descriptors; buffers still lent go back to the process's pool."""
        with self._lock:
            self._close_fds()
            lent, self._lent = list(self._lent.values()), {}
        for buf in lent:
            _give_back(buf)

    def _close_fds(self) -> None:
        for fd in self._fds.values():
            if fd is not None:
                os.close(fd)
        self._fds.clear()


_KEPT_BUFFERS = 8
"""Direct-read buffers kept for reuse in the process (each as large as the largest range read,
``LoadOptions.max_read_bytes`` at most for a load)."""
_pool: list[mmap.mmap] = []
_pool_lock = threading.Lock()


def _borrow(nbytes: int) -> mmap.mmap:
    """A page-aligned buffer of at least ``nbytes`` (from the pool when one is large enough)."""
    with _pool_lock:
        for i, buf in enumerate(_pool):
            if len(buf) >= nbytes:
                return _pool.pop(i)
    return mmap.mmap(-1, -(-nbytes // _BOUNCE_BYTES) * _BOUNCE_BYTES)  # anonymous memory: page-aligned


def _give_back(buf: mmap.mmap) -> None:
    with _pool_lock:
        if len(_pool) < _KEPT_BUFFERS:
            _pool.append(buf)
            return
    try:
        buf.close()
    except BufferError:  # a view is still referenced somewhere: freed with it
        pass
