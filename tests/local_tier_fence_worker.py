"""Rank functions for tests/test_local_tier_fence.py (module-level, so spawned ranks can import them).

Every rank is its own node (the tests pass ``LOCAL_WORLD_SIZE=1``). A step's content says which
timeline saved it: ``k = step + 1000 * timeline``, and ``check_state`` compares a loaded state
with ``make_state(k)`` bit for bit.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from tessera.errors import CheckpointError, CheckpointNotFoundError
from tessera.manager import CheckpointManager
from tessera.manager.local_tier.inventory import MARKER_NAME
from tests.crash_worker import check_state, empty_state
from tests.local_tier_worker import _rank_state


def _manager(root: str, local_dir: str, durable_every: int, **kwargs: Any) -> CheckpointManager:
    return CheckpointManager(
        root, keep_last=3, local_dir=local_dir, local_replicas=1, durable_every=durable_every, **kwargs
    )


def _runtime_warnings(caught: list) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def committed_here(local_dir: str, node: int) -> list[int]:
    """The steps with a commit marker in ``node``'s directory."""
    directory = local_dir.replace("{node}", str(node))
    if not os.path.isdir(directory):
        return []
    names = sorted(n for n in os.listdir(directory) if os.path.exists(os.path.join(directory, n, MARKER_NAME)))
    return [int(n.removeprefix("step-")) for n in names]


def resume_and_save(
    rank: int,
    world: int,
    root: str,
    local_dir: str,
    durable_every: int,
    resume: int | str | None,
    saves: list[tuple[int, int]],
) -> dict[str, Any]:
    """Resume (``None``: no load; ``"newest"``: ``load(state)``, nothing found is fine; a step:
    ``load(state, step=...)``), then save each ``(step, k)``: ``make_state(k)`` as ``step``."""
    mgr = _manager(root, local_dir, durable_every)
    out: dict[str, Any] = {"loaded": None, "errors": {}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if resume is not None:
            state = empty_state()
            try:
                got = mgr.load(state) if resume == "newest" else mgr.load(state, step=int(resume))
                out["loaded"] = (got.step, check_state(state), got.source)
            except CheckpointNotFoundError:
                out["loaded"] = None
        for step, k in saves:
            try:
                mgr.save(step, _rank_state(k, rank, world))
            except CheckpointError as e:
                out["errors"][step] = f"{type(e).__name__}: {e}"
    out["warnings"] = _runtime_warnings(caught)
    mgr.close()
    return out


def restart(rank: int, world: int, root: str, local_dir: str, durable_every: int) -> dict[str, Any]:
    """A restart's resume idiom on every rank: what ``steps()`` says first, then ``load(state)``
    (checked bit for bit), the warnings, and the steps committed on this node afterwards."""
    mgr = _manager(root, local_dir, durable_every)
    out: dict[str, Any] = {"steps": mgr.steps(), "step": None, "k": None, "source": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = empty_state()
        got = mgr.load(state)
        out.update(step=got.step, k=check_state(state), source=got.source)
    out["warnings"] = _runtime_warnings(caught)
    out["committed"] = committed_here(local_dir, rank)
    mgr.close()
    return out


def _wide_state(k: int, rank: int, world: int) -> dict[str, Any]:
    """4 MiB of float32 per rank, different for every ``k``."""
    import torch

    import tessera

    n = 1 << 20
    local = torch.arange(rank * n, (rank + 1) * n, dtype=torch.float32) * 0.25 + k
    return {"w": tessera.ShardedTensor(local, (world * n,), (rank * n,)), "k": k}


def limit_directory(directory: str, nbytes: int) -> None:
    """Make ``directory`` (in this process) a filesystem of ``nbytes``, for where no tmpfs can be
    mounted: writes and allocations that would take its files past ``nbytes`` fail with ENOSPC,
    and ``shutil.disk_usage`` reports what is left."""
    import errno
    import shutil

    real_write, real_allocate, real_usage = os.write, os.posix_fallocate, shutil.disk_usage
    top = os.path.realpath(directory)

    def inside(path: str) -> bool:
        return path == top or path.startswith(top + "/")

    def used() -> int:
        total = 0
        for d, _, names in os.walk(top):
            for name in names:
                try:
                    total += os.lstat(os.path.join(d, name)).st_size
                except OSError:
                    pass  # deleted meanwhile
        return total

    def target(fd: int) -> str:
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return ""

    def full() -> OSError:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def write(fd: int, data: Any) -> int:
        if inside(target(fd)) and used() + memoryview(data).nbytes > nbytes:
            raise full()
        return real_write(fd, data)

    def allocate(fd: int, offset: int, length: int) -> None:
        if inside(target(fd)) and used() + max(0, offset + length - os.fstat(fd).st_size) > nbytes:
            raise full()
        real_allocate(fd, offset, length)

    def disk_usage(path: Any) -> Any:
        real = real_usage(path)
        if not inside(os.path.realpath(path)):
            return real
        taken = used()
        return type(real)(nbytes, taken, nbytes - taken)

    os.write, os.posix_fallocate, shutil.disk_usage = write, allocate, disk_usage  # type: ignore[assignment]


def fill_a_small_directory(
    rank: int, world: int, root: str, local_dir: str, last: int, limit: int | None
) -> dict[str, Any]:
    """Save steps 1..``last`` (``local_keep_last=2``, every 5th durable) into node directories
    with room for about two steps (a tmpfs, or ``limit`` bytes: :func:`limit_directory`); then
    load the newest and compare it with the last save."""
    import torch

    if limit is not None:
        directory = local_dir.replace("{node}", str(rank))
        os.makedirs(directory, exist_ok=True)
        limit_directory(directory, limit)

    mgr = CheckpointManager(root, keep_last=2, local_dir=local_dir, local_replicas=1, durable_every=5)
    errors: dict[int, str] = {}
    for k in range(1, last + 1):
        try:
            mgr.save(k, _wide_state(k, rank, world))
        except CheckpointError as e:
            errors[k] = f"{type(e).__name__}: {e}"
    committed = committed_here(local_dir, rank)
    target = _wide_state(0, rank, world)
    target["w"].local.zero_()
    got = mgr.load(target)
    exact = torch.equal(target["w"].local, _wide_state(last, rank, world)["w"].local) and target["k"] == last
    durable = mgr.steps(local=False)
    mgr.close()
    return {"errors": errors, "committed": committed, "step": got.step, "exact": exact, "durable": durable}
