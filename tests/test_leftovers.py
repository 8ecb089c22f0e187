"""The session-level leftover check of tests/conftest.py, run on an inner pytest session."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tessera.storage.host_memory import default_memory_root
from tests.dist_utils import run_script

REPO = Path(__file__).resolve().parent.parent

LEAKY = """
import tempfile

import torch

import tessera


def test_clean(tmp_path):
    with tessera.CheckpointManager("tier::" + str(tmp_path / "run")) as manager:  # cleaned for it
        manager.save(1, {"w": torch.ones(2)})


def test_leaks_a_temporary_directory():
    tempfile.mkdtemp(prefix="forgotten-")


def test_leaks_host_memory_steps(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("elsewhere") / "run")
    with tessera.CheckpointManager("tier::" + root) as manager:
        manager.save(1, {"w": torch.ones(2)})
"""


def _session(tmp_path: Path, body: str, *extra: str) -> subprocess.CompletedProcess[str]:
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(REPO / "tests" / "conftest.py", work / "conftest.py")  # imports tests.leftovers from REPO
    (work / "test_inner.py").write_text(body)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("TESSERA_LEFTOVER_CHECK", None)
    # python -m pytest, in a process forked from the preloaded server (tests/dist_utils.py).
    args = ["-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "base"), *extra]
    script = tmp_path / "run_pytest.py"
    script.write_text(f"import sys\nimport pytest\n\nsys.exit(pytest.main({args!r}))\n")
    return run_script(script, cwd=work, env=env, timeout=300)


@pytest.mark.parametrize("workers", [0, 2], ids=["serial", "xdist"])
def test_a_session_that_leaves_files_fails_and_names_them(tmp_path: Path, workers: int) -> None:
    before = set(os.listdir(os.environ.get("TMPDIR") or "/tmp"))
    # Under pytest-xdist each worker checks its own tests and the controller reports them all.
    proc = _session(tmp_path, LEAKY, *(["-n", str(workers)] if workers else []))
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    assert "3 passed" in out and "leftovers: this session left these behind" in out
    lines = out[out.index("leftovers:") :].splitlines()[1:]
    tmp_line = next(line for line in lines if "/forgotten-" in line)
    assert tmp_line.endswith("<- test_inner.py::test_leaks_a_temporary_directory")
    shm_line = next(line for line in lines if "elsewhere" in line)
    assert "host-memory checkpoint steps" in shm_line and shm_line.endswith("test_leaks_host_memory_steps")
    assert not any("test_clean" in line for line in lines)
    # The inner session removed what was its own: its private temporary directory and the
    # host-memory steps of its basetemp.
    assert set(os.listdir(os.environ.get("TMPDIR") or "/tmp")) == before
    assert not os.path.exists(default_memory_root(str(tmp_path / "base")))


def test_a_clean_session_passes(tmp_path: Path) -> None:
    proc = _session(tmp_path, LEAKY.split("def test_leaks_a_temporary_directory")[0])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "leftovers" not in proc.stdout
