"""The ``tessera`` command: every verb on checkpoints saved by 1, 2 and 4 real ranks in mixed layouts.

Most tests call ``main([...])`` in-process (fast, output through ``capsys``); one runs the
installed module through ``subprocess`` to check the real entry point and exit codes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tessera
from tessera.cli import EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, main
from tessera.convert import RenameRule, diff_checkpoints, rename_tensors
from tessera.storage import FileStorage
from tessera.tools.trace import RankTiming, find_stragglers
from tests.dist_utils import run_distributed
from tests.layouts import hold, truth

TENSORS = {
    "model.embed": ((13, 6), torch.float32, "dt_2d"),
    "model.proj": ((7, 5), torch.bfloat16, "flat"),
    "model.bias": ((9,), torch.float32, "sharded_uneven"),
    "optim.step": ((), torch.int64, "replicated"),
}
SLOW_RANK = 2


class SlowStorage(FileStorage):
    """A real local backend that takes longer to write on one rank (a straggler)."""

    def __init__(self, url: str, delay: float) -> None:
        super().__init__(url, durable=False)
        self.delay = delay

    def write_file(self, path, chunks) -> None:  # type: ignore[no-untyped-def]
        time.sleep(self.delay)
        super().write_file(path, chunks)


def full_state(seed: int = 0) -> dict[str, torch.Tensor]:
    return {n: truth(shape, dt, seed) if shape else torch.tensor(5) for n, (shape, dt, _) in TENSORS.items()}


def _save(rank: int, world: int, path: str, seed: int) -> None:
    """Every layout of tests/layouts.py that fits, one per tensor; rank 2 writes slowly."""
    held: dict = {}
    for name, (shape, dt, layout) in TENSORS.items():
        t = truth(shape, dt, seed) if shape else torch.tensor(5)
        held[name] = t.clone() if not shape else hold(layout, t, rank, world)
    state = {"model": {k[6:]: v for k, v in held.items() if k.startswith("model.")}, "optim": {"step": held["optim.step"]},
             "epoch": 3, "cfg": {"lr": 0.1, "betas": (0.9, 0.95)}, "rng": tessera.per_rank(rank, on_resize="keep")}  # fmt: skip
    tessera.save(path, state)  # warm-up: the first save of a process also sets up its gloo group
    delay = 0.4 if rank == SLOW_RANK else 0.0
    tessera.save(path, state, storage=SlowStorage(path, delay))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cli")
    out = {"w4": str(root / "w4"), "w2": str(root / "w2")}
    run_distributed(_save, 4, out["w4"], 0)
    run_distributed(_save, 2, out["w2"], 0)
    return out


def _load_full(path: str) -> dict[str, torch.Tensor]:
    target = {n: torch.zeros(shape, dtype=dt) for n, (shape, dt, _) in TENSORS.items()}
    tessera.load(
        path,
        {
            "model": {k[6:]: v for k, v in target.items() if k.startswith("model.")},
            "optim": {"step": target["optim.step"]},
        },
        strict=False,
    )
    return target


# --------------------------------------------------------------------------------------
# inspect


def test_inspect_json_lists_tensors_values_layout(ckpts, capsys) -> None:
    assert main(["inspect", ckpts["w4"], "--json"]) == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    tensors = {t["name"]: t for t in doc["tensors"]}
    assert set(tensors) == set(TENSORS)
    assert tensors["model.embed"]["shape"] == [13, 6] and tensors["model.embed"]["dtype"] == "float32"
    assert tensors["model.embed"]["tiles"] == 4  # a DTensor on a 2 x 2 mesh
    assert tensors["model.proj"]["bytes"] == 7 * 5 * 2
    assert doc["world_size"] == 4 and doc["layout"]["world_size"] == 4
    assert doc["values"]["epoch"] == 3
    assert doc["per_rank"]["rng"]["values"] == [0, 1, 2, 3]
    assert doc["created"] and doc["save_id"]


def test_inspect_table(ckpts, capsys) -> None:
    assert main(["inspect", ckpts["w2"]]) == EXIT_OK
    text = capsys.readouterr().out
    for name in TENSORS:
        assert name in text
    assert "bfloat16" in text and "[13, 6]" in text and "(0.9, 0.95)" in text and "saved by 2 rank(s)" in text


def test_inspect_prints_names_verbatim(tmp_path, capsys) -> None:
    tessera.save(str(tmp_path / "ck"), {"w[red]": torch.ones(2), "note": "[bold]x[/bold]"})
    assert main(["inspect", str(tmp_path / "ck")]) == EXIT_OK
    out = capsys.readouterr().out
    assert "w[red]" in out and "[bold]x[/bold]" in out


def test_inspect_missing_checkpoint_fails(tmp_path, capsys) -> None:
    assert main(["inspect", str(tmp_path / "nothing")]) == EXIT_PROBLEMS
    assert "no committed checkpoint" in capsys.readouterr().err


# --------------------------------------------------------------------------------------
# verify


def _copy(src: str, dst: str) -> str:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_verify_ok(ckpts, capsys) -> None:
    assert main(["verify", ckpts["w4"]]) == EXIT_OK
    assert "OK" in capsys.readouterr().out


def test_verify_catches_flipped_byte(ckpts, tmp_path, capsys) -> None:
    path = _copy(ckpts["w4"], str(tmp_path / "bad"))
    m = tessera.read_manifest(path)
    tile = m.tensors["model.embed"].tiles[0]
    with open(os.path.join(path, tile.file), "r+b") as f:
        f.seek(tile.byte_offset + 3)
        b = f.read(1)
        f.seek(tile.byte_offset + 3)
        f.write(bytes([b[0] ^ 0xFF]))
    assert main(["verify", path]) == EXIT_PROBLEMS
    out = capsys.readouterr().out
    assert "FAILED" in out and "checksum" in out and "model.embed" in out
    assert main(["verify", path, "--json"]) == EXIT_PROBLEMS
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False
    assert any(
        p["kind"] == "checksum" and p["tensor"] == "model.embed" and p["file"] == tile.file for p in doc["problems"]
    )


def test_verify_catches_missing_file(ckpts, tmp_path, capsys) -> None:
    path = _copy(ckpts["w2"], str(tmp_path / "bad"))
    victim = tessera.read_manifest(path).files[-1]
    os.remove(os.path.join(path, victim.path))
    assert main(["verify", path]) == EXIT_PROBLEMS
    out = capsys.readouterr().out
    assert "missing" in out and f"{victim.rank}" in out


# --------------------------------------------------------------------------------------
# diff


def test_diff_same_data_different_layouts_is_identical(ckpts, capsys) -> None:
    """4-rank and 2-rank saves of the same state: different tiles, identical content."""
    assert main(["diff", ckpts["w4"], ckpts["w2"]]) == EXIT_PROBLEMS  # only the per-rank value differs
    out = capsys.readouterr().out
    assert "rng" in out and "tensors that differ" not in out
    report = diff_checkpoints(ckpts["w4"], ckpts["w2"], block_bytes=16)
    assert report.tensors == [] and report.same_tensors == len(TENSORS)
    assert [v.name for v in report.values] == ["rng"]


def test_diff_reports_values_shapes_dtypes_and_missing(ckpts, tmp_path, capsys) -> None:
    other = str(tmp_path / "other")
    base = _load_full(ckpts["w2"])
    changed = {
        "embed": base["model.embed"].clone(),
        "proj": base["model.proj"].to(torch.float32),  # dtype differs
        "bias": torch.zeros(10),  # shape differs
        "extra": torch.ones(2),  # only in B
    }
    changed["embed"][4, 2] += 0.5
    tessera.save(other, {"model": changed, "epoch": 4, "cfg": {"lr": 0.1, "betas": (0.9, 0.95)}})
    assert main(["diff", ckpts["w2"], other, "--json"]) == EXIT_PROBLEMS
    doc = json.loads(capsys.readouterr().out)
    kinds = {d["name"]: d for d in doc["tensors"]}
    assert kinds["model.embed"]["kind"] == "values" and kinds["model.embed"]["mismatched"] == 1
    assert kinds["model.embed"]["max_abs"] == pytest.approx(0.5)
    expected_rel = 0.5 / (abs(float(base["model.embed"][4, 2])) + 0.5)
    assert kinds["model.embed"]["max_rel"] == pytest.approx(expected_rel)
    assert kinds["model.proj"]["kind"] == "dtype" and kinds["model.bias"]["kind"] == "shape"
    assert kinds["model.extra"]["kind"] == "only_b" and kinds["optim.step"]["kind"] == "only_a"
    values = {d["name"]: d["kind"] for d in doc["values"]}
    assert values == {"epoch": "values", "rng": "only_a"}
    # A tolerance hides the small change.
    report = diff_checkpoints(ckpts["w2"], other, atol=0.6)
    assert "model.embed" not in {d.name for d in report.tensors}


def test_diff_nan_equal_to_itself(tmp_path) -> None:
    t = torch.tensor([1.0, float("nan"), 3.0])
    tessera.save(str(tmp_path / "a"), {"t": t})
    tessera.save(str(tmp_path / "b"), {"t": t.clone()})
    assert diff_checkpoints(str(tmp_path / "a"), str(tmp_path / "b")).identical
    tessera.save(str(tmp_path / "c"), {"t": torch.tensor([1.0, 2.0, 3.0])})
    d = diff_checkpoints(str(tmp_path / "a"), str(tmp_path / "c")).tensors[0]
    assert d.mismatched == 1 and d.max_abs == float("inf")


def test_json_output_is_strict(tmp_path, capsys) -> None:
    tessera.save(str(tmp_path / "a"), {"t": torch.tensor([1.0, float("nan")])})
    tessera.save(str(tmp_path / "b"), {"t": torch.tensor([1.0, 2.0])})
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json"]) == EXIT_PROBLEMS

    def refuse(name: str) -> None:
        raise ValueError(f"non-standard JSON constant {name}")

    doc = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert doc["tensors"][0]["max_abs"] == "inf" and doc["identical"] is False


# --------------------------------------------------------------------------------------
# rename


def test_rename_prefix_and_regex(ckpts, tmp_path, capsys) -> None:
    path = _copy(ckpts["w4"], str(tmp_path / "r"))
    files_before = sorted(os.listdir(os.path.join(path, "data", tessera.read_manifest(path).save_id)))
    assert main(["rename", path, "--map", "model.=net.", "--regex", r"^optim\.(\w+)$=opt.\1", "--dry-run"]) == EXIT_OK
    assert "would rename" in capsys.readouterr().out
    assert "model.embed" in tessera.read_manifest(path).tensors  # dry run wrote nothing
    assert main(["rename", path, "--map", "model.=net.", "--regex", r"^optim\.(\w+)$=opt.\1"]) == EXIT_OK
    m = tessera.read_manifest(path)
    assert set(m.tensors) == {"net.embed", "net.proj", "net.bias", "opt.step"}
    assert sorted(os.listdir(os.path.join(path, "data", m.save_id))) == files_before
    # The renamed checkpoint loads under the new names, with the same data.
    want = _load_full(ckpts["w4"])
    got = {
        "net": {"embed": torch.zeros(13, 6), "proj": torch.zeros(7, 5, dtype=torch.bfloat16), "bias": torch.zeros(9)}
    }
    tessera.load(path, got, strict=False)
    assert torch.equal(got["net"]["embed"], want["model.embed"]) and torch.equal(got["net"]["proj"], want["model.proj"])
    assert m.metadata["tile_names"]["net.embed"] == "model.embed"
    assert main(["verify", path]) == EXIT_OK  # data files keep the old names; verify knows
    # Renaming back composes: the tile names point at the original names again.
    rename_tensors(path, [RenameRule("net.", "model.")])
    assert "tile_names" in tessera.read_manifest(path).metadata
    assert tessera.read_manifest(path).metadata["tile_names"] == {"opt.step": "optim.step"}


def test_rename_collision_is_refused(ckpts, tmp_path, capsys) -> None:
    path = _copy(ckpts["w2"], str(tmp_path / "r"))
    before = Path(path, "manifest.json").read_bytes()
    assert main(["rename", path, "--regex", r"^model\.\w+$=model.same"]) == EXIT_PROBLEMS
    assert "same name" in capsys.readouterr().err
    assert Path(path, "manifest.json").read_bytes() == before


def test_rename_usage_errors(ckpts, capsys) -> None:
    assert main(["rename", ckpts["w2"]]) == EXIT_USAGE
    assert main(["rename", ckpts["w2"], "--map", "no-equals-sign"]) == EXIT_USAGE
    assert main(["rename", ckpts["w2"], "--map", "zzz.=a."]) == EXIT_PROBLEMS  # nothing matched


# --------------------------------------------------------------------------------------
# trace


def test_trace_finds_the_slow_rank_and_writes_chrome_and_png(ckpts, tmp_path, capsys) -> None:
    chrome, png = str(tmp_path / "t.json"), str(tmp_path / "t.png")
    assert main(["trace", ckpts["w4"], "--chrome", chrome, "--png", png]) == EXIT_OK
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith(f"│    {SLOW_RANK} │"))
    assert "write" in row and "x median" in row  # the slow rank is flagged, for its write phase
    doc = json.loads(Path(chrome).read_text())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in spans} == {0, 1, 2, 3}
    assert {e["name"] for e in spans} >= {"plan", "stage", "write"}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    slow_write = next(e for e in spans if e["tid"] == SLOW_RANK and e["name"] == "write")
    assert slow_write["dur"] >= 0.4e6
    data = Path(png).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    assert main(["trace", ckpts["w4"], "--json", "--fail-on-stragglers"]) == EXIT_PROBLEMS
    doc = json.loads(capsys.readouterr().out)
    assert any(s["rank"] == SLOW_RANK and s["phase"] == "write" for s in doc["save"]["stragglers"])


def test_find_stragglers_uses_the_median() -> None:
    ts = [RankTiming(r, {"plan": 0.1, "write": w}) for r, w in enumerate([1.0, 1.1, 0.9, 3.0])]
    slow = find_stragglers(ts, factor=1.5)
    assert {(s.rank, s.phase) for s in slow} == {(3, "write"), (3, "total")}
    assert find_stragglers(ts, factor=4.0) == []


def test_trace_of_converted_checkpoint(tmp_path, capsys) -> None:
    torch.save({"w": torch.ones(3)}, str(tmp_path / "m.pt"))
    assert main(["convert", str(tmp_path / "m.pt"), str(tmp_path / "ck")]) == EXIT_OK
    assert main(["trace", str(tmp_path / "ck")]) == EXIT_USAGE  # no save timings, only convert
    assert "convert" in capsys.readouterr().err
    assert main(["trace", str(tmp_path / "ck"), "--op", "convert"]) == EXIT_OK


# --------------------------------------------------------------------------------------
# convert through the CLI, and the real entry point


def test_convert_round_trip_multi_rank_checkpoint(ckpts, tmp_path) -> None:
    src = ckpts["w4"]
    pt = str(tmp_path / "m.pt")
    assert main(["convert", src, pt, "--to", "torch"]) == EXIT_OK
    back = str(tmp_path / "back")
    assert main(["convert", pt, back]) == EXIT_OK
    report = diff_checkpoints(src, back)
    assert report.tensors == []  # every tensor equal; per-rank values are not carried by torch.save
    # tessera to tessera is a byte-for-byte, self-contained copy: everything equal, per-rank values too
    copy = str(tmp_path / "copy")
    assert main(["convert", src, copy, "--to", "tessera"]) == EXIT_OK
    same = diff_checkpoints(src, copy)
    assert same.tensors == [] and same.values == [] and tessera.verify(copy).ok
    assert main(["convert", src, str(tmp_path / "y"), "--to", "tessera", "--dtype", "bf16"]) == EXIT_USAGE
    assert main(["convert", src, str(tmp_path / "x"), "--to", "hf", "--max-shard-size", "lots"]) == EXIT_USAGE
    assert main(["convert", str(tmp_path / "nothing-here"), str(tmp_path / "x")]) == EXIT_USAGE


def test_verbs_on_a_url(tmp_path, capsys) -> None:
    """Checkpoints behind an fsspec URL (here memory://) work like local ones."""
    state = {"w": torch.arange(12.0).reshape(4, 3), "step": 4}
    tessera.save("memory://cli-url/a", state)
    assert main(["inspect", "memory://cli-url/a", "--json"]) == EXIT_OK
    assert json.loads(capsys.readouterr().out)["step"] == 4
    assert main(["verify", "memory://cli-url/a"]) == EXIT_OK
    assert main(["convert", "memory://cli-url/a", "memory://cli-url/hf", "--to", "hf"]) == EXIT_OK
    assert main(["convert", "memory://cli-url/a", str(tmp_path / "a.pt"), "--to", "torch"]) == EXIT_OK
    assert main(["convert", str(tmp_path / "a.pt"), "memory://cli-url/b"]) == EXIT_OK
    assert main(["diff", "memory://cli-url/a", "memory://cli-url/b"]) == EXIT_OK


def test_module_entry_point_and_exit_codes(ckpts, tmp_path) -> None:
    py = sys.executable
    ok = subprocess.run([py, "-m", "tessera", "verify", ckpts["w2"]], capture_output=True, text=True)
    assert ok.returncode == 0 and "OK" in ok.stdout
    bad = subprocess.run([py, "-m", "tessera.cli", "inspect"], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr
    missing = subprocess.run(
        [py, "-m", "tessera.cli", "verify", str(tmp_path / "none")], capture_output=True, text=True
    )
    assert missing.returncode == 1 and "no committed checkpoint" in missing.stdout
