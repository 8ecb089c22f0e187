"""A training loop checkpointed with torch.distributed.checkpoint (DCP): the "before" of docs/from-dcp.md.

    python examples/from_dcp_before.py --ckpt DIR --steps 10            # one process
    python examples/from_dcp_before.py --ckpt DIR --steps 10 --nproc 2  # FSDP2 on 2 gloo ranks
    torchrun --nproc-per-node 2 examples/from_dcp_before.py --ckpt DIR

It checkpoints the way the DCP tutorial does: the model and AdamW behind the tutorial's
``AppState`` (``get_state_dict`` / ``set_state_dict``), beside a warmup-cosine LR scheduler's
``state_dict()`` and the step. Every ``--save-every`` steps it saves ``DIR/step-N`` with
``dcp.async_save``; started again with the same ``--ckpt`` it resumes from the newest step
there (same world size: DCP reshards DTensors, but this script keeps it simple).
``examples/from_dcp_after.py`` is the same script on tessera; ``diff`` the two files to see
the migration.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard

DIM, BATCH = 16, 12  # BATCH divides by 1, 2, 3 and 4: the same global batch at any world size
WARMUP, TOTAL = 3, 20  # the scheduler's warmup steps and cosine length


class AppState(Stateful):
    """The DCP tutorial's wrapper: DCP calls ``state_dict()`` when saving, ``load_state_dict()`` when loading."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict) -> None:
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"]
        )


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


def latest_step(root: str) -> int | None:
    steps = [int(n.split("-")[1]) for n in os.listdir(root) if n.startswith("step-")] if os.path.isdir(root) else []
    return max(steps, default=None)


def main(args: argparse.Namespace) -> None:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = make_scheduler(opt)
    # DCP's async_save runs its collectives from a background thread: give it its own gloo group.
    ckpt_group = dist.new_group(backend="gloo") if dist.is_initialized() else None

    # --- checkpointing: resume ----------------------------------------------------------------
    start = 0
    last = latest_step(args.ckpt)
    if last is not None:
        state = {"app": AppState(model, opt), "sched": sched.state_dict(), "step": 0}
        dcp.load(state, checkpoint_id=f"{args.ckpt}/step-{last}", process_group=ckpt_group)
        sched.load_state_dict(state["sched"])
        start = state["step"]
    # ------------------------------------------------------------------------------------------

    pending = None
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

        # --- checkpointing: save --------------------------------------------------------------
        if step % args.save_every == 0:
            if pending is not None:
                pending.result()  # one save in flight at a time
            state = {"app": AppState(model, opt), "sched": sched.state_dict(), "step": step}
            pending = dcp.async_save(state, checkpoint_id=f"{args.ckpt}/step-{step}", process_group=ckpt_group)
    if pending is not None:
        pending.result()
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
    p.add_argument("--ckpt", required=True, help="checkpoint root: step-N directories go here")
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
                ["torch.distributed.checkpoint.state_dict", "torch.distributed.fsdp", "torch._dynamo"]
            )
            mp.start_processes(
                run, args=(args.nproc, f"file://{tmp}/store", args), nprocs=args.nproc, start_method="forkserver"
            )
    else:
        torch.set_num_threads(1)
        main(args)
