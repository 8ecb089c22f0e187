"""tessera's storage backends side by side: local disk, S3 (moto), ``memory://``.

Workload, the same for every backend: ``--procs`` gloo processes hold ``--mb`` MB of fp32
DTensors sharded ``Shard(0)``; they save them, then load them back resharded as ``Shard(1)``
(every rank reads half of every other rank's file). Each measurement is the slowest rank's
time (barriers around it), median of ``--repeat`` trials; GB/s is the checkpoint size over
that time. The first trial's load is checked element by element.

Backends:

* ``local``: a directory on local disk (``FileStorage``, fsync'ed before the commit).
* ``s3 (moto)``: ``s3://`` through the S3 code path (multipart uploads, ranged GETs) to a moto
  server on 127.0.0.1, started by this script. moto is an in-process *Python* server holding
  objects in RAM, so this measures tessera's S3 path and moto's overhead, not S3's bandwidth.
* ``memory://``: fsspec's in-memory filesystem. It is private to each process, so a rank
  cannot read another rank's files: this row loads back in the *same* layout (``Shard(0)``,
  each rank reading its own file) instead of resharding.

Run (about 2 minutes for the defaults on 2 busy cores)::

    .venv/bin/python bench/bench_storage.py --mb 256 --procs 2 --repeat 3

Options: ``--dir`` (where the local checkpoints go, default a temporary directory on disk),
``--backends local,s3,memory`` (a subset), ``--tensors`` (how many tensors).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import tessera
from tessera.storage import storage_for

COLS = 4096
BACKENDS = ("local", "s3", "memory")
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": "/dev/null",
    "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
    "AWS_EC2_METADATA_DISABLED": "true",
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}


def _values(i: int, rows: slice, cols: slice) -> torch.Tensor:
    """Tensor ``i``'s elements in ``[rows, cols]``: exact in fp32 (row * COLS + col < 2**24)."""
    r = torch.arange(rows.start, rows.stop, dtype=torch.float32).unsqueeze(1) * COLS
    c = torch.arange(cols.start, cols.stop, dtype=torch.float32).unsqueeze(0)
    return r + c + i


def make_state(mesh, n_tensors: int, rows: int, dim: int, fill: bool) -> dict[str, DTensor]:
    """``layers.<i>.weight`` ``(rows, COLS)`` sharded ``Shard(dim)`` with torch's chunking rule."""
    world, rank = mesh.size(), mesh.get_coordinate()[0]
    n = (rows, COLS)[dim]
    chunk = -(-n // world)
    lo, hi = min(rank * chunk, n), min((rank + 1) * chunk, n)
    box = [slice(0, rows), slice(0, COLS)]
    box[dim] = slice(lo, hi)
    out = {}
    for i in range(n_tensors):
        local = _values(i, *box) if fill else torch.zeros(box[0].stop - box[0].start, box[1].stop - box[1].start)
        out[f"layers.{i}.weight"] = DTensor.from_local(local, mesh, [Shard(dim)], shape=(rows, COLS), stride=(COLS, 1))
    return out


def check(state: dict[str, DTensor], dim: int, rows: int, world: int, rank: int, label: str) -> None:
    n = (rows, COLS)[dim]
    chunk = -(-n // world)
    box = [slice(0, rows), slice(0, COLS)]
    box[dim] = slice(min(rank * chunk, n), min((rank + 1) * chunk, n))
    for i, t in enumerate(state.values()):
        if not torch.equal(t.to_local(), _values(i, *box)):
            raise AssertionError(f"{label}: rank {rank} loaded wrong values into tensor {i}")


def timed(fn: Callable[[], object]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def url_for(backend: str, args: argparse.Namespace, trial: int) -> str:
    name = f"ckpt-{backend}-{trial}"
    if backend == "local":
        return os.path.join(args.dir, name)
    if backend == "s3":
        return f"s3://{args.bucket}/{args.run}/{name}"
    return f"memory://{args.run}/{name}"


def remove(backend: str, url: str) -> None:
    """Rank 0: drop a checkpoint so that trials do not pile up in RAM or on disk."""
    if backend == "local":
        shutil.rmtree(url, ignore_errors=True)
        return
    store = storage_for(url)
    store.delete(store.list())


def worker(rank: int, world: int, store: str, args: argparse.Namespace) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    rows = max(world, int(args.mb * 1e6) // (4 * COLS * args.tensors))
    src = make_state(mesh, args.tensors, rows, 0, fill=True)
    rec: dict[str, list[float]] = {}

    def add(key: str, v: float) -> None:
        rec.setdefault(key, []).append(v)

    warm = os.path.join(args.dir, "warm-up")  # the global plan is exchanged once, then cached
    tessera.save(warm, src)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(warm, ignore_errors=True)

    for trial in range(args.repeat):
        for backend in args.backends:
            url = url_for(backend, args, trial)
            add(f"{backend}_save", timed(functools.partial(tessera.save, url, src)))
            dim = 0 if backend == "memory" else 1  # memory:// is per process: no resharding
            target = make_state(mesh, args.tensors, rows, dim, fill=False)
            add(f"{backend}_load", timed(functools.partial(tessera.load, url, target)))
            if trial == 0:
                check(target, dim, rows, world, rank, backend)
            del target
            dist.barrier()
            if rank == 0 or backend == "memory":
                remove(backend, url)
            dist.barrier()
    rec["bytes"] = [float(rows * COLS * 4 * args.tensors)]
    gathered: list[dict | None] = [None] * world
    dist.all_gather_object(gathered, rec)
    if rank == 0:
        with open(os.path.join(args.dir, "results.json"), "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def report(ranks: list[dict[str, list[float]]], args: argparse.Namespace) -> None:
    def med(key: str) -> float:
        return statistics.median(max(v) for v in zip(*(r[key] for r in ranks)))

    gb = ranks[0]["bytes"][0] / 1e9

    def cell(key: str) -> str:
        if not all(key in r for r in ranks):
            return ""
        t = med(key)
        return f"{t:.3f} s ({gb / t:.2f} GB/s)"

    labels = {
        "local": "local disk (fsync)",
        "s3": "s3:// on loopback moto",
        "memory": "memory:// (fsspec)",
    }
    print(
        f"\n{len(ranks)} processes, {gb * 1e3:.0f} MB of fp32 DTensors Shard(0) in {args.tensors} tensors, "
        f"medians of {args.repeat} (slowest rank per trial)\n"
    )
    print("| backend | save | load Shard(0) -> Shard(1) |")
    print("|---|---|---|")
    for b in args.backends:
        load = cell(f"{b}_load")
        if b == "memory":
            load += " [same layout]"
        print(f"| {labels[b]} | {cell(f'{b}_save')} | {load} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=256.0, help="checkpoint size in MB (1e6 bytes)")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated subset of " + ",".join(BACKENDS))
    ap.add_argument("--dir", default=None, help="directory for local checkpoints (default: a temporary one)")
    args = ap.parse_args()
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(args.backends) - set(BACKENDS)
    if unknown:
        ap.error(f"unknown backends {sorted(unknown)}; choose from {', '.join(BACKENDS)}")
    if args.mb * 1e6 / (4 * COLS * args.tensors) > (1 << 24) // COLS:
        ap.error("tensors too large for exact fp32 check values; raise --tensors")
    own_dir = args.dir is None
    args.dir = os.path.abspath(args.dir or tempfile.mkdtemp(prefix="tessera-bench-storage-"))
    os.makedirs(args.dir, exist_ok=True)
    args.run = uuid.uuid4().hex[:8]
    server = None
    if "s3" in args.backends:
        import boto3
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
        os.environ.update(AWS_ENV)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        os.environ["AWS_ENDPOINT_URL"] = f"http://{host}:{port}"  # the spawned ranks inherit it
        args.bucket = f"tessera-bench-{args.run}"
        boto3.client("s3").create_bucket(Bucket=args.bucket)
    store = os.path.join(args.dir, "store")
    try:
        mp.start_processes(worker, args=(args.procs, store, args), nprocs=args.procs, start_method="spawn")
        with open(os.path.join(args.dir, "results.json")) as f:
            ranks = json.load(f)
    finally:
        if server is not None:
            server.stop()
        if own_dir:
            shutil.rmtree(args.dir, ignore_errors=True)
        else:
            for name in ("store", "results.json"):
                if os.path.exists(os.path.join(args.dir, name)):
                    os.unlink(os.path.join(args.dir, name))
    report(ranks, args)


if __name__ == "__main__":
    main()
