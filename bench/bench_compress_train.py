"""Compressed checkpoints of a training job: 2 gloo ranks, a save every ``--every`` steps.

A small transformer (``--layers`` x ``--dim``, AdamW, fp32 master weights and a bf16 copy of
them) trains under DDP on 2 gloo processes for ``--steps`` steps. Every ``--every`` steps the
same state (``ModelState``, ``OptimizerState`` and the bf16 copy) is saved by each arm:

* ``tessera``: ``tessera.save``, uncompressed;
* ``tessera compress``: ``SaveOptions(compress=True)``;
* ``tessera auto``: ``SaveOptions(compress="auto")`` (codes where the storage measured slower
  than the codec, ``docs/compression.md``);
* ``tessera delta``: ``CheckpointManager(dedup=True, compress=True)`` (each step stored as
  compressed delta tiles against the step before where smaller; bytes are what the step adds);
* ``dcp+zstd``: ``dcp.save`` of the same state (``get_state_dict``) with ``_extensions=[ZStandard()]``.

Reported per arm: stored bytes per save (median over the saves after the first; for the
delta arm, the bytes the step added to the root) and their ratio to the state's logical bytes,
save seconds (median; slowest rank, barriers around), and the last save's load seconds into a
fresh model on the same 2 ranks. Then a resharded load: 3 gloo processes load the last
compressed checkpoint, each a third of every 2-D tensor's rows (and every 1-D tensor whole),
and report the bytes they decoded against the bytes they needed. Codec MB/s per core:
``bench/bench_compress.py``.

Run::

    .venv/bin/python bench/bench_compress_train.py --steps 200 --every 10
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.state_dict import get_state_dict

import tessera
from tessera.manager import CheckpointManager

VOCAB, SEQ, BATCH = 2048, 64, 8


def _model(layers: int, dim: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True)
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, dim), torch.nn.TransformerEncoder(layer, layers), torch.nn.Linear(dim, VOCAB)
    )


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def train_and_save(rank: int, store: str, args: argparse.Namespace) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    model = torch.nn.parallel.DistributedDataParallel(_model(args.layers, args.dim))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    bf16 = {n.replace(".", "_"): p.detach().to(torch.bfloat16) for n, p in model.module.named_parameters()}
    state = {"model": tessera.ModelState(model), "optim": tessera.OptimizerState(model, opt), "bf16": bf16}
    g = torch.Generator().manual_seed(1)
    table = torch.randint(0, VOCAB, (VOCAB,), generator=g)  # a fixed bigram task: the loss falls
    g.manual_seed(2 + rank)
    mgr = CheckpointManager(os.path.join(args.root, "delta"), dedup=True, compress=True, keep_last=args.steps)
    times: dict[str, list[float]] = {}
    sizes: dict[str, list[int]] = {}
    logical = 0
    for step in range(1, args.steps + 1):
        x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), table[x].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % args.every:
            continue
        with torch.no_grad():
            for n, p in model.module.named_parameters():
                bf16[n.replace(".", "_")].copy_(p)
        arms = {
            "tessera": lambda p: tessera.save(p, state),
            "tessera compress": lambda p: tessera.save(p, state, options=tessera.SaveOptions(compress=True)),
            "tessera auto": lambda p: tessera.save(p, state, options=tessera.SaveOptions(compress="auto")),
            "dcp+zstd": lambda p: dcp.save(
                {**dict(zip(("model", "optim"), get_state_dict(model, opt))), "bf16": bf16},
                storage_writer=dcp.FileSystemWriter(p, _extensions=[ZStandard()]),
            ),
        }
        for name, save in arms.items():
            path = os.path.join(args.root, name.replace(" ", "-"), f"step-{step}")
            times.setdefault(name, []).append(_timed(lambda s=save, p=path: s(p)))
            if rank == 0:
                sizes.setdefault(name, []).append(_du(path))
                old = os.path.join(args.root, name.replace(" ", "-"), f"step-{step - 2 * args.every}")
                shutil.rmtree(old, ignore_errors=True)  # keep the disk use bounded
        before = _du(os.path.join(args.root, "delta")) if rank == 0 else 0
        dist.barrier()
        times.setdefault("tessera delta", []).append(_timed(lambda s=step: mgr.save(s, state)))
        if rank == 0:  # what the step added to the root (retention deletes nothing here)
            sizes.setdefault("tessera delta", []).append(_du(os.path.join(args.root, "delta")) - before)
        if not logical:
            logical = sum(t.numel() * t.element_size() for t in model.module.state_dict().values()) * 3 + sum(
                t.numel() * t.element_size() for t in bf16.values()
            )
    mgr.close()
    last = args.steps // args.every * args.every
    fresh = torch.nn.parallel.DistributedDataParallel(_model(args.layers, args.dim))
    fopt = torch.optim.AdamW(fresh.parameters(), lr=3e-4)
    loads = {}
    for name in ("tessera", "tessera compress", "tessera auto"):
        target = {
            "model": tessera.ModelState(fresh),
            "optim": tessera.OptimizerState(fresh, fopt),
            "bf16": {k: torch.zeros_like(v) for k, v in bf16.items()},
        }
        path = os.path.join(args.root, name.replace(" ", "-"), f"step-{last}")
        loads[name] = _timed(lambda p=path, t=target: tessera.load(p, t))
        assert all(torch.equal(target["bf16"][k], v) for k, v in bf16.items()), name
        assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters())), name
    if rank == 0:
        out = {
            "loss": loss.item(),
            "logical": logical,
            "saves": {
                k: {"seconds": statistics.median(v[1:] or v), "bytes": statistics.median(sizes[k][1:] or sizes[k])}
                for k, v in times.items()
            },
            "loads": loads,
            "last": last,
        }
        with open(os.path.join(args.root, "results.json"), "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def reshard(rank: int, store: str, args: argparse.Namespace, path: str) -> None:
    """Rank ``rank`` of 3 loads a third of every 2-D tensor's rows and every 1-D tensor whole."""
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=3)
    m = tessera.read_manifest(path)
    target, needed = {}, 0
    for name, e in m.tensors.items():
        dtype = getattr(torch, e.dtype)
        if len(e.shape) == 2:
            lo, hi = e.shape[0] * rank // 3, e.shape[0] * (rank + 1) // 3
            t = torch.zeros(hi - lo, e.shape[1], dtype=dtype)
            target[name] = tessera.ShardedTensor(t, tuple(e.shape), (lo, 0))
        else:
            t = torch.zeros(e.shape, dtype=dtype)
            target[name] = t
        needed += t.numel() * t.element_size()
    res = tessera.load(path, _nest(target), strict=False)
    rows = [None] * 3
    dist.all_gather_object(rows, (res.decoded_bytes, needed))
    if rank == 0:
        with open(os.path.join(args.root, "reshard.json"), "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def _nest(flat: dict) -> dict:
    """``{"a.b.c": t}`` as nested dicts, so each FQN is the one saved."""
    out: dict = {}
    for name, t in flat.items():
        head, _, tail = name.partition(".")
        out.setdefault(head, {})[tail] = t
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    args.root = os.path.abspath(args.dir or tempfile.mkdtemp(prefix="tessera-bench-ctrain-"))
    try:
        mp.start_processes(
            train_and_save, args=(os.path.join(args.root, "store1"), args), nprocs=2, start_method="spawn"
        )
        with open(os.path.join(args.root, "results.json")) as f:
            out = json.load(f)
        path = os.path.join(args.root, "tessera-compress", f"step-{out['last']}")
        mp.start_processes(
            reshard, args=(os.path.join(args.root, "store2"), args, path), nprocs=3, start_method="spawn"
        )
        with open(os.path.join(args.root, "reshard.json")) as f:
            rows = json.load(f)
    finally:
        if args.dir is None:
            shutil.rmtree(args.root, ignore_errors=True)
    logical = out["logical"]
    print(
        f"{logical / 1e6:.1f} MB of state (fp32 weights, AdamW moments, a bf16 copy) on 2 gloo ranks, "
        f"{args.steps} steps (loss {out['loss']:.3f}), a save every {args.every}: medians over the saves after the first"
    )
    print(f"{'arm':18s}{'bytes/save':>14s}{'ratio':>8s}{'save s':>9s}{'x plain':>9s}{'load s':>9s}")
    plain = out["saves"]["tessera"]["seconds"]
    for name, row in out["saves"].items():
        load = out["loads"].get(name)
        print(
            f"{name:18s}{int(row['bytes']):>14,d}{logical / row['bytes']:>8.3f}{row['seconds']:>9.3f}"
            f"{row['seconds'] / plain:>9.2f}{'' if load is None else f'{load:9.3f}'}"
        )
    decoded, needed = sum(r[0] for r in rows), sum(r[1] for r in rows)
    print(f"resharded load 2 -> 3 ranks (a third of each 2-D tensor's rows each): decoded {decoded:,} bytes "
          f"for {needed:,} needed ({decoded / needed:.3f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
