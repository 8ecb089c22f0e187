"""Process-wide registry of the memory tier: per-directory state and the one persistence thread.

Every tier object on one memory directory shares its :class:`TierState`, and every
persistence job of the process runs on one thread, in submission order; the last job
submitted is kept for backpressure (:func:`wait_last_job`).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class TierState:
    """Persistence state of one memory directory, shared by every tier object on it in a process.

    Shared because ``save`` and ``load`` each open their own backend for a URL: a load must
    still wait for the persistence a save's object started, deferred deletes must wait for
    it, and a commit must wait for the previous one whichever object made it.
    """

    lock: threading.Lock = field(default_factory=threading.Lock)
    pending: concurrent.futures.Future[None] | None = None
    """The last persistence submitted (jobs run one at a time, in order)."""
    pending_commit: bool = False
    """Whether ``pending`` publishes a manifest."""
    deferred_deletes: list[str] = field(default_factory=list)
    """Durable deletes waiting for the next durable commit."""
    deleted: set[str] = field(default_factory=set)
    """Files deleted from memory through a tier object (so a copy may find them gone)."""
    failed_copies: set[str] = field(default_factory=set)
    """Files whose copy failed and that no later copy has replaced: block commits."""
    hooked_save: str | None = None
    """Save id of the last :meth:`MemoryTierStorage.after_commit` (a repeated call is a no-op)."""
    written: set[str] = field(default_factory=set)
    """Files written through a tier object since the last commit in memory."""
    own_files: list[str] = field(default_factory=list)
    """Per-rank mode: files this process persisted for the previous save (dropped from memory next time)."""


_STATES: dict[str, TierState] = {}
_REGISTRY_LOCK = threading.Lock()
_PERSISTER: concurrent.futures.ThreadPoolExecutor | None = None
_LAST_JOB: concurrent.futures.Future[None] | None = None  # the process's last persistence job


def state_for(memory_root: str) -> TierState:
    """The shared state of the memory directory ``memory_root`` (created on first use)."""
    key = os.path.realpath(memory_root)
    with _REGISTRY_LOCK:
        state = _STATES.get(key)
        if state is None:
            state = _STATES[key] = TierState()
        return state


def _persister() -> concurrent.futures.ThreadPoolExecutor:
    """The process's persistence thread: one job at a time, in submission order.

    Its thread is not a daemon: at interpreter exit, queued persistence completes first.
    """
    global _PERSISTER
    with _REGISTRY_LOCK:
        if _PERSISTER is None:
            _PERSISTER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tessera-tier-persist")
        return _PERSISTER


def wait_last_job() -> None:
    """Backpressure: wait for the process's last persistence job (whatever its directory)."""
    with _REGISTRY_LOCK:
        previous = _LAST_JOB
    if previous is not None:
        concurrent.futures.wait([previous])


def submit(state: TierState, fn: Callable[..., None], *args: object, commit: bool) -> concurrent.futures.Future[None]:
    """Queue ``fn(*args)`` on the persistence thread as ``state``'s pending (and the process's last) job.

    Args:
        state: the directory's state; its ``pending`` becomes the job.
        fn: the job.
        *args: its arguments.
        commit: whether the job publishes a manifest (``state.pending_commit``).

    Returns:
        The job's future.
    """
    global _LAST_JOB
    with state.lock:
        future = _persister().submit(fn, *args)
        state.pending = future
        state.pending_commit = commit
    with _REGISTRY_LOCK:
        _LAST_JOB = future
    return future
