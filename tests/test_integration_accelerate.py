"""Accelerate: ``save_state`` / ``load_state`` with the real ``accelerate`` on CPU processes.

A job on 2 gloo processes (Accelerate sees the torchrun-style environment and uses the
initialised group, ``DistributedType.MULTI_CPU``) prepares a tiny model, AdamW and a
scheduler, trains 3 steps and saves. Jobs on 3 processes and on 1 prepare a model from
another seed and fresh optimizers, load, and must hold bit-exactly what was saved (model
through ``accelerator.get_state_dict``, optimizer and scheduler through their own state
dicts), with ``accelerator.step`` restored; they then keep training. On 2 processes the
resumed losses equal the uninterrupted run's.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("accelerate")

import tessera
from tessera.integrations.accelerate import load_state, save_state
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.interop


class Counter:
    """A custom object registered for checkpointing."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)


def _snapshot(accelerator, model, opt, sched) -> dict:
    sd = opt.state_dict()
    return {
        "model": {k: v.clone() for k, v in accelerator.get_state_dict(model).items()},
        "optim": {p: {k: v.clone() for k, v in st.items()} for p, st in sd["state"].items()},
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]],
        "sched": sched.state_dict(),
        "step": accelerator.step,
    }


def _job(rank: int, world: int, ckpt: str, mode: str, train_steps: int) -> dict:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="1"
    )
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=1)
    torch.manual_seed(1 if mode == "resume" else 0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    out: dict = {"distributed_type": accelerator.distributed_type.value, "losses": []}
    if mode == "resume":
        load_state(accelerator, ckpt)
        out["loaded"] = _snapshot(accelerator, model, opt, sched)
        out["counter"] = counter.n
    first = accelerator.step if mode == "resume" else 0
    for step in range(first, first + train_steps):
        with accelerator.accumulate(model):
            x, y = _batch(step, rank)
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
        counter.n += 1
        out["losses"].append(float(loss.detach()))
        if mode == "save" and step == 2:
            save_state(accelerator, ckpt)
            out["saved"] = _snapshot(accelerator, model, opt, sched)
    return out


def _same(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["optim"].keys() == b["optim"].keys() and a["optim"]
    for p in a["optim"]:
        for k in a["optim"][p]:
            assert torch.equal(a["optim"][p][k], b["optim"][p][k]), (p, k)
    assert a["groups"] == b["groups"]
    assert a["sched"] == b["sched"]
    assert a["step"] == b["step"]


def test_save_on_2_resume_on_3_2_and_1(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(_job, 2, ckpt, "save", 5)
    assert saved[0]["distributed_type"] == "MULTI_CPU"
    manifest = tessera.read_manifest(ckpt)
    assert manifest.world_size == 2
    assert {"model.0.0.weight", "optim.0.state.0.weight.exp_avg"} <= set(manifest.tensors)
    ref = saved[0]["saved"]
    assert ref["step"] == 3 and ref["sched"]["last_epoch"] == 3 * 2  # Accelerate steps it once per process
    for world in (3, 2):
        resumed = run_distributed(_job, world, ckpt, "resume", 2)
        for r in resumed:
            _same(ref, r["loaded"])
            assert r["counter"] == 3
        if world == 2:  # the same data per rank: the same losses as the uninterrupted run
            assert [r["losses"] for r in resumed] == [s["losses"][3:] for s in saved]
    single = run_distributed(_job, 1, ckpt, "resume", 1)[0]
    _same(ref, single["loaded"])
