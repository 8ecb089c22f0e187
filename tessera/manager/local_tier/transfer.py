"""Whole files between ranks over tessera's gloo group: replicas at save, fetches at recovery.

Every rank computes the same list of :class:`Transfer` (it depends only on data all ranks
share) and calls :func:`run_transfers` together; each rank posts the receives and sends
that name it, so the traffic is point to point (no rank relays another's bytes).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import uuid
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as tdist

from ...engine import dist
from ...errors import StorageError
from ...format.names import check_relpath

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Transfer:
    """One file sent from one rank to another.

    Attributes:
        src: the sending rank (in the process group).
        dst: the receiving rank.
        path: the file, relative to the step directory.
        nbytes: its size.
    """

    src: int
    dst: int
    path: str
    nbytes: int


class FileSink:
    """A file being received: a uint8 tensor mapped onto a temporary file next to ``path``
    (the bytes land in the page cache directly, with no copy after the receive), renamed
    into place by :meth:`commit`.

    Args:
        root: the directory ``path`` is relative to.
        path: the file to create (an existing one is replaced atomically on commit).
        nbytes: its size.
    """

    def __init__(self, root: str, path: str, nbytes: int) -> None:
        self.final = os.path.join(root, check_relpath(path))
        os.makedirs(os.path.dirname(self.final), exist_ok=True)
        self.tmp = f"{self.final}.recv-{uuid.uuid4().hex}"
        fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            # Allocate the file's pages in one call; mapping them is left to the receive. Measured
            # on tmpfs, 4 ranks x 256 MB on 2 cores: 0.59 s per replication against 0.69 s with
            # MAP_POPULATE, whose page-table setup costs more than the allocation itself.
            if nbytes:
                _allocate(fd, nbytes)
            self._map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED) if nbytes else None
        except OSError as e:
            self.abort()
            raise StorageError(f"cannot receive {path} ({nbytes} bytes) into {self.final}: {e}") from e
        finally:
            os.close(fd)
        self.buffer = torch.frombuffer(self._map, dtype=torch.uint8) if self._map is not None else torch.empty(0)

    def commit(self) -> None:
        """Publish the received file under its name (the mapping is released with its last user)."""
        os.replace(self.tmp, self.final)

    def abort(self) -> None:
        """Remove the temporary file."""
        try:
            os.remove(self.tmp)
        except FileNotFoundError:
            pass


def _allocate(fd: int, nbytes: int) -> None:
    """Give the open file ``nbytes`` of allocated space (a sparse file where the filesystem cannot)."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise  # ENOSPC, EFBIG: said now, where a sparse file would SIGBUS the receive
        os.ftruncate(fd, nbytes)


def read_tensor(root: str, path: str) -> torch.Tensor:
    """A file under ``root`` as a read-only uint8 tensor mapped onto it (no copy)."""
    full = os.path.join(root, check_relpath(path))
    with open(full, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return torch.empty(0, dtype=torch.uint8)
        mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "not writable": it is only sent
        return torch.frombuffer(mapped, dtype=torch.uint8)


def run_transfers(
    world: dist.World,
    transfers: Sequence[Transfer],
    root: str,
    what: str,
) -> int:
    """Collective: carry out this rank's part of ``transfers``; the bytes it received.

    Files are read from and written to this rank's directory ``root`` (the step's directory
    on its node). A sender that cannot read a file still sends ``nbytes`` zero bytes (so
    that no receiver waits forever), and every rank then learns that the transfer failed.

    Raises:
        StorageError: on every rank, if any rank failed to read or write its files.
        CollectiveTimeoutError: if a peer died or hangs.
    """
    error: BaseException | None = None
    received = 0
    sinks: list[tuple[Transfer, FileSink]] = []
    try:
        for t in transfers:
            if t.dst == world.rank:
                sinks.append((t, FileSink(root, t.path, t.nbytes)))
    except Exception as e:
        error = e
    if world.distributed:

        def post() -> None:
            nonlocal error
            works = []
            mine = dict((id(t), sink) for t, sink in sinks)
            for tag, t in enumerate(transfers):
                if t.dst == world.rank and t.nbytes > 0:
                    sink = mine.get(id(t))
                    buf = sink.buffer if sink is not None else torch.empty(t.nbytes, dtype=torch.uint8)
                    works.append(tdist.irecv(buf, group=world.group, group_src=t.src, tag=tag))
            for tag, t in enumerate(transfers):
                if t.src == world.rank and t.nbytes > 0:
                    try:
                        buf = read_tensor(root, t.path)
                        if buf.numel() != t.nbytes:
                            raise StorageError(f"{t.path}: {buf.numel()} bytes on disk, {t.nbytes} expected")
                    except Exception as e:
                        error = error or e
                        buf = torch.zeros(t.nbytes, dtype=torch.uint8)
                    works.append(tdist.isend(buf, group=world.group, group_dst=t.dst, tag=tag))
            for work in works:
                work.wait()  # type: ignore[union-attr]

        try:
            dist.run_collective(world, what, post)
        except BaseException:
            # A peer died or hangs: no receive will complete. The temporary files would hold
            # their full size in host memory until the step is deleted; they go now.
            for _, sink in sinks:
                sink.abort()
            raise
    for t, sink in sinks:
        try:
            if error is None:
                sink.commit()
                received += t.nbytes
            else:
                sink.abort()
        except Exception as e:
            error = error or e
    if error is not None:
        logger.warning("rank %d: %s: %s", world.rank, what, error)
    dist.exchange(world, None if error is None else _as_storage_error(error, what, world.rank), None, what)
    return received


def _as_storage_error(e: BaseException, what: str, rank: int) -> BaseException:
    """A StorageError naming the rank and the step of the collective (``what``)."""
    cause = str(e) if isinstance(e, StorageError) else f"{type(e).__name__}: {e}"
    out = StorageError(f"rank {rank}: {what}: {cause}")
    out.__cause__ = e
    return out
