"""The local tier across membership changes (issue #39): a node that missed a rollback or a
resume never brings the abandoned timeline back, and a full node directory does not stop saves.

Every rank is a node of its own (``LOCAL_WORLD_SIZE=1``), each with its own directory through
``{node}``. A step's content names the timeline that saved it (``k = step + 1000 * timeline``),
and every load is compared bit for bit with the job's last save.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.crash_worker import run_ranks
from tests.local_tier_fence_worker import committed_here, fill_a_small_directory, restart, resume_and_save

ONE = {"LOCAL_WORLD_SIZE": "1"}


def _run(world: int, fn, *args) -> list[dict]:  # type: ignore[no-untyped-def]
    outcomes = run_ranks(fn, world, *args, env=ONE, timeout=180)
    bad = [o for o in outcomes if o.status != "ok"]
    assert not bad, "\n".join(f"rank {o.rank}: {o.status}: {o.value and o.value.get('traceback')}" for o in bad)
    return [o.value for o in outcomes]


def _dirs(tmp_path: os.PathLike) -> tuple[str, str]:
    return os.path.join(tmp_path, "durable"), os.path.join(tmp_path, "shm", "node-{node}")


def _saved(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert r["errors"] == {}, (rank, r["errors"])


def _abandoned_warning(results: list[dict]) -> str:
    """Rank 0's one warning about abandoned steps (no other rank says it)."""
    found = [w for w in results[0]["warnings"] if "abandoned timeline" in w]
    assert len(found) == 1, results[0]["warnings"]
    assert not any("abandoned timeline" in w for r in results[1:] for w in r["warnings"]), results
    return found[0]


# ----------------------------------------------------------------------------------------
# The rule itself (pure)


def test_the_timeline_admits_exactly_the_steps_the_job_went_on_from() -> None:
    from tessera.manager.local_tier import Timeline

    t = Timeline().fork(0)  # epoch 1: a fresh run saves 1..6
    assert all(t.admits(s, epoch=1) for s in range(1, 7))
    t = t.fork(4)  # epoch 2: resumed from 4, saved 5..7
    assert [s for s in range(1, 8) if t.admits(s, epoch=1)] == [1, 2, 3, 4]
    assert all(t.admits(s, epoch=2) for s in (5, 6, 7))
    t = t.fork(2)  # epoch 3: resumed from 2 (a second rollback), saved 3
    assert [s for s in range(1, 8) if t.admits(s, epoch=1)] == [1, 2]
    assert not any(t.admits(s, epoch=2) for s in (5, 6, 7))  # epoch 2's steps are all newer than 4 > 2
    assert t.admits(3, epoch=3) and t.admits(100, epoch=3)
    assert not t.admits(1, epoch=4)  # an epoch the root never recorded: the root was replaced
    assert Timeline.decode(t.encode()) == t
    # A resume from the newest step abandons nothing; redundant forks are folded away.
    assert Timeline().fork(0).fork(6).fork(9).forks == ((1, 0), (2, 6), (3, 9))
    assert Timeline().fork(5).fork(3).forks == ((2, 3),)


def test_a_long_run_keeps_a_bounded_record() -> None:
    from tessera.manager.local_tier import Timeline

    t = Timeline()
    for base in range(0, 10_000, 10):  # 1000 resumes, each from the newest step
        t = t.fork(base)
    assert len(t.encode()) < 8_000 and t.floor > 0
    assert t.admits(9_990, epoch=t.epoch - 1) and not t.admits(9_991, epoch=t.epoch - 1)
    assert not t.admits(1, epoch=0)  # older than the record keeps: refused, never guessed


# ----------------------------------------------------------------------------------------
# A node returns after the job went on without it


def _away_then_back(tmp_path: os.PathLike, nodes: int, variant: str) -> None:
    """``nodes`` nodes save 1..5 (every 3rd durable); the others go away and node 0 alone resumes
    from the durable step 3, its own directory lost (``"lost"``) or by ``load(step=3)``
    (``"explicit"``), and saves step 4; then every node restarts."""
    root, local_dir = _dirs(tmp_path)
    _saved(_run(nodes, resume_and_save, root, local_dir, 3, None, [(s, s) for s in range(1, 6)]))
    assert committed_here(local_dir, 1) == [4, 5]
    if variant == "lost":
        shutil.rmtree(local_dir.format(node=0))
    alone = _run(1, resume_and_save, root, local_dir, 3, "newest" if variant == "lost" else 3, [(4, 1004)])
    _saved(alone)
    assert alone[0]["loaded"] == (3, 3, "durable"), alone
    got = _run(nodes, restart, root, local_dir, 3)
    assert [(g["step"], g["k"]) for g in got] == [(4, 1004)] * nodes, got  # the job's last save, bit for bit
    assert got[0]["steps"] == [3, 4] and all(g["steps"] == [3] for g in got[1:]), got  # never 5, never the old 4
    warning = _abandoned_warning(got)
    for node in range(1, nodes):
        assert f"step 5 on node {node}" in warning and f"step 4 on node {node}" in warning, warning
        assert got[node]["committed"] == [4], got[node]  # the old 4 and 5 are gone; the new 4 was fetched
    assert "node 0" not in warning, warning


@pytest.mark.parametrize("variant", ["lost", "explicit"])
def test_a_node_that_missed_a_resume_does_not_bring_its_newer_steps_back(tmp_path: os.PathLike, variant: str) -> None:
    _away_then_back(tmp_path, 2, variant)


@pytest.mark.parametrize("variant", ["lost", "explicit"])
def test_two_nodes_that_missed_a_resume_do_not_bring_their_newer_steps_back(
    tmp_path: os.PathLike, variant: str
) -> None:
    """3 nodes, 2 away: between them the two hold every file of step 5 (own files and replicas)."""
    _away_then_back(tmp_path, 3, variant)


def test_a_node_that_returns_after_two_rollbacks(tmp_path: os.PathLike) -> None:
    """Steps 1..6 (every 2nd durable); rollback 1 on both nodes to 4, then 5..7; node 1 goes away;
    rollback 2 on node 0 alone to 4 again, then 5. Node 1 returns holding 6 and 7 of the first
    rollback's timeline: 5 of the second loads everywhere."""
    root, local_dir = _dirs(tmp_path)
    _saved(_run(2, resume_and_save, root, local_dir, 2, None, [(s, s) for s in range(1, 7)]))
    first = _run(2, resume_and_save, root, local_dir, 2, 4, [(5, 1005), (6, 1006), (7, 1007)])
    _saved(first)
    assert [f["loaded"] for f in first] == [(4, 4, "durable")] * 2, first
    assert committed_here(local_dir, 1) == [6, 7]
    second = _run(1, resume_and_save, root, local_dir, 2, 4, [(5, 2005)])
    _saved(second)
    assert second[0]["loaded"] == (4, 4, "durable"), second
    got = _run(2, restart, root, local_dir, 2)
    assert [(g["step"], g["k"]) for g in got] == [(5, 2005)] * 2, got
    warning = _abandoned_warning(got)
    assert "step 6 on node 1" in warning and "step 7 on node 1" in warning, warning
    assert committed_here(local_dir, 1) == [5]
    durable = sorted(n for n in os.listdir(root) if n.startswith("step-"))
    assert durable == ["step-00000002", "step-00000004"], durable  # the second rollback deleted 6 (1006)


def test_a_node_that_returns_from_before_the_root_was_recreated(tmp_path: os.PathLike) -> None:
    """3 nodes save 1..5; node 2 goes away with its directory, the durable root is deleted and a
    new run on nodes 0 and 1 saves 1..5 into a new root of the same name; node 1 goes away too and
    node 0 alone rolls back to 3 and saves 4. Both return: node 2's steps are another root's,
    node 1's an abandoned timeline's; step 4 of the last timeline loads everywhere."""
    root, local_dir = _dirs(tmp_path)
    _saved(_run(3, resume_and_save, root, local_dir, 3, None, [(s, s) for s in range(1, 6)]))
    shutil.rmtree(root)
    new = _run(2, resume_and_save, root, local_dir, 3, "newest", [(s, 1000 + s) for s in range(1, 6)])
    _saved(new)
    assert [n["loaded"] for n in new] == [None, None], new
    assert committed_here(local_dir, 2) == [4, 5]  # from before the deletion
    _saved(_run(1, resume_and_save, root, local_dir, 3, 3, [(4, 2004)]))
    got = _run(3, restart, root, local_dir, 3)
    assert [(g["step"], g["k"]) for g in got] == [(4, 2004)] * 3, got
    assert all(g["steps"] == [3] for g in got[1:]), got
    warning = _abandoned_warning(got)
    assert "step 5 on node 1" in warning and "node 2" not in warning, warning
    (stale,) = [w for w in got[0]["warnings"] if "another root id" in w]
    assert "node 2: steps 4, 5" in stale, stale


# ----------------------------------------------------------------------------------------
# A node directory with room for exactly local_keep_last steps


MiB = 1 << 20


@pytest.fixture
def small_node_dirs(tmp_path: os.PathLike):  # type: ignore[no-untyped-def]
    """``shm/node-0`` and ``shm/node-1`` with room for two steps of ``fill_a_small_directory``
    (4 MiB per rank, plus the other node's replica), not three: each a 20 MiB tmpfs where
    mounting is allowed (root), else a directory its rank limits to 20 MiB (``limit_directory``).
    Yields the ``local_dir`` template and the limit the ranks set (None on tmpfs)."""
    mounts = [os.path.join(tmp_path, "shm", f"node-{n}") for n in (0, 1)]
    mounted = []
    use_tmpfs = os.environ.get("TESSERA_TEST_NO_TMPFS") != "1"  # to exercise the fallback
    try:
        for m in mounts:
            os.makedirs(m)
            cmd = ["mount", "-t", "tmpfs", "-o", f"size={20 * MiB}", "tmpfs", m]
            if use_tmpfs and subprocess.run(cmd, capture_output=True).returncode == 0:
                mounted.append(m)
        template = os.path.join(tmp_path, "shm", "node-{node}")
        yield template, (None if len(mounted) == len(mounts) else 20 * MiB)
    finally:
        for m in mounted:
            subprocess.run(["umount", "-l", m], check=False)


def test_a_node_directory_with_room_for_local_keep_last_steps_keeps_saving(
    tmp_path: os.PathLike, small_node_dirs: tuple[str, int | None]
) -> None:
    """2 steps fill each node directory; 10 more save (locally, replicated, every 5th durable):
    before each, the older local step goes to make room, the newest committed one stays."""
    root = os.path.join(tmp_path, "durable")
    local_dir, limit = small_node_dirs
    got = _run(2, fill_a_small_directory, root, local_dir, 12, limit)
    for rank, g in enumerate(got):
        assert g["errors"] == {}, (rank, g["errors"])
        assert g["committed"] == [11, 12], (rank, g["committed"])
        assert (g["step"], g["exact"]) == (12, True), (rank, g)
        assert g["durable"] == [5, 10], (rank, g["durable"])
