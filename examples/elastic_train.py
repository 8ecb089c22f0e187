"""Elastic training: survive lost workers and preemption with torchrun restarts and tessera.

Run it under torchrun's elastic agent (2 workers per node, 1 to 2 nodes, up to 3 restarts)::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=1:2 --nproc-per-node=2 --max-restarts=3 \\
        --rdzv-backend=c10d --rdzv-endpoint=$HEAD_NODE:29400 --rdzv-id=run-7 \\
        examples/elastic_train.py --ckpt /shared/ckpt/run-7 --steps 200 --save-every 10

When a worker (or a whole node) dies, torchrun stops the others and starts the job again on
whatever nodes are left, up to ``--max-restarts`` times. Every start begins with
``manager.load(state)``: the newest complete checkpoint is loaded into the current layout
(world size may have changed) and training continues from the step after it; on the very
first start there is none and training begins at step 0.
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives every start a fresh rendezvous store: with the
agent's shared store a restarted gloo worker may read a dead worker's address
(pytorch/pytorch#167288).

SIGTERM (what schedulers and torchrun's agent send before killing a job) is turned into one
last checkpoint: at the next step boundary every rank agrees (even ranks that saw no
signal), saves synchronously, and exits 0. Disable with ``--no-preemption``.

With ``--local-tier``, every checkpoint goes to node-local memory (``--local-dir``) and is
replicated to another node, and every ``--durable-every``-th step also goes to ``--ckpt``: a
restart on the surviving nodes resumes from the newest step they hold between them. On a
cluster give ``--local-dir`` a node-local path, the same string on every node
(``/dev/shm/tessera-run-7``); ``{node}`` in it (the node index) is for several simulated nodes
on one machine.

``--status-dir`` and ``--result`` write JSON for tests and dashboards: each rank's pid and
step, and rank 0's final loss.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

import tessera
from tessera.adapters import DataPosition, ModelState, OptimizerState


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True, help="durable checkpoint root (a directory or any storage URL)")
    p.add_argument("--steps", type=int, default=40, help="train until this step")
    p.add_argument("--save-every", type=int, default=5, help="save every N steps")
    p.add_argument("--save-every-seconds", type=float, default=None, help="also save every T seconds")
    p.add_argument("--batch", type=int, default=12, help="global batch size")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--no-preemption", action="store_true", help="do not turn SIGTERM into a last checkpoint")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (a slower job)")
    p.add_argument("--local-tier", action="store_true", help="use the replicated node-local tier")
    p.add_argument("--local-dir", default="/dev/shm/tessera-{node}", help="node-local directory of the tier")
    p.add_argument("--local-replicas", type=int, default=1)
    p.add_argument("--durable-every", type=int, default=10)
    p.add_argument("--status-dir", default=None, help="write <rank>.json (pid, step) here after every step")
    p.add_argument("--result", default=None, help="rank 0 writes the final loss here as JSON")
    return p.parse_args(argv)


def make_manager(args: argparse.Namespace) -> tessera.CheckpointManager:
    policy: tessera.manager.SavePolicy = tessera.manager.EveryNSteps(args.save_every)
    if args.save_every_seconds is not None:
        policy = tessera.manager.AnyOf(policy, tessera.manager.EveryNSeconds(args.save_every_seconds))
    kwargs: dict = {
        "keep_last": args.keep_last,
        "async_save": True,
        "save_policy": policy,
        "preemption": not args.no_preemption,
    }
    if args.local_tier:
        kwargs.update(local_dir=args.local_dir, local_replicas=args.local_replicas, durable_every=args.durable_every)
    return tessera.CheckpointManager(args.ckpt, **kwargs)


def write_json(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def main(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = DDP(common.ToyModel())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    data = DataPosition()
    state = {"model": ModelState(model), "optim": OptimizerState(model, opt), "data": data, "step": 0}
    x, y = common.dataset()

    with make_manager(args) as manager:
        resumed_from = source = None
        try:
            loaded = manager.load(state)
            resumed_from, source = loaded.step, loaded.source
        except tessera.CheckpointNotFoundError:
            pass  # the first start: nothing saved yet
        if rank == 0:
            where = "from scratch" if resumed_from is None else f"from step {resumed_from}"
            print(f"start {restart}: {world} workers, training {where}", flush=True)

        loss_value = float("nan")
        while state["step"] < args.steps:
            idx = data.batch_indices(len(x), args.batch, rank, world)
            loss = F.mse_loss(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            opt.zero_grad()
            data.advance(args.batch)
            state["step"] += 1
            step = state["step"]
            avg = loss.detach().clone()
            dist.all_reduce(avg)
            loss_value = avg.item() / world
            if args.status_dir is not None:
                status = {"pid": os.getpid(), "step": step, "restart": restart, "resumed_from": resumed_from}
                write_json(os.path.join(args.status_dir, f"{rank}.json"), status)
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if manager.should_save(step):  # the same answer on every rank
                pending = manager.save(step, state)
                if isinstance(pending, tessera.PendingSave):
                    pending.wait_staged()  # the optimizer may change the tensors from here on
            if manager.reached_preemption:  # the preemption checkpoint is committed
                if args.status_dir is not None:
                    status = {"pid": os.getpid(), "step": step, "restart": restart, "preempted_at": step}
                    write_json(os.path.join(args.status_dir, f"{rank}.json"), status)
                if rank == 0:
                    print(f"preempted: saved step {step}, exiting", flush=True)
                return
        manager.wait()
        if rank == 0:
            print(f"finished step {state['step']}: loss {loss_value!r}", flush=True)
            if args.result is not None:
                result = {"final_loss": loss_value, "step": state["step"], "restart": restart}
                write_json(args.result, {**result, "resumed_from": resumed_from, "source": source, "world": world})


if __name__ == "__main__":
    if "RANK" not in os.environ:
        raise SystemExit("run this example under torchrun (see the command at the top of the file)")
    arguments = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        main(arguments)
        dist.barrier()
    finally:
        dist.destroy_process_group()
