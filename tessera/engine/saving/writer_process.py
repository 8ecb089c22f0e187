"""Write data files from a separate, long-lived writer process fed from shared memory.

With :attr:`tessera.options.WriterMode.PROCESS` a save's file writes, checksums and fsyncs run in a
child process instead of threads of the training process, so they never take the training
loop's GIL. The training process copies the bytes a rank writes into a shared-memory arena
(a mapping both processes hold, reused by later saves and grown when a save needs more; its
file is unlinked as soon as it exists and reaches the child as a file descriptor, so it never
outlives them: see :mod:`tessera.engine.saving.writer_channel`), sends the child the file layouts and where each tile lies in the arena, and
gets back what :func:`tessera.engine.saving.write.write_files` returns (sizes and checksums). The child runs
that very function on views of the arena, so files are byte-identical to the thread
writer's. Planning, the claim and the commit protocol stay in the training process.

One writer serves every save of a process, one save at a time; it is started at the first
save that uses it (a new interpreter: about the cost of importing torch) and exits when its
parent does: it reads requests from a socket, and the socket's end of file (or a changed
parent pid) stops it.

No wait on the child is unbounded: when the child makes no progress for
``TESSERA_WRITER_TIMEOUT_S`` seconds (default: half of ``TESSERA_TIMEOUT_S``) — it was stopped
(SIGSTOP), or a write hangs in the kernel — the training process kills it and the save fails
with :class:`~tessera.errors.StorageError` (on every rank, through the commit exchange); the
next save starts a new writer. A slow write is not stuck: the child reports progress while
bytes reach storage. Only :class:`~tessera.storage.local.FileStorage` is written from the child
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
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from ... import _knobs
from ...errors import CheckpointError, StorageError
from ...format.chunking import Chunking
from ...format.tilefile import FileLayout
from ...storage.base import Storage
from ...storage.local import FileStorage
from .write import WriteRequest, WrittenFile, write_files
from .writer_channel import Arena, Channel, ChannelTimeout, sweep_arenas

logger = logging.getLogger(__name__)

_ALIGN = 64

__all__ = ["ProcessWriter", "shutdown", "write_files_in_process", "write_tiles_in_process"]


class ProcessWriter:
    """The writer process and its shared-memory arena. Thread-safe; one request at a time.

    Every wait on the child is bounded: a request fails with :class:`StorageError` (and the
    child is killed) once the child has made no progress for ``TESSERA_WRITER_TIMEOUT_S``
    seconds; the child reports progress every :data:`_PROGRESS_EVERY_S` (at most a quarter of
    that timeout) while bytes reach storage, so a slow write does not time out and a stopped
    or stuck one always does.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: Any = None
        self._channel: Channel | None = None
        self._arena: Arena | None = None

    @property
    def pid(self) -> int | None:
        """The child's process id (None before the first save)."""
        return None if self._proc is None else self._proc.pid

    def _start(self) -> Channel:
        if self._proc is not None and self._proc.poll() is None and self._channel is not None:
            return self._channel
        self._stop_locked()
        sweep_arenas()  # names a process SIGKILLed while creating one could have left
        # A fresh interpreter, not a multiprocessing spawn: spawn re-runs the module level of
        # the user's main script, which in a training script without a __main__ guard trains.
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        root = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 3))  # above tessera/
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        code = f"from tessera.engine.saving.writer_process import _main; _main({theirs.fileno()}, {os.getpid()})"
        try:
            proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()], env=env)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._proc, self._channel, self._arena = proc, Channel(ours), None
        _register_exit()
        # A new interpreter importing torch can take long on a loaded machine: its start is
        # bounded by the general timeout, not by the (shorter) no-progress one.
        startup_s = max(_knobs.collective_timeout_s(), _knobs.writer_timeout_s())
        self._call(self._channel, None, "starting the writer process", timeout=startup_s)
        logger.debug("started the writer process (pid %d)", proc.pid)
        return self._channel

    def _ensure_arena(self, channel: Channel, nbytes: int, what: str) -> Arena:
        arena = self._arena
        if arena is not None and arena.nbytes >= nbytes:
            return arena
        self._arena = None  # the old mapping goes once nothing refers to it
        arena = Arena(max(nbytes, 1))
        try:
            self._call(channel, ("map", arena.nbytes), what, fd=arena.fd)
        finally:
            arena.close_fd()  # both processes hold a mapping: the descriptor is no longer needed
        self._arena = arena
        logger.debug("writer arena of %d bytes", arena.nbytes)
        return arena

    def _call(
        self, channel: Channel, request: tuple | None, what: str, fd: int | None = None, timeout: float | None = None
    ) -> Any:
        """Send ``request`` (None: only wait for a message) and wait for its reply, at most
        ``timeout`` (default ``TESSERA_WRITER_TIMEOUT_S``) seconds without progress."""
        if timeout is None:
            timeout = _knobs.writer_timeout_s()
        deadline = time.monotonic() + timeout
        try:
            if request is not None:
                channel.send(request, deadline)
            if fd is not None:
                channel.send_fd(fd, deadline)
            while True:
                kind, payload = channel.recv(deadline)
                if kind != "progress":
                    break
                deadline = time.monotonic() + timeout  # bytes are reaching storage: not stuck
        except ChannelTimeout as e:
            pid = self.pid
            self._kill_locked()
            raise StorageError(
                f"the tessera writer process (pid {pid}) made no progress for {timeout:g} s while {what}, "
                "and was killed (TESSERA_WRITER_TIMEOUT_S; TESSERA_TIMEOUT_S for its start); the storage "
                "may hang (check it), or the process was stopped. The next save starts a new writer process"
            ) from e
        except (EOFError, OSError) as e:
            code = None if self._proc is None else self._proc.poll()
            self._stop_locked()
            raise StorageError(
                f"the tessera writer process died (exit code {code}) while {what}: {type(e).__name__}: {e}"
            ) from e
        if kind == "error":
            raise payload
        return payload

    def write(
        self,
        storage: FileStorage,
        files: Sequence[tuple[str, FileLayout, Sequence[torch.Tensor]]],
        *,
        chunking: Chunking,
        threads: int,
        compress: bool | str = False,
    ) -> list[WrittenFile]:
        """:func:`tessera.engine.saving.write.write_files`, run in the writer process (same contract)."""
        what = f"writing {len(files)} data file(s) under {storage.url}"
        with self._lock:
            channel = self._start()
            # Sized from the layouts: the tiles may still be being staged (each is waited for below).
            total = sum(s.nbytes + (-s.nbytes % _ALIGN) for _, layout, _ in files for s in layout.slots)
            arena = self._ensure_arena(channel, total, what)
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
            every_s = min(_PROGRESS_EVERY_S, _knobs.writer_timeout_s() / 4)
            request = ("write", storage.url, storage.durable, jobs, chunking, threads, every_s, compress)
            try:
                return self._call(channel, request, what)
            except StorageError:
                if self._proc is None:  # the child died or was killed mid-write: nobody removed its files
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
        channel, proc = self._channel, self._proc
        self._channel, self._proc, self._arena = None, None, None
        if channel is not None:
            try:
                channel.send(("stop",), time.monotonic() + 1.0)
            except (ChannelTimeout, OSError):
                pass
            channel.close()
        if proc is not None:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                _reap(proc)

    def _kill_locked(self) -> None:
        """SIGKILL the child (it may be stopped, where nothing else reaches it) and forget it."""
        channel, proc = self._channel, self._proc
        self._channel, self._proc, self._arena = None, None, None
        if proc is not None:
            proc.kill()
            _reap(proc)
        if channel is not None:
            channel.close()


def _reap(proc: subprocess.Popen) -> None:
    # A process in uninterruptible I/O dies only when that I/O returns: do not wait for it.
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        logger.warning("the writer process (pid %d) was killed but has not exited yet (stuck in I/O)", proc.pid)


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
    chunking: Chunking,
    threads: int,
    compress: bool | str = False,
) -> list[WrittenFile]:
    """Write like :func:`tessera.engine.saving.write.write_files`, from this process's writer process.

    Backends other than :class:`~tessera.storage.local.FileStorage` are written by threads of
    this process, as :func:`~tessera.engine.saving.write.write_files` does.

    Raises:
        StorageError: a failed write (the child removes what it wrote, as the thread writer does),
            or the writer process died.
    """
    if type(storage) is not FileStorage or not files:
        return write_files(storage, files, chunking=chunking, threads=threads, compress=compress)
    return _writer().write(storage, files, chunking=chunking, threads=threads, compress=compress)


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
    _serve(Channel(socket.socket(fileno=fd)), parent_pid)


def _watch_parent(parent_pid: int) -> None:
    # The pipe's EOF stops the child when the parent exits; this covers a parent that dies
    # while something else still holds the pipe open (a forked grandchild, say).
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(0)


_PROGRESS_EVERY_S = 0.5


def _serve(channel: Channel, parent_pid: int) -> None:
    """The writer process: map arenas, write files, report; until the parent goes away."""
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    arena: torch.Tensor | None = None
    lock = threading.Lock()  # writing threads report progress on the channel the reply uses
    last = [time.monotonic()]
    every_s = [_PROGRESS_EVERY_S]
    channel.send(("ready", None))

    def progress(_: int) -> None:
        now = time.monotonic()
        if now - last[0] >= every_s[0]:
            with lock:
                last[0] = now
                channel.send(("progress", None))

    while True:
        try:
            request = channel.recv()
        except (EOFError, OSError):
            return
        kind = request[0]
        if kind == "stop":
            return
        try:
            if kind == "map":
                fd = channel.recv_fd()
                try:
                    arena = torch.frombuffer(mmap.mmap(fd, request[1]), dtype=torch.uint8)
                finally:
                    os.close(fd)
                reply: Any = None
            elif kind == "write":
                _, url, durable, jobs, chunking, threads, every_s[0], compress = request
                if arena is None:
                    raise CheckpointError("internal error: the writer process has no shared-memory arena")
                store = FileStorage(url, durable=durable)
                files = [(p, lay, [arena[o : o + n] for o, n in spans]) for p, lay, spans in jobs]
                last[0] = time.monotonic()
                reply = write_files(
                    store, files, chunking=chunking, threads=threads, progress=progress, compress=compress
                )
            else:
                raise CheckpointError(f"internal error: unknown writer request {kind!r}")
            with lock:
                channel.send(("ok", reply))
        except BaseException as e:  # sent back: the parent raises it in the save
            with lock:
                channel.send(("error", _picklable(e)))


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
    return write_files_in_process(
        storage, files, chunking=request.chunking, threads=request.threads, compress=request.compress
    )
