"""Incremental (deduplicated) checkpoints: bytes written and save time, step by step.

Workload (the fine-tuning case dedup is for): ``--world`` gloo processes each hold the whole
model under DDP: a frozen fp32 base of about ``--params`` parameters (``--layers`` square
``nn.Linear`` layers, ``requires_grad=False``) with a LoRA adapter of rank ``--rank`` on every
layer, the only trainable part, trained with AdamW. After every training step, for
``--steps`` steps, every LoRA arm saves the same state (the arms' order rotates by step):

- ``tessera``: ``tessera.CheckpointManager(root, dedup=False)``, ``ModelState`` + ``OptimizerState``;
- ``tessera-dedup``: the same with ``dedup=True`` (unchanged tiles referenced, not rewritten);
- ``dcp``: ``torch.distributed.checkpoint.save`` of ``get_state_dict(model, opt)``, a new
  directory per step;
- ``dcp-trainable``: the same with ``StateDictOptions(ignore_frozen_params=True)``: the frozen
  base is left out (a job that does this must keep the base weights elsewhere to resume).

Then a pre-training state (``full-*`` arms): the same base with every parameter trainable
and changed every step (no LoRA), saved ``--full-steps`` times with ``dedup=False`` and
``dedup=True``: dedup must cost little when nothing can be deduplicated.

Bytes per save are counted on the filesystem: the sizes of the files under the arm's root
that are new after the save (a path not there before, or one replaced: other inode, size or
mtime). Save time is wall time between barriers before and after the call (so the slowest
rank's), with ``os.sync()`` before it so that one save's writeback is not charged to the
next. "Ideal" is what must change per step: the trainable parameters and their AdamW state
(``exp_avg``, ``exp_avg_sq``, ``step``). After the last step every tessera arm is loaded back
into the zeroed model and optimizer and checked bit for bit (``--no-verify`` skips it).

The ``*-dedup`` arms need ``CheckpointManager(dedup=...)``; with a tessera that does not
have it yet they are skipped, with a note. Prints the table, then one JSON line.

    python bench/bench_dedup.py                       # 100M fp32 base, LoRA r=16, 2 ranks, 10 steps
    python bench/bench_dedup.py --quick               # smoke test: 5M params, 3 steps
    python bench/bench_dedup.py --arms tessera,tessera-dedup --dir /tmp/bench-dedup
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import xxhash
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

import tessera

LORA_ARMS = ("tessera", "tessera-dedup", "dcp", "dcp-trainable")
FULL_ARMS = ("full-tessera", "full-tessera-dedup")
BATCH = 16


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update ``B @ A`` (PEFT's init: B = 0)."""

    def __init__(self, d: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(d, d)
        self.base.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.randn(rank, d) / math.sqrt(d))
        self.lora_B = nn.Parameter(torch.zeros(d, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.t()) @ self.lora_B.t()


def build_model(d: int, layers: int, lora_rank: int | None) -> nn.Module:
    """The same weights on every rank (seeded); tanh so that no gradient is exactly zero."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [LoRALinear(d, lora_rank) if lora_rank else nn.Linear(d, d), nn.Tanh()]
    return nn.Sequential(*blocks)


def walk(root: str) -> dict[str, tuple[int, int, int]]:
    """Every file under ``root``: path -> (inode, size, mtime_ns)."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            out[path] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


def new_bytes(before: dict[str, tuple[int, int, int]], after: dict[str, tuple[int, int, int]]) -> tuple[int, int]:
    """Bytes and count of the files in ``after`` that are new or replaced since ``before``."""
    fresh = [v for p, v in after.items() if before.get(p) != v]
    return sum(v[1] for v in fresh), len(fresh)


def fingerprint(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """xxh3 of every parameter, buffer and optimizer state tensor's bytes, by name."""
    out = {}
    tensors = list(model.state_dict().items())
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        tensors += [(f"optim.{names[id(p)]}.{k}", v) for k, v in st.items() if isinstance(v, torch.Tensor)]
    for name, t in tensors:
        out[name] = xxhash.xxh3_64_intdigest(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return out


class Arm:
    """One way of saving the training state: ``save(step)`` is collective."""

    def __init__(self, name: str, root: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.name = name
        self.root = root
        self.model = model
        self.opt = opt
        self.mgr: tessera.CheckpointManager | None = None
        self.total_bytes: list[int] = []  # what tessera says all ranks wrote
        if "tessera" in name:
            # Without dedup= (a tessera from before the feature) the manager is the no-dedup one.
            kw: dict[str, Any] = {"dedup": name.endswith("-dedup")} if has_dedup() else {}
            self.mgr = tessera.CheckpointManager(root, **kw)
            self.state = {"model": tessera.ModelState(model), "optim": tessera.OptimizerState(model, opt)}

    def save(self, step: int) -> None:
        if self.mgr is not None:
            result = self.mgr.save(step, self.state)
            self.total_bytes.append(result.total_bytes)  # type: ignore[union-attr]
            return
        # get_state_dict is part of DCP's save: it builds the FQN-keyed dicts (DDP's "module." dropped).
        options = StateDictOptions(ignore_frozen_params=self.name == "dcp-trainable")
        msd, osd = get_state_dict(self.model, self.opt, options=options)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(self.root, f"step-{step}"))

    def verify_load(self) -> tuple[bool, float]:
        """Zero the model and optimizer state, load the newest step, compare bit for bit; (ok, load seconds)."""
        assert self.mgr is not None
        want = fingerprint(self.model, self.opt)
        with torch.no_grad():
            for t in self.model.state_dict().values():
                t.zero_()
            for st in self.opt.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        v.zero_()
        secs = timed(lambda: self.mgr.load(self.state))  # type: ignore[union-attr]
        return fingerprint(self.model, self.opt) == want, secs


def has_dedup() -> bool:
    return "dedup" in inspect.signature(tessera.CheckpointManager).parameters


def timed(fn: Callable[[], object]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def run_phase(names: list[str], lora_rank: int | None, steps: int, args: argparse.Namespace) -> dict:
    """Train ``steps`` steps; after each, every arm saves the same state. Returns this rank's records."""
    rank = dist.get_rank()
    model = build_model(args.d, args.layers, lora_rank)
    ddp = DDP(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    arms = [Arm(n, os.path.join(args.dir, n), ddp, opt) for n in names]
    rec: dict = {n: {"bytes": [], "files": [], "secs": []} for n in names}
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches; DDP keeps replicas equal
    for step in range(1, steps + 1):
        opt.zero_grad(set_to_none=True)
        ddp(torch.randn(BATCH, args.d, generator=gen)).pow(2).mean().backward()
        opt.step()
        for arm in arms[step % len(arms) :] + arms[: step % len(arms)]:
            before = walk(arm.root) if rank == 0 else {}
            if rank == 0:
                os.sync()
            secs = timed(functools.partial(arm.save, step))
            rec[arm.name]["secs"].append(secs)
            if rank == 0:
                b, n = new_bytes(before, walk(arm.root))
                rec[arm.name]["bytes"].append(b)
                rec[arm.name]["files"].append(n)
    states = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    ideal = sum(p.numel() * p.element_size() for p in trainable) + sum(v.numel() * v.element_size() for v in states)
    rec["_phase"] = {
        "params": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in trainable),
        "ideal_bytes": ideal,
    }
    for arm in arms:
        rec[arm.name]["tessera_total_bytes"] = arm.total_bytes
        if arm.mgr is not None and args.verify:
            ok, secs = arm.verify_load()
            rec[arm.name]["load_ok"], rec[arm.name]["load_secs"] = ok, secs
        if arm.mgr is not None:
            arm.mgr.close()
    dist.barrier()
    if rank == 0 and not args.keep:
        for arm in arms:
            shutil.rmtree(arm.root, ignore_errors=True)
    return rec


def worker(rank: int, world: int, store: str, args: argparse.Namespace) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    out: dict = {}
    lora = [a for a in args.arms if a in LORA_ARMS]
    full = [a for a in args.arms if a in FULL_ARMS]
    if lora:
        out["lora"] = run_phase(lora, args.rank, args.steps, args)
    if full:
        out["full"] = run_phase(full, None, args.full_steps, args)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, out)
    if rank == 0:
        with open(os.path.join(args.dir, "results.json"), "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def summarize(ranks: list[dict], args: argparse.Namespace) -> dict:
    """Per arm: bytes (rank 0's count) and time (slowest rank per save), first save and medians of the rest."""
    summary: dict = {}
    for phase in ("lora", "full"):
        if phase not in ranks[0]:
            continue
        recs = [r[phase] for r in ranks]
        info = recs[0]["_phase"]
        arms = {}
        for name, r0 in recs[0].items():
            if name.startswith("_"):
                continue
            secs = [max(v) for v in zip(*(r[name]["secs"] for r in recs))]
            later_b, later_s = r0["bytes"][1:] or r0["bytes"], secs[1:] or secs
            arms[name] = {
                "first_bytes": r0["bytes"][0],
                "later_bytes": statistics.median(later_b),
                "first_secs": secs[0],
                "later_secs": statistics.median(later_s),
                "bytes": r0["bytes"],
                "files": r0["files"],
                "secs": secs,
                "tessera_total_bytes": r0["tessera_total_bytes"],
                **{k: r0[k] for k in ("load_ok", "load_secs") if k in r0},
            }
        summary[phase] = {**info, "arms": arms}
    return summary


def print_table(summary: dict, args: argparse.Namespace) -> None:
    titles = {
        "lora": f"LoRA fine-tuning: frozen base + rank-{args.rank} adapters, {args.steps} saves",
        "full": f"pre-training: every parameter trainable, {args.full_steps} saves",
    }
    for phase, s in summary.items():
        ideal = s["ideal_bytes"]
        print(
            f"\n{titles[phase]}; {s['params'] / 1e6:.1f}M fp32 parameters ({args.layers} x Linear({args.d}, {args.d})), "
            f"{s['trainable'] / 1e6:.2f}M trainable, {args.world} gloo ranks; ideal per save {ideal / 1e6:.2f} MB "
            f"(trainable parameters + AdamW state)\n"
        )
        print(
            "| arm | first save | later saves (median) | / ideal | / tessera | first save time | "
            "later save time (median) | / tessera |"
        )
        print("|---|---|---|---|---|---|---|---|")
        base = s["arms"].get("full-tessera" if phase == "full" else "tessera")
        for name, a in s["arms"].items():
            rb = f"{a['later_bytes'] / base['later_bytes']:.3f}x" if base else "-"
            rt = f"{a['later_secs'] / base['later_secs']:.2f}x" if base else "-"
            print(
                f"| {name} | {a['first_bytes'] / 1e6:.2f} MB | {a['later_bytes'] / 1e6:.2f} MB | "
                f"{a['later_bytes'] / ideal:.2f}x | {rb} | {a['first_secs']:.3f} s | {a['later_secs']:.3f} s | {rt} |"
            )
        for name, a in s["arms"].items():
            if "load_ok" in a:
                print(f"- {name}: newest step loaded back bit for bit: {a['load_ok']} ({a['load_secs']:.3f} s)")
            told = a["tessera_total_bytes"]
            if told and any(abs(t - b) > 0.05 * b for t, b in zip(told, a["bytes"])):
                print(f"- {name}: tessera's total_bytes {told} differ from the files counted {a['bytes']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=100e6, help="size of the base model (parameters)")
    ap.add_argument("--layers", type=int, default=24, help="square Linear layers of the base")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank r")
    ap.add_argument("--steps", type=int, default=10, help="saves of the LoRA arms (one per step)")
    ap.add_argument("--full-steps", type=int, default=5, help="saves of the pre-training arms")
    ap.add_argument("--world", type=int, default=2, help="gloo processes")
    ap.add_argument("--dir", default=None, help="where to write (default: a new temporary directory)")
    ap.add_argument("--arms", default=",".join(LORA_ARMS + FULL_ARMS), help="comma list of arms")
    ap.add_argument("--quick", action="store_true", help="smoke test: 5M parameters, 3 steps")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints (default: removed after each phase)")
    ap.add_argument("--no-verify", dest="verify", action="store_false", help="skip the load-back check")
    args = ap.parse_args()
    if args.quick:
        args.params, args.layers, args.steps, args.full_steps = 5e6, 8, 3, 3
    args.d = max(64, round(math.sqrt(args.params / args.layers) / 64) * 64)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in args.arms if a not in LORA_ARMS + FULL_ARMS]
    if unknown:
        ap.error(f"unknown arms {unknown}; choose from {', '.join(LORA_ARMS + FULL_ARMS)}")
    skipped = [a for a in args.arms if a.endswith("-dedup") and not has_dedup()]
    if skipped:
        print(f"skipped {skipped}: this tessera's CheckpointManager has no dedup= yet", file=sys.stderr)
        args.arms = [a for a in args.arms if a not in skipped]
    made_dir = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="tessera-bench-dedup-")
    os.makedirs(args.dir, exist_ok=True)
    store = os.path.join(args.dir, "store")
    if os.path.exists(store):
        os.unlink(store)
    mp.start_processes(worker, args=(args.world, store, args), nprocs=args.world, start_method="spawn")
    with open(os.path.join(args.dir, "results.json")) as f:
        ranks = json.load(f)
    os.unlink(os.path.join(args.dir, "results.json"))
    if os.path.exists(store):
        os.unlink(store)
    if made_dir and not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)
    summary = summarize(ranks, args)
    print_table(summary, args)
    config = {k: v for k, v in vars(args).items() if k not in ("dir",)}
    print(json.dumps({"command": " ".join(["python", *sys.argv]), "config": config, "skipped": skipped, **summary}))


if __name__ == "__main__":
    main()
