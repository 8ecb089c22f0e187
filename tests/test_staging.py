"""Staging overlapped with compute: the gate (wait_staged), its automatic installs, the debug
check, and stall figures that count every wait (issue #13, items 1 and 2).

Several tests slow the background copy down on purpose (:func:`_slow_copies`: a sleep before
the real copy), so that a mutation the gate fails to hold back would land inside the copy
every time instead of by chance; the copy itself is the real one.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

import tessera
from tessera.engine import saving
from tessera.engine.saving import cache, finish
from tessera.engine.saving import staging as stage
from tessera.tools.trace import blocked_seconds, rank_timings
from tests.dist_utils import run_distributed

DELAY_S = 0.2


def _slow_copies(delay: float = DELAY_S) -> None:
    """Make every staging copy of this process start ``delay`` seconds late (in the copy thread)."""
    real = stage.StagingBuffer.stage

    def slow(self, sources, *, copy, after=None, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(delay)
        return real(self, sources, copy=copy, after=after, **kwargs)

    stage.StagingBuffer.stage = slow  # type: ignore[method-assign]


@pytest.fixture
def slow_copies():
    real = stage.StagingBuffer.stage
    _slow_copies()
    yield
    stage.StagingBuffer.stage = real  # type: ignore[method-assign]


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            for key, val in opt.state.get(p, {}).items():
                if isinstance(val, torch.Tensor):
                    out[f"optim.{names[id(p)]}.{key}"] = val.detach().clone()
    return out


def _net(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_and_save(root: str, steps: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """A loop that saves asynchronously every step and never calls wait_staged itself."""
    model, opt = _net(seed)
    state = {"model": tessera.ModelState(model), "optim": tessera.OptimizerState(model, opt)}
    snapshots = []
    pending = None
    for step in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()  # forward updates batch norm's running stats (gated)
        opt.step()  # mutates parameters and optimizer state in place (gated)
        opt.zero_grad()
        snapshots.append(_snapshot(model, opt))
        pending = tessera.async_save(os.path.join(root, f"s{step}"), {**state, "step": step})
        assert not pending.staged()  # the copy is still running (slowed down)
    assert pending is not None
    pending.wait()
    return snapshots


def _check_loaded(root: str, snapshots: list[dict[str, torch.Tensor]], seed: int = 0) -> None:
    for step, want in enumerate(snapshots):
        model, opt = _net(seed + 1000)  # different values: everything must come from the checkpoint
        # A fresh AdamW has no state yet; OptimizerState.prepare_load creates it from the checkpoint.
        target = {"model": tessera.ModelState(model), "optim": tessera.OptimizerState(model, opt), "step": None}
        tessera.load(os.path.join(root, f"s{step}"), target)
        assert target["step"] == step
        got = _snapshot(model, opt)
        assert got.keys() == want.keys(), (step, sorted(set(got) ^ set(want)))
        for k in want:
            assert torch.equal(got[k], want[k]), (step, k)


# --------------------------------------------------------------------------------------
# The gate


@pytest.mark.parametrize("staging", list(tessera.StagingMode))
def test_mutations_after_the_gate_never_reach_the_checkpoint(tmp_path: Path, slow_copies, staging) -> None:
    w = torch.arange(4096, dtype=torch.float32)
    b = torch.arange(10, dtype=torch.int64)
    opts = tessera.SaveOptions(staging=staging)
    for step in range(3):
        w.add_(step)
        want = (w.clone(), b.clone())
        pending = tessera.async_save(str(tmp_path / f"s{step}"), {"w": w, "b": b[::2]}, options=opts)
        # AUTO copies raw tensors before returning, as BLOCKING does; only BACKGROUND defers it.
        assert pending.staged() is (staging is not tessera.StagingMode.BACKGROUND)
        pending.wait_staged()
        assert pending.staged()
        w.fill_(-1)
        b.mul_(-7)
        pending.wait()
        target = {"w": torch.zeros(4096), "b": torch.zeros(5, dtype=torch.int64)}
        tessera.load(str(tmp_path / f"s{step}"), target)
        assert torch.equal(target["w"], want[0]) and torch.equal(target["b"], want[1][::2])
        w.copy_(want[0])
        b.copy_(want[1])


def test_background_copy_returns_before_staging(tmp_path: Path, slow_copies) -> None:
    opts = tessera.SaveOptions(staging=tessera.StagingMode.BACKGROUND)
    pending = tessera.async_save(str(tmp_path / "a"), {"w": torch.ones(100)}, options=opts)
    assert not pending.staged() and pending.stall_s < DELAY_S  # returned before the (slowed) copy
    assert set(pending.stall_parts) == {"wait_previous", "plan", "schedule"}
    with pytest.raises(TimeoutError):
        pending.wait_staged(timeout=0.001)
    pending.wait_staged()
    assert pending.staged()
    pending.wait()


def test_optimizer_step_and_forward_are_gated(tmp_path: Path, slow_copies) -> None:
    snapshots = _train_and_save(str(tmp_path), steps=4)
    _check_loaded(str(tmp_path), snapshots)


def _mlp() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))  # no buffers
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _forward_backward(model: torch.nn.Module, step: int) -> None:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
    model(x).square().mean().backward()


def test_forward_and_backward_run_during_the_copy_when_the_save_holds_every_parameters_step(
    tmp_path: Path, slow_copies
) -> None:
    """Parameters change only in ``optimizer.step()``: with an OptimizerState over all of them
    in the save, only the step waits; each save's checkpoint is the state at its call."""
    model, opt = _mlp()
    state = {"model": tessera.ModelState(model), "optim": tessera.OptimizerState(model, opt)}
    for step in range(3):  # the hooks are installed once; every save decides afresh
        _forward_backward(model, step)
        opt.step()
        opt.zero_grad()
        want = _snapshot(model, opt)
        pending = tessera.async_save(str(tmp_path / f"s{step}"), state)
        _forward_backward(model, 100 + step)
        assert not pending.staged()  # the forward and backward did not wait for the (slowed) copy
        opt.step()  # waits
        assert pending.staged()
        opt.zero_grad()
        pending.wait()
        got_model, got_opt = _mlp()
        tessera.load(
            str(tmp_path / f"s{step}"),
            {"model": tessera.ModelState(got_model), "optim": tessera.OptimizerState(got_model, got_opt)},
        )
        got = _snapshot(got_model, got_opt)
        assert all(torch.equal(got[k], want[k]) for k in want) and got.keys() == want.keys()


@pytest.mark.parametrize("case", ["buffers", "optimizer not gated", "a parameter the optimizer does not step"])
def test_the_forward_waits_unless_the_save_holds_every_saved_tensors_step(tmp_path: Path, slow_copies, case) -> None:
    if case == "buffers":
        model, opt = _net()  # batch norm: the forward changes its running statistics
        state: dict[str, object] = {"model": tessera.ModelState(model), "optim": tessera.OptimizerState(model, opt)}
    elif case == "optimizer not gated":
        model, opt = _mlp()
        _forward_backward(model, 0)
        opt.step()
        state = {"model": tessera.ModelState(model), "optim": opt.state_dict()}  # copied in the call
    else:
        model, _ = _mlp()
        opt = torch.optim.AdamW(list(model.parameters())[:2], lr=1e-2)
        state = {"model": tessera.ModelState(model), "optim": tessera.OptimizerState(model, opt)}
    pending = tessera.async_save(str(tmp_path / "s"), state)
    assert not pending.staged()
    _forward_backward(model, 1)
    assert pending.staged()  # the forward waited for the copy
    pending.wait()


def test_without_the_gate_the_check_fails_the_save(tmp_path: Path, slow_copies, monkeypatch) -> None:
    # The control for the test above: with the hooks switched off, the same loop changes the
    # state after the call. The default mutation check fails the save; with the check off
    # too, the checkpoint holds state the optimizer changed after the call, so the bit-exact
    # comparison catches it.
    monkeypatch.setattr(tessera.OptimizerState, "hold_mutations", lambda self, pending: None)
    monkeypatch.setattr(tessera.ModelState, "hold_mutations", lambda self, pending: None)
    with pytest.raises(tessera.StagingMutationError, match=r"tensor '(model|optim)\..*' was modified"):
        _train_and_save(str(tmp_path / "checked"), steps=2)
    monkeypatch.setenv("TESSERA_CHECK_STAGING", "off")
    snapshots = _train_and_save(str(tmp_path / "unchecked"), steps=2)
    with pytest.raises(AssertionError):
        _check_loaded(str(tmp_path / "unchecked"), snapshots)


def test_manager_saves_are_gated_and_wait_staged_delegates(tmp_path: Path, slow_copies) -> None:
    model, opt = _net()
    state = {"model": tessera.ModelState(model), "optim": tessera.OptimizerState(model, opt)}
    snapshots = []
    with tessera.CheckpointManager(str(tmp_path / "run"), async_save=True) as mgr:
        for step in range(3):
            model(torch.randn(8, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
            snapshots.append(_snapshot(model, opt))
            pending = mgr.save(step, state)
            assert isinstance(pending, tessera.PendingSave) and not pending.staged()
        pending.wait_staged()
        assert pending.staged()
    for step, want in enumerate(snapshots):
        m2, o2 = _net(7)
        tessera.load(mgr.step_url(step), {"model": tessera.ModelState(m2), "optim": tessera.OptimizerState(m2, o2)})
        got = _snapshot(m2, o2)
        assert all(torch.equal(got[k], want[k]) for k in want), step


# --------------------------------------------------------------------------------------
# The debug check


def test_check_staging_catches_a_mutation_before_the_gate(tmp_path: Path, slow_copies) -> None:
    opts = tessera.SaveOptions(staging=tessera.StagingMode.BACKGROUND, check_staging=True)
    w = torch.zeros(64)
    pending = tessera.async_save(str(tmp_path / "a"), {"w": w, "v": torch.ones(3)}, options=opts)
    w.add_(1)  # the caller's bug: before wait_staged()
    with pytest.raises(tessera.StagingMutationError, match=r"tensor 'w' was modified"):
        pending.wait()
    assert not (tmp_path / "a" / "manifest.json").exists()  # nothing committed


def test_check_staging_catches_a_mutation_the_version_counter_misses(tmp_path: Path, slow_copies) -> None:
    opts = tessera.SaveOptions(staging=tessera.StagingMode.BACKGROUND, check_staging=True)
    w = torch.zeros(64)
    pending = tessera.async_save(str(tmp_path / "a"), {"w": w}, options=opts)
    w.numpy()[3] = 5.0  # no version bump: only the checksum sees it
    with pytest.raises(tessera.StagingMutationError, match="'w'"):
        pending.wait()


def test_check_staging_passes_a_gated_loop_and_the_knob_turns_it_on(tmp_path: Path, slow_copies, monkeypatch) -> None:
    monkeypatch.setenv("TESSERA_CHECK_STAGING", "1")
    assert tessera.SaveOptions().check_staging is tessera.options.StagingCheck.FULL
    snapshots = _train_and_save(str(tmp_path), steps=2)
    _check_loaded(str(tmp_path), snapshots)
    monkeypatch.setenv("TESSERA_STAGING", "sideways")
    with pytest.raises(ValueError, match="TESSERA_STAGING"):
        tessera.SaveOptions()


# --------------------------------------------------------------------------------------
# Honest stall figures


def _slow_writes(monkeypatch, delay: float) -> None:
    real = finish.write_tiles

    def slow(*args, **kwargs):
        time.sleep(delay)
        return real(*args, **kwargs)

    monkeypatch.setattr(finish, "write_tiles", slow)


@pytest.mark.parametrize("staging", list(tessera.StagingMode))
def test_stall_counts_the_wait_for_the_previous_save(tmp_path: Path, monkeypatch, staging) -> None:
    _slow_writes(monkeypatch, 0.4)
    opts = tessera.SaveOptions(staging=staging)
    first = tessera.async_save(str(tmp_path / "a"), {"w": torch.ones(1000)}, options=opts)
    t0 = time.monotonic()
    second = tessera.async_save(str(tmp_path / "b"), {"w": torch.ones(1000)}, options=opts)
    wall = time.monotonic() - t0
    assert first.done() and wall > 0.2  # really blocked by the first save's write
    assert wall * 0.98 <= second.stall_s <= wall  # the whole blocked time, not just this save's own work
    parts = second.stall_parts
    staging_part = "schedule" if staging is tessera.StagingMode.BACKGROUND else "stage"  # raw tensors
    assert set(parts) == {"wait_previous", "plan", staging_part}
    assert parts["wait_previous"] > 0.2 and sum(parts.values()) <= second.stall_s
    second.wait()
    ranks = rank_timings(tessera.read_manifest(str(tmp_path / "b")))
    recorded = tessera.read_manifest(str(tmp_path / "b")).timings["save"]["ranks"]["0"]
    assert recorded["stall"] == pytest.approx(second.stall_s)
    assert recorded["wait_previous"] == pytest.approx(parts["wait_previous"])
    assert blocked_seconds("save", ranks[0]) == pytest.approx(sum(parts.values()))
    if staging is tessera.StagingMode.BACKGROUND:
        assert "copy" in ranks[0].phases  # the background copy, not blocking
        assert blocked_seconds("save", ranks[0]) < ranks[0].total


def test_trace_marks_what_blocked_training(tmp_path: Path, monkeypatch, capsys) -> None:
    from tessera.cli import EXIT_OK, main

    _slow_writes(monkeypatch, 0.3)
    opts = tessera.SaveOptions(staging=tessera.StagingMode.BACKGROUND)
    tessera.async_save(str(tmp_path / "a"), {"w": torch.ones(100)}, options=opts)
    second = tessera.async_save(str(tmp_path / "b"), {"w": torch.ones(100)}, options=opts)
    second.wait()
    capsys.readouterr()
    assert main(["trace", str(tmp_path / "b"), "--op", "save", "--json"]) == EXIT_OK
    rank0 = json.loads(capsys.readouterr().out)["save"]["ranks"][0]
    assert list(rank0["phases"])[:4] == ["wait_previous", "plan", "schedule", "copy"]
    assert rank0["blocked"] == pytest.approx(sum(second.stall_parts.values()))
    assert rank0["blocked"] > 0.2 and rank0["blocked"] < rank0["total"]  # the wait for "a" blocked; the copy did not
    assert main(["trace", str(tmp_path / "b"), "--op", "save"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "wait_previous*" in out and "schedule*" in out and "copy*" not in out


def test_manager_stall_counts_its_own_wait(tmp_path: Path, monkeypatch) -> None:
    _slow_writes(monkeypatch, 0.4)
    with tessera.CheckpointManager(str(tmp_path / "run"), async_save=True) as mgr:
        mgr.save(1, {"w": torch.ones(100)})
        t0 = time.monotonic()
        second = mgr.save(2, {"w": torch.ones(100)})
        wall = time.monotonic() - t0
        assert isinstance(second, tessera.PendingSave)
        assert wall > 0.2 and wall * 0.98 <= second.stall_s <= wall
        assert second.stall_parts["wait_previous"] > 0.2
        # raw tensors: copied before the save returns
        assert set(second.stall_parts) == {"wait_previous", "plan", "stage", "prepare"}
        assert sum(second.stall_parts.values()) == pytest.approx(second.stall_s)


# --------------------------------------------------------------------------------------
# Two gloo ranks


def _dist_gated(rank: int, world: int, root: str) -> list[bool]:
    _slow_copies()
    # rank r owns rows 4r..4r+3 of a global (4*world, 8) weight; the optimizer state follows it.
    w = torch.nn.Parameter(torch.full((4, 8), float(rank)))
    opt = torch.optim.SGD([w], lr=0.5, momentum=0.9)
    out = []
    for step in range(3):
        w.grad = torch.full_like(w, float(step + 1))
        opt.step()
        want = w.detach().clone()
        state = {"w": tessera.ShardedTensor(w.detach(), (4 * world, 8), (4 * rank, 0)), "step": step}
        opts = tessera.SaveOptions(staging=tessera.StagingMode.BACKGROUND)  # raw tensors, opted in
        pending = tessera.async_save(os.path.join(root, f"s{step}"), state, options=opts)
        out.append(pending.staged())
        pending.wait_staged()
        w.data.fill_(-1)  # after the gate
        pending.wait()
        full = {"w": torch.zeros(4 * world, 8), "step": None}
        tessera.load(os.path.join(root, f"s{step}"), full)
        mine = full["w"][4 * rank : 4 * rank + 4]
        assert torch.equal(mine, want) and full["step"] == step, (rank, step)
        w.data.copy_(want)
    return out


def test_two_ranks_mutations_after_the_gate_never_reach_the_checkpoint(tmp_path: Path) -> None:
    assert run_distributed(_dist_gated, 2, str(tmp_path)) == [[False, False, False]] * 2


def _wrapped_mlp(layout: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An MLP with no buffers whose every parameter AdamW steps, wrapped as ``layout``."""
    import torch.distributed as dist

    torch.manual_seed(seed)
    model: torch.nn.Module = torch.nn.Sequential(
        torch.nn.Linear(8, 10), torch.nn.ReLU(), torch.nn.Linear(10, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3)
    )
    if layout == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif layout == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        policy = ModuleWrapPolicy({torch.nn.Linear})
        model = FSDP(
            model, auto_wrap_policy=policy, use_orig_params=layout == "fsdp1_orig", device_id=torch.device("cpu")
        )
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _held(v: object) -> torch.Tensor:
    """The memory a rank holds of a ModelState value, cloned."""
    if isinstance(v, tessera.FlatShard):
        return v.local_1d.clone()
    if isinstance(v, tessera.ShardedTensor):
        return v.local.clone()
    return (v.to_local() if hasattr(v, "to_local") else v).detach().clone()  # type: ignore[union-attr]


def _dist_wrapped_forward_during_copy(rank: int, world: int, root: str, layout: str) -> tuple[bool, bool]:
    """A wrapped model with no buffers, all of it stepped by the saved optimizer: its forward
    (FSDP gathers and frees parameters, FSDP1 swaps flat parameters' ``.data``) runs while the
    copy is slowed. Returns (staged after forward and backward, checkpoint == the state at the call)."""
    _slow_copies()
    model, opt = _wrapped_mlp(layout, seed=0)

    def forward_backward(step: int) -> None:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).square().mean().backward()

    forward_backward(0)
    opt.step()
    opt.zero_grad()
    state = {"model": tessera.ModelState(model), "optim": tessera.OptimizerState(model, opt)}
    want = {k: _held(v) for k, v in tessera.ModelState(model).state_dict().items()}
    pending = tessera.async_save(os.path.join(root, layout), state)
    forward_backward(1)
    during = not pending.staged()
    opt.step()
    opt.zero_grad()
    pending.wait()
    model2, _ = _wrapped_mlp(layout, seed=1)
    tessera.load(os.path.join(root, layout), {"model": tessera.ModelState(model2)}, strict=False)
    got = {k: _held(v) for k, v in tessera.ModelState(model2).state_dict().items()}
    return during, got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("layout", ["ddp", "fsdp1", "fsdp1_orig", "fsdp2"])
def test_two_ranks_wrapped_models_train_during_the_copy_and_commit_the_call(tmp_path: Path, layout: str) -> None:
    out = run_distributed(_dist_wrapped_forward_during_copy, 2, str(tmp_path), layout)
    assert out == [(True, True)] * 2, out  # the forward ran during the copy; the checkpoint is the call


def _dist_optimizer_loop(rank: int, world: int, root: str) -> bool:
    _slow_copies()
    snapshots = _train_and_save(root, steps=3)  # a replicated model: same seed on both ranks
    _check_loaded(root, snapshots)
    return True


def test_two_ranks_optimizer_steps_are_gated(tmp_path: Path) -> None:
    assert run_distributed(_dist_optimizer_loop, 2, str(tmp_path)) == [True, True]


def _dist_unchecked_mutation(rank: int, world: int, root: str) -> str:
    _slow_copies()
    w = torch.zeros(4, 8)
    state = {"w": tessera.ShardedTensor(w, (4 * world, 8), (4 * rank, 0))}
    opts = tessera.SaveOptions(staging=tessera.StagingMode.BACKGROUND)  # the default check
    pending = tessera.async_save(os.path.join(root, "a"), state, options=opts)
    if rank == 1:
        w.add_(1)  # rank 1's bug
    try:
        pending.wait()
    except tessera.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_two_ranks_check_staging_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    out = run_distributed(_dist_unchecked_mutation, 2, str(tmp_path))
    assert out[1].startswith("StagingMutationError") and "'w'" in out[1], out
    assert "rank 1" in out[0] and "'w'" in out[0], out
    assert not (tmp_path / "a" / "manifest.json").exists()


# --------------------------------------------------------------------------------------
# CUDA: side stream into reused pinned memory, ordered by events


@pytest.mark.cuda
def test_cuda_background_copy_is_ordered_after_queued_work(tmp_path: Path, slow_copies) -> None:
    w = torch.zeros(1 << 20, device="cuda")
    for step in range(3):
        big = torch.randn(2048, 2048, device="cuda")
        for _ in range(5):
            big = big @ big / 2048  # queue work on the training stream, then a write into w after it
        w.fill_(float(step + 1)).add_(big.sum() * 0)
        opts = tessera.SaveOptions(staging=tessera.StagingMode.BACKGROUND)  # a raw tensor, opted in
        pending = tessera.async_save(str(tmp_path / f"s{step}"), {"w": w}, options=opts)
        assert not pending.staged()
        pending.wait_staged()
        w.fill_(-1)  # after the gate
        pending.wait()
        target = {"w": torch.zeros(1 << 20)}
        tessera.load(str(tmp_path / f"s{step}"), target)
        assert torch.equal(target["w"], torch.full((1 << 20,), float(step + 1)))
    assert cache.cache_for(None).staging.nbytes >= w.numel() * 4


@pytest.mark.cuda
def test_cuda_optimizer_steps_are_gated(tmp_path: Path, slow_copies) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256).cuda()
    opt = torch.optim.Adam(model.parameters())
    state = {"model": tessera.ModelState(model), "optim": tessera.OptimizerState(model, opt)}
    snaps = []
    for step in range(3):
        model(torch.randn(4, 256, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
        snaps.append({k: v.detach().cpu().clone() for k, v in model.state_dict().items()})
        tessera.async_save(str(tmp_path / f"s{step}"), state)
    saving.wait_pending()
    for step, want in enumerate(snaps):
        m2 = torch.nn.Linear(256, 256)
        tessera.load(str(tmp_path / f"s{step}"), {"model": tessera.ModelState(m2)}, strict=False)
        assert all(torch.equal(m2.state_dict()[k], want[k]) for k in want), step
