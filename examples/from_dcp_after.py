"""The same training loop checkpointed with tessera: the "after" of docs/from-dcp.md.

    python examples/from_dcp_after.py --ckpt DIR --steps 10            # one process
    python examples/from_dcp_after.py --ckpt DIR --steps 10 --nproc 2  # FSDP2 on 2 gloo ranks
    torchrun --nproc-per-node 2 examples/from_dcp_after.py --ckpt DIR

Every ``--save-every`` steps it saves a step under ``DIR`` with a ``tessera.CheckpointManager``
(asynchronously); started again with the same ``--ckpt`` it resumes from the newest committed
step there, under any world size: a step whose save was killed is skipped, with a warning.
The state keeps the DCP tutorial's layout (``app.model.*``, ``app.optim.*``, ``sched.*``,
``step``), so the steps ``examples/from_dcp_before.py`` wrote with DCP resume here once the
folder is converted: ``tessera convert OLD DIR`` (``OLD/step-6`` becomes
``DIR/step-00000006``). ``diff`` the two files to see the migration.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard

import tessera

DIM, BATCH = 16, 12  # BATCH divides by 1, 2, 3 and 4: the same global batch at any world size
WARMUP, TOTAL = 3, 20  # the scheduler's warmup steps and cosine length


def make_scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warmup, then cosine decay."""
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=WARMUP)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=TOTAL - WARMUP)
    return torch.optim.lr_scheduler.SequentialLR(opt, [warmup, cosine], milestones=[WARMUP])


def make_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
    if dist.is_initialized() and dist.get_world_size() > 1:
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    return model


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the global batch of ``step`` (the same data at any world size)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, DIM, generator=g)
    y = torch.sin(x)
    per = BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def main(args: argparse.Namespace) -> None:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = make_scheduler(opt)
    # tessera coordinates over its own gloo group: no checkpoint process group to create.
    # ModelState / OptimizerState key everything by parameter name, like get_state_dict, and
    # hold opt.step() and the forward pass while a background copy still reads the tensors.
    # Under "app" as the tutorial's AppState put them; the scheduler is a Stateful itself.
    app = {"model": tessera.ModelState(model), "optim": tessera.OptimizerState(model, opt)}
    state = {"app": app, "sched": sched, "step": 0}

    with tessera.CheckpointManager(args.ckpt, async_save=True) as manager:
        # --- checkpointing: resume ------------------------------------------------------------
        if manager.latest_step() is not None:
            manager.load(state)  # the newest committed step; in place, strict, any world size
        start = state["step"]
        # --------------------------------------------------------------------------------------

        for step in range(start + 1, args.steps + 1):
            x, y = batch(step, rank, world)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            mean = loss.detach().clone()
            if world > 1:
                dist.all_reduce(mean)  # the loss of the global batch, comparable at any world size
                mean /= world
            if rank == 0:
                print(f"step {step} loss {mean.item():.7f}", flush=True)

            # --- checkpointing: save ----------------------------------------------------------
            if step % args.save_every == 0:
                state["step"] = step
                manager.save(step, state)  # waits for the previous save itself, then returns
    # leaving the block waits for the last save: committed
    # ------------------------------------------------------------------------------------------


def run(rank: int, world: int, init: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        main(args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True, help="checkpoint root: a CheckpointManager's steps go here")
    p.add_argument("--steps", type=int, default=10, help="train until this step")
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--nproc", type=int, default=1, help="processes to spawn when not under torchrun")
    args = p.parse_args()
    if "RANK" in os.environ:  # torchrun
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", args)
    elif args.nproc > 1:
        with tempfile.TemporaryDirectory() as tmp:
            # The ranks fork from one server that imported these once (spawn: once per rank).
            mp.get_context("forkserver").set_forkserver_preload(
                ["tessera.adapters", "tessera.manager", "torch.distributed.fsdp", "torch._dynamo"]
            )
            mp.start_processes(
                run, args=(args.nproc, f"file://{tmp}/store", args), nprocs=args.nproc, start_method="forkserver"
            )
    else:
        torch.set_num_threads(1)
        main(args)
