"""Loading into raw ``optimizer.state_dict()`` targets, and ``strict=False`` never skipping silently.

The idiom ``tessera.load(p, {"model": m.state_dict(), "optim": fresh_opt.state_dict()})``
followed by ``fresh_opt.load_state_dict(sd["optim"])`` must restore the optimizer bit for
bit, so that the next training step is the same as the original's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import tessera
from tessera.errors import MissingKeysError, StateMismatchError

Factory = Callable[[nn.Module], torch.optim.Optimizer]

OPTIMIZERS: dict[str, Factory] = {
    "adamw-2-groups": lambda m: torch.optim.AdamW(
        [{"params": [m[0].weight, m[0].bias], "lr": 1e-2}, {"params": [m[2].weight, m[2].bias], "lr": 3e-3}],
        weight_decay=0.1,
    ),
    "adam-amsgrad": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, amsgrad=True),
    "sgd-momentum": lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9, nesterov=True),
}


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _train(m: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 6, generator=g)
        opt.zero_grad()
        m(x).pow(2).mean().backward()
        opt.step()


def _same_state(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for pid, st in a["state"].items():
        assert st.keys() == b["state"][pid].keys(), pid
        for k, v in st.items():
            w = b["state"][pid][k]
            if isinstance(v, torch.Tensor):
                assert v.dtype == w.dtype and v.shape == w.shape and torch.equal(v, w), (pid, k)
            else:
                assert v == w, (pid, k)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_raw_optimizer_state_dict_round_trip_is_exact(name: str, tmp_path: Path) -> None:
    factory = OPTIMIZERS[name]
    m = _model(0)
    opt = factory(m)
    _train(m, opt, 3, seed=1)
    opt.state[m[0].weight]["note"] = 3  # a state entry that is no tensor (torch mangles strings)
    path = str(tmp_path / "ckpt")
    tessera.save(path, {"model": m.state_dict(), "optim": opt.state_dict()})

    m2 = _model(7)  # other weights, a fresh optimizer with no state
    opt2 = factory(m2)
    sd = {"model": m2.state_dict(), "optim": opt2.state_dict()}
    result = tessera.load(path, sd)
    assert result.missing_keys == [] and result.unexpected_keys == []
    m2.load_state_dict(sd["model"])
    opt2.load_state_dict(sd["optim"])
    _same_state(opt.state_dict(), opt2.state_dict())
    assert opt2.state[m2[0].weight]["note"] == 3

    _train(m, opt, 2, seed=2)  # the next steps, on the same data, are the same
    _train(m2, opt2, 2, seed=2)
    for (n, p), p2 in zip(m.named_parameters(), m2.parameters()):
        assert torch.equal(p, p2), n
    _same_state(opt.state_dict(), opt2.state_dict())


def test_a_failed_load_leaves_the_raw_state_dict_as_it_was(tmp_path: Path) -> None:
    m = _model(0)
    opt = torch.optim.AdamW(m.parameters())
    _train(m, opt, 1, seed=1)
    path = str(tmp_path / "ckpt")
    tessera.save(path, {"model": m.state_dict(), "optim": opt.state_dict()})
    m2 = _model(1)
    opt2 = torch.optim.AdamW(m2.parameters())
    sd = {"model": {k: v.to(torch.float64) for k, v in m2.state_dict().items()}, "optim": opt2.state_dict()}
    with pytest.raises(StateMismatchError, match="dtype"):
        tessera.load(path, sd)
    assert sd["optim"]["state"] == {}


def test_parameters_the_target_does_not_list_stay_unexpected(tmp_path: Path, caplog) -> None:
    m = _model(0)
    opt = torch.optim.AdamW(m.parameters())
    _train(m, opt, 2, seed=1)
    path = str(tmp_path / "ckpt")
    tessera.save(path, {"model": m.state_dict(), "optim": opt.state_dict()})
    # An optimizer over the first layer only: parameters 2 and 3 of the checkpoint have no place.
    m2 = _model(1)
    opt2 = torch.optim.AdamW(m2[0].parameters())
    sd = {"model": m2.state_dict(), "optim": opt2.state_dict()}
    with pytest.raises(MissingKeysError, match=r"wanted by no rank: 'optim.state.2.exp_avg'"):
        tessera.load(path, sd)
    assert sd["optim"]["state"] == {}
    with caplog.at_level(logging.WARNING, logger="tessera"):
        result = tessera.load(path, sd, strict=False)
    assert result.unexpected_keys == [f"optim.state.{i}.{k}" for i in (2, 3) for k in ("exp_avg", "exp_avg_sq", "step")]
    assert sorted(sd["optim"]["state"]) == [0, 1]  # what does fit is loaded
    assert "strict=False skipped" in caplog.text and "'optim.state.2.exp_avg'" in caplog.text


def test_strict_false_reports_and_logs_what_it_skipped(tmp_path: Path, caplog) -> None:
    path = str(tmp_path / "ckpt")
    m = _model(0)
    tessera.save(path, {"model": m.state_dict(), "step": 5})
    target = {"net": _model(1).state_dict(), "model": {"0.weight": torch.zeros(5, 6), "extra": torch.zeros(2)}}
    with caplog.at_level(logging.WARNING, logger="tessera"):
        result = tessera.load(path, target, strict=False)
    assert result.missing_keys == ["model.extra", *sorted(f"net.{k}" for k in m.state_dict())]
    assert result.unexpected_keys == ["model.0.bias", "model.2.bias", "model.2.weight"]
    assert torch.equal(target["model"]["0.weight"], m[0].weight)
    warning = [r for r in caplog.records if r.levelno == logging.WARNING and "strict=False" in r.getMessage()]
    assert len(warning) == 1
    text = warning[0].getMessage()
    assert "5 key(s) of the state are not in the checkpoint" in text and "'model.extra'" in text
    assert "3 key(s) of the checkpoint are not in the state" in text and "'model.2.weight'" in text

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tessera"):
        tessera.load(path, {"model": _model(2).state_dict()}, strict=False)  # nothing skipped: nothing said
    assert "strict=False" not in caplog.text


def test_a_plain_value_where_the_checkpoint_has_entries_says_what_differs(tmp_path: Path) -> None:
    m = _model(0)
    opt = torch.optim.AdamW(m.parameters())
    _train(m, opt, 1, seed=1)
    path = str(tmp_path / "ckpt")
    tessera.save(path, {"model": m.state_dict(), "optim": opt.state_dict()})
    with pytest.raises(MissingKeysError) as e:
        tessera.load(path, {"model": _model(1).state_dict(), "optim": None})
    text = str(e.value)
    assert "missing from the checkpoint: 'optim'" in text
    assert "'optim' is one plain value in the state (NoneType)" in text and "13 entries under 'optim.'" in text
    assert "tessera.OptimizerState" in text
