"""Megatron-style TP x PP state dicts to global tiles and back, driven by a :class:`MegatronSpec`.

The spec type is :mod:`.megatron_spec` (re-exported here); this module adds the spec of
Megatron-core's ``GPTModel`` (:func:`gpt_spec`) and :func:`global_shapes_from_manifest`.

A tensor- and pipeline-parallel rank holds slices of parameters under local names
(``decoder.layers.0..k`` on every stage, fused QKV, padded vocabulary). A
:class:`MegatronSpec` (rules from :mod:`.layout_spec` plus layer stacks) turns that local
state dict into :class:`~tessera.ShardedTensor`\\ s keyed by global FQN (``to_global``),
builds the empty local state of any TP x PP rank from global shapes (``empty_local``) and
describes it for ``tessera.load`` (``global_targets``). The same pure functions serve
offline conversion. :func:`gpt_spec` is the spec of Megatron-core's ``GPTModel``.

Example:
    >>> spec = gpt_spec(num_layers=24, vocab_size=50257, num_attention_heads=16,
    ...                 num_query_groups=4, kv_channels=64, swiglu=True)
    >>> state = {"model": spec.to_global(model.state_dict(), tp_rank, tp, pp_rank, pp)}
    >>> tessera.save(path, state)
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

import torch

from ..format.dtypes import dtype_from_name
from .layout_spec import ExpertStack, Fused, LayerStack, PaddedVocab, PipelineStage, Replicated, Rule, Skip, Split
from .megatron_spec import GlobalShapes, LocalValue, MegatronSpec

logger = logging.getLogger(__name__)

__all__ = ["GlobalShapes", "LocalValue", "MegatronSpec", "global_shapes_from_manifest", "gpt_spec"]


def global_shapes_from_manifest(manifest: Any, prefix: str = "") -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{name: (shape, dtype)}`` of the checkpoint tensors under ``prefix`` (prefix removed).

    Example:
        >>> global_shapes_from_manifest(tessera.read_manifest(path), prefix="model.")
    """
    return {
        fqn[len(prefix) :]: (tuple(entry.shape), dtype_from_name(entry.dtype))
        for fqn, entry in manifest.tensors.items()
        if fqn.startswith(prefix)
    }


def gpt_spec(
    *,
    num_layers: int,
    vocab_size: int,
    num_attention_heads: int,
    kv_channels: int,
    num_query_groups: int | None = None,
    ffn_hidden_size: int | None = None,
    swiglu: bool = False,
    make_vocab_size_divisible_by: int = 128,
    stage_layers: Sequence[int] | None = None,
    num_moe_experts: int | None = None,
    moe_ffn_hidden_size: int | None = None,
) -> MegatronSpec:
    """The spec of Megatron-core's ``GPTModel`` (TE or local layer specs).

    Covers ``embedding.word_embeddings`` / ``output_layer`` (padded vocabulary, first /
    last stage), ``embedding.position_embeddings``, ``decoder.layers.{i}`` with
    ``linear_qkv`` (fused per query group), ``linear_proj`` (row parallel), ``linear_fc1``
    (fused gate/up with ``swiglu``), ``linear_fc2``, their TE-fused or separate layer
    norms and QK norms, and ``decoder.final_layernorm``; ``_extra_state`` is skipped.
    With ``num_moe_experts``: ``mlp.router.weight`` (replicated) and the SequentialMLP
    experts ``mlp.experts.local_experts.{j}.linear_fc1/linear_fc2`` (numbered per EP rank,
    split by the expert-tensor-parallel rank, fc1 fused gate/up with ``swiglu``).
    Not covered: grouped-GEMM experts (``moe_grouped_gemm``), shared experts, virtual
    pipeline chunks, multi-token prediction.

    Args:
        num_layers, vocab_size, num_attention_heads, kv_channels: model sizes
            (``kv_channels`` is the head dimension).
        num_query_groups: GQA groups (default: one per head).
        ffn_hidden_size: MLP width; needed with ``swiglu``.
        swiglu: whether ``linear_fc1`` holds gate and up.
        make_vocab_size_divisible_by: Megatron's vocabulary padding multiple.
        stage_layers: explicit layers per pipeline stage (uneven first/last stages).
        num_moe_experts: experts per MoE layer (None: a dense model).
        moe_ffn_hidden_size: expert MLP width (default: ``ffn_hidden_size``).

    Example:
        >>> spec = gpt_spec(num_layers=4, vocab_size=1000, num_attention_heads=8,
        ...                 num_query_groups=2, kv_channels=16, ffn_hidden_size=256, swiglu=True)
    """
    groups = num_query_groups or num_attention_heads
    if num_attention_heads % groups:
        raise ValueError(f"num_attention_heads={num_attention_heads} is not a multiple of num_query_groups={groups}")
    q = num_attention_heads // groups * kv_channels
    qkv = Fused(0, (("q", q), ("k", kv_channels), ("v", kv_channels)), groups=groups)
    vocab = PaddedVocab(vocab_size, make_vocab_size_divisible_by)
    if swiglu:
        if ffn_hidden_size is None:
            raise ValueError("gpt_spec(swiglu=True) needs ffn_hidden_size")
        fc1: Split | Fused = Fused(0, (("gate", ffn_hidden_size), ("up", ffn_hidden_size)))
    else:
        fc1 = Split(0)
    layer = "decoder.layers.*."
    norms = re.compile(
        r"decoder\.layers\.\d+\.(input_layernorm\.(weight|bias)|pre_mlp_layernorm\.(weight|bias)"
        r"|self_attention\.linear_qkv\.layer_norm_(weight|bias)|mlp\.linear_fc1\.layer_norm_(weight|bias)"
        r"|self_attention\.(q|k)_layernorm\.(weight|bias)|self_attention\.linear_proj\.bias|mlp\.linear_fc2\.bias)"
    )
    rules: tuple[Rule, ...] = (
        Rule("embedding.word_embeddings.weight", vocab, PipelineStage.FIRST),
        Rule("embedding.position_embeddings.weight", Replicated(), PipelineStage.FIRST),
        Rule(layer + "self_attention.linear_qkv.weight", qkv),
        Rule(layer + "self_attention.linear_qkv.bias", qkv),
        Rule(layer + "self_attention.linear_proj.weight", Split(1)),
        Rule(layer + "mlp.linear_fc1.weight", fc1),
        Rule(layer + "mlp.linear_fc1.bias", fc1),
        Rule(layer + "mlp.linear_fc2.weight", Split(1)),
        Rule(norms, Replicated()),
        Rule(re.compile(r"decoder\.final_layernorm\.(weight|bias)"), Replicated(), PipelineStage.LAST),
        Rule("output_layer.weight", vocab, PipelineStage.LAST),
        Rule("*._extra_state", Skip()),
    )
    stack = LayerStack("decoder.layers.{i}", num_layers, tuple(stage_layers) if stage_layers is not None else None)
    if num_moe_experts is None:
        return MegatronSpec(rules, (stack,))
    expert_ffn = moe_ffn_hidden_size or ffn_hidden_size
    if swiglu and expert_ffn is None:
        raise ValueError("gpt_spec(num_moe_experts=..., swiglu=True) needs moe_ffn_hidden_size or ffn_hidden_size")
    efc1: Split | Fused = Fused(0, (("gate", expert_ffn), ("up", expert_ffn))) if swiglu else Split(0)  # type: ignore[arg-type]
    experts = layer + "mlp.experts.local_experts.*."
    rules += (
        Rule(re.compile(r"decoder\.layers\.\d+\.mlp\.router\.(weight|bias|expert_bias)"), Replicated()),
        Rule(experts + "linear_fc1.weight", efc1),
        Rule(experts + "linear_fc1.bias", efc1),
        Rule(experts + "linear_fc2.weight", Split(1)),
        Rule(experts + "linear_fc2.bias", Replicated()),
    )
    return MegatronSpec(rules, (stack,), (ExpertStack("mlp.experts.local_experts.{i}", num_moe_experts),))
