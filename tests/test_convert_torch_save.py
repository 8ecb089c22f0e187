"""A single ``torch.save`` file <-> tessera, checked with ``torch.load`` and ``load_state_dict``."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

import tessera
from tessera.convert import export_torch_save, import_torch_save


class Opaque:
    def __init__(self, x: int) -> None:
        self.x = x


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))


def test_export_loads_into_a_model(tmp_path) -> None:
    model = _model()
    ck = str(tmp_path / "ck")
    tessera.save(ck, {"model": model.state_dict(), "step": 9, "ids": torch.arange(4)})
    out = str(tmp_path / "out" / "model.pt")
    result = export_torch_save(ck, out, prefix="model.", block_bytes=8)  # many tiny blocks
    assert result.tensors == len(model.state_dict()) and result.values == 0
    fresh = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))
    fresh.load_state_dict(torch.load(out, weights_only=True))
    x = torch.randn(2, 6)
    assert torch.equal(fresh(x), model(x))
    assert os.listdir(tmp_path / "out") == ["model.pt"]  # the scratch files are gone
    # The whole checkpoint, values included, with a cast of the floating-point tensors.
    export_torch_save(ck, out, dtype=torch.float16)
    whole = torch.load(out, weights_only=True)
    assert whole["step"] == 9 and whole["ids"].dtype == torch.int64
    assert whole["model.0.weight"].dtype == torch.float16
    assert torch.equal(whole["model.0.weight"], model.state_dict()["0.weight"].half())


def test_import_nested_file(tmp_path) -> None:
    model = _model()
    src = str(tmp_path / "in.pt")
    torch.save({"model": model.state_dict(), "optim": {"state": {0: {"exp_avg": torch.ones(5, 6)}}, "param_groups": [{"lr": 0.1}]},
                "epoch": 2}, src)  # fmt: skip
    r = import_torch_save(src, str(tmp_path / "ck"), block_bytes=16)
    assert r.tensors == len(model.state_dict()) + 1 and r.values == 2
    m = tessera.read_manifest(str(tmp_path / "ck"))
    assert "optim.state.0.exp_avg" in m.tensors and len(m.tensors["model.0.weight"].tiles) > 1
    target = {"model": {n: torch.zeros_like(t) for n, t in model.state_dict().items()}, "epoch": 0}
    tessera.load(str(tmp_path / "ck"), target, strict=False)
    assert all(torch.equal(target["model"][n], t) for n, t in model.state_dict().items()) and target["epoch"] == 2


def test_import_needs_pickle_opt_in(tmp_path) -> None:
    src = str(tmp_path / "in.pt")
    torch.save({"w": torch.ones(3), "obj": Opaque(5)}, src)
    with pytest.raises(pickle.UnpicklingError):
        import_torch_save(src, str(tmp_path / "ck"))
    assert not os.path.exists(tmp_path / "ck" / "manifest.json")
    r = import_torch_save(src, str(tmp_path / "ck"), allow_pickle=True, prefix="x.")
    assert r.tensors == 1 and r.values == 1
    target = {"x": {"w": torch.zeros(3), "obj": None}}
    tessera.load(str(tmp_path / "ck"), target, allow_pickle=True)
    assert target["x"]["obj"].x == 5 and torch.equal(target["x"]["w"], torch.ones(3))


def test_import_over_a_checkpoint_commits_like_a_save(tmp_path) -> None:
    """A converter commits through tessera.engine.commit: no temporary manifest, load timings or older files stay."""
    from tessera.cli import EXIT_OK, main

    ck = tmp_path / "ck"
    tessera.save(str(ck), {"w": torch.arange(6.0)})
    tessera.load(str(ck), {"w": torch.zeros(6)})  # records its timings beside the checkpoint
    assert os.listdir(ck / "timings")
    (ck / "manifest.json.tmp-0123abcd").write_bytes(b"{")  # a writer that died mid-commit
    old_data = set(os.listdir(ck / "data"))
    src = str(tmp_path / "in.pt")
    torch.save({"w": torch.ones(2, 3), "step": 4}, src)
    import_torch_save(src, str(ck))
    names = os.listdir(ck)
    assert not [n for n in names if n.startswith("manifest.json.tmp")], names
    assert "timings" not in names
    assert not (ck / ".tessera-saves").exists() or not os.listdir(ck / ".tessera-saves")  # no owner marker left
    m = tessera.read_manifest(str(ck))
    assert set(os.listdir(ck / "data")) == {m.save_id} and not old_data & {m.save_id}
    assert {f"data/{m.save_id}/{n}" for n in os.listdir(ck / "data" / m.save_id)} == {f.path for f in m.files}
    assert main(["verify", str(ck)]) == EXIT_OK
    target = {"w": torch.zeros(2, 3), "step": 0}
    tessera.load(str(ck), target)
    assert torch.equal(target["w"], torch.ones(2, 3)) and target["step"] == 4
