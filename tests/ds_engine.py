"""Train a tiny model with the real DeepSpeed engine (CPU, gloo) and save or resume its checkpoints.

Used by ``tests/test_interop_deepspeed.py`` through ``run_distributed``: every function here runs
inside a spawned rank whose gloo group is already initialised. DeepSpeed is told to use the CPU
accelerator (``DS_ACCELERATOR=cpu``) before it is imported. One spawn trains and saves several
configurations one after the other, because DeepSpeed's start-up dominates the cost of a run.
"""

from __future__ import annotations

import os
from typing import Any

import torch

CASES: dict[str, dict[str, Any]] = {
    # name: (zero stage, dtype, extra zero options, grad accumulation dtype)
    "z1_fp32": {"stage": 1, "dtype": "fp32"},
    "z2_fp32": {"stage": 2, "dtype": "fp32"},
    "z3_fp32": {"stage": 3, "dtype": "fp32"},
    "z1_bf16": {"stage": 1, "dtype": "bf16", "grad_accum_dtype": "bf16"},
    "z2_bf16": {"stage": 2, "dtype": "bf16"},
    "z3_bf16": {"stage": 3, "dtype": "bf16"},
    "z1_bf16_optimizer": {"stage": 1, "dtype": "bf16", "grad_accum_dtype": "fp32"},  # BF16_Optimizer
    "z2_bf16_aligned": {"stage": 2, "dtype": "bf16", "zero": {"parameter_alignment": True}},
    "z1_fp32_aligned_round_robin": {
        "stage": 1,
        "dtype": "fp32",
        "zero": {"parameter_alignment": True, "round_robin_gradients": True},
    },
    # Elastic checkpoints keep per-group state without padding and no hyperparameters.
    "z2_fp32_elastic": {"stage": 2, "dtype": "fp32", "zero": {"elastic_checkpoint": True}, "no_param_groups": True},
    "z3_fp32_sub_groups": {
        "stage": 3,
        "dtype": "fp32",
        "zero": {"sub_group_size": 40},
    },  # several flat groups per param group
}
"""The configurations trained; every one has tied, frozen and two groups of parameters."""

STEPS = 2
TAG = f"global_step{STEPS}"


class Net(torch.nn.Module):
    """Embedding tied to the output head, a frozen layer, a buffer; 115 trainable elements."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.mid = torch.nn.Linear(6, 7)
        self.frozen = torch.nn.Linear(7, 6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight  # tied: DeepSpeed records shared_params
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        h = torch.relu(self.mid(h))
        h = self.frozen(h) * self.scale.to(h.dtype)
        return self.head(h)


def _config(case: dict[str, Any], universal: bool = False) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": case["stage"], **case.get("zero", {})},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if case["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
        if "grad_accum_dtype" in case:
            cfg["data_types"] = {"grad_accum_dtype": case["grad_accum_dtype"]}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def engine_for(case: dict[str, Any], seed: int, universal: bool = False):
    """A fresh engine for ``case``: AdamW with two parameter groups (different lr and decay)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_RANK", str(torch.distributed.get_rank()))
    import deepspeed

    # DeepSpeed's CPU backend JIT-compiles a shared-memory kernel that only its inference
    # all-reduce uses (minutes of C++ on a fresh machine); training and checkpoints never touch it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(seed)
    model = Net()
    decay = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and not n.endswith("weight")]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 2e-2}]
    optimizer = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.99))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=_config(case, universal))
    return engine


def train(engine, steps: int, seed: int) -> None:
    """``steps`` optimizer steps on the same batches on every rank (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, 11, (2, 3), generator=gen)
        loss = engine(idx).float().pow(2).mean()
        engine.backward(loss)
        engine.step()


def full_state(engine) -> dict[str, dict[str, torch.Tensor]]:
    """The engine's own view of every parameter: fp32 master weights and Adam state, gathered."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if hasattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state"):
        engine.optimizer._hp_optimizer_states_linked = False  # may have been linked before the first step
        engine.optimizer._lazy_init_hp_params_optimizer_state()  # links each parameter's optimizer-state views
    out: dict[str, dict[str, torch.Tensor]] = {}
    for n, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        out[n] = {
            "fp32": safe_get_full_fp32_param(p).detach().clone(),
            "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").detach().clone(),
            "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").detach().clone(),
        }
    return out


def module_state(engine) -> dict[str, torch.Tensor]:
    """Frozen parameters and buffers as the engine holds them (ZeRO-3: gathered)."""
    import deepspeed

    out = {}
    frozen = [p for p in engine.module.parameters() if not p.requires_grad]
    with deepspeed.zero.GatheredParameters(frozen, enabled=hasattr(frozen[0], "ds_id")):
        for n, p in engine.module.named_parameters():
            if not p.requires_grad:
                out[n] = p.detach().clone()
    for n, b in engine.module.named_buffers():
        out[n] = b.detach().clone()
    return out


def save_cases(rank: int, world: int, root: str, names: list[str]) -> dict[str, Any]:
    """Train and save every case in ``names`` under ``root/<name>``; the engines' own states."""
    out = {}
    for name in names:
        engine = engine_for(CASES[name], seed=0)
        train(engine, STEPS, seed=1)
        engine.save_checkpoint(os.path.join(root, name), tag=TAG)
        step = {int(k) for k in _steps(engine)}
        out[name] = {"params": full_state(engine), "module": module_state(engine), "steps": step}
        del engine
    return out


def _steps(engine) -> list[float]:
    opt = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer
    return [float(s["step"]) for s in opt.state.values() if "step" in s]


def resume_cases(rank: int, world: int, jobs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """For each ``(case, load_dir)``: a fresh engine (other initial weights) resumes from the
    universal checkpoint in ``load_dir``, then trains one more step; its states before and after."""
    out = []
    for name, load_dir in jobs:
        engine = engine_for(CASES[name], seed=99, universal=True)
        engine.load_checkpoint(load_dir)
        loaded = full_state(engine)
        groups = [
            {k: v for k, v in g.items() if k in ("lr", "weight_decay", "betas", "eps")}
            for g in engine.optimizer.param_groups
        ]
        train(engine, 1, seed=2)
        out.append(
            {
                "loaded": loaded,
                "groups": groups,
                "steps": sorted(set(_steps(engine))),
                "stepped": full_state(engine),
                "global_steps": engine.global_steps,
            }
        )
        del engine
    return out


def continue_cases(rank: int, world: int, root: str, names: list[str]) -> dict[str, Any]:
    """Each case trained as in :func:`save_cases`, then one more step (the uninterrupted run)."""
    out = {}
    for name in names:
        engine = engine_for(CASES[name], seed=0)
        train(engine, STEPS, seed=1)
        train(engine, 1, seed=2)
        out[name] = full_state(engine)
        del engine
    return out
