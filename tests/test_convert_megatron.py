"""Megatron TP x PP rank files -> tessera global tensors, compared with the global truth.

The rank files are written in Megatron's on-disk layout (``latest_checkpointed_iteration.txt``,
``iter_<N>/mp_rank_<tp>[_<pp>]/model_optim_rng.pt``) from the independent model of Megatron-core's
sharding in ``tests/test_megatron.py`` (fused per-group QKV, SwiGLU fc1, padded vocabulary,
per-stage layer numbering), so the conversion is checked against that model, not against
the spec it uses.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import tessera
from tessera.cli import main
from tessera.convert import import_megatron
from tessera.errors import CorruptCheckpointError, StateMismatchError
from tests.test_megatron import DIV, FFN, HD, NG, NH, SPEC, L, V, megatron_local, saved_name, saved_view, truth


def write_megatron(root: str, tp: int, pp: int, iteration: int = 3) -> str:
    g = truth(0, torch.float32)
    it_dir = os.path.join(root, f"iter_{iteration:07d}")
    for tp_rank in range(tp):
        for pp_rank in range(pp):
            d = os.path.join(it_dir, f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else ""))
            os.makedirs(d)
            model = megatron_local(g, tp_rank, tp, pp_rank, pp)
            model["decoder.layers.0.self_attention.core_attention._extra_state"] = None
            sd = {"model": model, "iteration": iteration, "checkpoint_version": 3.0,
                  "optimizer": {"optimizer": {"state": {}, "param_groups": []}}, "rng_state": [{"random_rng_state": [1, 2]}]}  # fmt: skip
            torch.save(sd, os.path.join(d, "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return root


def _check(path: str) -> None:
    g = truth(0, torch.float32)
    plain = {"model": {saved_name(n): torch.zeros_like(saved_view(n, t)) for n, t in g.items()}, "iteration": 0}
    assert tessera.load(path, plain).missing_keys == []
    for n, t in g.items():
        assert torch.equal(plain["model"][saved_name(n)], saved_view(n, t)), n
    assert plain["iteration"] == 3
    m = tessera.read_manifest(path)
    assert m.tensors["model.output_layer.weight"].shape == (V, 8)  # vocabulary padding dropped


@pytest.mark.parametrize("tp,pp", [(2, 2), (4, 1), (1, 2)])
def test_megatron_files_to_global_tensors(tmp_path, tp: int, pp: int) -> None:
    root = write_megatron(str(tmp_path / "meg"), tp, pp)
    r = import_megatron(root, str(tmp_path / "ck"), spec=SPEC, file_bytes=4096)
    assert r.files > 1 and "optimizer (not converted)" in r.skipped
    _check(str(tmp_path / "ck"))
    layout = tessera.read_manifest(str(tmp_path / "ck")).layout
    assert layout["tensor_parallel"] == tp and layout["pipeline_parallel"] == pp


def test_cli_with_json_spec_and_module_spec(tmp_path) -> None:
    root = write_megatron(str(tmp_path / "meg"), 2, 2)
    spec_file = str(tmp_path / "spec.json")
    with open(spec_file, "w") as f:
        json.dump({"gpt": {"num_layers": L, "vocab_size": V, "num_attention_heads": NH, "num_query_groups": NG,
                           "kv_channels": HD, "ffn_hidden_size": FFN, "swiglu": True, "make_vocab_size_divisible_by": DIV}}, f)  # fmt: skip
    assert main(["convert", root, str(tmp_path / "ck"), "--from", "megatron", "--spec", spec_file]) == 0
    _check(str(tmp_path / "ck"))
    # Detected from the tracker file; the spec given as module:attribute.
    assert main(["convert", root, str(tmp_path / "ck2"), "--spec", "tests.test_megatron:SPEC"]) == 0
    _check(str(tmp_path / "ck2"))
    assert main(["convert", root, str(tmp_path / "ck3"), "--from", "megatron"]) == 2  # no spec


def test_wrong_spec_and_missing_rank_are_reported(tmp_path) -> None:
    root = write_megatron(str(tmp_path / "meg"), 2, 2)
    from tessera.adapters.megatron import gpt_spec

    wrong = gpt_spec(num_layers=L - 2, vocab_size=V, num_attention_heads=NH, num_query_groups=NG, kv_channels=HD,
                     ffn_hidden_size=FFN, swiglu=True, make_vocab_size_divisible_by=DIV)  # fmt: skip
    with pytest.raises(StateMismatchError, match="local layer 1"):
        import_megatron(root, str(tmp_path / "ck"), spec=wrong)
    assert not os.path.exists(tmp_path / "ck" / "manifest.json")
    os.remove(os.path.join(root, "iter_0000003", "mp_rank_01_001", "model_optim_rng.pt"))
    with pytest.raises(CorruptCheckpointError, match=r"\(1, 1, 0\)"):
        import_megatron(root, str(tmp_path / "ck"), spec=SPEC)
