"""Local or shared POSIX filesystem backend.

Data files are created exclusively (``O_EXCL``: an existing file is never reopened, let
alone truncated), written with large sequential ``os.write`` calls and fsync'ed; a failed
write removes its partial file. Durable data-file writes bypass the page cache (``O_DIRECT``
through a small aligned buffer, where the filesystem allows it; see :func:`_write_direct`) on
devices where that measured faster (:mod:`.direct_choice`), and are buffered on the others. :meth:`FileStorage.sync_dirs` then makes their directory
entries durable. The manifest is committed by writing a temporary file, fsync,
``os.replace`` and an fsync of the directory, so a crash leaves either the old or the new
manifest. :meth:`FileStorage.replace_if` does the same under an exclusive ``flock`` of the
directory and only if the manifest is still the version the save started from: the fence between two writers of one path (see docs/guarantees.md). Range reads use
``pread`` on cached descriptors shared by all threads, or a memory map
(:meth:`FileStorage.map_range`).
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from collections.abc import Iterable

from .. import _knobs
from ..errors import ConcurrentSaveError, StorageError
from ..format.names import check_relpath
from . import recache
from ._direct_io import _set_direct, _write_all, _write_direct
from ._local_files import LOCK_NAME as LOCK_NAME
from ._local_files import LocalFiles, typed_errors
from ._local_files import local_root as local_root
from .base import Buffer, is_temp_name, temp_name, timed_chunks
from .direct_choice import CHOICE as DIRECT_CHOICE

logger = logging.getLogger(__name__)


class FileStorage(LocalFiles):
    """Checkpoint storage on a local or shared filesystem.

    Args:
        url: a directory path or ``file://`` URL (created on first write).
        durable: fsync data files, the manifest and directories before a save returns.
            Turning it off is faster and still atomic against process crashes, but not
            against power loss or a kernel crash.
    """

    def __init__(self, url: str, *, durable: bool = True) -> None:
        super().__init__(url, durable=durable)
        self._yielded = False  # whether this storage's reads made the re-caching of its checkpoint give way
        self._cached: set[str] = set()  # data files written buffered, not yet offered for re-caching

    def reopen(self, url: str) -> FileStorage:
        """:class:`~tessera.storage.base.Reopens`: a directory at ``url`` with the same durability."""
        return FileStorage(url, durable=self.durable)

    def write_file(self, path: str, chunks: Iterable[Buffer]) -> None:
        """Create ``path`` from ``chunks``; durable (fsync) on return when ``durable``.

        The file is created with ``O_EXCL``, so no file that exists (for instance one a
        committed manifest references) is ever reopened or truncated. If ``path`` exists,
        the new content goes to a temporary file that then replaces it by rename (readers
        holding the old file keep reading the old bytes). A failed write removes what it
        wrote.

        Raises:
            StorageError: if the file cannot be created or written (ENOSPC included).
        """
        full = self._abs(path)
        recache.yield_to_writes()
        t0 = time.monotonic()
        try:
            fd = self._create(full)
            target = full
        except FileExistsError:
            target = temp_name(full)
            try:
                fd = self._create(target)
            except OSError as e:
                raise StorageError(f"cannot create {target}: {e}") from e
        except OSError as e:
            raise StorageError(f"cannot create {full}: {e}") from e
        ok = direct = False
        try:
            how = _knobs.direct_io() if self.durable else "off"
            device = os.fstat(fd).st_dev if how == "auto" else 0
            waited = 0.0

            def wait(seconds: float) -> None:
                nonlocal waited
                waited += seconds

            if how == "auto":
                chunks = timed_chunks(chunks, wait)
            if how == "on" or (how == "auto" and DIRECT_CHOICE.use_direct(device)):
                direct = _set_direct(fd, True)
            if direct:
                # a file the filesystem refused direct writes for part way is in the page cache
                # (and timed) as a buffered one
                direct = _write_direct(fd, chunks)
            else:
                for chunk in chunks:
                    _write_all(fd, memoryview(chunk).cast("B"))
            if self.durable:
                os.fsync(fd)
            if how == "auto":
                # the device's time only: not the waits for the producer's next bytes (a staging
                # copy, a coder), which would make whichever mode this file used look slower
                DIRECT_CHOICE.record(device, direct, os.fstat(fd).st_size, time.monotonic() - t0 - waited)
            if self.durable and not direct:
                self._cached.add(full)  # buffered: in the page cache already, nothing to read back
            ok = True
        except OSError as e:
            raise StorageError(f"writing {full} failed: {e}") from e
        finally:
            os.close(fd)
            if not ok:
                # A partial file must not stay behind: on a full disk it would keep the disk full.
                self._unlink_quietly(target)
        if target != full:
            try:
                os.replace(target, full)
            except OSError as e:
                self._unlink_quietly(target)
                raise StorageError(f"replacing {full} failed: {e}") from e

    def recache(self, paths: Iterable[str], *, supersedes: bool = True) -> None:
        """:class:`~tessera.storage.capabilities.Recaches`: bring files of a committed save back into
        the page cache in the background (:mod:`.recache`), where ``O_DIRECT`` writes left them out."""
        if not self.durable:
            return  # buffered writes: the page cache has them already
        full = [self._abs(p) for p in paths]
        direct = [p for p in full if p not in self._cached]
        self._cached.difference_update(full)
        if direct:
            recache.offer(self.root, direct, supersedes=supersedes)

    def sync_dirs(self, paths: Iterable[str]) -> None:
        """Make the directory entries of ``paths`` durable: one fsync per distinct directory.

        Called after the files themselves were fsync'ed and before anything refers to them
        (the manifest), so that after a power loss a committed manifest never names a file
        whose directory entry was lost.
        """
        if not self.durable:
            return
        for d in sorted({os.path.dirname(self._abs(p)) for p in paths}):
            try:
                self._fsync_dir(d)
            except OSError as e:
                raise StorageError(f"fsync of directory {d} failed: {e}") from e

    def write_atomic(self, path: str, data: bytes) -> None:
        full = self._abs(path)
        directory = os.path.dirname(full)
        self._makedirs(directory)
        self._replace_with(full, data)

    def _replace_with(self, full: str, data: bytes) -> None:
        """Atomically make ``full`` hold ``data``: a durable temporary file, a rename, then the
        directory fsync'ed, so the new name is durable when this returns (and nothing partial is
        ever visible under ``full``)."""
        tmp = temp_name(full)
        try:
            self._write_new(tmp, data)
            os.replace(tmp, full)
            self._fsync_dir(os.path.dirname(full))
        except OSError as e:
            raise StorageError(f"committing {full} failed: {e}") from e
        finally:
            if os.path.exists(tmp):
                self._unlink_quietly(tmp)

    def _write_new(self, full: str, data: bytes) -> None:
        fd = self._create(full)
        try:
            view = memoryview(data).cast("B")
            while len(view):
                view = view[os.write(fd, view) :]
            if self.durable:
                os.fsync(fd)
        finally:
            os.close(fd)

    @typed_errors
    def version(self, path: str) -> str | None:
        """An opaque token of ``path``'s current content (None if absent).

        Every replacement by rename creates a new inode, so the token changes with each commit.
        """
        try:
            st = os.stat(self._abs(path))
        except FileNotFoundError:
            return None
        return f"{st.st_dev}-{st.st_ino}-{st.st_mtime_ns}-{st.st_ctime_ns}-{st.st_size}"

    def replace_if(self, path: str, data: bytes, expected: str | None, *, owner: str | None = None) -> None:
        """Publish ``data`` at ``path`` atomically, only if its :meth:`version` is ``expected``
        (and, with ``owner``, only if that file, the save's owner marker, still exists).

        The check and the rename happen under an exclusive ``flock`` of the directory (or of
        ``<dir>/.tessera-lock`` where directories cannot be locked), released by the kernel if
        the process dies, so it never goes stale. Every writer of
        a manifest through this method takes the same lock, so check-then-replace is atomic
        among them, on one host and on shared filesystems whose ``flock`` is coherent across
        clients (NFSv4, Lustre with ``flock``, GPFS). Temporary files left by writers that
        crashed are removed while the lock is held.

        Raises:
            ConcurrentSaveError: if ``path`` changed since ``expected`` was read, or ``owner``
                is gone (another job's retention removed this unfinished save: see :meth:`uncommit`).
            StorageError: if writing fails (nothing is published then).
        """
        full = self._abs(path)
        directory = os.path.dirname(full)
        self._makedirs(directory)
        lock = self._lock(directory, full)
        try:
            current = self.version(path)
            if current != expected:
                raise ConcurrentSaveError(
                    f"not committing {full}: another save committed it while this one ran "
                    f"(the manifest is no longer the one this save started from); two jobs are saving "
                    f"to one path. The other save's checkpoint stands; this save's files were removed"
                )
            if owner is not None and not os.path.exists(self._abs(owner)):
                raise ConcurrentSaveError(
                    f"not committing {full}: this save's owner marker {owner} was removed while it ran "
                    "(another job's CheckpointManager deleted this unfinished checkpoint as a leftover, "
                    "with some of its files); two jobs are saving under one root. Nothing was committed"
                )
            base = os.path.basename(full)
            for name in os.listdir(directory):  # leftovers of writers that died mid-commit
                if is_temp_name(name, of=base):
                    self._unlink_quietly(os.path.join(directory, name))
            self._replace_with(full, data)
        finally:
            os.close(lock)  # releases the flock

    def uncommit(self, manifest: str, expected: str | None, markers: Iterable[str]) -> bool:
        """Start deleting the checkpoint of ``manifest`` (retention): under the commit lock of
        :meth:`replace_if`, if the manifest's :meth:`version` is still ``expected`` (None: still
        absent), delete it and the owner ``markers`` of the saves found there, and return True.

        Afterwards none of those saves can publish (:meth:`replace_if` checks its marker under
        the same lock), so their data files may be deleted. Returns False, deleting nothing, if
        a save committed ``manifest`` since ``expected`` was read.
        """
        full = self._abs(manifest)
        directory = os.path.dirname(full)
        if not os.path.isdir(directory):
            return expected is None
        lock = self._lock(directory, full)
        try:
            if self.version(manifest) != expected:
                return False
            self.delete([manifest, *markers])
            return True
        finally:
            os.close(lock)

    @typed_errors
    def file_sizes(self, prefix: str) -> dict[str, int]:
        """``{relative path: size}`` of every file under ``prefix`` (one directory walk)."""
        base = self._abs(prefix) if prefix else self.root
        out: dict[str, int] = {}
        stack = [base]
        while stack:
            d = stack.pop()
            try:
                entries = list(os.scandir(d))
            except FileNotFoundError:
                continue
            except NotADirectoryError:
                continue
            for e in entries:
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                elif e.name != LOCK_NAME:
                    try:
                        size = e.stat().st_size
                    except FileNotFoundError:
                        continue
                    out[os.path.relpath(e.path, self.root).replace(os.sep, "/")] = size
        return out

    def remove_empty_dirs(self, prefix: str) -> None:
        """Remove empty directories under ``prefix`` (left by saves killed between creating a
        directory and their first file). A writer that races with this retries (:meth:`_create`)."""
        base = self._abs(prefix)
        for dirpath, _, filenames in os.walk(base, topdown=False):
            # Bottom-up, so a directory whose subdirectories were just removed is empty now.
            if dirpath != base and not filenames:
                try:
                    os.rmdir(dirpath)
                except OSError:  # not empty (or raced): left alone
                    pass

    def location(self) -> str:
        """Where this backend stores, as one comparable string: the directory with symlinks
        resolved, so ranks that reach one directory through different links agree."""
        return "file://" + os.path.realpath(self.root)

    @typed_errors
    def read_file(self, path: str) -> bytes:
        with open(self._abs(path), "rb") as f:
            return f.read()

    @typed_errors
    def read_bounded(self, path: str, limit: int) -> bytes | int:
        """:class:`~tessera.storage.capabilities.ReadsBounded`: one open, its size from ``fstat``."""
        with open(self._abs(path), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                return size
            # read(n) allocates n bytes up front: ask for what fstat saw (and one more, to see
            # whether the file grew since), never for the limit itself.
            parts = [f.read(size + 1)]
            got = len(parts[0])
            while got > size and got <= limit and (more := f.read(min(1 << 20, limit + 1 - got))):
                parts.append(more)
                got += len(more)
        return got if got > limit else b"".join(parts)

    def _loading(self) -> None:
        """A data read: the re-caching of this checkpoint gives way to the load (:mod:`.recache`)."""
        if not self._yielded:
            self._yielded = True
            recache.yield_to_reads(self.root)

    @typed_errors
    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        self._loading()
        full = self._abs(path)
        fd = self._fd(full)
        view = out.cast("B") if out.format != "B" else out
        got = 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], offset + got)
            if n == 0:
                raise StorageError(
                    f"{full} is truncated: wanted bytes [{offset}, {offset + len(view)}), file ends at {offset + got}"
                )
            got += n

    @typed_errors
    def map_range(self, path: str, offset: int, length: int) -> memoryview:
        """A read-only, zero-copy view of ``[offset, offset + length)`` of ``path`` (mmap).

        Lets a reader verify and copy straight from the page cache instead of reading into
        a buffer first. The kernel is asked to read the range ahead (``MADV_WILLNEED``).

        Raises:
            StorageError: if the file is shorter than the range.
        """
        self._loading()
        full = self._abs(path)
        with self._maps_lock:
            m = self._maps.get(full)
            if m is None:
                with open(full, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    # Copy-on-write: writable for torch.frombuffer, yet no write ever reaches the file.
                    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
                self._maps[full] = m
        size = len(m) if m is not None else 0
        if offset + length > size:
            raise StorageError(f"{full} is truncated: wanted bytes [{offset}, {offset + length}), file ends at {size}")
        if m is None:
            return memoryview(b"")
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        try:
            m.madvise(mmap.MADV_WILLNEED, start, offset + length - start)
        except (AttributeError, OSError):  # pragma: no cover - platforms without madvise
            pass
        return memoryview(m)[offset : offset + length]

    @typed_errors
    def release_range(self, path: str, offset: int, length: int) -> None:
        """Drop this process's mapping of a range returned by :meth:`map_range`.

        The pages stay in the page cache; only the process stops holding them, so its
        resident memory does not grow with the size of the checkpoint it reads.
        """
        with self._maps_lock:
            m = self._maps.get(self._abs(path))
        if m is None:
            return
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        try:
            m.madvise(mmap.MADV_DONTNEED, start, min(len(m), offset + length) - start)
        except (AttributeError, OSError):  # pragma: no cover
            pass

    @typed_errors
    def size(self, path: str) -> int:
        return os.path.getsize(self._abs(path))

    @typed_errors
    def _list(self, prefix: str) -> list[str]:
        base = self._abs(prefix) if prefix else self.root
        if os.path.isfile(base):
            return [check_relpath(prefix)]
        found = []
        for dirpath, _, files in os.walk(base):
            for name in files:
                if name == LOCK_NAME:  # the commit lock is not part of the checkpoint
                    continue
                found.append(os.path.relpath(os.path.join(dirpath, name), self.root).replace(os.sep, "/"))
        return sorted(found)

    @typed_errors
    def exists(self, path: str) -> bool:
        return os.path.exists(self._abs(path))

    def list(self, prefix: str = "") -> list[str]:
        """Every file under ``prefix`` (a directory or a file), relative to the root, sorted."""
        return self._list(prefix)

    def delete(self, paths: Iterable[str]) -> None:
        dirs = set()
        for p in paths:
            full = self._abs(p)
            try:
                os.unlink(full)
                dirs.add(os.path.dirname(full))
            except (FileNotFoundError, NotADirectoryError):  # absent: nothing to delete
                pass
        # Remove directories left empty (e.g. an old save generation), deepest first.
        for d in sorted(dirs, key=len, reverse=True):
            while d.startswith(self.root) and d != self.root:
                try:
                    if os.listdir(d) == [LOCK_NAME]:  # a checkpoint directory being removed whole
                        os.unlink(os.path.join(d, LOCK_NAME))
                    os.rmdir(d)
                except OSError:
                    break
                d = os.path.dirname(d)
