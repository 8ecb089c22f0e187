"""Rank functions for tests/test_local_tier.py (module-level, so spawned ranks can import them).

Every rank sets nothing itself: the tests pass ``LOCAL_WORLD_SIZE=2`` in the environment, so
ranks 0-1 are node 0 and ranks 2-3 node 1 (``RANK // LOCAL_WORLD_SIZE``), as under torchrun.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from tessera.manager import CheckpointManager
from tests.crash_worker import check_state, empty_state, make_rank_state


def _manager(root: str, local_dir: str, **kwargs: Any) -> CheckpointManager:
    kwargs.setdefault("local_replicas", 1)
    return CheckpointManager(root, keep_last=3, local_dir=local_dir, durable_every=3, **kwargs)


def save_then_die(
    rank: int, world: int, root: str, local_dir: str, last: int, async_save: bool, replicas: int = 1
) -> None:
    """Save steps 1..last (each rank holding a quarter of 'a'), wait for the commits, SIGKILL self."""
    mgr = _manager(root, local_dir, async_save=async_save, local_replicas=replicas)
    for k in range(1, last + 1):
        mgr.save(k, make_rank_state(k, rank, world))
    mgr.wait()
    os.kill(os.getpid(), signal.SIGKILL)


def save_then_die_mid_save(rank: int, world: int, root: str, local_dir: str, last: int) -> None:
    """Save steps 1..last (async), then start step last+1: rank 3 is SIGKILLed right after the
    save started (before the step can commit anywhere); the others die at the test's deadline."""
    mgr = _manager(root, local_dir, async_save=True)
    for k in range(1, last + 1):
        mgr.save(k, make_rank_state(k, rank, world))
    mgr.wait()
    pending = mgr.save(last + 1, make_rank_state(last + 1, rank, world))
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    pending.wait_staged()  # type: ignore[union-attr]
    time.sleep(600)  # the others write their files, then wait for rank 3 until killed


def load_and_check(rank: int, world: int, root: str, local_dir: str) -> dict[str, Any]:
    """Load into a full (unsharded) state: the layout differs from the save's 4 shards."""
    mgr = _manager(root, local_dir)
    state = empty_state()
    got = mgr.load(state)
    k = check_state(state)
    mgr.close()
    return {"step": got.step, "k": k, "source": got.source, "peer_bytes": got.peer_bytes}


def _fsdp2_model(seed: int):  # type: ignore[no-untyped-def]
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 6))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full_params(model) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    return {name: p.full_tensor().clone() for name, p in model.named_parameters()}


def _train_one_step(model, seed: int):  # type: ignore[no-untyped-def]
    """One AdamW step on fixed data: the optimizer then has state (exp_avg, exp_avg_sq, step)."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    torch.manual_seed(seed + 1)
    model(torch.randn(4, 8)).square().sum().backward()
    opt.step()
    return opt


def _full_optim(model, opt) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    return {
        f"{name}.{k}": (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
        for name, p in model.named_parameters()
        for k, v in opt.state[p].items()
    }


def fsdp2_save_then_die(rank: int, world: int, root: str, local_dir: str, last: int) -> None:
    """FSDP2 over 4 ranks (2 nodes x 2): save model + AdamW of seed k as step k, then SIGKILL."""
    import tessera

    mgr = _manager(root, local_dir)
    for k in range(1, last + 1):
        model = _fsdp2_model(k)
        opt = _train_one_step(model, k)
        mgr.save(k, {"model": tessera.ModelState(model), "optim": tessera.OptimizerState(model, opt), "k": k})
    mgr.wait()
    os.kill(os.getpid(), signal.SIGKILL)


def fsdp2_load_and_check(rank: int, world: int, root: str, local_dir: str, want_step: int) -> dict[str, Any]:
    """FSDP2 over this world (another size): load model and optimizer, then compare every full
    parameter and optimizer state bit for bit with those of seed ``want_step``."""
    import torch

    import tessera

    model = _fsdp2_model(1000)
    for p in model.parameters():
        torch.nn.init.zeros_(p.to_local())
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = {"model": tessera.ModelState(model), "optim": tessera.OptimizerState(model, opt), "k": -1}
    got = _manager(root, local_dir).load(state)
    ref = _fsdp2_model(want_step)
    ref_opt = _train_one_step(ref, want_step)
    want, have = _full_params(ref), _full_params(model)
    want_opt, have_opt = _full_optim(ref, ref_opt), _full_optim(model, opt)
    exact = all(torch.equal(have[n], want[n]) for n in want)
    exact_opt = sorted(want_opt) == sorted(have_opt) and all(torch.equal(have_opt[n], want_opt[n]) for n in want_opt)
    return {"step": got.step, "k": state["k"], "source": got.source, "exact": exact, "exact_optim": exact_opt}


def _uneven_state(rank: int, k: int) -> dict[str, Any]:
    """Rank 0 holds 1024 rows of 'w' (1 MiB), rank 1 two rows: rank 1's own files stay small."""
    import torch

    import tessera

    start, rows = (0, 1024) if rank == 0 else (1024, 2)
    local = torch.arange(start * 256, (start + rows) * 256, dtype=torch.float32).reshape(rows, 256) + k
    return {"w": tessera.ShardedTensor(local, (1026, 256), (start, 0)), "step": k}


def replica_space_runs_out(rank: int, world: int, root: str, local_dir: str) -> dict[str, Any]:
    """2 nodes x 1 rank. Step 1 saves; then rank 1's filesystem refuses files over 256 KiB (a
    kernel-enforced RLIMIT_FSIZE, as a full /dev/shm would) and step 2's replica of rank 0's
    1 MiB file cannot be written there: the save must fail on both ranks, leave no partial
    file, and step 1 stay the one that recovers."""
    import resource

    import torch

    from tessera.errors import CheckpointError

    mgr = CheckpointManager(root, local_dir=local_dir, local_replicas=1)
    mgr.save(1, _uneven_state(rank, 1))
    if rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from the call instead of the signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, resource.RLIM_INFINITY))
    error = None
    try:
        mgr.save(2, _uneven_state(rank, 2))
    except CheckpointError as e:
        error = f"{type(e).__name__}: {e}"
    node = local_dir.replace("{node}", str(rank))
    leftovers = sorted(n for _, _, names in os.walk(node) for n in names if ".recv-" in n)
    target = _uneven_state(rank, 0)
    target["w"].local.zero_()
    got = mgr.load(target)
    exact = torch.equal(target["w"].local, _uneven_state(rank, 1)["w"].local)
    mgr.close()
    return {"error": error, "leftovers": leftovers, "step": got.step, "source": got.source, "exact": exact}


def durable_copy_dies_after_publish(rank: int, world: int, root: str, local_dir: str) -> dict[str, Any]:
    """2 nodes x 1 rank, every step durable. Rank 0 is SIGKILLed right after it published step
    2's durable manifest; rank 1 sees only a failed exchange and reports its error."""
    from tessera.errors import DistributedError
    from tessera.format.manifest import MANIFEST_NAME
    from tessera.storage import FileStorage
    from tests.crash_worker import CrashStorage

    def factory(url: str) -> Any:
        if rank == 0 and url.rstrip("/").endswith("step-00000002"):
            return CrashStorage(url, at="after_atomic", name=MANIFEST_NAME)
        return FileStorage(url)

    mgr = CheckpointManager(root, local_dir=local_dir, local_replicas=1, durable_every=1, storage_factory=factory)
    mgr.save(1, make_rank_state(1, rank, world))
    try:
        mgr.save(2, make_rank_state(2, rank, world))
    except DistributedError as e:  # a peer died or timed out
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None}


def transfer_files(rank: int, world: int, root: str) -> dict[str, Any]:
    """3 ranks: files of odd sizes (one empty), each rank both sends and receives; then a transfer
    whose receiver cannot create its file fails on every rank."""
    import hashlib

    from tessera.engine import dist
    from tessera.errors import StorageError
    from tessera.manager.local_tier.transfer import Transfer, run_transfers

    mine = os.path.join(root, str(rank))
    os.makedirs(mine, exist_ok=True)
    sizes = {"a": 10_007, "b": 999, "c": 0, "d": 3_000}
    for name, n in sizes.items():
        with open(os.path.join(mine, f"{name}-from-{rank}"), "wb") as f:
            f.write(bytes((rank * 31 + i * 7) % 251 for i in range(n)))
    transfers = [
        Transfer(0, 1, "a-from-0", sizes["a"]),
        Transfer(0, 2, "b-from-0", sizes["b"]),
        Transfer(2, 1, "d-from-2", sizes["d"]),
        Transfer(1, 2, "c-from-1", 0),
        Transfer(1, 0, "a-from-1", sizes["a"]),
        Transfer(2, 0, "d-from-2", sizes["d"]),
    ]
    world_ = dist.world_for(None)
    received = run_transfers(world_, transfers, mine, "test transfer")
    digests = {}
    for name in sorted(os.listdir(mine)):
        if "-from-" in name and not name.endswith(f"-from-{rank}"):
            with open(os.path.join(mine, name), "rb") as f:
                digests[name] = hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(mine, "blocked"), "wb"):  # a file where rank 1 needs a directory
        pass
    error = None
    try:  # rank 1 cannot create blocked/y: every rank must fail, and nobody hang
        run_transfers(world_, [Transfer(0, 1, "blocked/y", 2_500)], mine, "blocked transfer")
    except StorageError as e:
        error = str(e)
    return {"received": received, "digests": digests, "error": error}


# ----------------------------------------------------------------------------------------
# Identity, rollback, corruption (2 nodes x 1 rank: LOCAL_WORLD_SIZE=1)


def _warnings_of(caught: list) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def save_steps(
    rank: int, world: int, root: str, local_dir: str, steps: list[int], durable_every: int
) -> dict[str, Any]:
    """Save ``steps`` (errors recorded, not raised); what the manager said before and after."""
    import warnings

    from tessera.errors import CheckpointError

    mgr = CheckpointManager(root, keep_last=3, local_dir=local_dir, local_replicas=1, durable_every=durable_every)
    out: dict[str, Any] = {"latest_before": mgr.latest_step(), "errors": {}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in steps:
            try:
                mgr.save(k, make_rank_state(k, rank, world))
            except CheckpointError as e:
                out["errors"][k] = f"{type(e).__name__}: {e}"
    out["warnings"] = _warnings_of(caught)
    out["steps_after"] = mgr.steps()
    mgr.close()
    return out


def resume_idiom(rank: int, world: int, root: str, local_dir: str, durable_every: int) -> dict[str, Any]:
    """The README's resume idiom: load only if ``latest_step()`` names a step."""
    import warnings

    mgr = CheckpointManager(root, keep_last=3, local_dir=local_dir, local_replicas=1, durable_every=durable_every)
    state = empty_state()
    out: dict[str, Any] = {"latest": mgr.latest_step(), "steps": mgr.steps(), "step": None, "k": None, "source": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if out["latest"] is not None:
            got = mgr.load(state)
            out.update(step=got.step, k=check_state(state), source=got.source)
    out["warnings"] = _warnings_of(caught)
    mgr.close()
    return out


def load_or_error(rank: int, world: int, root: str, local_dir: str, durable_every: int) -> dict[str, Any]:
    """``manager.load`` on every rank: what loaded, or the error, and the warnings."""
    import warnings

    from tessera.errors import CheckpointError

    mgr = CheckpointManager(root, keep_last=3, local_dir=local_dir, local_replicas=1, durable_every=durable_every)
    state = empty_state()
    out: dict[str, Any] = {"step": None, "error": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            got = mgr.load(state)
            out.update(step=got.step, k=check_state(state), source=got.source)
        except CheckpointError as e:
            out["error"] = f"{type(e).__name__}: {e}"
    out["warnings"] = _warnings_of(caught)
    mgr.close()
    return out


def rollback_then_save(rank: int, world: int, root: str, local_dir: str) -> dict[str, Any]:
    """Save 100, 200, 300 (durable too), roll back with ``load(step=100)``, then save 110 and 120
    (local only)."""
    from tessera.errors import CheckpointError

    mgr = CheckpointManager(
        root, keep_last=3, local_dir=local_dir, local_replicas=1, durable_every=100, local_keep_last=3
    )
    for k in (100, 200, 300):
        mgr.save(k, make_rank_state(k, rank, world))
    state = empty_state()
    got = mgr.load(state, step=100)
    out: dict[str, Any] = {"rolled_back": (got.step, check_state(state)), "errors": {}}
    for k in (110, 120):
        try:
            mgr.save(k, make_rank_state(k, rank, world))
        except CheckpointError as e:
            out["errors"][k] = f"{type(e).__name__}: {e}"
    out["steps"] = mgr.steps()
    mgr.close()
    return out


# ----------------------------------------------------------------------------------------
# SIGKILL during replication, the durable copy and recovery (3 nodes x 1 rank)


def _rank_state(k: int, rank: int, world: int) -> dict[str, Any]:
    """``make_state(k)`` split over any number of ranks (the last takes the remainder)."""
    import tessera
    from tests.crash_worker import A_NUMEL, make_state

    state = make_state(k)
    a = state["model"]["a"]
    n = A_NUMEL // world
    stop = A_NUMEL if rank == world - 1 else (rank + 1) * n
    state["model"]["a"] = tessera.ShardedTensor(a[rank * n : stop].clone(), (A_NUMEL,), (rank * n,))
    return state


def save_and_kill_at(rank: int, world: int, root: str, local_dir: str, victim: int, where: str) -> dict[str, Any]:
    """Save steps 1 and 2 (every step durable), then step 3, during which ``victim`` SIGKILLs
    itself: ``"replicating"`` (entering step 3's replication), ``"replicated"`` (its replicas
    written, before its node's commit marker) or ``"durable"`` (halfway through uploading its
    file of step 3 to the durable root). The others report the error they get."""
    from tessera.errors import CheckpointError
    from tessera.manager.local_tier import tier as tier_module
    from tessera.storage import FileStorage
    from tests.crash_worker import CrashStorage

    def factory(url: str) -> Any:
        if where == "durable" and rank == victim and url.rstrip("/").endswith("step-00000003"):
            return CrashStorage(url, at="write_file", after_bytes=64)
        return FileStorage(url)

    mgr = CheckpointManager(root, local_dir=local_dir, local_replicas=1, durable_every=1, storage_factory=factory)
    for k in (1, 2):
        mgr.save(k, _rank_state(k, rank, world))
    if rank == victim and where.startswith("replicat"):
        original = tier_module.run_transfers

        def dying(world_: Any, transfers: Any, root_: str, what: str) -> int:
            if "step 3: replicating" in what and where == "replicating":
                os.kill(os.getpid(), signal.SIGKILL)
            out = original(world_, transfers, root_, what)
            if "step 3: replicating" in what:
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        tier_module.run_transfers = dying  # type: ignore[assignment]
    try:
        mgr.save(3, _rank_state(3, rank, world))
    except CheckpointError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None}


def recover_and_kill(rank: int, world: int, root: str, local_dir: str, victim: int) -> dict[str, Any]:
    """Recovery in which ``victim`` SIGKILLs itself as the fetch from peers starts."""
    from tessera.errors import CheckpointError
    from tessera.manager.local_tier import recovery

    if rank == victim:
        original = recovery.run_transfers

        def dying(world_: Any, transfers: Any, root_: str, what: str) -> int:
            if transfers and "fetching" in what:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(world_, transfers, root_, what)

        recovery.run_transfers = dying  # type: ignore[assignment]
    try:
        return {"error": None, **load_and_check(rank, world, root, local_dir)}
    except CheckpointError as e:
        return {"error": f"{type(e).__name__}: {e}"}


def load_save_on(rank: int, world: int, root: str, local_dir: str, step: int) -> dict[str, Any]:
    """Load (every step durable), check, then save ``step`` and report both."""
    mgr = CheckpointManager(root, local_dir=local_dir, local_replicas=1, durable_every=1)
    state = empty_state()
    got = mgr.load(state)
    out = {"step": got.step, "k": check_state(state), "source": got.source}
    mgr.save(step, _rank_state(step, rank, world))
    mgr.close()
    return out
