"""tessera demo: train under one layout, save, resume under others, same loss curve.

1. 2 processes train a small GPT-like model with FSDP2 for 20 steps, save a checkpoint
   (model, AdamW state, step, per-rank RNG) asynchronously, and keep training to step 40.
2. 3 processes (another world size, so other shards) resume from the checkpoint and
   train steps 21-40: the losses match the uninterrupted run.
3. A single process without torch.distributed loads only the model for evaluation.

    python examples/demo.py [--dir DIR]

Without ``--dir`` everything goes to a temporary directory that is removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard

import tessera

VOCAB, DIM, SEQ, BATCH = 64, 64, 16, 12  # BATCH divides by 2 and 3: same global batch everywhere


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(x)


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x).clone()  # FSDP2 wants the root's output not to be a view


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: deterministic, so every layout sees the same data."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    seq = (start + torch.arange(SEQ + 1) * 3) % VOCAB  # a learnable pattern
    return seq[:, :-1], seq[:, 1:]


def build(world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyGPT()
    if world > 1:
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int, world: int) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step)
        per = BATCH // world
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        value = loss.detach().clone()
        if world > 1:
            dist.all_reduce(value)
            value /= world
        losses.append(value.item())
    return losses


def state(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    return {
        "model": tessera.ModelState(model),
        "optim": tessera.OptimizerState(model, opt),
        "step": step,
        "rng": tessera.per_rank(torch.get_rng_state(), on_resize="keep"),
    }


def phase_1(rank: int, world: int, ckpt: str, out: str) -> None:
    model, opt = build(world)
    first = train(model, opt, range(1, 21), rank, world)
    pending = tessera.async_save(ckpt, state(model, opt, 20))
    rest = train(model, opt, range(21, 41), rank, world)  # training goes on while it writes
    result = pending.wait()
    if rank == 0:
        print(f"[2 ranks, FSDP2] trained steps 1-20: loss {first[0]:.3f} -> {first[-1]:.3f}")
        print(
            f"[2 ranks, FSDP2] async_save stalled training for {pending.stall_s * 1e3:.1f} ms; "
            f"committed {result.total_bytes / 1e6:.2f} MB in {result.timings['total']:.2f} s"
        )
        torch.save(rest, out)


def phase_2(rank: int, world: int, ckpt: str, ref: str) -> None:
    model, opt = build(world)  # fresh model and optimizer, different init is overwritten
    target = state(model, opt, 0)
    res = tessera.load(ckpt, target)
    resumed = train(model, opt, range(target["step"] + 1, 41), rank, world)
    if rank == 0:
        reference = torch.load(ref)
        worst = max(abs(a - b) for a, b in zip(resumed, reference))
        print(
            f"[3 ranks, FSDP2] resumed at step {target['step']} (read {res.bytes_read / 1e6:.2f} MB on rank 0); "
            f"steps 21-40 loss {resumed[0]:.4f} -> {resumed[-1]:.4f}"
        )
        print(f"[3 ranks, FSDP2] max |loss difference| vs the uninterrupted 2-rank run: {worst:.2e}")
        assert worst < 1e-4, "resumed run diverged from the uninterrupted one"


def run(fn, world: int, *args: object) -> None:
    mp.start_processes(_entry, args=(fn, world, args), nprocs=world, start_method="spawn")


def _entry(rank: int, fn, world: int, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args[-1]}.store", rank=rank, world_size=world)
    try:
        fn(rank, world, *args[:-1])
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="keep the checkpoint here (default: a temporary directory, removed)")
    args = ap.parse_args()
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
        run_demo(args.dir)
        return
    root = tempfile.mkdtemp(prefix="tessera-demo-")
    try:
        run_demo(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_demo(root: str) -> None:
    ckpt, ref = os.path.join(root, "ckpt"), os.path.join(root, "reference.pt")

    run(phase_1, 2, ckpt, ref, os.path.join(root, "a"))
    m = tessera.read_manifest(ckpt)
    tiles = sum(len(e.tiles) for e in m.tensors.values())
    print(
        f"checkpoint {ckpt}: {len(m.tensors)} global tensors in {tiles} tiles across {len(m.files)} files, "
        f"values {sorted(m.values)}"
    )
    run(phase_2, 3, ckpt, ref, os.path.join(root, "b"))

    model = TinyGPT()  # 3. one process, no torch.distributed: evaluate the saved model
    tessera.load(ckpt, {"model": tessera.ModelState(model)})
    x, y = batch(10_000)
    with torch.no_grad():
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    print(f"[1 process] loaded only the model (no optimizer, no process group): eval loss {loss:.3f}")
    print("demo OK")


if __name__ == "__main__":
    main()
