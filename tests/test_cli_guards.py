"""The CLI guards the operator: --version and --help without torch, convert refuses to
overwrite, --to hf exports only the model, inspect/verify understand manager roots and
Hugging Face directories, diff maps prefixes, trace reads load timings and needs a real
gap to call a rank a straggler. Single-process checkpoints: fast."""

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
from tessera.tools.describe import PathKind, classify_path, detect_model_prefix, list_steps
from tessera.tools.trace import RankTiming, blocked_seconds, find_stragglers, load_records

REPO = Path(__file__).resolve().parent.parent


def _training_state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"model": tessera.ModelState(model), "optim": tessera.OptimizerState(model, opt), "step": 7,
            "rng": tessera.RNGState()}  # fmt: skip


@pytest.fixture
def training_ckpt(tmp_path: Path) -> str:
    path = str(tmp_path / "ck")
    tessera.save(path, _training_state())
    return path


# --------------------------------------------------------------------------------------
# --version, --help: no torch


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_do_not_import_torch(flag: str) -> None:
    code = (
        "import sys\n"
        f"sys.argv = ['tessera', '{flag}']\n"
        "from tessera.cli import main\n"
        "try:\n    main()\nfinally:\n    assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    if flag == "--version":
        assert proc.stdout.strip() == f"tessera {tessera.__version__}"
    else:
        assert "usage: tessera" in proc.stdout and "--version" in proc.stdout


def test_version_through_the_module(capsys) -> None:
    proc = subprocess.run([sys.executable, "-m", "tessera", "--version"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.strip() == f"tessera {tessera.__version__}"


def test_import_tessera_is_lazy_but_complete() -> None:
    code = (
        "import sys, tessera\n"
        "assert 'torch' not in sys.modules\n"
        "import tessera.tools.verification  # importing the module must not hide the function\n"
        "assert callable(tessera.verify) and tessera.verify.__module__ == 'tessera.tools.verification'\n"
        "missing = [n for n in tessera.__all__ if not hasattr(tessera, n)]\n"
        "assert not missing, missing\n"
        "assert tessera.storage.FileStorage\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr


# --------------------------------------------------------------------------------------
# convert


def test_convert_refuses_a_non_empty_output_without_force(training_ckpt: str, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out.pt"
    out.write_bytes(b"precious")
    assert main(["convert", training_ckpt, str(out), "--to", "torch"]) == EXIT_USAGE
    assert "exists and is not empty; pass --force" in capsys.readouterr().err
    assert out.read_bytes() == b"precious"
    assert main(["convert", training_ckpt, str(out), "--to", "torch", "--force"]) == EXIT_OK
    assert "model.0.weight" in torch.load(str(out))

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model-00001-of-00002.safetensors").write_bytes(b"stale")
    assert main(["convert", training_ckpt, str(hf), "--to", "hf"]) == EXIT_USAGE
    assert main(["convert", training_ckpt, str(hf), "--to", "hf", "--force"]) == EXIT_OK
    assert sorted(os.listdir(hf)) == ["model.safetensors"]  # nothing stale mixes in

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["convert", training_ckpt, str(empty), "--to", "hf"]) == EXIT_OK  # an empty directory is fine


def test_convert_force_never_deletes_tessera_checkpoints(training_ckpt: str, tmp_path: Path, capsys) -> None:
    other = str(tmp_path / "other")
    tessera.save(other, {"w": torch.ones(2)})
    assert main(["convert", training_ckpt, other, "--to", "hf", "--force"]) == EXIT_USAGE
    assert "holds tessera checkpoints" in capsys.readouterr().err
    assert tessera.read_manifest(other).tensors.keys() == {"w"}


def test_to_hf_exports_the_model_only(training_ckpt: str, tmp_path: Path, capsys) -> None:
    out = tmp_path / "hf"
    assert main(["convert", training_ckpt, str(out), "--to", "hf"]) == EXIT_OK
    text = capsys.readouterr().out
    assert "exporting the model only" in text and "'optim.'" in text
    assert "skipped:" not in text  # no flood of one line per skipped entry
    tensors = load_file(str(out / "model.safetensors"))
    assert sorted(tensors) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    full = {"model": {k: torch.zeros_like(v) for k, v in tensors.items()}}
    tessera.load(training_ckpt, full)
    assert all(torch.equal(full["model"][k], tensors[k]) for k in tensors)


def test_to_hf_with_an_explicit_prefix_and_verbose_skips(training_ckpt: str, tmp_path: Path, capsys) -> None:
    assert main(["-v", "convert", training_ckpt, str(tmp_path / "all"), "--to", "hf", "--prefix", ""]) == EXIT_OK
    out = capsys.readouterr().out
    assert "skipped: step (plain value)" in out
    names = load_file(str(tmp_path / "all" / "model.safetensors"))
    assert "model.0.weight" in names and any(n.startswith("optim.state.") for n in names)
    assert (
        main(["convert", training_ckpt, str(tmp_path / "all.pt"), "--to", "torch", "--prefix", "", "--no-values"])
        == EXIT_OK
    )
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "skipped" in ln]
    assert lines == [  # one line per reason, three names at most: no flood
        "  skipped 6 (per-rank value): rng.python.version, rng.python.gauss_next, rng.numpy.algorithm, "
        "... and 3 more (-v lists them)"
    ]


def test_to_hf_requires_a_prefix_when_it_cannot_tell(tmp_path: Path, capsys) -> None:
    path = str(tmp_path / "only-model")
    tessera.save(path, {"model": {"w": torch.ones(2)}, "step": 1})
    assert main(["convert", path, str(tmp_path / "hf"), "--to", "hf"]) == EXIT_USAGE
    assert "pass --prefix model." in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
    assert main(["convert", path, str(tmp_path / "hf"), "--to", "hf", "--prefix", "model."]) == EXIT_OK
    assert list(load_file(str(tmp_path / "hf" / "model.safetensors"))) == ["w"]


@pytest.mark.parametrize(
    ("names", "prefix"),
    [
        (["model.a", "optim.state.a.exp_avg", "optim.state.a.step"], "model."),
        (["net.a", "net.b", "optimizer.state.a.exp_avg"], "net."),
        (["model.embed.weight", "lm_head.weight"], ""),  # an HF model's own names: everything
        (["w", "b"], ""),
        (["model.a"], None),  # strip model. or not: cannot be guessed
        (["a.w", "b.w", "optim.state.a.w.exp_avg"], None),
    ],
)
def test_detect_model_prefix(names: list[str], prefix: str | None) -> None:
    assert detect_model_prefix(names)[0] == prefix


# --------------------------------------------------------------------------------------
# inspect / verify on what is not one checkpoint


def _manager_root(tmp_path: Path) -> str:
    root = str(tmp_path / "run")
    with tessera.CheckpointManager(root) as mgr:
        for step in (10, 20):
            mgr.save(step, {"w": torch.full((3,), float(step)), "step": step})
    half = os.path.join(root, "step-00000030", "data", "abc")  # a save that never committed
    os.makedirs(half)
    Path(half, "0-0.safetensors").write_bytes(b"partial")
    return root


def test_inspect_and_verify_a_manager_root(tmp_path: Path, capsys) -> None:
    root = _manager_root(tmp_path)
    assert classify_path(root) == PathKind.MANAGER_ROOT
    assert [(s.step, s.committed, s.latest) for s in list_steps(root)] == [
        (10, True, False),
        (20, True, True),
        (30, False, False),
    ]
    assert main(["inspect", root]) == EXIT_OK
    out = capsys.readouterr().out
    assert (
        "a checkpoint manager root with 2 committed step(s)" in out
        and "committed, latest" in out
        and "incomplete" in out
    )
    assert main(["inspect", root, "--json"]) == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in doc["steps"]] == [10, 20, 30]
    assert main(["verify", root]) == EXIT_OK
    out = capsys.readouterr().out
    assert (
        "OK " + os.path.join(root, "step-00000010") in out
        and "2 step(s) verified" in out
        and "incomplete step(s) 30" in out
    )
    assert main(["verify", root, "--step", "20", "--json"]) == EXIT_OK
    assert list(json.loads(capsys.readouterr().out)["steps"]) == ["20"]
    assert main(["verify", root, "--step", "99"]) == EXIT_USAGE


def test_verify_a_manager_root_finds_a_corrupt_step(tmp_path: Path, capsys) -> None:
    root = _manager_root(tmp_path)
    data = os.path.join(root, "step-00000010", "data")
    victim = next(os.path.join(d, f) for d, _, fs in os.walk(data) for f in fs)
    with open(victim, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    assert main(["verify", root]) == EXIT_PROBLEMS
    out = capsys.readouterr().out
    assert "FAILED " + os.path.join(root, "step-00000010") in out and "PROBLEMS found" in out


def test_inspect_an_hf_directory_says_what_it_is(training_ckpt: str, tmp_path: Path, capsys) -> None:
    hf = tmp_path / "hf"
    assert main(["convert", training_ckpt, str(hf), "--to", "hf"]) == EXIT_OK
    (hf / "config.json").write_text(json.dumps({"architectures": ["TinyForCausalLM"], "model_type": "tiny"}))
    capsys.readouterr()
    assert main(["inspect", str(hf)]) == EXIT_OK
    out = capsys.readouterr().out
    assert (
        "a Hugging Face safetensors directory, TinyForCausalLM: 4 tensors (4 F32)" in out and "manifest.json" not in out
    )
    assert main(["verify", str(hf)]) == EXIT_PROBLEMS  # nothing tessera can verify
    assert "not a tessera checkpoint" in capsys.readouterr().out


def test_inspect_an_incomplete_checkpoint(tmp_path: Path, capsys) -> None:
    (tmp_path / "half" / "data").mkdir(parents=True)
    assert main(["inspect", str(tmp_path / "half")]) == EXIT_PROBLEMS
    assert "save never committed" in capsys.readouterr().out


# --------------------------------------------------------------------------------------
# diff


def test_diff_a_training_checkpoint_with_its_model_export(training_ckpt: str, tmp_path: Path, capsys) -> None:
    hf = str(tmp_path / "hf")
    assert main(["convert", training_ckpt, hf, "--to", "hf"]) == EXIT_OK
    assert main(["diff", training_ckpt, hf]) == EXIT_PROBLEMS  # names differ without mapping
    capsys.readouterr()
    assert main(["diff", training_ckpt, hf, "--strip", "model."]) == EXIT_OK
    assert "identical: 4 tensors" in capsys.readouterr().out
    assert main(["diff", hf, training_ckpt, "--strip-b", "model.", "--prefix", "1.", "--json"]) == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert doc["identical"] and doc["same_tensors"] == 2 and doc["b"] == training_ckpt

    other = str(tmp_path / "other")
    tessera.save(other, _training_state(seed=1))
    assert main(["diff", other, hf, "--strip", "model.", "--json"]) == EXIT_PROBLEMS
    doc = json.loads(capsys.readouterr().out)
    assert {d["name"] for d in doc["tensors"]} == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert all(d["kind"] == "values" for d in doc["tensors"])


# --------------------------------------------------------------------------------------
# trace


def test_trace_reads_load_timings(training_ckpt: str, tmp_path: Path, capsys) -> None:
    assert main(["trace", training_ckpt, "--op", "load"]) == EXIT_USAGE  # no load yet
    capsys.readouterr()
    tessera.load(training_ckpt, _training_state())
    tessera.load(training_ckpt, _training_state())
    records = load_records(training_ckpt)
    assert len(records) == 2 and all(r.world_size == 1 for r in records)
    assert set(records[-1].timings[0].phases) >= {"metadata", "plan", "read"}
    assert main(["trace", training_ckpt, "--op", "load"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "1 earlier load(s) recorded" in out and "the training loop waits for the whole load" in out
    assert main(["trace", training_ckpt, "--op", "all", "--json"]) == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"save", "load"}
    rank0 = doc["load"]["ranks"][0]
    assert rank0["blocked"] == pytest.approx(rank0["total"])
    save0 = doc["save"]["ranks"][0]
    phases = save0["phases"]
    assert save0["blocked"] == pytest.approx(phases["wait_previous"] + phases["plan"] + phases["stage"])


def test_a_straggler_needs_an_absolute_and_a_relative_gap() -> None:
    fast = [RankTiming(r, {"plan": 0.01, "write": 0.02}) for r in range(3)]
    short = fast + [RankTiming(3, {"plan": 0.01, "write": 0.055})]  # a 65 ms save, 2.2x the median
    assert find_stragglers(short) == []
    assert {(s.rank, s.phase) for s in find_stragglers(short, min_gap_s=0.01)} == {(3, "write"), (3, "total")}
    long = [RankTiming(r, {"write": 100.0}) for r in range(3)] + [RankTiming(3, {"write": 110.0})]
    assert find_stragglers(long) == []  # 10 s late, but only 1.1x
    slow = fast + [RankTiming(3, {"plan": 0.01, "write": 1.0})]
    assert {(s.rank, s.phase) for s in find_stragglers(slow)} == {(3, "write"), (3, "total")}


def test_blocked_seconds() -> None:
    t = RankTiming(0, {"plan": 0.5, "stage": 0.25, "write": 4.0, "commit": 1.0})
    assert blocked_seconds("save", t) == 0.75
    assert blocked_seconds("load", t) == t.total
