"""The file plumbing under :class:`~tessera.storage.local.FileStorage`: paths, descriptors, durability.

:class:`LocalFiles` owns what every operation of the file backend shares: the root, relative paths
checked against it, directories made and fsync'ed, files created exclusively, the cached read
descriptors and memory maps, and the commit lock. :func:`typed_errors` gives every operation the
errors the Storage protocol promises.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import mmap
import os
import threading
from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar
from urllib.parse import urlparse

from ..errors import StorageError
from ..format.names import check_relpath

logger = logging.getLogger(__name__)

LOCK_NAME = ".tessera-lock"
"""File (next to a manifest) that writers of that manifest ``flock`` while they replace it."""


_P = ParamSpec("_P")
_R = TypeVar("_R")
_S = TypeVar("_S", bound="LocalFiles")


def typed_errors(
    method: Callable[Concatenate[_S, str, _P], _R],
) -> Callable[Concatenate[_S, str, _P], _R]:
    """Raise what the Storage protocol promises: ``StorageError`` naming the file, or
    ``FileNotFoundError`` / ``IsADirectoryError`` / ``NotADirectoryError`` for a path that is
    missing or not a file; never another raw ``OSError`` (EIO, EACCES, ENAMETOOLONG...)."""

    @functools.wraps(method)
    def typed(self: _S, path: str, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return method(self, path, *args, **kwargs)
        except (StorageError, FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise
        except OSError as e:
            where = os.path.join(self.root, path)
            raise StorageError(f"{method.__name__.strip('_')} of {where} failed: {type(e).__name__}: {e}") from e

    return typed


def local_root(url: str) -> str:
    """The filesystem path of a plain path or ``file://`` URL."""
    if url.startswith("file://"):
        return urlparse(url).path
    return url


class LocalFiles:
    """A directory on a local or shared filesystem, as the file backend's operations use it.

    Args:
        url: a directory path or ``file://`` URL (created on first write).
        durable: fsync files and directories before an operation returns.
    """

    def __init__(self, url: str, *, durable: bool = True) -> None:
        self.url = url
        self.root = os.path.abspath(local_root(url))
        self.durable = durable
        self._fds: dict[str, int] = {}
        self._maps: dict[str, mmap.mmap | None] = {}
        self._maps_lock = threading.Lock()

    def _abs(self, path: str) -> str:
        return os.path.join(self.root, check_relpath(path))

    def _fsync_dir(self, path: str) -> None:
        if not self.durable:
            return
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _makedirs(self, directory: str) -> None:
        if os.path.isdir(directory):
            return
        os.makedirs(directory, exist_ok=True)
        # Make the new directory entries themselves durable, up to the root's parent.
        d = directory
        while self.durable and d.startswith(self.root) and d != os.path.dirname(self.root):
            self._fsync_dir(os.path.dirname(d))
            if d == self.root:
                break
            d = os.path.dirname(d)

    def _create(self, full: str) -> int:
        """Create ``full`` exclusively, with its directories.

        Retried if a directory vanishes in between: another save's cleanup removes
        directories it left empty (``data/``, ``.tessera-saves/``), which may be ones just made.
        """
        for attempt in range(8):
            try:
                self._makedirs(os.path.dirname(full))
                return os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileNotFoundError:
                if attempt == 7:
                    raise
        raise AssertionError("unreachable")

    @staticmethod
    def _unlink_quietly(full: str) -> None:
        try:
            os.unlink(full)
        except FileNotFoundError:
            pass
        except OSError as e:  # the original error matters more
            logger.warning("could not remove partial file %s: %s", full, e)

    @staticmethod
    def _lock(directory: str, full: str) -> int:
        """An exclusive ``flock`` on ``directory`` itself (no file left behind), or, where the
        filesystem cannot lock a directory (NFS emulates ``flock`` with POSIX locks, which need
        a writable descriptor), on ``directory/.tessera-lock``. Returns the locked descriptor."""
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            raise StorageError(f"cannot open {directory} to commit {full}: {e}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return fd
        except OSError:
            os.close(fd)
        try:
            fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            raise StorageError(f"cannot take the commit lock of {full}: {e}") from e
        return fd

    def _fd(self, full: str) -> int:
        # One descriptor per file, shared by all threads: pread is positional, so safe.
        with self._maps_lock:
            fd = self._fds.get(full)
            if fd is None:
                if len(self._fds) >= 256:
                    self._close_fds()
                fd = self._fds[full] = os.open(full, os.O_RDONLY)
            return fd

    def _close_fds(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def close(self) -> None:
        """Close cached descriptors and memory maps (also done when the object is collected)."""
        with self._maps_lock:
            self._close_fds()
            maps, self._maps = self._maps, {}
        for m in maps.values():
            if m is not None:
                try:
                    m.close()
                except BufferError:  # a view is still alive somewhere; the GC will close it
                    pass

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
