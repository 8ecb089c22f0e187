"""tessera vs torch.distributed.checkpoint (DCP), side by side in one run.

Workload: ``--procs`` gloo processes hold ``--gb`` GB of fp32 DTensors sharded Shard(0);
each library saves them to local disk (durable: fsync before commit) and loads them back
resharded as Shard(1), from a warm and from a cold page cache (files evicted with
``posix_fadvise(POSIX_FADV_DONTNEED)``). Every measurement is repeated ``--repeat`` times
and the table shows medians, with DCP/tessera ratios (> 1 means tessera is faster).

Also measured: the stall of ``async_save`` (time until the state may change: the call plus
``PendingSave.wait_staged()``; and, apart, until the call returns) next to a plain
``memcpy`` of the rank's bytes, and the peak extra host memory (RSS above the level before
the operation) during loads and async saves.

    python bench/bench_dcp.py --gb 1 --procs 2 --repeat 3 --dir /tmp/tessera-bench
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import tessera

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def anon() -> int:
    """Anonymous resident memory: what the process allocated, excluding mapped page cache."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakRSS:
    """Samples this process's RSS every 2 ms; ``extra`` is the peak above the start level
    (``extra_anon`` the same for anonymous memory only)."""

    def __enter__(self) -> PeakRSS:
        self.base = rss()
        self.peak = self.base
        self.base_anon = anon()
        self.peak_anon = self.base_anon
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            self.peak_anon = max(self.peak_anon, anon())
            time.sleep(0.002)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())

    @property
    def extra(self) -> int:
        return self.peak - self.base

    @property
    def extra_anon(self) -> int:
        return self.peak_anon - self.base_anon


def evict(path: str) -> None:
    """Drop ``path``'s files from the page cache so the next read comes from the device."""
    os.sync()
    for dirpath, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def make_state(mesh, n_tensors: int, rows: int, cols: int, placement: Shard, fill: bool) -> dict[str, DTensor]:
    world = mesh.size()
    rank = mesh.get_coordinate()[0]
    out = {}
    for i in range(n_tensors):
        full_shape = (rows, cols)
        d = placement.dim
        n = full_shape[d]
        chunk = -(-n // world)
        lo, hi = min(rank * chunk, n), min((rank + 1) * chunk, n)
        local_shape = list(full_shape)
        local_shape[d] = hi - lo
        local = torch.empty(local_shape)
        if fill:
            local.normal_()
        else:
            local.zero_()
        out[f"layers.{i}.weight"] = DTensor.from_local(local, mesh, [placement], shape=full_shape, stride=(cols, 1))
    return out


def timed(fn: Callable[[], object]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def worker(rank: int, world: int, store: str, args: argparse.Namespace, results: dict) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    total = int(args.gb * (1 << 30))
    n_tensors = args.tensors
    cols = 4096
    rows = max(world, total // (4 * cols * n_tensors))
    src = make_state(mesh, n_tensors, rows, cols, Shard(0), fill=True)
    rank_bytes = sum(t.to_local().numel() * 4 for t in src.values())
    rec: dict[str, list[float]] = {}

    def add(key: str, v: float) -> None:
        rec.setdefault(key, []).append(v)

    # A plain memcpy of this rank's bytes into preallocated host memory: the floor for a stall.
    dst = {k: torch.zeros_like(v.to_local()) for k, v in src.items()}  # pages touched: no faults timed
    for _ in range(args.repeat):
        dist.barrier()
        t0 = time.perf_counter()
        for k, v in src.items():
            dst[k].copy_(v.to_local())
        add("memcpy", time.perf_counter() - t0)
    del dst

    for trial in range(args.repeat):
        tdir = os.path.join(args.dir, f"tessera-{trial}")
        ddir = os.path.join(args.dir, f"dcp-{trial}")
        add("save_tessera", timed(lambda: tessera.save(tdir, src)))  # noqa: B023 - called at once
        add("save_dcp", timed(lambda: dcp.save(src, checkpoint_id=ddir)))  # noqa: B023 - called at once

        # Async: the stall is the time until the state may change again (the call returns,
        # then wait_staged: the copy to host memory runs in the background); also recorded,
        # the time until the call returns. Then wait for the commit.
        adir = os.path.join(args.dir, f"tessera-async-{trial}")
        dist.barrier()
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            pending = tessera.async_save(adir, src)
            returned = time.perf_counter() - t0
            pending.wait_staged()
            stall = time.perf_counter() - t0
            pending.wait()
        add("stall_tessera", stall)
        add("return_tessera", returned)
        add("async_mem_tessera", mem.extra)
        adir_d = os.path.join(args.dir, f"dcp-async-{trial}")
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(src, checkpoint_id=adir_d)
        add("stall_dcp", time.perf_counter() - t0)
        fut.result()

        for cache in ("warm", "cold"):
            for lib, path in (("tessera", tdir), ("dcp", ddir)):
                target = make_state(mesh, n_tensors, rows, cols, Shard(1), fill=False)
                if cache == "cold":
                    dist.barrier()
                    if rank == 0:
                        evict(path)
                    dist.barrier()
                else:  # warm the cache with a first read
                    if lib == "tessera":
                        tessera.load(path, target)
                    else:
                        dcp.load(target, checkpoint_id=path)
                with PeakRSS() as mem:
                    if lib == "tessera":
                        secs = timed(lambda t=target, p=path: tessera.load(p, t))
                    else:
                        secs = timed(lambda t=target, p=path: dcp.load(t, checkpoint_id=p))
                add(f"load_{cache}_{lib}", secs)
                add(f"load_mem_{lib}", mem.extra)
                add(f"load_anon_{lib}", mem.extra_anon)
                # Check the reshard is right (against the source) once per trial.
                if cache == "cold" and trial == 0:
                    for k in ("layers.0.weight",):
                        got = target[k].full_tensor()
                        want = src[k].full_tensor()
                        assert torch.equal(got, want), f"{lib} resharded load is wrong"
                del target
        dist.barrier()
        if rank == 0:
            for p in (tdir, ddir, adir, adir_d):
                shutil.rmtree(p, ignore_errors=True)
        dist.barrier()
    rec["rank_bytes"] = [rank_bytes]
    gathered = [None] * world
    dist.all_gather_object(gathered, rec)
    if rank == 0:
        results.update({"ranks": gathered})
        import json

        with open(os.path.join(args.dir, "results.json"), "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def report(ranks: list[dict[str, list[float]]], args: argparse.Namespace) -> None:
    def med(key: str) -> float:
        # The job's time is the slowest rank's in each trial (timed() ends on a barrier).
        per_trial = zip(*(r[key] for r in ranks))
        return statistics.median(max(v) for v in per_trial)

    rank_bytes = ranks[0]["rank_bytes"][0]
    gb = rank_bytes * len(ranks) / 1e9
    rows = [
        ("sync save (fsync'ed)", "save_tessera", "save_dcp"),
        ("load resharded Shard(0)->Shard(1), warm cache", "load_warm_tessera", "load_warm_dcp"),
        ("load resharded Shard(0)->Shard(1), cold cache", "load_cold_tessera", "load_cold_dcp"),
        ("async_save stall (until the state may change)", "stall_tessera", "stall_dcp"),
    ]
    print(
        f"\n{len(ranks)} processes, {gb:.2f} GB of fp32 DTensors ({rank_bytes / 1e6:.0f} MB per rank), "
        f"{args.tensors} tensors, medians of {args.repeat}\n"
    )
    print("| operation | tessera | DCP | DCP / tessera |")
    print("|---|---|---|---|")
    for label, tk, dk in rows:
        t, d = med(tk), med(dk)
        print(f"| {label} | {t:.3f} s ({gb / t:.2f} GB/s) | {d:.3f} s ({gb / d:.2f} GB/s) | {d / t:.2f}x |")
    memcpy = med("memcpy")
    print(f"| memcpy of one rank's bytes | {memcpy:.3f} s | | |")
    print(f"| async_save returns (copy still running) | {med('return_tessera'):.3f} s | | |")
    print()
    print(f"- async stall / DCP sync save: 1/{med('save_dcp') / med('stall_tessera'):.1f}")
    print(f"- async stall / memcpy of the rank's bytes: {med('stall_tessera') / memcpy:.2f}x")
    peak = lambda k: max(max(r[k]) for r in ranks) / 1e6  # noqa: E731
    print(
        f"- peak extra host memory during load (RSS, max over ranks and trials): tessera {peak('load_mem_tessera'):.0f} MB, "
        f"DCP {peak('load_mem_dcp'):.0f} MB; anonymous memory only: tessera {peak('load_anon_tessera'):.0f} MB, "
        f"DCP {peak('load_anon_dcp'):.0f} MB; bytes a rank receives: {rank_bytes / 1e6:.0f} MB"
    )
    print(
        f"- peak extra host memory during async save: tessera {peak('async_mem_tessera'):.0f} MB "
        f"(one staging copy of the rank's bytes is {rank_bytes / 1e6:.0f} MB)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args()
    args.dir = args.dir or tempfile.mkdtemp(prefix="tessera-bench-")
    os.makedirs(args.dir, exist_ok=True)
    store = os.path.join(args.dir, "store")
    if os.path.exists(store):
        os.unlink(store)
    mp.start_processes(worker, args=(args.procs, store, args, {}), nprocs=args.procs, start_method="spawn")
    import json

    with open(os.path.join(args.dir, "results.json")) as f:
        ranks = json.load(f)
    report(ranks, args)
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
