"""PyTorch DCP <-> tessera, checked with torch's own ``dcp.save`` / ``dcp.load``.

DCP checkpoints written by torch (one process, and 2 real ranks saving DTensors) import into
tessera bit-exactly; tessera checkpoints exported to DCP load with ``dcp.load`` in one
process and resharded onto 2 ranks' DTensors.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard

import tessera
from tessera.cli import main
from tessera.convert import export_dcp, import_dcp
from tests.dist_utils import run_distributed
from tests.layouts import hold, mesh, truth

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SHAPES = {"w": ((10, 6), torch.float32), "v": ((7,), torch.bfloat16), "m": ((5, 9), torch.int64)}


class Opaque:
    """A value DCP pickles and ``weights_only`` refuses."""

    def __init__(self, x: int) -> None:
        self.x = x


def test_import_single_process_dcp(tmp_path) -> None:
    state = {
        "model": {n: truth(s, dt) for n, (s, dt) in SHAPES.items()},
        "optim": {
            "step": torch.tensor(12.0),
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["model.w"]}],
        },
        "epoch": 4,
        "cfg": {"name": "run", "sizes": [1, 2]},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    r = import_dcp(str(tmp_path / "dcp"), str(tmp_path / "ck"), file_bytes=100)
    assert r.tensors == 4 and r.files >= 2
    target = {
        "model": {n: torch.zeros(s, dtype=dt) for n, (s, dt) in SHAPES.items()},
        "optim": {"step": torch.tensor(0.0), "param_groups": None},
        "epoch": 0,
        "cfg": {"name": "", "sizes": []},  # as dcp.load needs it: DCP fills the keys it is given
    }
    tessera.load(str(tmp_path / "ck"), target)
    for n, (s, dt) in SHAPES.items():
        assert torch.equal(target["model"][n], truth(s, dt)), n
    assert target["optim"]["step"].item() == 12.0
    # DCP flattened the plain containers; the import nests them back as tessera stores them: a
    # top-level dict key by key (as a Stateful's state dict), a container below it as one value.
    assert {"cfg.name", "cfg.sizes", "optim.param_groups"} <= set(tessera.read_manifest(str(tmp_path / "ck")).values)
    assert target["optim"]["param_groups"] == [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["model.w"]}]
    assert target["cfg"] == {"name": "run", "sizes": [1, 2]} and target["epoch"] == 4


def test_pickled_entries_need_opt_in(tmp_path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2), "obj": Opaque(3)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    r = import_dcp(str(tmp_path / "dcp"), str(tmp_path / "ck"))
    assert r.skipped == ("obj (needs pickle)",)
    assert "obj" not in tessera.read_manifest(str(tmp_path / "ck")).values
    import_dcp(str(tmp_path / "dcp"), str(tmp_path / "ck2"), allow_pickle=True)
    target = {"obj": None}
    tessera.load(str(tmp_path / "ck2"), target, allow_pickle=True, strict=False)
    assert isinstance(target["obj"], Opaque) and target["obj"].x == 3


def _dcp_save_dtensors(rank: int, world: int, path: str) -> None:
    m = mesh((world,))
    state = {"model": {}}
    for i, (n, (s, dt)) in enumerate(SHAPES.items()):
        full = truth(s, dt)
        placements = [Shard(i % full.dim())]
        local = torch.chunk(full, world, dim=placements[0].dim)[rank].clone()
        state["model"][n] = DTensor.from_local(local, m, placements, shape=full.shape, stride=full.stride())
    state["model"]["rep"] = torch.arange(4.0)  # a plain tensor: replicated, DCP saves it once
    state["step"] = 7
    dcp.save(state, checkpoint_id=path)


def _dcp_load_dtensors(rank: int, world: int, path: str) -> int:
    m = mesh((world,))
    target = {"model": {}}
    for n, (s, dt) in SHAPES.items():
        full = truth(s, dt)
        placements = [Shard(full.dim() - 1)]  # another layout than the one saved
        zero = torch.zeros_like(full)
        target["model"][n] = DTensor.from_local(
            torch.chunk(zero, world, dim=placements[0].dim)[rank].clone(),
            m,
            placements,
            shape=full.shape,
            stride=full.stride(),
        )
    target["model"]["rep"] = torch.zeros(4)
    dcp.load(target, checkpoint_id=path)
    for n, (s, dt) in SHAPES.items():
        want = torch.chunk(truth(s, dt), world, dim=len(s) - 1)[rank]
        assert torch.equal(target["model"][n].to_local(), want), (rank, n)
    assert torch.equal(target["model"]["rep"], torch.arange(4.0))
    return len(target["model"])


def test_two_rank_dtensor_dcp_import_then_export_reshards_in_dcp(tmp_path) -> None:
    src = str(tmp_path / "dcp")
    run_distributed(_dcp_save_dtensors, 2, src)
    ck = str(tmp_path / "ck")
    assert main(["convert", src, ck]) == 0  # format detected from .metadata
    m = tessera.read_manifest(ck)
    assert len(m.tensors["model.w"].tiles) == 2  # one tile per saved DCP chunk
    target = {
        "model": {n: torch.zeros(s, dtype=dt) for n, (s, dt) in SHAPES.items()} | {"rep": torch.zeros(4)},
        "step": 0,
    }
    tessera.load(ck, target)
    for n, (s, dt) in SHAPES.items():
        assert torch.equal(target["model"][n], truth(s, dt)), n
    assert torch.equal(target["model"]["rep"], torch.arange(4.0)) and target["step"] == 7
    out = str(tmp_path / "out")
    assert main(["convert", ck, out, "--to", "dcp"]) == 0
    assert run_distributed(_dcp_load_dtensors, 2, out) == [4, 4]


def _save_tessera_layouts(rank: int, world: int, path: str) -> None:
    layouts = ["dt_2d", "flat", "sharded_cols"]
    state = {"model": {n: hold(layouts[i], truth(s, dt), rank, world) for i, (n, (s, dt)) in enumerate(SHAPES.items())},
             "sched": {"last_epoch": 3, "base_lrs": [0.1]}}  # fmt: skip
    tessera.save(path, state)


def test_export_three_rank_checkpoint_loads_with_dcp(tmp_path) -> None:
    ck = str(tmp_path / "ck")
    run_distributed(_save_tessera_layouts, 3, ck)
    out = str(tmp_path / "dcp")
    r = export_dcp(ck, out)
    assert r.tensors == 3 and r.values == 1
    target = {
        "model": {n: torch.zeros(s, dtype=dt) for n, (s, dt) in SHAPES.items()},
        "sched": {"last_epoch": 0, "base_lrs": None},
    }
    dcp.load(target, checkpoint_id=out)
    for n, (s, dt) in SHAPES.items():
        assert torch.equal(target["model"][n], truth(s, dt)), n
    assert target["sched"] == {"last_epoch": 3, "base_lrs": [0.1]}
    # --prefix selects and strips; --dtype casts floating point only.
    out2 = str(tmp_path / "dcp2")
    assert main(["convert", ck, out2, "--to", "dcp", "--prefix", "model.", "--dtype", "fp16", "--no-values"]) == 0
    md = dcp.FileSystemReader(out2).read_metadata()
    assert set(md.state_dict_metadata) == {"w", "v", "m"}
    assert md.state_dict_metadata["w"].properties.dtype == torch.float16
    assert md.state_dict_metadata["m"].properties.dtype == torch.int64
    assert len([f for f in os.listdir(out2) if f.endswith(".distcp")]) == 3


def _scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=3)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    return torch.optim.lr_scheduler.SequentialLR(opt, [warmup, cosine], milestones=[3])


@pytest.mark.parametrize("layout", ["pairs", "app"])
def test_a_dcp_scheduler_loads_into_the_scheduler(tmp_path, layout: str) -> None:
    """``"sched": scheduler.state_dict()`` saved by DCP loads strictly into ``{"sched": scheduler}``,
    beside ``get_state_dict`` pairs or the tutorial's ``{"app": AppState}`` (nested the same way)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = _scheduler(opt)
    for _ in range(5):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    pair = {"model": model_sd, "optim": optim_sd}
    saved = {**({"app": pair} if layout == "app" else pair), "sched": sched.state_dict(), "step": 5}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(saved, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert main(["convert", str(tmp_path / "dcp"), str(tmp_path / "ck")]) == 0

    fresh = torch.nn.Linear(4, 3)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_sched = _scheduler(fresh_opt)
    objects = {"model": tessera.ModelState(fresh), "optim": tessera.OptimizerState(fresh, fresh_opt)}
    target = {**({"app": objects} if layout == "app" else objects), "sched": fresh_sched, "step": 0}
    result = tessera.load(str(tmp_path / "ck"), target)  # strict
    assert result.missing_keys == [] and target["step"] == 5
    assert fresh_sched.state_dict() == sched.state_dict()
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert torch.equal(fresh.weight, model.weight)
    # The manifest holds what tessera.save of the same objects holds, but for the optimizer's
    # ``has_state`` flag: torch's layout has none, and OptimizerState infers it from the states.
    tessera.save(str(tmp_path / "native"), {**target, "sched": sched})
    native = {k for k in tessera.read_manifest(str(tmp_path / "native")).keys() if not k.endswith("optim.has_state")}
    assert set(tessera.read_manifest(str(tmp_path / "ck")).keys()) == native


class _TutorialAppState:
    """The DCP tutorial's ``AppState``, as users have it (``get_state_dict`` / ``set_state_dict``)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model, self.optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"]
        )


def test_the_tutorial_appstate_class_loads_a_converted_checkpoint_strictly(tmp_path) -> None:
    """The tutorial's own ``AppState`` object, unchanged, resumes a converted DCP checkpoint with
    ``strict=True`` (before, the importer's ``has_state`` flag was an unexpected key)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = _scheduler(opt)
    for _ in range(4):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"app": _TutorialAppState(model, opt), "sched": sched}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True
        )
    assert main(["convert", str(tmp_path / "dcp"), str(tmp_path / "ck")]) == 0

    fresh = torch.nn.Linear(4, 3)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_sched = _scheduler(fresh_opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = tessera.load(str(tmp_path / "ck"), {"app": _TutorialAppState(fresh, fresh_opt), "sched": fresh_sched})
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert torch.equal(fresh.weight, model.weight) and fresh_sched.state_dict() == sched.state_dict()
    for p, q in zip(fresh.parameters(), model.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(fresh_opt.state[p][key], opt.state[q][key]), key
