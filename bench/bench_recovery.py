"""Recovery of a lost node from peers' local tiers vs a cold local disk vs loopback S3, and
the cost of replication per save (issue #12).

Workload: 4 gloo processes simulate 2 nodes x 2 ranks (``LOCAL_WORLD_SIZE=2``) holding
``--gb`` GB of fp32 in ``--tensors`` tensors, each split in 4 row blocks (``ShardedTensor``).
Each figure is the slowest rank's time (barriers around it), median of ``--repeat`` trials.

* ``save, local only``: ``CheckpointManager(local_dir=/dev/shm/..., local_replicas=0).save``,
  call to commit: one copy of each rank's bytes into its node's directory.
* ``save, local + 1 replica``: the same with ``local_replicas=1``: the rank's files also go
  over gloo (TCP loopback here) to a rank on the other node, which writes them.
* ``recover from peers``: node 1's local directory is deleted; ``manager.load`` on all 4 ranks
  fetches node 1's files from node 0 (own files + replicas) and loads (``source == "peers"``).
* ``recover, nothing lost``: ``manager.load`` with every node's directory intact (``source == "local"``).
* ``gloo limit, ...``: this machine's own limit for the same bytes: bare ``isend``/``irecv``
  between preallocated buffers, over the rank pairs the tier uses (replicas; the fetch of
  node 1's files).
* ``cold read, local disk``: ``manager.load`` from a durable root on local disk after
  ``posix_fadvise(DONTNEED)`` on every file (the page cache is dropped for them).
* ``loopback S3 (moto)``: ``manager.load`` from ``s3://`` on a moto server on 127.0.0.1.
  moto is a Python server, so this is tessera's S3 path plus moto's overhead, not S3.

Run (the integrator's full size; ``--gb 0.25`` on a busy machine)::

    .venv/bin/python bench/bench_recovery.py --gb 1 --repeat 3

Options: ``--dir`` (disk directory for the durable root, default a temporary directory),
``--shm`` (the local tier's parent, default /dev/shm), ``--no-s3``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tessera
from tessera.manager import CheckpointManager

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_storage import AWS_ENV

WORLD = 4


def _state(rank: int, args: argparse.Namespace, step: int, empty: bool = False) -> dict:
    numel = int(args.gb * 1e9 / 4 / args.tensors)
    rows = (numel // 1024 // WORLD) * WORLD
    mine = rows // WORLD
    out = {}
    for i in range(args.tensors):
        if empty:
            local = torch.zeros(mine, 1024)
        else:
            local = torch.full((mine, 1024), float(step * 100 + i)) + torch.arange(mine).unsqueeze(1) * rank
        out[f"t{i}"] = tessera.ShardedTensor(local, (rows, 1024), (rank * mine, 0))
    return {"model": out, "step": step}


def _check(state: dict, rank: int, step: int) -> None:
    assert state["step"] == step, state["step"]
    for i, t in enumerate(state["model"].values()):
        want = torch.full_like(t.local, float(step * 100 + i)) + torch.arange(t.local.shape[0]).unsqueeze(1) * rank
        assert torch.equal(t.local, want), f"t{i} differs on rank {rank}"


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _drop_cache(root: str) -> None:
    for dirpath, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _exchange(rank: int, pairs: list[tuple[int, int]], nbytes: int) -> Callable[[], None]:
    """Bare gloo: every (src, dst) pair moves ``nbytes`` from one preallocated buffer to another."""
    sends = [torch.ones(nbytes, dtype=torch.uint8) for src, _ in pairs if src == rank]
    recvs = [torch.empty(nbytes, dtype=torch.uint8) for _, dst in pairs if dst == rank]
    for b in recvs:
        b.fill_(0)  # paged in, as the tier's fallocate'd receive files are

    def run() -> None:
        works, s, r = [], iter(sends), iter(recvs)
        for tag, (src, dst) in enumerate(pairs):
            if dst == rank:
                works.append(dist.irecv(next(r), src=src, tag=tag))
        for tag, (src, dst) in enumerate(pairs):
            if src == rank:
                works.append(dist.isend(next(s), dst=dst, tag=tag))
        for w in works:
            w.wait()

    return run


def _limits(rank: int, args: argparse.Namespace, results: dict[str, list[float]]) -> None:
    """This machine's own limit for the same bytes: bare gloo between the pairs the tier uses."""
    from tessera.manager.local_tier import place

    per_rank = sum(t.local.numel() * 4 for t in _state(rank, args, 1)["model"].values())
    placement = place([0, 0, 1, 1], 1)
    replica_pairs = [(src, dst) for src, dsts in enumerate(placement.targets) for dst in dsts]
    # Recovery of node 1: each of its ranks gets its files back from the rank holding their replica.
    fetch_pairs = [(holder, rank) for rank in placement.nodes[1] for holder in placement.targets[rank]]
    for name, pairs in (("gloo limit, replica bytes", replica_pairs), ("gloo limit, fetched bytes", fetch_pairs)):
        run = _exchange(rank, pairs, per_rank)
        run()  # warm-up
        results[name] = [_timed(run) for _ in range(args.repeat)]


def worker(rank: int, store: str, args: argparse.Namespace) -> None:
    os.environ.update({"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    results: dict[str, list[float]] = {}
    src = _state(rank, args, 1)
    for name, replicas in (("save, local only", 0), ("save, local + 1 replica", 1)):
        local = os.path.join(args.shm, f"{name[-9:].replace(' ', '')}-{{node}}")
        mgr = CheckpointManager(args.disk + "/unused", local_dir=local, local_replicas=replicas, durable_every=10**6)
        mgr.save(1, src)  # warm-up (not timed): the coordination group, the plan cache
        times = []
        for s in range(2, args.repeat + 2):
            state = _state(rank, args, s)
            times.append(_timed(lambda m=mgr, s=s, state=state: m.save(s, state)))
        results[name] = times
        if replicas:
            last = args.repeat + 1
            times = []
            for _ in range(args.repeat):
                target = _state(rank, args, 0, empty=True)
                got = []
                times.append(_timed(lambda m=mgr, t=target, g=got: g.append(m.load(t))))
                assert got[0].source == "local" and got[0].step == last, (got[0].source, got[0].step)
            results["recover, nothing lost"] = times
            times = []
            for _ in range(args.repeat):
                if rank == 2:
                    shutil.rmtree(local.format(node=1), ignore_errors=True)
                dist.barrier()
                target = _state(rank, args, 0, empty=True)
                got: list = []
                times.append(_timed(lambda m=mgr, t=target, g=got: g.append(m.load(t))))
                assert got[0].source == "peers" and got[0].step == last, (got[0].source, got[0].step)
                _check(target, rank, last)
            results["recover from peers"] = times
        mgr.close()
        if rank == 0:
            shutil.rmtree(local.format(node=0), ignore_errors=True)
        if rank == 2:
            shutil.rmtree(local.format(node=1), ignore_errors=True)
    _limits(rank, args, results)
    roots = {"cold read, local disk": os.path.join(args.disk, "durable")}
    if args.bucket:
        roots["loopback S3 (moto)"] = f"s3://{args.bucket}/run"
    for name, root in roots.items():
        opts = {"client_kwargs": {"endpoint_url": args.endpoint}} if root.startswith("s3://") else None
        mgr = CheckpointManager(root, storage_options=opts)
        mgr.save(7, src)
        times = []
        for _ in range(args.repeat):
            if rank == 0 and not root.startswith("s3://"):
                _drop_cache(root)
            target = _state(rank, args, 0, empty=True)
            times.append(_timed(lambda m=mgr, t=target: m.load(t)))
            _check(target, rank, 1)
        results[name] = times
        mgr.close()
    if rank == 0:
        with open(os.path.join(args.disk, "results.json"), "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def _drop_page_cache() -> bool:
    """Free the page cache first where allowed (root): otherwise the replicas' /dev/shm pages
    are allocated while the kernel reclaims cache, and replication times drift up by 2x
    between trials (measured: 0.6 s -> 1.3 s per 1 GB by the fourth save)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--shm", default="/dev/shm")
    ap.add_argument("--no-s3", action="store_true")
    args = ap.parse_args()
    run = uuid.uuid4().hex[:8]
    args.disk = os.path.abspath(args.dir or tempfile.mkdtemp(prefix="tessera-bench-recovery-"))
    args.shm = os.path.join(args.shm, f"tessera-bench-recovery-{run}")
    os.makedirs(args.disk, exist_ok=True)
    args.bucket, args.endpoint, server = None, None, None
    if not args.no_s3:
        import boto3
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        os.environ.update(AWS_ENV)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        args.endpoint = f"http://{host}:{port}"
        args.bucket = f"tessera-bench-{run}"
        boto3.client("s3", endpoint_url=args.endpoint).create_bucket(Bucket=args.bucket)
    dropped = _drop_page_cache()
    try:
        mp.start_processes(worker, args=(os.path.join(args.disk, "store"), args), nprocs=WORLD, start_method="spawn")
        with open(os.path.join(args.disk, "results.json")) as f:
            results = json.load(f)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(args.shm, ignore_errors=True)
        if args.dir is None:
            shutil.rmtree(args.disk, ignore_errors=True)
    print(f"{args.gb:g} GB fp32 state, 2 nodes x 2 ranks (gloo on one machine), median of {args.repeat}")
    print(f"page cache dropped before the run: {'yes' if dropped else 'no (not root): replication may drift'}")
    print(f"{'':28s} {'seconds':>9s} {'GB/s':>7s}")
    for name, times in results.items():
        t = statistics.median(times)
        print(f"{name:28s} {t:9.3f} {args.gb / t:7.2f}")
    rows = {k: statistics.median(v) for k, v in results.items()}
    if "recover from peers" in rows:
        extra = rows["save, local + 1 replica"] - rows["save, local only"]
        print(f"replication overhead per save: {extra:.3f} s ({extra / rows['save, local only']:.2f}x one local copy)")
        if "gloo limit, replica bytes" in rows:
            limit = rows["gloo limit, replica bytes"]
            print(f"replication overhead / bare gloo exchange of the same bytes: {extra / limit:.2f}x")
            write_floor = limit + rows["save, local only"]
            print(f"replication overhead / (bare gloo + one local copy): {extra / write_floor:.2f}x")
            floor = rows["gloo limit, fetched bytes"] + rows["recover, nothing lost"]
            print(
                f"recover from peers / (bare gloo fetch + load from memory): {rows['recover from peers'] / floor:.2f}x"
            )
        for other in ("cold read, local disk", "loopback S3 (moto)"):
            if other in rows:
                print(f"recover from peers vs {other}: {rows[other] / rows['recover from peers']:.1f}x faster")


if __name__ == "__main__":
    main()
