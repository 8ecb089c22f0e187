"""How the ranks of a save or a load coordinate: few fixed-size collectives, and every failure loud.

The counts are checked with real gloo process groups and a counter of every
``torch.distributed`` call (``tests/collective_count.py``): a steady-state save and a load each
take at most 2 collectives of at most 1 KiB per rank (DESIGN.md, "Distribution and scale").
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from collective_count import CollectiveCounter
from dist_utils import run_distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import tessera
from tessera.errors import PlanMismatchError

KIB = 1024


def _state(world: int, tensors: int = 12, seed: int = 0) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    model = {f"layer{i}.weight": torch.randn(8 * world, 6, generator=g) for i in range(tensors)}
    return {
        "model": {k: distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None) for k, v in model.items()},
        "step": 7,
    }


def _counted(rank: int, world: int, root: str) -> dict:
    state = _state(world)
    counter = CollectiveCounter()
    with counter:
        with counter.phase("first save") as first:
            tessera.save(f"{root}/a", state)
        with counter.phase("steady save") as steady:
            tessera.save(f"{root}/b", state)
        with counter.phase("async steady save") as pending:
            tessera.async_save(f"{root}/c", state).wait()
        # A resharded load: Shard(1) instead of Shard(0), and the int comes back.
        mesh = init_device_mesh("cpu", (world,))
        target = {
            "model": {
                k: distribute_tensor(torch.zeros(v.shape), mesh, [Shard(1)], src_data_rank=None)
                for k, v in state["model"].items()
            },
            "step": 0,
        }
        with counter.phase("resharded load") as load:
            tessera.load(f"{root}/b", target)
    for k, v in state["model"].items():
        assert torch.equal(target["model"][k].full_tensor(), v.full_tensor()), k
    assert target["step"] == 7
    return {"first": first, "steady": steady, "async": pending, "load": load}


def test_a_steady_save_and_a_load_each_take_two_small_collectives(tmp_path: Path) -> None:
    ranks = run_distributed(_counted, 4, str(tmp_path))
    for phase in ("steady", "async", "load"):
        for r, counts in enumerate(ranks):
            c = counts[phase]
            assert c.api_calls <= 2 and c.wire_ops <= 2, (phase, r, c.calls)
            assert c.max_call_bytes <= KIB, (phase, r, c.largest_call, c.max_call_bytes)
    # The first save exchanges plans (it may take more), but nothing like one call per tensor.
    assert max(c["first"].api_calls for c in ranks) <= 6


def _structure_changes_on_one_rank(rank: int, world: int, root: str) -> list[str]:
    state = _state(world, tensors=3)
    tessera.save(f"{root}/a", state)
    if rank == 1:  # only this rank's structure changes (a per-rank buffer grew, say)
        state["model"] = dict(state["model"])
        state["extra"] = torch.ones(3)
    outcomes = []
    for path, call in (("b", tessera.save), ("c", lambda p, s: tessera.async_save(p, s).wait())):
        try:
            call(f"{root}/{path}", state)
            outcomes.append("saved")
        except PlanMismatchError as e:
            assert "structure changed" in str(e), str(e)
            outcomes.append("mismatch")
        if rank == 1:
            state.pop("extra", None)  # back to the common structure: every rank planned again
    tessera.save(f"{root}/d", state)
    return outcomes


def test_a_structure_change_on_some_ranks_starts_a_save_over_or_fails_an_async_one_everywhere(
    tmp_path: Path,
) -> None:
    """A rank whose structure changed must plan; the others planned alone and wrote. Their one
    vote shows it: a synchronous save starts over (and commits); an async save cannot (its
    copies follow the stale plan) and fails on every rank; the next save plans again."""
    outcomes = run_distributed(_structure_changes_on_one_rank, 2, str(tmp_path))
    assert outcomes == [["saved", "mismatch"], ["saved", "mismatch"]], outcomes
    assert not (tmp_path / "c" / "manifest.json").exists()
    assert [p for p in _data_files(tmp_path / "c") if p.startswith("data/")] == []  # what was written went
    for name in ("a", "b", "d"):
        assert (tmp_path / name / "manifest.json").exists(), name
    target = {"extra": torch.zeros(3)}
    tessera.load(str(tmp_path / "b"), target, strict=False)  # rank 1's extra tensor was saved
    assert torch.equal(target["extra"], torch.ones(3))


def _data_files(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()) if path.exists() else []


def _report_cannot_be_written(rank: int, world: int, root: str) -> tuple[str, str]:
    state = _state(world, tensors=2)
    tessera.save(f"{root}/warm", state)  # a steady-state save next: no vote before writing
    if rank == 1:
        original = tessera.storage.FileStorage.write_atomic

        def refuse(self, path, data):  # this rank's storage fails just for its report
            if "/reports/" in path:
                raise OSError(28, "No space left on device")
            return original(self, path, data)

        tessera.storage.FileStorage.write_atomic = refuse
    try:
        tessera.save(f"{root}/ckpt", state)
    except tessera.CheckpointError as e:
        return type(e).__name__, str(e)
    raise AssertionError(f"rank {rank}: the save did not fail")


def test_a_rank_that_cannot_write_its_report_fails_the_save_on_every_rank_at_once(tmp_path: Path) -> None:
    results = run_distributed(_report_cannot_be_written, 2, str(tmp_path), timeout=60)
    for rank, (kind, message) in enumerate(results):
        assert kind in ("StorageError", "DistributedError"), (rank, kind, message)
        assert "rank 1" in message and "No space left" in message, message
    assert not (tmp_path / "ckpt" / "manifest.json").exists()
    assert [p for p in _data_files(tmp_path / "ckpt") if p.startswith("data/")] == []


def _locations_differ(rank: int, world: int, root: str) -> str:
    state = _state(world, tensors=2)
    tessera.save(f"{root}/shared", state)
    try:
        tessera.save(f"{root}/node{rank}", state)  # a node-local directory per rank
    except tessera.errors.LocationMismatchError as e:
        return str(e)
    raise AssertionError("the save did not fail")


def test_ranks_saving_to_different_locations_fail_and_leave_no_data_files(tmp_path: Path) -> None:
    messages = run_distributed(_locations_differ, 2, str(tmp_path))
    assert all("node0" in m and "node1" in m for m in messages), messages
    for rank in range(2):
        node = tmp_path / f"node{rank}"
        assert not (node / "manifest.json").exists()
        leftovers = [p for p in _data_files(node) if p.startswith("data/") and not p.endswith("/")]
        assert leftovers == [], leftovers
    assert os.path.exists(tmp_path / "shared" / "manifest.json")


def _derived_2d(rank: int, world: int, root: str) -> dict:
    """A 2 x 2 mesh, Shard(0) x Replicate: each box is held by 2 ranks; plus plain tensors (DDP-like)."""
    mesh = init_device_mesh("cpu", (2, 2))
    g = torch.Generator().manual_seed(1)
    full = {f"w{i}": torch.randn(1024, 512, generator=g) for i in range(4)}  # 1 MiB boxes: cut in slabs
    full["bias"] = torch.randn(64, generator=g)  # small: one holder writes it
    state = {
        "model": {k: distribute_tensor(v, mesh, [Shard(0), Replicate()], src_data_rank=None) for k, v in full.items()},
        "plain": {"scale": torch.arange(float(1 << 20)), "step": torch.tensor(3)},
    }
    counter = CollectiveCounter()
    with counter, counter.phase("first save") as first:
        result = tessera.save(f"{root}/ckpt", state)
    target = {
        "model": {k: torch.zeros_like(v) for k, v in full.items()},
        "plain": {"scale": torch.zeros(1 << 20), "step": torch.tensor(0)},
    }
    tessera.load(f"{root}/ckpt", target)  # plain tensors: a single-layout view of every tensor
    for k, v in full.items():
        assert torch.equal(target["model"][k], v), k
    assert torch.equal(target["plain"]["scale"], torch.arange(float(1 << 20))) and int(target["plain"]["step"]) == 3
    return {"calls": first.calls, "bytes": result.bytes_written}


def test_a_first_save_of_dtensors_derives_each_ranks_plan_without_an_exchange(tmp_path: Path) -> None:
    """Replicated boxes are split among their holders by a rule every rank applies alone: no
    plan is gathered, every byte is written once (the manifest's coverage is checked before the
    commit and the load is exact), and the bytes are balanced across the ranks."""
    ranks = run_distributed(_derived_2d, 4, str(tmp_path))
    for r in ranks:
        assert set(r["calls"]) <= {"all_reduce", "broadcast"}, r["calls"]  # no gather, no scatter
    written = [r["bytes"] for r in ranks]
    logical = 4 * 1024 * 512 * 4 + 64 * 4 + (1 << 20) * 4 + 8
    assert 0 <= sum(written) - logical < 4 * 4096, written  # each byte once (plus file headers)
    assert max(written) <= 1.1 * min(written), written
