"""Saves on preemption (issue #12 item 4), with real processes and real signals.

Ranks train on a real gloo group; the test sends SIGTERM to ONE of them mid-training. At the
next step boundary every rank must agree, write the same durable checkpoint (synchronous
even when the manager saves asynchronously), and leave its loop normally; the checkpoint
then loads bit-exact.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tessera
from tests.crash_worker import RankGroup, start_ranks

N = 60  # elements of the global tensor (divisible by 2 and 3)
MAX_STEPS = 3000  # a bound, never reached when the signal arrives


def weights_at(step: int) -> torch.Tensor:
    """The global tensor after ``step`` steps of the fake training below."""
    return torch.arange(N, dtype=torch.float32) * 0.25 + float(step)


def _train(rank: int, world: int, root: str, progress_dir: str, async_save: bool, signum: int) -> dict:
    n = N // world
    local = weights_at(0)[rank * n : (rank + 1) * n].clone()
    bias = torch.zeros(3)
    state = {"model": {"w": tessera.ShardedTensor(local, (N,), (rank * n,)), "b": bias}, "step": 0}
    progress = os.path.join(progress_dir, str(rank))
    saved: list[int] = []
    mgr = tessera.CheckpointManager(
        root,
        keep_last=2,
        async_save=async_save,
        save_policy=tessera.manager.EveryNSteps(4),
        preemption=True,
        preemption_signal=signum,
    )
    try:
        step = 0
        for step in range(1, MAX_STEPS + 1):
            local.add_(1.0)  # one "training step"
            bias.add_(float(step))
            state["step"] = step
            with open(progress, "a") as f:
                f.write(f"{step}\n")
            time.sleep(0.01)
            if mgr.should_save(step):
                pending = mgr.save(step, state)
                if async_save and not mgr.reached_preemption:
                    pending.wait_staged()  # the state changes right after
                saved.append(step)
            if mgr.reached_preemption:
                # The preemption save returned committed, even though saves are asynchronous.
                committed = mgr.latest_step()
                break
        else:
            committed = None
        return {
            "stopped_at": step,
            "preempted": mgr.reached_preemption,
            "last_saved": saved[-1] if saved else None,
            "committed_on_return": committed,
            "handler_signal": mgr._decider.preemption.received if mgr._decider.preemption else None,
        }
    finally:
        mgr.close()


def _wait_progress(group: RankGroup, path: str, at_least: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not all(p.is_alive() for p in group.procs):
            outcomes = group.collect(timeout=30)
            raise AssertionError(f"a rank ended before the signal: {[(o.status, o.value) for o in outcomes]}")
        if os.path.exists(path):
            with open(path) as f:
                lines = f.read().split()
            if len(lines) >= at_least:
                return
        time.sleep(0.01)
    raise TimeoutError(f"{path} never reached step {at_least}")


@pytest.mark.parametrize(
    "world, victim, async_save, signum",
    [
        (2, 1, False, signal.SIGTERM),
        (3, 2, True, signal.SIGTERM),
        (2, 0, True, signal.SIGUSR1),  # a chosen signal, sent to rank 0
    ],
)
def test_sigterm_to_one_rank_saves_everywhere(tmp_path, world: int, victim: int, async_save: bool, signum: int) -> None:
    root = str(tmp_path / "run")
    progress_dir = tmp_path / "progress"
    progress_dir.mkdir()
    group = start_ranks(_train, world, root, str(progress_dir), async_save, int(signum))
    _wait_progress(group, str(progress_dir / str(victim)), 9)  # past two policy saves (steps 4 and 8)
    os.kill(group.procs[victim].pid, signum)
    outcomes = group.collect(timeout=180)

    for o in outcomes:
        assert o.status == "ok", (o.rank, o.status, o.value)
        assert o.exitcode == 0, (o.rank, o.exitcode)
    values = [o.value for o in outcomes]
    stopped = {v["stopped_at"] for v in values}
    assert len(stopped) == 1, values  # every rank left at the same step boundary
    (step,) = stopped
    assert step < MAX_STEPS
    for r, v in enumerate(values):
        assert v["preempted"] is True
        assert v["last_saved"] == step == v["committed_on_return"], values
        # Only the victim saw the signal; the others joined through the agreement.
        assert v["handler_signal"] == (int(signum) if r == victim else None), values

    mgr = tessera.CheckpointManager(root)
    assert mgr.latest_step() == step and mgr.pointer_step() == step
    target = {"model": {"w": torch.zeros(N), "b": torch.zeros(3)}, "step": -1}
    loaded = mgr.load(target)
    assert loaded.step == step and target["step"] == step
    assert torch.equal(target["model"]["w"], weights_at(step))
    assert torch.equal(target["model"]["b"], torch.full((3,), float(step * (step + 1) // 2)))
    # The policy's saves before the preemption are there too (keep_last=2).
    assert len(mgr.steps()) == 2 and mgr.steps()[0] % 4 == 0


def _save_boundary_only(rank: int, world: int, root: str, progress_dir: str) -> dict:
    # A loop that never calls should_save: it saves every 5 steps itself. The agreement
    # happens inside save(), so the next save after the signal is the preemption save.
    w = torch.zeros(4)
    mgr = tessera.CheckpointManager(root, async_save=True, preemption=True)
    progress = os.path.join(progress_dir, str(rank))
    try:
        for step in range(1, MAX_STEPS + 1):
            w.add_(1.0)
            with open(progress, "a") as f:
                f.write(f"{step}\n")
            time.sleep(0.01)
            if step % 5 == 0:
                pending = mgr.save(step, {"w": w.clone(), "step": step})
                if mgr.reached_preemption:
                    return {"step": step, "committed": mgr.latest_step(), "returned": type(pending).__name__}
        return {"step": None}
    finally:
        mgr.close()


def test_preemption_at_the_save_boundary_without_should_save(tmp_path) -> None:
    root = str(tmp_path / "run")
    progress_dir = tmp_path / "progress"
    progress_dir.mkdir()
    group = start_ranks(_save_boundary_only, 2, root, str(progress_dir))
    _wait_progress(group, str(progress_dir / "1"), 7)
    os.kill(group.procs[1].pid, signal.SIGTERM)
    outcomes = group.collect(timeout=180)
    assert [o.status for o in outcomes] == ["ok", "ok"], [o.value for o in outcomes]
    (a, b) = (o.value for o in outcomes)
    assert a["step"] == b["step"] and a["step"] is not None and a["step"] % 5 == 0
    # Synchronous despite async_save=True: a SaveResult, committed when save() returned.
    assert a["returned"] == b["returned"] == "SaveResult"
    assert a["committed"] == b["committed"] == a["step"]
    target = {"w": torch.zeros(4), "step": -1}
    tessera.load(str(tmp_path / "run" / f"step-{a['step']:08d}"), target)
    assert target["step"] == a["step"] and torch.equal(target["w"], torch.full((4,), float(a["step"])))


# --------------------------------------------------------------------------------------
# Elastic restarts (issue #12 item 3): examples/elastic_train.py under the real torchrun.

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = str(REPO / "examples" / "elastic_train.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


STEPS = 20  # the job's length: past the kills at step 13 and the signal at step 7


def _torchrun(
    tmp: Path,
    name: str,
    *extra: str,
    nproc: int = 2,
    nnodes: str = "1",
    port: int | None = None,
    ckpt: str | None = None,
) -> tuple[subprocess.Popen, Path, Path]:
    """torchrun of examples/elastic_train.py: ``nnodes`` agents ("1:2": elastic, one or two
    nodes), ``nproc`` workers each, one restart allowed. A single agent started with "1:2"
    would wait ``last_call_timeout`` at every rendezvous for a second node that never comes."""
    status = tmp / f"{name}-status"
    status.mkdir()
    result = tmp / f"{name}-result.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        "--max-restarts=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port or _free_port()}",
        f"--rdzv-id={port or name}",
        # An agent that stops sending heartbeats (every keep_alive_interval seconds) is dead after
        # keep_alive_max_attempt of them: torchrun's default, 5 s x 3, made the restart on the
        # surviving node wait 10-15 s for the dead node.
        "--rdzv-conf=last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=4",
        EXAMPLE,
        "--ckpt",
        ckpt or str(tmp / f"{name}-ckpt"),
        "--steps",
        str(STEPS),
        "--save-every",
        "5",
        "--status-dir",
        str(status),
        "--result",
        str(result),
        *extra,
    ]
    # pytorch/pytorch#167288: with the agent's store shared, a restarted worker may read a dead
    # worker's address left there by the previous start; a fresh store per start avoids it.
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    # torchrun leaves its torchelastic_* log directories in the temporary directory when a
    # worker is killed: give it one under tmp_path, removed with the test's files.
    (tmp / f"{name}-tmp").mkdir(exist_ok=True)
    env["TMPDIR"] = str(tmp / f"{name}-tmp")
    log = open(tmp / f"{name}.log", "w")  # noqa: SIM115 (closed with the process below)
    proc = subprocess.Popen(cmd, cwd=str(tmp), env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.log = log  # type: ignore[attr-defined]
    return proc, status, result


def _finish(proc: subprocess.Popen, tmp: Path, name: str, timeout: float = 300) -> str:
    try:
        proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.log.close()  # type: ignore[attr-defined]
    return (tmp / f"{name}.log").read_text()


def _read_status(status: Path, rank: int) -> dict | None:
    try:
        return json.loads((status / f"{rank}.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The job of the elastic tests, never interrupted: 2 workers, STEPS steps."""
    tmp = tmp_path_factory.mktemp("reference")
    proc, _, ref_result = _torchrun(tmp, "ref")
    log = _finish(proc, tmp, "ref")
    assert proc.returncode == 0, log
    ref = json.loads(ref_result.read_text())
    assert ref["step"] == STEPS and ref["restart"] == 0 and ref["resumed_from"] is None and ref["world"] == 2
    return ref


@pytest.mark.slow
def test_elastic_restart_resumes_from_the_last_checkpoint(tmp_path, reference_run: dict) -> None:
    ref = reference_run

    # The same job; one worker is SIGKILLed mid-run, torchrun restarts both.
    proc, status, result = _torchrun(tmp_path, "killed", "--step-sleep", "0.15")
    killed_at = None
    deadline = time.monotonic() + 240
    while killed_at is None and time.monotonic() < deadline and proc.poll() is None:
        s = _read_status(status, 1)
        if s is not None and s["restart"] == 0 and s["step"] >= 13:
            os.kill(s["pid"], signal.SIGKILL)
            killed_at = s["step"]
        time.sleep(0.02)
    log = _finish(proc, tmp_path, "killed")
    assert killed_at is not None, log
    assert proc.returncode == 0, log
    out = json.loads(result.read_text())
    assert out["restart"] == 1, (out, log)  # the job was restarted once ...
    assert out["resumed_from"] is not None and 10 <= out["resumed_from"] <= killed_at, (out, killed_at, log)
    assert out["resumed_from"] % 5 == 0  # ... from the last checkpoint, not from step 0
    assert out["step"] == STEPS and out["world"] == 2
    assert out["final_loss"] == ref["final_loss"], (out, ref)  # the same loss curve, bit for bit
    assert "start 1: 2 workers, training from step" in log


@pytest.mark.slow
def test_sigterm_to_torchrun_writes_a_last_checkpoint(tmp_path) -> None:
    # What a scheduler does: SIGTERM to the launcher, which passes it on to every worker.
    proc, status, result = _torchrun(tmp_path, "pre", "--step-sleep", "0.15")
    deadline = time.monotonic() + 240
    sent_at = None
    while sent_at is None and time.monotonic() < deadline and proc.poll() is None:
        s = _read_status(status, 0)
        if s is not None and s["step"] >= 7:
            proc.send_signal(signal.SIGTERM)
            sent_at = s["step"]
        time.sleep(0.02)
    log = _finish(proc, tmp_path, "pre")
    assert sent_at is not None, log
    assert not result.exists()  # the job did not run to the end
    mgr = tessera.CheckpointManager(str(tmp_path / "pre-ckpt"))
    last = mgr.latest_step()
    # Saved at the first step boundary after the signal, not at the next multiple of 5.
    assert last is not None and sent_at <= last < STEPS, (last, sent_at, log)
    assert f"preempted: saved step {last}, exiting" in log, log
    # Both workers, not only the one that printed, left their loop at that step.
    assert [(_read_status(status, r) or {}).get("preempted_at") for r in (0, 1)] == [last, last], log


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["durable", "local"])
def test_elastic_restart_continues_on_the_surviving_node(tmp_path, reference_run: dict, tier: str) -> None:
    # Two torchrun agents on one machine are two nodes of one worker each; node B dies whole
    # (agent and worker SIGKILLed). The job restarts on node A alone, at world size 1, from
    # the last checkpoint the two workers wrote: durable ones, or (tier="local") the newest
    # step in node-local directories, node B's part from the replica node A holds, with no
    # step ever written to the durable root.
    port = _free_port()
    ckpt = str(tmp_path / "ckpt")

    def local(node: str) -> tuple[str, ...]:
        # One machine plays both nodes: "{node}" gives each its own directory (on a real
        # cluster the same /dev/shm path is node-local by itself).
        if tier == "durable":
            return ()
        return ("--local-tier", "--local-dir", str(tmp_path / "shm-{node}"), "--durable-every", "1000")

    node_a, _, result = _torchrun(
        tmp_path, "a", "--step-sleep", "0.15", *local("a"), nproc=1, nnodes="1:2", port=port, ckpt=ckpt
    )
    # Node A must host the rendezvous store (torchrun's c10d rendezvous does not survive the
    # loss of its host): start B once A listens on the endpoint.
    deadline = time.monotonic() + 120
    while True:
        assert node_a.poll() is None and time.monotonic() < deadline, _finish(node_a, tmp_path, "a")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    node_b, status_b, _ = _torchrun(
        tmp_path, "b", "--step-sleep", "0.15", *local("b"), nproc=1, nnodes="1:2", port=port, ckpt=ckpt
    )
    killed_at = None
    deadline = time.monotonic() + 240
    try:
        while killed_at is None and time.monotonic() < deadline and node_a.poll() is None:
            s = _read_status(status_b, 1)
            if s is not None and s["step"] >= 13:
                node_b.kill()
                os.kill(s["pid"], signal.SIGKILL)
                killed_at = s["step"]
            time.sleep(0.02)
    finally:
        _finish(node_b, tmp_path, "b")
    log = _finish(node_a, tmp_path, "a")
    assert killed_at is not None, log
    assert node_a.returncode == 0, log
    out = json.loads(result.read_text())
    assert out["restart"] == 1 and out["world"] == 1, (out, log)
    assert out["resumed_from"] is not None and out["resumed_from"] >= 10 and out["resumed_from"] % 5 == 0, out
    assert "start 1: 1 workers, training from step" in log
    if tier == "local":
        assert out["source"] == "local", out  # node A's directory held both workers' files
        assert not list((tmp_path / "ckpt").glob("step*")), "a local-tier run wrote a durable step"
    assert out["step"] == STEPS
    # The same global batch on one worker instead of two: the same loss up to float summation order.
    assert out["final_loss"] == pytest.approx(ref_loss := reference_run["final_loss"], rel=1e-5), (out, ref_loss)
