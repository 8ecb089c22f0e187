"""Hugging Face safetensors export/import, checked with the real consumer: ``transformers``.

A tiny random-init Llama is saved with tessera (one process, and sharded over 2 real ranks in
mixed layouts), exported, and loaded with ``AutoModelForCausalLM.from_pretrained``: the logits
must be bit-identical to the original model's. No downloads: the config is written locally.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open

import tessera
from tessera.cli import main
from tessera.convert import export_hf, import_hf
from tests.dist_utils import run_distributed
from tests.layouts import hold

transformers = pytest.importorskip("transformers")


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


def logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(24).reshape(2, 12) * 5 % 128
    with torch.no_grad():
        return model(ids).logits


def load_exported(out_dir: str, model: torch.nn.Module, **kw: object) -> torch.nn.Module:
    model.config.save_pretrained(out_dir)
    return transformers.AutoModelForCausalLM.from_pretrained(out_dir, **kw).eval()


def test_export_hf_sharded_gives_same_logits(tmp_path) -> None:
    model = tiny_llama()
    ck, out = str(tmp_path / "ck"), str(tmp_path / "hf")
    tessera.save(ck, {"model": model.state_dict(), "step": 10})
    result = export_hf(ck, out, prefix="model.", max_shard_size="100KB")
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == result.files - 1 >= 3
    assert set(index["weight_map"]) == set(model.state_dict())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for s in shards:
        assert os.path.getsize(os.path.join(out, s)) <= 100_000 + 4096  # header included
    loaded = load_exported(out, model)
    assert torch.equal(logits(loaded), logits(model))


def _save_sharded(rank: int, world: int, sd_file: str, path: str) -> None:
    sd = torch.load(sd_file, weights_only=True)
    layouts = ["dt_shard0", "sharded_cols", "flat", "dt_shard1", "sharded_uneven"]
    held = {n: hold(layouts[i % len(layouts)], t, rank, world) for i, (n, t) in enumerate(sd.items())}
    tessera.save(path, {"model": held, "step": 10})


def test_export_hf_from_two_rank_checkpoint(tmp_path) -> None:
    model = tiny_llama()
    sd_file, ck, out = str(tmp_path / "sd.pt"), str(tmp_path / "ck"), str(tmp_path / "hf")
    torch.save(model.state_dict(), sd_file)
    run_distributed(_save_sharded, 2, sd_file, ck)
    assert tessera.read_manifest(ck).world_size == 2
    assert main(["convert", ck, out, "--to", "hf", "--prefix", "model.", "--max-shard-size", "64KiB"]) == 0
    loaded = load_exported(out, model)
    assert torch.equal(logits(loaded), logits(model))


def test_export_hf_dtype_cast_and_single_file(tmp_path) -> None:
    model = tiny_llama()
    ck, out = str(tmp_path / "ck"), str(tmp_path / "hf")
    tessera.save(ck, {"model": model.state_dict(), "ids": torch.arange(5)})
    # A sharded export first, then a single-file one into the same directory: stale shards go.
    export_hf(ck, out, prefix="model.", max_shard_size="50KB")
    result = export_hf(ck, out, prefix="model.", dtype=torch.bfloat16)
    assert result.files == 1 and sorted(os.listdir(out)) == ["model.safetensors"]
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        for name, t in model.state_dict().items():
            got = f.get_tensor(name)
            assert got.dtype == torch.bfloat16 and torch.equal(got, t.to(torch.bfloat16)), name
    # (Logits are not compared here: model.to(bf16) also casts the rotary buffer, which
    # from_pretrained keeps in fp32.)
    loaded = load_exported(out, model, dtype=torch.bfloat16).state_dict()
    for name, t in model.state_dict().items():
        assert loaded[name].dtype == torch.bfloat16 and torch.equal(loaded[name], t.to(torch.bfloat16)), name
    # Integer tensors keep their dtype under a cast; without a prefix everything is exported.
    export_hf(ck, str(tmp_path / "all"), dtype=torch.float16)
    with safe_open(os.path.join(tmp_path / "all", "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("ids").dtype == torch.int64 and "model.lm_head.weight" in f.keys()


def test_import_hf_round_trip(tmp_path) -> None:
    model = tiny_llama()
    out = str(tmp_path / "hf")
    model.save_pretrained(out, max_shard_size="60KB")  # transformers' own sharded writer
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    ck = str(tmp_path / "ck")
    assert main(["convert", out, ck, "--prefix", "model."]) == 0  # format detected
    target = {"model": {n: torch.zeros_like(t) for n, t in model.state_dict().items()}}
    tessera.load(ck, target)
    for n, t in model.state_dict().items():
        assert torch.equal(target["model"][n], t), n
    # One safetensors file, imported directly, with a cast.
    single = str(tmp_path / "one.safetensors")
    from safetensors.torch import save_file

    save_file({"a": torch.randn(4, 3), "i": torch.arange(3)}, single)
    r = import_hf(single, str(tmp_path / "ck2"), dtype=torch.bfloat16)
    m = tessera.read_manifest(str(tmp_path / "ck2"))
    assert r.tensors == 2 and m.tensors["a"].dtype == "bfloat16" and m.tensors["i"].dtype == "int64"


def test_export_import_bounded_memory(tmp_path) -> None:
    """96 MiB of tensors go through export, import and diff with < 40 MiB of extra memory."""
    ck = str(tmp_path / "ck")
    tessera.save(ck, {f"w{i}": torch.full((2048, 4096), float(i)) for i in range(3)})  # 3 x 32 MiB
    script = textwrap.dedent(
        f"""
        import threading, time, torch, tessera
        from tessera.convert import export_hf, import_hf, diff_checkpoints
        ck, out, back = {ck!r}, {str(tmp_path / "hf")!r}, {str(tmp_path / "back")!r}
        def rss():  # anonymous memory: file pages mapped by safetensors are reclaimable page cache
            with open("/proc/self/status") as f:
                status = dict(line.split(":", 1) for line in f)
            return int(status["RssAnon"].split()[0]) * 1024
        peak, done = [0], []
        def sample(*_):
            peak[0] = max(peak[0], rss())
        def watch():
            while not done:
                sample()
                time.sleep(0.002)
        base = rss()
        t = threading.Thread(target=watch); t.start()
        export_hf(ck, out, block_bytes=4 << 20, progress=sample)
        import_hf(out, back, block_bytes=4 << 20, file_bytes=8 << 20, progress=sample)
        assert diff_checkpoints(ck, back, block_bytes=4 << 20, progress=sample).identical
        done.append(1); t.join()
        print(base, peak[0])
        """
    )
    # A fresh process, so that nothing else it holds muddles the measurement. A fixed mmap
    # threshold makes glibc return freed blocks at once, so RSS tracks live memory rather
    # than what the allocator keeps cached per thread arena.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    base, peak = (int(x) for x in proc.stdout.split())
    assert peak - base < 40 << 20, f"peak {peak >> 20} MiB vs {base >> 20} MiB before converting 96 MiB"
