"""tessera and DCP at 0.5, 2 and 4 GB per rank: does the cost per GB stay flat as the state grows?

For each size in ``--sizes`` (GB per rank), fresh gloo processes (``--procs``) hold that many
bytes of fp32 DTensors, ``--tensors`` of them, sharded Shard(0), and measure side by side, in
one run, medians of ``--repeat``:

- **sync save** (fsync'ed) of tessera and DCP, against this machine's durable write limit for
  the same bytes (the best of 1 and 4 files, buffered and ``O_DIRECT``);
- **async save** of the raw DTensors and of the same tensors as a model and its optimizer
  (``ModelState`` + ``OptimizerState``: half the tensors are parameters, the other half their
  SGD momentum buffers, so no byte is added): the **stall** (until the state may change: the
  call plus ``wait_staged``) against a memcpy of the rank's bytes, and **call to commit**
  against the mean of two sync saves of the same state, run just before and just after it (the
  disk's rate drifts between minutes; the ratio to the one before is printed too); DCP's
  ``async_save`` beside them, against its sync save before it;
- **peak extra host memory** (RSS above the level before, sampled every 2 ms) of each async
  save and of the loads;
- **load resharded** Shard(0) -> Shard(1): the first load after the save (right after each
  library's sync save, into targets allocated then, as an evaluation job or a restart on the same
  nodes reads it), warm (after an untimed read) and cold (after ``posix_fadvise(DONTNEED)``),
  against the cold read limit.

The last table gives seconds per GB of each figure at each size and the ratio of the largest
size to the smallest: cost per GB that grows shows there. Memory is kept within the machine:
the limits use one buffer of at most 512 MiB reused (the disk sees the same bytes), and the load
targets exist only after the saves, so a rank holds at most twice its state (the state and a
staging copy, or the state and the load's targets).

    python bench/bench_sweep.py --sizes 0.5,2,4 --repeat 3 [--no-recache] [--train-stall]

``--no-recache`` turns off reading committed files back into the page cache (``TESSERA_RECACHE=0``;
on by default, docs/storage.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from bench_dcp import PeakRSS, evict, make_state, read_into, timed, write_durably
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import tessera
from tessera.storage import recache

LIMIT_BUFFER = 512 << 20
"""The largest buffer a limit measurement allocates; larger states reuse it (same bytes on disk)."""


def _cycled(total: int, buf: memoryview) -> list[memoryview]:
    """``total`` bytes as page-aligned slices of ``buf`` (the same buffer, again and again)."""
    parts, left = [], total
    while left:
        n = min(left, len(buf))
        parts.append(buf[:n])
        left -= n
    return parts


def _read_all(d: str, files: list[str], out: memoryview) -> None:
    """Read each of ``files`` (under ``d``) into the start of ``out``."""
    for f in files:
        p = os.path.join(d, f)
        read_into(p, out[: os.path.getsize(p)])


def measure_limits(d: str, rank_bytes: int, repeat: int, add: Callable[[str, float], None]) -> None:
    """Durable write limit (best of 1 and 4 files, buffered and O_DIRECT), cold read limit (of
    files written buffered, then evicted), the read right after an ``O_DIRECT`` write (this VM's
    disk serves that slower than a later cold read of the same bytes), memcpy."""
    import mmap

    n = min(rank_bytes, LIMIT_BUFFER)
    buf = mmap.mmap(-1, n)  # page-aligned, for O_DIRECT
    src = torch.frombuffer(buf, dtype=torch.uint8)
    src.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
    view = memoryview(buf)
    dst = torch.empty(n, dtype=torch.uint8)
    dst.zero_()
    ldir = os.path.join(d, f"limits-{dist.get_rank()}")
    os.makedirs(ldir, exist_ok=True)
    for trial in range(repeat):
        left = rank_bytes
        dist.barrier()
        t0 = time.perf_counter()
        while left:
            k = min(left, n)
            dst[:k].copy_(src[:k])
            left -= k
        add("memcpy", time.perf_counter() - t0)
        best = float("inf")
        for nfiles in (1, 4):
            for direct in (False, True):
                parts = _cycled(rank_bytes, view)

                def write(p: list[memoryview] = parts, nf: int = nfiles, dr: bool = direct, t: int = trial) -> None:
                    for i, part in enumerate(p):  # each part is a file set of its own: same bytes, same calls
                        paths = [os.path.join(ldir, f"{t}-{nf}-{int(dr)}-{i}-{k}") for k in range(nf)]
                        write_durably(paths, part, dr)

                secs = timed(write)
                best = min(best, secs)
                if nfiles == 1 and direct:  # read at once what O_DIRECT just wrote: nothing is cached
                    fresh = sorted(f for f in os.listdir(ldir) if f.startswith(f"{trial}-1-1-"))
                    add("limit_read_fresh", timed(lambda fs=fresh: _read_all(ldir, fs, memoryview(dst.numpy()))))
                for name in os.listdir(ldir):
                    if not name.startswith(f"{trial}-1-0-"):
                        os.unlink(os.path.join(ldir, name))
        add("limit_write", best)
        files = sorted(f for f in os.listdir(ldir) if f.startswith(f"{trial}-1-0-"))
        dist.barrier()
        evict(ldir)
        add("limit_read_cold", timed(lambda fs=files: _read_all(ldir, fs, memoryview(dst.numpy()))))
        for name in os.listdir(ldir):
            os.unlink(os.path.join(ldir, name))
    shutil.rmtree(ldir, ignore_errors=True)
    # buf is unmapped when the last view of it goes (closing it here would fail on live views)


def model_and_optimizer(src: dict) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The first half of ``src`` as a model's parameters, the second half as their SGD momentum."""
    names = list(src)
    half = len(names) // 2
    model = torch.nn.Module()
    params = []
    for i, name in enumerate(names[:half]):
        p = torch.nn.Parameter(src[name], requires_grad=True)
        model.register_parameter(f"w{i}", p)
        params.append(p)
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for p, name in zip(params, names[half : 2 * half]):
        opt.state[p] = {"momentum_buffer": src[name]}
    return model, opt


def worker(rank: int, world: int, store: str, args: argparse.Namespace, gb: float) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["LOCAL_WORLD_SIZE"] = str(world)  # every rank on this machine, as torchrun says it
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    cols = 4096
    rows = max(world, int(gb * 1e9 * world) // (4 * cols * args.tensors))
    src = make_state(mesh, args.tensors, rows, cols, Shard(0), fill=True)
    rank_bytes = sum(t.to_local().numel() * 4 for t in src.values())
    rec: dict[str, list] = {"rank_bytes": [rank_bytes]}

    def add(key: str, v: float) -> None:
        rec.setdefault(key, []).append(v)

    measure_limits(args.dir, rank_bytes, args.repeat, add)
    model, opt = model_and_optimizer(src)
    gated = {"model": tessera.ModelState(model), "optim": tessera.OptimizerState(model, opt)}
    tessera.save(os.path.join(args.dir, "warmup"), gated)  # plans and imports, untimed
    dist.barrier()
    if rank == 0:
        shutil.rmtree(os.path.join(args.dir, "warmup"), ignore_errors=True)
    d = args.dir

    def fresh_target() -> dict:
        target = make_state(mesh, args.tensors, rows, cols, Shard(1), fill=False)
        for t in target.values():  # fault the target's pages in: the load is timed, not the allocator
            t.to_local().zero_()
        return target

    def load(lib: str, path: str, target: dict) -> None:
        if lib == "tessera":
            tessera.load(path, target)
        else:
            dcp.load(target, checkpoint_id=path)

    def first_load(lib: str, path: str) -> None:
        target = fresh_target()
        with PeakRSS() as mem:
            add(f"load_fresh_{lib}", timed(lambda t=target: load(lib, path, t)))
        add(f"load_mem_{lib}", mem.extra)
        del target

    for trial in range(args.repeat):
        tdir, ddir = f"{d}/tessera-{trial}", f"{d}/dcp-{trial}"
        # Each library's sync save, then at once the first load of that checkpoint (an evaluation
        # job, a verify, a restart on the same nodes), resharded, with whatever the save left cached.
        add("save_tessera", timed(lambda p=tdir: tessera.save(p, src)))
        first_load("tessera", tdir)
        recache.drain(300)  # tessera's reading back of its files must not share the disk with DCP's turn
        add("save_dcp", timed(lambda p=ddir: dcp.save(src, checkpoint_id=p)))
        first_load("dcp", ddir)
        for arm, state in (("raw", src), ("gated", gated), ("dcp", src)):
            if arm == "dcp":
                recache.drain(300)
                # tessera keeps its staging buffer for its next save; DCP's copy and the loads
                # need the room (no public call frees it: the default group's cache is reached here).
                from tessera.engine.saving.cache import cache_for

                cache_for(None).staging.release()
            if arm == "raw":
                # A job's second async save finds its staging buffer allocated and touched: make
                # it so (the buffer was freed for DCP in the trial before), untimed.
                warm = f"{d}/warm-{trial}"
                tessera.async_save(warm, src).wait()
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(warm, ignore_errors=True)
            sdir, adir = f"{d}/{arm}-sync-{trial}", f"{d}/{arm}-async-{trial}"
            if arm == "dcp":
                add(f"sync_{arm}", timed(lambda p=sdir: dcp.save(src, checkpoint_id=p)))
            else:
                add(f"sync_{arm}", timed(lambda p=sdir, s=state: tessera.save(p, s)))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(sdir, ignore_errors=True)
            dist.barrier()
            with PeakRSS() as mem:
                t0 = time.perf_counter()
                if arm == "dcp":
                    fut = dcp.async_save(src, checkpoint_id=adir)
                    add(f"stall_{arm}", time.perf_counter() - t0)
                    fut.result()
                else:
                    pending = tessera.async_save(adir, state)
                    pending.wait_staged()
                    add(f"stall_{arm}", time.perf_counter() - t0)
                    pending.wait()
                dist.barrier()
                add(f"commit_{arm}", time.perf_counter() - t0)
            add(f"async_mem_{arm}", mem.extra)
            if rank == 0:
                shutil.rmtree(adir, ignore_errors=True)
            if arm != "dcp":
                # The disk's rate drifts from one minute to the next at these sizes (a sync save of
                # the same bytes took 3.4-7.4 s within one run): the async save is compared with
                # the sync saves on both sides of it, so that a drift does not land on the ratio.
                dist.barrier()
                after = timed(lambda p=sdir, s=state: tessera.save(p, s))
                add(f"sync_mean_{arm}", (rec[f"sync_{arm}"][-1] + after) / 2)
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(sdir, ignore_errors=True)
        recache.drain(300)
        target = fresh_target()
        for cache in ("warm", "cold"):
            for lib, path in (("tessera", tdir), ("dcp", ddir)):
                if cache == "cold":
                    dist.barrier()
                    if rank == 0:
                        evict(path)
                    dist.barrier()
                else:
                    load(lib, path, target)
                with PeakRSS() as mem:
                    add(f"load_{cache}_{lib}", timed(lambda lib=lib, path=path, t=target: load(lib, path, t)))
                add(f"load_mem_{lib}", mem.extra)
                if cache == "cold" and trial == 0:
                    for k in list(src)[:1]:
                        assert torch.equal(target[k].full_tensor(), src[k].full_tensor()), f"{lib}: wrong load of {k}"
        del target
        dist.barrier()
        if rank == 0:
            for p in (tdir, ddir):
                shutil.rmtree(p, ignore_errors=True)
        dist.barrier()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, rec)
    if rank == 0:
        with open(os.path.join(args.dir, f"sweep-{gb}.json"), "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def med(ranks: list[dict], key: str) -> float:
    """Median over trials of the slowest rank (timed() ends on a barrier)."""
    return statistics.median(max(v) for v in zip(*(r[key] for r in ranks)))


ROWS = [
    # label, key, reference key (or None), what the ratio is
    ("durable write limit", "limit_write", None, ""),
    ("cold read limit", "limit_read_cold", None, ""),
    ("read limit right after an O_DIRECT write (/ cold read limit)", "limit_read_fresh", "limit_read_cold", ""),
    ("memcpy of the rank's bytes", "memcpy", None, ""),
    ("sync save, tessera (/ write limit)", "save_tessera", "limit_write", "lib / limit"),
    ("sync save, DCP (/ write limit)", "save_dcp", "limit_write", "lib / limit"),
    ("async stall, raw DTensors (/ memcpy)", "stall_raw", "memcpy", "lib / limit"),
    ("async stall, ModelState+OptimizerState (/ memcpy)", "stall_gated", "memcpy", "lib / limit"),
    ("async stall, DCP (/ memcpy)", "stall_dcp", "memcpy", "lib / limit"),
    ("async call to commit, raw (/ sync saves before and after it)", "commit_raw", "sync_mean_raw", "target <= 1.3x"),
    (
        "async call to commit, ModelState+OptimizerState (/ sync saves before and after it)",
        "commit_gated",
        "sync_mean_gated",
        "target <= 1.3x",
    ),
    ("async call to commit, raw (/ sync save before it)", "commit_raw", "sync_raw", ""),
    ("async call to commit, ModelState+OptimizerState (/ sync save before it)", "commit_gated", "sync_gated", ""),
    ("async call to commit, DCP (/ its sync save before it)", "commit_dcp", "sync_dcp", ""),
    ("first load after the save, tessera (/ DCP)", "load_fresh_tessera", "load_fresh_dcp", "target <= 0.5x"),
    (
        "first load after the save, tessera (/ own cold load)",
        "load_fresh_tessera",
        "load_cold_tessera",
        "target <= 1.0x",
    ),
    (
        "first load after the save, tessera (/ read limit right after a write)",
        "load_fresh_tessera",
        "limit_read_fresh",
        "",
    ),
    ("warm load, tessera (/ DCP)", "load_warm_tessera", "load_warm_dcp", ""),
    ("cold load, tessera (/ DCP)", "load_cold_tessera", "load_cold_dcp", ""),
    ("cold load, tessera (/ cold read limit)", "load_cold_tessera", "limit_read_cold", ""),
    ("first load after the save, DCP", "load_fresh_dcp", None, ""),
]


def report(results: dict[float, list[dict]], args: argparse.Namespace) -> None:
    sizes = sorted(results)
    print(f"\n{args.procs} ranks, {args.tensors} fp32 DTensors, medians of {args.repeat} (the slowest rank)\n")
    for gb in sizes:
        ranks = results[gb]
        rb = ranks[0]["rank_bytes"][0]
        print(f"### {rb / 1e9:.2f} GB per rank ({rb * len(ranks) / 1e9:.2f} GB in all)\n")
        print("| figure | seconds | ratio | |")
        print("|---|---|---|---|")
        for label, key, ref, note in ROWS:
            v = med(ranks, key)
            ratio = f"{v / med(ranks, ref):.2f}x" if ref else ""
            print(f"| {label} | {v:.3f} | {ratio} | {note} |")
        peak = lambda k, ranks=ranks, rb=rb: max(max(r[k]) for r in ranks) / rb  # noqa: E731
        print(
            f"| peak extra host memory / rank's bytes: async raw {peak('async_mem_raw'):.2f}, "
            f"ModelState+OptimizerState {peak('async_mem_gated'):.2f}, DCP async {peak('async_mem_dcp'):.2f}; "
            f"load: tessera {peak('load_mem_tessera'):.2f}, DCP {peak('load_mem_dcp'):.2f} | | | |\n"
        )
    print("### seconds per GB of a rank's bytes, by size\n")
    print("| figure | " + " | ".join(f"{s} GB" for s in sizes) + " | largest / smallest |")
    print("|---|" + "---|" * (len(sizes) + 1))
    seen = set()
    for label, key, _, _ in ROWS:
        if key in seen:
            continue
        seen.add(key)
        per = [med(results[s], key) / (results[s][0]["rank_bytes"][0] / 1e9) for s in sizes]
        print(f"| {label.split(' (')[0]} | " + " | ".join(f"{p:.3f}" for p in per) + f" | {per[-1] / per[0]:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="0.5,2,4", help="GB per rank, comma-separated")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--train-stall", action="store_true", help="also run bench_train_stall.py at each size")
    ap.add_argument(
        "--no-recache", action="store_true", help="TESSERA_RECACHE=0: committed files are not read back into the cache"
    )
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args()
    args.dir = args.dir or tempfile.mkdtemp(prefix="tessera-sweep-")
    if args.no_recache:
        os.environ["TESSERA_RECACHE"] = "0"  # inherited by the ranks and bench_train_stall.py
    os.makedirs(args.dir, exist_ok=True)
    results = {}
    for gb in (float(s) for s in args.sizes.split(",")):
        store = os.path.join(args.dir, f"store-{gb}")
        mp.start_processes(worker, args=(args.procs, store, args, gb), nprocs=args.procs, start_method="spawn")
        with open(os.path.join(args.dir, f"sweep-{gb}.json")) as f:
            results[gb] = json.load(f)
        print(f"{gb} GB per rank measured at {time.strftime('%H:%M:%S')}", flush=True)
    report(results, args)
    if args.train_stall:
        here = os.path.dirname(os.path.abspath(__file__))
        for gb in results:
            mb = gb * 1024 * args.procs
            print(f"\n### training time lost, {gb} GB per rank (bench_train_stall.py --mb {mb:.0f})\n", flush=True)
            cmd = [sys.executable, os.path.join(here, "bench_train_stall.py"), "--mb", f"{mb:.0f}"]
            cmd += ["--ranks", str(args.procs), "--repeat", str(args.repeat)]
            cmd += ["--arms", "tessera,tessera-uncached,tessera-budget,dcp-thread,memcpy"]
            subprocess.run(cmd, check=True)
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
