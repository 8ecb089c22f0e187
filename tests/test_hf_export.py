"""tessera.save_hf: a Hugging Face directory written by the ranks of a sharded job.

The judge is ``transformers`` itself: ``AutoModelForCausalLM.from_pretrained`` must load the
directory and give bit-identical weights and the original logits. The models are tiny,
randomly initialised Llamas built locally (no hub download).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import tessera
from tessera.errors import CoverageError
from tests.dist_utils import run_distributed

transformers = pytest.importorskip("transformers")

VOCAB = 96
BLOCK = 1024  # bytes: far below every weight matrix, so blocks are assembled from several pieces


def _build(tied: bool = False) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _model_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _check_directory(out_dir: str, *, tied: bool = False, dtype: torch.dtype | None = None) -> None:
    """transformers loads the directory: same weights bit for bit, same logits."""
    ref = _build(tied)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out_dir).eval()
    want = {k: (v.to(dtype) if dtype is not None else v) for k, v in ref.state_dict().items()}
    got = loaded.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k], want[k]), k
    if dtype is None:
        ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            assert torch.equal(loaded(ids).logits, ref(ids).logits)


def _shards(out_dir: str) -> list[str]:
    return sorted(n for n in os.listdir(out_dir) if n.endswith(".safetensors"))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_single_process_sharded_directory(tmp_path, dtype):
    model = _build()
    out = str(tmp_path / "hf")
    res = tessera.save_hf(out, model, dtype=dtype, max_shard_size="40KB", block_bytes=BLOCK)
    files = _shards(out)
    assert len(files) >= 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict()) and set(index["weight_map"].values()) == set(files)
    assert res.files == (*files, "model.safetensors.index.json") and res.written == tuple(files)
    expected = sum(t.numel() * (2 if dtype else 4) for t in model.state_dict().values())
    assert res.bytes == res.rank_bytes == index["metadata"]["total_size"] == expected
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == ("bfloat16" if dtype else "float32")
    _check_directory(out, dtype=dtype)


def test_small_model_is_one_file_and_replaces_old_shards(tmp_path):
    out = tmp_path / "hf"
    tessera.save_hf(str(out), _build(), max_shard_size="40KB")
    (out / "tokenizer.json").write_text("{}")
    res = tessera.save_hf(str(out), _build())
    assert _shards(str(out)) == ["model.safetensors"] and res.files == ("model.safetensors",)
    assert not (out / "model.safetensors.index.json").exists() and (out / "tokenizer.json").exists()
    _check_directory(str(out))


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="no tensors under prefix 'nope.'"):
        tessera.save_hf(str(tmp_path / "a"), _build(), prefix="nope.")
    hole = {"w": tessera.ShardedTensor(torch.zeros(2, 4), (4, 4), (0, 0))}  # rows 2..3 held by nobody
    with pytest.raises(CoverageError, match="tensor 'w'.*cover 8 of the 16"):
        tessera.save_hf(str(tmp_path / "b"), hole)


def test_state_dict_with_prefix(tmp_path):
    model = _build()
    res = tessera.save_hf(
        str(tmp_path / "hf"), {"model": tessera.ModelState(model), "step": 3}, prefix="model.", config=model.config
    )
    assert res.tensors == len(model.state_dict())
    _check_directory(str(tmp_path / "hf"))


# --------------------------------------------------------------------------------------
# Sharded jobs: 2 gloo ranks, each layout


def _fsdp2(rank: int, world: int, out: str) -> tuple:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _build()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    res = tessera.save_hf(out, model, max_shard_size="40KB", block_bytes=BLOCK)
    return res, _model_bytes(_build())


def _tp(rank: int, world: int, out: str) -> tuple:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _build()
    mesh = init_device_mesh("cpu", (world,))
    plan = {"model.embed_tokens": RowwiseParallel(), "lm_head": ColwiseParallel()}
    for i in range(len(model.model.layers)):
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"model.layers.{i}.self_attn.{name}"] = ColwiseParallel()
        plan[f"model.layers.{i}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"model.layers.{i}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"model.layers.{i}.mlp.up_proj"] = ColwiseParallel()
        plan[f"model.layers.{i}.mlp.down_proj"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    res = tessera.save_hf(out, model, max_shard_size="40KB", block_bytes=BLOCK)
    return res, _model_bytes(_build())


def _ddp(rank: int, world: int, out: str) -> tuple:
    model = torch.nn.parallel.DistributedDataParallel(_build(tied=True))
    res = tessera.save_hf(out, model, max_shard_size="40KB", block_bytes=BLOCK)
    return res, _model_bytes(_build(tied=True))


@pytest.mark.parametrize("layout", ["fsdp2", "tp", "ddp"])
def test_sharded_job_writes_in_parallel(tmp_path, layout):
    out = str(tmp_path / "hf")
    fn = {"fsdp2": _fsdp2, "tp": _tp, "ddp": _ddp}[layout]
    results = run_distributed(fn, 2, out)
    r0, r1 = (r for r, _ in results)
    model_bytes = results[0][1]
    # Both ranks wrote shards, none twice, together all of them.
    assert r0.written and r1.written and not set(r0.written) & set(r1.written)
    assert set(r0.written) | set(r1.written) == set(_shards(out)) and r0.files == r1.files
    assert r0.rank_bytes + r1.rank_bytes == r0.bytes
    # Bounded memory: exchange and assembly buffers stay a few blocks, far below the model.
    for r in (r0, r1):
        assert 0 < r.peak_buffer_bytes <= 5 * BLOCK < model_bytes // 10
    if layout == "ddp":
        assert r0.peak_buffer_bytes <= BLOCK  # every rank holds everything: nothing is sent
    _check_directory(out, tied=layout == "ddp")


def _mismatch(rank: int, world: int, out: str) -> None:
    tessera.save_hf(out, {"w": torch.zeros(4 + rank)})


def test_ranks_disagreeing_on_a_shape_fail_together(tmp_path):
    with pytest.raises(AssertionError) as info:
        run_distributed(_mismatch, 2, str(tmp_path / "hf"))
    text = str(info.value)
    # The same error on both ranks: each rank computed the same plan from the same metadata.
    assert "rank 0:" in text and "rank 1:" in text
    assert text.count("StateMismatchError: tensor 'w': rank 1 holds a piece of shape [5]") == 2


def _one_rank_cannot_write(rank: int, world: int, out: str, bad: str) -> tuple[str, str]:
    rows = torch.arange(64, dtype=torch.float32).reshape(16, 4)
    state = {
        f"w{i}": tessera.ShardedTensor(rows[rank * 8 : rank * 8 + 8] + i, (16, 4), (rank * 8, 0)) for i in range(4)
    }
    try:
        tessera.save_hf(out if rank == 0 else bad, state, max_shard_size=300, block_bytes=64)
    except Exception as e:
        return type(e).__name__, str(e)
    return "no error", ""


def test_a_rank_failing_to_write_fails_every_rank_without_hanging(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    results = run_distributed(_one_rank_cannot_write, 2, str(tmp_path / "hf"), str(tmp_path / "file" / "hf"))
    # The failing rank gets its own error (FileStorage lets makedirs' OSError through today).
    assert results[1][0] in ("StorageError", "NotADirectoryError") and "file/hf" in results[1][1]
    # The healthy rank gets the failing rank's error type when it is tessera's (typed errors travel
    # to every rank), DistributedError for a builtin one; either way it names rank 1's cause.
    expected = "StorageError" if results[1][0] == "StorageError" else "DistributedError"
    assert results[0][0] == expected and "rank 1" in results[0][1] and results[1][0] in results[0][1]
    assert not (tmp_path / "hf" / "model.safetensors.index.json").exists()  # no index over missing shards


def _mixed(rank: int, world: int, out: str) -> tuple[tuple[str, ...], int]:
    a, b = _mixed_tensors()
    rows = [(0, 3), (3, 5), (5, 7)][rank]
    cols = [(0, 3), (3, 6), (6, 9)][rank]  # column shards: every part sent is strided in memory
    state = {
        "a": tessera.ShardedTensor(a[rows[0] : rows[1]], (7, 5), (rows[0], 0)),
        "b": tessera.ShardedTensor(b[:, cols[0] : cols[1]], (5, 9), (0, cols[0])),
        "c": torch.arange(11, dtype=torch.int64),
        "d": torch.tensor(3.5),
    }
    res = tessera.save_hf(out, state, max_shard_size=60, block_bytes=16)
    return res.written, res.peak_buffer_bytes


def _mixed_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(7, 5, generator=g).to(torch.bfloat16), torch.randn(5, 9, generator=g)


def test_three_ranks_mixed_dtypes_odd_sizes_tiny_blocks(tmp_path):
    """bf16 rows, fp32 columns, int64 and 0-dim tensors; blocks of 16 bytes: parts of 2, 4 and 8 byte dtypes mix."""
    from safetensors.torch import load_file

    out = str(tmp_path / "hf")
    results = run_distributed(_mixed, 3, out)
    assert all(written for written, _ in results)  # all three ranks wrote shards
    got: dict[str, torch.Tensor] = {}
    for name in _shards(out):
        got.update(load_file(os.path.join(out, name)))
    a, b = _mixed_tensors()
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b)
    assert torch.equal(got["c"], torch.arange(11)) and got["d"].item() == 3.5 and got["d"].shape == ()
    assert max(peak for _, peak in results) <= 5 * 16 + 3 * 8  # blocks of 16 bytes, parts padded to 8
