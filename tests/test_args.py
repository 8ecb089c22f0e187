"""Swapped or wrong-typed arguments of save/async_save/load and the manager: a TypeError
naming the argument, raised before any work (nothing is written, nothing is read)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

import tessera


def _state() -> dict:
    return {"w": torch.arange(4.0), "step": 3}


@pytest.mark.parametrize("func", [tessera.save, tessera.async_save, tessera.load])
def test_swapped_path_and_state(func, tmp_path: Path) -> None:
    name = f"tessera.{func.__name__}"
    path = str(tmp_path / "ckpt")
    with pytest.raises(TypeError, match=re.escape(f"{name}(path, state): the arguments are swapped")) as info:
        func(_state(), path)
    assert "`path`" in str(info.value) and "`state`" in str(info.value) and repr(path) in str(info.value)
    assert os.listdir(tmp_path) == []  # nothing was written


@pytest.mark.parametrize("func", [tessera.save, tessera.async_save, tessera.load])
def test_wrong_types_name_the_argument(func, tmp_path: Path) -> None:
    name = f"tessera.{func.__name__}"
    with pytest.raises(
        TypeError, match=re.escape(f"{name}(path, state): `path` must be a str or os.PathLike") + ".*got int"
    ):
        func(5, _state())
    with pytest.raises(TypeError, match=re.escape(f"{name}(path, state): `state` must be a dict") + ".*got Tensor"):
        func(str(tmp_path / "c"), torch.zeros(2))
    with pytest.raises(TypeError, match="`path` must be .* got None; `state` must be .* got None"):
        func(None, None)
    assert os.listdir(tmp_path) == []


def test_path_objects_are_accepted(tmp_path: Path) -> None:
    tessera.save(tmp_path / "c", _state())
    target = {"w": torch.zeros(4), "step": 0}
    tessera.load(tmp_path / "c", target)
    assert torch.equal(target["w"], torch.arange(4.0)) and target["step"] == 3
    tessera.async_save(tmp_path / "d", _state()).wait()
    assert tessera.read_manifest(str(tmp_path / "d")).values["step"] == 3


def test_manager_swapped_and_wrong_types(tmp_path: Path) -> None:
    with tessera.CheckpointManager(str(tmp_path / "run")) as mgr:
        with pytest.raises(
            TypeError, match=re.escape("CheckpointManager.save(step, state): the arguments are swapped")
        ):
            mgr.save(_state(), 10)
        with pytest.raises(TypeError, match=re.escape("`step` must be an int (the training step), got str")):
            mgr.save("10", _state())
        with pytest.raises(TypeError, match=re.escape("`state` must be a dict") + ".*got list"):
            mgr.save(10, [1, 2])
        with pytest.raises(
            TypeError, match=re.escape("CheckpointManager.load(state, step=None): the arguments are swapped")
        ):
            mgr.load(10, _state())
        with pytest.raises(TypeError, match=re.escape("got str (the manager's root is given to its constructor)")):
            mgr.load(str(tmp_path / "run"))
        with pytest.raises(TypeError, match=re.escape("`step` must be an int or None") + ".*got float"):
            mgr.load(_state(), 1.0)
        assert mgr.steps() == []
        mgr.save(10, _state())
        target = {"w": torch.zeros(4), "step": 0}
        assert mgr.load(target, 10).step == 10 and target["step"] == 3
