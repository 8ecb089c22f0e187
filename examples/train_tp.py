"""Tensor-parallel training (``parallelize_module``), optionally with FSDP2 on a 2-D mesh.

    python examples/train_tp.py --nproc 2 --steps 10               # TP over 2 ranks
    python examples/train_tp.py --nproc 4 --dp 2 --steps 20        # FSDP2 x TP, 2 x 2
    torchrun --nproc-per-node 2 examples/train_tp.py

``up`` layers are column-parallel and ``down`` layers row-parallel. With ``--dp 2`` FSDP2
shards the TP shards again (torch's ``_StridedShard``); tessera stores plain boxes either
way, so checkpoints of this script, ``train_fsdp2.py`` and ``train_ddp.py`` are
interchangeable.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common


def main(args) -> None:
    world = dist.get_world_size()
    if world % args.dp:
        raise SystemExit(f"--dp {args.dp} must divide the world size {world}")
    torch.manual_seed(0)
    model = common.ToyModel()
    mesh = init_device_mesh("cpu", (args.dp, world // args.dp), mesh_dim_names=("dp", "tp"))
    plan = {}
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.up"] = ColwiseParallel()
        plan[f"blocks.{i}.down"] = RowwiseParallel()
    parallelize_module(model, mesh["tp"], plan)
    if args.dp > 1:
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    # every rank of a TP group sees the same samples: the data-parallel rank picks them
    common.train(args, model, opt, mesh["dp"].get_local_rank(), args.dp)


if __name__ == "__main__":
    parser = common.parser(__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=1, help="FSDP2 degree (the rest is TP)")
    common.launch(main, parser.parse_args(), preload=["torch.distributed.fsdp", "torch.distributed.tensor.parallel"])
