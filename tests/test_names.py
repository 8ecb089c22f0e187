"""Names are unique, values that do not collide are never dropped, nesting is bounded.

Issue #10 items 5 and 8: flattening refuses two entries that join to one FQN (naming both
sources) instead of saving one tensor and loading it into both, keeps a plain value that
sits beside dotted keys, and a state nested absurdly deep is a typed error, not a bare
``RecursionError``, at save and at load.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import tessera
from tessera.errors import InvalidStateError
from tessera.format.values import MAX_DEPTH
from tests.dist_utils import run_distributed

NO_TIMINGS = tessera.LoadOptions(record_timings=False)


def test_a_value_beside_dotted_keys_round_trips(tmp_path) -> None:
    path = str(tmp_path / "c")
    shadow = torch.arange(6, dtype=torch.float32)
    tessera.save(path, {"ema.shadow": shadow, "ema": {"decay": 0.999, "updates": 1234}})
    target = {"ema.shadow": torch.zeros(6), "ema": {"decay": 0.0, "updates": 0}}
    result = tessera.load(path, target, options=NO_TIMINGS)
    assert torch.equal(target["ema.shadow"], shadow)
    assert target["ema"] == {"decay": 0.999, "updates": 1234}
    assert result.missing_keys == [] and result.unexpected_keys == []


def test_an_empty_container_beside_dotted_keys_round_trips(tmp_path) -> None:
    # An empty container where the checkpoint has dotted keys under its name wants nothing.
    path = str(tmp_path / "c")
    tessera.save(path, {"a.b": torch.ones(2), "a": {}})
    target = {"a.b": torch.zeros(2), "a": {}}
    tessera.load(path, target, options=NO_TIMINGS)
    assert torch.equal(target["a.b"], torch.ones(2)) and target["a"] == {}


COLLISIONS = {
    "dotted-key-vs-nested": (
        {"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}},
        "a.b",
        "state['a.b']",
        "state['a']['b']",
    ),
    "list-index-vs-dict-key": (
        {"m": {"x": [torch.ones(2)], "x.0": torch.zeros(2)}},
        "m.x.0",
        "state['m']['x'][0]",
        "state['m']['x.0']",
    ),
    "value-vs-tensor": ({"a.b": 1, "a": {"b": torch.zeros(2)}}, "a.b", "state['a.b']", "state['a']['b']"),
    "dotted-prefix-vs-list": (
        {"m.x": [torch.ones(2)], "m": {"x.0": torch.zeros(2)}},
        "m.x.0",
        "state['m.x'][0]",
        "state['m']['x.0']",
    ),
}


@pytest.mark.parametrize("case", COLLISIONS, ids=list(COLLISIONS))
def test_colliding_names_are_refused_at_save_naming_both(tmp_path, case: str) -> None:
    state, name, first, second = COLLISIONS[case]
    path = str(tmp_path / "c")
    with pytest.raises(InvalidStateError) as info:
        tessera.save(path, state)
    message = str(info.value)
    assert f"'{name}'" in message and first in message and second in message, message
    assert not os.path.exists(os.path.join(path, "manifest.json"))


@pytest.mark.parametrize("case", COLLISIONS, ids=list(COLLISIONS))
def test_colliding_names_are_refused_at_load_before_any_write(tmp_path, case: str) -> None:
    state, name, _, _ = COLLISIONS[case]
    path = str(tmp_path / "c")
    tessera.save(path, {name: torch.full((2,), 5.0)})
    tensors = [v for v in _tensors(state)]
    before = [t.clone() for t in tensors]
    with pytest.raises(InvalidStateError, match=f"'{name}'"):
        tessera.load(path, state, strict=False, options=NO_TIMINGS)
    assert all(torch.equal(a, b) for a, b in zip(tensors, before)), "nothing may be written on a refused load"


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _nested(depth: int, leaf: object, kind: str = "list") -> object:
    v = leaf
    for _ in range(depth):
        v = [v] if kind == "list" else {"k": v}
    return v


@pytest.mark.parametrize("kind", ["list", "dict", "dict-with-tensor"])
def test_a_value_nested_600_deep_is_a_typed_error_at_save(tmp_path, kind: str) -> None:
    leaf = torch.ones(1) if kind == "dict-with-tensor" else 1
    state = {"w": torch.ones(2), "deep": _nested(600, leaf, "list" if kind == "list" else "dict")}
    with pytest.raises(InvalidStateError, match="'deep'.*levels deep"):
        tessera.save(str(tmp_path / "c"), state)


def test_a_target_nested_600_deep_is_a_typed_error_at_load(tmp_path) -> None:
    path = str(tmp_path / "c")
    tessera.save(path, {"w": torch.ones(2), "deep": 1})
    target = {"w": torch.zeros(2), "deep": _nested(600, 0)}
    with pytest.raises(InvalidStateError, match="'deep'"):
        tessera.load(path, target, options=NO_TIMINGS)
    assert torch.equal(target["w"], torch.zeros(2))


def test_a_stored_value_nested_600_deep_is_a_manifest_error_at_load(tmp_path) -> None:
    path = str(tmp_path / "c")
    tessera.save(path, {"w": torch.ones(2), "deep": 1})
    mpath = os.path.join(path, "manifest.json")
    doc = json.loads(Path(mpath).read_bytes())
    doc["values"]["deep"] = _nested(600, 1)
    with open(mpath, "w") as f:
        json.dump(doc, f)
    target = {"w": torch.zeros(2), "deep": 0}
    with pytest.raises(tessera.errors.ManifestError, match="'deep'"):
        tessera.load(path, target, options=NO_TIMINGS)
    assert torch.equal(target["w"], torch.zeros(2)) and target["deep"] == 0
    report = tessera.verify(path)
    assert not report.ok and any("'deep'" in p.message for p in report.problems)


def test_nesting_up_to_the_limit_round_trips(tmp_path) -> None:
    path = str(tmp_path / "c")
    value = _nested(MAX_DEPTH - 1, 7)
    tessera.save(path, {"w": torch.ones(2), "v": value})
    target = {"w": torch.zeros(2), "v": None}
    tessera.load(path, target, options=NO_TIMINGS)
    assert target["v"] == value


def _collide_on_rank1(rank: int, world: int, path: str) -> tuple[str, str]:
    t = torch.ones(2)
    state = {"a.b": t, "a": {"b": t}} if rank == 1 else {"a.b": t}
    try:
        tessera.save(path, state)
    except tessera.CheckpointError as e:
        return type(e).__name__, str(e)
    return "no error", ""


def test_a_collision_on_one_rank_fails_every_rank_with_the_same_type(tmp_path) -> None:
    out = run_distributed(_collide_on_rank1, 2, str(tmp_path / "c"))
    for kind, message in out:
        assert kind == "InvalidStateError" and "'a.b'" in message, (kind, message)
    assert "rank 1" in out[0][1]
