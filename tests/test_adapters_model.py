"""ModelState / OptimizerState in one process: ties, frozen parameters, optimizers, groups.

Single-process training is deterministic, so every comparison here is bit-exact: a run
that saves, reloads into fresh objects and continues must equal one that never stopped.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tessera
from tessera.adapters import ModelState, OptimizerState


class Tied(nn.Module):
    """An embedding tied to the output head, a frozen layer and an optional unused one."""

    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight
        self.unused = nn.Linear(6, 2) if unused else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.frozen(self.emb(ids)))))


def make(seed: int, unused: bool = False) -> Tied:
    torch.manual_seed(seed)
    return Tied(unused)


def train(model: nn.Module, opt: torch.optim.Optimizer, start: int, steps: int) -> list[float]:
    losses = []
    for k in range(start, start + steps):
        g = torch.Generator().manual_seed(k)
        ids = torch.randint(0, 11, (4, 5), generator=g)
        loss = F.cross_entropy(model(ids).flatten(0, 1), ids.roll(1, 1).flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def opt_state_by_name(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        names[id(p)]: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()} for p, st in opt.state.items()
    }


def assert_states_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name, st in a.items():
        assert st.keys() == b[name].keys(), name
        for k, v in st.items():
            assert torch.equal(v, b[name][k]) if torch.is_tensor(v) else v == b[name][k], f"{name}.{k}"


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.1),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=0.01),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5, centered=True),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_resume_into_fresh_objects_is_bit_exact(tmp_path, name: str) -> None:
    ref_model = make(0)
    ref_opt = OPTIMIZERS[name](ref_model.parameters())
    train(ref_model, ref_opt, 0, 3)
    before = opt_state_by_name(ref_model, ref_opt)
    tessera.save(str(tmp_path), {"model": ModelState(ref_model), "optim": OptimizerState(ref_model, ref_opt)})
    assert_states_equal(opt_state_by_name(ref_model, ref_opt), before)  # saving changed nothing
    model = make(1)
    opt = OPTIMIZERS[name](model.parameters())
    tessera.load(str(tmp_path), {"model": ModelState(model), "optim": OptimizerState(model, opt)})
    assert model.head.weight is model.emb.weight  # the tie survives
    for (n, p), q in zip(ref_model.named_parameters(), model.parameters()):
        assert torch.equal(p, q), n
    assert_states_equal(opt_state_by_name(model, opt), opt_state_by_name(ref_model, ref_opt))
    assert train(model, opt, 3, 2) == train(ref_model, ref_opt, 3, 2)
    for p, q in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(p, q)


def test_tied_saved_once_frozen_not_in_optimizer(tmp_path) -> None:
    model = make(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)  # frozen params included, get no state
    train(model, opt, 0, 2)
    tessera.save(str(tmp_path), {"model": ModelState(model), "optim": OptimizerState(model, opt)})
    keys = tessera.read_manifest(str(tmp_path)).keys()
    assert "model.emb.weight" in keys and "model.head.weight" not in keys
    assert "model.frozen.weight" in keys
    assert not any(k.startswith("optim.state.frozen.") for k in keys)
    assert "optim.state.emb.weight.exp_avg" in keys and not any(k.startswith("optim.state.head.") for k in keys)


def test_param_groups_restored_by_membership(tmp_path) -> None:
    model = make(0)
    mid = [model.mid.weight, model.mid.bias]
    rest = [model.emb.weight]
    opt = torch.optim.AdamW([{"params": mid, "lr": 0.01, "betas": (0.8, 0.9)}, {"params": rest, "lr": 0.03}])
    train(model, opt, 0, 1)
    tessera.save(str(tmp_path), {"optim": OptimizerState(model, opt)})
    # other order, other hyperparameters: restored by which parameters a group holds
    m2 = make(1)
    opt2 = torch.optim.AdamW(
        [{"params": [m2.emb.weight], "lr": 1.0}, {"params": [m2.mid.weight, m2.mid.bias], "lr": 2.0}]
    )
    tessera.load(str(tmp_path), {"optim": OptimizerState(m2, opt2)})
    assert opt2.param_groups[0]["lr"] == 0.03 and opt2.param_groups[0]["betas"] == (0.9, 0.999)
    assert opt2.param_groups[1]["lr"] == 0.01 and opt2.param_groups[1]["betas"] == (0.8, 0.9)
    # a group mixing parameters of two saved groups cannot be restored
    m3 = make(1)
    opt3 = torch.optim.AdamW([{"params": [m3.emb.weight, m3.mid.weight]}, {"params": [m3.mid.bias]}])
    with pytest.raises(tessera.StateMismatchError, match="saved groups"):
        tessera.load(str(tmp_path), {"optim": OptimizerState(m3, opt3)})


def test_checkpoint_of_a_fresh_optimizer_loads_as_fresh(tmp_path) -> None:
    model = make(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    tessera.save(str(tmp_path), {"model": ModelState(model), "optim": OptimizerState(model, opt)})
    assert len(opt.state) == 0  # a save never initializes the live optimizer
    assert tessera.read_manifest(str(tmp_path)).values["optim.has_state"] is False
    trained = make(1)
    trained_opt = torch.optim.Adam(trained.parameters(), lr=0.01)
    train(trained, trained_opt, 0, 2)
    tessera.load(str(tmp_path), {"model": ModelState(trained), "optim": OptimizerState(trained, trained_opt)})
    assert len(trained_opt.state) == 0
    assert train(trained, trained_opt, 0, 3) == train(model, opt, 0, 3)  # step counts start at 0 again


def test_unused_parameter_gets_no_state_on_load(tmp_path) -> None:
    model = make(0, unused=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train(model, opt, 0, 2)
    assert model.unused.weight not in opt.state
    path = str(tmp_path)
    tessera.save(path, {"model": ModelState(model), "optim": OptimizerState(model, opt)})
    saved_keys = tessera.read_manifest(path).keys()
    assert "optim.state.unused.weight.exp_avg" not in saved_keys
    m2 = make(1, unused=True)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=0.01)
    # a fresh optimizer describes no state of its own (nothing is stepped to make some)
    assert OptimizerState(m2, opt2).state_dict()["state"] == {}
    assert len(opt2.state) == 0
    # the checkpoint's own keys give exactly the states it holds
    optim_state = OptimizerState(m2, opt2)
    optim_state.prepare_load(tessera.read_manifest(path), "optim")
    assert "unused.weight" not in optim_state.state_dict()["state"]
    optim_state.prepare_load(tessera.read_manifest(path), "optim")
    tessera.load(path, {"model": ModelState(m2), "optim": optim_state})
    assert m2.unused.weight not in opt2.state
    assert_states_equal(opt_state_by_name(m2, opt2), opt_state_by_name(model, opt))
    assert train(m2, opt2, 2, 2) == train(model, opt, 2, 2)


def test_model_state_loads_a_full_state_dict_and_strips_wrappers() -> None:
    src, dst = make(0), make(1)
    compiled = torch.compile(dst)  # compilation is lazy: nothing is compiled here
    state = ModelState(compiled)
    assert set(state.state_dict()) == {"emb.weight", "frozen.weight", "frozen.bias", "mid.weight", "mid.bias"}
    state.load_state_dict({k: v for k, v in src.state_dict().items() if k != "head.weight"})
    for p, q in zip(src.parameters(), dst.parameters()):
        assert torch.equal(p, q)
    with pytest.raises(tessera.MissingKeysError, match="mid.bias"):
        state.load_state_dict({"emb.weight": src.emb.weight, "frozen.weight": src.frozen.weight})
    with pytest.raises(tessera.StateMismatchError, match="shape"):
        state.load_state_dict({**src.state_dict(), "mid.bias": torch.zeros(3)}, strict=False)


def test_optimizer_over_a_foreign_parameter_is_refused() -> None:
    model = make(0)
    opt = torch.optim.SGD([*model.parameters(), nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(ValueError, match="not a parameter of the model"):
        OptimizerState(model, opt).state_dict()


def test_model_parts_and_several_optimizers(tmp_path) -> None:
    """Pipeline-style: two model parts with disjoint FQNs, one optimizer each, one checkpoint."""
    a, b = make(0), make(2)
    oa, ob = torch.optim.Adam(a.parameters(), lr=0.01), torch.optim.SGD(b.mid.parameters(), lr=0.1, momentum=0.9)
    train(a, oa, 0, 1)
    train(b, ob, 0, 1)
    parts = [nn.ModuleDict({"a": a}), nn.ModuleDict({"b": b})]
    tessera.save(str(tmp_path), {"model": ModelState(parts), "optim": OptimizerState(parts, [oa, ob])})
    saved_keys = tessera.read_manifest(str(tmp_path)).keys()
    assert "optim.state.b.mid.weight.momentum_buffer" in saved_keys
    a2, b2 = make(5), make(6)
    oa2, ob2 = torch.optim.Adam(a2.parameters(), lr=0.01), torch.optim.SGD(b2.mid.parameters(), lr=0.1, momentum=0.9)
    parts2 = [nn.ModuleDict({"a": a2}), nn.ModuleDict({"b": b2})]
    tessera.load(str(tmp_path), {"model": ModelState(parts2), "optim": OptimizerState(parts2, [oa2, ob2])})
    assert_states_equal(opt_state_by_name(a2, oa2), opt_state_by_name(a, oa))
    assert_states_equal(opt_state_by_name(b2, ob2), opt_state_by_name(b, ob))
    assert train(b2, ob2, 1, 2) == train(b, ob, 1, 2)
    with pytest.raises(ValueError, match="two different tensors"):
        ModelState([a, b]).state_dict()
