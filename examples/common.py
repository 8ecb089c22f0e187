"""Shared parts of the examples: launching, a toy model, data, and a resumable training loop.

Every example runs either under ``torchrun --nproc-per-node N examples/X.py`` or as plain
``python examples/X.py --nproc N``, which starts N gloo processes itself. Checkpoints go
to ``--ckpt/step_NNNNNN``; a run finds the newest one there and resumes from it, whatever
world size or framework saved it.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import tessera
from tessera.adapters import DataPosition, ModelState, OptimizerState, RNGState

DIM = 32


def parser(description: str) -> argparse.ArgumentParser:
    """The options every example takes; an example may add its own before parsing."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--nproc", type=int, default=2, help="processes to spawn when not under torchrun")
    p.add_argument("--steps", type=int, default=20, help="train until this global step")
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--batch", type=int, default=12, help="global batch size")
    p.add_argument("--ckpt", default="/tmp/tessera-example", help="checkpoint directory")
    return p


def launch(main: Callable[[argparse.Namespace], None], args: argparse.Namespace, preload: Sequence[str] = ()) -> None:
    """Run ``main(args)`` on every rank: under torchrun directly, else in ``args.nproc``
    processes forked from one server that imported torch, tessera and ``preload`` (the heavy
    modules of the script) once, instead of once per rank as spawn would. Python before 3.14
    does not preload the script's own imports in that server: hence the list."""
    if "RANK" in os.environ:  # torchrun set up the environment
        _run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", main, args)
        return
    mp.get_context("forkserver").set_forkserver_preload([*PRELOAD, *preload])
    with tempfile.TemporaryDirectory(prefix="tessera-example-") as tmp:
        store = f"file://{os.path.join(tmp, 'store')}"
        mp.start_processes(_run, args=(args.nproc, store, main, args), nprocs=args.nproc, start_method="forkserver")


PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo", "tessera.adapters", "common")
"""What every rank imports (DTensor and dynamo on the first optimizer step): seconds of CPU."""


def _run(rank: int, world: int, init: str, main: Callable, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        main(args)
        dist.barrier()  # nobody tears the group down while a peer still uses it
    finally:
        dist.destroy_process_group()


class Block(nn.Module):
    """A residual MLP block: ``up`` and ``down`` are what tensor parallelism splits."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class ToyModel(nn.Module):
    """Two blocks and a head; every example but the Hugging Face one builds this, so their
    checkpoints are interchangeable."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x).squeeze(-1)


def dataset(n: int = 240) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed synthetic regression set, identical in every process."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, DIM, generator=g)
    return x, x.sin().sum(-1)


def latest(ckpt: str) -> str | None:
    """The newest committed checkpoint under ``ckpt``."""
    if not os.path.isdir(ckpt):
        return None
    done = sorted(d for d in os.listdir(ckpt) if os.path.exists(os.path.join(ckpt, d, "manifest.json")))
    return os.path.join(ckpt, done[-1]) if done else None


def train(
    args: argparse.Namespace,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    dp_rank: int,
    dp_size: int,
    loss_fn: Callable[[nn.Module, list[int]], torch.Tensor] | None = None,
    num_samples: int = 240,
) -> None:
    """Resume from the newest checkpoint if any, then train to ``args.steps``, saving as we go.

    ``loss_fn(model, indices)`` computes the loss of this rank's samples; the default is the
    toy regression. Each rank takes its share of every global batch (see DataPosition).
    """
    rank = dist.get_rank()
    data = DataPosition()
    state = {
        "model": ModelState(model),
        "optim": OptimizerState(model, opt),
        "data": data,
        "rng": RNGState(),
        "step": 0,
    }
    path = latest(args.ckpt)
    if path is not None:
        t0 = time.monotonic()
        tessera.load(path, state)
        if rank == 0:
            print(f"resumed {path} at step {state['step']} in {time.monotonic() - t0:.2f}s")
    if loss_fn is None:
        x, y = dataset(num_samples)

        def loss_fn(m: nn.Module, idx: list[int]) -> torch.Tensor:
            return F.mse_loss(m(x[idx]), y[idx])

    pending = None
    while state["step"] < args.steps:
        idx = data.batch_indices(num_samples, args.batch, dp_rank, dp_size)
        loss = loss_fn(model, idx)
        loss.backward()
        opt.step()
        opt.zero_grad()
        data.advance(args.batch)
        state["step"] += 1
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        if rank == 0:
            print(f"step {state['step']:4d}  loss {avg.item() / dist.get_world_size():.6f}")
        if state["step"] % args.save_every == 0:
            # async: the loop resumes once the bytes are staged; the write overlaps training
            pending = tessera.async_save(os.path.join(args.ckpt, f"step_{state['step']:06d}"), state)
            if rank == 0:
                print(f"  saved step {state['step']} (stall {pending.stall_s * 1e3:.1f} ms)")
    if pending is not None:
        pending.wait()
