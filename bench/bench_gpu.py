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
   no save. The stall (the training time lost) is the extra wall time of those steps, and the
   peak extra host memory of each arm is sampled (VmRSS: pinned memory is resident). tessera
   saves ``{"model": ModelState, "optim": OptimizerState}`` (its hooks hold ``optimizer.step()``
   until the last byte left the device), with a full pinned buffer and with
   ``max_staging_bytes = --budget`` x the state (a small pinned window); each tessera arm's
   checkpoint is checked bit for bit against the state at the call, the loop stepping behind it.
   DCP saves ``get_state_dict`` through ``FileSystemWriter(cache_staged_state_dict=True)`` (pinned
   copy inside the call) and through ``DefaultStager(StagingOptions(pinned, async staging,
   non-blocking copy))``, the loop waiting on ``staging_completion`` before ``optimizer.step()``,
   as torchtitan does.

    python bench/bench_gpu.py --gb 2 --repeat 5 --dir /tmp/tessera-gpu
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
import torch.distributed.checkpoint as dcp
from bench_train_stall import tree_rss  # bench/ is on sys.path when run as a script

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
) -> None:
    for _ in range(steps):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


class PeakRSS:
    """The largest VmRSS of this process (pinned host memory is resident) while in a ``with``,
    sampled every ~5 ms by a thread; ``extra`` is that peak over the RSS at entry."""

    def __enter__(self) -> PeakRSS:
        self.start = self.peak = tree_rss(os.getpid(), [])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, tree_rss(os.getpid(), []))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, tree_rss(os.getpid(), []))

    @property
    def extra(self) -> int:
        return self.peak - self.start


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The state as tessera names it, copied to the host (for the bit-identity check)."""
    out = {f"model.{k}": v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    for name, p in model.named_parameters():
        out.update({f"optim.state.{name}.{k}": v.detach().to("cpu", copy=True) for k, v in opt.state[p].items()})
    return out


def committed_equals(path: str, want: dict[str, torch.Tensor]) -> bool:
    manifest = tessera.read_manifest(path)
    got = {k: torch.empty(manifest.tensors[k].shape, dtype=want[k].dtype) for k in want}
    tessera.load(path, got, strict=False)
    return all(torch.equal(got[k], want[k]) for k in want)


def stall(args: argparse.Namespace, root: str) -> dict[str, object]:
    """Each arm: a warm-up save, then ``--repeat`` windows of ``--steps`` steps with a save before
    the first; the stall is the median window's time over the median window without a save, and
    the peak extra host memory is sampled from before the warm-up to the end of the arm."""
    model, opt = make_model(args.layers, args.width)
    x = torch.randn(args.batch, args.width, device="cuda")
    train_steps(model, opt, x, 3)  # optimizer state exists from here on
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
    base = statistics.median(sync_time(lambda: train_steps(model, opt, x, args.steps)) for _ in range(args.repeat))
    out: dict[str, object] = {"state_gb": state_bytes / 1e9, "base": base}

    def measure(name: str, start: Callable[[], Callable[[], None]], check: Callable[[], bool] | None = None) -> None:
        """``start()`` begins a save and returns what waits for it to be durable."""
        try:
            with PeakRSS() as rss:
                finish = start()
                train_steps(model, opt, x, args.steps)  # warm-up: plans, pools
                torch.cuda.synchronize()
                finish()
                times = []
                for _ in range(args.repeat):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    finish = start()
                    train_steps(model, opt, x, args.steps)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                    finish()
            row: dict[str, object] = {"stall": statistics.median(times) - base, "peak_extra_gb": rss.extra / 1e9}
            if check is not None:
                row["bit_identical"] = check()
            out[name] = row
        except Exception as e:
            out[name] = f"failed: {type(e).__name__}: {e}"

    t_state = {"model": tessera.ModelState(model), "optim": tessera.OptimizerState(model, opt)}

    def tessera_start(options: tessera.SaveOptions | None) -> Callable[[], Callable[[], None]]:
        def start() -> Callable[[], None]:
            return tessera.async_save(os.path.join(root, "train"), t_state, options=options).wait

        return start

    def tessera_check(options: tessera.SaveOptions) -> Callable[[], bool]:
        """One more save, the loop stepping right behind it: the checkpoint is the state at the call."""

        def check() -> bool:
            want = snapshot(model, opt)
            pending = tessera.async_save(os.path.join(root, "check"), t_state, options=options)
            train_steps(model, opt, x, args.steps)
            pending.wait()
            return committed_equals(os.path.join(root, "check"), want)

        return check

    budget = tessera.SaveOptions(max_staging_bytes=int(args.budget * state_bytes))
    # the budget first: the full buffer's pinned pool stays allocated for later saves
    measure(f"tessera async_save, max_staging_bytes = {args.budget:g}x", tessera_start(budget), tessera_check(budget))
    measure("tessera async_save (full pinned buffer)", tessera_start(None), tessera_check(tessera.SaveOptions()))

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

    # one writer for every save: its pinned cache is kept by the writer (a new writer per save
    # would allocate pinned memory inside every call)
    writer = FileSystemWriter(os.path.join(root, "dcp"), cache_staged_state_dict=True)

    def dcp_start(stager: object | None) -> Callable[[], Callable[[], None]]:
        """DCP's classic async save (the FileSystemWriter stages into its cached pinned memory
        inside the call), or, with a stager, the overlapped staging torchtitan uses: the loop
        waits on ``staging_completion`` before ``optimizer.step()``."""

        def start() -> Callable[[], None]:
            if stager is None:
                resp = dcp.async_save(dcp_state(), storage_writer=writer, no_dist=True)
            else:
                resp = dcp.async_save(
                    dcp_state(), checkpoint_id=os.path.join(root, "dcp"), async_stager=stager, no_dist=True
                )
            staging = getattr(resp, "staging_completion", None)
            if staging is not None:
                real_step = opt.step

                def gated_step(*a: object, **k: object) -> object:
                    staging.result()
                    opt.step = real_step  # type: ignore[method-assign]
                    return real_step(*a, **k)

                opt.step = gated_step  # type: ignore[method-assign]
            return getattr(resp, "upload_completion", resp).result

        return start

    measure("DCP async_save (FileSystemWriter, cached pinned)", dcp_start(None))
    name = "DCP async_save (DefaultStager, pinned, async)"
    try:
        stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=True, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=True
            )
        )
    except Exception as e:
        out[name] = f"failed: {type(e).__name__}: {e}"
    else:
        try:
            measure(name, dcp_start(stager))
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
    ap.add_argument("--budget", type=float, default=0.25, help="the budget arm's max_staging_bytes / state bytes")
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
        f"{args.steps} steps of batch {args.batch}; peak extra host memory sampled from the arm's first save"
    )
    print(f"{'':<58}{'stall s':>9}{'peak extra GB':>15}{'  bit-identical'}")
    print(f"{'steps without a save':<58}{s['base']:>9.3f}")
    for name, row in s.items():
        if name in ("state_gb", "base"):
            continue
        if isinstance(row, dict):
            ok = {True: "yes", False: "NO", None: ""}[row.get("bit_identical")]
            print(f"{name:<58}{row['stall']:>9.3f}{row['peak_extra_gb']:>15.2f}  {ok}")
        else:
            print(f"{name:<58}  {row}")


if __name__ == "__main__":
    main()
