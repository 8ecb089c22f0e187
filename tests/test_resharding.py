"""Save under any layout and world size, load under any other: bit-exact.

One spawn per source world size saves a checkpoint per layout; one spawn per target world
size loads every checkpoint into every layout and compares with the arange truth.
"""

from __future__ import annotations

import os

import pytest
import torch

import tessera
from tests.dist_utils import run_distributed
from tests.layouts import LAYOUTS, expected_local, hold, local_part, truth, zeros_like_held

TENSORS = {
    "f32": ((13, 10), torch.float32),
    "bf16": ((7, 6), torch.bfloat16),
    "i64": ((9, 4), torch.int64),
    "b": ((5, 6), torch.bool),
    "f64_3d": ((5, 4, 6), torch.float64),
}
WORLDS = [1, 2, 3, 4]


def _state(layout: str, rank: int, world: int, zero: bool) -> dict:
    make = zeros_like_held if zero else hold
    return {"t": {name: make(layout, truth(shape, dt), rank, world) for name, (shape, dt) in TENSORS.items()}}


def _save_all(rank: int, world: int, root: str) -> None:
    for layout in LAYOUTS:
        tessera.save(os.path.join(root, f"w{world}-{layout}"), _state(layout, rank, world, zero=False))


def _load_all(rank: int, world: int, root: str) -> int:
    checked = 0
    for src in sorted(os.listdir(root)):
        for layout in LAYOUTS:
            target = _state(layout, rank, world, zero=True)
            result = tessera.load(os.path.join(root, src), target)
            assert result.missing_keys == [] and result.unexpected_keys == []
            for name, (shape, dt) in TENSORS.items():
                got = local_part(target["t"][name])
                want = expected_local(layout, truth(shape, dt), rank, world)
                assert torch.equal(got, want), f"{src} -> {layout} (world {world}, rank {rank}): tensor {name} differs"
                checked += 1
    return checked


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("reshard"))
    for w in WORLDS:
        run_distributed(_save_all, w, root)
    return root


@pytest.mark.parametrize("world", WORLDS)
def test_load_every_layout_into_every_layout(saved: str, world: int) -> None:
    checked = run_distributed(_load_all, world, saved)
    assert checked[0] == len(WORLDS) * len(LAYOUTS) * len(LAYOUTS) * len(TENSORS)


def test_single_process_without_distributed(saved: str) -> None:
    """A plain process (no torch.distributed) loads a 4-rank DTensor checkpoint whole."""
    for name, (shape, dt) in TENSORS.items():
        target = {"t": {name: torch.zeros(shape, dtype=dt)}}
        tessera.load(os.path.join(saved, "w4-dt_2d"), target, strict=False)
        assert torch.equal(target["t"][name], truth(shape, dt))
