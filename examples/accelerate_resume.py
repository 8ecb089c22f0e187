"""Accelerate + tessera: save model, optimizer, scheduler and RNG on N processes, resume on M.

    python examples/accelerate_resume.py --nproc 2 --steps 6 --ckpt /tmp/tessera-accelerate
    python examples/accelerate_resume.py --nproc 3 --steps 10 --ckpt /tmp/tessera-accelerate

``--nproc`` launches CPU processes with Accelerate's ``notebook_launcher``; under
``accelerate launch`` (or ``torchrun``) leave it out. A run resumes from ``--ckpt`` when a
checkpoint is there, then trains to ``--steps`` and saves again.
"""

from __future__ import annotations

import argparse
import os

import torch
from accelerate import Accelerator, notebook_launcher
from torch import nn

from tessera.integrations.accelerate import load_state, save_state


def train(ckpt: str, steps: int) -> None:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.99**s)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    if os.path.exists(os.path.join(ckpt, "manifest.json")):
        load_state(accelerator, ckpt)  # any process count; the optimizer here is fresh
        accelerator.print(f"resumed at step {accelerator.step} on {accelerator.num_processes} processes")
    g = torch.Generator().manual_seed(accelerator.process_index)
    while accelerator.step < steps:
        x = torch.randn(8, 16, generator=g)
        loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        accelerator.step += 1  # the step counter tessera saves and restores
    save_state(accelerator, ckpt)  # collective: every process writes its part
    accelerator.print(f"step {accelerator.step}, loss {loss.item():.4f}; saved {ckpt}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=0, help="CPU processes to launch (0: already launched)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--ckpt", default="/tmp/tessera-accelerate")
    args = p.parse_args()
    if args.nproc:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        notebook_launcher(train, (args.ckpt, args.steps), num_processes=args.nproc)
    else:
        train(args.ckpt, args.steps)


if __name__ == "__main__":
    main()
