"""FSDP2 (``fully_shard``) training with tessera checkpoints that any other layout can resume.

    python examples/train_fsdp2.py --nproc 2 --steps 10
    python examples/train_fsdp2.py --nproc 3 --steps 20    # resumes step 10, 3-way sharded
    torchrun --nproc-per-node 2 examples/train_fsdp2.py

Parameters and optimizer states are DTensors; each rank writes only its own shard, and
on load reads only the bytes of its new shard. No rank materializes a full tensor.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common


def main(args) -> None:
    torch.manual_seed(0)
    model = common.ToyModel()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    common.train(args, model, opt, dist.get_rank(), dist.get_world_size())


if __name__ == "__main__":
    common.launch(main, common.parser(__doc__.splitlines()[0]).parse_args(), preload=["torch.distributed.fsdp"])
