"""A Hugging Face model (tiny Llama, random init, no download) trained with FSDP2.

    python examples/train_hf_fsdp2.py --nproc 2 --steps 10 --ckpt /tmp/tessera-hf
    python examples/train_hf_fsdp2.py --nproc 3 --steps 20 --ckpt /tmp/tessera-hf   # resumes on 3
    torchrun --nproc-per-node 2 examples/train_hf_fsdp2.py

Each decoder layer is its own FSDP2 unit. The input embedding and the LM head are tied:
tessera saves the shared weight once, as ``model.model.embed_tokens.weight``, and loading
fills the one tensor both modules use. Needs ``pip install transformers``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

SEQ, VOCAB, SAMPLES = 16, 128, 240


def build() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def main(args) -> None:
    model = build()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(0))

    def loss_fn(m: torch.nn.Module, idx: list[int]) -> torch.Tensor:
        ids = tokens[idx]
        return m(input_ids=ids, labels=ids).loss

    common.train(args, model, opt, dist.get_rank(), dist.get_world_size(), loss_fn, num_samples=SAMPLES)


if __name__ == "__main__":
    parser = common.parser(__doc__.splitlines()[0])
    parser.set_defaults(ckpt="/tmp/tessera-hf-example")
    common.launch(
        main, parser.parse_args(), preload=["torch.distributed.fsdp", "transformers.models.llama.modeling_llama"]
    )
