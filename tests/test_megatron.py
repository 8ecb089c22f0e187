"""Megatron-style TP x PP layouts: save under TP2xPP2, load under TP1xPP1, TP4xPP1 and TP1xPP2.

The test holds its own model of how Megatron-core shards a tiny GPT (fused GQA ``linear_qkv``
interleaved per query group, SwiGLU ``linear_fc1`` as [gate_r; up_r], vocabulary padded to a
multiple of ``divisible_by * tp``, layers renumbered per pipeline stage), written from the
global (unfused, true-vocabulary) tensors without using tessera's spec. Every TP x PP rank's
local state is cut from those global tensors by that model; the spec must map it to the same
global tensors and back bit for bit, and the TP1xPP1 model built on the loaded weights must
compute what the reference model computes on the global tensors.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
import torch.nn.functional as F

import tessera
from tessera.adapters.layout_spec import (
    ExpertStack,
    Fused,
    LayerStack,
    PaddedVocab,
    PipelineStage,
    Replicated,
    Rule,
    Skip,
    Split,
)
from tessera.adapters.megatron import MegatronSpec, global_shapes_from_manifest, gpt_spec
from tests.dist_utils import run_distributed

L, V, DIV, H, NH, NG, HD, FFN, SEQ = 4, 37, 4, 8, 8, 4, 2, 12, 5
QG = NH // NG * HD  # query rows per group
SPEC = gpt_spec(
    num_layers=L,
    vocab_size=V,
    num_attention_heads=NH,
    num_query_groups=NG,
    kv_channels=HD,
    ffn_hidden_size=FFN,
    swiglu=True,
    make_vocab_size_divisible_by=DIV,
)


# ----------------------------------------------------------------------------------------
# Global truth and the test's own model of Megatron's sharding.


def _global_shapes() -> dict[str, tuple[int, ...]]:
    shapes = {
        "embedding.word_embeddings.weight": (V, H),
        "embedding.position_embeddings.weight": (SEQ, H),
        "decoder.final_layernorm.weight": (H,),
        "decoder.final_layernorm.bias": (H,),
        "output_layer.weight": (V, H),
    }
    for i in range(L):
        p = f"decoder.layers.{i}."
        shapes.update(
            {
                p + "self_attention.linear_qkv.layer_norm_weight": (H,),
                p + "self_attention.linear_qkv.layer_norm_bias": (H,),
                p + "q.weight": (NH * HD, H),
                p + "k.weight": (NG * HD, H),
                p + "v.weight": (NG * HD, H),
                p + "q.bias": (NH * HD,),
                p + "k.bias": (NG * HD,),
                p + "v.bias": (NG * HD,),
                p + "self_attention.linear_proj.weight": (H, NH * HD),
                p + "self_attention.linear_proj.bias": (H,),
                p + "mlp.linear_fc1.layer_norm_weight": (H,),
                p + "mlp.linear_fc1.layer_norm_bias": (H,),
                p + "gate.weight": (FFN, H),
                p + "up.weight": (FFN, H),
                p + "gate.bias": (FFN,),
                p + "up.bias": (FFN,),
                p + "mlp.linear_fc2.weight": (H, FFN),
                p + "mlp.linear_fc2.bias": (H,),
            }
        )
    return shapes


def truth(seed: int, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """Reference global tensors (q/k/v and gate/up separate, true vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in _global_shapes().items():
        t = torch.randn(shape, generator=g, dtype=torch.float64) * 0.3
        if name.endswith(("layer_norm_weight", "final_layernorm.weight")):
            t = t + 1.0
        out[name] = t.to(dtype)
    return out


def _padded(tp: int) -> int:
    m = DIV * tp
    return -(-V // m) * m


def _layers_of_stage(pp_rank: int, pp: int) -> range:
    n = L // pp
    return range(pp_rank * n, (pp_rank + 1) * n)


def megatron_local(g: dict[str, torch.Tensor], tp_rank: int, tp: int, pp_rank: int, pp: int) -> dict[str, torch.Tensor]:
    """What Megatron-core rank (tp_rank, pp_rank) holds, cut from the global tensors."""

    def chunk(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(tp, dim)[tp_rank].clone()

    def vocab(t: torch.Tensor) -> torch.Tensor:
        padded = torch.zeros((_padded(tp), *t.shape[1:]), dtype=t.dtype)
        padded[:V] = t
        return chunk(padded, 0)

    out: dict[str, torch.Tensor] = {}
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = vocab(g["embedding.word_embeddings.weight"])
        out["embedding.position_embeddings.weight"] = g["embedding.position_embeddings.weight"].clone()
    for local_i, i in enumerate(_layers_of_stage(pp_rank, pp)):
        gp, lp = f"decoder.layers.{i}.", f"decoder.layers.{local_i}."
        for suffix in ("weight", "bias"):
            q, k, v = (g[gp + f"{n}.{suffix}"] for n in "qkv")
            # TP1 linear_qkv: per query group [q_g; k_g; v_g]; ColumnParallelLinear cuts it in tp row blocks.
            fused = torch.cat(
                [
                    torch.cat([q[j * QG : (j + 1) * QG], k[j * HD : (j + 1) * HD], v[j * HD : (j + 1) * HD]])
                    for j in range(NG)
                ]
            )
            out[lp + f"self_attention.linear_qkv.{suffix}"] = chunk(fused, 0)
            # SwiGLU linear_fc1 on rank r: [gate_r; up_r].
            out[lp + f"mlp.linear_fc1.{suffix}"] = torch.cat(
                [chunk(g[gp + f"gate.{suffix}"], 0), chunk(g[gp + f"up.{suffix}"], 0)]
            )
        for name in (
            "self_attention.linear_qkv.layer_norm_weight",
            "self_attention.linear_qkv.layer_norm_bias",
            "mlp.linear_fc1.layer_norm_weight",
            "mlp.linear_fc1.layer_norm_bias",
            "self_attention.linear_proj.bias",
            "mlp.linear_fc2.bias",
        ):
            out[lp + name] = g[gp + name].clone()
        out[lp + "self_attention.linear_proj.weight"] = chunk(g[gp + "self_attention.linear_proj.weight"], 1)
        out[lp + "mlp.linear_fc2.weight"] = chunk(g[gp + "mlp.linear_fc2.weight"], 1)
    if pp_rank == pp - 1:
        out["decoder.final_layernorm.weight"] = g["decoder.final_layernorm.weight"].clone()
        out["decoder.final_layernorm.bias"] = g["decoder.final_layernorm.bias"].clone()
        out["output_layer.weight"] = vocab(g["output_layer.weight"])
    return out


def saved_name(name: str) -> str:
    """The checkpoint name of a global truth tensor (parts under their fused module, q/k/v grouped)."""
    m = re.fullmatch(r"(decoder\.layers\.\d+\.)(q|k|v|gate|up)\.(weight|bias)", name)
    if m is None:
        return name
    module = "self_attention.linear_qkv" if m.group(2) in "qkv" else "mlp.linear_fc1"
    return f"{m.group(1)}{module}.{m.group(2)}.{m.group(3)}"


def saved_view(name: str, t: torch.Tensor) -> torch.Tensor:
    """The truth tensor in its saved shape: q/k/v keep a leading query-group dimension."""
    if re.search(r"\.linear_qkv\.[qkv]\.", saved_name(name)):
        return t.reshape(NG, -1, *t.shape[1:])
    return t


OPT_KEYS = ("exp_avg", "exp_avg_sq")


def optimizer_local(tp_rank: int, tp: int, pp_rank: int, pp: int) -> dict[str, dict[str, torch.Tensor]]:
    moments = {
        k: megatron_local(truth(10 + i, torch.float32), tp_rank, tp, pp_rank, pp) for i, k in enumerate(OPT_KEYS)
    }
    return {n: {**{k: moments[k][n] for k in OPT_KEYS}, "step": torch.tensor(3.0)} for n in moments["exp_avg"]}


# ----------------------------------------------------------------------------------------
# The reference model on global tensors, and Megatron's TP1 model on a local state dict.


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # q: [S, NH, HD]; k, v: [S, NG, HD]; heads of a group share its k/v.
    k = k.repeat_interleave(NH // NG, dim=1)
    v = v.repeat_interleave(NH // NG, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HD)
    mask = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).triu(1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).reshape(q.shape[0], NH * HD)


def reference_forward(g: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    x = g["embedding.word_embeddings.weight"][tokens] + g["embedding.position_embeddings.weight"][: len(tokens)]
    for i in range(L):
        p = f"decoder.layers.{i}."
        h = F.layer_norm(
            x,
            (H,),
            g[p + "self_attention.linear_qkv.layer_norm_weight"],
            g[p + "self_attention.linear_qkv.layer_norm_bias"],
        )
        q, k, v = (F.linear(h, g[p + f"{n}.weight"], g[p + f"{n}.bias"]) for n in "qkv")
        a = _attention(q.view(-1, NH, HD), k.view(-1, NG, HD), v.view(-1, NG, HD))
        x = x + F.linear(a, g[p + "self_attention.linear_proj.weight"], g[p + "self_attention.linear_proj.bias"])
        h = F.layer_norm(x, (H,), g[p + "mlp.linear_fc1.layer_norm_weight"], g[p + "mlp.linear_fc1.layer_norm_bias"])
        m = F.silu(F.linear(h, g[p + "gate.weight"], g[p + "gate.bias"])) * F.linear(
            h, g[p + "up.weight"], g[p + "up.bias"]
        )
        x = x + F.linear(m, g[p + "mlp.linear_fc2.weight"], g[p + "mlp.linear_fc2.bias"])
    x = F.layer_norm(x, (H,), g["decoder.final_layernorm.weight"], g["decoder.final_layernorm.bias"])
    return F.linear(x, g["output_layer.weight"])


def megatron_tp1_forward(sd: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    x = sd["embedding.word_embeddings.weight"][tokens] + sd["embedding.position_embeddings.weight"][: len(tokens)]
    for i in range(L):
        p = f"decoder.layers.{i}."
        h = F.layer_norm(
            x,
            (H,),
            sd[p + "self_attention.linear_qkv.layer_norm_weight"],
            sd[p + "self_attention.linear_qkv.layer_norm_bias"],
        )
        mixed = F.linear(h, sd[p + "self_attention.linear_qkv.weight"], sd[p + "self_attention.linear_qkv.bias"])
        mixed = mixed.view(-1, NG, QG + 2 * HD)  # Megatron-core's get_query_key_value_tensors
        q, k, v = mixed.split([QG, HD, HD], dim=-1)
        a = _attention(q.reshape(-1, NH, HD), k, v)
        x = x + F.linear(a, sd[p + "self_attention.linear_proj.weight"], sd[p + "self_attention.linear_proj.bias"])
        h = F.layer_norm(x, (H,), sd[p + "mlp.linear_fc1.layer_norm_weight"], sd[p + "mlp.linear_fc1.layer_norm_bias"])
        gate, up = F.linear(h, sd[p + "mlp.linear_fc1.weight"], sd[p + "mlp.linear_fc1.bias"]).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, sd[p + "mlp.linear_fc2.weight"], sd[p + "mlp.linear_fc2.bias"])
    x = F.layer_norm(x, (H,), sd["decoder.final_layernorm.weight"], sd["decoder.final_layernorm.bias"])
    return F.linear(x, sd["output_layer.weight"])[:, :V]  # drop the padded vocabulary


def test_test_model_is_consistent() -> None:
    """The test's Megatron TP1 model on its own sharding computes the reference output."""
    g = truth(0)
    tokens = torch.tensor([3, 36, 0, 17, 8])
    torch.testing.assert_close(
        megatron_tp1_forward(megatron_local(g, 0, 1, 0, 1), tokens),
        reference_forward(g, tokens),
        rtol=1e-12,
        atol=1e-12,
    )


# ----------------------------------------------------------------------------------------
# Save TP2xPP2 on 4 gloo processes; load under other layouts.


def _save(rank: int, world: int, path: str, tp: int, pp: int) -> list[str]:
    tp_rank, pp_rank = rank % tp, rank // tp  # Megatron's order: TP ranks are adjacent
    model = megatron_local(truth(0), tp_rank, tp, pp_rank, pp)
    model["decoder.layers.0.self_attention.core_attention._extra_state"] = None  # TE: skipped
    state = {
        "model": SPEC.to_global(model, tp_rank, tp, pp_rank, pp),
        "optim": {"state": SPEC.to_global(optimizer_local(tp_rank, tp, pp_rank, pp), tp_rank, tp, pp_rank, pp)},
        "iteration": 3,
    }
    tessera.save(path, state)
    return sorted(state["model"])


@pytest.fixture(scope="module")
def tp2pp2(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("megatron") / "tp2pp2")
    names = run_distributed(_save, 4, path, 2, 2)
    assert sorted(set().union(*names)) == sorted(saved_name(n) for n in _global_shapes())
    return path


def _load_rank(path: str, tp_rank: int, tp: int, pp_rank: int, pp: int) -> tuple[dict, dict, tessera.LoadResult]:
    shapes = global_shapes_from_manifest(tessera.read_manifest(path), prefix="model.")
    model = SPEC.empty_local(shapes, tp_rank, tp, pp_rank, pp)
    for t in model.values():
        t.fill_(7.0)  # garbage, including the vocabulary padding: the load must zero it
    optim = {
        n: {"exp_avg": torch.full(t.shape, 7.0), "exp_avg_sq": torch.full(t.shape, 7.0), "step": torch.tensor(0.0)}
        for n, t in model.items()
    }
    state = {
        "model": SPEC.global_targets(model, tp_rank, tp, pp_rank, pp),
        "optim": {"state": SPEC.global_targets(optim, tp_rank, tp, pp_rank, pp)},
        "iteration": 0,
    }
    result = tessera.load(path, state, strict=pp == 1)
    assert result.missing_keys == [] and state["iteration"] == 3
    return model, optim, result


def _check_rank(model: dict, optim: dict, tp_rank: int, tp: int, pp_rank: int, pp: int) -> None:
    want = megatron_local(truth(0), tp_rank, tp, pp_rank, pp)
    assert model.keys() == want.keys()
    for n, t in want.items():
        assert model[n].dtype == t.dtype and torch.equal(model[n], t), f"{n} on tp{tp_rank}/{tp} pp{pp_rank}/{pp}"
    want_opt = optimizer_local(tp_rank, tp, pp_rank, pp)
    for n, st in want_opt.items():
        for k in OPT_KEYS:
            assert torch.equal(optim[n][k], st[k]), f"{k} of {n} on tp{tp_rank}/{tp} pp{pp_rank}/{pp}"
        assert optim[n]["step"].item() == 3.0


def test_tp2pp2_to_tp1pp1_forward_matches_reference(tp2pp2: str) -> None:
    model, optim, _ = _load_rank(tp2pp2, 0, 1, 0, 1)
    _check_rank(model, optim, 0, 1, 0, 1)
    assert model["output_layer.weight"].shape == (_padded(1), H) and not model["output_layer.weight"][V:].any()
    g = truth(0)
    tokens = torch.tensor([1, 36, 5, 0, 22])
    torch.testing.assert_close(
        megatron_tp1_forward(model, tokens), reference_forward(g, tokens), rtol=1e-12, atol=1e-12
    )


def test_tp2pp2_global_tensors_by_fqn(tp2pp2: str) -> None:
    """A plain process reads the unfused, true-vocabulary global tensors by FQN."""
    g = truth(0)
    plain = {"model": {saved_name(n): torch.zeros_like(saved_view(n, t)) for n, t in g.items()}}
    assert tessera.load(tp2pp2, plain).missing_keys == []
    for n, t in g.items():
        assert torch.equal(plain["model"][saved_name(n)], saved_view(n, t)), n
    assert tessera.read_manifest(tp2pp2).tensors["model.output_layer.weight"].shape == (V, H)


def test_tp2pp2_to_tp4pp1(tp2pp2: str) -> None:
    for tp_rank in range(4):  # each target rank loads on its own: a load reads only its own tiles
        model, optim, _ = _load_rank(tp2pp2, tp_rank, 4, 0, 1)
        _check_rank(model, optim, tp_rank, 4, 0, 1)
        assert model["embedding.word_embeddings.weight"].shape == (_padded(4) // 4, H)  # 48 rows: 12 each


def test_tp2pp2_to_tp1pp2(tp2pp2: str) -> None:
    for pp_rank in range(2):
        model, optim, result = _load_rank(tp2pp2, 0, 1, pp_rank, 2)
        _check_rank(model, optim, 0, 1, pp_rank, 2)
        # The other stage's tensors are in the checkpoint but not in this stage's state.
        other = set(SPEC.to_global(megatron_local(truth(0), 0, 1, 1 - pp_rank, 2), 0, 1, 1 - pp_rank, 2))
        assert {k.removeprefix("model.") for k in result.unexpected_keys if k.startswith("model.")} == other


# ----------------------------------------------------------------------------------------
# The spec's own rules: names, errors, uneven stages.


def test_misdeclared_specs_are_errors() -> None:
    w = torch.zeros(4, 8)
    spec = MegatronSpec((Rule("a.*", Split(0)), Rule(re.compile(r"a\.w|b\.w"), Replicated())))
    with pytest.raises(tessera.StateMismatchError, match=r"'a\.w' matches 2 rules .*'a\.\*'.*'a\\\\.w\|b\\\\.w'"):
        spec.to_global({"a.w": w}, 0, 2, 0, 1)
    with pytest.raises(tessera.StateMismatchError, match=r"'c\.w' matches no rule"):
        spec.to_global({"c.w": w}, 0, 2, 0, 1)
    with pytest.raises(ValueError, match=r"'x': Split splits dimension 2, but it has 2"):
        MegatronSpec((Rule("x", Split(2)),)).to_global({"x": w}, 0, 2, 0, 1)
    qkv = MegatronSpec((Rule("qkv", Fused(0, (("q", 4), ("k", 2), ("v", 2)), groups=2)),))
    with pytest.raises(
        tessera.StateMismatchError, match=r"'qkv' of local shape \[4, 8\]: fused dimension 0 should be 8"
    ):
        qkv.to_global({"qkv": w}, 0, 2, 0, 1)
    with pytest.raises(tessera.StateMismatchError, match=r"'qkv'.*cannot be split across 3 TP ranks"):
        qkv.to_global({"qkv": torch.zeros(6, 8)}, 0, 3, 0, 1)
    vocab = MegatronSpec((Rule("emb", PaddedVocab(37, 4)),))
    with pytest.raises(
        tessera.StateMismatchError,
        match=r"'emb': local vocabulary dimension 0 has 19 entries, so 38 over 2 TP ranks, but vocab_size=37 padded to a multiple of 4\*2 is 40",
    ):
        vocab.to_global({"emb": torch.zeros(19, 8)}, 0, 2, 0, 1)
    with pytest.raises(tessera.StateMismatchError, match=r"'decoder\.layers\.2\.w' on pipeline stage 1: local layer 2"):
        SPEC_SMALL.to_global({"decoder.layers.2.w": w}, 0, 1, 1, 2)
    with pytest.raises(
        tessera.StateMismatchError, match=r"'embedding\.word_embeddings\.weight' is on pipeline stage 1"
    ):
        SPEC.to_global({"embedding.word_embeddings.weight": torch.zeros(20, H)}, 0, 2, 1, 2)
    with pytest.raises(tessera.StateMismatchError, match=r"expected a tensor or a dict"):
        SPEC.to_global({"decoder.final_layernorm.weight": 3}, 0, 1, 0, 1)


SPEC_SMALL = MegatronSpec(
    (
        Rule("decoder.layers.*.w", Split(0)),
        Rule("head", Replicated(), PipelineStage.LAST),
        Rule("*._extra_state", Skip()),
    ),
    (LayerStack("decoder.layers.{i}", 4),),
)


def test_empty_local_errors() -> None:
    shapes = {"decoder.layers.0.w": ((6, 2), torch.float32)}
    with pytest.raises(
        tessera.StateMismatchError, match=r"'decoder\.layers\.0\.w'.*dimension 0 \(6\) does not split evenly across 4"
    ):
        SPEC_SMALL.empty_local(shapes, 0, 4, 0, 1)
    with pytest.raises(tessera.StateMismatchError, match=r"'other' matches no rule"):
        SPEC_SMALL.empty_local({"other": ((2,), torch.float32)}, 0, 1, 0, 1)
    with pytest.raises(tessera.StateMismatchError, match=r"'decoder\.layers\.9\.w': layer 9 is past the 4 layers"):
        SPEC_SMALL.empty_local({"decoder.layers.9.w": ((4,), torch.float32)}, 0, 1, 0, 1)
    g = {saved_name(n): (tuple(saved_view(n, t).shape), t.dtype) for n, t in truth(0).items()}
    del g["decoder.layers.1.self_attention.linear_qkv.k.weight"]
    with pytest.raises(
        tessera.StateMismatchError,
        match=r"'decoder\.layers\.1\.self_attention\.linear_qkv\.weight' lacks its part\(s\) \['decoder\.layers\.1\.self_attention\.linear_qkv\.k\.weight'\]",
    ):
        SPEC.empty_local(g, 0, 1, 0, 1)
    g = {saved_name(n): (tuple(saved_view(n, t).shape), t.dtype) for n, t in truth(0).items()}
    g["decoder.layers.0.self_attention.linear_qkv.weight"] = ((32, H), torch.float64)  # an unsplit fused tensor
    with pytest.raises(tessera.StateMismatchError, match=r"matches the fused rule"):
        SPEC.empty_local(g, 0, 1, 0, 1)
    with pytest.raises(ValueError, match=r"stage_layers \(1, 3\) are for PP=2, not PP=4"):
        LayerStack("decoder.layers.{i}", 4, (1, 3)).counts(4)
    with pytest.raises(ValueError, match="must add up to 4"):
        LayerStack("decoder.layers.{i}", 4, (1, 2))


def test_uneven_stages_names_and_skip() -> None:
    stack = LayerStack("decoder.layers.{i}", 4, (1, 3))
    spec = dataclasses.replace(SPEC_SMALL, layers=(stack,))
    local = {
        "decoder.layers.0.w": torch.arange(4.0),
        "decoder.layers.2.w": torch.arange(4.0),
        "head": torch.ones(2),
        "decoder.layers.1._extra_state": None,
    }
    out = spec.to_global(local, 1, 2, 1, 2)
    assert sorted(out) == ["decoder.layers.1.w", "decoder.layers.3.w", "head"]
    assert out["decoder.layers.3.w"].global_shape == (8,) and out["decoder.layers.3.w"].global_offset == (4,)
    assert spec.global_name("decoder.layersX.1.w", 1, 2) == "decoder.layersX.1.w"  # not in the stack
    assert spec.global_name("decoder.layers.3.w", 0, 1) == "decoder.layers.3.w"  # PP=1 holds every layer
    shapes = {n: ((8,), torch.float32) for n in ("decoder.layers.0.w", "decoder.layers.1.w", "decoder.layers.3.w")}
    shapes["head"] = ((2,), torch.float32)
    assert sorted(spec.empty_local(shapes, 0, 2, 0, 2)) == ["decoder.layers.0.w"]
    assert sorted(spec.empty_local(shapes, 0, 2, 1, 2)) == ["decoder.layers.0.w", "decoder.layers.2.w", "head"]


def test_fused_split_within_groups_and_name_template() -> None:
    """TP larger than the group count splits every part of a group; a custom name template."""
    fused = Fused(1, (("a", 4), ("b", 2)), groups=2, name="{name}::{part}")
    spec = MegatronSpec((Rule("w", fused),))
    full = torch.arange(3 * 12.0).reshape(3, 12)  # groups along dim 1: [a0(4) b0(2) a1(4) b1(2)]
    a = torch.stack([full[:, 0:4], full[:, 6:10]], 1)  # [3, 2 groups, 4]
    b = torch.stack([full[:, 4:6], full[:, 10:12]], 1)
    tiles = {}
    for r in range(4):  # 4 ranks, 2 per group: rank r holds half of each part of group r // 2
        local = torch.cat([a[:, r // 2, (r % 2) * 2 : (r % 2) * 2 + 2], b[:, r // 2, r % 2 : r % 2 + 1]], 1)
        for name, st in spec.to_global({"w": local}, r, 4, 0, 1).items():
            tiles.setdefault(name, torch.zeros(st.global_shape))[st.box.slices()] = st.local
    assert torch.equal(tiles["w::a"], a) and torch.equal(tiles["w::b"], b)
    shapes = {"w::a": ((3, 2, 4), torch.float32), "w::b": ((3, 2, 2), torch.float32)}
    assert spec.empty_local(shapes, 0, 4, 0, 1)["w"].shape == (3, 3)
    assert spec.empty_local(shapes, 0, 1, 0, 1)["w"].shape == (3, 12)


# ----------------------------------------------------------------------------------------
# MoE: experts numbered per EP rank, split by the expert-TP rank, per-expert optimizer state.

E, EFFN = 4, 6
MOE_SPEC = MegatronSpec(
    rules=(
        Rule("layers.*.router.weight", Replicated()),
        Rule("layers.*.experts.local_experts.*.fc1.weight", Fused(0, (("gate", EFFN), ("up", EFFN)))),
        Rule("layers.*.experts.local_experts.*.fc2.weight", Split(1)),
    ),
    experts=(ExpertStack("experts.local_experts.{i}", num_experts=E),),
)


def _moe_truth() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    out = {"layers.0.router.weight": torch.randn(E, H, generator=g)}
    for j in range(E):
        out[f"layers.0.experts.local_experts.{j}.fc1.gate.weight"] = torch.randn(EFFN, H, generator=g)
        out[f"layers.0.experts.local_experts.{j}.fc1.up.weight"] = torch.randn(EFFN, H, generator=g)
        out[f"layers.0.experts.local_experts.{j}.fc2.weight"] = torch.randn(H, EFFN, generator=g)
    return out


def _moe_local(g: dict[str, torch.Tensor], ep_rank: int, ep: int, etp_rank: int, etp: int) -> dict[str, torch.Tensor]:
    """What Megatron's EP x ETP rank holds: its experts renumbered from 0, ETP slices, fc1 = [gate_r; up_r]."""
    n = E // ep
    out = {"layers.0.router.weight": g["layers.0.router.weight"].clone()}
    for j in range(n):
        p = f"layers.0.experts.local_experts.{ep_rank * n + j}."
        gate, up = (g[p + f"fc1.{x}.weight"].chunk(etp, 0)[etp_rank] for x in ("gate", "up"))
        out[f"layers.0.experts.local_experts.{j}.fc1.weight"] = torch.cat([gate, up]).clone()
        out[f"layers.0.experts.local_experts.{j}.fc2.weight"] = g[p + "fc2.weight"].chunk(etp, 1)[etp_rank].clone()
    return out


def _moe_save_and_reload(rank: int, world: int, path: str) -> None:
    g = _moe_truth()
    ep, etp = 2, 1  # ranks are the EP ranks
    local = _moe_local(g, rank, ep, 0, etp)
    optim = {k: {"exp_avg": v * 2, "step": 3} for k, v in local.items()}  # per-expert optimizer state
    kw = dict(ep_rank=rank, ep_size=ep)
    tessera.save(path, {"model": MOE_SPEC.to_global(local, 0, 1, 0, 1, **kw),
                        "optim": MOE_SPEC.to_global(optim, 0, 1, 0, 1, **kw)})  # fmt: skip
    # Reload at EP=1 x ETP=2: both experts groups on every rank, each rank one ETP slice.
    shapes = global_shapes_from_manifest(tessera.read_manifest(path), prefix="model.")
    kw = dict(ep_rank=0, ep_size=1, etp_rank=rank, etp_size=2)
    empty = MOE_SPEC.empty_local(shapes, 0, 1, 0, 1, **kw)
    opt = {k: {"exp_avg": torch.zeros_like(v), "step": 0} for k, v in empty.items()}
    optim_targets = MOE_SPEC.global_targets(opt, 0, 1, 0, 1, **kw)
    res = tessera.load(path, {"model": MOE_SPEC.global_targets(empty, 0, 1, 0, 1, **kw), "optim": optim_targets})
    assert res.missing_keys == [] and all(v["step"] == 3 for v in optim_targets.values())
    want = _moe_local(g, 0, 1, rank, 2)
    assert empty.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(empty[k], v), k
        assert torch.equal(opt[k]["exp_avg"], v * 2), k


def test_moe_ep2_saved_loads_at_ep1_expert_tp2_and_ep4(tmp_path) -> None:
    path = str(tmp_path / "ck")
    run_distributed(_moe_save_and_reload, 2, path)
    # EP=4 (one expert per rank), one process standing for each rank in turn.
    g = _moe_truth()
    shapes = global_shapes_from_manifest(tessera.read_manifest(path), prefix="model.")
    for ep_rank in range(4):
        local = MOE_SPEC.empty_local(shapes, 0, 1, 0, 1, ep_rank=ep_rank, ep_size=4)
        res = tessera.load(path, {"model": MOE_SPEC.global_targets(local, 0, 1, 0, 1, ep_rank=ep_rank, ep_size=4)},
                           strict=False)  # fmt: skip
        assert res.missing_keys == []
        assert {k: torch.equal(v, local[k]) for k, v in _moe_local(g, ep_rank, 4, 0, 1).items()} == dict.fromkeys(
            local, True
        )


def test_moe_expert_count_not_divisible_is_an_error() -> None:
    g = _moe_truth()
    with pytest.raises(
        tessera.StateMismatchError, match="4 experts .* do not divide evenly over 3 expert-parallel ranks"
    ):
        MOE_SPEC.to_global(_moe_local(g, 0, 2, 0, 1), 0, 1, 0, 1, ep_rank=0, ep_size=3)
    with pytest.raises(tessera.StateMismatchError, match="local expert 2, but each of 2 EP ranks holds 2"):
        MOE_SPEC.to_global(_moe_local(g, 0, 1, 0, 1), 0, 1, 0, 1, ep_rank=0, ep_size=2)  # 4 local experts at EP=2
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in g.items()}
    with pytest.raises(tessera.StateMismatchError, match="do not divide evenly over 3"):
        MOE_SPEC.empty_local(shapes, 0, 1, 0, 1, ep_rank=0, ep_size=3)
    with pytest.raises(tessera.StateMismatchError, match="across 4 TP ranks"):  # expert TP must divide too
        MOE_SPEC.empty_local(shapes, 0, 1, 0, 1, etp_rank=0, etp_size=4)


def test_multishard_several_boxes_of_one_tensor_on_one_rank(tmp_path) -> None:
    """Megatron-Core's SwiGLU fc1 on a TP rank: its gate rows and its up rows, one tensor."""
    from tessera.shards import MultiShard

    g = torch.arange(32.0).reshape(8, 4)
    tessera.save(str(tmp_path), {"w": MultiShard([tessera.ShardedTensor(g[0:2], (8, 4), (0, 0)),
                                                  tessera.ShardedTensor(g[4:6], (8, 4), (4, 0)),
                                                  tessera.FlatShard(g[2:4].reshape(-1), (8, 4), 8),
                                                  tessera.ShardedTensor(g[6:], (8, 4), (6, 0))])})  # fmt: skip
    a, b = torch.zeros(3, 4), torch.zeros(5, 4)
    tessera.load(str(tmp_path), {"w": MultiShard([tessera.ShardedTensor(b, (8, 4), (3, 0)),
                                                  tessera.ShardedTensor(a, (8, 4), (0, 0))])})  # fmt: skip
    assert torch.equal(torch.cat([a, b]), g)
    with pytest.raises(ValueError, match="disagree on the global shape"):
        MultiShard([tessera.ShardedTensor(a, (8, 4), (0, 0)), tessera.ShardedTensor(a, (9, 4), (0, 0))])
