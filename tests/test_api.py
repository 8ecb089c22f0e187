"""save/load in a single process: values, dtypes, containers, strictness, atomic replace."""

from __future__ import annotations

import collections
import os

import pytest
import torch
from safetensors import safe_open

import tessera
from tessera.format.dtypes import _NAMES

ALL_DTYPES = sorted(_NAMES.values(), key=str)


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        0,
        256,
        (int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size(),),
        generator=g,
        dtype=torch.uint8,
    )
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def _zeros(like: torch.Tensor) -> torch.Tensor:
    """Zero bytes shaped like ``like`` (works for dtypes without arithmetic, e.g. bits16)."""
    out = torch.empty_like(like)
    out.reshape(-1).view(torch.uint8).zero_()
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality for every dtype (NaN payloads included)."""
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_round_trips_bit_exactly(tmp_path, dtype: torch.dtype) -> None:
    state = {"x": _random((3, 5), dtype), "s": _random((), dtype, 1), "e": _random((0, 4), dtype)}
    tessera.save(str(tmp_path), state)
    target = {k: _zeros(v) for k, v in state.items()}
    tessera.load(str(tmp_path), target)
    for k in state:
        assert _same(target[k], state[k]), k


def test_tiles_are_valid_safetensors_files(tmp_path) -> None:
    state = {"w": torch.randn(6, 4), "i": torch.arange(10), "c": torch.randn(3, dtype=torch.complex128)}
    tessera.save(str(tmp_path), state)
    m = tessera.read_manifest(str(tmp_path))
    for name, entry in m.tensors.items():
        for tile in entry.tiles:
            with safe_open(os.path.join(tmp_path, tile.file), "pt") as f:
                key = name + "[" + ",".join(f"{o}:{o + n}" for o, n in zip(tile.offsets, tile.lengths)) + "]"
                got = f.get_tensor(key)
                if name == "c":  # complex128 is stored raw: U8 with a trailing item-size dim
                    got = got.view(torch.complex128).squeeze(-1)
                assert _same(got, state[name])


Point = collections.namedtuple("Point", "x y")


def test_nested_containers_plain_values_and_views(tmp_path) -> None:
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    state = {
        "model": {"layers.0.w": base.t(), "layers.1.w": base[::2, 1:5]},  # non-contiguous views
        "list": [torch.ones(2), {"deep": torch.full((3,), 7.0)}, "plain"],
        "tup": (torch.zeros(1), 5),
        "point": Point(torch.tensor([1.0]), 2),
        "cfg": {"lr": 1e-3, "betas": (0.9, 0.95), "name": "run", "ids": {1: "a"}, "none": None, "inf": float("inf")},
        "step": 12,
    }
    tessera.save(str(tmp_path), state)
    target = {
        "model": {"layers.0.w": torch.zeros(8, 6), "layers.1.w": torch.zeros(3, 4).t().contiguous().t()},
        "list": [torch.zeros(2), {"deep": torch.zeros(3)}, None],
        "tup": (torch.ones(1), 0),
        "point": Point(torch.tensor([0.0]), 0),
        "cfg": None,
        "step": 0,
    }
    keep = target["model"]["layers.0.w"]
    tessera.load(str(tmp_path), target)
    assert target["model"]["layers.0.w"] is keep  # filled in place
    assert torch.equal(keep, base.t())
    assert torch.equal(target["model"]["layers.1.w"], base[::2, 1:5])
    assert target["list"][2] == "plain" and torch.equal(target["list"][1]["deep"], torch.full((3,), 7.0))
    assert target["tup"][1] == 5 and torch.equal(target["tup"][0], torch.zeros(1))
    assert isinstance(target["point"], Point) and target["point"].y == 2
    assert target["cfg"] == state["cfg"] and target["step"] == 12


class Counter:
    def __init__(self) -> None:
        self.n = 0
        self.w = torch.zeros(3)

    def state_dict(self) -> dict:
        return {"n": self.n, "w": self.w}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]
        self.w = sd["w"]


def test_stateful_objects_get_load_state_dict(tmp_path) -> None:
    c = Counter()
    c.n, c.w = 4, torch.tensor([1.0, 2.0, 3.0])
    tessera.save(str(tmp_path), {"counter": c, "model": torch.nn.Linear(3, 2)})
    fresh, lin = Counter(), torch.nn.Linear(3, 2)
    tessera.load(str(tmp_path), {"counter": fresh, "model": lin})
    assert fresh.n == 4 and torch.equal(fresh.w, c.w)


def test_strict_errors_name_the_keys(tmp_path) -> None:
    tessera.save(
        str(tmp_path), {"model": {"a": torch.ones(2), "b": torch.ones(3)}, "optim": {"m": torch.ones(2)}, "step": 1}
    )
    # A subset (only the model) is a normal use.
    res = tessera.load(str(tmp_path), {"model": {"a": torch.zeros(2), "b": torch.zeros(3)}})
    assert res.missing_keys == [] and res.unexpected_keys == []
    with pytest.raises(tessera.MissingKeysError, match="'model.c'"):
        tessera.load(str(tmp_path), {"model": {"a": torch.zeros(2), "b": torch.zeros(3), "c": torch.zeros(1)}})
    with pytest.raises(tessera.MissingKeysError, match="wanted by no rank.*'model.b'"):
        tessera.load(str(tmp_path), {"model": {"a": torch.zeros(2)}})
    res = tessera.load(str(tmp_path), {"model": {"a": torch.zeros(2), "c": torch.zeros(1)}}, strict=False)
    assert res.missing_keys == ["model.c"] and res.unexpected_keys == ["model.b"]
    with pytest.raises(tessera.StateMismatchError, match="'model.a'.*shape \\[2\\].*\\[5\\]"):
        tessera.load(str(tmp_path), {"model": {"a": torch.zeros(5)}}, strict=False)
    with pytest.raises(tessera.StateMismatchError, match="'model.a'.*dtype float32.*float16"):
        tessera.load(str(tmp_path), {"model": {"a": torch.zeros(2, dtype=torch.float16)}}, strict=False)
    t = torch.zeros(2, dtype=torch.float16)
    tessera.load(str(tmp_path), {"model": {"a": t}}, strict=False, cast_dtypes=True)
    assert torch.equal(t, torch.ones(2, dtype=torch.float16))


def test_mismatch_leaves_target_untouched(tmp_path) -> None:
    tessera.save(str(tmp_path), {"a": torch.ones(4), "b": torch.ones(3)})
    a, b = torch.zeros(4), torch.zeros(2)
    with pytest.raises(tessera.StateMismatchError):
        tessera.load(str(tmp_path), {"a": a, "b": b})
    assert torch.equal(a, torch.zeros(4))


def test_missing_checkpoint(tmp_path) -> None:
    with pytest.raises(tessera.CheckpointNotFoundError, match="no committed checkpoint"):
        tessera.load(str(tmp_path / "nothing"), {"a": torch.zeros(1)})


def test_pickle_opt_in(tmp_path) -> None:
    class Thing:
        pass

    with pytest.raises(tessera.errors.PickleNotAllowedError, match="'obj'"):
        tessera.save(str(tmp_path), {"obj": Thing()})
    assert not (tmp_path / "manifest.json").exists()  # refused before anything was written
    tessera.save(str(tmp_path), {"obj": collections.OrderedDict(a=1)}, allow_pickle=True)
    with pytest.raises(tessera.errors.PickleNotAllowedError):
        tessera.load(str(tmp_path), {"obj": None})
    target = {"obj": None}
    tessera.load(str(tmp_path), target, allow_pickle=True)
    assert target["obj"] == collections.OrderedDict(a=1)


def test_saving_over_a_checkpoint_replaces_it(tmp_path) -> None:
    tessera.save(str(tmp_path), {"a": torch.ones(4), "old": 1})
    first = set(os.listdir(tmp_path / "data"))
    tessera.save(str(tmp_path), {"a": torch.full((4,), 2.0)})
    assert set(os.listdir(tmp_path / "data")).isdisjoint(first)  # old generation removed
    target = {"a": torch.zeros(4)}
    tessera.load(str(tmp_path), target)
    assert torch.equal(target["a"], torch.full((4,), 2.0))
    assert "old" not in tessera.read_manifest(str(tmp_path)).values


def test_per_rank_values_single_process(tmp_path) -> None:
    rng = torch.get_rng_state()
    tessera.save(str(tmp_path), {"rng": tessera.per_rank(rng), "pos": tessera.per_rank(17)})
    target = {"rng": tessera.per_rank(torch.zeros_like(rng)), "pos": tessera.per_rank(0)}
    tessera.load(str(tmp_path), target)
    assert torch.equal(target["rng"].value, rng) and target["pos"].value == 17


@pytest.mark.parametrize("staging", list(tessera.StagingMode))
def test_async_save_snapshots_at_the_gate(tmp_path, staging: tessera.StagingMode) -> None:
    w = torch.arange(1000, dtype=torch.float32)
    state = {"w": w, "step": 1}
    pending = tessera.async_save(str(tmp_path), state, options=tessera.SaveOptions(staging=staging))
    if staging is tessera.StagingMode.BLOCKING:
        assert pending.staged()  # the old behaviour: staged before returning
    pending.wait_staged()
    assert pending.staged()
    w.add_(1)  # training continues once the gate is passed
    state["step"] = 2
    result = pending.wait()
    assert pending.done() and result.total_bytes > 4000
    target = {"w": torch.zeros(1000), "step": 0}
    tessera.load(str(tmp_path), target)
    assert torch.equal(target["w"], torch.arange(1000, dtype=torch.float32)) and target["step"] == 1


def test_plan_cache_reused_until_structure_changes(tmp_path) -> None:
    state = {"w": torch.randn(8, 8)}
    first = tessera.save(str(tmp_path / "a"), state)
    second = tessera.save(str(tmp_path / "b"), {"w": torch.randn(8, 8)})
    changed = tessera.save(str(tmp_path / "c"), {"w": torch.randn(8, 9)})
    assert (first.plan_cached, second.plan_cached, changed.plan_cached) == (False, True, False)


def test_async_error_is_raised_on_wait_and_never_lost(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    pending = tessera.async_save(str(blocker / "ckpt"), {"w": torch.ones(3)})
    with pytest.raises(tessera.CheckpointError):
        pending.wait()
    pending = tessera.async_save(str(blocker / "ckpt2"), {"w": torch.ones(3)})
    with pytest.raises(tessera.CheckpointError):  # nobody waited: the next save raises it
        tessera.save(str(tmp_path / "ok"), {"w": torch.ones(3)})
    tessera.save(str(tmp_path / "ok"), {"w": torch.ones(3)})


def test_a_tier_path_is_refused_and_names_the_manager(tmp_path) -> None:
    """``tier::<root>`` means a CheckpointManager root with its local tier, and nothing else:
    save, async_save and load refuse it in the call, say what to use, and write nothing."""
    url = "tier::" + str(tmp_path / "ckpt")
    calls = {
        "save": lambda: tessera.save(url, {"w": torch.arange(4.0)}),
        "async_save": lambda: tessera.async_save(url, {"w": torch.arange(4.0)}),
        "load": lambda: tessera.load(url, {"w": torch.zeros(4)}),
    }
    for name, call in calls.items():
        with pytest.raises(tessera.errors.UnsupportedPathError, match=r"CheckpointManager\('tier::") as e:
            call()
        assert isinstance(e.value, ValueError) and isinstance(e.value, tessera.CheckpointError), name
        assert repr(str(tmp_path / "ckpt")) in str(e.value), name  # the durable location to use instead
    assert os.listdir(tmp_path) == []
