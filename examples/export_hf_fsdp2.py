"""Publish a Hugging Face model straight from an FSDP2 job: every rank writes shards in parallel.

    python examples/export_hf_fsdp2.py --nproc 2 --out /tmp/tessera-hf-export
    torchrun --nproc-per-node 2 examples/export_hf_fsdp2.py --out /tmp/tessera-hf-export
    MALLOC_MMAP_THRESHOLD_=65536 python examples/export_hf_fsdp2.py --hidden 512 --layers 8 \\
        --vocab 32000 --shard-size 50MB --block-mb 16      # the memory measurement in docs/hf_export.md

A tiny Llama (random init, no download) is sharded with FSDP2 and written with
``tessera.save_hf``; rank 0 then loads the directory with ``transformers`` and checks the
logits against an unsharded copy. Each rank prints how much it wrote, its peak exchange
buffers and the growth of its resident memory during the export (sampled every 2 ms; set
``MALLOC_MMAP_THRESHOLD_`` so freed memory goes back to the OS and the figure is honest).
"""

from __future__ import annotations

import os
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

import tessera


def build(args) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Samples this process's resident memory in a thread; ``peak`` is the highest seen."""

    def __enter__(self) -> PeakRSS:
        self.base = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.002)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


def main(args) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(args)
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    held = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    dist.barrier()

    with PeakRSS() as mem:
        res = tessera.save_hf(args.out, model, max_shard_size=args.shard_size, block_bytes=args.block_mb << 20)
    print(
        f"rank {rank}: model {model_bytes / 2**20:.1f} MiB, holds {held / 2**20:.1f} MiB; wrote {len(res.written)} "
        f"file(s), {res.rank_bytes / 2**20:.1f} MiB in {res.seconds:.2f}s; peak buffers "
        f"{res.peak_buffer_bytes / 2**20:.1f} MiB, resident memory +{(mem.peak - mem.base) / 2**20:.1f} MiB",
        flush=True,
    )
    dist.barrier()
    if rank == 0:
        loaded = AutoModelForCausalLM.from_pretrained(args.out).eval()
        ref = build(args)
        ids = torch.randint(0, args.vocab, (2, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            same = torch.equal(loaded(ids).logits, ref(ids).logits)
        print(f"transformers loaded {args.out} ({len(res.files)} file(s)): logits identical: {same}", flush=True)
        if not same:
            raise SystemExit("logits differ")


if __name__ == "__main__":
    parser = common.parser(__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/tessera-hf-export", help="the Hugging Face directory to write")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--shard-size", default="100KB", help="most bytes per safetensors shard")
    parser.add_argument("--block-mb", type=int, default=1, help="most MiB of a tensor assembled at once")
    common.launch(main, parser.parse_args())
