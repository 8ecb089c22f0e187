"""Save policies (issue #12 item 4): every N steps, every T seconds, on preemption, composed.

The pure policies are checked on contexts; :class:`SaveDecider` and
``CheckpointManager.should_save`` are checked on real gloo ranks whose injected clocks
disagree, which must still all reach the same decision.
"""

from __future__ import annotations

import os
import signal
import textwrap
from pathlib import Path

import pytest
import torch

import tessera
from tessera.manager.policies import SaveDecider
from tests.dist_utils import run_distributed, run_script

REPO = str(Path(__file__).resolve().parents[1])


def ctx(
    step: int, seconds: float = 0.0, preempted: bool = False, last: int | None = None
) -> tessera.manager.SaveContext:
    return tessera.manager.SaveContext(step, last, seconds, preempted)


def test_every_n_steps() -> None:
    p = tessera.manager.EveryNSteps(5)
    assert [s for s in range(0, 21) if p.should_save(ctx(s))] == [0, 5, 10, 15, 20]
    assert not p.uses_clock


def test_at_steps() -> None:
    p = tessera.manager.AtSteps([3, 7])
    assert [s for s in range(10) if p.should_save(ctx(s))] == [3, 7]


def test_every_n_seconds() -> None:
    p = tessera.manager.EveryNSeconds(2.5)
    assert not p.should_save(ctx(1, seconds=2.49))
    assert p.should_save(ctx(1, seconds=2.5))
    assert p.uses_clock


def test_on_preemption_and_combinators() -> None:
    assert tessera.manager.OnPreemption().should_save(ctx(7, preempted=True))
    assert not tessera.manager.OnPreemption().should_save(ctx(7))
    any_of = tessera.manager.AnyOf(
        tessera.manager.EveryNSteps(10), tessera.manager.EveryNSeconds(60), tessera.manager.OnPreemption()
    )
    assert any_of.uses_clock
    assert (
        any_of.should_save(ctx(10))
        and any_of.should_save(ctx(3, seconds=61))
        and any_of.should_save(ctx(3, preempted=True))
    )
    assert not any_of.should_save(ctx(3, seconds=1))
    all_of = tessera.manager.AllOf(tessera.manager.EveryNSteps(10), tessera.manager.EveryNSeconds(60))
    assert not all_of.should_save(ctx(10, seconds=5)) and all_of.should_save(ctx(10, seconds=60))
    assert not all_of.should_save(ctx(11, seconds=100))
    assert isinstance(any_of, tessera.manager.SavePolicy) and isinstance(
        tessera.manager.EveryNSteps(1), tessera.manager.SavePolicy
    )


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: tessera.manager.EveryNSteps(0), "n must be a positive integer, got 0"),
        (lambda: tessera.manager.EveryNSteps(2.0), "n must be a positive integer, got 2.0"),
        (lambda: tessera.manager.EveryNSteps(True), "n must be a positive integer, got True"),
        (lambda: tessera.manager.EveryNSeconds(-1), "seconds must be a positive number, got -1"),
    ],
)
def test_bad_arguments(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_not_a_policy() -> None:
    with pytest.raises(TypeError, match="is not a save policy"):
        tessera.manager.AnyOf(tessera.manager.EveryNSteps(1), 5)  # type: ignore[arg-type]
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(TypeError, match="is not a save policy"):
        tessera.CheckpointManager("/nonexistent-unused", save_policy="every 5", preemption=True)  # type: ignore[arg-type]
    assert signal.getsignal(signal.SIGTERM) == before  # a refused manager installs no handler


class FakeClock:
    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def test_decider_single_process_clock_restarts_at_each_save() -> None:
    clock = FakeClock(100.0)
    decider = SaveDecider(tessera.manager.EveryNSeconds(10), clock=clock)
    clock.now = 105.0
    assert not decider.should_save(1)
    clock.now = 110.0
    assert decider.should_save(2)
    decider.record_save(2)
    assert decider.last_saved_step == 2
    clock.now = 119.0
    assert not decider.should_save(3)
    clock.now = 120.0
    assert decider.should_save(4)


RATES = (1.0, 0.5, 2.0)  # seconds per step of each rank's clock


def _clock_at(rank: int, step: int) -> float:
    # Each rank's clock has its own offset and rate, and jumps ahead at some steps.
    return 1000.0 * rank + RATES[rank] * step + (0.7 if step % 3 == rank else 0.0)


def _clocks_disagree(rank: int, world: int) -> list[bool]:
    clock = FakeClock(_clock_at(rank, 0))
    decider = SaveDecider(
        tessera.manager.AnyOf(tessera.manager.EveryNSteps(7), tessera.manager.EveryNSeconds(3)), clock=clock
    )
    decisions = []
    for step in range(1, 15):
        clock.now = _clock_at(rank, step)
        save = decider.should_save(step)
        decisions.append(save)
        if save:
            decider.record_save(step)
    return decisions


def _model_decisions(world: int) -> list[bool]:
    """What agreement on the largest elapsed time gives, computed without any process."""
    last = [_clock_at(r, 0) for r in range(world)]
    out = []
    for step in range(1, 15):
        elapsed = max(_clock_at(r, step) - last[r] for r in range(world))
        save = step % 7 == 0 or elapsed >= 3
        out.append(save)
        if save:
            last = [_clock_at(r, step) for r in range(world)]
    return out


def test_decider_all_ranks_agree_when_clocks_disagree() -> None:
    results = run_distributed(_clocks_disagree, 3)
    assert results[0] == results[1] == results[2] == _model_decisions(3), results
    # Without agreement rank 1's slow clock (0.5 s per step) would save far less often.
    assert results[0] != [s % 7 == 0 or False for s in range(1, 15)]


def _two_clocks(rank: int, world: int) -> list[tuple[int, bool]]:
    # Rank 0's clock stands still; rank 1's advances 4 s per step. T = 10 s.
    clock = FakeClock(0.0)
    decider = SaveDecider(tessera.manager.EveryNSeconds(10), clock=clock)
    out = []
    for step in range(1, 9):
        if rank == 1:
            clock.now += 4.0
        save = decider.should_save(step)
        out.append((step, save))
        if save:
            decider.record_save(step)
    return out


def test_decider_uses_the_largest_elapsed_time() -> None:
    r0, r1 = run_distributed(_two_clocks, 2)
    # Rank 1 sees 4, 8, 12 -> save at step 3; then 4, 8, 12 again -> step 6.
    want = [(s, s in (3, 6)) for s in range(1, 9)]
    assert r0 == want and r1 == want


def _manager_every_n(rank: int, world: int, root: str) -> tuple[list[int], list[int]]:
    saved = []
    with tessera.CheckpointManager(root, save_policy=tessera.manager.EveryNSteps(3)) as mgr:
        for step in range(1, 10):
            if mgr.should_save(step):
                mgr.save(step, {"w": torch.full((4,), float(step)), "step": step})
                saved.append(step)
        return saved, mgr.steps()


def test_manager_should_save_every_n_steps(tmp_path) -> None:
    results = run_distributed(_manager_every_n, 2, str(tmp_path / "run"))
    assert results == [([3, 6, 9], [3, 6, 9])] * 2
    target = {"w": torch.zeros(4), "step": 0}
    tessera.load(str(tmp_path / "run" / "step-00000006"), target)
    assert torch.equal(target["w"], torch.full((4,), 6.0)) and target["step"] == 6


def test_manager_without_policy_never_saves_by_itself(tmp_path) -> None:
    with tessera.CheckpointManager(str(tmp_path / "run")) as mgr:
        assert not any(mgr.should_save(s) for s in range(20))
        assert not mgr.reached_preemption


def test_manager_should_save_on_preemption_single_process(tmp_path) -> None:
    before = signal.getsignal(signal.SIGUSR1)
    root = str(tmp_path / "run")
    with tessera.CheckpointManager(
        root,
        save_policy=tessera.manager.EveryNSteps(100),
        preemption=True,
        preemption_signal=signal.SIGUSR1,
        async_save=True,
    ) as mgr:
        assert not mgr.should_save(1)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert mgr.should_save(2) and mgr.reached_preemption
        mgr.save(2, {"w": torch.arange(3.0)})
        # Asynchronous by default, but the preemption save returns committed.
        assert mgr.steps() == [2]
        assert not mgr.should_save(3)  # the preemption checkpoint is written: nothing more to do
        assert mgr.reached_preemption
    assert signal.getsignal(signal.SIGUSR1) == before  # close() put the previous handler back


def test_second_signal_kills_the_process(tmp_path) -> None:
    # The first SIGTERM is recorded; one after the grace period means "stop now" and takes the
    # default action.
    code = textwrap.dedent(
        """
        import os, signal, sys, time
        from tessera.manager.preemption import PreemptionHandler
        h = PreemptionHandler(grace_s=0.2).install()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.4)
        print("received", h.received, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("survived", flush=True)
        """
    )
    script = tmp_path / "job.py"
    script.write_text(code)
    proc = run_script(script, cwd=REPO, env={**os.environ}, timeout=60)  # a forked process: real signals
    assert proc.stdout.split() == ["received", str(int(signal.SIGTERM))], proc.stdout + proc.stderr
    assert proc.returncode == -signal.SIGTERM


def test_handler_refuses_a_thread_and_an_empty_list() -> None:
    import threading

    from tessera.manager.preemption import PreemptionHandler

    with pytest.raises(ValueError, match="at least one signal"):
        PreemptionHandler([])
    errors: list[BaseException] = []

    def install() -> None:
        try:
            PreemptionHandler([signal.SIGUSR2]).install()
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=install)
    t.start()
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], ValueError) and "main thread" in str(errors[0])


def test_manager_takes_a_handler_that_code_can_trigger(tmp_path) -> None:
    import threading

    handler = tessera.manager.PreemptionHandler([signal.SIGUSR2])
    with tessera.CheckpointManager(str(tmp_path / "run"), preemption=handler) as mgr:
        assert handler.installed and not mgr.should_save(1)
        t = threading.Thread(target=handler.trigger)  # e.g. a thread polling a preemption notice
        t.start()
        t.join()
        assert mgr.should_save(2) and mgr.reached_preemption
        mgr.save(2, {"w": torch.ones(2)})
        assert mgr.steps() == [2]
    assert not handler.installed
