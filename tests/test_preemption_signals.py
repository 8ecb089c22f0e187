"""The preemption signal rule, with real processes and real signals.

Whatever mix of notices (``PreemptionHandler.trigger()``) and near-simultaneous signals
arrives, a job makes one preemption save at its next step boundary and exits normally; only
a signal that comes ``grace_s`` or more after the first signal stops it at once.
"""

from __future__ import annotations

import json
import os
import signal
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import tessera
from tests.crash_worker import start_ranks
from tests.dist_utils import ScriptProcess, start_script

REPO = Path(__file__).resolve().parents[1]

# A one-process training loop. At step 3 it reports "ready" (after a poller thread's notice,
# for mode "trigger") and waits, still before its step boundary, until the test has sent its
# signals; then it reaches the boundary, where it must save and leave the loop.
TRAINER = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    import torch
    import tessera

    root, workdir, mode = sys.argv[1:4]
    handler = tessera.manager.PreemptionHandler()
    w = torch.zeros(8)
    state = {"w": w, "step": 0}

    def touch(name):
        with open(os.path.join(workdir, name), "w"):
            pass

    def wait_for(name, timeout=60.0):
        deadline = time.monotonic() + timeout
        while not os.path.exists(os.path.join(workdir, name)):
            if time.monotonic() > deadline:
                sys.exit(f"{name} never came")
            time.sleep(0.005)

    with tessera.CheckpointManager(root, save_policy=tessera.manager.EveryNSteps(100), preemption=handler) as mgr:
        for step in range(1, 100):
            w.add_(1.0)
            state["step"] = step
            if step == 3:
                if mode == "trigger":  # a thread that polls the cloud provider's preemption notice
                    poller = threading.Thread(target=handler.trigger)
                    poller.start()
                    poller.join()
                touch("ready")
                wait_for("sent")  # the test's signals arrived (their handlers ran) by now
            if mgr.should_save(step):
                mgr.save(step, state)
            if mgr.reached_preemption:
                break
        print(json.dumps({"step": step, "steps": mgr.steps(), "received": handler.received}), flush=True)
    """
)


def _start(tmp_path: Path, mode: str, env: dict[str, str] | None = None) -> tuple[ScriptProcess, Path, Path]:
    """The trainer, in a process forked from the preloaded server (tests/dist_utils.py): a
    real process that gets real signals, without a fresh interpreter's seconds of imports."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    root = tmp_path / "run"
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    proc = start_script(
        script,
        str(root),
        str(workdir),
        mode,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})},
        logs=tmp_path,
    )
    deadline = time.monotonic() + 120
    while not (workdir / "ready").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the trainer never reached step 3"
        time.sleep(0.01)
    return proc, workdir, root


def _finish(proc: ScriptProcess) -> tuple[int | None, str, str]:
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err


def _assert_saved_step_3(root: Path) -> None:
    mgr = tessera.CheckpointManager(str(root))
    assert mgr.steps() == [3] and mgr.latest_step() == 3
    target = {"w": torch.zeros(8), "step": -1}
    assert mgr.load(target).step == 3
    assert target["step"] == 3 and torch.equal(target["w"], torch.full((8,), 3.0))


@pytest.mark.parametrize(
    "mode, signals",
    [
        ("trigger", 1),  # a poller's notice, then the scheduler's one real SIGTERM
        ("signal", 2),  # two SIGTERMs a few ms apart (Slurm signals the step, torchrun forwards it)
        ("trigger", 3),  # a notice, then three signals in a burst
    ],
)
def test_notices_and_near_simultaneous_signals_make_one_save(tmp_path: Path, mode: str, signals: int) -> None:
    proc, workdir, root = _start(tmp_path, mode)
    for i in range(signals):
        if i:
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGTERM)
    time.sleep(0.05)  # let the signal handlers run before the loop goes on
    (workdir / "sent").touch()
    rc, out, err = _finish(proc)
    assert rc == 0, (rc, out, err)
    result = json.loads(out)
    assert result == {"step": 3, "steps": [3], "received": int(signal.SIGTERM)}, (result, err)
    _assert_saved_step_3(root)


def test_a_signal_after_the_grace_period_stops_the_job(tmp_path: Path) -> None:
    # The loop is stuck before its boundary: a second SIGTERM well after the first stops it.
    proc, _, root = _start(tmp_path, "signal", env={"TESSERA_PREEMPTION_GRACE_S": "0.5"})
    os.kill(proc.pid, signal.SIGTERM)
    time.sleep(0.1)
    assert proc.poll() is None  # the first signal is only recorded
    time.sleep(0.9)
    os.kill(proc.pid, signal.SIGTERM)
    rc, out, err = _finish(proc)
    assert rc == -signal.SIGTERM, (rc, out, err)
    assert not tessera.CheckpointManager(str(root)).steps()


def test_grace_period_from_the_knob_and_argument() -> None:
    assert tessera.manager.PreemptionHandler().grace_s == 5.0
    assert tessera.manager.PreemptionHandler(grace_s=0).grace_s == 0.0
    with pytest.raises(ValueError, match="grace_s"):
        tessera.manager.PreemptionHandler(grace_s=-1)
    os.environ["TESSERA_PREEMPTION_GRACE_S"] = "2.5"
    try:
        assert tessera.manager.PreemptionHandler().grace_s == 2.5
        os.environ["TESSERA_PREEMPTION_GRACE_S"] = "soon"
        with pytest.raises(ValueError, match="TESSERA_PREEMPTION_GRACE_S"):
            tessera.manager.PreemptionHandler()
    finally:
        del os.environ["TESSERA_PREEMPTION_GRACE_S"]


# --------------------------------------------------------------------------------------
# Several ranks; signals and notices reach only some of them.

N = 60
MAX_STEPS = 3000


def _train(rank: int, world: int, root: str, workdir: str, notice_rank: int) -> dict:
    n = N // world
    local = torch.arange(N, dtype=torch.float32)[rank * n : (rank + 1) * n].clone()
    state = {"w": tessera.ShardedTensor(local, (N,), (rank * n,)), "step": 0}
    handler = tessera.manager.PreemptionHandler()
    if rank == notice_rank:

        def poll() -> None:  # a poller that sees the provider's notice, then says it told the handler
            while not os.path.exists(os.path.join(workdir, "notice")):
                time.sleep(0.005)
            handler.trigger()
            open(os.path.join(workdir, "triggered"), "w").close()

        threading.Thread(target=poll, daemon=True).start()
    mgr = tessera.CheckpointManager(
        root,
        keep_last=3,
        async_save=True,
        save_policy=tessera.manager.AnyOf(tessera.manager.EveryNSteps(4), tessera.manager.OnPreemption()),
        preemption=handler,
    )
    progress = os.path.join(workdir, str(rank))
    saved: list[int] = []
    step = 0
    try:
        for step in range(1, MAX_STEPS + 1):
            local.add_(1.0)
            state["step"] = step
            with open(progress, "a") as f:
                f.write(f"{step}\n")
            time.sleep(0.01)
            if mgr.should_save(step):
                pending = mgr.save(step, state)
                if not mgr.reached_preemption:
                    pending.wait_staged()
                saved.append(step)
            if mgr.reached_preemption:
                break
        # A real job tears down for a while before it exits; signals still arriving then
        # (the rest of a burst) must not kill it.
        time.sleep(1.0)
        return {"stopped_at": step, "saved": saved, "committed": mgr.latest_step(), "received": handler.received}
    finally:
        mgr.close()


def _wait_step(group, path: Path, at_least: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert all(p.is_alive() for p in group.procs), [(o.status, o.value) for o in group.collect(timeout=30)]
        if path.exists() and len(path.read_text().split()) >= at_least:
            return
        time.sleep(0.01)
    raise TimeoutError(f"{path} never reached step {at_least}")


@pytest.mark.parametrize(
    "signalled, notice_rank",
    [
        ((0, 2), -1),  # two of three ranks get a burst of two SIGTERMs each
        ((1, 2), 1),  # rank 1 had a notice before its SIGTERM; rank 2 gets a burst; rank 0 nothing
    ],
)
def test_signals_reaching_some_ranks_save_one_step_everywhere(
    tmp_path: Path, signalled: tuple[int, ...], notice_rank: int
) -> None:
    root = tmp_path / "run"
    workdir = tmp_path / "work"
    workdir.mkdir()
    group = start_ranks(_train, 3, str(root), str(workdir), notice_rank)
    _wait_step(group, workdir / "0", 6)
    if notice_rank >= 0:
        (workdir / "notice").touch()
        deadline = time.monotonic() + 60
        while not (workdir / "triggered").exists():
            assert time.monotonic() < deadline
            time.sleep(0.002)
    for _ in range(2):
        for r in signalled:
            os.kill(group.procs[r].pid, signal.SIGTERM)
        time.sleep(0.005)
    outcomes = group.collect(timeout=180)
    for o in outcomes:
        assert o.status == "ok" and o.exitcode == 0, (o.rank, o.status, o.exitcode, o.value)
    values = [o.value for o in outcomes]
    (step,) = {v["stopped_at"] for v in values}  # every rank left at the same boundary
    for r, v in enumerate(values):
        assert v["saved"][-1] == step == v["committed"], values
        assert v["saved"] == values[0]["saved"], values  # the same saves on every rank
        assert (v["received"] is not None) == (r in signalled or r == notice_rank), values
    mgr = tessera.CheckpointManager(str(root))
    assert mgr.latest_step() == step
    target = {"w": torch.zeros(N), "step": -1}
    assert mgr.load(target).step == step and target["step"] == step
    assert torch.equal(target["w"], torch.arange(N, dtype=torch.float32) + step)
