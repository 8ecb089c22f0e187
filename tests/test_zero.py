"""ZeRO-style flat partitions: layout maths against DeepSpeed's, and resume across world sizes.

The multi-process tests run a faithful model of DeepSpeed ZeRO-1/2 (``stage_1_and_2.py``):
one flat bit16 buffer per group padded to a multiple of ``2 * dp`` and split equally, an
fp32 master partition per rank, torch Adam over that partition, and an all-gather of the
updated bit16 partitions. They save under 2 ranks, resume under 3 ranks and in one plain
process (per-parameter tensors and a plain Adam), and check the state bit for bit, then
take one more step on each side and check that the runs still agree bit for bit.

When DeepSpeed itself is installed, the same is done with its real ``DeepSpeedZeroOptimizer``
on CPU, and the loaded state is read back through DeepSpeed's own per-parameter accessors.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist

import tessera
from tessera.adapters.zero import FlatEntry, FlatLayout, FlatPartition, zero_partition_state
from tests.dist_utils import run_distributed

PARAMS = [
    ("embed.weight", (5, 3)),
    ("blocks.0.w", (3, 4)),
    ("blocks.0.b", (4,)),
    ("blocks.1.w", (4, 3)),
    ("head.w", (3, 2)),
]
LR = 1e-2


# ----------------------------------------------------------------------------------------
# A model of DeepSpeed's partitioning code, written from stage_1_and_2.py.


def ds_flatten_aligned(tensors: list[torch.Tensor], alignment: int) -> torch.Tensor:
    """``flatten_dense_tensors_aligned``: concatenate, zero-pad at the end to ``alignment``."""
    n = sum(t.numel() for t in tensors)
    pad = (alignment - n % alignment) % alignment
    parts = [t.reshape(-1) for t in tensors]
    if pad:
        parts.append(torch.zeros(pad, dtype=tensors[0].dtype))
    return torch.cat(parts)


def ds_partitions(flat: torch.Tensor, dp: int) -> list[torch.Tensor]:
    """``get_data_parallel_partitions``: near-equal views, remainder to the first ranks."""
    base, remaining = divmod(flat.numel(), dp)
    out, start = [], 0
    for i in range(dp):
        size = base + (1 if i < remaining else 0)
        out.append(flat.narrow(0, start, size))
        start += size
    return out


def ds_partition_info(sizes: list[int], partition_size: int, partition_id: int) -> tuple[list[int], int]:
    """``get_partition_info``: indices of the params in the partition and ``first_offset``."""
    start_index, end_index = partition_size * partition_id, partition_size * (partition_id + 1)
    current, first_offset, inside = 0, 0, []
    for i, size in enumerate(sizes):
        if start_index <= current < end_index:
            inside.append(i)
        elif current < start_index < current + size:
            inside.append(i)
            first_offset = start_index - current
        current += size
    return inside, first_offset


def ds_group_padding(orig_numel: int, partitions: list[torch.Tensor], partition_id: int) -> int:
    """The ``groups_padding`` entry DeepSpeed records for this rank."""
    left = sum(t.numel() for t in partitions[:partition_id])
    size = partitions[partition_id].numel()
    if orig_numel <= left:
        return size
    if orig_numel < left + size:
        return left + size - orig_numel
    return 0


SHAPE_SETS = {
    "mixed": PARAMS,
    "one_big": [("w", (7, 5))],
    "tiny_params": [("a", (1,)), ("b", (2,)), ("c", (1, 1)), ("d", (3,))],
    "empty_param": [("a", (2, 3)), ("e", (0, 4)), ("b", (5,))],
}


@pytest.mark.parametrize("shapes", list(SHAPE_SETS))
@pytest.mark.parametrize("dp", [1, 2, 3, 4, 7, 16])
def test_layout_matches_deepspeed(shapes: str, dp: int) -> None:
    params = SHAPE_SETS[shapes]
    tensors = [torch.arange(math.prod(s), dtype=torch.float32).reshape(s) + 1000 * i for i, (_, s) in enumerate(params)]
    flat = ds_flatten_aligned(tensors, 2 * dp)
    layout = FlatLayout.deepspeed(params, dp)
    assert layout.numel == flat.numel()
    views = layout.views(flat)
    for (name, _), t in zip(params, tensors):
        assert torch.equal(views[name], t)
        assert views[name].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()  # a view
    partitions = ds_partitions(flat, dp)
    sizes = [t.numel() for t in tensors]
    for rank in range(dp):
        part = layout.partition(rank, dp)
        assert (part.start, part.numel) == (rank * partitions[0].numel(), partitions[rank].numel())
        inside, first_offset = ds_partition_info(sizes, partitions[0].numel(), rank)
        pieces = part.pieces()
        # DeepSpeed lists zero-size params that sit on the boundary; they hold no element.
        assert [p.entry.fqn for p in pieces] == [params[i][0] for i in inside if sizes[i]]
        if pieces and pieces[0].entry.offset < part.start:
            assert pieces[0].param_start == first_offset
        assert part.padding == ds_group_padding(sum(sizes), partitions, rank)
        local = partitions[rank].clone()  # like the fp32 master partition
        shards = part.shards(local)
        assert list(shards) == [name for name, _ in params]
        for name, t in zip([n for n, _ in params], tensors):
            s = shards[name]
            assert torch.equal(s.local_1d, t.reshape(-1)[s.flat_start : s.flat_stop])
            if s.local_1d.numel():
                assert s.local_1d.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()


def test_pack_alignment_and_explicit_layouts() -> None:
    layout = FlatLayout.pack([("w", (3, 3)), ("b", (3,)), ("c", (2,))], param_alignment=4, total_alignment=8)
    assert [(e.fqn, e.offset) for e in layout.entries] == [("w", 0), ("b", 12), ("c", 16)]
    assert layout.numel == 24
    part = layout.slice(10, 17)  # padding 10..12, b whole, c's first element
    assert [(p.entry.fqn, p.param_start, p.param_stop, p.local_start) for p in part.pieces()] == [
        ("b", 0, 3, 2),
        ("c", 0, 1, 6),
    ]
    assert part.padding == 3
    local = torch.arange(7.0)
    shards = part.shards(local, declare_all=False)
    assert list(shards) == ["b", "c"]
    assert torch.equal(shards["b"].local_1d, torch.tensor([2.0, 3.0, 4.0]))
    state = part.optimizer_state({"exp_avg": local}, {"step": 3}, declare_all=False)
    assert list(state) == ["b", "c"] and state["c"]["step"] == 3
    shards = zero_partition_state(torch.arange(5.0), [("w", (3, 3)), ("b", (3,))], 8)
    assert (shards["w"].flat_start, shards["w"].local_1d.tolist()) == (8, [0.0])
    assert shards["b"].local_1d.tolist() == [1.0, 2.0, 3.0]


def test_misuse_is_an_error() -> None:
    layout = FlatLayout.deepspeed(PARAMS, 2)
    part = layout.partition(0, 2)
    with pytest.raises(ValueError, match="partition \\[0, 26\\).*26 elements, got 27"):
        part.shards(torch.zeros(27))
    with pytest.raises(ValueError, match="1-D"):
        part.shards(torch.zeros(2, 13))
    with pytest.raises(ValueError, match="whole flat buffer"):
        layout.views(torch.zeros(3))
    with pytest.raises(ValueError, match="'b' at offset 3 overlaps"):
        FlatLayout((FlatEntry("a", (4,), 0), FlatEntry("b", (2,), 3)), 8)
    with pytest.raises(ValueError, match="'a' appears twice"):
        FlatLayout.pack([("a", (2,)), ("a", (2,))])
    with pytest.raises(ValueError, match="past the buffer"):
        FlatLayout((FlatEntry("a", (4,), 0),), 3)
    with pytest.raises(ValueError, match="outside a flat buffer"):
        FlatPartition(layout, 5, 100)
    with pytest.raises(ValueError, match="both per element and per parameter"):
        part.optimizer_state({"step": torch.zeros(26)}, {"step": 1})


# ----------------------------------------------------------------------------------------
# The resume test: a DeepSpeed-like ZeRO-1/2 optimizer on real gloo processes.


def init_param(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    seed = sum(map(ord, name))
    n = math.prod(shape)
    return (torch.sin(torch.arange(n, dtype=torch.float32) * 0.37 + seed) * 0.5).reshape(shape)


def grad_for(name: str, shape: tuple[int, ...], step: int) -> torch.Tensor:
    seed = sum(map(ord, name)) * 7 + step * 13
    n = math.prod(shape)
    return (torch.cos(torch.arange(n, dtype=torch.float32) * 0.11 + seed) * (1 + step)).reshape(shape)


class ZeroModel:
    """One param group under ZeRO-1/2, as ``DeepSpeedZeroOptimizer`` keeps it (bf16 + fp32 master)."""

    def __init__(self, rank: int, dp: int, *, param_alignment: int = 1, fresh: bool = False) -> None:
        self.rank, self.dp = rank, dp
        self.layout = FlatLayout.pack(PARAMS, param_alignment=param_alignment, total_alignment=2 * dp)
        inits = [torch.zeros(s) if fresh else init_param(n, s) for n, s in PARAMS]
        if param_alignment == 1:
            self.flat = ds_flatten_aligned([t.bfloat16() for t in inits], 2 * dp)
        else:
            self.flat = torch.zeros(self.layout.numel, dtype=torch.bfloat16)
            for e, t in zip(self.layout.entries, inits):
                self.flat[e.offset : e.stop] = t.reshape(-1)
        self.part = self.layout.partition(rank, dp)
        self.bit16_partition = ds_partitions(self.flat, dp)[rank]
        self.master = self.bit16_partition.detach().clone().float().requires_grad_()
        self.optimizer = torch.optim.Adam([self.master], lr=LR)
        if fresh:  # DeepSpeed's initialize_optimizer_states: a zero-grad step creates the state
            self.master.grad = torch.zeros_like(self.master)
            self.optimizer.step()

    def step(self, step: int) -> None:
        grad = torch.zeros(self.layout.numel)
        for e in self.layout.entries:
            grad[e.offset : e.stop] = grad_for(e.fqn, e.shape, step).reshape(-1)
        self.master.grad = grad[self.part.start : self.part.stop].clone()
        self.optimizer.step()
        with torch.no_grad():
            self.bit16_partition.copy_(self.master)
        gathered = list(ds_partitions(self.flat, self.dp))
        dist.all_gather(gathered, self.bit16_partition.clone())

    def state(self) -> dict:
        st = self.optimizer.state[self.master]
        return {
            "model": self.layout.views(self.flat),
            "optim": {
                "master": self.part.shards(self.master.detach()),
                "state": self.part.optimizer_state(
                    {"exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"]}, {"step": st["step"]}
                ),
                "param_groups": [{"lr": LR, "betas": [0.9, 0.999]}],
            },
        }

    def snapshot(self) -> dict[str, torch.Tensor]:
        st = self.optimizer.state[self.master]
        return {
            "flat": self.flat.clone(),
            "master": self.master.detach().clone(),
            "exp_avg": st["exp_avg"].clone(),
            "exp_avg_sq": st["exp_avg_sq"].clone(),
            "step": st["step"].clone(),
        }


ALIGNMENTS = (1, 4)  # DeepSpeed's packing, and Megatron-style padding before each parameter


def _save_zero(rank: int, world: int, root: str) -> dict[int, dict]:
    out = {}
    for align in ALIGNMENTS:
        m = ZeroModel(rank, world, param_alignment=align)
        m.step(1)
        m.step(2)
        tessera.save(os.path.join(root, f"align{align}"), m.state())
        saved = m.snapshot()
        m.step(3)
        out[align] = {"saved": saved, "after": m.snapshot()}
    return out


def _resume_zero(rank: int, world: int, root: str) -> dict[int, dict]:
    out = {}
    for align in ALIGNMENTS:
        m = ZeroModel(rank, world, param_alignment=align, fresh=True)
        flat_ptr, master_ptr = m.flat.data_ptr(), m.master.data_ptr()
        st = m.optimizer.state[m.master]
        result = tessera.load(os.path.join(root, f"align{align}"), m.state())
        assert result.missing_keys == [] and result.unexpected_keys == []
        assert m.flat.data_ptr() == flat_ptr and m.master.data_ptr() == master_ptr  # filled in place
        assert m.optimizer.state[m.master]["exp_avg"] is st["exp_avg"]
        loaded = m.snapshot()
        m.step(3)
        out[align] = {"loaded": loaded, "after": m.snapshot()}
    return out


def _global_flat(results: list[dict], phase: str, key: str) -> torch.Tensor:
    return torch.cat([r[phase][key] for r in results])


def _params_of(layout: FlatLayout, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in layout.views(flat).items()}


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict], list[dict]]:
    """Save on 2 ranks (both alignments), resume on 3 ranks: one spawn each."""
    root = str(tmp_path_factory.mktemp("zero"))
    saved = run_distributed(_save_zero, 2, root)
    resumed = run_distributed(_resume_zero, 3, root)
    return root, saved, resumed


@pytest.mark.parametrize("param_alignment", ALIGNMENTS)
def test_zero2_to_zero3_and_to_plain_process(zero_runs, param_alignment: int) -> None:
    root, saved, resumed = zero_runs
    path = os.path.join(root, f"align{param_alignment}")
    saved = [r[param_alignment] for r in saved]
    resumed = [r[param_alignment] for r in resumed]
    src_layout = FlatLayout.pack(PARAMS, param_alignment=param_alignment, total_alignment=4)
    truth = {
        key: _params_of(src_layout, _global_flat(saved, "saved", key)) for key in ("master", "exp_avg", "exp_avg_sq")
    }
    truth["model"] = _params_of(src_layout, saved[0]["saved"]["flat"])
    final = {
        key: _params_of(src_layout, _global_flat(saved, "after", key)) for key in ("master", "exp_avg", "exp_avg_sq")
    }
    final["model"] = _params_of(src_layout, saved[0]["after"]["flat"])
    assert all(torch.equal(r["saved"]["step"], torch.tensor(2.0)) for r in saved)

    # ZeRO x2 -> ZeRO x3: every partition holds exactly the saved elements (padding zero).
    dst_layout = FlatLayout.pack(PARAMS, param_alignment=param_alignment, total_alignment=6)
    for key in ("master", "exp_avg", "exp_avg_sq"):
        want = torch.zeros(dst_layout.numel)
        for e in dst_layout.entries:
            want[e.offset : e.stop] = truth[key][e.fqn].reshape(-1)
        assert torch.equal(_global_flat(resumed, "loaded", key), want), key
        assert _params_of(dst_layout, _global_flat(resumed, "after", key)).keys() == final[key].keys()
        for name, t in _params_of(dst_layout, _global_flat(resumed, "after", key)).items():
            assert torch.equal(t, final[key][name]), f"{key} of {name} diverged after resuming on 3 ranks"
    for r in resumed:
        assert torch.equal(r["loaded"]["step"], torch.tensor(2.0))
        loaded_params = _params_of(dst_layout, r["loaded"]["flat"])
        assert all(torch.equal(loaded_params[n], truth["model"][n]) for n, _ in PARAMS)
        after_params = _params_of(dst_layout, r["after"]["flat"])
        assert all(torch.equal(after_params[n], final["model"][n]) for n, _ in PARAMS)

    # ZeRO x2 -> one plain process: per-parameter tensors by FQN, then a plain Adam step.
    masters = {n: torch.zeros(s, requires_grad=True) for n, s in PARAMS}
    plain = {
        "model": {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in PARAMS},
        "optim": {
            "master": {n: p.detach() for n, p in masters.items()},
            "state": {
                n: {"exp_avg": torch.zeros(s), "exp_avg_sq": torch.zeros(s), "step": torch.tensor(0.0)}
                for n, s in PARAMS
            },
            "param_groups": [],
        },
    }
    result = tessera.load(path, plain)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert plain["optim"]["param_groups"] == [{"lr": LR, "betas": [0.9, 0.999]}]
    for n, _ in PARAMS:
        assert torch.equal(plain["model"][n], truth["model"][n])
        assert torch.equal(masters[n].detach(), truth["master"][n])
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(plain["optim"]["state"][n][key], truth[key][n])
        assert torch.equal(plain["optim"]["state"][n]["step"], torch.tensor(2.0))
    adam = torch.optim.Adam(list(masters.values()), lr=LR)
    adam.load_state_dict(
        {
            "state": {i: plain["optim"]["state"][n] for i, n in enumerate(masters)},
            "param_groups": [{**adam.param_groups[0], "params": list(range(len(masters)))}],
        }
    )
    for n, s in PARAMS:
        masters[n].grad = grad_for(n, s, 3)
    adam.step()
    for n, p in masters.items():
        assert torch.equal(p.detach(), final["master"][n]), f"plain Adam diverged from ZeRO on {n}"
        assert torch.equal(adam.state[p]["exp_avg_sq"], final["exp_avg_sq"][n])


# ----------------------------------------------------------------------------------------
# Real DeepSpeed ZeRO-2 on CPU, when it is installed.


def _ds_engine(seed: int, rank: int):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    os.environ.setdefault("LOCAL_RANK", str(rank))
    # Only DeepSpeed's inference all-reduce uses this CPU kernel; JIT-compiling it costs minutes.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3), torch.nn.Linear(3, 3, bias=False)
    )
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 2},
        "bf16": {"enabled": True},
        "zero_allow_untested_optimizer": True,
    }
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=LR), config=cfg
    )
    return engine, optimizer


def _ds_state(engine, optimizer, dp: int, rank: int) -> tuple[dict, FlatLayout]:
    names = {id(p): n for n, p in engine.module.named_parameters()}
    (group,) = optimizer.round_robin_bit16_groups
    layout = FlatLayout.deepspeed([(names[id(p)], p) for p in group], dp)
    part = layout.partition(rank, dp)
    flat = optimizer.bit16_groups_flat[0]
    master = optimizer.single_partition_of_fp32_groups[0]
    assert layout.numel == flat.numel() and part.numel == master.numel()
    assert part.padding == optimizer.groups_padding[0]
    # DeepSpeed's own map of which slice of the partition each parameter owns.
    ds_map = {n: (int(a.start), int(a.numel)) for n, a in optimizer._param_slice_mappings[0].items()}
    assert ds_map == {p.entry.fqn: (p.local_start, p.numel) for p in part.pieces()}
    st = optimizer.optimizer.state[master]
    state = {
        "model": layout.views(flat),
        "optim": {
            "master": part.shards(master.detach()),
            "state": part.optimizer_state(
                {"exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"]}, {"step": st["step"]}
            ),
        },
    }
    return state, layout


def _ds_full(engine) -> dict[str, dict[str, torch.Tensor]]:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for n, p in engine.module.named_parameters():
        out[n] = {
            "model": p.detach().clone(),
            "master": safe_get_full_fp32_param(p).clone(),
            "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").clone(),
            "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").clone(),
        }
    return out


def _ds_save(rank: int, world: int, path: str) -> dict:
    engine, optimizer = _ds_engine(0, rank)
    torch.manual_seed(100)  # the same batches on every rank
    for _ in range(2):
        loss = engine(torch.randn(2, 5, dtype=torch.bfloat16)).float().pow(2).sum()
        engine.backward(loss)
        engine.step()
    state, _ = _ds_state(engine, optimizer, world, rank)
    tessera.save(path, state)
    return _ds_full(engine)


def _ds_load(rank: int, world: int, path: str) -> dict:
    engine, optimizer = _ds_engine(1, rank)  # different initial weights
    # torch optimizers create their state at the first step: make it exist (zero-grad step,
    # what DeepSpeed's initialize_optimizer_states used to do) so that load can fill it.
    master = optimizer.single_partition_of_fp32_groups[0]
    master.grad = torch.zeros_like(master)
    optimizer.optimizer.step()
    master.grad = None
    optimizer._lazy_init_hp_params_optimizer_state()  # link DeepSpeed's per-parameter state views
    state, _ = _ds_state(engine, optimizer, world, rank)
    result = tessera.load(path, state)
    assert result.missing_keys == [] and result.unexpected_keys == []
    return _ds_full(engine)


@pytest.mark.slow  # DeepSpeed's start-up costs ~10 s per spawn
@pytest.mark.interop("deepspeed")
def test_real_deepspeed_zero2_two_to_three_ranks_and_plain(tmp_path) -> None:
    path = str(tmp_path / "ds")
    saved = run_distributed(_ds_save, 2, path)[0]
    loaded = run_distributed(_ds_load, 3, path)
    for rank_view in loaded:
        assert rank_view.keys() == saved.keys()
        for name, kinds in saved.items():
            for kind, want in kinds.items():
                assert torch.equal(rank_view[name][kind], want), f"DeepSpeed x3 rank view of {kind} of {name} differs"
    plain = {
        "model": {n: torch.zeros_like(k["model"]) for n, k in saved.items()},
        "optim": {
            "master": {n: torch.zeros_like(k["master"]) for n, k in saved.items()},
            "state": {
                n: {
                    "exp_avg": torch.zeros_like(k["exp_avg"]),
                    "exp_avg_sq": torch.zeros_like(k["exp_avg_sq"]),
                    "step": torch.tensor(0.0),
                }
                for n, k in saved.items()
            },
        },
    }
    tessera.load(path, plain)
    for n, k in saved.items():
        assert torch.equal(plain["model"][n], k["model"])
        assert torch.equal(plain["optim"]["master"][n], k["master"])
        assert torch.equal(plain["optim"]["state"][n]["exp_avg"], k["exp_avg"])
        assert torch.equal(plain["optim"]["state"][n]["exp_avg_sq"], k["exp_avg_sq"])
        assert plain["optim"]["state"][n]["step"].item() == 2.0
