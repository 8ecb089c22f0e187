"""Data-parallel training (DDP) with tessera checkpoints that any other layout can resume.

    python examples/train_ddp.py --nproc 2 --steps 10
    python examples/train_ddp.py --nproc 3 --steps 20      # resumes step 10 on 3 ranks
    torchrun --nproc-per-node 2 examples/train_ddp.py

DDP's ``module.`` prefix is dropped: the checkpoint is the same as a single process's, so
``train_fsdp2.py`` or ``train_tp.py`` can resume it too (same ``--ckpt``).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common


def main(args) -> None:
    torch.manual_seed(0)
    model = DDP(common.ToyModel())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    common.train(args, model, opt, dist.get_rank(), dist.get_world_size())


if __name__ == "__main__":
    common.launch(main, common.parser(__doc__.splitlines()[0]).parse_args())
