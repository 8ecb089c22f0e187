"""How much a save writing in the background slows a Python-heavy training loop.

One process (a gloo group of one) trains a small MLP with many tiny ops (``--layers`` Linear
+ ReLU layers of ``--width``, AdamW): each step is mostly Python and dispatcher work, so it
needs the GIL all the time. While it trains, a save of ``--mb`` MB of other CPU tensors runs
in the background. For each writer (tessera with ``WriterMode.THREAD`` and
``WriterMode.PROCESS``; DCP's ``async_save`` with ``AsyncCheckpointerType.THREAD`` and
``PROCESS``) the table shows, medians over ``--repeat`` saves:

- **stall**: how long the save call (plus tessera's ``wait_staged``) blocked the loop;
- **to commit**: from the call until the checkpoint is committed;
- **slowdown**: mean step time while the save was in flight over the mean step time with no
  save (steps measured back to back before each save), minus 1;
- **lost**: the training time lost to the save: stall plus the extra time of the steps run
  while it was in flight.

Each writer saves once before it is measured (a writer process and its shared memory are
started then, as in a real job where the first save pays for them); the order of the
writers rotates from trial to trial.

    python bench/bench_train_stall.py --mb 256 --repeat 5
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
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import tessera
from tessera import SaveOptions
from tessera.options import WriterMode

WRITERS = ("tessera-thread", "tessera-process", "dcp-thread", "dcp-process")


def make_loop(layers: int, width: int, batch: int) -> Callable[[], None]:
    layers_ = []
    for _ in range(layers):
        layers_ += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers_)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, width)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    return step


def start_save(writer: str, path: str, state: dict[str, torch.Tensor]) -> tuple[float, Callable[[], bool]]:
    """Start a background save; ``(seconds the call blocked, is it committed?)``."""
    t0 = time.perf_counter()
    if writer.startswith("tessera"):
        mode = WriterMode.PROCESS if writer.endswith("process") else WriterMode.THREAD
        pending = tessera.async_save(path, state, options=SaveOptions(writer=mode))
        pending.wait_staged()
        stall = time.perf_counter() - t0

        def done() -> bool:
            if pending.done():
                pending.wait()  # raise a failure here
                return True
            return False

        return stall, done
    kind = AsyncCheckpointerType.PROCESS if writer.endswith("process") else AsyncCheckpointerType.THREAD
    fut = dcp.async_save(state, checkpoint_id=path, async_checkpointer_type=kind)
    stall = time.perf_counter() - t0

    def done_dcp() -> bool:
        if fut.done():
            fut.result()
            return True
        return False

    return stall, done_dcp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=256)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--baseline-steps", type=int, default=40)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--writers", default=",".join(WRITERS))
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="tessera-train-stall-")
    os.makedirs(root, exist_ok=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=0, world_size=1)
    writers = args.writers.split(",")
    n = int(args.mb * (1 << 20)) // 4 // args.tensors
    state = {f"blob.{i}": torch.randn(n) for i in range(args.tensors)}
    step = make_loop(args.layers, args.width, args.batch)
    for _ in range(20):
        step()
    rec: dict[str, dict[str, list[float]]] = {w: {} for w in writers}
    for trial in range(-1, args.repeat):  # trial -1: each writer's first save, not measured
        k = trial % len(writers)  # rotate who goes first: the machine's state differs
        for w in writers[k:] + writers[:k]:
            path = os.path.join(root, f"{w}-{trial}")
            t0 = time.perf_counter()
            for _ in range(args.baseline_steps):
                step()
            base = (time.perf_counter() - t0) / args.baseline_steps
            t0 = time.perf_counter()
            stall, done = start_save(w, path, state)
            steps = 0
            t1 = time.perf_counter()
            while not done():
                step()
                steps += 1
            end = time.perf_counter()
            shutil.rmtree(path, ignore_errors=True)
            if trial < 0:
                continue
            during = (end - t1) / steps if steps else base
            r = rec[w]
            for key, v in (
                ("stall", stall),
                ("commit", end - t0),
                ("slowdown", during / base - 1),
                ("lost", stall + steps * (during - base)),
                ("steps", steps),
                ("base_ms", base * 1e3),
            ):
                r.setdefault(key, []).append(v)
    dist.destroy_process_group()
    shutil.rmtree(root, ignore_errors=True)
    print(
        f"\n{args.mb:.0f} MB saved in the background ({args.tensors} CPU tensors), an MLP of {args.layers} x "
        f"{args.width} training meanwhile; medians of {args.repeat}\n"
    )
    print("| writer | stall | to commit | steps during | step time without save | slowdown while saving | lost |")
    print("|---|---|---|---|---|---|---|")
    for w in writers:
        m = {k: statistics.median(v) for k, v in rec[w].items()}
        print(
            f"| {w} | {m['stall']:.3f} s | {m['commit']:.3f} s | {m['steps']:.0f} | {m['base_ms']:.2f} ms | "
            f"{m['slowdown'] * 100:+.0f}% | {m['lost']:.3f} s |"
        )


if __name__ == "__main__":
    main()
