"""The same training loop checkpointed with tessera: the "after" of docs/from-dcp.md.

    python examples/from_dcp_after.py --ckpt DIR --steps 10            # one process
    python examples/from_dcp_after.py --ckpt DIR --steps 10 --nproc 2  # FSDP2 on 2 gloo ranks
    torchrun --nproc-per-node 2 examples/from_dcp_after.py --ckpt DIR

Every ``--save-every`` steps it saves ``DIR/step-N`` with ``tessera.async_save``; started
again with the same ``--ckpt`` it resumes from the newest step there, under any world size.
A step written by ``examples/from_dcp_before.py`` (DCP) resumes here once converted:
``tessera convert OLD/step-N DIR/step-N``. ``diff`` the two files to see the migration.
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
    # tessera coordinates over its own gloo group: no checkpoint process group to create.
    # ModelState / OptimizerState key everything by parameter name, like get_state_dict, and
    # hold opt.step() and the forward pass while a background copy still reads the tensors.
    state = {"model": tessera.ModelState(model), "optim": tessera.OptimizerState(model, opt), "step": 0}

    # --- checkpointing: resume ----------------------------------------------------------------
    last = latest_step(args.ckpt)
    if last is not None:
        tessera.load(f"{args.ckpt}/step-{last}", state)  # in place, strict, any world size
    start = state["step"]
    # ------------------------------------------------------------------------------------------

    pending = None
    for step in range(start + 1, args.steps + 1):
        x, y = batch(step, rank, world)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)  # the loss of the global batch, comparable at any world size
            mean /= world
        if rank == 0:
            print(f"step {step} loss {mean.item():.7f}", flush=True)

        # --- checkpointing: save --------------------------------------------------------------
        if step % args.save_every == 0:
            state["step"] = step
            # Waits for the previous save itself (one in flight per process), then returns.
            pending = tessera.async_save(f"{args.ckpt}/step-{step}", state)
    if pending is not None:
        pending.wait()  # committed
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
            mp.spawn(run, args=(args.nproc, f"file://{tmp}/store", args), nprocs=args.nproc)
    else:
        torch.set_num_threads(1)
        main(args)
