"""Write data files from a separate, long-lived writer process fed from shared memory.

With :attr:`tessera.WriterMode.PROCESS` a save's file writes, checksums and fsyncs run in a
child process instead of threads of the training process, so they never take the training
loop's GIL. The training process copies the bytes a rank writes into a shared-memory arena
(a ``/dev/shm`` mapping both processes hold, reused by later saves and grown when a save
needs more), sends the child the file layouts and where each tile lies in the arena, and
gets back what :func:`tessera.engine.saving.write.write_files` returns (sizes and checksums). The child runs
that very function on views of the arena, so files are byte-identical to the thread
writer's. Planning, the claim and the commit protocol stay in the training process.

One writer serves every save of a process, one save at a time; it is started at the first
save that uses it (a new interpreter: about the cost of importing torch) and exits when its
parent does: it reads requests from a pipe, and the pipe's end of file (or a changed parent
pid) stops it. Only :class:`~tessera.storage.local.FileStorage` is written from the child
(other backends may keep state in the training process, like ``memory://``); saves to any
other backend use the thread writer.
"""

from __future__ import annotations

import atexit
import logging
import mmap
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from ...errors import CheckpointError, StorageError
from ...format.tilefile import FileLayout
from ...storage.base import Storage
from ...storage.local import FileStorage
from .write import WriteRequest, WrittenFile, write_files

logger = logging.getLogger(__name__)

_ALIGN = 64
_SHM_DIR = "/dev/shm"

__all__ = ["ProcessWriter", "shutdown", "write_files_in_process", "write_tiles_in_process"]


class _Arena:
    """A shared-memory file mapped in this process; the child maps the same file."""

    def __init__(self, nbytes: int) -> None:
        directory = _SHM_DIR if os.path.isdir(_SHM_DIR) else None
        fd, self.path = tempfile.mkstemp(prefix="tessera-writer-", dir=directory)
        try:
            os.ftruncate(fd, nbytes)
            self.map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.nbytes = nbytes
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)
        self.base = self.tensor.data_ptr()

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def offset_of(self, t: torch.Tensor) -> int | None:
        """Where ``t``'s bytes lie in the arena, or None if they lie elsewhere."""
        ptr = t.data_ptr()
        n = t.numel() * t.element_size()
        if t.device.type == "cpu" and t.is_contiguous() and self.base <= ptr and ptr + n <= self.base + self.nbytes:
            return ptr - self.base
        return None


class ProcessWriter:
    """The writer process and its shared-memory arena. Thread-safe; one request at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: Any = None
        self._conn: Connection | None = None
        self._arena: _Arena | None = None

    @property
    def pid(self) -> int | None:
        """The child's process id (None before the first save)."""
        return None if self._proc is None else self._proc.pid

    def _start(self) -> Connection:
        if self._proc is not None and self._proc.poll() is None and self._conn is not None:
            return self._conn
        self._stop_locked()
        # A fresh interpreter, not a multiprocessing spawn: spawn re-runs the module level of
        # the user's main script, which in a training script without a __main__ guard trains.
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        code = f"from tessera.engine.saving.writer_process import _main; _main({theirs.fileno()}, {os.getpid()})"
        try:
            proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()], env=env)
        finally:
            theirs.close()
        self._proc, self._conn, self._arena = proc, Connection(ours.detach()), None
        _register_exit()
        logger.debug("started the writer process (pid %d)", proc.pid)
        return self._conn

    def _ensure_arena(self, conn: Connection, nbytes: int) -> _Arena:
        arena = self._arena
        if arena is not None and arena.nbytes >= nbytes:
            return arena
        self._arena = None  # the old mapping goes once nothing refers to it
        arena = _Arena(max(nbytes, 1))
        try:
            self._call(conn, ("map", arena.path, arena.nbytes))
        finally:
            arena.unlink()  # both processes hold a mapping: the name is no longer needed
        self._arena = arena
        logger.debug("writer arena of %d bytes", arena.nbytes)
        return arena

    def _call(self, conn: Connection, request: tuple) -> Any:
        try:
            conn.send(request)
            status, payload = conn.recv()
        except (EOFError, OSError, BrokenPipeError) as e:
            code = None if self._proc is None else self._proc.poll()
            self._stop_locked()
            raise StorageError(f"the tessera writer process died (exit code {code}): {type(e).__name__}: {e}") from e
        if status == "error":
            raise payload
        return payload

    def write(
        self,
        storage: FileStorage,
        files: Sequence[tuple[str, FileLayout, Sequence[torch.Tensor]]],
        *,
        chunk_bytes: int,
        threads: int,
    ) -> list[WrittenFile]:
        """:func:`tessera.engine.saving.write.write_files`, run in the writer process (same contract)."""
        with self._lock:
            conn = self._start()
            # Sized from the layouts: the tiles may still be being staged (each is waited for below).
            total = sum(s.nbytes + (-s.nbytes % _ALIGN) for _, layout, _ in files for s in layout.slots)
            arena = self._ensure_arena(conn, total)
            jobs = []
            pos = 0
            for path, layout, staged in files:
                spans = []
                for t in staged:
                    n = t.numel() * t.element_size()
                    off = arena.offset_of(t)
                    if off is None:  # copy into shared memory (torch copies without the GIL)
                        off = pos
                        if n:
                            arena.tensor[off : off + n].copy_(t.reshape(-1).view(torch.uint8))
                        pos += n + (-n % _ALIGN)
                    spans.append((off, n))
                jobs.append((path, layout, spans))
            request = ("write", storage.url, storage.durable, jobs, chunk_bytes, threads)
            try:
                return self._call(conn, request)
            except StorageError:
                if self._proc is None:  # the child died mid-write: nobody removed its partial files
                    try:
                        storage.delete([p for p, _, _ in files])
                    except Exception as e:
                        logger.warning("could not remove the files of a failed write under %s: %s", storage.url, e)
                raise

    def stop(self) -> None:
        """Stop the child and drop the arena (a later save starts a new one)."""
        with self._lock:
            self._stop_locked()

    def _stop_locked(self) -> None:
        conn, proc = self._conn, self._proc
        self._conn, self._proc, self._arena = None, None, None
        if conn is not None:
            try:
                conn.send(("stop",))
            except (OSError, BrokenPipeError):
                pass
            conn.close()
        if proc is not None:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


_WRITER: ProcessWriter | None = None
_WRITER_LOCK = threading.Lock()


def _writer() -> ProcessWriter:
    global _WRITER
    with _WRITER_LOCK:
        if _WRITER is None:
            _WRITER = ProcessWriter()
        return _WRITER


def write_files_in_process(
    storage: Storage,
    files: Sequence[tuple[str, FileLayout, Sequence[torch.Tensor]]],
    *,
    chunk_bytes: int,
    threads: int,
) -> list[WrittenFile]:
    """Write like :func:`tessera.engine.saving.write.write_files`, from this process's writer process.

    Backends other than :class:`~tessera.storage.local.FileStorage` are written by threads of
    this process, as :func:`~tessera.engine.saving.write.write_files` does.

    Raises:
        StorageError: a failed write (the child removes what it wrote, as the thread writer does),
            or the writer process died.
    """
    if type(storage) is not FileStorage or not files:
        return write_files(storage, files, chunk_bytes=chunk_bytes, threads=threads)
    return _writer().write(storage, files, chunk_bytes=chunk_bytes, threads=threads)


def shutdown() -> None:
    """Stop this process's writer process, if one runs (saves after this start a new one)."""
    with _WRITER_LOCK:
        writer = _WRITER
    if writer is not None:
        writer.stop()


_EXIT_REGISTERED = False


def _register_exit() -> None:
    # Stop the child at interpreter exit (non-daemon save threads have finished by then).
    global _EXIT_REGISTERED
    if not _EXIT_REGISTERED:
        _EXIT_REGISTERED = True
        atexit.register(shutdown)


def _main(fd: int, parent_pid: int) -> None:
    """Entry point of the writer process."""
    # Ctrl-C reaches the whole process group: the training process decides what happens to
    # a save in flight, so the writer finishes its request instead of dying half-way.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _serve(Connection(fd), parent_pid)


def _watch_parent(parent_pid: int) -> None:
    # The pipe's EOF stops the child when the parent exits; this covers a parent that dies
    # while something else still holds the pipe open (a forked grandchild, say).
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(0)


def _serve(conn: Connection, parent_pid: int) -> None:
    """The writer process: map arenas, write files, report; until the parent goes away."""
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    arena: torch.Tensor | None = None
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        kind = request[0]
        if kind == "stop":
            return
        try:
            if kind == "map":
                _, path, nbytes = request
                fd = os.open(path, os.O_RDWR)
                try:
                    arena = torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)
                finally:
                    os.close(fd)
                reply: Any = None
            elif kind == "write":
                _, url, durable, jobs, chunk_bytes, threads = request
                if arena is None:
                    raise CheckpointError("internal error: the writer process has no shared-memory arena")
                store = FileStorage(url, durable=durable)
                files = [(p, lay, [arena[o : o + n] for o, n in spans]) for p, lay, spans in jobs]
                reply = write_files(store, files, chunk_bytes=chunk_bytes, threads=threads)
            else:
                raise CheckpointError(f"internal error: unknown writer request {kind!r}")
            conn.send(("ok", reply))
        except BaseException as e:  # sent back: the parent raises it in the save
            conn.send(("error", _picklable(e)))


def _picklable(e: BaseException) -> BaseException:
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return StorageError(f"{type(e).__name__}: {e}")


def write_tiles_in_process(storage: Storage, request: WriteRequest) -> list[WrittenFile]:
    """:func:`tessera.engine.saving.write.write_tiles` (the write phase of a save), from this process's writer process."""
    files = [(f.path, f.layout, f.tiles) for f in request.files]
    return write_files_in_process(storage, files, chunk_bytes=request.chunk_bytes, threads=request.threads)
