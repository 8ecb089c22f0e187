"""Train under one framework layout, save, resume under another: bit-exact state, same losses.

One tiny model (a frozen layer, a persistent buffer, uneven dims so FSDP+TP gives uneven
``_StridedShard`` shards) trains with AdamW in two parameter groups. Each source layout
trains ``N`` steps and saves; each target layout builds a *fresh* model (another seed) and
a fresh optimizer, loads, and must hold bit-identically what was saved (compared through
torch's own full-state-dict helpers, independent of tessera), then trains ``N`` more steps
whose losses must match an uninterrupted single-process run up to reduction order.

Spawns are batched: one world-4 job, one world-2 job (saves, then loads), one world-3 job;
the single-process source and target run in the test process itself. The same jobs also
check per-rank RNG state and the FSDP1 / unshaped-state corner cases.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tessera
from tessera.adapters import ModelState, OptimizerState, RNGState
from tests.dist_utils import run_distributed

N = 3
GLOBAL_BATCH = 12

# (source layout, source world) -> [(target layout, target world)]
PAIRS = [
    (("fsdp2", 2), ("single", 1)),
    (("single", 1), ("fsdp2", 3)),
    (("fsdp2", 2), ("tp", 2)),
    (("fsdp_tp", 4), ("fsdp2", 2)),
    (("ddp", 2), ("ddp", 3)),
    (("fsdp1", 2), ("fsdp2", 2)),
    (("fsdp1_orig", 2), ("fsdp2", 2)),
    (("fsdp1", 2), ("fsdp1_orig", 2)),
    (("single", 1), ("fsdp_tp", 4)),
    (("tp", 2), ("fsdp2", 3)),
    (("fsdp2", 2), ("fsdp1", 2)),
]
SOURCES = ["single-1", "fsdp2-2", "ddp-2", "tp-2", "fsdp1-2", "fsdp1_orig-2", "fsdp_tp-4"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(8, 8)
        self.fc1 = nn.Linear(8, 10)
        self.fc2 = nn.Linear(10, 6)
        self.norm = nn.LayerNorm(6)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc2(torch.relu(self.fc1(torch.tanh(self.frozen(x)))))) * self.scale


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 6, generator=g)


_MESHES: dict[tuple[int, ...], object] = {}


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    from torch.distributed.device_mesh import init_device_mesh

    if shape not in _MESHES:
        _MESHES[shape] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[shape]


def build(layout: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, int, int]:
    """The model under ``layout``, its AdamW, and this rank's data-parallel rank and size."""
    torch.manual_seed(seed)
    model = Net()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    dp_rank, dp_size = rank, world
    if layout == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif layout == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        mesh = _mesh((world,), ("dp",))
        fully_shard(model.fc1, mesh=mesh)
        fully_shard(model.fc2, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout in ("tp", "fsdp_tp"):
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = _mesh((world,), ("tp",)) if layout == "tp" else _mesh((2, world // 2), ("dp", "tp"))
        tp_mesh = mesh if layout == "tp" else mesh["tp"]
        parallelize_module(model, tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        if layout == "tp":
            dp_rank, dp_size = 0, 1
        else:
            from torch.distributed.fsdp import fully_shard

            fully_shard(model.fc1, mesh=mesh["dp"])
            fully_shard(model.fc2, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            dp_rank, dp_size = mesh["dp"].get_local_rank(), 2
    elif layout in ("fsdp1", "fsdp1_orig"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            use_orig_params=layout == "fsdp1_orig",
            device_id=torch.device("cpu"),
        )
    elif layout != "single":
        raise ValueError(layout)
    groups: dict[str, list] = {"fc1": [], "rest": []}
    for name, p in model.named_parameters():
        clean = name.replace("_fsdp_wrapped_module.", "").removeprefix("module.")
        groups["fc1" if clean.startswith("fc1.") else "rest"].append(p)
    opt = torch.optim.AdamW(
        [
            {"params": groups["fc1"], "lr": 0.01, "weight_decay": 0.1},
            {"params": groups["rest"], "lr": 0.02, "weight_decay": 0.0, "betas": (0.8, 0.95)},
        ]
    )
    return model, opt, dp_rank, dp_size


def train(
    model: nn.Module, opt: torch.optim.Optimizer, start: int, steps: int, dp_rank: int, dp_size: int
) -> list[float]:
    losses = []
    share = GLOBAL_BATCH // dp_size
    for k in range(start, start + steps):
        x, y = batch(k)
        sl = slice(dp_rank * share, (dp_rank + 1) * share)
        loss = F.mse_loss(model(x[sl]), y[sl])
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(value)
            value /= dist.get_world_size()
        losses.append(value.item())
    return losses


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Every tensor gathered whole, by FQN, through torch's own helpers (not tessera)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    msd = get_model_state_dict(model, options=options)
    osd = get_optimizer_state_dict(model, opt, options=options)
    groups = []
    for g in osd["param_groups"]:
        groups.append((sorted(g["params"]), {k: v for k, v in g.items() if k not in ("params", "initial_lr")}))
    return {
        "model": {k: v.detach().clone() for k, v in msd.items()},
        "optim": {
            fqn: {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in st.items()}
            for fqn, st in osd["state"].items()
        },
        "groups": sorted(groups, key=lambda g: g[0]),
    }


def source(layout: str, root: str) -> dict:
    model, opt, dp_rank, dp_size = build(layout, seed=0)
    losses = train(model, opt, 0, N, dp_rank, dp_size)
    world = dist.get_world_size() if dist.is_initialized() else 1
    tessera.save(
        os.path.join(root, f"{layout}-{world}"),
        {"model": ModelState(model), "optim": OptimizerState(model, opt), "step": N},
    )
    out = {"losses": losses, "full": full_state(model, opt)}
    out["after"] = train(model, opt, N, N, dp_rank, dp_size)  # saving must not disturb training
    return out


def target(layout: str, src: str, root: str) -> dict:
    model, opt, dp_rank, dp_size = build(layout, seed=1)
    state = {"model": ModelState(model), "optim": OptimizerState(model, opt), "step": 0}
    result = tessera.load(os.path.join(root, src), state)
    assert state["step"] == N and result.missing_keys == [] and result.unexpected_keys == []
    full = full_state(model, opt)
    return {"full": full, "losses": train(model, opt, N, N, dp_rank, dp_size)}


def _targets(world: int, root: str) -> dict:
    return {
        f"{src}-{sw}->{dst}-{dw}": target(dst, f"{src}-{sw}", root) for (src, sw), (dst, dw) in PAIRS if dw == world
    }


def _rng_draw() -> list[float]:
    return [random.random(), float(np.random.rand()), torch.rand(()).item()]


def _rng(rank: int, root: str, save: bool) -> dict:
    """Per-rank generators: saved by 2 ranks; restored per rank, or kept under 3."""
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(rank)
    path = os.path.join(root, "rng")
    if save:
        tessera.save(path, {"rng": RNGState()})
        return {"saved": _rng_draw(), "loaded": (tessera.load(path, {"rng": RNGState()}), _rng_draw())[1]}
    before = (random.getstate(), torch.get_rng_state())
    tessera.load(path, {"rng": RNGState()})
    return {"kept": before[0] == random.getstate() and torch.equal(before[1], torch.get_rng_state())}


def _extras_world2(root: str) -> dict:
    out: dict = {}
    # an FSDP1 use_orig_params optimizer that already stepped has no state where a rank holds
    # nothing of a parameter (fc1.bias on rank 0); the rank holding it loads it
    model, opt, dp_rank, dp_size = build("fsdp1_orig", seed=1)
    train(model, opt, 0, 1, dp_rank, dp_size)
    tessera.load(os.path.join(root, "fsdp1_orig-2"), {"model": ModelState(model), "optim": OptimizerState(model, opt)})
    out["fsdp1_orig-2->stepped fsdp1_orig-2"] = {"full": full_state(model, opt)}
    # a plain state tensor of a sharded parameter, shaped unlike it, cannot be described
    model, opt, _, _ = build("fsdp2", seed=0)
    opt.state[model.fc1.weight]["odd"] = torch.zeros(3)
    try:
        OptimizerState(model, opt).state_dict()
        out["odd"] = "no error"
    except ValueError as e:
        out["odd"] = str(e)
    return out


def _world4(rank: int, world: int, root: str) -> dict:
    return {"fsdp_tp-4": source("fsdp_tp", root), **_targets(4, root)}


def _world2(rank: int, world: int, root: str) -> dict:
    out = {f"{layout}-2": source(layout, root) for layout in ("fsdp2", "ddp", "tp", "fsdp1", "fsdp1_orig")}
    out.update(_targets(2, root))
    out.update(_extras_world2(root))
    out[f"rng-{rank}"] = _rng(rank, root, save=True)
    return out


def _world3(rank: int, world: int, root: str) -> dict:
    return {**_targets(3, root), "rng": _rng(rank, root, save=False)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = str(tmp_path_factory.mktemp("resume"))
    out = {"root": root, "single-1": source("single", root)}
    out.update(run_distributed(_world4, 4, root)[0])
    w2 = run_distributed(_world2, 2, root)
    out.update(w2[0])
    out["rng-1"] = w2[1]["rng-1"]
    w3 = run_distributed(_world3, 3, root)
    out.update({k: v for k, v in w3[0].items() if k != "rng"})
    out["rng-3"] = [r["rng"] for r in w3]
    for (src, sw), (dst, dw) in PAIRS:
        if dw == 1:
            out[f"{src}-{sw}->{dst}-{dw}"] = target(dst, f"{src}-{sw}", root)
    return out


def _assert_same_state(got: dict, want: dict, what: str) -> None:
    assert got["model"].keys() == want["model"].keys(), what
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), f"{what}: model tensor {k} differs"
    assert got["optim"].keys() == want["optim"].keys(), what
    for fqn, st in want["optim"].items():
        assert got["optim"][fqn].keys() == st.keys(), f"{what}: {fqn}"
        for k, v in st.items():
            same = torch.equal(got["optim"][fqn][k], v) if torch.is_tensor(v) else got["optim"][fqn][k] == v
            assert same, f"{what}: optimizer state {fqn}.{k} differs"
    assert got["groups"] == want["groups"], what


def test_sources_match_the_reference(runs: dict) -> None:
    ref = runs["single-1"]["losses"] + runs["single-1"]["after"]
    for name in ("fsdp2-2", "ddp-2", "fsdp1-2", "fsdp1_orig-2", "fsdp_tp-4"):
        got = runs[name]["losses"] + runs[name]["after"]
        assert got == pytest.approx(ref, rel=1e-5, abs=1e-6), name
    # frozen parameters are in the model state and absent from the optimizer state
    full = runs["single-1"]["full"]
    assert "frozen.weight" in full["model"] and "frozen.weight" not in full["optim"]
    assert "scale" in full["model"] and "scratch" not in full["model"]


def test_every_framework_writes_the_same_keys(runs: dict) -> None:
    """DDP, FSDP1, FSDP2, TP and 2-D checkpoints name, shape and type every tensor alike."""
    manifests = {name: tessera.read_manifest(os.path.join(runs["root"], name)) for name in SOURCES}
    want = {k: (e.dtype, e.shape) for k, e in manifests["single-1"].tensors.items()}
    assert "model.frozen.weight" in want and not any(
        k.startswith(("model.module.", "optim.state.frozen")) for k in want
    )
    for name, m in manifests.items():
        assert {k: (e.dtype, e.shape) for k, e in m.tensors.items()} == want, name
        assert _sorted_groups(m.values) == _sorted_groups(manifests["single-1"].values), name


def _sorted_groups(values: dict) -> dict:
    """Manifest values with each group's FQN list sorted (frameworks order parameters differently)."""
    groups = [{**g, "params": sorted(g["params"])} for g in values["optim.param_groups"]]
    return {**values, "optim.param_groups": groups}


def test_stepped_fsdp1_orig_optimizer_loads(runs: dict) -> None:
    _assert_same_state(runs["fsdp1_orig-2->stepped fsdp1_orig-2"]["full"], runs["fsdp1_orig-2"]["full"], "fsdp1_orig")


def test_sharded_parameter_with_unshaped_state_is_refused(runs: dict) -> None:
    assert "optimizer state 'odd' of parameter 'fc1.weight'" in runs["odd"], runs["odd"]


def test_rng_state_per_rank(runs: dict) -> None:
    for rank in (0, 1):
        r = runs[f"rng-{rank}"]
        assert r["loaded"] == r["saved"], rank  # the same draws again after loading
    assert runs["rng-0"]["saved"] != runs["rng-1"]["saved"]  # ranks had their own streams
    assert all(r["kept"] for r in runs["rng-3"])  # another world size keeps the generators


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0][0]}x{p[0][1]}-to-{p[1][0]}x{p[1][1]}")
def test_resume_under_another_layout(runs: dict, pair: tuple) -> None:
    (src, sw), (dst, dw) = pair
    saved = runs[f"{src}-{sw}"]
    resumed = runs[f"{src}-{sw}->{dst}-{dw}"]
    _assert_same_state(resumed["full"], saved["full"], f"{src}x{sw} -> {dst}x{dw}")
    ref = runs["single-1"]["after"]
    assert resumed["losses"] == pytest.approx(ref, rel=1e-5, abs=1e-6)
