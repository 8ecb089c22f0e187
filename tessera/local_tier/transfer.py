"""Whole files between ranks over tessera's gloo group: replicas at save, fetches at recovery.

Every rank computes the same list of :class:`Transfer` (it depends only on data all ranks
share) and calls :func:`run_transfers` together; each rank posts the receives and sends
that name it, so the traffic is point to point (no rank relays another's bytes).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as tdist

from .. import dist
from ..errors import StorageError
from ..storage import check_relpath

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


def run_transfers(
    world: dist.World,
    transfers: Sequence[Transfer],
    read: Callable[[str], torch.Tensor],
    write: Callable[[str, memoryview], None],
    what: str,
) -> int:
    """Collective: carry out this rank's part of ``transfers``; the bytes it received.

    ``read`` returns a file's bytes as a uint8 tensor (sent as is); ``write`` stores what
    arrived. A sender that cannot read a file still sends ``nbytes`` zero bytes (so that no receiver
    waits forever), and every rank then learns that the transfer failed.

    Raises:
        StorageError: on every rank, if any rank failed to read or write its files.
        CollectiveTimeoutError: if a peer died or hangs.
    """
    error: BaseException | None = None
    received = 0
    if world.distributed:
        recvs: list[tuple[Transfer, torch.Tensor, object]] = []
        sends: list[tuple[torch.Tensor, object]] = []

        def post() -> None:
            nonlocal error, received
            for tag, t in enumerate(transfers):
                if t.dst == world.rank and t.nbytes > 0:
                    buf = torch.empty(t.nbytes, dtype=torch.uint8)
                    recvs.append((t, buf, tdist.irecv(buf, group=world.group, group_src=t.src, tag=tag)))
            for tag, t in enumerate(transfers):
                if t.src == world.rank and t.nbytes > 0:
                    try:
                        buf = read(t.path)
                        if buf.numel() != t.nbytes:
                            raise StorageError(f"{t.path}: {buf.numel()} bytes on disk, {t.nbytes} expected")
                    except Exception as e:
                        error = error or e
                        buf = torch.zeros(t.nbytes, dtype=torch.uint8)
                    sends.append((buf, tdist.isend(buf, group=world.group, group_dst=t.dst, tag=tag)))
            for _, work in sends:
                work.wait()  # type: ignore[attr-defined]
            for t, buf, work in recvs:
                work.wait()  # type: ignore[attr-defined]
                if error is None:
                    try:
                        write(t.path, memoryview(buf.numpy()))  # type: ignore[arg-type]
                    except Exception as e:
                        error = e
                received += t.nbytes

        dist._run(world, what, post)
    for t in transfers:
        if t.dst == world.rank and t.nbytes == 0:
            try:
                write(t.path, memoryview(b""))
            except Exception as e:
                error = error or e
    if error is not None:
        logger.warning("rank %d: %s: %s", world.rank, what, error)
    dist.exchange(world, None if error is None else _as_storage_error(error, what, world.rank), None, what)
    return received


def _as_storage_error(e: BaseException, what: str, rank: int) -> BaseException:
    if isinstance(e, StorageError):
        return e
    out = StorageError(f"rank {rank}: {what}: {type(e).__name__}: {e}")
    out.__cause__ = e
    return out


def read_tensor(root: str, path: str) -> torch.Tensor:
    """A file under ``root`` as a uint8 tensor, read with one copy (no intermediate bytes)."""
    full = os.path.join(root, check_relpath(path))
    with open(full, "rb", buffering=0) as f:
        out = torch.empty(os.fstat(f.fileno()).st_size, dtype=torch.uint8)
        view = memoryview(out.numpy())  # type: ignore[arg-type]
        pos = 0
        while pos < len(view):
            n = f.readinto(view[pos:])
            if not n:
                raise StorageError(f"{full}: file shrank while being read ({pos} of {len(view)} bytes)")
            pos += n
    return out
