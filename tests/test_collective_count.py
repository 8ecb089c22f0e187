"""The collective counter (tests/collective_count.py) counts what it claims, and undoes itself."""

from __future__ import annotations

import pickle
import sys
import types
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tests.collective_count import COLLECTIVES, CollectiveCounter, PhaseCounts
from tests.dist_utils import run_distributed

OBJ = {"rank": 0, "names": ["a", "b", "c"]}


def _originals() -> dict[str, Any]:
    return {
        "dist": {n: getattr(dist, n, None) for n in COLLECTIVES},
        "c10d": {n: getattr(c10d, n) for n in COLLECTIVES},
        "by name": vars(sys.modules["_importer"]).copy(),
    }


def _count(rank: int, world: int) -> dict[str, Any]:
    # A module that did `from torch.distributed import broadcast as bcast` before the counter
    # started (as DTensor's mesh_broadcast does), and one that does it while it runs.
    early = sys.modules["_importer"] = types.ModuleType("_importer")
    early.bcast = dist.broadcast  # type: ignore[attr-defined]
    late = sys.modules["_late_importer"] = types.ModuleType("_late_importer")
    before = _originals()
    counter = CollectiveCounter()
    with counter:
        assert dist.all_reduce is not before["dist"]["all_reduce"]
        assert c10d.all_gather is not before["c10d"]["all_gather"]
        assert early.bcast is not before["by name"]["bcast"]
        late.reduce = dist.all_reduce  # type: ignore[attr-defined]
        dist.barrier()  # outside a phase: not recorded
        with counter.phase("object"):
            out: list[Any] = [None] * world
            dist.all_gather_object(out, {**OBJ, "rank": rank})
        with counter.phase("list object"):  # one object that is a list: pickled whole, once
            dist.all_gather_object([None] * world, [OBJ, OBJ])
        with counter.phase("tensor"):
            dist.all_reduce(torch.tensor([1, 2, 3], dtype=torch.int64))
        with counter.phase("broadcast"):
            dist.broadcast(torch.zeros(5, dtype=torch.float32), src=1)
            dist.broadcast_object_list([OBJ, 7], src=0)
    assert out[1]["rank"] == 1
    assert _originals() == before, "the counter left a wrapper installed"
    assert late.reduce is c10d.all_reduce, "a wrapper taken while counting was not restored"
    return dict(counter.phases)


def test_counts_api_calls_wire_ops_and_payload_bytes() -> None:
    ranks: list[dict[str, PhaseCounts]] = run_distributed(_count, 2, timeout=60)
    for rank, phases in enumerate(ranks):
        obj = phases["object"]
        assert (obj.api_calls, obj.calls) == (1, {"all_gather_object": 1}), obj
        assert obj.wire_ops >= 2 and set(obj.wire) <= {"all_gather", "all_gather_into_tensor"}, obj
        assert obj.max_call_bytes == obj.total_bytes == len(pickle.dumps({**OBJ, "rank": rank}))
        assert obj.wire_bytes >= 8 + obj.total_bytes  # the size tensor, then the (padded) pickle

        assert phases["list object"].total_bytes == len(pickle.dumps([OBJ, OBJ]))

        tensor = phases["tensor"]
        assert (tensor.api_calls, tensor.wire_ops) == (1, 1)
        assert tensor.max_call_bytes == tensor.total_bytes == tensor.wire_bytes == 24

        bcast = phases["broadcast"]
        assert bcast.api_calls == 2 and bcast.wire_ops >= 3, bcast
        # the root contributes, the others receive
        tensor_bytes = 20 if rank == 1 else 0
        object_bytes = len(pickle.dumps(OBJ)) + len(pickle.dumps(7)) if rank == 0 else 0
        assert bcast.total_bytes == tensor_bytes + object_bytes, (rank, bcast)
    worst = PhaseCounts.worst([r["broadcast"] for r in ranks])
    assert (worst.max_call_bytes, worst.largest_call) == (
        len(pickle.dumps(OBJ)) + len(pickle.dumps(7)),
        "broadcast_object_list",
    )
