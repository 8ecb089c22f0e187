"""docs/from-dcp.md's before/after scripts, run as a user runs them.

``examples/from_dcp_before.py`` checkpoints with torch's real ``dcp.async_save`` /
``dcp.load`` the DCP tutorial's way (``AppState``, AdamW, a warmup-cosine scheduler's
``state_dict()``, the step); ``examples/from_dcp_after.py`` is the same loop on a tessera
``CheckpointManager``. The folder of DCP steps the "before" script wrote converts with one
``tessera convert`` into a manager root, and the "after" script resumes from it on the same
loss curve, from one process and (slow) from FSDP2 on 2 gloo ranks onto 2, 1 and 3 ranks; a
save killed on either side leaves leftovers that the conversion and the resume pass over.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from tessera.cli import main as cli_main
from tests.dist_utils import run_script

ROOT = Path(__file__).resolve().parent.parent


def _run(script: str, ckpt: Path, *args: str) -> dict[int, float]:
    """Run an example as ``python examples/<script> --ckpt ckpt *args``, in a process forked
    from the preloaded server (tests/dist_utils.py); the losses it printed, by step."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    done = run_script(ROOT / "examples" / script, "--ckpt", str(ckpt), *args, cwd=ROOT, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {int(s): float(v) for s, v in re.findall(r"^step (\d+) loss (\S+)$", done.stdout, re.M)}


def _convert(src: Path, dst: Path) -> None:
    assert cli_main(["convert", str(src), str(dst)]) == 0  # as `tessera convert SRC DST`


def test_after_script_resumes_a_dcp_step_of_the_before_script(tmp_path) -> None:
    dcp_root, tessera_root = tmp_path / "dcp", tmp_path / "tessera"
    before = _run("from_dcp_before.py", dcp_root, "--steps", "9", "--save-every", "3")
    assert sorted(before) == list(range(1, 10))
    assert (dcp_root / "step-6" / ".metadata").is_file()  # written by torch's dcp.async_save

    shutil.rmtree(dcp_root / "step-9")  # resume from step 6, as after a loss of the last steps
    _convert(dcp_root, tessera_root)  # the whole folder: a manager root, step numbers kept
    assert sorted(os.listdir(tessera_root)) == ["latest", "step-00000003", "step-00000006"]
    after = _run("from_dcp_after.py", tessera_root, "--steps", "9", "--save-every", "3")
    assert after == {s: before[s] for s in (7, 8, 9)}  # the same loss curve, bit for bit
    assert (tessera_root / "step-00000009" / "manifest.json").is_file()


def _kill_a_save(step_dir: Path, name: str) -> None:
    """What a save killed mid-way leaves: a step directory with a data file and no commit."""
    (step_dir / name).parent.mkdir(parents=True)
    (step_dir / name).write_bytes(b"\0" * 100)


def test_a_killed_save_on_either_side_is_passed_over(tmp_path) -> None:
    dcp_root, tessera_root = tmp_path / "dcp", tmp_path / "tessera"
    before = _run("from_dcp_before.py", dcp_root, "--steps", "9", "--save-every", "3")
    _kill_a_save(dcp_root / "step-12", "__0_0.distcp")  # dcp.async_save killed before .metadata
    _convert(dcp_root, tessera_root)
    assert not (tessera_root / "step-00000012").exists()
    _kill_a_save(tessera_root / "step-00000010", "data/0-0.safetensors")  # a tessera save killed
    after = _run("from_dcp_after.py", tessera_root, "--steps", "11", "--save-every", "3")
    assert sorted(after) == [10, 11] and sorted(before) == list(range(1, 10))
    assert (tessera_root / "step-00000009" / "manifest.json").is_file()
    whole = _run("from_dcp_before.py", tmp_path / "whole", "--steps", "11", "--save-every", "11")
    assert after == {s: whole[s] for s in (10, 11)}


@pytest.mark.slow
def test_both_scripts_resume_themselves_on_one_loss_curve(tmp_path) -> None:
    whole = _run("from_dcp_before.py", tmp_path / "ref", "--steps", "6", "--save-every", "6")
    for script in ("from_dcp_before.py", "from_dcp_after.py"):
        root = tmp_path / script
        first = _run(script, root, "--steps", "3", "--save-every", "3")
        assert first | _run(script, root, "--steps", "6", "--save-every", "3") == whole, script


@pytest.mark.slow
def test_two_rank_fsdp2_dcp_run_resumes_on_two_one_and_three_ranks(tmp_path) -> None:
    dcp_root = tmp_path / "dcp"
    # One uninterrupted DCP run of 8 steps: it saves steps 3 and 6 (the resume point), and its
    # losses of steps 7 and 8 are what every resume must reproduce.
    whole = _run("from_dcp_before.py", dcp_root, "--steps", "8", "--save-every", "3", "--nproc", "2")
    assert sorted(whole) == list(range(1, 9))
    assert sorted(os.listdir(dcp_root)) == ["step-3", "step-6"]
    for nproc in ("2", "1", "3"):
        root = tmp_path / f"tessera-{nproc}"
        _convert(dcp_root, root)
        after = _run("from_dcp_after.py", root, "--steps", "8", "--save-every", "4", "--nproc", nproc)
        assert sorted(after) == [7, 8], nproc
        if nproc == "2":
            assert after == {7: whole[7], 8: whole[8]}  # the same ranks: bit for bit
        else:  # another world size sums the gradients in another order
            assert after == pytest.approx({7: whole[7], 8: whole[8]}, abs=1e-6), nproc
