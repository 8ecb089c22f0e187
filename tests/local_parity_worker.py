"""Rank functions for tests/test_local_parity.py (module-level, so spawned ranks can import them).

The tests run with ``LOCAL_WORLD_SIZE=1``: each rank is a node with its own ``local_dir``
(``{node}``). A rank given ``nodes`` takes the node index ``nodes[rank]`` (``GROUP_RANK``), so
that a smaller job can be made of the surviving nodes alone.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
import warnings
from collections.abc import Sequence
from typing import Any

from tessera.manager import CheckpointManager
from tests.crash_worker import A_NUMEL, check_state, empty_state, make_state


def _manager(root: str, local_dir: str, parity: tuple[int, int], **kwargs: Any) -> CheckpointManager:
    kwargs.setdefault("durable_every", 1000)
    return CheckpointManager(root, keep_last=3, local_dir=local_dir, local_parity=parity, **kwargs)


def make_rank_state(k: int, rank: int, world: int) -> dict[str, Any]:
    """``make_state(k)`` as ``rank`` of ``world`` holds it: 'a' in contiguous pieces of any world size."""
    import tessera

    state = make_state(k)
    lo, hi = A_NUMEL * rank // world, A_NUMEL * (rank + 1) // world
    state["model"]["a"] = tessera.ShardedTensor(state["model"]["a"][lo:hi].clone(), (A_NUMEL,), (lo,))
    return state


def _chunk(nbytes: int | None) -> None:
    """Move and code parity in chunks of ``nbytes`` (tiny states then take several rounds)."""
    if nbytes is not None:
        from tessera.manager.local_tier import parity, stripes

        stripes.CHUNK = parity.CHUNK = nbytes


def _as_node(rank: int, nodes: Sequence[int] | None) -> None:
    if nodes is not None:
        os.environ["GROUP_RANK"] = str(nodes[rank])


def save_steps(
    rank: int,
    world: int,
    root: str,
    local_dir: str,
    parity: tuple[int, int],
    steps: Sequence[int],
    durable_every: int = 1000,
    async_save: bool = False,
    max_staging_bytes: int | None = None,
    chunk: int | None = None,
    compress: bool = False,
) -> dict[str, Any]:
    """Save ``make_rank_state(k)`` for each step (each rank holds a piece of 'a'), then close."""
    _chunk(chunk)
    mgr = _manager(
        root,
        local_dir,
        parity,
        durable_every=durable_every,
        async_save=async_save,
        max_staging_bytes=max_staging_bytes,
        compress=compress,
    )
    for k in steps:
        mgr.save(k, make_rank_state(k, rank, world))
    mgr.wait()
    mgr.close()
    return {}


def load_and_check(
    rank: int, world: int, root: str, local_dir: str, parity: tuple[int, int], nodes: Sequence[int] | None = None
) -> dict[str, Any]:
    """Load into a full (unsharded) state, another layout than the save's; check it bit for bit."""
    _as_node(rank, nodes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mgr = _manager(root, local_dir, parity)
        state = empty_state()
        got = mgr.load(state)
        k = check_state(state)
        mgr.close()
    return {
        "step": got.step,
        "k": k,
        "source": got.source,
        "peer_bytes": got.peer_bytes,
        "warnings": [str(w.message) for w in caught],
    }


def sweep_losses(
    rank: int,
    world: int,
    root: str,
    local_dir: str,
    parity: tuple[int, int],
    pristine: str,
    cases: list[list[int]],
    chunk: int | None = None,
) -> list[dict[str, Any]]:
    """For each case: rank 0 restores every node directory from ``pristine`` but those of the
    case's lost nodes (they come back empty), then all ranks recover with a new manager and
    check the state bit for bit. The durable root holds no step (durable_every=1000)."""
    import torch.distributed as tdist

    _chunk(chunk)
    out = []
    for lost in cases:
        if rank == 0:
            for node in range(world):
                d = local_dir.format(node=node)
                shutil.rmtree(d, ignore_errors=True)
                if node not in lost:
                    shutil.copytree(pristine.format(node=node), d)
        tdist.barrier()
        mgr = _manager(root, local_dir, parity)
        state = empty_state()
        got = mgr.load(state)
        out.append({"lost": lost, "step": got.step, "k": check_state(state), "peer_bytes": got.peer_bytes})
        mgr.close()
        tdist.barrier()
    return out


def save_and_kill_encoding(
    rank: int, world: int, root: str, local_dir: str, parity: tuple[int, int], victim: int
) -> dict[str, Any]:
    """Save steps 1 and 2, then step 3, during whose parity encoding ``victim`` SIGKILLs itself
    (after the first round's data reached the encoders). The others report their error."""
    from tessera.errors import CheckpointError
    from tessera.manager.local_tier import parity as parity_module

    mgr = _manager(root, local_dir, parity)
    for k in (1, 2):
        mgr.save(k, make_rank_state(k, rank, world))
    if rank == victim:
        original = parity_module._exchange

        def dying(world_: Any, moves: Any, send: Any, recv: Any, what: str) -> None:
            original(world_, moves, send, recv, what)
            if "step-00000003" in what and "(data, round 0)" in what:
                os.kill(os.getpid(), signal.SIGKILL)

        parity_module._exchange = dying  # type: ignore[assignment]
    try:
        mgr.save(3, make_rank_state(3, rank, world))
    except CheckpointError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        time.sleep(0.1)
    return {"error": None}


def rollback_then_save(
    rank: int, world: int, root: str, local_dir: str, parity: tuple[int, int], keep: str
) -> dict[str, Any]:
    """Save 100, 200, 300 (durable every 100), roll back with ``load(step=100)``, save 110 and 120;
    then put back this node's step 300 as it was before the rollback (a node that missed the
    fork: its parity and files of the abandoned timeline)."""
    mgr = _manager(root, local_dir, parity, durable_every=100, local_keep_last=3)
    for k in (100, 200, 300):
        mgr.save(k, make_rank_state(k, rank, world))
    node_dir = local_dir.format(node=rank)
    shutil.copytree(os.path.join(node_dir, "step-00000300"), keep.format(node=rank))
    state = empty_state()
    got = mgr.load(state, step=100)
    for k in (110, 120):
        mgr.save(k, make_rank_state(k, rank, world))
    steps = mgr.steps()
    mgr.close()
    shutil.rmtree(os.path.join(node_dir, "step-00000300"), ignore_errors=True)
    shutil.copytree(keep.format(node=rank), os.path.join(node_dir, "step-00000300"))
    return {"rolled_back": (got.step, check_state(state)), "steps": steps}


def recover_and_kill(rank: int, world: int, root: str, local_dir: str, parity: tuple[int, int], victim: int) -> dict:
    """A recovery in which ``victim`` SIGKILLs itself as the rebuild from parity starts sending
    (the receiving node has created its files); the others report their error."""
    from tessera.errors import CheckpointError
    from tessera.manager.local_tier import parity as parity_module

    if rank == victim:
        original = parity_module._exchange

        def dying(world_: Any, moves: Any, send: Any, recv: Any, what: str) -> None:
            if "rebuilding from parity (round 0)" in what:
                os.kill(os.getpid(), signal.SIGKILL)
            original(world_, moves, send, recv, what)

        parity_module._exchange = dying  # type: ignore[assignment]
    try:
        mgr = _manager(root, local_dir, parity)
        mgr.load(empty_state())
    except CheckpointError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None}
