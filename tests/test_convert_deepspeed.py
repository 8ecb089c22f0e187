"""DeepSpeed ZeRO stage 1/2/3 checkpoints -> tessera, compared with the consolidated truth.

Checkpoints of the real DeepSpeed engine are the judge in ``test_interop_deepspeed.py``. The
hand-written files here cover what the real engine cannot give: error paths (a missing rank
file, ``param_shapes`` that disagree with the partitions), older files (padded last
partitions, ``shared_params`` as a list of pairs), the command line, and runs without
DeepSpeed installed. ``write_zero_checkpoint`` below writes the files the way DeepSpeed's engine did (``mp_rank_00_model_states.pt`` / per-rank
``zero_pp_rank_<r>_mp_rank_00_{model,optim}_states.pt``, flat fp32 partitions padded to a
multiple of ``2 * world`` for stage 1/2, per-parameter ``ceil(numel / world)`` partitions for
stage 3), following the layout ``zero_to_fp32.py`` consolidates.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict

import pytest
import torch

import tessera
from tessera.cli import main
from tessera.convert import import_deepspeed
from tessera.errors import CorruptCheckpointError

DS_VERSION = "0.16.4"


def _model() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(trainable params, buffers, frozen params) of a small model, fp32, odd sizes."""
    g = torch.Generator().manual_seed(0)
    params = {
        "embed.weight": torch.randn(11, 6, generator=g),
        "layers.0.weight": torch.randn(7, 6, generator=g),
        "layers.0.bias": torch.randn(7, generator=g),
        "layers.1.weight": torch.randn(5, 7, generator=g),
        "layers.1.bias": torch.randn(5, generator=g),
        "norm.weight": torch.randn(5, generator=g),
    }
    buffers = {"rope.inv_freq": torch.arange(3, dtype=torch.float32)}
    frozen = {"pos.weight": torch.randn(4, 3, generator=g)}
    return params, buffers, frozen


def _adam(params: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    return {n: {"exp_avg": p * 0.5 + 1, "exp_avg_sq": p * p + 2} for n, p in params.items()}


GROUPS = [["embed.weight", "layers.0.weight", "layers.0.bias"], ["layers.1.weight", "layers.1.bias", "norm.weight"]]


def write_zero_checkpoint(root: str, stage: int, world: int, *, shared: bool = False) -> str:
    """Write a ZeRO checkpoint of ``_model()`` under ``root/global_step5`` (+ ``latest``)."""
    params, buffers, frozen = _model()
    adam = _adam(params)
    d = os.path.join(root, "global_step5")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("global_step5")
    param_shapes = [OrderedDict((n, params[n].shape) for n in group) for group in GROUPS]
    shared_params = [["lm_head.weight", "embed.weight"]] if shared else []
    pgroups = [
        {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False, "params": [i]}
        for i in range(len(GROUPS))
    ]
    common = {
        "buffer_names": list(buffers), "param_shapes": param_shapes, "frozen_param_shapes": OrderedDict((n, t.shape) for n, t in frozen.items()),
        "shared_params": shared_params, "lr_scheduler": {"last_epoch": 5, "base_lrs": [1e-3, 1e-3]}, "sparse_tensor_module_names": set(),
        "skipped_steps": 0, "global_steps": 5, "global_samples": 40, "dp_world_size": world, "mp_world_size": 1,
        "ds_config": {"zero_optimization": {"stage": stage}, "train_batch_size": 8}, "ds_version": DS_VERSION,
    }  # fmt: skip
    if stage in (1, 2):
        module = (
            {n: t.to(torch.bfloat16) for n, t in params.items()}
            | dict(buffers)
            | {n: t.to(torch.bfloat16) for n, t in frozen.items()}
        )
        if shared:
            module["lm_head.weight"] = module["embed.weight"]
        # Stage 2 also stores frozen parameters whole (in the model dtype); stage 1 only in the module.
        frags = {n: t.to(torch.bfloat16) for n, t in frozen.items()} if stage == 2 else None
        torch.save(
            {"module": module, "optimizer": None, "frozen_param_fragments": frags, **common},
            os.path.join(d, "mp_rank_00_model_states.pt"),
        )
        flats = {}
        for gi, group in enumerate(GROUPS):
            for key, src in (("fp32", None), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
                vec = torch.cat([(params[n] if src is None else adam[n][src]).reshape(-1) for n in group])
                align = 2 * world
                vec = torch.cat([vec, torch.zeros(-len(vec) % align)])
                flats[(gi, key)] = vec.chunk(world)
        for r in range(world):
            osd = {
                "loss_scaler": None, "dynamic_loss_scale": False, "overflow": False, "clip_grad": 1.0,
                "base_optimizer_state": {
                    "state": {gi: {"step": torch.tensor(5.0), "exp_avg": flats[(gi, "exp_avg")][r].clone(),
                                   "exp_avg_sq": flats[(gi, "exp_avg_sq")][r].clone()} for gi in range(len(GROUPS))},
                    "param_groups": pgroups,
                },
                "single_partition_of_fp32_groups": [flats[(gi, "fp32")][r].clone() for gi in range(len(GROUPS))],
                "zero_stage": stage, "group_paddings": [0, 0], "partition_count": [world] * len(GROUPS), "ds_version": DS_VERSION,
            }  # fmt: skip
            name = (
                f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
                if stage == 1
                else f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
            )
            torch.save(
                {"optimizer_state_dict": osd, "ds_config": common["ds_config"], "ds_version": DS_VERSION},
                os.path.join(d, name),
            )
        return d

    # Stage 3: every parameter partitioned on its own.
    def part(t: torch.Tensor, r: int) -> torch.Tensor:
        n = t.numel()
        per = math.ceil(n / world)
        padded = torch.cat([t.reshape(-1), torch.zeros(per * world - n)])
        return padded[r * per : (r + 1) * per]

    for r in range(world):
        module = {n: torch.empty(0, dtype=torch.bfloat16) for n in params} | dict(buffers)
        frags = {n: part(t, r).to(torch.bfloat16) for n, t in frozen.items()}
        torch.save({"module": module, "optimizer": None, "frozen_param_fragments": frags, **common},
                   os.path.join(d, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"))  # fmt: skip
        groups = [torch.cat([part(params[n], r) for n in g]) for g in GROUPS]
        state = {gi: {"step": torch.tensor(5.0), "exp_avg": torch.cat([part(adam[n]["exp_avg"], r) for n in g]),
                      "exp_avg_sq": torch.cat([part(adam[n]["exp_avg_sq"], r) for n in g])} for gi, g in enumerate(GROUPS)}  # fmt: skip
        osd = {"zero_stage": 3, "loss_scaler": None, "dynamic_loss_scale": False, "overflow": False, "partition_count": world,
               "optimizer_state_dict": {"state": state, "param_groups": pgroups}, "fp32_flat_groups": groups}  # fmt: skip
        torch.save({"optimizer_state_dict": osd, "ds_config": common["ds_config"], "ds_version": DS_VERSION},
                   os.path.join(d, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))  # fmt: skip
    return d


def _check(path: str, *, shared: bool = False) -> None:
    params, buffers, frozen = _model()
    adam = _adam(params)
    frozen = {n: t.to(torch.bfloat16) for n, t in frozen.items()}  # frozen weights have no fp32 master
    model = {n: torch.zeros_like(t) for n, t in {**params, **buffers, **frozen}.items()}
    if shared:
        model["lm_head.weight"] = torch.zeros_like(params["embed.weight"])
    optim = {"state": {n: {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p), "step": torch.tensor(0.0)} for n, p in params.items()},
             "param_groups": None, "has_state": False}  # fmt: skip
    tessera.load(path, {"model": model, "optim": optim})
    for n, t in {**params, **buffers, **frozen}.items():
        assert torch.equal(model[n], t), n
    if shared:
        assert torch.equal(model["lm_head.weight"], params["embed.weight"])
    for n in params:
        assert torch.equal(optim["state"][n]["exp_avg"], adam[n]["exp_avg"]), n
        assert torch.equal(optim["state"][n]["exp_avg_sq"], adam[n]["exp_avg_sq"]), n
        assert optim["state"][n]["step"].item() == 5.0
    assert optim["param_groups"][1]["params"] == GROUPS[1]
    assert optim["param_groups"][0]["betas"] == (0.9, 0.999)


@pytest.mark.parametrize("stage,world", [(1, 2), (2, 3), (2, 4), (3, 3), (3, 4)])
def test_zero_to_tessera_equals_consolidated_truth(tmp_path, stage: int, world: int) -> None:
    write_zero_checkpoint(str(tmp_path / "ds"), stage, world, shared=stage == 2)
    result = import_deepspeed(str(tmp_path / "ds"), str(tmp_path / "ck"), file_bytes=300, tied_aliases=True)
    assert result.files > 1  # small data files: several flushes happened
    _check(str(tmp_path / "ck"), shared=stage == 2)
    m = tessera.read_manifest(str(tmp_path / "ck"))
    assert m.layout["zero_stage"] == stage and m.layout["dp_world_size"] == world
    assert m.values["deepspeed.global_steps"] == 5
    # A rank's slice becomes tiles of that tensor: partitions that cut rows make several.
    assert len(m.tensors["model.embed.weight"].tiles) > 1


class _TorchModel(torch.nn.Module):
    """The plain torch model the ZeRO fixture was trained from (same parameter names)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(6, 7), torch.nn.Linear(7, 5)])
        self.norm = torch.nn.LayerNorm(5, bias=False)
        self.rope = torch.nn.Module()
        self.rope.register_buffer("inv_freq", torch.zeros(3))
        self.pos = torch.nn.Embedding(4, 3, dtype=torch.bfloat16).requires_grad_(False)


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_checkpoint_resumes_a_plain_torch_run(tmp_path, stage: int) -> None:
    """The converted checkpoint loads through ModelState/OptimizerState into a fresh Adam."""
    write_zero_checkpoint(str(tmp_path / "ds"), stage, 3)
    import_deepspeed(str(tmp_path / "ds"), str(tmp_path / "ck"))
    model = _TorchModel()
    named = dict(model.named_parameters())
    opt = torch.optim.Adam([{"params": [named[n] for n in g], "lr": 0.5} for g in GROUPS])
    tessera.load(
        str(tmp_path / "ck"), {"model": tessera.ModelState(model), "optim": tessera.OptimizerState(model, opt)}
    )
    params, buffers, frozen = _model()
    adam = _adam(params)
    for n, t in params.items():
        assert torch.equal(named[n].detach(), t), n
        assert torch.equal(opt.state[named[n]]["exp_avg"], adam[n]["exp_avg"]), n
        assert torch.equal(opt.state[named[n]]["exp_avg_sq"], adam[n]["exp_avg_sq"]), n
        assert opt.state[named[n]]["step"].item() == 5.0
    assert torch.equal(model.rope.inv_freq, buffers["rope.inv_freq"])
    assert torch.equal(model.pos.weight, frozen["pos.weight"].to(torch.bfloat16))
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 1e-3]  # hyperparameters from the checkpoint


def test_cli_convert_from_deepspeed(tmp_path) -> None:
    d = write_zero_checkpoint(str(tmp_path / "ds"), 3, 2)
    assert main(["convert", d, str(tmp_path / "ck"), "--from", "deepspeed"]) == 0
    _check(str(tmp_path / "ck"))
    # Auto-detected from the directory layout too.
    assert main(["convert", str(tmp_path / "ds"), str(tmp_path / "ck2")]) == 0
    _check(str(tmp_path / "ck2"))


def test_cli_convert_deepspeed_straight_to_hf(tmp_path) -> None:
    from safetensors import safe_open

    d = write_zero_checkpoint(str(tmp_path / "ds"), 2, 2)
    out = str(tmp_path / "hf")
    assert main(["convert", d, out, "--from", "deepspeed", "--to", "hf", "--prefix", "model."]) == 0
    params, buffers, frozen = _model()
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(params) | set(buffers) | set(frozen)
        for n, t in params.items():
            assert torch.equal(f.get_tensor(n), t), n
    assert [p for p in os.listdir(tmp_path) if p.startswith(".tessera")] == []  # the temporary checkpoint is gone


def test_mismatched_param_shapes_are_reported(tmp_path) -> None:
    d = write_zero_checkpoint(str(tmp_path / "ds"), 2, 2)
    sd = torch.load(os.path.join(d, "mp_rank_00_model_states.pt"), weights_only=True)
    sd["param_shapes"][0]["embed.weight"] = torch.Size([40, 6])  # more than the partitions hold
    torch.save(sd, os.path.join(d, "mp_rank_00_model_states.pt"))
    with pytest.raises(CorruptCheckpointError, match="param_shapes does not match"):
        import_deepspeed(d, str(tmp_path / "ck"))
    assert not os.path.exists(tmp_path / "ck" / "manifest.json")


def test_missing_rank_file_is_reported(tmp_path) -> None:
    d = write_zero_checkpoint(str(tmp_path / "ds"), 3, 3)
    os.remove(os.path.join(d, "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    with pytest.raises(CorruptCheckpointError, match="ranks \\[0, 2\\]"):
        import_deepspeed(d, str(tmp_path / "ck"))


def test_cli_convert_to_deepspeed_universal(tmp_path) -> None:
    """``--to deepspeed`` writes the universal layout DeepSpeed's ``load_universal`` reads (the
    real engine resuming it is in test_interop_deepspeed.py); here, the files themselves."""
    write_zero_checkpoint(str(tmp_path / "ds"), 2, 3)
    out = str(tmp_path / "ucp")
    assert main(["convert", str(tmp_path / "ds"), str(tmp_path / "ck")]) == 0
    assert main(["convert", str(tmp_path / "ck"), out, "--to", "deepspeed"]) == 0
    params, _, _ = _model()
    adam = _adam(params)
    with open(os.path.join(out, "latest_universal")) as f:
        tag = f.read()
    assert tag == "global_step5"
    zero = os.path.join(out, tag, "zero")
    for n, t in params.items():
        assert torch.equal(torch.load(os.path.join(zero, n, "fp32.pt"), weights_only=True)["param"], t), n
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(
                torch.load(os.path.join(zero, n, f"{key}.pt"), weights_only=True)["param"], adam[n][key]
            ), n
        assert torch.load(os.path.join(zero, n, "step.pt"), weights_only=True).item() == 5.0
    osd = torch.load(os.path.join(zero, "optimizer_state.pt"), weights_only=True)
    assert [g["lr"] for g in osd["param_groups"]] == [1e-3, 1e-3] and osd["param_groups"][0]["params"] == []
    ms = torch.load(os.path.join(out, tag, "mp_rank_00_model_states.pt"), weights_only=True)
    assert ms["global_steps"] == 5 and ms["dp_world_size"] == 3
    assert os.path.isfile(os.path.join(out, tag, "zero_pp_rank_0_mp_rank_00_model_states.pt"))


def test_universal_export_without_optimizer_state_is_refused(tmp_path) -> None:
    from tessera.convert import export_deepspeed_universal

    tessera.save(str(tmp_path / "ck"), {"model": {"w": torch.ones(2, 3)}})
    with pytest.raises(ValueError, match="holds no optimizer state under 'optim.state.'"):
        export_deepspeed_universal(str(tmp_path / "ck"), str(tmp_path / "ucp"))
    with pytest.raises(ValueError, match="no tensor under 'net.'"):
        export_deepspeed_universal(str(tmp_path / "ck"), str(tmp_path / "ucp"), model_prefix="net.")
