"""Planner scale simulation: the global plan for many simulated ranks x tensors.

Builds the local plans that N ranks would send for a model of T tensors (each tensor
sharded Shard(0) across all ranks, plus a fraction replicated as in DDP/optimizer steps),
then times the coordinator's global plan and the size of the resulting manifest.

    python bench/plan_scale.py --ranks 4096 --tensors 1000
"""

from __future__ import annotations

import argparse
import hashlib
import time

import numpy as np

from tessera.engine.saving.plan import LocalPlan, TensorMeta, build_global_plan
from tessera.format.manifest import FileEntry, Manifest, TensorEntry, Tile, decode, encode


def local_plans(ranks: int, tensors: int, replicated_every: int) -> list[LocalPlan]:
    metas = []
    for t in range(tensors):
        shape = (ranks * 4 + (t % 3), 1024)  # uneven: some ranks get one row more
        metas.append(TensorMeta(f"model.layers.{t // 10}.p{t % 10}.weight", "bfloat16", shape))
    metas_t = tuple(metas)
    digest = hashlib.blake2b(repr(metas_t).encode(), digest_size=16).hexdigest()
    plans = []
    for r in range(ranks):
        rows = np.zeros((tensors, 5), dtype=np.int64)
        for t, m in enumerate(metas):
            rows[t, 0] = t
            if t % replicated_every == 0:
                rows[t, 1:] = (0, 0, m.shape[0], m.shape[1])
            else:
                n = m.shape[0]
                chunk = -(-n // ranks)
                lo, hi = min(r * chunk, n), min((r + 1) * chunk, n)
                rows[t, 1:] = (lo, 0, hi - lo, m.shape[1])
        plans.append(LocalPlan(r, metas_t, rows, np.zeros((0, 3), dtype=np.int64), f"fp{r}", digest))
    return plans


def manifest_for(plan, ranks: int) -> Manifest:
    tiles: dict[str, list[Tile]] = {m.fqn: [] for m in plan.metas}
    files = []
    for r, rp in enumerate(plan.rank_plans):
        path = f"data/0123456789abcdef/{r}-0.safetensors"
        files.append(FileEntry(path, r, 1 << 40))
        pos = 4096
        for fqn, box, _ in rp.items():
            n = box.numel * 2
            tiles[fqn].append(
                Tile(path, box.offsets, box.lengths, pos, n, (0x1234567890ABCDEF,) * max(1, -(-n // (4 << 20))))
            )
            pos += n
    tensors = {m.fqn: TensorEntry(m.dtype, m.shape, tuple(tiles[m.fqn])) for m in plan.metas}
    return Manifest("0123456789abcdef", ranks, 4 << 20, tensors, files=tuple(files))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4096)
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--replicated-every", type=int, default=10, help="every Nth tensor is replicated on all ranks")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    t0 = time.monotonic()
    plans = local_plans(args.ranks, args.tensors, args.replicated_every)
    build_s = time.monotonic() - t0
    times = []
    for _ in range(args.repeat):
        t0 = time.monotonic()
        plan = build_global_plan(plans)
        times.append(time.monotonic() - t0)
    per_rank = plan.bytes_per_rank
    manifest = manifest_for(plan, args.ranks)
    t0 = time.monotonic()
    data = encode(manifest)
    enc_s = time.monotonic() - t0
    t0 = time.monotonic()
    decode(data)
    parse_s = time.monotonic() - t0
    boxes = sum(len(lp.boxes) for lp in plans)
    tiles = sum(len(rp.rows) for rp in plan.rank_plans)
    print(
        f"| ranks | tensors | boxes held | tiles written | global plan (median of {args.repeat}) | manifest | encode | decode + validate | bytes/rank max/mean |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {args.ranks} | {args.tensors} | {boxes:,} | {tiles:,} | {sorted(times)[len(times) // 2]:.2f} s | "
        f"{len(data) / 1e6:.1f} MB | {enc_s:.2f} s | {parse_s:.2f} s | {max(per_rank) / (sum(per_rank) / len(per_rank)):.3f} |"
    )
    print(f"(simulated local plans built in {build_s:.1f} s; not part of the plan time)")


if __name__ == "__main__":
    main()
