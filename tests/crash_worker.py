"""Helpers for tests whose processes die: crash-injecting storage, save loops, a tolerant runner.

Processes come from a ``forkserver`` that has already imported torch and tessera, so a
trial starts in milliseconds instead of the seconds a fresh interpreter needs; that is what
lets the crash tests run dozens of trials. Nothing here replaces tessera code: faults are
injected by a real :class:`~tessera.storage.Storage` backend that wraps :class:`FileStorage`.

* :class:`CrashStorage` SIGKILLs its own process at a chosen storage call (a phase of a save).
* :func:`save_loop` saves a deterministic state for k = 1, 2, ... and logs ``begin k`` /
  ``done k`` to a progress file, through ``tessera.save`` or a ``CheckpointManager``.
* :class:`GateStorage` (a :class:`FileStorage`) and :func:`gated_s3` stop a save right before
  it publishes its manifest until the test opens a gate: two writers overlap on demand.

The process harness (``start``, ``start_ranks``, ``run_ranks``, ``RankOutcome``) lives in
:mod:`tests.dist_utils` and is re-exported here for the crash tests.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

import tessera
from tessera.errors import CommitCheckError, ConcurrentSaveError
from tessera.manager import CheckpointManager
from tessera.storage import FileStorage, FsspecStorage
from tests.dist_utils import RankGroup, RankOutcome, run_ranks, start, start_ranks  # noqa: F401 - the harness, re-exported

A_NUMEL = 512 * 1024  # 2 MiB of float32
B_NUMEL = 96 * 1024  # 768 KiB of int64


# --------------------------------------------------------------------------------------
# Deterministic states: every k gives different bits everywhere, so a mix is detectable.


def make_state(k: int) -> dict[str, Any]:
    """The state saved at iteration ``k`` (a few MB)."""
    a = torch.arange(A_NUMEL, dtype=torch.float32) + float(k) * 0.5
    b = torch.arange(B_NUMEL, dtype=torch.int64) * 7 + k
    return {"model": {"a": a, "b": b}, "k": k, "meta": {"tag": f"iteration-{k}"}}


def make_rank_state(k: int, rank: int, world: int) -> dict[str, Any]:
    """``make_state(k)`` as ``rank`` of ``world`` holds it: 'a' split in contiguous pieces."""
    state = make_state(k)
    a = state["model"]["a"]
    n = A_NUMEL // world
    state["model"]["a"] = tessera.ShardedTensor(a[rank * n : (rank + 1) * n].clone(), (A_NUMEL,), (rank * n,))
    return state


def empty_state() -> dict[str, Any]:
    return {
        "model": {"a": torch.zeros(A_NUMEL), "b": torch.zeros(B_NUMEL, dtype=torch.int64)},
        "k": -1,
        "meta": {"tag": ""},
    }


def check_state(state: dict[str, Any]) -> int:
    """Assert that ``state`` is exactly ``make_state(k)`` for its own ``k``; return ``k``."""
    k = state["k"]
    want = make_state(k)
    assert torch.equal(state["model"]["a"], want["model"]["a"]), f"tensor 'a' is not iteration {k}'s"
    assert torch.equal(state["model"]["b"], want["model"]["b"]), f"tensor 'b' is not iteration {k}'s"
    assert state["meta"] == want["meta"], f"meta {state['meta']} is not iteration {k}'s"
    return k


# --------------------------------------------------------------------------------------
# Crash injection through a real storage backend


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # not reached


class CrashStorage:
    """A :class:`FileStorage` that SIGKILLs this process at one chosen call.

    Args:
        url: the checkpoint directory.
        at: ``"write_file"`` (after ``after_bytes`` bytes of the first data file),
            ``"write_atomic"`` (before publishing ``name``), ``"after_atomic"`` (right after
            publishing ``name``), or ``"delete"`` (before deleting a path containing ``match``).
        name: the file ``write_atomic`` triggers on (default any).
        after_bytes: bytes of the data file written before dying.
        match: a substring of the path whose deletion dies (default any non-empty delete).
    """

    def __init__(
        self, url: str, at: str, *, name: str | None = None, after_bytes: int = 1 << 20, match: str | None = None
    ) -> None:
        self.inner = FileStorage(url)
        self.url = url
        self.at = at
        self.name = name
        self.after_bytes = after_bytes
        self.match = match

    def write_file(self, path: str, chunks: Iterable[Any]) -> None:
        if self.at != "write_file":
            return self.inner.write_file(path, chunks)

        def limited() -> Iterator[Any]:
            sent = 0
            for c in chunks:
                view = memoryview(c).cast("B")
                if sent + len(view) >= self.after_bytes:
                    yield view[: self.after_bytes - sent]
                    _die()
                sent += len(view)
                yield view

        # Write through a descriptor we control so the partial bytes really reach the file.
        full = self.inner._abs(path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb", buffering=0) as f:
            f.writelines(limited())
        return None

    def write_atomic(self, path: str, data: bytes) -> None:
        hit = self.name is None or path == self.name
        if self.at == "write_atomic" and hit:
            _die()
        self.inner.write_atomic(path, data)
        if self.at == "after_atomic" and hit:
            _die()

    def location(self) -> str:
        return self.inner.location()

    def read_file(self, path: str) -> bytes:
        return self.inner.read_file(path)

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        self.inner.read_into(path, offset, out)

    def size(self, path: str) -> int:
        return self.inner.size(path)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def list(self, prefix: str = "") -> list[str]:
        return self.inner.list(prefix)

    def delete(self, paths: Iterable[str]) -> None:
        paths = list(paths)
        if self.at == "delete" and paths and (self.match is None or any(self.match in p for p in paths)):
            _die()
        self.inner.delete(paths)


# --------------------------------------------------------------------------------------
# Overlapping writers: a backend that pauses right before publishing its manifest


def _touch(path: str) -> None:
    with open(path, "w"):
        pass


def _pass_gate(entered: str, gate: str, timeout: float = 120.0) -> None:
    _touch(entered)
    deadline = time.monotonic() + timeout
    while not os.path.exists(gate):
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {gate} never opened")
        time.sleep(0.01)


class GateStorage(FileStorage):
    """A real :class:`FileStorage` whose manifest publish waits for the file ``gate`` to exist
    (after creating ``entered``). Everything else is FileStorage's own code."""

    def __init__(self, url: str, *, entered: str, gate: str) -> None:
        super().__init__(url)
        self.entered, self.gate = entered, gate

    def write_atomic(self, path: str, data: bytes) -> None:
        if path == "manifest.json":
            _pass_gate(self.entered, self.gate)
        super().write_atomic(path, data)

    def replace_if(self, path: str, data: bytes, expected: str | None, **kw: Any) -> None:
        if path == "manifest.json":
            _pass_gate(self.entered, self.gate)
        super().replace_if(path, data, expected, **kw)


class GateFsspecStorage(FsspecStorage):
    """:class:`GateStorage` for fsspec URLs (S3 through moto in the tests)."""

    def __init__(self, url: str, storage_options: dict[str, Any], *, entered: str, gate: str) -> None:
        super().__init__(url, storage_options)
        self.entered, self.gate = entered, gate

    def write_atomic(self, path: str, data: bytes) -> None:
        if path == "manifest.json":
            _pass_gate(self.entered, self.gate)
        super().write_atomic(path, data)

    def replace_if(self, path: str, data: bytes, expected: str | None, **kw: Any) -> None:
        if path == "manifest.json":
            _pass_gate(self.entered, self.gate)
        super().replace_if(path, data, expected, **kw)


def gated_save(
    target: str, k: int, entered: str, gate: str, result: str, storage_options: dict[str, Any] | None = None
) -> None:
    """Save ``make_state(k)`` to ``target``, pausing before the manifest publish until ``gate``
    exists; write ``ok`` or ``<ErrorType>: message`` to ``result``."""
    torch.set_num_threads(1)
    if storage_options is None:
        store: Any = GateStorage(target, entered=entered, gate=gate)
    else:
        store = GateFsspecStorage(target, storage_options, entered=entered, gate=gate)
    try:
        tessera.save(target, make_state(k), storage=store)
        out = "ok"
    except BaseException as e:
        out = f"{type(e).__name__}: {e}"
    with open(result + ".tmp", "w") as f:
        f.write(out)
    os.replace(result + ".tmp", result)


# --------------------------------------------------------------------------------------
# Save loops run in a child process until killed


def log_progress(progress: str, line: str) -> None:
    # O_APPEND + one write per line: survives SIGKILL (the page cache is the kernel's).
    fd = os.open(progress, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def read_progress(progress: str) -> tuple[int, int]:
    """``(last begun, last done)`` iteration from a progress file (0 when none)."""
    begun = done = 0
    if os.path.exists(progress):
        with open(progress) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2 and parts[0] == "begin":
                    begun = int(parts[1])
                elif len(parts) == 2 and parts[0] == "done":
                    done = int(parts[1])
    return begun, done


def save_loop(
    target: str,
    progress: str,
    mode: str,
    crash: dict[str, Any] | None = None,
    first: int = 1,
    count: int = 10**6,
    manager_kwargs: dict[str, Any] | None = None,
    rank: int = 0,
    world: int = 1,
) -> None:
    """Save ``make_state(k)`` for k = first, first+1, ... until killed (or ``count`` saves).

    Args:
        target: the checkpoint path (``mode="path"``) or manager root (``"manager"``,
            ``"manager_async"``).
        progress: file receiving ``ready``, ``begin k`` and ``done k`` lines.
        mode: how to save.
        crash: keyword arguments of a :class:`CrashStorage` to save through, or None.
        manager_kwargs: extra CheckpointManager arguments.
        rank, world: with ``world > 1`` (inside :func:`start_ranks`), save this rank's
            part of the state (see :func:`make_rank_state`).

    Modes: ``"path"`` (``tessera.save``), ``"contended"`` (``tessera.save`` while another writer saves to
    the same path: a save fenced off by the other one logs ``lost k`` and the loop goes on),
    ``"manager"`` and ``"manager_async"``.
    """
    torch.set_num_threads(1)
    factory: Callable[[str], Any] | None = None
    if crash is not None:

        def factory(url: str) -> Any:
            return CrashStorage(url, **crash)

    mgr = None
    if mode.startswith("manager"):
        kwargs = {"keep_last": 2, "keep_every": 5, "async_save": mode == "manager_async"}
        kwargs.update(manager_kwargs or {})
        mgr = (
            CheckpointManager(target, storage_factory=factory, **kwargs)
            if factory
            else CheckpointManager(target, **kwargs)
        )
    log_progress(progress, "ready")
    for k in range(first, first + count):
        state = make_state(k) if world == 1 else make_rank_state(k, rank, world)
        log_progress(progress, f"begin {k}")
        if mode == "contended":
            try:
                tessera.save(target, state)
            except tessera.CheckpointError as e:
                if not _fenced(e):
                    raise
                log_progress(progress, f"lost {k}")
                continue
        elif mgr is None:
            tessera.save(target, state, storage=factory(target) if factory else None)
        else:
            out = mgr.save(k, state)
            if isinstance(out, tessera.PendingSave):
                # Training goes on once the copy to host is done (the gate: raw tensors are not
                # gated by hooks, so the loop waits for it); the save must not see the change.
                out.wait_staged()
                a = state["model"]["a"]
                (a if isinstance(a, torch.Tensor) else a.local).add_(1.0)
                out.wait()
        log_progress(progress, f"done {k}")
    if mgr is not None:
        mgr.close()


def _fenced(e: BaseException) -> bool:
    """Whether a save failed because another writer of the path won (on this rank or rank 0)."""
    if isinstance(e, (ConcurrentSaveError, CommitCheckError)):
        return True
    failures = getattr(e, "failures", None) or {}
    names = ("ConcurrentSaveError", "CommitCheckError")
    return bool(failures) and all(str(f).startswith(names) for f in failures.values())


def rank_save_loop(
    rank: int,
    world: int,
    target: str,
    progress_dir: str,
    mode: str,
    first: int = 1,
    crash: dict[str, Any] | None = None,
    crash_rank: int = 0,
) -> None:
    """:func:`save_loop` as one rank of :func:`start_ranks` (progress in ``progress_dir/<rank>``);
    rank ``crash_rank`` saves through a :class:`CrashStorage` made with ``crash``, if given."""
    mine = crash if rank == crash_rank else None
    save_loop(target, os.path.join(progress_dir, str(rank)), mode, mine, first=first, rank=rank, world=world)


def wait_for_line(progress: str, line: str, timeout: float = 60.0) -> None:
    """Block until ``progress`` contains ``line`` (the child is ready)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(progress):
            with open(progress) as f:
                if any(x.strip() == line for x in f):
                    return
        time.sleep(0.01)
    raise TimeoutError(f"{progress} never got {line!r}")


# --------------------------------------------------------------------------------------
# A distributed runner that tolerates dying and hanging ranks
