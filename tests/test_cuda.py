"""CUDA paths: pinned staging on a side stream, loads into device tensors. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

import tessera
from tessera.engine.saving.staging import StagingBuffer

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
