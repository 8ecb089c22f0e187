"""Writes a training loop makes after ``async_save`` returns: held, or a loud failure; never a mix.

Issue 33, items 1 and 2. A model and its optimizer are saved through ``ModelState`` and
``OptimizerState`` (the fast path: the forward may run while the copy runs), then the loop
writes the saved parameters right after the call, the ways real loops do: forward passes that
renormalise or clamp weights in place (``nn.Embedding``/``nn.EmbeddingBag`` with ``max_norm``,
the functional ``F.embedding(max_norm=...)`` in a module of the user's, a forward pre-hook that
clips weights as WGAN does, parametrizations), writes through aliases (one row or one element
through ``.data``, a NumPy view, ``detach()``), and an in-place kernel still running when the
copy ends. Each case runs 20 trials, half of them with the background copy delayed (so that a
write nothing holds lands before the copy every time), without and with a 64 KiB staging
budget, in one process; the main cases also on two gloo ranks.

A trial passes if the committed checkpoint equals, bit for bit, the state at the call, or the
save raised :class:`tessera.StagingMutationError` (on every rank) and committed nothing. Cases
whose write the gate holds (or that write nothing saved) must commit every time; cases whose
write lands before the copy and nothing holds must be refused every time the copy is delayed.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tessera
from tessera.engine.saving import fingerprint
from tessera.engine.saving import staging as stage
from tessera.engine.saving import window as win
from tests.dist_utils import run_distributed
from tests.test_async_consistency import _mixed, _snapshot

TRIALS = 20
"""Trials per case and budget of the slow sweep (half of them with the copy delayed)."""
QUICK = 6
"""Trials per case of the quick tests."""
DELAY_S = 0.05
BUDGET = 64 * 1024


class _Delay:
    """While ``seconds`` is set, the background copy starts that late: the copy thread's staging
    (no budget), or each window's first piece (a budget). The copy itself is the real one."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._stage = stage.StagingBuffer.stage
        self._copy = win.Window._copy

    def install(self) -> None:
        real_stage, real_copy, delay = self._stage, self._copy, self

        def slow_stage(buf: Any, sources: Any, *, copy: bool, after: Any = None, **kwargs: Any) -> Any:
            if delay.seconds and threading.current_thread() is not threading.main_thread():
                time.sleep(delay.seconds)
            return real_stage(buf, sources, copy=copy, after=after, **kwargs)

        def slow_copy(window: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
            if delay.seconds and not window.__dict__.get("_delayed"):
                window.__dict__["_delayed"] = True
                time.sleep(delay.seconds)
            real_copy(window, dst, src)

        stage.StagingBuffer.stage = slow_stage  # type: ignore[method-assign]
        win.Window._copy = slow_copy  # type: ignore[method-assign]

    def remove(self) -> None:
        stage.StagingBuffer.stage = self._stage  # type: ignore[method-assign]
        win.Window._copy = self._copy  # type: ignore[method-assign]


@pytest.fixture
def delay():
    d = _Delay()
    d.install()
    yield d
    d.remove()


# --------------------------------------------------------------------------------------
# Models


class _Embedder(nn.Module):
    """Token ids -> a scalar per sequence, through a stock ``nn.Embedding`` or ``nn.EmbeddingBag``."""

    def __init__(self, bag: bool) -> None:
        super().__init__()
        self.embed: nn.Module = nn.EmbeddingBag(512, 64, max_norm=1.0) if bag else nn.Embedding(512, 64, max_norm=1.0)
        self.head = nn.Linear(64, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return self.head(x if x.dim() == 2 else x.mean(1))


class _FunctionalMaxNorm(nn.Module):
    """The user's own module calling ``F.embedding(max_norm=...)``: a native in-place kernel
    (``embedding_renorm_``) in a forward tessera does not know to hold."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(4096, 64) * 3)
        self.head = nn.Linear(64, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(F.embedding(ids, self.table, max_norm=1.0).mean(1))


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(128, 96)
        self.fc2 = nn.Linear(96, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class _ClampOriginal(nn.Module):
    """A parametrization that (against its contract) clamps the original in place in its forward."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        w.data.clamp_(-0.05, 0.05)
        return w


def _clip_weights(module: nn.Module, _inputs: Any) -> None:
    """WGAN's weight clipping, as a forward pre-hook."""
    for p in module.parameters():
        p.data.clamp_(-0.05, 0.05)


@dataclass
class Loop:
    model: nn.Module
    opt: torch.optim.Optimizer
    batch: Callable[[int], torch.Tensor]
    pending: tessera.PendingSave | None = None

    def forward_backward(self, step: int) -> None:
        self.model(self.batch(step)).float().square().mean().backward()

    def train_step(self, step: int) -> None:
        self.forward_backward(step)
        self.opt.step()
        self.opt.zero_grad()


def _ids(vocab: int, n: int) -> Callable[[int], torch.Tensor]:
    return lambda step: torch.randint(0, vocab, (8, n), generator=torch.Generator().manual_seed(step))


def _dense(step: int) -> torch.Tensor:
    return torch.randn(16, 128, generator=torch.Generator().manual_seed(step))


def _build(model_kind: str, seed: int, ddp: bool = False) -> Loop:
    torch.manual_seed(seed)
    model: nn.Module
    if model_kind in ("embedding", "embedding-bag"):
        model, batch = _Embedder(bag=model_kind == "embedding-bag"), _ids(512, 16)
        with torch.no_grad():
            model.embed.weight.mul_(3)  # most rows above max_norm: a forward renormalises them
    elif model_kind == "functional":
        model, batch = _FunctionalMaxNorm(), _ids(4096, 512)
    else:
        model, batch = _MLP(), _dense
        if model_kind == "clip-hook":
            model.register_forward_pre_hook(_clip_weights)
        elif model_kind == "weight-norm":
            nn.utils.parametrizations.weight_norm(model.fc1)
        elif model_kind == "spectral-norm":
            nn.utils.parametrizations.spectral_norm(model.fc1)
        elif model_kind == "spectral-norm-hook":
            nn.utils.spectral_norm(model.fc1)
        elif model_kind == "writing-parametrization":
            nn.utils.parametrize.register_parametrization(model.fc1, "weight", _ClampOriginal())
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)
    lp = Loop(model, torch.optim.AdamW(model.parameters(), lr=1e-2), batch)
    for step in range(2):
        lp.train_step(step)
    return lp


# --------------------------------------------------------------------------------------
# What the loop does right after the call


def _weight(lp: Loop) -> torch.Tensor:
    inner = lp.model.module if isinstance(lp.model, nn.parallel.DistributedDataParallel) else lp.model
    return next(p for p in inner.parameters() if p.dim() == 2)


def _forward_then_step(lp: Loop) -> None:
    lp.train_step(100)


def _data_row(lp: Loop) -> None:
    _weight(lp).data[3] = 7.0  # one row, far from the first, middle and last elements


def _data_element(lp: Loop) -> None:
    _weight(lp).data[3, 5] += 1.0


def _numpy_view(lp: Loop) -> None:
    _weight(lp).detach().numpy()[3, 5] = -7.0  # no version counter at all


def _detach_row(lp: Loop) -> None:
    _weight(lp).detach()[3].mul_(2.0)


def _same_bytes(lp: Loop) -> None:
    with torch.no_grad():
        row = _weight(lp)[3]
        row.copy_(row.clone())  # an in-place op (the version counter moves) that changes no byte


def _kernel_still_running(lp: Loop) -> None:
    """An in-place CPU kernel as the copy sees it: its bytes change at once, its version counter
    moves only when it returns, and it returns only after the copy and its check have ended."""
    w = _weight(lp)
    half = w.shape[0] // 2 - 1
    w.detach().numpy()[1:half] *= -1.0  # the first half of the kernel's writes
    assert lp.pending is not None
    deadline = time.monotonic() + 10.0
    while not lp.pending.staged() and time.monotonic() < deadline:
        time.sleep(0.002)
    with torch.no_grad():
        w[half + 2 :].mul_(-1.0)  # the rest, then the counter moves: the kernel returns


def _after_the_copy(lp: Loop) -> None:
    assert lp.pending is not None
    lp.pending.wait_staged()
    _weight(lp).data[3] = 7.0  # the copy is done: harmless


@dataclass(frozen=True)
class Case:
    model: str
    after: Callable[[Loop], None]
    expect: str
    """``commit``: every trial commits; ``refuse``: every delayed trial is refused (the write
    lands before the copy and nothing holds it); ``either``: a race, never a mix."""


CASES: dict[str, Case] = {
    "embedding-max-norm-forward": Case("embedding", _forward_then_step, "commit"),
    "embedding-bag-max-norm-forward": Case("embedding-bag", _forward_then_step, "commit"),
    "clip-pre-hook-forward": Case("clip-hook", _forward_then_step, "commit"),
    "weight-norm-forward": Case("weight-norm", _forward_then_step, "commit"),
    "spectral-norm-forward": Case("spectral-norm", _forward_then_step, "commit"),
    "spectral-norm-hook-forward": Case("spectral-norm-hook", _forward_then_step, "commit"),
    "writing-parametrization-forward": Case("writing-parametrization", _forward_then_step, "refuse"),
    "functional-max-norm-forward": Case("functional", _forward_then_step, "refuse"),
    "data-row": Case("mlp", _data_row, "refuse"),
    "data-element": Case("mlp", _data_element, "refuse"),
    "numpy-view": Case("mlp", _numpy_view, "refuse"),
    "detach-row": Case("mlp", _detach_row, "refuse"),
    "kernel-still-running": Case("mlp", _kernel_still_running, "refuse"),
    "same-bytes-write": Case("mlp", _same_bytes, "commit"),
    "data-row-after-the-copy": Case("mlp", _after_the_copy, "commit"),
}


MAIN = ["embedding-max-norm-forward", "clip-pre-hook-forward", "data-row", "numpy-view", "kernel-still-running"]
"""The cases run on two ranks and, in the quick tests, under a budget."""


def _trial(name: str, path: str, *, budget: bool, seed: int, ddp: bool = False) -> str:
    """One trial: save at the call, write at once, train on; 'committed' or 'refused' ('MIXED ...' if not)."""
    case = CASES[name]
    lp = _build(case.model, seed, ddp)
    state = {"model": tessera.ModelState(lp.model), "optim": tessera.OptimizerState(lp.model, lp.opt), "step": 3}
    want = _snapshot(state)
    opts = tessera.SaveOptions(max_staging_bytes=BUDGET if budget else None)
    lp.pending = tessera.async_save(path, state, options=opts)
    case.after(lp)  # right after the call returns
    lp.train_step(7)
    try:
        lp.pending.wait()
    except tessera.StagingMutationError as e:
        assert "'model." in str(e) and "rank " in str(e), e  # names the tensor and the rank
        assert not os.path.exists(os.path.join(path, "manifest.json"))
        return "refused"
    mixed = _mixed(path, want)
    return f"MIXED {mixed}" if mixed else "committed"


def _check(name: str, outcomes: list[str], delayed: list[bool]) -> None:
    assert not [o for o in outcomes if o.startswith("MIXED")], (name, outcomes)
    expect = CASES[name].expect
    if expect == "commit":
        assert outcomes == ["committed"] * len(outcomes), (name, outcomes)
    elif expect == "refuse":
        assert all(o == "refused" for o, d in zip(outcomes, delayed) if d), (name, outcomes)


def _run(name: str, root: Path, delay: _Delay, budget: bool, trials: int = TRIALS) -> None:
    outcomes, delayed = [], []
    for trial in range(trials):
        delay.seconds = DELAY_S if trial % 2 else 0.0
        delayed.append(bool(delay.seconds))
        outcomes.append(_trial(name, str(root / f"t{trial}"), budget=budget, seed=trial))
    print(f"{name} budget={budget}: {dict(collections.Counter(outcomes))}")  # the tally, with -s
    _check(name, outcomes, delayed)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_write_after_the_call_is_held_or_fails_the_save(tmp_path: Path, delay: _Delay, name: str) -> None:
    _run(name, tmp_path, delay, budget=False, trials=QUICK)


@pytest.mark.parametrize("name", MAIN)
def test_under_a_budget_a_write_after_the_call_is_held_or_fails_the_save(
    tmp_path: Path, delay: _Delay, name: str
) -> None:
    _run(name, tmp_path, delay, budget=True, trials=QUICK)


@pytest.mark.slow
@pytest.mark.parametrize("budget", [False, True], ids=["no-budget", "64KiB"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_twenty_trials_of_each_write(tmp_path: Path, delay: _Delay, name: str, budget: bool) -> None:
    _run(name, tmp_path, delay, budget=budget, trials=TRIALS)


def test_a_racing_in_place_kernel_never_commits_a_mix(tmp_path: Path) -> None:
    """No delay: a real native kernel (``embedding_renorm_`` over 4096 looked-up ids) in a forward
    nothing holds races the real copy; whichever wins, the save commits the call or fails."""
    outcomes = [_trial("functional-max-norm-forward", str(tmp_path / f"t{i}"), budget=False, seed=i) for i in range(10)]
    assert not [o for o in outcomes if o.startswith("MIXED")], outcomes


def test_the_forward_overlaps_the_copy_unless_it_writes_parameters(tmp_path: Path, delay: _Delay) -> None:
    """The fast path stays where it is safe: a model whose forward writes nothing saved runs its
    forward and backward during the copy; an ``Embedding(max_norm=...)`` model's forward waits."""
    delay.seconds = 1.0  # longer than a forward and backward, even on a loaded machine
    for kind, overlapped in (("mlp", True), ("weight-norm", True), ("embedding", False), ("clip-hook", False)):
        lp = _build(kind, 0)
        state = {"model": tessera.ModelState(lp.model), "optim": tessera.OptimizerState(lp.model, lp.opt)}
        pending = tessera.async_save(str(tmp_path / kind), state)
        lp.forward_backward(5)
        assert pending.staged() is not overlapped, kind
        pending.wait()


# --------------------------------------------------------------------------------------
# The fingerprint itself: strided sources, chunk and piece boundaries, the threaded path


@pytest.mark.parametrize("threaded", [False, True], ids=["inline", "threads"])
def test_the_fingerprint_matches_the_writer_on_strided_sources_and_sees_one_element(
    tmp_path: Path, delay: _Delay, monkeypatch: pytest.MonkeyPatch, threaded: bool
) -> None:
    monkeypatch.setattr(fingerprint, "_PIECE_BYTES", 10_000)  # pieces that cut chunks anywhere
    monkeypatch.setattr(fingerprint, "_BATCH_BYTES", 8192)
    if threaded:
        monkeypatch.setattr(fingerprint, "_PARALLEL_BYTES", 1)
    base = torch.randn(300, 257)
    state = {"t": base.t(), "cols": base[:, 3:200], "whole": torch.randn(5000), "empty": torch.empty(0, 3)}
    opts = tessera.SaveOptions(staging=tessera.StagingMode.BACKGROUND, chunk_bytes=4096)
    for budget in (None, BUDGET):
        want = {k: v.clone() for k, v in state.items()}
        path = str(tmp_path / f"ok-{budget}")
        tessera.async_save(path, state, options=dataclasses.replace(opts, max_staging_bytes=budget)).wait()
        got = {k: torch.empty(v.shape) for k, v in want.items()}
        tessera.load(path, got)
        assert all(torch.equal(got[k], want[k]) for k in want)
        delay.seconds = DELAY_S
        pending = tessera.async_save(
            str(tmp_path / f"bad-{budget}"), state, options=dataclasses.replace(opts, max_staging_bytes=budget)
        )
        base.numpy()[150, 100] += 1.0  # one element of two strided views, through NumPy
        with pytest.raises(
            tessera.StagingMutationError, match=r"tensor '(t|cols)' was modified.*also changed: '(t|cols)'"
        ):
            pending.wait()
        delay.seconds = 0.0


def test_checksums_from_a_writer_process_are_compared_too(
    tmp_path: Path, delay: _Delay, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TESSERA_WRITER", "process")
    assert tessera.SaveOptions().writer is tessera.options.WriterMode.PROCESS
    for name in ("data-row", "embedding-max-norm-forward"):
        _run(name, tmp_path / name, delay, budget=False, trials=4)


# --------------------------------------------------------------------------------------
# Two gloo ranks (DDP): the same outcome on every rank, the typed error everywhere


def _dist_trials(rank: int, world: int, root: str, names: list[str], trials: int) -> dict[str, list[str]]:
    d = _Delay()
    d.install()
    out: dict[str, list[str]] = {}
    for budget in (False, True):
        for name in names:
            for trial in range(trials):
                d.seconds = DELAY_S if trial % 2 else 0.0
                path = os.path.join(root, f"{name}-{budget}-{trial}")
                out.setdefault(f"{name}{' budget' if budget else ''}", []).append(
                    _trial(name, path, budget=budget, seed=trial, ddp=True)
                )
    return out


def _two_ranks(root: Path, names: list[str], trials: int) -> None:
    per_rank = run_distributed(_dist_trials, 2, str(root), names, trials)
    assert per_rank[0] == per_rank[1], per_rank  # the same outcome on every rank
    for key, outcomes in per_rank[0].items():
        print(f"2 ranks, {key}: {dict(collections.Counter(outcomes))}")  # the tally, with -s
        _check(key.removesuffix(" budget"), outcomes, [t % 2 == 1 for t in range(len(outcomes))])


def test_two_ranks_hold_the_writes_or_fail_on_every_rank(tmp_path: Path) -> None:
    _two_ranks(tmp_path, MAIN[:4], 2)


@pytest.mark.slow
def test_two_ranks_twenty_trials_of_the_main_writes(tmp_path: Path) -> None:
    _two_ranks(tmp_path, MAIN, TRIALS)


@pytest.mark.slow
def test_two_ranks_twenty_trials_of_the_other_idioms(tmp_path: Path) -> None:
    """The idioms of the issue not in MAIN, on two ranks too: a one-element `.data` write, a
    `detach()` write, and weight norm (a parametrization that must keep committing)."""
    _two_ranks(tmp_path, ["data-element", "detach-row", "weight-norm-forward"], TRIALS)


# --------------------------------------------------------------------------------------
# What cannot be seen is said once, in the same words, where users look


def test_the_readme_and_the_guarantees_state_the_same_limits() -> None:
    repo = Path(__file__).resolve().parent.parent

    def words(name: str) -> str:
        return " ".join((repo / name).read_text().split())

    readme, guarantees = words("README.md"), words("docs/guarantees.md")
    start = readme.index("A change the gate cannot hold fails the save loudly")
    sentence = readme[start : readme.index(" while the call itself runs", start) + len(" while the call itself runs")]
    assert "What the default check cannot see: on a GPU" in sentence  # the limits, not only the promise
    assert sentence in guarantees and sentence in words("docs/manager.md")
