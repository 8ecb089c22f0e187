"""torchtitan: ``TesseraCheckpointManager`` with torchtitan's real checkpointer and containers.

torchtitan's ``Trainer`` does not run on a CPU-only machine (it places the model on
``cuda:<LOCAL_RANK>``; see docs/integrations.md), so these tests drive the parts it is built
from: its ``CheckpointManager`` policy code (interval, step discovery, model-only loads,
async saves), ``OptimizersContainer``, ``LRSchedulersContainer`` and ``ParallelAwareDataloader``,
around a tiny FSDP2 model on gloo processes. A job on 2 processes trains 5 steps, saving
at step 3 (asynchronously); jobs on 3 and on 2 processes build everything fresh (another
seed), ``load()`` the newest step, must hold bit-exactly what was saved (through torch's
full state dicts), and on 2 processes train on with the same data and losses as the
uninterrupted run.

``import torchtitan`` needs ``triton`` (its package ``__init__`` imports the MoE kernels);
without it the module is skipped.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("torchtitan.components.checkpoint", reason="torchtitan (and triton, which it imports) needed")

import tessera
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.interop


class Samples(torch.utils.data.IterableDataset):
    """An endless stream of (x, y) pairs, a different one per DP rank."""

    def __init__(self, dp_rank: int) -> None:
        self.dp_rank = dp_rank

    def __iter__(self):
        i = 0
        while True:
            g = torch.Generator().manual_seed(10_000 * self.dp_rank + i)
            yield torch.randn(6, generator=g), torch.randn(2, generator=g)
            i += 1


class TrainState:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        self.step = sd["step"]


def _full(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    o = StateDictOptions(full_state_dict=True)
    osd = get_optimizer_state_dict(model, opt, options=o)
    return {
        "model": {k: v.detach().clone() for k, v in get_model_state_dict(model, options=o).items()},
        "optim": {p: {k: torch.as_tensor(v).clone() for k, v in st.items()} for p, st in osd["state"].items()},
        "lr": [g["lr"] for g in opt.param_groups],
    }


def _job(rank: int, world: int, base: str, mode: str) -> dict:
    os.environ.setdefault("LOCAL_RANK", str(rank))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.config import Checkpoint

    from tessera.integrations.torchtitan import TesseraCheckpointManager

    torch.manual_seed(0 if mode == "save" else 1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers = OptimizersContainer([model], torch.optim.AdamW, {"lr": 1e-2})
    schedulers = LRSchedulersContainer(optimizers, lambda step: 0.9**step)
    loader = ParallelAwareDataloader(Samples(rank), dp_rank=rank, dp_world_size=world, batch_size=2)
    train_state = TrainState()
    config = Checkpoint(enable=True, folder="ckpt", interval=3, async_mode="async" if mode == "save" else "disabled")
    ckpt = TesseraCheckpointManager(
        dataloader=loader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train_state},
        checkpoint_config=config,
        sd_adapter=None,
        base_folder=base,
    )
    out: dict = {"losses": []}
    if mode != "save":
        out["loaded"] = ckpt.load()
        out["state"] = _full(model, optimizers.optimizers[0])
        out["step"] = train_state.step
    batches = iter(loader)
    for _ in range(5 if mode == "save" else 2):
        x, y = next(batches)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        train_state.step += 1
        out["losses"].append(float(loss.detach()))
        ckpt.save(curr_step=train_state.step)
        if mode == "save" and train_state.step == 3:
            out["state"] = _full(model, optimizers.optimizers[0])
            ckpt.save_future.result()  # the async save is committed
            ckpt.save_future = None
    ckpt.close()
    return out


def test_save_on_2_resume_on_3_and_2(tmp_path):
    base = str(tmp_path)
    saved = run_distributed(_job, 2, base, "save")
    path = os.path.join(base, "ckpt", "step-3")
    manifest = tessera.read_manifest(path)
    assert manifest.world_size == 2
    assert {"model.0.weight", "optimizer.state.0.weight.exp_avg"} <= set(manifest.tensors)
    assert manifest.per_rank  # the data loaders' states
    for world in (3, 2):
        resumed = run_distributed(_job, world, base, "resume")
        for r in resumed:
            assert r["loaded"] is True and r["step"] == 3
            ref = saved[0]["state"]
            assert ref["model"].keys() == r["state"]["model"].keys()
            for k in ref["model"]:
                assert torch.equal(ref["model"][k], r["state"]["model"][k]), k
            for p, st in ref["optim"].items():
                for k, v in st.items():
                    assert torch.equal(v, r["state"]["optim"][p][k]), (p, k)
            assert ref["lr"] == r["state"]["lr"]
    # Same DP degree (the last job): every rank's loader continues where it was, so the
    # losses are the uninterrupted run's, bit-exact.
    assert [r["losses"] for r in resumed] == [s["losses"][3:] for s in saved]
