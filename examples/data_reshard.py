"""A token-packing data loader saved on 4 data-parallel ranks and resumed on 3: no token lost or repeated.

    python examples/data_reshard.py                        # save on 4 ranks, resume on 3
    python examples/data_reshard.py --save-world 4 --resume-world 2 --steps 5

Phase 1 spawns ``--save-world`` gloo processes; each reads ``--steps`` batches of packed
token sequences through torchdata's ``StatefulDataLoader`` (or the stream directly when
torchdata is not installed) and the job saves with ``tessera.save`` mid-epoch, with
prefetched documents and packer tokens in flight. Phase 2 spawns ``--resume-world``
processes that ``tessera.load`` the checkpoint (resharding the loader state) and read to
the end of the epoch. Every token names its document and place, so the parent checks
that the two phases together saw every token exactly once.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import Counter

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tessera

DOCS = [[d * 1000 + j for j in range(1 + (d * 37) % 23)] for d in range(400)]


def make_loader(rank: int, world: int) -> object:
    stream = tessera.adapters.ReshardableStream(DOCS, rank=rank, world_size=world, seed=0, prefetch=4, pack_len=16)
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return stream
    return StatefulDataLoader(stream, batch_size=4, collate_fn=list)


def batches(loader: object):
    if isinstance(loader, tessera.adapters.ReshardableStream):
        it = iter(loader)
        while batch := [seq for _, seq in zip(range(4), it)]:
            yield batch
    else:
        yield from loader


def phase(rank: int, world: int, store: str, args: argparse.Namespace, resume: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
    try:
        loader = make_loader(rank, world)
        state = {"data": tessera.adapters.LoaderState(loader), "step": 0}
        if resume:
            tessera.load(args.ckpt, state)
        seen: list[int] = []
        for n, batch in enumerate(batches(loader)):
            seen += [t for seq in batch for t in seq]
            if not resume and n + 1 == args.steps:
                break
        if not resume:
            tessera.save(args.ckpt, {"data": tessera.adapters.LoaderState(loader), "step": args.steps})
            prefetched, tokens = tessera.adapters.LoaderState(loader).stream.in_flight()
            print(
                f"rank {rank}/{world}: read {len(seen)} tokens, in flight: {len(prefetched)} prefetched "
                f"documents, {len(tokens)} packer tokens",
                flush=True,
            )
        else:
            print(f"rank {rank}/{world}: resumed, read {len(seen)} tokens to the end", flush=True)
        with open(os.path.join(args.ckpt + "-seen", f"{'after' if resume else 'before'}-{rank}.json"), "w") as f:
            json.dump(seen, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--save-world", type=int, default=4)
    p.add_argument("--resume-world", type=int, default=3)
    p.add_argument("--steps", type=int, default=6, help="batches each rank reads before the save")
    p.add_argument("--ckpt", default=os.path.join(tempfile.gettempdir(), "tessera-data-example"))
    args = p.parse_args()
    os.makedirs(args.ckpt + "-seen", exist_ok=True)
    for name in os.listdir(args.ckpt + "-seen"):
        os.remove(os.path.join(args.ckpt + "-seen", name))
    for world, resume in ((args.save_world, False), (args.resume_world, True)):
        with tempfile.TemporaryDirectory() as tmp:
            store = f"file://{os.path.join(tmp, 'store')}"
            mp.spawn(phase, args=(world, store, args, resume), nprocs=world)
    seen: list[int] = []
    for name in os.listdir(args.ckpt + "-seen"):
        with open(os.path.join(args.ckpt + "-seen", name)) as f:
            seen += json.load(f)
    expected = Counter(t for d in DOCS for t in d)
    got = Counter(seen)
    if got != expected:
        raise SystemExit(
            f"mismatch: {sum((expected - got).values())} tokens lost, {sum((got - expected).values())} repeated"
        )
    print(f"saved on {args.save_world} ranks, resumed on {args.resume_world}: all {len(seen)} tokens seen exactly once")


if __name__ == "__main__":
    main()
