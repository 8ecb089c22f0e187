"""Async saves in a host-memory budget (``SaveOptions(max_staging_bytes=...)``).

Attacked as loops use them: the consistency trials of ``test_async_consistency.py`` rerun
under a budget far smaller than the state (every mutation idiom, with the copies delayed so
that a race lands); a state 10x and more the budget with the buffers in use counted; a
mutation right after the gate opens; a write failing half-way (the gate must open, the save
fail on every rank, the previous checkpoint stay); a process killed in the middle; 2 ranks
through the manager.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tessera
from tessera.engine.saving import cache
from tessera.engine.saving import window as win
from tessera.storage import FileStorage
from tests import test_async_consistency as consistency
from tests.dist_utils import run_distributed, start

BUDGET = 64 << 10


@pytest.fixture
def slow_window(monkeypatch: pytest.MonkeyPatch):
    """Slow the copies through the window: no piece is copied before ``seconds`` after
    ``tessera.async_save`` returned (the copy starts late, as in a loaded job, so a mutation
    made right after the call races it every time), and each piece takes ``each`` longer."""
    real = win.Window._copy
    state = {"seconds": 0.0, "each": 0.0, "pieces": 0}
    returned = threading.Event()
    real_async_save = tessera.async_save

    def async_save(*args: Any, **kwargs: Any) -> tessera.PendingSave:
        returned.clear()
        try:
            return real_async_save(*args, **kwargs)
        finally:
            returned.set()

    def slow(self: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        if state["seconds"]:
            if "_not_before" not in self.__dict__:
                # a call that waits for its copies (raw tensors under a budget) never returns first
                returned.wait(state["seconds"])
                self.__dict__.setdefault("_not_before", time.monotonic() + state["seconds"])
            time.sleep(max(0.0, self._not_before - time.monotonic()))
        if state["each"]:
            time.sleep(state["each"])
        state["pieces"] += 1
        real(self, dst, src)

    monkeypatch.setattr(tessera, "async_save", async_save)
    monkeypatch.setattr(win.Window, "_copy", slow)
    return state


@pytest.mark.parametrize("name", sorted(consistency.CASES))
def test_every_mutation_idiom_under_a_budget_commits_the_call_or_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slow_window: dict[str, float], name: str
) -> None:
    """The trials of the unbudgeted path, with the state (33 to 140 KB) streamed through 4 KiB."""
    monkeypatch.setenv("TESSERA_MAX_STAGING_BYTES", "4096")
    outcomes = []
    for trial in range(4):
        slow_window["seconds"] = consistency.DELAY_S if trial % 2 else 0.0
        slow_window["pieces"] = 0
        outcome, mixed = consistency._trial(name, str(tmp_path / f"t{trial}"), seed=trial)
        if not name.startswith("raw-"):  # raw state dicts are copied in the call, budget or not
            assert slow_window["pieces"] > 8 or outcome == "refused", slow_window  # the window was used
        assert not mixed, f"{name}, trial {trial}: committed a mix; tensors from after the call: {mixed}"
        outcomes.append(outcome)
    if consistency._must_commit(name):
        assert outcomes == ["committed"] * 4, outcomes
    if name in ("wrapped-no-grad-update", "wrapped-data-write", "wrapped-ema-model-update"):
        assert all(o == "refused" for o in outcomes[1::2]), outcomes


class _Counted(win.WindowBuffers):
    """Counts the buffer bytes held at once."""

    def __init__(self) -> None:
        super().__init__()
        self.held = 0
        self.peak = 0
        self._count = threading.Lock()

    def take(self, nbytes: int, pin: bool) -> torch.Tensor:
        with self._count:
            self.held += nbytes
            self.peak = max(self.peak, self.held)
        return super().take(nbytes, pin)

    def give(self, buf: torch.Tensor) -> None:
        with self._count:
            self.held -= buf.numel()
        super().give(buf)


def _model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])  # 1.5 MiB of parameters
    opt = torch.optim.AdamW(model.parameters())
    return model, opt


def _train(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    torch.manual_seed(1000 + step)
    model(torch.randn(4, 256)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for name, p in model.named_parameters():
        for k, v in opt.state[p].items():
            out[f"optim.state.{name}.{k}"] = v.clone()
    return out


def _committed_equals(path: str, want: dict[str, torch.Tensor]) -> None:
    manifest = tessera.read_manifest(path)
    got = {k: torch.empty(manifest.tensors[k].shape, dtype=want[k].dtype) for k in want}
    tessera.load(path, got, strict=False)
    different = [k for k in want if not torch.equal(got[k], want[k])]
    assert not different, different


def test_a_state_ten_times_the_budget_holds_only_the_budget_and_commits_the_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4.5 MiB of model and AdamW state through 256 KiB; the loop steps right after the gate opens."""
    counted = _Counted()
    monkeypatch.setattr(cache, "WindowBuffers", lambda: counted)
    monkeypatch.setattr(cache, "_CACHES", {})  # a fresh cache takes the counted buffers
    model, opt = _model()
    _train(model, opt, 0)
    state = {"model": tessera.ModelState(model), "optim": tessera.OptimizerState(model, opt)}
    want = _snapshot(model, opt)
    budget = 256 << 10
    nbytes = sum(v.numel() * v.element_size() for v in want.values())
    assert nbytes > 10 * budget
    pending = tessera.async_save(str(tmp_path / "c"), state, options=tessera.SaveOptions(max_staging_bytes=budget))
    _train(model, opt, 1)  # held by OptimizerState until the last byte left the state
    pending.wait()
    assert 0 < counted.peak <= budget, counted.peak
    assert counted.held == 0
    _committed_equals(str(tmp_path / "c"), want)
    assert tessera.verify(str(tmp_path / "c")).ok


def _tensors(prefix: str, tree: object) -> dict[str, torch.Tensor]:
    """Clones of the tensors in a nested dict, by tessera's dotted names."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree.detach().clone()}
    if isinstance(tree, dict):
        out: dict[str, torch.Tensor] = {}
        for k, v in tree.items():
            out |= _tensors(f"{prefix}.{k}" if prefix else str(k), v)
        return out
    return {}


@pytest.mark.parametrize(
    "idiom", ["raw state_dicts (AUTO)", "StagingMode.BLOCKING", "gated and raw together", "sync save, strided tensors"]
)
def test_what_nothing_holds_back_streams_through_the_budget_and_the_call_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, idiom: str
) -> None:
    """The DCP idiom (``async_save(path, {"model": model.state_dict(), ...})``), ``BLOCKING``, and
    a sync save that must copy (strided tensors here, device tensors on a GPU) keep the budget
    too: no full host copy; the call returns once the bytes have left the state, so the loop
    may change it at once."""
    counted = _Counted()
    monkeypatch.setattr(cache, "WindowBuffers", lambda: counted)
    monkeypatch.setattr(cache, "_CACHES", {})
    model, opt = _model()
    _train(model, opt, 0)
    want = _snapshot(model, opt)
    raw = {"model": model.state_dict(), "optim": opt.state_dict()}
    gated = {"model": tessera.ModelState(model), "optim": tessera.OptimizerState(model, opt)}
    budget = 256 << 10
    opts = tessera.SaveOptions(max_staging_bytes=budget)
    path = str(tmp_path / "c")
    if idiom == "sync save, strided tensors":
        strided = {k: v.t() if v.dim() == 2 else v for k, v in want.items()}
        tessera.save(path, strided, options=opts)
        want = strided
    else:
        if idiom == "StagingMode.BLOCKING":
            state, opts = gated, tessera.SaveOptions(max_staging_bytes=budget, staging=tessera.StagingMode.BLOCKING)
        elif idiom == "gated and raw together":
            state = {"model": tessera.ModelState(model), "optim": opt.state_dict()}
            want = {k: v for k, v in want.items() if k.startswith("model.")} | _tensors("optim", state["optim"])
        else:
            state = raw
            want = _tensors("", raw)
        pending = tessera.async_save(path, state, options=opts)
        assert pending.staged()  # every byte left the state before the call returned
        assert pending.stall_parts["copy"] > 0
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-3)  # right after the call, not through any gate
        for st in opt.state.values():
            st["exp_avg"].zero_()
        pending.wait()
    assert 0 < counted.peak <= budget and counted.held == 0, (counted.peak, counted.held)
    assert cache.cache_for(None).staging.nbytes == 0  # no full host copy was made
    if idiom == "sync save, strided tensors":
        manifest = tessera.read_manifest(path)
        got = {k: torch.empty(manifest.tensors[k].shape, dtype=want[k].dtype) for k in want}
        tessera.load(path, got)
        assert all(torch.equal(got[k], want[k]) for k in want)
    else:
        _committed_equals(path, want)


class _FailingFiles(FileStorage):
    """Fails the write of data files after ``after`` pieces have been taken."""

    after = 3

    def write_file(self, path: str, chunks: Any) -> None:
        if "/data/" not in f"/{path}":
            return super().write_file(path, chunks)

        def failing():
            for i, c in enumerate(chunks):
                if i == self.after:
                    raise OSError(28, "No space left on device (injected)")
                yield c

        return super().write_file(path, failing())


def test_a_write_failing_half_way_fails_the_save_opens_the_gate_and_keeps_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "c")
    model, opt = _model()
    _train(model, opt, 0)
    state = {"model": tessera.ModelState(model), "optim": tessera.OptimizerState(model, opt)}
    tessera.save(path, state)
    before = _snapshot(model, opt)
    _train(model, opt, 1)
    opts = tessera.SaveOptions(max_staging_bytes=BUDGET)
    pending = tessera.async_save(path, state, options=opts, storage=_FailingFiles(path))
    stepped = threading.Event()

    def step() -> None:
        _train(model, opt, 2)
        stepped.set()

    threading.Thread(target=step, daemon=True).start()
    assert stepped.wait(30), "the gate stayed closed after the write failed: the training loop hangs"
    with pytest.raises(tessera.errors.StorageError, match="No space left"):
        pending.wait()
    _committed_equals(path, before)
    assert tessera.verify(path).ok
    keep = tessera.read_manifest(path).save_id
    left = [os.path.join(d, f) for d, _, files in os.walk(tmp_path / "c" / "data") for f in files if keep not in d]
    assert not left, left  # the failed save removed what it wrote


def test_a_write_failing_half_way_under_a_budget_returns_the_call_that_waits_for_raw_tensors(tmp_path: Path) -> None:
    """The call waiting for a raw state dict's bytes must not hang when a write fails."""
    path = str(tmp_path / "c")
    model, opt = _model()
    _train(model, opt, 0)
    tessera.save(path, {"model": model.state_dict()})
    before = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    _train(model, opt, 1)
    opts = tessera.SaveOptions(max_staging_bytes=BUDGET)
    result: list[object] = []

    def call() -> None:
        result.append(
            tessera.async_save(path, {"model": model.state_dict()}, options=opts, storage=_FailingFiles(path))
        )

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(30)
    assert result, "async_save never returned after its write failed"
    pending = result[0]
    assert isinstance(pending, tessera.PendingSave)
    with pytest.raises(tessera.errors.StorageError, match="No space left"):
        pending.wait()
    _committed_equals(path, before)


def test_the_gate_holds_until_the_last_byte_left_the_state(tmp_path: Path, slow_window: dict[str, float]) -> None:
    """``wait_staged`` returns only once every piece was copied; a step right after it is not saved."""
    slow_window["each"] = 0.001
    model, opt = _model()
    _train(model, opt, 0)
    state = {"model": tessera.ModelState(model), "optim": tessera.OptimizerState(model, opt)}
    want = _snapshot(model, opt)
    pending = tessera.async_save(str(tmp_path / "c"), state, options=tessera.SaveOptions(max_staging_bytes=BUDGET))
    assert not pending.staged()  # dozens of delayed pieces are still to come
    pending.wait_staged()
    _train(model, opt, 1)
    pending.wait()
    _committed_equals(str(tmp_path / "c"), want)


def _manager_ranks(rank: int, world: int, root: str) -> list[str]:
    model, opt = _model(seed=rank)  # different per rank: every tensor is checked against its own rank
    model = nn.parallel.DistributedDataParallel(model)
    _train(model, opt, 0)
    state = {"model": tessera.ModelState(model), "optim": tessera.OptimizerState(model, opt)}
    with tessera.CheckpointManager(root, async_save=True, max_staging_bytes=BUDGET) as mgr:
        want = _snapshot(model, opt)
        mgr.save(1, state)
        _train(model, opt, 1)  # waits at the gate
        mgr.wait()
    fresh, fresh_opt = _model(seed=99)
    fresh = nn.parallel.DistributedDataParallel(fresh)
    _train(fresh, fresh_opt, 0)
    with tessera.CheckpointManager(root) as mgr:
        mgr.load({"model": tessera.ModelState(fresh), "optim": tessera.OptimizerState(fresh, fresh_opt)})
    got = _snapshot(fresh, fresh_opt)
    return [k for k in want if not torch.equal(got[k], want[k])]


def test_two_ranks_save_through_the_manager_in_a_budget(tmp_path: Path) -> None:
    different = run_distributed(_manager_ranks, 2, str(tmp_path / "run"))
    assert different == [[], []]


def _save_and_hang(path: str, progress: str) -> None:
    model, opt = _model()
    _train(model, opt, 5)
    state = {"model": tessera.ModelState(model), "optim": tessera.OptimizerState(model, opt)}
    real = win.Window._copy

    def slow(self: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        with open(progress, "a") as f:
            f.write("piece\n")
        time.sleep(0.05)
        real(self, dst, src)

    win.Window._copy = slow  # type: ignore[method-assign]
    tessera.async_save(path, state, options=tessera.SaveOptions(max_staging_bytes=BUDGET)).wait()


def test_a_process_killed_in_the_middle_of_a_budget_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    path = str(tmp_path / "c")
    model, opt = _model()
    _train(model, opt, 0)
    tessera.save(path, {"model": tessera.ModelState(model), "optim": tessera.OptimizerState(model, opt)})
    before = _snapshot(model, opt)
    progress = str(tmp_path / "progress")
    proc = start(_save_and_hang, path, progress)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if os.path.exists(progress) and Path(progress).read_text().count("piece") >= 5:
            break
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    assert proc.exitcode == -signal.SIGKILL
    _committed_equals(path, before)
    assert tessera.verify(path).ok


def test_the_full_check_catches_a_write_the_sampled_check_cannot_see_under_a_budget(
    tmp_path: Path, slow_window: dict[str, Any]
) -> None:
    """A ``.data`` write (no version counter move) to an element the samples miss, before its piece
    is copied: ``StagingCheck.FULL`` (the default) compares the fingerprint taken in the call with
    the checksums of every piece as it was written."""
    slow_window["seconds"] = consistency.DELAY_S
    t = torch.arange(64 * 1024, dtype=torch.float32)
    opts = tessera.SaveOptions(
        staging=tessera.StagingMode.BACKGROUND,
        check_staging=tessera.options.StagingCheck.FULL,
        max_staging_bytes=BUDGET,
    )
    pending = tessera.async_save(str(tmp_path / "c"), {"t": t}, options=opts)
    t.data[12345] = -1.0  # neither the first, the middle nor the last element
    with pytest.raises(tessera.StagingMutationError, match="fingerprint"):
        pending.wait()
