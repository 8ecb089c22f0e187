"""How much tessera and DCP coordinate: every torch.distributed call of a save and a load.

At scale a checkpoint is bounded by coordination, not bytes (issue 26); the targets are a
steady-state save and a load with at most 2 collectives of at most 1 KiB per rank each
(DESIGN.md, "Distribution and scale"). This benchmark counts, in a real ``--ranks``-process
gloo job, the collectives each library makes (tests/collective_count.py: API calls, the wire
ops underneath, and the bytes each rank contributes) in each phase:

* a first save, a steady-state save (same structure, new path) and an async steady-state
  save (waited for);
* loads of that last checkpoint into the saved layout, into a 2-D mesh (2 x ranks/2,
  ``(Shard(0), Shard(1))``: a real reshard) and into plain full tensors on every rank.

The state is FSDP2-shaped: 5 Linear layers as DTensors ``Shard(0)`` over a 1-D mesh, an
AdamW-like optimizer state (``exp_avg``, ``exp_avg_sq`` with the same placements, a ``step``
tensor per parameter) and a plain int: 40 tensors. DCP runs with its defaults and, for the
saves, once more with ``DefaultSavePlanner(enable_plan_caching=True)``. Every load is
checked against the saved values (``full_tensor()``, after the counted phase).

Each count is the maximum over ranks (rank 0 coordinates, so it usually sends most). Prints
a markdown table, then as its last line one JSON object with every count, by library and
phase. Not a timing benchmark.

    python bench/bench_coordination.py --ranks 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo: tests/

import tessera
from tests.collective_count import CollectiveCounter, PhaseCounts
from tests.dist_utils import run_distributed

LAYERS = [(64, 128), (128, 128), (128, 128), (128, 64), (64, 32)]  # Linear(in, out)
KIB = 1024
SAVES = ("first save", "steady save", "async steady save")
LOADS = ("load, same layout", "resharded load (2-D mesh)", "load into plain tensors")
STEADY = ("steady save", "async steady save", *LOADS)  # the phases with a target

Layout = Callable[[torch.Tensor], torch.Tensor]


def truth(version: int) -> dict[str, Any]:
    """The full (unsharded) state at training step ``version``: the same on every rank."""
    g = torch.Generator().manual_seed(1000 + version)
    model: dict[str, torch.Tensor] = {}
    for i, (fan_in, fan_out) in enumerate(LAYERS):
        model[f"layers.{i}.weight"] = torch.randn(fan_out, fan_in, generator=g)
        model[f"layers.{i}.bias"] = torch.randn(fan_out, generator=g)
    optim = {
        name: {
            "step": torch.tensor(float(version + 1)),
            "exp_avg": torch.randn(t.shape, generator=g),
            "exp_avg_sq": torch.rand(t.shape, generator=g),
        }
        for name, t in model.items()
    }
    return {"model": model, "optim": {"state": optim}, "epoch": 100 + version}


def shard0(mesh: DeviceMesh) -> Layout:
    return lambda t: distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None)


def mesh_2d(mesh: DeviceMesh) -> Layout:
    def place(t: torch.Tensor) -> torch.Tensor:
        placements: list[Placement] = [Shard(0), Shard(1)] if t.dim() == 2 else [Replicate(), Shard(0)]
        return distribute_tensor(t, mesh, placements, src_data_rank=None)

    return place


def laid_out(state: Any, layout: Layout, zero: bool = False) -> Any:
    """``state`` with every non-scalar tensor placed by ``layout`` (zeroed: a load target)."""
    if isinstance(state, dict):
        return {k: laid_out(v, layout, zero) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        t = torch.zeros_like(state) if zero else state.clone()
        return layout(t) if t.dim() > 0 else t
    return 0 if zero else state


def check_equal(loaded: Any, expected: Any, where: str) -> None:
    """Raise naming the first value of ``loaded`` that differs from the full ``expected``."""
    if isinstance(expected, dict):
        for k, v in expected.items():
            check_equal(loaded[k], v, f"{where}.{k}")
        return
    if isinstance(expected, torch.Tensor):
        full = loaded.full_tensor() if isinstance(loaded, DTensor) else loaded
        if not torch.equal(full, expected):
            raise AssertionError(f"rank {torch.distributed.get_rank()}: {where} differs from the saved tensor")
        return
    if loaded != expected:
        raise AssertionError(f"rank {torch.distributed.get_rank()}: {where} is {loaded!r}, saved {expected!r}")


def run_library(counter: CollectiveCounter, lib: str, root: str, layouts: dict[str, Layout]) -> None:
    """Count ``lib``'s saves and loads as phases ``"<lib>: <phase>"``."""
    paths = [os.path.join(root, f"{lib}-{i}") for i in range(len(SAVES))]
    for version, (phase, path) in enumerate(zip(SAVES, paths, strict=True)):
        state = laid_out(truth(version), layouts["shard0"])
        with counter.phase(f"{lib}: {phase}"):
            if lib == "tessera":
                if phase.startswith("async"):
                    tessera.async_save(path, state).wait()
                else:
                    tessera.save(path, state)
            elif phase.startswith("async"):
                pending = dcp.async_save(state, checkpoint_id=path)
                (pending if isinstance(pending, Future) else pending.upload_completion).result()
            else:
                dcp.save(state, checkpoint_id=path)
    expected = truth(len(SAVES) - 1)
    for phase, layout in zip(LOADS, ("shard0", "2d", "plain"), strict=True):
        target = laid_out(expected, layouts[layout], zero=True)
        with counter.phase(f"{lib}: {phase}"):
            if lib == "tessera":
                tessera.load(paths[-1], target)
            else:
                dcp.load(target, checkpoint_id=paths[-1])
        check_equal(target, expected, f"{lib} {phase}: state")


def run_cached_dcp(counter: CollectiveCounter, root: str, layout: Layout) -> None:
    """DCP's saves once more with its plan cache on (the planner reuses the last global plan)."""
    for version, phase in enumerate(SAVES[:2]):
        state = laid_out(truth(version), layout)
        with counter.phase(f"dcp+cache: {phase}"):
            dcp.save(state, checkpoint_id=os.path.join(root, f"dcp-cache-{version}"),
                     planner=DefaultSavePlanner(enable_plan_caching=True))  # fmt: skip


def rank_main(rank: int, world: int, root: str) -> dict[str, PhaseCounts]:
    mesh1 = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, world // 2))
    layouts: dict[str, Layout] = {"shard0": shard0(mesh1), "2d": mesh_2d(mesh2), "plain": lambda t: t}
    with CollectiveCounter() as counter:
        run_library(counter, "tessera", root, layouts)
        run_library(counter, "dcp", root, layouts)
        run_cached_dcp(counter, root, layouts["shard0"])
    return counter.phases


def target_met(counts: PhaseCounts) -> str:
    return "yes" if counts.api_calls <= 2 and counts.max_call_bytes <= KIB else "no"


def table(worst: dict[str, PhaseCounts]) -> str:
    rows = [
        "| phase | library | API calls | wire ops | max B / call (which) | total B | groups created | target | API calls by name |",
        "|---|---|--:|--:|--:|--:|--:|:-:|---|",
    ]
    phases = [*SAVES, *LOADS]
    for phase in phases:
        for lib in ("tessera", "dcp", "dcp+cache"):
            c = worst.get(f"{lib}: {phase}")
            if c is None:
                continue
            names = ", ".join(f"{n} x{k}" for n, k in c.calls.items()) or "-"
            target = target_met(c) if phase in STEADY else "-"
            rows.append(
                f"| {phase} | {lib} | {c.api_calls} | {c.wire_ops} | {c.max_call_bytes:,} ({c.largest_call or '-'}) | {c.total_bytes:,} "
                f"| {c.groups_created} | {target} | {names} |"
            )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--dir", default=None, help="where to write the checkpoints (a fresh folder in it, removed after)"
    )
    parser.add_argument("--ranks", type=int, default=4, help="gloo processes (even, at least 4: the 2-D mesh)")
    args = parser.parse_args()
    if args.ranks < 4 or args.ranks % 2:
        parser.error(f"--ranks must be even and at least 4 (a 2 x ranks/2 mesh), got {args.ranks}")
    if args.dir is not None:
        os.makedirs(args.dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="tessera-coordination-", dir=args.dir)
    try:
        per_rank: list[dict[str, PhaseCounts]] = run_distributed(rank_main, args.ranks, root, timeout=600)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    worst = {phase: PhaseCounts.worst([r[phase] for r in per_rank]) for phase in per_rank[0]}
    tensors = sum(len(v) for v in truth(0)["optim"]["state"].values()) + len(truth(0)["model"])
    print(f"torch {torch.__version__}, {args.ranks} gloo ranks, {tensors} tensors + 1 int; each count is the maximum over ranks; "
          f"target: at most 2 API calls of at most {KIB} B per rank (steady saves and loads)\n")  # fmt: skip
    print(table(worst))
    counts: dict[str, dict[str, Any]] = {}
    for key, c in worst.items():
        lib, phase = key.split(": ", 1)
        counts.setdefault(lib, {})[phase] = c.as_dict()
    print(json.dumps({"torch": torch.__version__, "ranks": args.ranks, "tensors": tensors, "counts": counts}))


if __name__ == "__main__":
    main()
