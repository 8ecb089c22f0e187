"""Multi-rank save behaviour: balanced replica writes, plan caching, async saves, errors on all ranks."""

from __future__ import annotations

import os

import pytest
import torch

import tessera
from tests.dist_utils import run_distributed


def _replicated(rank: int, world: int, path: str) -> tuple[int, int]:
    # Pure replication (DDP-like): identical tensors on every rank.
    g = torch.Generator().manual_seed(0)
    state = {"model": {f"w{i}": torch.randn(512, 1024, generator=g) for i in range(3)}, "step": 3}
    res = tessera.save(path, state)
    target = {"model": {f"w{i}": torch.zeros(512, 1024) for i in range(3)}, "step": 0}
    tessera.load(path, target)
    assert all(torch.equal(target["model"][k], state["model"][k]) for k in state["model"]) and target["step"] == 3
    return res.bytes_written, res.total_bytes


def test_replicated_tensors_are_written_once_and_balanced(tmp_path) -> None:
    world = 4
    out = run_distributed(_replicated, world, str(tmp_path))
    written = [b for b, _ in out]
    total = out[0][1]
    payload = 3 * 512 * 1024 * 4
    assert payload <= total < payload * 1.01  # each byte once (plus small headers)
    assert max(written) < 1.2 * total / world, written  # each rank writes about 1/N


def _cached_async(rank: int, world: int, root: str) -> list[bool]:
    w = torch.full((6, 4), float(rank))  # rank r owns rows 3r..3r+2 of a (6*world/2...) tensor
    cached = []
    for step in range(3):
        w.fill_(step * 10 + rank)
        state = {"w": tessera.ShardedTensor(w, (6 * world, 4), (6 * rank, 0)), "step": step}
        pending = tessera.async_save(os.path.join(root, f"s{step}"), state)
        pending.wait_staged()
        w.fill_(-1)  # mutate right after the gate: must not reach the checkpoint
        cached.append(pending.wait().plan_cached)
    for step in range(3):
        full = {"w": torch.zeros(6 * world, 4), "step": None}
        tessera.load(os.path.join(root, f"s{step}"), full)
        want = torch.cat([torch.full((6, 4), float(step * 10 + r)) for r in range(world)])
        assert torch.equal(full["w"], want) and full["step"] == step
    return cached


def test_async_saves_reuse_the_plan_and_snapshot_state(tmp_path) -> None:
    out = run_distributed(_cached_async, 2, str(tmp_path))
    assert out == [[False, True, True]] * 2


def _one_rank_fails(rank: int, world: int, path: str) -> str:
    class Opaque:
        pass

    state = {"w": torch.ones(4), "extra": Opaque() if rank == 1 else 1}
    try:
        tessera.save(path, state)
    except tessera.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_an_error_on_one_rank_is_raised_on_every_rank(tmp_path) -> None:
    out = run_distributed(_one_rank_fails, 3, str(tmp_path / "c"))
    for r, msg in enumerate(out):
        assert "Opaque" in msg, (r, msg)
        if r != 1:
            assert "rank 1" in msg, (r, msg)
    assert not (tmp_path / "c" / "manifest.json").exists()


def _disagree(rank: int, world: int, path: str) -> str:
    try:
        tessera.save(path, {"w": torch.ones(4 + rank)})
    except tessera.CheckpointError as e:
        return str(e)
    return "no error"


def test_ranks_disagreeing_on_a_shape_is_an_error_naming_the_tensor(tmp_path) -> None:
    out = run_distributed(_disagree, 2, str(tmp_path / "c"))
    assert all("'w'" in m and "shape" in m for m in out), out


@pytest.mark.parametrize("world", [2])
def test_gaps_in_coverage_are_reported(tmp_path, world: int) -> None:
    out = run_distributed(_gap, world, str(tmp_path / "c"))
    assert all("'w'" in m and "no rank" in m for m in out), out


def _gap(rank: int, world: int, path: str) -> str:
    try:  # rank 1 claims rows 3..4 of 6: rows 2 and 5 are saved by nobody
        tessera.save(path, {"w": tessera.ShardedTensor(torch.ones(2, 2), (6, 2), (0 if rank == 0 else 3, 0))})
    except tessera.CheckpointError as e:
        return str(e)
    return "no error"


def _broadcast_load(rank: int, world: int, path: str) -> tuple[int, int]:
    g = torch.Generator().manual_seed(1)
    state = {
        "w": torch.randn(1024, 1024, generator=g),
        "b": torch.randn(7, generator=g),
        "own": torch.full((4,), float(rank)),
    }
    state["own"] = tessera.ShardedTensor(state["own"], (4 * world,), (4 * rank,))
    tessera.save(path, state)
    plain = {"w": torch.zeros(1024, 1024), "b": torch.zeros(7)}
    full = tessera.load(path, plain).bytes_read
    target = {
        "w": torch.zeros(1024, 1024),
        "b": torch.zeros(7),
        "own": tessera.ShardedTensor(torch.zeros(4), (4 * world,), (4 * rank,)),
    }
    res = tessera.load(path, target, options=tessera.LoadOptions(broadcast_replicated=True))
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
    assert torch.equal(target["own"].local, torch.full((4,), float(rank)))
    return full, res.bytes_read


def test_broadcast_replicated_reads_each_byte_once(tmp_path) -> None:
    out = run_distributed(_broadcast_load, 3, str(tmp_path / "c"))
    full = out[0][0]
    shared = [b for _, b in out]
    assert sum(shared) < 1.2 * full, out  # together the ranks read about one copy


def _subgroups(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist

    # Two "pipeline stages" of 2 ranks each save their own checkpoints independently.
    groups = [dist.new_group([0, 1], backend="gloo"), dist.new_group([2, 3], backend="gloo")]
    stage = rank // 2
    group = groups[stage]
    local = torch.full((3,), float(rank))
    path = os.path.join(root, f"stage{stage}")
    tessera.save(path, {"w": tessera.ShardedTensor(local, (6,), (3 * (rank % 2),))}, process_group=group)
    target = {"w": torch.zeros(6)}
    tessera.load(path, target, process_group=group)
    assert torch.equal(target["w"], torch.tensor([2.0 * stage] * 3 + [2.0 * stage + 1] * 3))


def test_gloo_subgroups_save_independently(tmp_path) -> None:
    run_distributed(_subgroups, 4, str(tmp_path))


def _pipeline_stages(rank: int, world: int, path: str) -> tuple[list[str], list[str]]:
    # Each "stage" holds its own layers only; together they want every key.
    full = {"model": {f"layers.{i}.w": torch.full((2,), float(i)) for i in range(4)}}
    tessera.save(path, full if rank == 0 else {"model": {}})
    mine = {"model": {f"layers.{i}.w": torch.zeros(2) for i in range(4) if i // 2 == rank}}
    res = tessera.load(path, mine)  # strict: nothing is unexpected for the job as a whole
    assert all(
        torch.equal(t, torch.full((2,), float(k.split(".")[1]))) for k, t in ((k, v) for k, v in mine["model"].items())
    )
    only_first = {"model": {"layers.0.w": torch.zeros(2)}}
    with pytest.raises(tessera.MissingKeysError, match="wanted by no rank.*layers.1.w"):
        tessera.load(path, only_first)
    lax = tessera.load(path, only_first, strict=False)
    return res.unexpected_keys, lax.unexpected_keys


def test_unexpected_keys_are_judged_across_all_ranks(tmp_path) -> None:
    out = run_distributed(_pipeline_stages, 2, str(tmp_path / "c"))
    assert out[0][0] == [] and out[0][1] == ["model.layers.1.w", "model.layers.2.w", "model.layers.3.w"]
