"""Real megatron-core (CPU, gloo): train, save natively and as ``torch_dist``, load under other layouts.

Megatron-Core itself is the judge: every target layout loads Megatron's own ``torch_dist``
checkpoint with ``megatron.core.dist_checkpointing.load``, and the same layout loads
tessera's native checkpoint (:func:`save_sharded_state_dict`), the ``torch_dist``
checkpoint converted by :func:`import_torch_dist`, and a checkpoint saved through the
:class:`MegatronCoreState` Stateful. Model parameters and optimizer state (Adam moments,
the common step, param-group hyperparameters) must be bit-identical to Megatron's load.

The CUDA-only spots of megatron-core 0.16 that the harness works around are listed in
``tests/mcore_cpu.py`` and docs/frameworks.md.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (the interop extra)")
pytest.importorskip("psutil", reason="megatron-core's torch_dist writer needs psutil (the interop extra)")

from tests.dist_utils import run_distributed

pytestmark = [pytest.mark.interop, pytest.mark.slow]

STEPS = 2
KINDS = ("native", "converted", "stateful")


def _ssd(model: Any, opt: Any, loading: bool, iteration: int = 0) -> dict[str, Any]:
    m = model.sharded_state_dict()
    return {"model": m, "optimizer": opt.sharded_state_dict(m, is_loading=loading), "iteration": iteration}


def _save(rank: int, world: int, root: str, layout: dict[str, int], experts: int | None) -> dict[str, Any]:
    from megatron.core import dist_checkpointing

    import tessera
    from tessera.adapters.megatron_core import MegatronCoreState, save_sharded_state_dict
    from tessera.convert.megatron import import_torch_dist
    from tests import mcore_cpu as mc

    mc.init_parallel(**layout)
    model = mc.build_gpt(1, moe_experts=experts)
    opt = mc.build_optimizer(model)
    mc.train(model, opt, STEPS)
    if rank == 0:
        os.makedirs(f"{root}/mcore", exist_ok=True)
    torch.distributed.barrier()
    with mc.cuda_calls_on_cpu():
        dist_checkpointing.save(_ssd(model, opt, False, STEPS), f"{root}/mcore")
    save_sharded_state_dict(f"{root}/native", _ssd(model, opt, False, STEPS))
    tessera.save(f"{root}/stateful", {"mcore": MegatronCoreState(model, opt), "iteration": STEPS})
    if rank == 0:
        import_torch_dist(f"{root}/mcore", f"{root}/converted")
    torch.distributed.barrier()
    return {"params": sum(p.numel() for p in model.parameters())}


def _optim_state(opt: Any) -> dict[str, Any]:
    sd = opt.state_dict()
    groups = [{k: v for k, v in g.items() if k != "params"} | {"n": len(g["params"])} for g in sd["param_groups"]]
    return {"state": sd["state"], "groups": groups}


def _assert_same(kind: str, ref_model: Any, ref_opt: Any, model: Any, opt: Any) -> int:
    from tests import mcore_cpu as mc

    a, b = mc.local_state(ref_model), mc.local_state(model)
    assert a.keys() == b.keys(), kind
    for k in a:
        assert torch.equal(a[k], b[k]), f"{kind}: parameter {k} differs from megatron's own load"
    ra, rb = _optim_state(ref_opt), _optim_state(opt)
    assert ra["groups"] == rb["groups"], kind
    assert ra["state"].keys() == rb["state"].keys() and ra["state"], kind
    for i, st in ra["state"].items():
        assert st.keys() == rb["state"][i].keys() and {"exp_avg", "exp_avg_sq", "step"} <= st.keys(), (kind, i)
        for key, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(rb["state"][i][key])), f"{kind}: optimizer {i}.{key}"
    return len(a)


def _load(rank: int, world: int, root: str, layouts: list[dict[str, int]], experts: int | None) -> list[int]:
    from megatron.core import dist_checkpointing

    import tessera
    from tessera.adapters.megatron_core import MegatronCoreState, load_sharded_state_dict
    from tests import mcore_cpu as mc

    compared = []
    for layout in layouts:
        mc.init_parallel(**layout)
        ref_model = mc.build_gpt(7, moe_experts=experts)
        ref_opt = mc.build_optimizer(ref_model)
        fresh = mc.local_state(ref_model)
        with mc.cuda_calls_on_cpu():
            ref = dist_checkpointing.load(_ssd(ref_model, ref_opt, True), f"{root}/mcore")
        ref_model.load_state_dict(ref["model"])
        ref_opt.load_state_dict(ref["optimizer"])
        assert ref["iteration"] == STEPS
        assert any(not torch.equal(fresh[k], v) for k, v in mc.local_state(ref_model).items())
        for kind in KINDS:
            model = mc.build_gpt(11, moe_experts=experts)
            opt = mc.build_optimizer(model)
            if kind == "stateful":
                state = {"mcore": MegatronCoreState(model, opt), "iteration": 0}
                tessera.load(f"{root}/stateful", state)
                assert state["iteration"] == STEPS
            else:
                got = load_sharded_state_dict(f"{root}/{kind}", _ssd(model, opt, True))
                assert got["iteration"] == STEPS, kind
                model.load_state_dict(got["model"])
                opt.load_state_dict(got["optimizer"])
            compared.append(_assert_same(f"{kind} at {layout}", ref_model, ref_opt, model, opt))
    return compared


@pytest.fixture(scope="module")
def gpt_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny GPT trained 2 steps under TP=2 (SwiGLU, GQA), saved four ways."""
    root = str(tmp_path_factory.mktemp("mcore-gpt"))
    run_distributed(_save, 2, root, {"tp": 2}, None, timeout=600)
    return root


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny MoE GPT (4 experts, top-2) trained 2 steps under EP=2, saved four ways."""
    root = str(tmp_path_factory.mktemp("mcore-moe"))
    run_distributed(_save, 2, root, {"ep": 2}, 4, timeout=600)
    return root


def test_gpt_tp2_loads_at_pp2_and_dp2(gpt_ckpt: str) -> None:
    results = run_distributed(_load, 2, gpt_ckpt, [{"pp": 2}, {"tp": 1}], None, timeout=600)
    assert all(n > 0 for r in results for n in r) and len(results[0]) == 2 * len(KINDS)


def test_gpt_tp2_loads_into_one_dense_process(gpt_ckpt: str) -> None:
    (compared,) = run_distributed(_load, 1, gpt_ckpt, [{}], None, timeout=600)
    assert len(compared) == len(KINDS) and all(n > 0 for n in compared)


def test_moe_ep2_loads_at_ep1_with_expert_tp2(moe_ckpt: str) -> None:
    # EP=2 -> EP=1 with TP=2 and expert-tensor-parallel 2: experts regrouped, then split by rows.
    results = run_distributed(_load, 2, moe_ckpt, [{"tp": 2, "ep": 1, "etp": 2}], 4, timeout=600)
    assert all(n > 0 for r in results for n in r)


def test_moe_ep2_loads_into_one_dense_process(moe_ckpt: str) -> None:
    (compared,) = run_distributed(_load, 1, moe_ckpt, [{}], 4, timeout=600)
    assert len(compared) == len(KINDS)


def test_native_checkpoint_names_are_megatron_keys(gpt_ckpt: str) -> None:
    import tessera

    native = tessera.read_manifest(f"{gpt_ckpt}/native")
    converted = tessera.read_manifest(f"{gpt_ckpt}/converted")
    # The same global tensors under the same names and shapes, whichever way they were written.
    assert {k: e.shape for k, e in native.tensors.items()} == {k: e.shape for k, e in converted.tensors.items()}
    assert native.tensors["decoder.layers.self_attention.linear_qkv.weight"].shape == (2, 32, 16)
    assert "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight" in native.tensors
    assert "common" in native.values and "common" in converted.values


def test_cli_detects_torch_dist_and_converts_it_like_the_api(gpt_ckpt: str, tmp_path) -> None:
    from tessera.cli import main
    from tessera.convert import Format, detect_format, diff_checkpoints

    # Megatron's torch_dist is DCP plus common.pt and metadata.json: never mistaken for plain DCP
    # (which would drop common.pt), and it needs no layout spec.
    assert detect_format(f"{gpt_ckpt}/mcore") is Format.MEGATRON
    assert main(["convert", f"{gpt_ckpt}/mcore", str(tmp_path / "cli")]) == 0
    report = diff_checkpoints(f"{gpt_ckpt}/converted", str(tmp_path / "cli"))
    assert report.identical and report.same_tensors > 0 and report.same_values > 0, report


# ----------------------------------------------------------------------------------------
# The layout spec (legacy per-rank files) on a real MoE model: EP ranks' local state dicts.


def _moe_spec() -> Any:
    from tessera.adapters.megatron import gpt_spec
    from tests import mcore_cpu as mc

    return gpt_spec(num_layers=2, vocab_size=mc.VOCAB, num_attention_heads=4, num_query_groups=2, kv_channels=4,
                    ffn_hidden_size=32, swiglu=True, make_vocab_size_divisible_by=1, num_moe_experts=4,
                    moe_ffn_hidden_size=24)  # fmt: skip


def _legacy_moe(rank: int, world: int, root: str, targets: list[dict[str, int]]) -> list[int]:
    from megatron.core import parallel_state as ps

    import tessera
    from tessera.adapters.megatron import global_shapes_from_manifest
    from tessera.adapters.megatron_core import load_sharded_state_dict, save_sharded_state_dict
    from tessera.convert.megatron import import_megatron
    from tests import mcore_cpu as mc

    mc.init_parallel(ep=2)
    model = mc.build_gpt(1, moe_experts=4)
    opt = mc.build_optimizer(model)
    mc.train(model, opt, STEPS)
    # Megatron-LM's legacy layout under EP=2, PP=1: iter_*/mp_rank_<tp>_<ep>/model_optim_rng.pt
    d = f"{root}/legacy/iter_{STEPS:07d}/mp_rank_00_{ps.get_expert_model_parallel_rank():03d}"
    os.makedirs(d)
    torch.save({"model": model.state_dict(), "iteration": STEPS, "checkpoint_version": 3.0}, f"{d}/model_optim_rng.pt")
    save_sharded_state_dict(f"{root}/native", {"model": model.sharded_state_dict()})
    torch.distributed.barrier()
    if rank == 0:
        with open(f"{root}/legacy/latest_checkpointed_iteration.txt", "w") as f:
            f.write(str(STEPS))
        import_megatron(f"{root}/legacy", f"{root}/converted", spec=_moe_spec(), expert_parallel=True)
    torch.distributed.barrier()
    spec = _moe_spec()
    compared = []
    for layout in targets:
        mc.init_parallel(**layout)
        ref = mc.build_gpt(7, moe_experts=4)
        ref.load_state_dict(load_sharded_state_dict(f"{root}/native", {"model": ref.sharded_state_dict()})["model"])
        model = mc.build_gpt(11, moe_experts=4)
        local = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        coords = dict(tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
                      pp_rank=0, pp_size=1)  # fmt: skip
        ep = dict(ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ps.get_expert_model_parallel_world_size(),
                  etp_rank=ps.get_expert_tensor_parallel_rank(), etp_size=ps.get_expert_tensor_parallel_world_size())  # fmt: skip
        shapes = global_shapes_from_manifest(tessera.read_manifest(f"{root}/converted"), prefix="model.")
        empty = spec.empty_local(shapes, *coords.values(), **ep)
        assert {k: tuple(v.shape) for k, v in empty.items()} == {
            k: tuple(v.shape) for k, v in local.items() if "_extra_state" not in k
        }
        res = tessera.load(f"{root}/converted", {"model": spec.global_targets(local, *coords.values(), **ep)})
        assert res.missing_keys == []
        a, b = mc.local_state(ref), mc.local_state(model)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), f"{k} at {layout}: the layout spec disagrees with megatron's sharding"
        compared.append(len(a))
    return compared


def test_layout_spec_moe_ep2_files_load_at_expert_tp2_and_dense(tmp_path) -> None:
    results = run_distributed(_legacy_moe, 2, str(tmp_path), [{"tp": 2, "etp": 2}, {}], timeout=600)
    assert all(n > 0 for r in results for n in r)
