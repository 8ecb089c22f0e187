"""torchtitan + tessera: torchtitan's checkpointer policy, tessera's I/O; resume on another world size.

    python examples/torchtitan_checkpointer.py --nproc 2 --steps 6 --folder /tmp/tessera-titan
    python examples/torchtitan_checkpointer.py --nproc 3 --steps 9 --folder /tmp/tessera-titan

In torchtitan's own trainer, call ``tessera.integrations.torchtitan.install()`` before
``torchtitan.train.main(Trainer)`` and nothing else changes. That trainer needs a GPU, so this
example builds the same pieces on CPU processes (an FSDP2 model, torchtitan's
``OptimizersContainer``, ``LRSchedulersContainer``, ``ParallelAwareDataloader``) around
``TesseraCheckpointManager``, which saves every ``--interval`` steps to ``<folder>/ckpt/step-N``
and, on start, loads the newest committed step. Needs torchtitan and triton (its import needs it).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class Samples(torch.utils.data.IterableDataset):
    def __init__(self, dp_rank: int) -> None:
        self.dp_rank = dp_rank

    def __iter__(self):
        g = torch.Generator().manual_seed(self.dp_rank)
        while True:
            x = torch.randn(16, generator=g)
            yield x, x.sum(0, keepdim=True)


class TrainState:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        self.step = sd["step"]


def train(rank: int, world: int, store: str, folder: str, steps: int, interval: int) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.config import Checkpoint

    from tessera.integrations.torchtitan import TesseraCheckpointManager

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    optimizers = OptimizersContainer([model], torch.optim.AdamW, {"lr": 1e-2})
    schedulers = LRSchedulersContainer(optimizers, lambda s: 0.99**s)
    loader = ParallelAwareDataloader(Samples(rank), dp_rank=rank, dp_world_size=world, batch_size=8)
    state = TrainState()
    checkpointer = TesseraCheckpointManager(
        dataloader=loader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": state},
        sd_adapter=None,
        base_folder=folder,
        checkpoint_config=Checkpoint(enable=True, folder="ckpt", interval=interval, async_mode="async"),
    )
    if checkpointer.load() and rank == 0:
        print(f"resumed at step {state.step} on {world} processes")
    batches = iter(loader)
    while state.step < steps:
        x, y = next(batches)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        state.step += 1
        checkpointer.save(curr_step=state.step, last_step=False)
    if checkpointer.save_future is not None:
        checkpointer.save_future.result()  # the last asynchronous save is committed
    checkpointer.close()
    if rank == 0:
        print(f"step {state.step}, loss {loss.item():.4f}; checkpoints in {os.path.join(folder, 'ckpt')}")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--interval", type=int, default=3)
    p.add_argument("--folder", default="/tmp/tessera-titan")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            train, (args.nproc, os.path.join(tmp, "store"), args.folder, args.steps, args.interval), nprocs=args.nproc
        )


if __name__ == "__main__":
    main()
