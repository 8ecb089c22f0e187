"""docs/from-dcp.md's before/after scripts, run as a user runs them.

``examples/from_dcp_before.py`` checkpoints with torch's real ``dcp.async_save`` /
``dcp.load``; ``examples/from_dcp_after.py`` is the same loop on tessera. A DCP step that
the "before" script wrote converts with ``tessera convert`` and the "after" script resumes
from it on the same loss curve, from one process and (slow) from FSDP2 on 2 gloo ranks.
"""

from __future__ import annotations

import os
import re
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

    _convert(dcp_root / "step-6", tessera_root / "step-6")
    after = _run("from_dcp_after.py", tessera_root, "--steps", "9", "--save-every", "3")
    assert after == {s: before[s] for s in (7, 8, 9)}  # the same loss curve, bit for bit
    assert (tessera_root / "step-9" / "manifest.json").is_file()


@pytest.mark.slow
def test_both_scripts_resume_themselves_on_one_loss_curve(tmp_path) -> None:
    whole = _run("from_dcp_before.py", tmp_path / "ref", "--steps", "6", "--save-every", "6")
    for script in ("from_dcp_before.py", "from_dcp_after.py"):
        root = tmp_path / script
        first = _run(script, root, "--steps", "3", "--save-every", "3")
        assert first | _run(script, root, "--steps", "6", "--save-every", "3") == whole, script


@pytest.mark.slow
def test_two_rank_fsdp2_dcp_step_resumes_on_two_ranks_and_on_one(tmp_path) -> None:
    dcp_root = tmp_path / "dcp"
    before = _run("from_dcp_before.py", dcp_root, "--steps", "6", "--save-every", "6", "--nproc", "2")
    assert sorted(before) == list(range(1, 7))
    for nproc in ("2", "1"):
        root = tmp_path / f"tessera-{nproc}"
        _convert(dcp_root / "step-6", root / "step-6")
        after = _run("from_dcp_after.py", root, "--steps", "8", "--save-every", "4", "--nproc", nproc)
        assert sorted(after) == [7, 8], nproc
        if nproc == "2":
            ref = _run("from_dcp_before.py", dcp_root, "--steps", "8", "--save-every", "4", "--nproc", "2")
            assert after == pytest.approx(ref, abs=1e-6)
        else:
            assert after == pytest.approx(ref, abs=1e-5)  # another world size: another summation order
