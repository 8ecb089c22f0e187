"""Crash safety: savers are SIGKILLed at chosen phases and at random moments.

After every kill the checkpoint must hold the complete old or the complete new state: the
manifest verifies, the last committed iteration loads bit-exactly, an uncommitted one never
loads, and the next save cleans up what the dead one left. Savers are short processes
forked from a preloaded server (``tests.crash_worker``) that save a few MB in a loop and
log ``begin k`` / ``done k``; a state is a pure function of ``k``, so any mix of two saves
shows up as a mismatch.
"""

from __future__ import annotations

import os
import random
import signal
import time
import warnings

import pytest

import tessera
from tessera.format.manifest import MANIFEST_NAME
from tessera.manager import CheckpointManager, parse_step_dirname
from tessera.tools.verification import verify
from tests.crash_worker import (
    RankGroup,
    check_state,
    empty_state,
    make_state,
    rank_save_loop,
    read_progress,
    save_loop,
    start,
    start_ranks,
    wait_for_line,
)

KILLED = -signal.SIGKILL
NO_TIMINGS = tessera.LoadOptions(record_timings=False)


def _run_to_death(target: str, progress: str, mode: str, crash: dict, first: int, **manager_kwargs: object) -> None:
    proc = start(save_loop, target, progress, mode, crash, first, 1, manager_kwargs)
    proc.join(120)
    assert proc.exitcode == KILLED, f"the saver should have been killed at {crash}, exit code {proc.exitcode}"


def _load_path(path: str) -> int:
    state = empty_state()
    tessera.load(path, state, options=NO_TIMINGS)
    return check_state(state)


def _no_leftovers(path: str) -> None:
    m = tessera.read_manifest(path)
    report = verify(path)
    assert report.ok and report.unreferenced_files == (), report.summary()
    names = os.listdir(path)
    assert not [n for n in names if n.startswith(MANIFEST_NAME + ".tmp")], names
    assert sorted(os.listdir(os.path.join(path, "data"))) == [m.save_id]


# --------------------------------------------------------------------------------------
# tessera.save over an existing checkpoint, killed at each phase


@pytest.mark.parametrize(
    ("crash", "survivor"),
    [
        ({"at": "write_file", "after_bytes": 300_000}, 1),  # half-written data file
        ({"at": "write_atomic", "name": MANIFEST_NAME}, 1),  # all data durable, no commit yet
        ({"at": "after_atomic", "name": MANIFEST_NAME}, 2),  # committed, old files not yet removed
        ({"at": "delete"}, 2),  # committed, killed while removing the old files
    ],
    ids=["mid-data", "before-commit", "after-commit", "mid-cleanup"],
)
def test_save_killed_at_each_phase(tmp_path, crash: dict, survivor: int) -> None:
    path = str(tmp_path / "ckpt")
    tessera.save(path, make_state(1))
    _run_to_death(path, str(tmp_path / "progress"), "path", crash, first=2)
    assert verify(path).ok
    assert _load_path(path) == survivor
    tessera.save(path, make_state(3))  # the next save removes whatever the dead one left
    assert _load_path(path) == 3
    _no_leftovers(path)


def test_first_save_killed_before_commit_leaves_nothing_loadable(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    _run_to_death(path, str(tmp_path / "progress"), "path", {"at": "write_atomic", "name": MANIFEST_NAME}, first=1)
    assert os.path.isdir(os.path.join(path, "data"))  # the data is all there...
    with pytest.raises(tessera.CheckpointNotFoundError):  # ...but it was never committed
        tessera.load(path, empty_state(), options=NO_TIMINGS)
    assert not verify(path).ok


# --------------------------------------------------------------------------------------
# CheckpointManager, killed at each phase


def _manager_check(root: str) -> tuple[int, list[int], int | None]:
    """Every committed step verifies; resume; return (loaded step, steps, pointer)."""
    mgr = CheckpointManager(root)
    steps = mgr.steps()
    for s in steps:
        report = verify(mgr.step_url(s))
        assert report.ok, report.summary()
    pointer = mgr.pointer_step()
    assert pointer is None or pointer in steps, f"latest names step {pointer}, which is not committed ({steps})"
    state = empty_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = mgr.load(state)
    assert check_state(state) == loaded.step
    return loaded.step, steps, pointer


@pytest.mark.parametrize(
    ("crash", "expect"),
    [
        ({"at": "write_file", "after_bytes": 300_000}, (1, [1], 1)),
        ({"at": "write_atomic", "name": MANIFEST_NAME}, (1, [1], 1)),
        ({"at": "write_atomic", "name": "latest"}, (2, [1, 2], 1)),  # committed; the pointer lags
        ({"at": "delete", "match": "step-00000001/data"}, (2, [2], 2)),  # retention cut short
    ],
    ids=["mid-data", "before-commit", "before-pointer", "mid-retention"],
)
def test_manager_killed_at_each_phase(tmp_path, crash: dict, expect: tuple) -> None:
    root = str(tmp_path / "run")
    with CheckpointManager(root, keep_last=1) as mgr:
        mgr.save(1, make_state(1))
    _run_to_death(root, str(tmp_path / "progress"), "manager", crash, first=2, keep_last=1)
    assert _manager_check(root) == expect
    if crash["at"] == "delete":
        # Step 1 lost its manifest first: it is incomplete, never a committed step without data.
        assert os.path.isdir(os.path.join(root, "step-00000001", "data"))
        assert not os.path.exists(os.path.join(root, "step-00000001", MANIFEST_NAME))
    with CheckpointManager(root, keep_last=1) as mgr:
        mgr.save(3, make_state(3))
    assert _manager_check(root) == (3, [3], 3)
    leftovers = sorted(n for n in os.listdir(root) if n != "latest")
    assert leftovers == ["step-00000003"], leftovers


# --------------------------------------------------------------------------------------
# Random kills


def _check_path_after_kill(path: str, progress: str) -> str:
    begun, done = read_progress(progress)
    if not os.path.exists(os.path.join(path, MANIFEST_NAME)):
        assert done == 0, f"iteration {done} was committed but no manifest is left"
        with pytest.raises(tessera.CheckpointNotFoundError):
            tessera.load(path, empty_state(), options=NO_TIMINGS)
        return "nothing committed"
    report = verify(path)
    assert report.ok, report.summary()
    k = _load_path(path)
    assert done <= k <= begun, f"loaded iteration {k}, but {done} was the last committed and {begun} the last begun"
    return "new" if k > done else "old" if begun > done else "idle"


def _check_manager_after_kill(root: str, progress: str, pointer_done: int | None = None) -> str:
    """``pointer_done``: the last step whose save returned on rank 0, the rank that moves
    ``latest`` (default: the progress file's). Other ranks' saves return at the commit,
    before rank 0 moves the pointer, so only rank 0's progress bounds it."""
    begun, done = read_progress(progress)
    if not CheckpointManager(root).steps():
        assert done == 0, f"step {done} was committed but no step is left"
        return "nothing committed"
    k, steps, pointer = _manager_check(root)
    assert done <= k <= begun, f"resumed from step {k}; {done} was the last committed, {begun} the last begun"
    pointer_done = done if pointer_done is None else pointer_done
    if pointer_done:
        assert pointer is not None and pointer >= pointer_done, (
            f"latest names {pointer} after step {pointer_done} returned on rank 0"
        )
    recent = [s for s in steps if s % 5]
    assert len(recent) <= 3, f"retention (keep_last=2, keep_every=5) left {steps}"
    # A fresh manager resumes and its first save clears the dead save's leftovers.
    with CheckpointManager(root, keep_last=2, keep_every=5) as mgr:
        mgr.save(begun + 1, make_state(begun + 1))
    for name in os.listdir(root):
        step = parse_step_dirname(name)
        # Empty directories of a save killed before its first byte are invisible to the
        # storage interface (it lists files); any step with files must be committed.
        files = [f for _, _, fs in os.walk(os.path.join(root, name)) for f in fs]
        if step is not None and files:
            assert os.path.exists(os.path.join(root, name, MANIFEST_NAME)), f"{name} left incomplete: {files}"
    return "new" if k > done else "old" if begun > done else "idle"


def _trials(tmp_path, mode: str, n: int, seed: int, max_delay: float) -> dict[str, int]:
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    for trial in range(n):
        target = str(tmp_path / f"{mode}-{trial}")
        progress = str(tmp_path / f"{mode}-{trial}.progress")
        proc = start(save_loop, target, progress, mode)
        wait_for_line(progress, "ready")
        proc.join(rng.uniform(0.0, max_delay))
        proc.kill()
        proc.join()
        assert proc.exitcode == KILLED, f"trial {trial}: the saver ended by itself ({proc.exitcode})"
        check = _check_path_after_kill if mode == "path" else _check_manager_after_kill
        what = check(target, progress)
        outcomes[what] = outcomes.get(what, 0) + 1
    return outcomes


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "n"), [("path", 12), ("manager", 8), ("manager_async", 8)])
def test_random_kills(tmp_path, mode: str, n: int) -> None:
    outcomes = _trials(tmp_path, mode, n, seed=hash(mode) % 1000, max_delay=1.2)
    print(f"{mode}: {outcomes}")
    assert sum(outcomes.values()) == n


def test_random_kills_quick(tmp_path) -> None:
    path = _trials(tmp_path, "path", 3, seed=7, max_delay=0.6)
    manager = _trials(tmp_path, "manager_async", 2, seed=8, max_delay=0.6)
    assert sum(path.values()) == 3 and sum(manager.values()) == 2


# --------------------------------------------------------------------------------------
# Two ranks: one is killed mid-save


TWO_RANK_TIMEOUT_S = 10


def _start_two_savers(target: str, progress_dir: str, mode: str, *args: object) -> RankGroup:
    """:func:`rank_save_loop` on 2 ranks (``args``: its ``first``, ``crash``, ``crash_rank``),
    with a short collective timeout so that the survivor of a kill fails quickly."""
    os.makedirs(progress_dir)
    env = {"TESSERA_TIMEOUT_S": str(TWO_RANK_TIMEOUT_S)}
    return start_ranks(rank_save_loop, 2, target, progress_dir, mode, *args, env=env)


def _two_rank_trial(tmp_path, trial: int, rng: random.Random, mode: str) -> str:
    target = str(tmp_path / f"{mode}-{trial}")
    progress_dir = str(tmp_path / f"{mode}-{trial}.progress")
    timeout = TWO_RANK_TIMEOUT_S
    group = _start_two_savers(target, progress_dir, mode)
    for r in range(2):
        wait_for_line(os.path.join(progress_dir, str(r)), "ready")
    victim = rng.randrange(2)
    group.procs[victim].join(rng.uniform(0.0, 1.5))
    group.kill(victim)
    out = group.collect(timeout + 20)
    survivor = out[1 - victim]
    assert out[victim].status == "died"
    assert survivor.status == "error", f"rank {survivor.rank} should fail when rank {victim} dies: {survivor}"
    assert survivor.error_is("DistributedError"), survivor.value["traceback"]
    progress = [read_progress(os.path.join(progress_dir, str(r))) for r in range(2)]
    begun = max(p[0] for p in progress)
    done = max(p[1] for p in progress)
    merged = os.path.join(progress_dir, "merged")
    with open(merged, "w") as f:
        f.write(f"begin {begun}\ndone {done}\n")
    if mode == "path":
        return _check_path_after_kill(target, merged)
    return _check_manager_after_kill(target, merged, pointer_done=progress[0][1])


@pytest.mark.parametrize(
    "crash",
    [{"at": "after_atomic", "name": MANIFEST_NAME}, {"at": "delete"}],
    ids=["after-publish", "mid-cleanup"],
)
def test_rank_0_killed_after_it_committed_leaves_the_commit_intact(tmp_path, crash: dict) -> None:
    # Rank 1 only learns that the exchange failed, not whether rank 0 published first: it
    # must not remove its files, which the committed manifest names (CI run of stop 19).
    target = str(tmp_path / "ckpt")
    tessera.save(target, make_state(1))
    group = _start_two_savers(target, str(tmp_path / "progress"), "path", 2, crash, 0)
    out = group.collect(TWO_RANK_TIMEOUT_S + 30)
    assert out[0].status == "died", out[0]
    assert out[1].status == "error" and out[1].error_is("DistributedError"), out[1]
    report = verify(target)
    assert report.ok, report.summary()
    assert _load_path(target) == 2  # rank 0 published step 2 before it died
    tessera.save(target, make_state(3))  # the next save removes what the dead one left
    assert _load_path(target) == 3
    _no_leftovers(target)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["path", "manager_async"])
def test_two_ranks_one_killed_mid_save(tmp_path, mode: str) -> None:
    rng = random.Random(11 if mode == "path" else 12)
    outcomes: dict[str, int] = {}
    for trial in range(4):
        what = _two_rank_trial(tmp_path, trial, rng, mode)
        outcomes[what] = outcomes.get(what, 0) + 1
    print(f"two ranks, {mode}: {outcomes}")


# --------------------------------------------------------------------------------------
# Two independent writers on one path, overlapping, killed at random (issue #10, item 2)


def _read_lost(progress: str) -> int:
    with open(progress) as f:
        return sum(1 for line in f if line.startswith("lost "))


def _contended_trial(tmp_path, trial: int, rng: random.Random, run_s: float) -> tuple[int, int]:
    path = str(tmp_path / f"contended-{trial}")
    firsts = (1000, 2000)
    progress = [str(tmp_path / f"contended-{trial}.{w}") for w in range(2)]
    procs = [start(save_loop, path, progress[w], "contended", None, firsts[w]) for w in range(2)]
    for p in progress:
        wait_for_line(p, "ready")
    procs[0].join(run_s)
    victims = list(range(2))
    rng.shuffle(victims)
    for w in victims:  # one after the other, at different moments
        procs[w].kill()
        procs[w].join()
        assert procs[w].exitcode == KILLED, f"writer {w} ended by itself ({procs[w].exitcode})"
        procs[1 - w].join(rng.uniform(0.0, 0.3))
    ranges = [(firsts[w], read_progress(progress[w])[0]) for w in range(2)]
    if os.path.exists(os.path.join(path, MANIFEST_NAME)):
        report = verify(path)
        assert report.ok, report.summary()
        k = _load_path(path)  # complete, bit-exact: one writer's whole state, never a mix
        assert any(lo <= k <= hi for lo, hi in ranges), f"loaded {k}, begun ranges {ranges}"
    else:
        assert all(read_progress(p)[1] == 0 for p in progress), "a save returned but nothing is committed"
    tessera.save(path, make_state(3))  # the path is usable again, and cleaned
    assert _load_path(path) == 3
    _no_leftovers(path)
    assert not os.path.exists(os.path.join(path, ".tessera-saves"))
    return sum(read_progress(p)[1] > 0 for p in progress), sum(_read_lost(p) for p in progress)


def test_two_writers_one_path_quick(tmp_path) -> None:
    rng = random.Random(31)
    for trial in range(2):
        _contended_trial(tmp_path, trial, rng, run_s=2.0)


@pytest.mark.slow
def test_two_writers_one_path_killed_at_random(tmp_path) -> None:
    rng = random.Random(32)
    lost = 0
    for trial in range(8):
        lost += _contended_trial(tmp_path, trial, rng, run_s=rng.uniform(0.5, 3.0))[1]
    print(f"two writers: {lost} saves fenced off")


def _check_rank_state(path: str, ranges: list[tuple[int, int]]) -> int:
    state = empty_state()
    tessera.load(path, state, options=NO_TIMINGS)
    k = check_state(state)  # the whole state of one iteration of one group, never a mix
    assert any(lo <= k <= hi for lo, hi in ranges), f"loaded {k}, begun ranges {ranges}"
    return k


@pytest.mark.slow
def test_two_process_groups_one_path(tmp_path) -> None:
    """Two independent 2-rank jobs (a zombie and its replacement) save to one path at once."""
    rng = random.Random(41)
    for trial in range(3):
        path = str(tmp_path / f"groups-{trial}")
        dirs = [str(tmp_path / f"groups-{trial}.{g}") for g in range(2)]
        for d in dirs:
            os.makedirs(d)
        groups = [
            start_ranks(rank_save_loop, 2, path, dirs[g], "contended", 1000 * (g + 1), env={"TESSERA_TIMEOUT_S": "30"})
            for g in range(2)
        ]
        for d in dirs:
            for r in range(2):
                wait_for_line(os.path.join(d, str(r)), "ready")
        groups[0].procs[0].join(rng.uniform(1.0, 3.0))
        for g in groups:
            for r in range(2):
                g.kill(r)
        for g in groups:
            out = g.collect(30)
            assert all(o.status == "died" for o in out), [o.value for o in out if o.status == "error"]
        ranges = [
            (1000 * (g + 1), max(read_progress(os.path.join(dirs[g], str(r)))[0] for r in range(2))) for g in range(2)
        ]
        if os.path.exists(os.path.join(path, MANIFEST_NAME)):
            assert verify(path).ok, verify(path).summary()
            _check_rank_state(path, ranges)
        lost = sum(_read_lost(os.path.join(d, "0")) for d in dirs)
        done = [read_progress(os.path.join(d, "0"))[1] for d in dirs]
        print(f"trial {trial}: last done per group {done}, {lost} saves fenced off")
        tessera.save(path, make_state(3))
        assert _load_path(path) == 3
        _no_leftovers(path)


def test_a_report_group_leader_killed_at_random_never_breaks_the_path(tmp_path) -> None:
    """Four ranks in report groups of 2 ({0, 1} and {2, 3}, ``TESSERA_REPORT_GROUP=2``): rank 2, the
    leader of the second group, is killed at random moments of a save loop (before, during or after
    the vote, while it combines its group's reports). The survivors fail; what the path holds
    verifies and loads the last committed or the last begun iteration."""
    rng = random.Random(21)
    outcomes = []
    for trial in range(3):
        target = str(tmp_path / f"t{trial}")
        progress_dir = str(tmp_path / f"t{trial}.progress")
        os.makedirs(progress_dir)
        env = {"TESSERA_TIMEOUT_S": str(TWO_RANK_TIMEOUT_S), "TESSERA_REPORT_GROUP": "2"}
        group = start_ranks(rank_save_loop, 4, target, progress_dir, "path", env=env)
        for r in range(4):
            wait_for_line(os.path.join(progress_dir, str(r)), "ready")
        # The first save committed (through the groups) before the kill, however loaded the machine.
        deadline = time.monotonic() + 60
        while read_progress(os.path.join(progress_dir, "0"))[1] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        group.procs[2].join(rng.uniform(0.0, 1.5))
        group.kill(2)
        out = group.collect(TWO_RANK_TIMEOUT_S + 20)
        assert out[2].status == "died", out[2].value
        for survivor in (out[0], out[1], out[3]):
            assert survivor.status == "error" and survivor.error_is("DistributedError"), survivor
        progress = [read_progress(os.path.join(progress_dir, str(r))) for r in range(4)]
        merged = os.path.join(progress_dir, "merged")
        with open(merged, "w") as f:
            f.write(f"begin {max(p[0] for p in progress)}\ndone {max(p[1] for p in progress)}\n")
        outcomes.append(_check_path_after_kill(target, merged))
    assert "nothing committed" not in outcomes, outcomes  # each trial committed through the groups
