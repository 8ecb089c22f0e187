"""A writer process that stops answering, and arenas that must not outlive their owner.

With ``WriterMode.PROCESS``, a writer stopped with SIGSTOP (what a write stuck in the kernel
looks like to its parent) must fail the save with ``StorageError`` within
``TESSERA_WRITER_TIMEOUT_S``, on every rank, and be killed; the trainer then exits normally.
Its shared-memory arena never stays behind in ``/dev/shm``, even when the trainer is SIGKILLed
mid-save.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import tessera
from tessera import SaveOptions
from tessera.engine.saving import writer_channel, writer_process
from tessera.options import WriterMode
from tests.dist_utils import run_ranks

REPO = Path(__file__).resolve().parent.parent
PROCESS = SaveOptions(writer=WriterMode.PROCESS)

# A trainer: one save starts the writer process; it prints the writer's pid and waits for the
# test to stop that process; then it saves again (a larger state with grow=1, so that the
# save must first map a new arena into the stopped writer).
TRAINER = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    import tessera
    from tessera import SaveOptions
    from tessera.engine.saving import writer_process

    out, workdir, grow = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    opts = SaveOptions(writer="process")
    tessera.save(os.path.join(out, "a"), {"w": torch.ones(1000)}, options=opts)
    print(writer_process._writer().pid, flush=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(workdir, "stopped")) and time.monotonic() < deadline:
        time.sleep(0.01)
    state = {"w": torch.ones(300_000 if grow else 1000)}
    t0 = time.monotonic()
    pending = tessera.async_save(os.path.join(out, "b"), state, options=opts)
    result = {}
    try:
        pending.wait(timeout=0.2)  # documented: TimeoutError, the save goes on
    except TimeoutError as e:
        result["first_wait"] = type(e).__name__
    try:
        pending.wait()
        result["error"] = None
    except Exception as e:
        result["error"], result["message"] = type(e).__name__, str(e)
    result["seconds"] = time.monotonic() - t0
    print(json.dumps(result), flush=True)
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def _arenas(pid: int) -> dict[str, int]:
    """``{path as /proc shows it: bytes}`` of the arenas ``pid`` maps (a removed file ends in " (deleted)")."""
    found: dict[str, int] = {}
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            fields = line.split(None, 5)
            if len(fields) == 6 and os.path.basename(fields[5].strip()).startswith("tessera-writer-"):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                found[fields[5].strip()] = hi - lo
    return found


def _start(tmp_path: Path, grow: bool, timeout_s: str) -> tuple[subprocess.Popen, int, Path]:
    workdir = tmp_path / "work"
    workdir.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(tmp_path / "ck"), str(workdir), "1" if grow else "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=str(tmp_path),
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TESSERA_WRITER_TIMEOUT_S": timeout_s},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip().isdigit(), (line, proc.communicate())
    return proc, int(line), workdir


@pytest.mark.parametrize("grow", [False, True])
def test_a_stopped_writer_fails_the_save_in_bounded_time_and_the_trainer_exits(tmp_path: Path, grow: bool) -> None:
    proc, writer, workdir = _start(tmp_path, grow, "3")
    try:
        os.kill(writer, signal.SIGSTOP)
        (workdir / "stopped").touch()
        out, err = proc.communicate(timeout=90)  # the old code never returned from this save
    finally:
        if _alive(writer):  # first: a stopped writer holds the trainer's stdout open
            os.kill(writer, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, (proc.returncode, out, err)
    result = json.loads(out.splitlines()[-1])
    assert result["first_wait"] == "TimeoutError", result
    assert result["error"] == "StorageError", result
    assert "made no progress for 3 s" in result["message"] and "TESSERA_WRITER_TIMEOUT_S" in result["message"], result
    assert 2.5 < result["seconds"] < 40, result
    assert not _alive(writer)  # killed, although it was stopped
    assert not (tmp_path / "ck" / "b" / "manifest.json").exists()
    assert not list((tmp_path / "ck" / "b").glob("data/*/*"))  # the failed save left no data file
    assert not list(Path(writer_channel.SHM_DIR).glob(f"tessera-writer-{proc.pid}-*"))


def test_a_trainer_killed_mid_save_leaves_no_arena(tmp_path: Path) -> None:
    # The writer is stopped while the trainer maps a new, larger arena into it: the trainer is
    # SIGKILLed right there, holding that arena.
    proc, writer, workdir = _start(tmp_path, True, "600")
    try:
        os.kill(writer, signal.SIGSTOP)
        (workdir / "stopped").touch()
        deadline = time.monotonic() + 60
        arenas: dict[str, int] = {}
        while time.monotonic() < deadline and not any(n > 1_000_000 for n in arenas.values()):
            time.sleep(0.05)
            arenas = _arenas(proc.pid)
        time.sleep(0.2)  # well inside the save now: the old code waits for the writer's answer
    finally:
        proc.kill()
        proc.wait()
        os.kill(writer, signal.SIGKILL)  # an orphan, stopped: it holds the trainer's stdout open
        proc.communicate()
    assert any(n > 1_000_000 for n in arenas.values()), f"the trainer never mapped the larger arena: {arenas}"
    left = [p for p in arenas if os.path.exists(p)]
    for p in left:
        os.unlink(p)  # do not leave it behind
    assert not left, f"arena files outlived their owner: {left}"
    assert not list(Path(writer_channel.SHM_DIR).glob(f"tessera-writer-{proc.pid}-*"))


def test_arenas_of_dead_owners_are_swept_at_the_next_start(tmp_path: Path) -> None:
    writer_process.shutdown()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    shm = Path(writer_channel.SHM_DIR)
    stale = shm / f"tessera-writer-{dead.pid}-stale"
    live = shm / f"tessera-writer-{os.getppid()}-live"  # a live owner: its arena stays
    stale.write_bytes(b"\0" * 4096)
    live.write_bytes(b"\0" * 4096)
    try:
        tessera.save(str(tmp_path / "ck"), {"w": torch.ones(10)}, options=PROCESS)
        assert not stale.exists()
        assert live.exists()
    finally:
        writer_process.shutdown()
        for p in (stale, live):
            p.unlink(missing_ok=True)


def _stuck_on_rank_1(rank: int, world: int, root: str) -> tuple[str, str, float]:
    w = torch.arange(1000.0) + rank
    state = {"w": tessera.ShardedTensor(w, (2000,), (rank * 1000,))}
    try:
        tessera.save(f"{root}/a", state, options=PROCESS)
        if rank == 1:
            os.kill(writer_process._writer().pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            tessera.save(f"{root}/b", state, options=PROCESS)
        except Exception as e:
            return type(e).__name__, str(e), time.monotonic() - t0
        raise AssertionError(f"rank {rank}: the save did not fail")
    finally:
        writer_process.shutdown()


def test_a_stuck_writer_on_one_rank_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    outcomes = run_ranks(_stuck_on_rank_1, 2, str(tmp_path), timeout=120, env={"TESSERA_WRITER_TIMEOUT_S": "3"})
    for o in outcomes:
        assert o.status == "ok", (o.rank, o.status, o.value)
        kind, message, seconds = o.value
        assert kind == "StorageError", (o.rank, kind, message)
        assert "made no progress" in message, (o.rank, message)
        assert o.rank == 1 or "rank 1: StorageError" in message, (o.rank, message)  # the peer says whose writer
        assert seconds < 40, (o.rank, seconds)
    assert not (tmp_path / "b" / "manifest.json").exists()
