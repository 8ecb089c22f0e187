"""What the training process and its writer process share: a socket channel and a memory arena.

* :class:`Channel`: length-prefixed pickles over a Unix socket pair, with a deadline on every
  send and receive on the training side, so that a writer that stopped answering (SIGSTOP, a
  write stuck in the kernel) can never block the training process. Both ends are tessera's
  own processes: nothing untrusted is unpickled.
* :class:`Arena`: a shared-memory file that has no name once it exists: it is created under
  ``/dev/shm`` as ``tessera-writer-<owner pid>-*``, unlinked at once, and its descriptor is
  passed to the writer over the socket. Killing either process (even with SIGKILL) therefore
  leaves nothing behind; :func:`sweep_arenas` removes the names that a process killed in the
  microseconds between creating and unlinking one might still leave, once its owner is dead.
"""

from __future__ import annotations

import logging
import mmap
import os
import pickle
import socket
import struct
import tempfile
import time
from typing import Any

import torch

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "tessera-writer-"
_HEADER = struct.Struct("!Q")


class ChannelTimeout(Exception):
    """The other end did not take or send a message before the deadline."""


class Channel:
    """Pickled messages over a connected stream socket. Not thread-safe: callers hold a lock."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send(self, obj: Any, deadline: float | None = None) -> None:
        """Send ``obj``; ``deadline`` (monotonic) bounds the wait for the peer to take it.

        Raises:
            ChannelTimeout: the deadline passed first (the message may be half sent).
            OSError: the peer is gone.
        """
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self._timed(deadline, self.sock.sendall, _HEADER.pack(len(data)) + data)

    def send_fd(self, fd: int, deadline: float | None = None) -> None:
        """Pass a file descriptor (one byte carries it; see :meth:`recv_fd`)."""
        self._timed(deadline, socket.send_fds, self.sock, [b"F"], [fd])

    def recv(self, deadline: float | None = None) -> Any:
        """The next message; ``deadline`` as in :meth:`send`.

        Raises:
            ChannelTimeout: the deadline passed first.
            EOFError: the peer closed its end (exited).
        """
        (n,) = _HEADER.unpack(self._read(_HEADER.size, deadline))
        return pickle.loads(self._read(n, deadline))

    def recv_fd(self) -> int:
        """A descriptor sent by :meth:`send_fd` (blocking).

        Raises:
            EOFError: the peer closed its end.
        """
        _, fds, _, _ = socket.recv_fds(self.sock, 1, 1)
        if not fds:
            raise EOFError("the channel closed before a file descriptor arrived")
        return fds[0]

    def close(self) -> None:
        """Close this end (the peer reads end of file)."""
        self.sock.close()

    def _read(self, n: int, deadline: float | None) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self._timed(deadline, self.sock.recv_into, view[got:])
            if k == 0:
                raise EOFError("the channel closed")
            got += k
        return bytes(buf)

    def _timed(self, deadline: float | None, fn: Any, *args: Any) -> Any:
        if deadline is None:
            self.sock.settimeout(None)
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChannelTimeout()
            self.sock.settimeout(left)
        try:
            return fn(*args)
        except TimeoutError as e:  # socket.timeout
            raise ChannelTimeout() from e


class Arena:
    """A nameless shared-memory mapping of ``nbytes`` in this process; :attr:`fd` maps it elsewhere."""

    def __init__(self, nbytes: int) -> None:
        directory = SHM_DIR if os.path.isdir(SHM_DIR) else None
        fd, path = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", dir=directory)
        os.unlink(path)  # from here on nothing outlives the processes that hold it
        try:
            os.ftruncate(fd, nbytes)
            self.map = mmap.mmap(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
        self.fd: int | None = fd
        """Open until :meth:`close_fd` (after the writer mapped it)."""
        self.nbytes = nbytes
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)
        self.base = self.tensor.data_ptr()

    def close_fd(self) -> None:
        """Close the descriptor (the mapping stays)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def offset_of(self, t: torch.Tensor) -> int | None:
        """Where ``t``'s bytes lie in the arena, or None if they lie elsewhere."""
        ptr = t.data_ptr()
        n = t.numel() * t.element_size()
        if t.device.type == "cpu" and t.is_contiguous() and self.base <= ptr and ptr + n <= self.base + self.nbytes:
            return ptr - self.base
        return None


def sweep_arenas(directory: str = SHM_DIR) -> list[str]:
    """Remove arena files whose owner process is dead; returns the names removed.

    Arenas are unlinked as soon as they exist, so a name is left only by a process killed in
    that instant. Files of live owners are kept (in a container the owner may be a process
    this one cannot see: it only loses a name nobody uses).
    """
    try:
        names = [n for n in os.listdir(directory) if n.startswith(PREFIX)]
    except OSError:
        return []
    removed = []
    for name in names:
        owner = name[len(PREFIX) :].split("-", 1)[0]
        if not owner.isdigit() or _alive(int(owner)):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(name)
        except OSError:
            pass
    if removed:
        logger.info("removed %d shared-memory arena(s) of dead writer owners: %s", len(removed), ", ".join(removed))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True
