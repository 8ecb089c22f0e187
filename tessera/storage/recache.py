"""Bringing a just-committed checkpoint back into the page cache, off the training thread.

Durable data files are written with ``O_DIRECT`` (:mod:`._direct_io`) where the device measured
that faster (:mod:`.direct_choice`): the training loop does not pay the kernel's copy into the
page cache and its writeback. The price was the *first load after a
save* (an evaluation job, a ``tessera verify``, a restart on the same nodes): nothing of the fresh
checkpoint was cached, so it read the disk, where a buffered writer's first load (DCP's) finds its
pages in memory. Here, once a save committed, a daemon thread reads the files this rank wrote back
into the page cache with ``sendfile`` to ``/dev/null``: the disk's DMA fills the cache, no byte is
copied to user space (about 0.02 CPU-seconds per 512 MB on the 2-core VM of
``docs/benchmarks.md``, against 0.3-0.6 s for a ``pread`` into a buffer and up to 1.5 s for the
buffered write itself).

It is **on by default** (``TESSERA_RECACHE=auto``; ``0`` turns it off). Reading the files back
is not free for a loop that runs beside it: on the 2-core VM of ``docs/benchmarks.md`` it cost
0.02-0.47 s of training time per save of 0.5 GB per rank and 1.2-1.4 s at 2 GB, counted until
the last byte was cached (the kernel's work of filling the cache; this thread is charged 0.04 s
of CPU per 2 GB). That is a fraction of what DCP's async save costs the same loop, and it is
what makes the first load after a save a warm one (2.5-2.8x DCP's at 0.5 GB per rank, where it
was 0.8x). A job that never reads its checkpoints back on the same nodes can set
``TESSERA_RECACHE=0``. It runs only for files on a local filesystem (a network filesystem would
move the bytes over the network again) and only for as many of this rank's files as fit in its
part of half of the memory the kernel reports available (``MemAvailable``: the cache must not push
out what the job itself needs), the half shared by the node's ``LOCAL_WORLD_SIZE`` ranks (set by
torchrun; 1 when unset). A save whose files do not all fit gets the first of them re-cached, not
none: a first load then finds part of its bytes cached where it found none (at 4 GB per rank
beside 8 GB of state on the 24 GB VM, the share sits at that edge). ``TESSERA_RECACHE=1`` skips
both checks.

What it never does: delay or fail a save. It starts after the commit, gives way as soon as this
process writes data files again (:func:`yield_to_writes`: a new save's writes must not share the
disk with reading the old one) or starts loading the checkpoint it is reading back
(:func:`yield_to_reads`: the load reads what it needs itself, and a second stream from the same
disk would only slow it), stops at the first error (a file deleted by retention is no
reason to log more than a debug line), and holds no file open between files.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
from collections.abc import Sequence

from .. import _knobs

logger = logging.getLogger(__name__)

STEP_BYTES = 16 << 20
"""Bytes per ``sendfile`` call; between two calls the thread checks whether it should give way."""

MEMORY_SHARE = 0.5
"""The node's files are re-cached only while they fit in this fraction of ``MemAvailable``."""

LOCAL_FILESYSTEMS = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "bcachefs", "jfs", "reiserfs", "overlay", "nilfs2"}
)
"""Filesystems whose reads do not cross a network (``/proc/self/mountinfo``'s type field)."""

_generation = 0
"""Bumped by every data-file write of this process; work queued under an older one is dropped."""

_queue: queue.SimpleQueue[tuple[int, tuple[str, ...], tuple[str, ...]]] = queue.SimpleQueue()
_thread: threading.Thread | None = None
_lock = threading.Lock()
_pending = 0
"""Batches queued and not finished (under ``_lock``); :func:`drain` waits for none."""
_done = threading.Condition(_lock)
_stats = {"files": 0, "bytes": 0, "dropped": 0, "evicted": 0, "yielded": 0}
_loading: tuple[str, ...] = ()
"""Roots (``os.sep``-terminated) of the checkpoints a load of this process reads: their files are
not read back. Replaced whole (never mutated), so the thread reads it without the lock."""
_previous: dict[str, tuple[str, ...]] = {}
"""Per folder of checkpoints (the parent of a checkpoint's root: a manager's root, the folder a
job saves its steps in), the files of the last save offered: the next save's take their place."""


def filesystem_type(path: str) -> str | None:
    """The type of the filesystem holding ``path`` (the longest mount point above it), or None."""
    try:
        real = os.path.realpath(path)
        best, kind = "", None
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) < 5 or not right:
                    continue
                point = fields[4].replace("\\040", " ")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, right.split()[0]
        return kind
    except OSError:
        return None


def available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes, or None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _ranks_on_node() -> int:
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    except ValueError:
        return 1


def allowance(root: str) -> int:
    """How many bytes this rank may bring back into the cache of what it wrote under ``root``:
    its part (one of ``LOCAL_WORLD_SIZE``) of :data:`MEMORY_SHARE` of ``MemAvailable``."""
    how = _knobs.recache()
    if how == "off":
        return 0
    if how == "always":
        return sys.maxsize
    if filesystem_type(root) not in LOCAL_FILESYSTEMS:
        return 0
    free = available_bytes()
    return 0 if free is None else int(MEMORY_SHARE * free) // _ranks_on_node()


def wanted(root: str, nbytes: int) -> bool:
    """Whether all of ``nbytes`` written under ``root`` by this rank may be brought back into the cache."""
    return 0 < nbytes <= allowance(root)


def _within(paths: Sequence[str], allowed: int) -> tuple[str, ...]:
    """The first of ``paths`` that fit in ``allowed`` bytes together: at the edge of the rule a
    save's files are re-cached in part (a first load then reads the rest), not left out whole."""
    out: list[str] = []
    for p in paths:
        try:
            n = os.path.getsize(p)
        except OSError:
            continue  # removed meanwhile (retention, another save's cleanup): nothing to keep
        if n > allowed:
            break
        out.append(p)
        allowed -= n
    return tuple(out)


def offer(root: str, paths: Sequence[str], *, supersedes: bool = True) -> None:
    """Schedule ``paths`` (absolute, under ``root``) if :func:`wanted`; nothing is looked at when off.

    With ``supersedes`` the files offered before for a checkpoint in the same folder as ``root``
    are dropped from the page cache first, re-cached or not: the cache then holds one save's files
    per folder of checkpoints (the newest step of a job), not every save's until the kernel
    reclaims them. (It bounds what the saves put in the cache; it did not measurably lower the
    re-cache's cost to a loop beside it: 1.2 s per 2 GB-per-rank save after, 1.4-1.8 s before.)
    A save whose checkpoint reads earlier saves' files (dedup) passes False.
    """
    global _loading
    if _knobs.recache() == "off" or not paths:
        return
    with _lock:  # a new save at a root a load read: its files are wanted again
        _loading = tuple(r for r in _loading if r != _prefix(root))
    drop: tuple[str, ...] = ()
    if supersedes:
        folder = os.path.dirname(os.path.normpath(root))
        with _lock:
            before, _previous[folder] = _previous.get(folder, ()), tuple(paths)
        keep = set(paths)
        drop = tuple(p for p in before if p not in keep)
    schedule(_within(paths, allowance(root)), drop)


def yield_to_writes() -> None:
    """A data file is about to be written: drop the re-caching queued or running before it."""
    global _generation
    _generation += 1


def yield_to_reads(root: str) -> None:
    """A load reads the checkpoint at ``root``: stop reading its files back, now and until a new
    save there offers them again (called by the first data read of a local storage)."""
    global _loading
    with _lock:
        if _prefix(root) not in _loading:
            _loading = (*_loading, _prefix(root))


def _prefix(root: str) -> str:
    return os.path.join(os.path.abspath(root), "")


def _being_loaded(path: str) -> bool:
    return any(path.startswith(r) for r in _loading)


def schedule(paths: Sequence[str], drop: Sequence[str] = ()) -> None:
    """Read ``paths`` (absolute) back into the page cache in the background thread, after
    dropping ``drop`` from it."""
    global _thread, _pending
    if not paths and not drop:
        return
    with _lock:
        _pending += 1
        _queue.put((_generation, tuple(paths), tuple(drop)))
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="tessera-recache", daemon=True)
            _thread.start()


def stats() -> dict[str, int]:
    """Files and bytes re-cached so far by this process, work dropped for a newer write, files
    left to a load of their checkpoint (``yielded``), and files dropped from the cache."""
    return dict(_stats)


def drain(timeout: float | None = None) -> bool:
    """Wait until everything scheduled so far was read back or dropped; False on timeout."""
    with _done:
        return _done.wait_for(lambda: _pending == 0, timeout)


def _run() -> None:
    global _pending
    while True:
        generation, paths, drop = _queue.get()
        try:
            _evict(drop)
            _read_batch(generation, paths)
        except Exception as e:  # never a traceback from a helper thread for a cache hint
            logger.debug("re-caching stopped: %s: %s", type(e).__name__, e)
        finally:
            with _done:
                _pending -= 1
                _done.notify_all()


def _evict(paths: tuple[str, ...]) -> None:
    """Drop ``paths`` from the page cache (clean pages: no write); a file gone has no pages left."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            _stats["evicted"] += 1
        except OSError as e:
            logger.debug("dropping %s from the page cache failed: %s", path, e)
        finally:
            os.close(fd)


def _read_batch(generation: int, paths: tuple[str, ...]) -> None:
    for path in paths:
        if generation != _generation:
            _stats["dropped"] += 1
            return
        if _being_loaded(path):
            _stats["yielded"] += 1
            continue
        try:
            _read_through(path, generation)
        except OSError as e:
            logger.debug("re-caching %s stopped: %s", path, e)
            return


def _read_through(path: str, generation: int) -> None:
    """``sendfile`` the whole of ``path`` to /dev/null: the page cache keeps what the disk sent."""
    fd = os.open(path, os.O_RDONLY)
    try:
        sink = os.open(os.devnull, os.O_WRONLY)
        try:
            size = os.fstat(fd).st_size
            offset = 0
            while offset < size and generation == _generation and not _being_loaded(path):
                sent = os.sendfile(sink, fd, offset, min(STEP_BYTES, size - offset))
                if sent <= 0:
                    break
                offset += sent
                _stats["bytes"] += sent
            _stats["files"] += 1
        finally:
            os.close(sink)
    finally:
        os.close(fd)
