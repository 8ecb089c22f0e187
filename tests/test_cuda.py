"""CUDA paths: pinned staging on a side stream, budget-bound saves through a pinned window, loads into device tensors. Skipped without a GPU."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import tessera
from tessera.engine.saving import cache
from tessera.engine.saving.staging import StagingBuffer
from tessera.engine.saving.window import WindowBuffers
from tests.test_memory_budget import _committed_equals, _snapshot

pytestmark = pytest.mark.cuda


def test_async_save_of_cuda_tensors_stages_into_reused_pinned_memory(tmp_path) -> None:
    w = torch.randn(1024, 1024, device="cuda")
    state = {"w": w, "b": torch.arange(10, device="cuda")}
    pending = tessera.async_save(str(tmp_path / "a"), state)
    pending.wait_staged()
    w.mul_(0)  # queued on the training stream after the gate: must not be saved
    pending.wait()
    target = {"w": torch.zeros(1024, 1024, device="cuda"), "b": torch.zeros(10, dtype=torch.int64, device="cuda")}
    tessera.load(str(tmp_path / "a"), target)
    assert torch.count_nonzero(target["w"]) > 0 and torch.equal(target["b"].cpu(), torch.arange(10))


def test_staging_buffer_is_pinned_and_reused() -> None:
    buf = StagingBuffer()
    src = [torch.randn(256, device="cuda"), torch.randn(3, 5, device="cuda").t()]
    first = buf.stage(src, copy=True)
    ptr = first[0].data_ptr()
    second = buf.stage(src, copy=True)
    assert second[0].data_ptr() == ptr and second[0].is_pinned()
    for s, b in zip(src, second):
        assert torch.equal(b.view(s.dtype).view(s.shape).cuda(), s)


def test_load_cpu_checkpoint_into_cuda_and_back(tmp_path) -> None:
    cpu = {"w": torch.randn(33, 17)}
    tessera.save(str(tmp_path / "c"), cpu)
    target = {"w": torch.zeros(33, 17, device="cuda")}
    tessera.load(str(tmp_path / "c"), target)
    assert torch.equal(target["w"].cpu(), cpu["w"])


class _PinCounted(WindowBuffers):
    """The window's buffers, with the bytes held at once and whether each was pinned."""

    def __init__(self) -> None:
        super().__init__()
        self.held = self.peak = 0
        self.pins: set[bool] = set()
        self._count = threading.Lock()

    def take(self, nbytes: int, pin: bool) -> torch.Tensor:
        with self._count:
            self.held += nbytes
            self.peak = max(self.peak, self.held)
        buf = super().take(nbytes, pin)
        self.pins.add(buf.is_pinned())
        return buf

    def give(self, buf: torch.Tensor) -> None:
        with self._count:
            self.held -= buf.numel()
        super().give(buf)


def _train_cuda(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(1000 + step)
    model(torch.randn(256, 512, device="cuda", generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_budget_save_of_a_cuda_model_streams_through_pinned_buffers_and_commits_the_call(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16 MiB of model and AdamW state on the GPU through a 1 MiB pinned window; the loop steps
    right after the call (held by OptimizerState until the last byte left the device)."""
    counted = _PinCounted()
    monkeypatch.setattr(cache, "WindowBuffers", lambda: counted)
    monkeypatch.setattr(cache, "_CACHES", {})  # a fresh cache takes the counted buffers
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(6)]).cuda()
    opt = torch.optim.AdamW(model.parameters())
    _train_cuda(model, opt, 0)
    state = {"model": tessera.ModelState(model), "optim": tessera.OptimizerState(model, opt)}
    want = {k: v.cpu() for k, v in _snapshot(model, opt).items()}
    budget = 1 << 20
    assert sum(v.numel() * v.element_size() for v in want.values()) > 10 * budget
    path = str(tmp_path / "c")
    pending = tessera.async_save(path, state, options=tessera.SaveOptions(max_staging_bytes=budget))
    for step in (1, 2):
        _train_cuda(model, opt, step)
    pending.wait()
    assert counted.pins == {True}
    assert 0 < counted.peak <= budget and counted.held == 0, (counted.peak, counted.held)
    _committed_equals(path, want)
    assert tessera.verify(path).ok


def test_budget_save_copies_after_queued_work_and_before_a_mutation_after_the_gate(tmp_path) -> None:
    """Plain CUDA tensors under a budget: a value still being computed on the training stream at
    the call is saved as computed; a kernel queued right after ``wait_staged`` is not saved."""
    a = torch.randn(2048, 2048, device="cuda")
    w = torch.zeros(2048, 2048, device="cuda")
    for _ in range(20):  # queued, not finished, when async_save is called
        w.add_(a @ a, alpha=1e-6)
    path = str(tmp_path / "w")
    pending = tessera.async_save(path, {"w": w}, options=tessera.SaveOptions(max_staging_bytes=1 << 20))
    pending.wait_staged()
    want = w.cpu()
    w.mul_(0)
    pending.wait()
    got = {"w": torch.empty(2048, 2048)}
    tessera.load(path, got)
    assert torch.count_nonzero(want) > 0 and torch.equal(got["w"], want)


@pytest.mark.parametrize("how", ["async_save of a raw state_dict", "sync save"])
def test_cuda_tensors_nothing_holds_back_stream_through_the_budget(
    tmp_path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """No full pinned copy under a budget: a raw CUDA state dict's async save returns once its
    bytes left the device (the loop may change them at once); a sync save streams too."""
    counted = _PinCounted()
    monkeypatch.setattr(cache, "WindowBuffers", lambda: counted)
    monkeypatch.setattr(cache, "_CACHES", {})
    a = torch.randn(2048, 2048, device="cuda")
    state = {"w": torch.zeros(2048, 2048, device="cuda"), "b": torch.arange(1000, device="cuda")}
    for _ in range(10):  # queued on the training stream at the call
        state["w"].add_(a @ a, alpha=1e-6)
    path = str(tmp_path / "c")
    opts = tessera.SaveOptions(max_staging_bytes=1 << 20)
    if how == "sync save":
        tessera.save(path, state, options=opts)
        want = {k: v.cpu() for k, v in state.items()}
    else:
        pending = tessera.async_save(path, state, options=opts)
        assert pending.staged()
        want = {k: v.cpu() for k, v in state.items()}
        state["w"].mul_(0)
        pending.wait()
    assert counted.pins == {True} and 0 < counted.peak <= 1 << 20
    assert cache.cache_for(None).staging.nbytes == 0
    got = {"w": torch.empty(2048, 2048), "b": torch.empty(1000, dtype=torch.int64)}
    tessera.load(path, got)
    assert torch.count_nonzero(want["w"]) > 0 and all(torch.equal(got[k], want[k]) for k in want)
