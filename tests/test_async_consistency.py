"""An async save commits exactly the state at the call, or fails loudly on every rank.

Real training loops (AdamW on an MLP and on a small transformer; 1 and 2 gloo ranks) save
asynchronously and change the state right after the call returns, the way loops ported from
``torch.distributed.checkpoint`` do: raw ``state_dict()``s through ``async_save`` and through
the manager, the adapters, and each mutation the adapters' gate does not see (an EMA update,
a manual ``no_grad`` update, ``p.data`` writes, ``load_state_dict``), plus gradient
accumulation, foreach/fused optimizers and an LR scheduler.

A trial passes if the committed checkpoint equals, bit for bit, a clone of the state taken at
the call, or the save raised :class:`tessera.StagingMutationError` (on every rank). Half the
trials delay the background copy (a sleep before the real copy, in the copy thread), so that
a mutation nothing holds back lands before the copy every time instead of by chance.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tessera
from tessera.engine.flat_state import flatten
from tessera.engine.saving import staging as stage
from tessera.format.dtypes import dtype_from_name
from tests.dist_utils import run_distributed

TRIALS = 6
DELAY_S = 0.05


class _Delay:
    """Delays every staging copy made outside the main thread (the background copy) while on."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._real = stage.StagingBuffer.stage

    def install(self) -> None:
        real = self._real
        delay = self

        def slow(buf: Any, sources: Any, *, copy: bool, after: Any = None, **kwargs: Any) -> Any:
            if delay.seconds and threading.current_thread() is not threading.main_thread():
                time.sleep(delay.seconds)
            return real(buf, sources, copy=copy, after=after, **kwargs)

        stage.StagingBuffer.stage = slow  # type: ignore[method-assign]

    def remove(self) -> None:
        stage.StagingBuffer.stage = self._real  # type: ignore[method-assign]


@pytest.fixture
def delay():
    d = _Delay()
    d.install()
    yield d
    d.remove()


# --------------------------------------------------------------------------------------
# Models and loops


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 8))


class _TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.block = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, 50)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(x)))


def _batch(kind: str, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 50, (4, 6), generator=g) if kind == "transformer" else torch.randn(8, 32, generator=g)


def _loss(model: nn.Module, kind: str, step: int) -> torch.Tensor:
    return model(_batch(kind, step)).float().square().mean()


class _EMA:
    """An EMA of a model's parameters that holds its updates while a save copies it (the public gate)."""

    def __init__(self, model: nn.Module) -> None:
        self.shadow = {k: v.detach().clone() for k, v in model.named_parameters()}
        self.gate = tessera.StagingGate()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.shadow

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        for k, v in sd.items():
            self.shadow[k].copy_(v)

    def hold_mutations(self, pending: tessera.PendingSave) -> None:
        self.gate.hold(pending)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.gate.wait()
        for k, p in model.named_parameters():
            self.shadow[k].mul_(0.9).add_(p.detach(), alpha=0.1)


@dataclass
class Loop:
    model: nn.Module
    opt: torch.optim.Optimizer
    kind: str
    ema_model: nn.Module
    ema: _EMA
    sched: torch.optim.lr_scheduler.LRScheduler
    extra: torch.Tensor

    def train_step(self, step: int, accumulate: int = 1) -> None:
        for micro in range(accumulate):
            _loss(self.model, self.kind, step * 10 + micro).backward()
        self.opt.step()
        self.opt.zero_grad()


def _loop(kind: str, optim_kw: dict[str, Any], seed: int = 0, ddp: bool = False) -> Loop:
    torch.manual_seed(seed)
    model = _TinyTransformer() if kind == "transformer" else _mlp()
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **optim_kw)
    inner = model.module if ddp else model
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return Loop(model, opt, kind, copy.deepcopy(inner), _EMA(inner), sched, torch.arange(4096.0))


# --------------------------------------------------------------------------------------
# What is saved, and what happens right after the call


def _raw(lp: Loop) -> dict[str, Any]:
    return {"model": lp.model.state_dict(), "optim": lp.opt.state_dict(), "step": 3}


def _wrapped(lp: Loop) -> dict[str, Any]:
    return {"model": tessera.ModelState(lp.model), "optim": tessera.OptimizerState(lp.model, lp.opt), "step": 3}


def _with_ema_model(lp: Loop) -> dict[str, Any]:
    return {**_wrapped(lp), "ema": tessera.ModelState(lp.ema_model)}


def _with_gated_ema(lp: Loop) -> dict[str, Any]:
    return {**_wrapped(lp), "ema": lp.ema}


def _with_sched(lp: Loop) -> dict[str, Any]:
    return {**_wrapped(lp), "sched": lp.sched.state_dict()}


def _with_raw_extra(lp: Loop) -> dict[str, Any]:
    return {**_wrapped(lp), "extra": {"counts": lp.extra}}


def _extra_then_step(lp: Loop) -> None:
    lp.extra.mul_(3)
    lp.train_step(100)


def _step(lp: Loop) -> None:
    lp.train_step(100)


def _accumulate_then_step(lp: Loop) -> None:
    lp.train_step(100, accumulate=3)


@torch.no_grad()
def _ema_update(lp: Loop) -> None:
    for pe, p in zip(lp.ema_model.parameters(), lp.model.parameters()):
        pe.mul_(0.5).add_(p, alpha=0.5)


def _gated_ema_update(lp: Loop) -> None:
    lp.ema.update(lp.model)
    lp.train_step(100)


@torch.no_grad()
def _manual_no_grad(lp: Loop) -> None:
    for p in lp.model.parameters():
        p.add_(0.25)


def _data_write(lp: Loop) -> None:
    for p in lp.model.parameters():
        p.data.mul_(0.5)


def _load_state_dict(lp: Loop) -> None:
    other = copy.deepcopy(lp.model.state_dict())
    for v in other.values():
        v.add_(1)
    lp.model.load_state_dict(other)


def _sched_then_step(lp: Loop) -> None:
    lp.sched.step()
    lp.train_step(100)


Case = tuple[str, dict[str, Any], Callable[[Loop], dict[str, Any]], Callable[[Loop], None]]

CASES: dict[str, Case] = {
    "raw-mlp-step": ("mlp", {}, _raw, _step),
    "raw-transformer-step": ("transformer", {}, _raw, _step),
    "raw-foreach-step": ("mlp", {"foreach": True}, _raw, _step),
    "raw-fused-step": ("mlp", {"fused": True}, _raw, _step),
    "raw-no-grad-update": ("mlp", {}, _raw, _manual_no_grad),
    "raw-data-write": ("mlp", {}, _raw, _data_write),
    "raw-load-state-dict": ("transformer", {}, _raw, _load_state_dict),
    "wrapped-step": ("transformer", {}, _wrapped, _step),
    "wrapped-accumulate": ("mlp", {}, _wrapped, _accumulate_then_step),
    "wrapped-fused": ("mlp", {"fused": True}, _wrapped, _step),
    "wrapped-foreach": ("transformer", {"foreach": True}, _wrapped, _step),
    "wrapped-sched": ("mlp", {}, _with_sched, _sched_then_step),
    "wrapped-load-state-dict": ("mlp", {}, _wrapped, _load_state_dict),
    "wrapped-no-grad-update": ("mlp", {}, _wrapped, _manual_no_grad),
    "wrapped-data-write": ("transformer", {}, _wrapped, _data_write),
    "wrapped-ema-model-update": ("mlp", {}, _with_ema_model, _ema_update),
    "gated-ema-update": ("mlp", {}, _with_gated_ema, _gated_ema_update),
    "gated-plus-raw-tensor": ("mlp", {}, _with_raw_extra, _extra_then_step),
}
"""name -> (model, optimizer options, what is saved, what the loop does right after the call)."""


def _must_commit(name: str) -> bool:
    """Cases the defaults must commit, never refuse: raw state is copied before the call returns,
    and the gate holds the optimizer step, the forward pass, ``load_state_dict`` and a gated EMA."""
    return name.startswith("raw-") or name in {
        "wrapped-step",
        "wrapped-accumulate",
        "wrapped-fused",
        "wrapped-foreach",
        "wrapped-sched",
        "wrapped-load-state-dict",
        "gated-ema-update",
        "gated-plus-raw-tensor",
    }


# --------------------------------------------------------------------------------------
# The check of one trial


def _snapshot(state: dict[str, Any]) -> dict[str, Any]:
    flat = flatten(state)
    out: dict[str, Any] = {p.fqn: p.data.clone() for p in flat.tensors}
    out.update({k: copy.deepcopy(v) for k, v in flat.values.items()})
    return out


def _committed(path: str) -> dict[str, torch.Tensor]:
    manifest = tessera.read_manifest(path)
    target: dict[str, Any] = {
        fqn: torch.empty(e.shape, dtype=dtype_from_name(e.dtype)) for fqn, e in manifest.tensors.items()
    }
    tessera.load(path, target, strict=False)
    return target


def _mixed(path: str, want: dict[str, Any]) -> list[str]:
    """Names of tensors whose committed bytes differ from the state at the call."""
    got = _committed(path)
    tensors = {k for k, v in want.items() if isinstance(v, torch.Tensor)}
    assert set(got) == tensors, sorted(set(got) ^ tensors)
    return [k for k in sorted(tensors) if not torch.equal(got[k], want[k])]


def _trial(
    name: str, path: str, *, manager_root: str | None = None, seed: int = 0, ddp: bool = False
) -> tuple[str, list[str]]:
    """One trial: train, save at the call, mutate at once, train on; ('committed'|'refused', mixed names)."""
    kind, optim_kw, saved, after = CASES[name]
    lp = _loop(kind, optim_kw, seed, ddp)
    for step in range(2):
        lp.train_step(step)
    state = saved(lp)
    want = _snapshot(state)
    mgr = tessera.CheckpointManager(manager_root, async_save=True) if manager_root else None
    try:
        if mgr is not None:
            pending = mgr.save(3, state)
            path = mgr.step_url(3)
        else:
            pending = tessera.async_save(path, state)
        after(lp)  # right after the call returns
        lp.train_step(7)
        assert isinstance(pending, tessera.PendingSave)
        try:
            pending.wait()
        except tessera.StagingMutationError:
            return "refused", []
    finally:
        if mgr is not None:
            try:
                mgr.close()
            except tessera.StagingMutationError:
                pass
    return "committed", _mixed(path, want)


@pytest.mark.parametrize("name", sorted(CASES))
def test_async_save_commits_the_state_at_the_call_or_refuses(tmp_path: Path, delay: _Delay, name: str) -> None:
    outcomes = []
    for trial in range(TRIALS):
        delay.seconds = DELAY_S if trial % 2 else 0.0
        outcome, mixed = _trial(name, str(tmp_path / f"t{trial}"), seed=trial)
        assert not mixed, f"{name}, trial {trial}: committed a mix; tensors from after the call: {mixed}"
        outcomes.append(outcome)
    if _must_commit(name):
        assert outcomes == ["committed"] * TRIALS, outcomes
    if name in ("wrapped-no-grad-update", "wrapped-data-write", "wrapped-ema-model-update"):
        # The gate does not hold these; with the copy delayed, the check must have refused.
        assert all(o == "refused" for o in outcomes[1::2]), outcomes


@pytest.mark.parametrize("name", ["raw-mlp-step", "raw-transformer-step", "wrapped-step", "raw-load-state-dict"])
def test_manager_async_save_commits_the_state_at_the_call(tmp_path: Path, delay: _Delay, name: str) -> None:
    for trial in range(TRIALS // 2):
        delay.seconds = DELAY_S
        outcome, mixed = _trial(name, "", manager_root=str(tmp_path / f"run{trial}"), seed=trial)
        assert outcome == "committed" and not mixed, (trial, outcome, mixed)


def test_background_opt_in_refuses_a_raw_mix(tmp_path: Path, delay: _Delay, monkeypatch) -> None:
    # The explicit opt-in copies raw tensors in the background: the loop's step races the
    # copy, and the default check turns every race into a refusal instead of a mix.
    monkeypatch.setenv("TESSERA_STAGING", "background")
    delay.seconds = 0.5  # longer than a step, even on a loaded machine
    outcomes = [_trial("raw-mlp-step", str(tmp_path / f"t{i}"), seed=i) for i in range(3)]
    assert outcomes == [("refused", [])] * 3


def test_the_default_check_sees_a_data_write_with_the_version_counter_blind(tmp_path: Path, delay: _Delay) -> None:
    delay.seconds = DELAY_S
    w = torch.arange(1000, dtype=torch.float32)
    opts = tessera.SaveOptions(staging=tessera.StagingMode.BACKGROUND)
    pending = tessera.async_save(str(tmp_path / "a"), {"w": w}, options=opts)
    w.data.mul_(2)  # .data has its own version counter: only the sampled bytes see this
    with pytest.raises(tessera.StagingMutationError, match=r"tensor 'w'.*alias"):
        pending.wait()
    assert not (tmp_path / "a" / "manifest.json").exists()


def test_check_off_lets_the_opt_in_mix(tmp_path: Path, delay: _Delay, monkeypatch) -> None:
    # The control for the tests above: the harness really does produce a mix when nothing guards.
    monkeypatch.setenv("TESSERA_STAGING", "background")
    monkeypatch.setenv("TESSERA_CHECK_STAGING", "off")
    delay.seconds = 0.5
    outcome, mixed = _trial("raw-mlp-step", str(tmp_path / "t"))
    assert outcome == "committed" and mixed


# --------------------------------------------------------------------------------------
# Two gloo ranks (DDP)


def _dist_trials(rank: int, world: int, root: str, names: list[str]) -> dict[str, list[str]]:
    d = _Delay()
    d.install()
    out: dict[str, list[str]] = {}
    for name in names:
        for trial in range(3):
            d.seconds = DELAY_S if trial % 2 == 0 else 0.0
            outcome, mixed = _trial(name, os.path.join(root, f"{name}-{trial}"), seed=trial, ddp=True)
            out.setdefault(name, []).append(outcome if not mixed else f"MIXED {mixed}")
    return out


def test_two_ranks_ddp_commit_the_state_at_the_call_or_refuse_everywhere(tmp_path: Path) -> None:
    names = ["raw-mlp-step", "raw-transformer-step", "wrapped-step", "wrapped-no-grad-update", "raw-data-write"]
    per_rank = run_distributed(_dist_trials, 2, str(tmp_path), names)
    assert per_rank[0] == per_rank[1], per_rank  # the same outcome on every rank
    for name, outcomes in per_rank[0].items():
        assert all(o in ("committed", "refused") for o in outcomes), (name, outcomes)
        if _must_commit(name):
            assert outcomes == ["committed"] * 3, (name, outcomes)


def test_auto_copies_raw_tensors_in_the_call_and_gated_ones_behind(tmp_path: Path, delay: _Delay) -> None:
    delay.seconds = 0.3
    lp = _loop("mlp", {})
    gated = tessera.async_save(str(tmp_path / "g"), _with_raw_extra(lp))
    assert not gated.staged() and "schedule" in gated.stall_parts and gated.stall_s < 0.3  # the fast path
    gated.wait()
    raw = tessera.async_save(str(tmp_path / "r"), _raw(lp))
    assert raw.staged() and "stage" in raw.stall_parts  # copied before returning, as DCP does
    raw.wait()
