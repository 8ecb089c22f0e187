"""GPU staging: tessera's device-to-host copy against the card's pinned-copy limit, and the
stall a training loop feels when a save is taken, beside DCP's async save with pinned memory.

Three measurements, one process, one GPU, medians over ``--repeat`` runs:

1. **limit**: one ``copy_(non_blocking=True)`` of ``--gb`` GB from device memory into a pinned
   host buffer (the fastest a device-to-host copy of these bytes can go on this machine);
2. **staging**: ``tessera.async_save`` of ``--gb`` GB of CUDA tensors (64 tensors), time from the
   call until ``wait_staged()`` returns (the staging pool is reused after the first save), as
   bandwidth and as a fraction of the limit;
3. **training stall**: an MLP (``--layers`` x ``--width``\u00b2 fp32 weights) trained with AdamW;
   ``--steps`` steps with one save taken before the first of them, against the same steps with
   no save. The stall is the extra wall time of those steps. tessera saves
   ``{"model": ModelState, "optim": OptimizerState}`` (its hooks hold ``optimizer.step()`` until
   the copy is done); DCP saves ``get_state_dict`` with ``DefaultStager(StagingOptions(pinned,
   async staging, non-blocking copy))`` and the loop waits on ``staging_completion`` before
   ``optimizer.step()``, as torchtitan does.

    python bench/bench_gpu.py --gb 2 --repeat 5 --dir /tmp/tessera-gpu
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp

import tessera


def sync_time(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def pinned_copy_limit(nbytes: int, repeat: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst.copy_(src, non_blocking=True)  # warm-up
    times = [sync_time(lambda: dst.copy_(src, non_blocking=True)) for _ in range(repeat)]
    src = dst = None  # free the device and pinned memory before the next measurement
    return statistics.median(times)


def tessera_staging(nbytes: int, repeat: int, root: str) -> tuple[float, float]:
    """Median (call-to-return, call-to-staged) seconds over ``repeat`` saves after a warm-up."""
    numel = nbytes // 4 // 64
    state = {f"w{i}": torch.randn(numel, device="cuda") for i in range(64)}
    returns, staged = [], []
    for i in range(repeat + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pending = tessera.async_save(os.path.join(root, "staging"), state)
        t1 = time.perf_counter()
        pending.wait_staged()
        t2 = time.perf_counter()
        pending.wait()
        if i:  # the first save allocates the pinned pool and builds the plan
            returns.append(t1 - t0)
            staged.append(t2 - t0)
    del state
    return statistics.median(returns), statistics.median(staged)


def make_model(layers: int, width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def train_steps(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    steps: int,
    before_step: Callable[[], None] | None = None,
) -> None:
    for _ in range(steps):
        model(x).square().mean().backward()
        if before_step is not None:
            before_step()
        opt.step()
        opt.zero_grad(set_to_none=True)


def stall(args: argparse.Namespace, root: str) -> dict[str, float]:
    model, opt = make_model(args.layers, args.width)
    x = torch.randn(args.batch, args.width, device="cuda")
    train_steps(model, opt, x, 3)  # optimizer state exists from here on
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
    base = statistics.median(sync_time(lambda: train_steps(model, opt, x, args.steps)) for _ in range(args.repeat))

    t_state = {"model": tessera.ModelState(model), "optim": tessera.OptimizerState(model, opt)}
    pendings: list[tessera.PendingSave] = []

    def tessera_run() -> None:
        pendings.append(tessera.async_save(os.path.join(root, "train"), t_state))
        train_steps(model, opt, x, args.steps)

    tessera_run()  # warm-up: plan and pinned pool
    torch.cuda.synchronize()
    pendings.pop().wait()
    t_times = []
    for _ in range(args.repeat):
        t_times.append(sync_time(tessera_run))
        pendings.pop().wait()

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import get_state_dict

    def dcp_state() -> dict[str, torch.Tensor]:
        msd, osd = get_state_dict(model, opt)
        flat = {f"model.{k}": v.detach() for k, v in msd.items()}
        # AdamW's `step` counters are CPU scalars, left out: DCP's DefaultStager (torch 2.11) fails
        # on them beside CUDA tensors (KeyError: <class 'type'> in its deepcopy).
        flat.update(
            {
                f"optim.{k}.{n}": v.detach()
                for k, st in osd["state"].items()
                for n, v in st.items()
                if isinstance(v, torch.Tensor) and v.is_cuda
            }
        )
        return flat

    def dcp_stall(stager: object | None) -> float:
        """DCP's stall with ``stager`` (overlapped staging: the loop waits on staging_completion
        before optimizer.step, as torchtitan does), or, with None, its classic async save whose
        FileSystemWriter stages into cached pinned memory inside the call."""
        responses: list[object] = []

        def run() -> None:
            if stager is None:
                writer = FileSystemWriter(os.path.join(root, "dcp"), cache_staged_state_dict=True)
                resp = dcp.async_save(dcp_state(), storage_writer=writer, no_dist=True)
            else:
                resp = dcp.async_save(
                    dcp_state(), checkpoint_id=os.path.join(root, "dcp"), async_stager=stager, no_dist=True
                )
            responses.append(resp)
            staging = getattr(resp, "staging_completion", None)
            done = [staging is None]

            def gate() -> None:
                if not done[0]:
                    staging.result()
                    done[0] = True

            train_steps(model, opt, x, args.steps, before_step=gate)

        def finish() -> None:
            resp = responses.pop()
            getattr(resp, "upload_completion", resp).result()

        run()
        torch.cuda.synchronize()
        finish()
        times = []
        for _ in range(args.repeat):
            times.append(sync_time(run))
            finish()
        return statistics.median(times) - base

    out = {"state_gb": state_bytes / 1e9, "base": base, "tessera": statistics.median(t_times) - base}
    out["DCP async_save (FileSystemWriter, cached pinned)"] = dcp_stall(None)
    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=True, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=True
        )
    )
    try:
        out["DCP async_save (DefaultStager, pinned, async)"] = dcp_stall(stager)
    except Exception as e:
        out["DCP async_save (DefaultStager, pinned, async)"] = f"failed: {type(e).__name__}: {e}"
    finally:
        stager.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.0, help="bytes for the limit and staging measurements")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dir", default=None, help="where saves go (default: a temporary directory)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA device")
    root = tempfile.mkdtemp(prefix="tessera-gpu-", dir=args.dir)
    nbytes = int(args.gb * 1e9) // (64 * 4) * (64 * 4)
    gbps = lambda t: nbytes / t / 1e9  # noqa: E731
    try:
        limit = pinned_copy_limit(nbytes, args.repeat)
        ret, staged = tessera_staging(nbytes, args.repeat, root)
        print(f"\ndevice: {torch.cuda.get_device_name()}, torch {torch.__version__}; medians of {args.repeat}")
        print(f"{'measurement':<58}{'time':>10}{'GB/s':>9}{'vs limit':>10}")
        print(
            f"{'pinned D2H copy of %.2f GB (limit)' % (nbytes / 1e9):<58}{limit:>9.3f}s{gbps(limit):>9.1f}{1.0:>10.2f}"
        )
        print(f"{'tessera async_save: call returns':<58}{ret:>9.3f}s")
        print(
            f"{'tessera async_save: call until wait_staged() returns':<58}{staged:>9.3f}s{gbps(staged):>9.1f}"
            f"{limit / staged:>10.2f}",
            flush=True,
        )
        s = stall(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"\ntraining stall, {args.layers}x{args.width}^2 MLP + AdamW ({s['state_gb']:.2f} GB of state), "
        f"{args.steps} steps of batch {args.batch}"
    )
    print(f"{'':<56}{'seconds':>10}")
    print(f"{'steps without a save':<56}{s['base']:>10.3f}")
    for name, value in s.items():
        if name in ("state_gb", "base"):
            continue
        cell = f"{value:>10.3f}" if isinstance(value, float) else f"  {value}"
        print(f"{'stall: ' + (name if name != 'tessera' else 'tessera async_save'):<56}{cell}")


if __name__ == "__main__":
    main()
