"""Run a function on N real processes joined by a gloo process group.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, initialises
``torch.distributed`` (gloo, a FileStore rendezvous in a temporary directory) in each, calls
``fn(rank, world_size, *args)`` and returns the per-rank return values. A failure on any
rank fails the test with that rank's traceback; a hang is killed after ``timeout`` seconds.
``fn`` must be a module-level function so that the spawned processes can import it.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, store_path: str, result_dir: str, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    out_path = os.path.join(result_dir, f"{rank}.pkl")
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
        try:
            result = ("ok", fn(rank, world_size, *args))
        finally:
            dist.destroy_process_group()
    except BaseException:
        result = ("error", traceback.format_exc())
    with open(out_path, "wb") as f:
        pickle.dump(result, f)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; their results."""
    with tempfile.TemporaryDirectory(prefix="tessera-dist-") as tmp:
        store = os.path.join(tmp, "store")
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, store, tmp, fn, args), daemon=False)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results = []
        errors = []
        for r in range(world_size):
            path = os.path.join(tmp, f"{r}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {r}: {'hung' if r in hung else f'died (exit code {procs[r].exitcode})'}")
                results.append(None)
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(f"rank {r}:\n{value}")
            results.append(value)
        if errors:
            raise AssertionError("distributed test failed:\n" + "\n".join(errors))
        return results
