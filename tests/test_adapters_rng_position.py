"""RNGState and DataPosition, and the examples as a user runs them."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

import tessera
from tessera.adapters import DataPosition, RNGState
from tests.dist_utils import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _draw() -> list[float]:
    return [
        random.random(),
        random.gauss(0, 1),
        float(np.random.rand()),
        float(np.random.randn()),
        torch.rand(()).item(),
    ]


def test_rng_state_round_trip(tmp_path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)
    np.random.randn()  # leave cached Gaussians behind: they are part of the state
    tessera.save(str(tmp_path), {"rng": RNGState()})
    first = _draw()
    keys = tessera.read_manifest(str(tmp_path)).keys()
    assert {"rng.torch", "rng.python.state", "rng.numpy.keys"} <= keys
    tessera.load(str(tmp_path), {"rng": RNGState()})
    assert _draw() == first
    with pytest.raises(ValueError):
        RNGState(on_resize="sometimes")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_data_position_is_world_size_independent(world: int) -> None:
    pos, ref = DataPosition(), DataPosition()
    for _ in range(7):  # 7 batches of 12 from 40 samples: crosses two epoch ends
        got = [i for r in range(world) for i in pos.batch_indices(40, 12, r, world, seed=5)]
        assert got == ref.batch_indices(40, 12, 0, 1, seed=5)
        assert len(set(got)) == 12
        pos.advance(12)
        ref.advance(12)
    assert pos.state_dict() == {"epoch": 2, "samples_seen": 12}


def test_data_position_resumes_and_validates(tmp_path) -> None:
    pos = DataPosition()
    for _ in range(4):
        pos.batch_indices(40, 12, 0, 2)
        pos.advance(12)
    tessera.save(str(tmp_path), {"data": pos})
    resumed = DataPosition()
    tessera.load(str(tmp_path), {"data": resumed})
    assert resumed.state_dict() == pos.state_dict() == {"epoch": 1, "samples_seen": 12}
    assert resumed.batch_indices(40, 12, 1, 3) == pos.batch_indices(40, 12, 1, 3)
    with pytest.raises(ValueError, match="divisible"):
        pos.batch_indices(40, 12, 0, 5)
    with pytest.raises(tessera.StateMismatchError):
        resumed.load_state_dict({"epoch": "x"})


def _run(script: str, *args: str, ckpt: str) -> str:
    """``python examples/<script> --ckpt ckpt *args``; the script's own process is forked from
    the preloaded server (tests/dist_utils.py), the ranks it spawns are fresh interpreters."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    path = os.path.join(ROOT, "examples", script)
    done = run_script(path, "--ckpt", ckpt, *args, cwd=ROOT, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_examples_resume_each_other(tmp_path) -> None:
    """FSDP2 on 2 ranks -> FSDP2 x TP on 4 -> DDP on 3, continuing one loss curve."""
    ckpt = str(tmp_path)
    out = _run("train_fsdp2.py", "--nproc", "2", "--steps", "4", "--save-every", "2", ckpt=ckpt)
    assert "saved step 4" in out
    out = _run("train_tp.py", "--nproc", "4", "--dp", "2", "--steps", "6", "--save-every", "2", ckpt=ckpt)
    assert "resumed" in out and "at step 4" in out and "step    5" in out
    out = _run("train_ddp.py", "--nproc", "3", "--steps", "7", "--save-every", "7", ckpt=ckpt)
    assert "at step 6" in out and "saved step 7" in out
    assert sorted(os.listdir(ckpt)) == ["step_000002", "step_000004", "step_000006", "step_000007"]


@pytest.mark.slow
def test_hugging_face_example(tmp_path) -> None:
    pytest.importorskip("transformers")
    ckpt = str(tmp_path)
    _run("train_hf_fsdp2.py", "--nproc", "2", "--steps", "2", "--save-every", "2", ckpt=ckpt)
    out = _run("train_hf_fsdp2.py", "--nproc", "3", "--steps", "3", "--save-every", "3", ckpt=ckpt)
    assert "at step 2" in out and "saved step 3" in out
    keys = tessera.read_manifest(os.path.join(ckpt, "step_000003")).keys()
    assert "model.model.embed_tokens.weight" in keys and "model.lm_head.weight" not in keys  # tied: saved once
