"""Parity (``local_parity=(k, m)``) against replicas (``local_replicas=1``) in the local tier
(issue #35): memory per node, save time, recovery time.

Workload: 6 gloo processes as 6 nodes of one rank (``LOCAL_WORLD_SIZE=1``), ``--mb`` MB of
fp32 per rank in 4 tensors split in 6 row blocks (``ShardedTensor``). Each configuration runs
in the same processes, one after the other: ``replicas=1``, ``parity 4+2``, ``parity 5+1``.

* ``save``: ``manager.save`` to commit (local files, replicas or parity, the local commit),
  median of ``--repeat`` saves after one warm-up; the slowest rank's time (barriers around).
* ``extra files``: per node, the bytes of replica or parity files in its ``local_dir`` for
  the last step over its own files' bytes (max over nodes); ``peak RSS``: the growth of the
  process's peak resident set during the timed saves (``/proc/self/clear_refs`` 5 resets the
  peak first), max over ranks, in MB.
* ``recover, same job``: the directories of the lost nodes are emptied, then ``manager.load``
  on all 6 ranks with a new manager; ``source == "peers"``, checked bit for bit.
* ``recover, survivors``: the same losses, then a new manager over a process group of the
  survivors alone (``dist.new_group``).
* Losses: ``m`` nodes for parity (nodes 1 and 4 for 4+2, node 3 for 5+1). The replicated ring
  (each node's files on the next node) is measured on both: node 3 alone, and nodes 1 and 4
  (not neighbours, so it survives them too). Each ratio compares a loss with the replicas'
  recovery from the same loss; ``x repl 1`` compares with the replicas' one-node loss.
  Every recovery is timed ``--repeat`` times (the local directories restored from a copy in
  between) and the median is reported.

No step is ever written under the durable root (``durable_every`` far away), so recovery
reads 0 durable bytes (the script asserts the root holds no step).

Run::

    .venv/bin/python bench/bench_parity.py --mb 64 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tessera
from tessera.manager import CheckpointManager

WORLD = 6
TENSORS = 4
CONFIGS = [("replicas=1", {"local_replicas": 1}, [[3], [1, 4]]), ("parity 4+2", {"local_parity": (4, 2)}, [[1, 4]])]
CONFIGS += [("parity 5+1", {"local_parity": (5, 1)}, [[3]])]


def _state(rank: int, mb: float, step: int, empty: bool = False) -> dict:
    rows = int(mb * 1e6 / 4 / 1024 / TENSORS) * WORLD
    mine = rows // WORLD
    out = {}
    for i in range(TENSORS):
        local = torch.zeros(mine, 1024) if empty else torch.full((mine, 1024), float(step * 100 + i + rank))
        out[f"t{i}"] = tessera.ShardedTensor(local, (rows, 1024), (rank * mine, 0))
    return {"model": out, "step": step}


def _check(state: dict, step: int, ranks: list[int]) -> None:
    """The full tensors a smaller job holds in its row blocks: compare each block's rows."""
    assert state["step"] == step, state["step"]
    for i, t in enumerate(state["model"].values()):
        for r in range(WORLD):
            lo = r * (t.global_shape[0] // WORLD)
            hi = lo + t.global_shape[0] // WORLD
            a, b = max(lo, t.global_offset[0]), min(hi, t.global_offset[0] + t.local.shape[0])
            if a < b:
                assert torch.all(
                    t.local[a - t.global_offset[0] : b - t.global_offset[0]] == float(step * 100 + i + r)
                ), (i, r)


def _even(rank: int, size: int, mb: float, empty: bool) -> dict:
    """A state sharded over ``size`` ranks (the survivors' job)."""
    rows = int(mb * 1e6 / 4 / 1024 / TENSORS) * WORLD
    lo, hi = rows * rank // size, rows * (rank + 1) // size
    out = {f"t{i}": tessera.ShardedTensor(torch.zeros(hi - lo, 1024), (rows, 1024), (lo, 0)) for i in range(TENSORS)}
    return {"model": out, "step": -1}


def _timed(fn, group=None) -> float:  # type: ignore[no-untyped-def]
    dist.barrier(group=group)
    t0 = time.perf_counter()
    fn()
    dist.barrier(group=group)
    return time.perf_counter() - t0


def _hwm_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _bytes(directory: str, part: str) -> int:
    top = os.path.join(directory, part)
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(top) for n in names)


def worker(rank: int, store: str, args: argparse.Namespace) -> None:
    os.environ.update({"LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    results: dict[str, dict] = {}
    for name, kwargs, losses in CONFIGS:
        local = os.path.join(args.shm, name.replace(" ", "").replace("=", "") + "-{node}")
        root = os.path.join(args.disk, name.replace(" ", ""))
        mgr = CheckpointManager(root, local_dir=local, durable_every=10**6, **kwargs)
        mgr.save(1, _state(rank, args.mb, 1))  # warm-up (not timed)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")  # reset the peak RSS
        base = _hwm_mb()
        times = []
        for s in range(2, args.repeat + 2):
            state = _state(rank, args.mb, s)
            times.append(_timed(lambda m=mgr, s=s, state=state: m.save(s, state)))
        last = args.repeat + 1
        mgr.close()
        step_dir = os.path.join(local.format(node=rank), f"step-{last:08d}")
        own = sum(
            os.path.getsize(os.path.join(d, n))
            for d, _, names in os.walk(os.path.join(step_dir, "data"))
            for n in names
            if n.startswith(f"{rank}-")
        )
        extra = _bytes(step_dir, "data") - own + _bytes(step_dir, "parity")
        row = {"save": statistics.median(times), "extra": extra / own, "rss": _hwm_mb() - base}
        pristine = local.replace("{node}", "pristine-{node}")
        shutil.copytree(local.format(node=rank), pristine.format(node=rank))
        for lost in losses:
            survivors = [r for r in range(WORLD) if r not in lost]
            survivors_group = dist.new_group(survivors)
            for job in ("same job", "survivors"):
                times = []
                for _ in range(args.repeat):
                    shutil.rmtree(local.format(node=rank), ignore_errors=True)
                    if rank not in lost:
                        shutil.copytree(pristine.format(node=rank), local.format(node=rank))
                    group = survivors_group if job == "survivors" else None
                    if job == "survivors" and rank in lost:
                        dist.barrier()
                        continue
                    size = len(survivors) if group is not None else WORLD
                    me = survivors.index(rank) if group is not None else rank
                    mgr = CheckpointManager(root, local_dir=local, durable_every=10**6, process_group=group, **kwargs)
                    target = _even(me, size, args.mb, True)
                    got: list = []
                    times.append(_timed(lambda m=mgr, t=target, g=got: g.append(m.load(t)), group))
                    assert got[0].source == "peers" and got[0].step == last, (got[0].source, got[0].step)
                    _check(target, last, survivors)
                    mgr.close()
                    dist.barrier()
                if times:
                    row[f"{job} {lost}"] = statistics.median(times)
        assert not [n for n in os.listdir(root) if n.startswith("step-")], "a step reached the durable root"
        results[name] = row
        all_rows: list = [None] * WORLD
        dist.all_gather_object(all_rows, row)
        if rank == 0:
            results[name] = {
                **{k: max(r[k] for r in all_rows if k in r) for k in row if k.startswith(("same", "survivors"))},
                "save": row["save"],
                "extra": max(r["extra"] for r in all_rows),
                "rss": max(r["rss"] for r in all_rows),
                "losses": [str(lost) for lost in losses],
            }
        dist.barrier()
        shutil.rmtree(local.format(node=rank), ignore_errors=True)
        shutil.rmtree(pristine.format(node=rank), ignore_errors=True)
    if rank == 0:
        with open(os.path.join(args.disk, "results.json"), "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--shm", default="/dev/shm")
    args = ap.parse_args()
    run = uuid.uuid4().hex[:8]
    args.disk = tempfile.mkdtemp(prefix="tessera-bench-parity-")
    args.shm = os.path.join(args.shm, f"tessera-bench-parity-{run}")
    try:
        mp.start_processes(worker, args=(os.path.join(args.disk, "store"), args), nprocs=WORLD, start_method="spawn")
        with open(os.path.join(args.disk, "results.json")) as f:
            results = json.load(f)
    finally:
        shutil.rmtree(args.shm, ignore_errors=True)
        shutil.rmtree(args.disk, ignore_errors=True)
    print(
        f"{args.mb:g} MB fp32 per rank, 6 nodes x 1 rank (gloo on one machine), medians of {args.repeat} saves "
        f"and of {args.repeat} recoveries"
    )
    print(f"{'':12s} {'save s':>7s} {'x repl':>7s} {'extra files':>12s} {'peak RSS MB':>12s} {'lost':>7s} "
          f"{'recover s':>10s} {'x repl':>7s} {'x repl 1':>9s} {'survivors s':>12s} {'x repl':>7s} {'x repl 1':>9s}")  # fmt: skip
    ref = results["replicas=1"]
    one = ref["losses"][0]
    for name, row in results.items():
        for i, lost in enumerate(row["losses"]):
            head = (
                f"{name:12s} {row['save']:7.3f} {row['save'] / ref['save']:7.2f} {row['extra']:12.3f} {row['rss']:12.1f}"
                if i == 0
                else " " * 52
            )
            cells = []
            for job in ("same job", "survivors"):
                t = row[f"{job} {lost}"]
                cells.append(f"{t:10.3f} {t / ref[f'{job} {lost}']:7.2f} {t / ref[f'{job} {one}']:9.2f}")
            print(f"{head} {lost.replace(' ', ''):>7s} {cells[0]}   {cells[1]}")


if __name__ == "__main__":
    main()
