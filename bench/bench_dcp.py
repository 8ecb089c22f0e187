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
import fcntl
import mmap
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import tessera

PAGE = os.sysconf("SC_PAGE_SIZE")
WRITE_BYTES = 64 << 20  # one os.write / readinto call of the limit measurements


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


def _write_part(path: str, data: memoryview, direct: bool = False) -> None:
    """Write ``data`` to a new file and fsync it; with ``direct``, through ``O_DIRECT`` (``data``
    page-aligned; a last partial block is written with the flag cleared)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o644)
    try:
        whole = len(data) // 4096 * 4096 if direct else len(data)
        for i in range(0, whole, WRITE_BYTES):
            view = data[i : min(i + WRITE_BYTES, whole)]
            while len(view):
                view = view[os.write(fd, view) :]
        if whole < len(data):
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            view = data[whole:]
            while len(view):
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(paths: list[str], data: memoryview, direct: bool = False) -> None:
    """Write ``data`` split over ``paths`` (one thread each), fsync every file and the directory."""
    step = -(-len(data) // len(paths) // 4096) * 4096  # page multiples: each part stays aligned
    parts = [data[i * step : (i + 1) * step] for i in range(len(paths))]
    if len(paths) == 1:
        _write_part(paths[0], parts[0], direct)
    else:
        with ThreadPoolExecutor(len(paths)) as pool:
            list(pool.map(_write_part, paths, parts, [direct] * len(paths)))
    fd = os.open(os.path.dirname(paths[0]), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_into(path: str, out: memoryview) -> None:
    with open(path, "rb", buffering=0) as f:
        pos = 0
        while pos < len(out):
            n = f.readinto(out[pos : pos + WRITE_BYTES])
            if not n:
                raise EOFError(path)
            pos += n


def measure_limits(args: argparse.Namespace, rank_bytes: int, add: Callable[[str, float], None]) -> None:
    """This machine's limits for these bytes, all ranks at once (each its own ``rank_bytes``).

    ``limit_write``: the fastest durable write of the rank's bytes (1 file, or ``--limit-files``
    files written by as many threads; each file fsync'ed, then the directory), with large
    ``os.write`` calls from memory that is already resident. ``limit_read_cold``: reading the
    rank's bytes back after ``posix_fadvise(DONTNEED)`` into preallocated memory.
    """
    rank = dist.get_rank()
    data = torch.randn(rank_bytes // 4).view(torch.uint8)
    view = memoryview(data.numpy())
    aligned = mmap.mmap(-1, len(view))  # page-aligned, for O_DIRECT writes
    aligned[:] = view
    aligned_view = memoryview(aligned)
    direct_ok = hasattr(os, "O_DIRECT")
    out = torch.zeros_like(data)
    out_view = memoryview(out.numpy())
    ldir = os.path.join(args.dir, f"limits-{rank}")
    os.makedirs(ldir, exist_ok=True)
    for trial in range(args.repeat):
        best = float("inf")
        for nfiles in sorted({1, args.limit_files}):
            for direct in (False, True) if direct_ok else (False,):
                paths = [os.path.join(ldir, f"{trial}-{nfiles}-{int(direct)}-{k}") for k in range(nfiles)]
                src = aligned_view if direct else view
                secs = timed(lambda p=paths, d=direct, v=src: write_durably(p, v, d))
                add(f"limit_write_{nfiles}{'_direct' if direct else ''}", secs)
                best = min(best, secs)
        add("limit_write", best)
        one = os.path.join(ldir, f"{trial}-1-0-0")
        dist.barrier()
        evict(ldir)
        add("limit_read_cold", timed(lambda p=one: read_into(p, out_view)))
        assert torch.equal(out, data), "the read-back limit file differs"
        for name in os.listdir(ldir):
            os.unlink(os.path.join(ldir, name))
    shutil.rmtree(ldir, ignore_errors=True)
    aligned_view.release()
    aligned.close()


def bytecheckpoint_model(mesh, total_bytes: int) -> torch.nn.Module | None:
    """An FSDP2 model of ``total_bytes`` of fp32 weights for ByteCheckpoint, None if it cannot run."""
    try:
        import bytecheckpoint  # noqa: F401 - checked here so a missing package skips the rows
        from torch.distributed.fsdp import fully_shard
    except Exception as e:  # ImportError, or a version clash with this torch
        if dist.get_rank() == 0:
            print(f"ByteCheckpoint skipped: {type(e).__name__}: {e}")
        return None
    cols = 4096
    n_layers = 8
    rows = max(1, total_bytes // (4 * cols * n_layers))
    model = torch.nn.Sequential(*[torch.nn.Linear(cols, rows, bias=False) for _ in range(n_layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def measure_bytecheckpoint(model: torch.nn.Module, path: str, add: Callable[[str, float], None]) -> None:
    """ByteCheckpoint (FSDP2 checkpointer): sync save, and load in the same layout."""
    import bytecheckpoint as bcp

    add("save_bcp", timed(lambda: bcp.save(path + "-sync", {"model": model}, framework="fsdp2")))
    add("load_warm_bcp", timed(lambda: bcp.load(path + "-sync", {"model": model}, framework="fsdp2")))
    # Not measured: fast_saving (its async save). Its completion is only observable through
    # its callback, which in this harness never fired (the run hung); see docs/benchmarks.md.
    dist.barrier()
    if dist.get_rank() == 0:
        for p in (path + "-sync", path + "-async"):
            shutil.rmtree(p, ignore_errors=True)


class GatedState:
    """The benchmark's tensors as a gated Stateful (what ModelState/OptimizerState are): the
    default staging copies them in the background instead of in the call."""

    def __init__(self, tensors: dict) -> None:
        self.tensors = tensors
        self.gate = tessera.StagingGate()

    def state_dict(self) -> dict:
        return self.tensors

    def load_state_dict(self, sd: dict) -> None:
        pass

    def hold_mutations(self, pending: tessera.PendingSave) -> None:
        self.gate.hold(pending)


def measure_gated(src: dict, path: str, add: Callable[[str, float], None]) -> None:
    """The fast path's stall with each mutation check (the default call-time fingerprint, the sampled
    check, none), and the sampled check's own cost."""
    from tessera.engine.saving.sources import MutationCheck
    from tessera.options import StagingCheck

    state = {"model": GatedState(src)}
    tessera.async_save(path, state).wait()  # plan this structure once: both timed saves reuse the plan
    for check in (StagingCheck.FULL, StagingCheck.SAMPLED, StagingCheck.OFF):
        dist.barrier()
        t0 = time.perf_counter()
        pending = tessera.async_save(path, state, options=tessera.SaveOptions(check_staging=check))
        add(f"return_gated_{check.value}", time.perf_counter() - t0)
        pending.wait()
    locals_ = [t.to_local() for t in src.values()]
    names = list(src)
    costs = []
    for _ in range(50):
        t0 = time.perf_counter()
        ref = MutationCheck(locals_, names, skip=set())
        ref.verify(locals_, [t.reshape(-1).view(torch.uint8) for t in locals_], 0, path)
        costs.append(time.perf_counter() - t0)
    add("check_cost", statistics.median(costs))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def worker(rank: int, world: int, store: str, args: argparse.Namespace, results: dict) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["LOCAL_WORLD_SIZE"] = str(world)  # every rank on this machine, as torchrun says it
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    total = int(args.gb * (1 << 30))
    n_tensors = args.tensors
    cols = 4096
    rows = max(world, total // (4 * cols * n_tensors))
    src = make_state(mesh, n_tensors, rows, cols, Shard(0), fill=True)
    rank_bytes = sum(t.to_local().numel() * 4 for t in src.values())
    rec: dict[str, list] = {}
    bcp_model = bytecheckpoint_model(mesh, rank_bytes * world) if args.bytecheckpoint else None

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
    measure_limits(args, rank_bytes, add)

    for trial in range(args.repeat):
        tdir = os.path.join(args.dir, f"tessera-{trial}")
        ddir = os.path.join(args.dir, f"dcp-{trial}")
        sync_result: list = []
        add("save_tessera", timed(lambda: sync_result.append(tessera.save(tdir, src))))  # noqa: B023 - called at once
        add("sync_phases_tessera", sync_result[0].timings)
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
        measure_gated(src, os.path.join(args.dir, f"tessera-gated-{trial}"), add)
        adir_d = os.path.join(args.dir, f"dcp-async-{trial}")
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(src, checkpoint_id=adir_d)
        add("stall_dcp", time.perf_counter() - t0)
        fut.result()

        # Call to commit of an async save, without the memory sampler (its thread takes the GIL),
        # right after a sync save of the same library, so both meet the disk in the same state.
        for lib in ("tessera", "dcp"):
            cdir = os.path.join(args.dir, f"{lib}-commit-{trial}")
            sdir = cdir + "-sync"
            dist.barrier()
            t0 = time.perf_counter()
            if lib == "tessera":
                tessera.save(sdir, src)
            else:
                dcp.save(src, checkpoint_id=sdir)
            dist.barrier()
            add(f"sync_adjacent_{lib}", time.perf_counter() - t0)
            if rank == 0:
                shutil.rmtree(sdir, ignore_errors=True)
            dist.barrier()
            t0 = time.perf_counter()
            if lib == "tessera":
                tp = tessera.async_save(cdir, src)
                add(
                    "async_phases_tessera",
                    {**tp.wait().timings, **{f"stall.{k}": v for k, v in tp.stall_parts.items()}},
                )
            else:
                dcp.async_save(src, checkpoint_id=cdir).result()
            dist.barrier()
            add(f"async_commit_{lib}", time.perf_counter() - t0)
            if rank == 0:
                shutil.rmtree(cdir, ignore_errors=True)
        if bcp_model is not None:
            measure_bytecheckpoint(bcp_model, os.path.join(args.dir, f"bcp-{trial}"), add)

        # fresh: the first load after the save, as an evaluation job, a `tessera verify` or a
        # restart on the same nodes does it (whatever the save left in the page cache); warm: a
        # load after a first, untimed read; cold: after the files were evicted from the page cache.
        for cache in ("fresh", "warm", "cold"):
            for lib, path in (("tessera", tdir), ("dcp", ddir)):
                target = make_state(mesh, n_tensors, rows, cols, Shard(1), fill=False)
                for t in target.values():  # fault the target's pages in: the load is timed, not the allocator
                    t.to_local().zero_()
                if cache == "cold":
                    dist.barrier()
                    if rank == 0:
                        evict(path)
                    dist.barrier()
                elif cache == "warm":  # warm the cache with a first read
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
                if cache == "warm" and lib == "tessera":  # what verifying every byte read costs
                    unverified = tessera.LoadOptions(verify=False)
                    add(
                        "load_warm_unverified",
                        timed(lambda t=target, p=path, o=unverified: tessera.load(p, t, options=o)),
                    )
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
        ("load resharded Shard(0)->Shard(1), first load after the save", "load_fresh_tessera", "load_fresh_dcp"),
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
    print(f"| async_save returns, raw DTensors (copied in the call) | {med('return_tessera'):.3f} s | | |")
    full, gated, unchecked = med("return_gated_full"), med("return_gated_sampled"), med("return_gated_off")
    print(
        f"| async_save returns, gated Stateful (copy in the background; default check: call-time fingerprint) "
        f"| {full * 1e3:.2f} ms | | |"
    )
    print(f"| the same with the sampled check (`check_staging=SAMPLED`) | {gated * 1e3:.2f} ms | | |")
    print(f"| the same with the mutation check off | {unchecked * 1e3:.2f} ms | | |")
    check = med("check_cost")
    print(
        f"| sampled mutation check of one rank's {args.tensors} tensors (call + verify) | {check * 1e6:.0f} us "
        f"({check / gated:.1%} of the sampled stall) | | |"
    )
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


def report_limits(ranks: list[dict[str, list]], args: argparse.Namespace) -> None:
    """Every figure beside this machine's limit for the same bytes, measured in the same run."""

    def med(key: str) -> float | None:
        if key not in ranks[0]:
            return None
        return statistics.median(max(v) for v in zip(*(r[key] for r in ranks)))

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f} s"

    def ratio(num: float | None, den: float | None) -> str:
        return "-" if num is None or den is None else f"{num / den:.2f}x"

    write, read, memcpy = med("limit_write"), med("limit_read_cold"), med("memcpy")
    sync = {lib: med(f"save_{lib}") for lib in ("tessera", "dcp", "bcp")}
    commit = {lib: med(f"async_commit_{lib}") for lib in ("tessera", "dcp", "bcp")}
    stall = {lib: med(f"stall_{lib}") for lib in ("tessera", "dcp", "bcp")}
    warm = {lib: med(f"load_warm_{lib}") for lib in ("tessera", "dcp", "bcp")}
    cold = {lib: med(f"load_cold_{lib}") for lib in ("tessera", "dcp")}
    print("\nAgainst this machine's limits (same bytes, same run; the slowest rank, medians):")
    print(
        f"durable write limit {fmt(write)} (1 file: {fmt(med('limit_write_1'))}, {args.limit_files} files: "
        f"{fmt(med(f'limit_write_{args.limit_files}'))}; O_DIRECT, 1 file: {fmt(med('limit_write_1_direct'))}, "
        f"{args.limit_files} files: {fmt(med(f'limit_write_{args.limit_files}_direct'))}), "
        f"cold read limit {fmt(read)}, memcpy {fmt(memcpy)}\n"
    )
    print("| figure | tessera | DCP | ByteCheckpoint | tessera against | target | DCP against | BCP against |")
    print("|---|---|---|---|---|---|---|---|")

    def row(label: str, vals: dict, target: str, against: Callable[[float | None], str]) -> None:
        cells = [fmt(vals.get(lib)) for lib in ("tessera", "dcp", "bcp")]
        print(
            f"| {label} | {' | '.join(cells)} | {against(vals.get('tessera'))} | {target} | "
            f"{against(vals.get('dcp'))} | {against(vals.get('bcp'))} |"
        )

    row("sync save (write limit / save)", sync, ">= 0.9x", lambda v: ratio(write, v))
    print(
        f"| async save, call to commit (/ own sync save) | {fmt(commit['tessera'])} | {fmt(commit['dcp'])} | "
        f"{fmt(commit['bcp'])} | {ratio(commit['tessera'], sync['tessera'])} | <= 1.1x | "
        f"{ratio(commit['dcp'], sync['dcp'])} | {ratio(commit['bcp'], sync['bcp'])} |"
    )
    adjacent = {lib: med(f"sync_adjacent_{lib}") for lib in ("tessera", "dcp")}
    print(
        f"| async save, call to commit (/ a sync save just before it) | {fmt(commit['tessera'])} | "
        f"{fmt(commit['dcp'])} | - | {ratio(commit['tessera'], adjacent['tessera'])} | <= 1.3x | "
        f"{ratio(commit['dcp'], adjacent['dcp'])} | - |"
    )
    row("stall: until the state may change (/ memcpy)", stall, "<= 1.2x", lambda v: ratio(v, memcpy))
    print(
        f"| load resharded, warm (DCP / lib) | {fmt(warm['tessera'])} | {fmt(warm['dcp'])} | "
        f"{fmt(warm['bcp'])} (same layout) | {ratio(warm['dcp'], warm['tessera'])} | >= 3x | 1.00x | "
        f"{ratio(warm['dcp'], warm['bcp'])} |"
    )
    fresh = {lib: med(f"load_fresh_{lib}") for lib in ("tessera", "dcp")}
    print(
        f"| load resharded, first load after the save (DCP / lib) | {fmt(fresh['tessera'])} | {fmt(fresh['dcp'])} | - | "
        f"{ratio(fresh['dcp'], fresh['tessera'])} | >= 2x | 1.00x | - |"
    )
    print(
        f"| load resharded, first load after the save (/ cold load of the same checkpoint) | | | | "
        f"{ratio(fresh['tessera'], cold['tessera'])} | <= 1.0x | {ratio(fresh['dcp'], cold['dcp'])} | - |"
    )
    unverified = med("load_warm_unverified")
    print(
        f"| load resharded, warm, checksums not verified (`verify=False`: what bounds the row above) | "
        f"{fmt(unverified)} | | - | {ratio(warm['dcp'], unverified)} | | | - |"
    )
    print(
        f"| load resharded, cold (DCP / lib) | {fmt(cold['tessera'])} | {fmt(cold['dcp'])} | - | "
        f"{ratio(cold['dcp'], cold['tessera'])} | >= 1.5x | 1.00x | - |"
    )
    print(
        f"| load resharded, cold (read limit / load) | | | | {ratio(read, cold['tessera'])} | | "
        f"{ratio(read, cold['dcp'])} | |"
    )
    phases = {}
    for key in ("sync_phases_tessera", "async_phases_tessera"):
        if key in ranks[0]:
            names = ranks[0][key][0].keys()
            phases[key] = {n: statistics.median(t.get(n, 0.0) for t in ranks[0][key]) for n in names}
            print(
                f"- rank 0 {key.split('_')[0]} save phases (medians): "
                + ", ".join(f"{n} {v:.3f}" for n, v in phases[key].items() if n != "bytes")
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--limit-files", type=int, default=4, help="files (threads) per rank of the write limit")
    ap.add_argument("--no-bytecheckpoint", dest="bytecheckpoint", action="store_false", help="leave out ByteCheckpoint")
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
    report_limits(ranks, args)
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
