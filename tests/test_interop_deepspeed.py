"""Real DeepSpeed (CPU engine, gloo) checkpoints <-> tessera, judged by the engine itself.

One spawn of 3 ranks trains the tiny model of ``tests/ds_engine.py`` (tied embedding/head, a
frozen layer, a buffer, two AdamW parameter groups, 115 trainable elements: not a multiple of
``2 * dp``) under every configuration of ``ds_engine.CASES`` and saves each with
``engine.save_checkpoint``. Each checkpoint is imported with ``import_deepspeed`` (no
``allow_pickle``) and loaded strictly into a plain torch model and AdamW through
``tessera.ModelState`` / ``tessera.OptimizerState``; everything must equal the engine's own
fp32 master weights and Adam moments bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch

import tessera
from tessera.convert import import_deepspeed

from dist_utils import run_distributed
import ds_engine

pytestmark = [pytest.mark.interop("deepspeed"), pytest.mark.slow]

DP_SAVE = 3


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[str, dict]:
    """``(root, truth)``: every case trained and saved by DeepSpeed under ``root/<case>``."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    root = str(tmp_path_factory.mktemp("deepspeed"))
    truth = run_distributed(ds_engine.save_cases, DP_SAVE, root, list(ds_engine.CASES), timeout=600)[0]
    return root, truth


def _plain(case: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same model as a plain torch module and AdamW groups, other initial values and hyperparameters.

    Trainable parameters are fp32 (the importer writes DeepSpeed's fp32 master weights); the
    frozen ones have the engine's dtype, as they have no master copy.
    """
    torch.manual_seed(123)
    model = ds_engine.Net()
    if ds_engine.CASES[case]["dtype"] == "bf16":
        model.frozen.to(torch.bfloat16)
    decay = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and not n.endswith("weight")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.5}, {"params": rest, "lr": 0.5}], lr=0.5)
    return model, opt


@pytest.mark.parametrize("case", list(ds_engine.CASES))
def test_import_real_deepspeed_checkpoint(trained, tmp_path, case: str) -> None:
    root, truth = trained
    dst = str(tmp_path / "ts")
    import_deepspeed(os.path.join(root, case), dst)  # no allow_pickle: DeepSpeed's classes are allow-listed
    model, opt = _plain(case)
    state = {"model": tessera.ModelState(model), "optim": tessera.OptimizerState(model, opt)}
    result = tessera.load(dst, state)  # strict
    assert result.missing_keys == [] and result.unexpected_keys == []
    want = truth[case]
    named = dict(model.named_parameters())
    for name, t in want["params"].items():
        p = named[name]
        assert torch.equal(p.detach(), t["fp32"]), f"{case}: fp32 master of {name}"
        assert torch.equal(opt.state[p]["exp_avg"], t["exp_avg"]), f"{case}: exp_avg of {name}"
        assert torch.equal(opt.state[p]["exp_avg_sq"], t["exp_avg_sq"]), f"{case}: exp_avg_sq of {name}"
        assert float(opt.state[p]["step"]) == ds_engine.STEPS
    assert model.head.weight is model.embed.weight  # tied: one tensor, loaded from embed.weight
    sd = model.state_dict()
    for name, t in want["module"].items():  # frozen parameters (ZeRO-1: only in the module) and buffers
        assert sd[name].dtype == t.dtype and torch.equal(sd[name], t), f"{case}: {name}"
    assert opt.param_groups[0]["weight_decay"] == 0.1 and opt.param_groups[1]["lr"] == 2e-2
    assert opt.param_groups[1]["weight_decay"] == 0.0 and opt.param_groups[0]["lr"] == 1e-2


def test_import_refuses_unknown_objects_without_allow_pickle(trained, tmp_path) -> None:
    """The allow-list is exact: any other object in a DeepSpeed file still needs the opt-in."""
    import shutil

    from tessera.errors import CheckpointError

    root, _ = trained
    src = str(tmp_path / "ds")
    shutil.copytree(os.path.join(root, "z2_fp32"), src)
    f = os.path.join(src, ds_engine.TAG, "mp_rank_00_model_states.pt")
    sd = torch.load(f, weights_only=False)
    sd["client"] = _Custom()
    torch.save(sd, f)
    with pytest.raises(CheckpointError, match="allow_pickle"):
        import_deepspeed(src, str(tmp_path / "a"))
    result = import_deepspeed(src, str(tmp_path / "b"), allow_pickle=True)
    assert "deepspeed.client (not a plain value)" in result.skipped


class _Custom:
    """An object no allow-list knows."""
