"""The ``tessera`` command on ``CheckpointManager`` roots: a root is its latest step, ``ROOT@STEP`` a step.

Also options after the verb (``-v``) and the ``config.json`` of ``convert --to hf``. Real
manager roots with several steps (each with a ``latest`` pointer, which once passed for
DeepSpeed's), through :func:`tessera.cli.main` and one real subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tessera
from tessera.cli import EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, main
from tessera.convert import detect_format
from tessera.tools.steps import resolve_checkpoint

STEPS = (20, 40, 60)


def _state(step: int, scale: float = 1.0) -> dict:
    return {"model": {"w": torch.full((2, 3), step * scale), "b": torch.arange(3.0) + step}, "step": step}


def _root(path: Path, scale: float = 1.0, steps: tuple[int, ...] = STEPS) -> str:
    root = str(path)
    with tessera.CheckpointManager(root) as mgr:
        for step in steps:
            mgr.save(step, _state(step, scale))
    return root


@pytest.fixture
def roots(tmp_path: Path) -> tuple[str, str]:
    a = _root(tmp_path / "run-a")
    b = _root(tmp_path / "run-b", scale=2.0, steps=(20, 40))
    half = Path(a, "step-00000080", "data")  # a save that never committed: never chosen
    half.mkdir(parents=True)
    (half / "0-0.safetensors").write_bytes(b"partial")
    return a, b


def _step(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def test_convert_a_root_reads_its_latest_step(roots: tuple[str, str], tmp_path: Path, capsys) -> None:
    a, _ = roots
    out = str(tmp_path / "out.pt")
    assert main(["convert", a, out, "--to", "torch"]) == EXIT_OK
    err = capsys.readouterr().err
    assert f"{a}: a checkpoint manager root; using its latest committed step 60: {_step(a, 60)}" in err
    assert torch.equal(torch.load(out)["model.w"], torch.full((2, 3), 60.0))

    assert main(["convert", f"{a}@20", out, "--to", "torch", "--force"]) == EXIT_OK
    assert f"{a}@20: step 20 of the checkpoint manager root {a}: {_step(a, 20)}" in capsys.readouterr().err
    assert torch.equal(torch.load(out)["model.w"], torch.full((2, 3), 20.0))

    assert main(["convert", _step(a, 40), out, "--to", "torch", "--force"]) == EXIT_OK  # a step directory
    assert "manager root" not in capsys.readouterr().err
    assert torch.load(out)["step"] == 40


def test_diff_two_roots_and_their_steps(roots: tuple[str, str], capsys) -> None:
    a, b = roots
    assert main(["diff", a, b, "--json"]) == EXIT_PROBLEMS  # a's 60 against b's 40
    captured = capsys.readouterr()
    doc = json.loads(captured.out)  # the notes go to stderr: stdout stays JSON
    assert (doc["a"], doc["b"]) == (_step(a, 60), _step(b, 40))
    assert "latest committed step 60" in captured.err and "latest committed step 40" in captured.err
    assert main(["diff", f"{a}@40", f"{a}@latest"]) == EXIT_PROBLEMS
    assert "step 40 of the checkpoint manager root" in capsys.readouterr().err
    assert main(["diff", f"{a}@40", _step(a, 40)]) == EXIT_OK
    assert "identical" in capsys.readouterr().out


def test_trace_rename_inspect_verify_take_root_at_step(roots: tuple[str, str], capsys) -> None:
    a, _ = roots
    assert main(["trace", a]) == EXIT_OK
    captured = capsys.readouterr()
    assert "save: 1 rank(s)" in captured.out and "latest committed step 60" in captured.err

    assert main(["rename", f"{a}@20", "--map", "model.=net."]) == EXIT_OK
    assert set(tessera.read_manifest(_step(a, 20)).tensors) == {"net.w", "net.b"}
    assert set(tessera.read_manifest(_step(a, 60)).tensors) == {"model.w", "model.b"}
    capsys.readouterr()
    assert main(["rename", a, "--map", "model.=net.", "--dry-run"]) == EXIT_OK
    assert "would rename 2" in (out := capsys.readouterr().out) and "net.w" in out

    assert main(["inspect", f"{a}@40", "--json"]) == EXIT_OK
    assert json.loads(capsys.readouterr().out)["step"] == 40
    assert main(["inspect", a]) == EXIT_OK  # a bare root still lists its steps
    assert "a checkpoint manager root with 3 committed step(s)" in capsys.readouterr().out
    assert main(["verify", f"{a}@40"]) == EXIT_OK
    out = capsys.readouterr().out
    assert f"OK {_step(a, 40)}" in out and _step(a, 60) not in out
    assert main(["verify", a]) == EXIT_OK  # a bare root: every committed step
    assert "3 step(s) verified" in capsys.readouterr().out


def test_unusable_step_names_are_usage_errors(roots: tuple[str, str], tmp_path: Path, capsys) -> None:
    a, _ = roots
    out = str(tmp_path / "x.pt")
    assert main(["convert", f"{a}@99", out, "--to", "torch"]) == EXIT_USAGE
    assert "no step 99 under" in (err := capsys.readouterr().err) and "its committed steps: 20, 40, 60" in err
    assert main(["trace", f"{a}@80"]) == EXIT_USAGE
    assert "step 80 under" in (err := capsys.readouterr().err) and "never committed" in err
    assert main(["inspect", f"{_step(a, 20)}@20"]) == EXIT_USAGE
    assert "needs a checkpoint manager root" in capsys.readouterr().err
    empty = tmp_path / "empty-run"
    (empty / "step-00000010" / "data").mkdir(parents=True)
    (empty / "step-00000010" / "data" / "f").write_bytes(b"x")
    assert main(["diff", str(empty), a]) == EXIT_PROBLEMS
    assert "no committed step" in capsys.readouterr().err
    assert not os.path.exists(out)


def test_a_path_with_an_at_sign_is_taken_as_it_is(tmp_path: Path) -> None:
    odd = str(tmp_path / "ckpt@5")
    tessera.save(odd, _state(5))
    assert resolve_checkpoint(odd).path == odd


def test_detect_format_names_a_root_instead_of_deepspeed(roots: tuple[str, str]) -> None:
    a, _ = roots
    with pytest.raises(ValueError, match=r"CheckpointManager root, not one checkpoint; name a step: .*step-00000080"):
        detect_format(a)


def test_verbose_after_the_verb(tmp_path: Path, capsys) -> None:
    path = str(tmp_path / "ckpt")
    tessera.save(path, {"model": {"w": torch.ones(2)}, **{f"v{i}": i for i in range(5)}})
    assert main(["convert", path, str(tmp_path / "a"), "--to", "hf", "--prefix", ""]) == EXIT_OK
    assert "(-v lists them)" in capsys.readouterr().out
    assert main(["convert", path, str(tmp_path / "b"), "--to", "hf", "--prefix", "", "-v"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "-v lists them" not in out and all(f"skipped: v{i} (plain value)" in out for i in range(5))
    assert main(["-v", "inspect", path, "-v", "--no-progress"]) == EXIT_OK


def test_module_entry_point_on_a_root(roots: tuple[str, str], tmp_path: Path) -> None:
    a, b = roots
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH", "")]),
    }
    out = str(tmp_path / "out.pt")
    proc = subprocess.run(
        [sys.executable, "-m", "tessera", "convert", a, out, "--to", "torch", "-v"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == EXIT_OK, proc.stderr
    assert "latest committed step 60" in proc.stderr and "wrote 2 tensors and 1 values" in proc.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "tessera", "diff", f"{a}@20", f"{b}@20"], capture_output=True, text=True, env=env,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == EXIT_PROBLEMS and "1 tensor(s) and 0 value(s) differ" in proc.stdout, proc.stderr


# --------------------------------------------------------------------------------------
# convert --to hf: config.json


def test_to_hf_writes_config_json_when_known(tmp_path: Path, capsys) -> None:
    cfg = {"model_type": "toy", "architectures": ["ToyForCausalLM"], "hidden_size": 3, "torch_dtype": "float16"}
    path = str(tmp_path / "ckpt")
    state = {"model": {"w": torch.ones(2, 3)}, "optim": {"w": torch.zeros(2, 3)}, "step": 1}
    tessera.save(path, state)
    assert main(["convert", path, str(tmp_path / "bare"), "--to", "hf"]) == EXIT_OK
    assert "no config.json" in capsys.readouterr().out and not (tmp_path / "bare" / "config.json").exists()

    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    assert main(["convert", path, str(tmp_path / "given"), "--to", "hf", "--config", str(tmp_path / "cfg.json")]) == 0
    assert "wrote config.json (from " in capsys.readouterr().out
    assert json.loads((tmp_path / "given" / "config.json").read_text()) == {**cfg, "torch_dtype": "float32"}

    recorded = str(tmp_path / "recorded")
    tessera.save(recorded, state, options=tessera.SaveOptions(metadata={"hf_config": cfg}))
    assert main(["convert", recorded, str(tmp_path / "meta"), "--to", "hf", "--dtype", "bf16"]) == EXIT_OK
    assert "wrote config.json (recorded in the checkpoint)" in capsys.readouterr().out
    assert json.loads((tmp_path / "meta" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load_file(str(tmp_path / "meta" / "model.safetensors"))["w"].dtype == torch.bfloat16

    # Hugging Face -> tessera -> Hugging Face keeps the config.
    assert main(["convert", str(tmp_path / "given"), str(tmp_path / "back")]) == EXIT_OK
    assert tessera.read_manifest(str(tmp_path / "back")).metadata["hf_config"]["model_type"] == "toy"
    assert main(["convert", str(tmp_path / "back"), str(tmp_path / "again"), "--to", "hf"]) == EXIT_OK
    assert json.loads((tmp_path / "again" / "config.json").read_text())["architectures"] == ["ToyForCausalLM"]

    assert main(["convert", path, str(tmp_path / "x.pt"), "--to", "torch", "--config", str(tmp_path / "cfg.json")]) == 2
    assert main(["convert", path, str(tmp_path / "y"), "--to", "hf", "--config", str(tmp_path / "nope.json")]) == 1
    assert "no Hugging Face config at" in capsys.readouterr().err
