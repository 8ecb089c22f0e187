"""The replicated local tier of CheckpointManager (issue #12): placement, inventory, recovery.

Nodes are simulated on one machine: 4 real gloo processes with ``LOCAL_WORLD_SIZE=2`` are 2
nodes x 2 ranks, each node with its own ``local_dir`` through ``{node}``.
"""

from __future__ import annotations

import os
import pickle
import shutil
import time

import pytest

from tessera.manager import CheckpointManager
from tessera.manager.identity import ROOT_ID_NAME
from tessera.manager.local_tier import NodeInventory, StepHolding, choose_step, node_index, place
from tessera.manager.local_tier.fetches import choose_fetches, choose_manifest_fetches
from tessera.manager.local_tier.inventory import MARKER_NAME
from tessera.manager.local_tier.timeline import TIMELINE_NAME
from tessera.manager.local_tier.transfer import Transfer
from tessera.tools.verification import verify
from tests.crash_worker import check_state, empty_state, run_ranks, start_ranks
from tests.local_tier_worker import (
    durable_copy_dies_after_publish,
    fsdp2_load_and_check,
    fsdp2_save_then_die,
    load_and_check,
    load_or_error,
    load_save_on,
    recover_and_kill,
    replica_space_runs_out,
    resume_idiom,
    rollback_then_save,
    save_and_kill_at,
    save_steps,
    save_then_die,
    save_then_die_mid_save,
    transfer_files,
)

ENV = {"LOCAL_WORLD_SIZE": "2"}


# ----------------------------------------------------------------------------------------
# Placement and the choice of step (pure)


def test_node_index_from_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GROUP_RANK", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "17")
    assert node_index() == 2
    assert node_index(rank=8) == 1
    monkeypatch.setenv("GROUP_RANK", "5")
    assert node_index() == 5


def test_ring_placement_puts_copies_on_other_nodes() -> None:
    p = place([0, 0, 1, 1, 2, 2], 2)
    assert p.targets == ((2, 4), (3, 5), (4, 0), (5, 1), (0, 2), (1, 3))
    for rank, targets in enumerate(p.targets):
        nodes = {p.node_of[rank]} | {p.node_of[t] for t in targets}
        assert len(nodes) == 1 + len(targets)  # no two copies of a rank's files on one node
    # More replicas than other nodes: one copy per other node, never two on one node.
    assert place([0, 0, 1, 1], 3).targets == ((2,), (3,), (0,), (1,))
    assert place([0, 0], 1).targets == ((), ())
    # Uneven nodes (a node lost a rank): targets wrap within the smaller node.
    assert place([0, 0, 1], 1).targets == ((2,), (2,), (0,))


def _holding(step: int, n_files: int, held: set[int], save_id: str = "s") -> StepHolding:
    return StepHolding(step, save_id, n_files, frozenset(held), 100)


def _files(n: int, save_id: str = "s") -> list[tuple[str, int]]:
    return [(f"data/{save_id}/{i}.safetensors", 10) for i in range(n)]


def test_choose_step_newest_complete() -> None:
    a = NodeInventory(0, (_holding(5, 4, {0, 1}), _holding(4, 4, {0, 1, 2, 3})))
    b = NodeInventory(1, (_holding(5, 4, {2}),))
    assert choose_step([a, b]) == (4, "s")  # file 3 of step 5 is nowhere
    c = NodeInventory(2, (_holding(5, 4, {3}),))
    assert choose_step([a, None, b, c]) == (5, "s")
    assert choose_step([a, b], only_step=4) == (4, "s")
    assert choose_step([None, None]) is None


def test_plan_fetches_serves_empty_nodes_from_holders() -> None:
    placement = place([0, 0, 1, 1], 1)
    a = NodeInventory(0, (_holding(5, 4, {0, 1, 2, 3}),))
    assert choose_manifest_fetches([a, None, None, None], placement, 5, "s") == [Transfer(0, 2, "manifest.json", 100)]
    transfers = choose_fetches([a, None, None, None], placement, 5, "s", _files(4))
    # Node 1 gets all 4 files, each from a node-0 rank to a node-1 rank, spread over both.
    assert sorted(t.path for t in transfers) == [p for p, _ in _files(4)]
    assert all(t.src in (0, 1) and t.dst in (2, 3) for t in transfers)
    assert {t.dst for t in transfers} == {2, 3} and {t.src for t in transfers} == {0, 1}
    # Only what node 1's ranks will read: files 2 and 3 (another rank's needs count for its node).
    only = choose_fetches([a, None, None, None], placement, 5, "s", _files(4), {0: {0, 1}, 1: {3, 2}})
    assert [(t.path, t.dst) for t in only] == [("data/s/2.safetensors", 2), ("data/s/3.safetensors", 3)]
    b = NodeInventory(1, (_holding(5, 4, {0, 2}),))
    assert choose_manifest_fetches([a, None, b, None], placement, 5, "s") == []
    assert [(t.path, t.dst in (2, 3)) for t in choose_fetches([a, None, b, None], placement, 5, "s", _files(4))] == [
        ("data/s/1.safetensors", True),
        ("data/s/3.safetensors", True),
    ]


def test_choice_for_4096_ranks_under_a_second() -> None:
    """512 nodes x 8 ranks, each node with its own 8 files and 8 replicas, for 2 steps."""
    ranks, per_node = 4096, 8
    nodes = ranks // per_node
    node_of = [r // per_node for r in range(ranks)]
    t0 = time.perf_counter()
    placement = place(node_of, 1)
    place_s = time.perf_counter() - t0
    assert placement.targets[0] == (8,) and placement.targets[ranks - 1] == (7,)
    inventories: list[NodeInventory | None] = []
    for n in range(nodes):
        own = set(range(n * per_node, (n + 1) * per_node))
        prev = (n - 1) % nodes
        replicas = set(range(prev * per_node, (prev + 1) * per_node))
        steps = tuple(_holding(s, ranks, own | replicas) for s in (10, 9))
        inventories += [NodeInventory(n, steps)] + [None] * (per_node - 1)
    # One rank's summary is small (one node's holdings), so the all_gather is O(ranks) bytes-ish.
    assert len(pickle.dumps(inventories[0])) < 2_000
    # Node 7 is lost: its files survive as node 8's replicas.
    inventories[7 * per_node] = None
    t0 = time.perf_counter()
    choice = choose_step(inventories)
    choose_s = time.perf_counter() - t0
    assert choice == (10, "s")
    inventories[8 * per_node] = None  # and node 8 too: node 7's files are gone
    assert choose_step(inventories) is None
    assert place_s < 1.0, place_s
    assert choose_s < 1.0, choose_s


# ----------------------------------------------------------------------------------------
# 2 nodes x 2 ranks: save 1..5, SIGKILL, lose node 1, restart


def _dirs(tmp_path: os.PathLike) -> tuple[str, str]:
    return os.path.join(tmp_path, "durable"), os.path.join(tmp_path, "shm", "node-{node}")


def _ok(outcomes: list) -> list[dict]:
    bad = [o for o in outcomes if o.status != "ok"]
    assert not bad, "\n".join(f"rank {o.rank}: {o.status}: {o.value and o.value.get('traceback')}" for o in bad)
    return [o.value for o in outcomes]


def _without_durable(root: str, fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    """Run a restart with the durable root's steps moved away (its identity and timeline stay:
    without them no local step is the run's): any durable read of a step would find nothing."""
    hidden = root + ".hidden"
    os.makedirs(hidden)
    identity = [ROOT_ID_NAME, TIMELINE_NAME]
    names = [n for n in os.listdir(root) if n not in identity]
    for name in names:
        os.rename(os.path.join(root, name), os.path.join(hidden, name))
    try:
        return fn(*args, **kwargs)
    finally:
        assert sorted(os.listdir(root)) == identity, "the load wrote into the durable root"
        for name in names:
            os.rename(os.path.join(hidden, name), os.path.join(root, name))
        os.rmdir(hidden)


def _committed(node_dir: str) -> list[str]:
    return sorted(n for n in os.listdir(node_dir) if os.path.exists(os.path.join(node_dir, n, "local-commit.json")))


def _save_kill(root: str, local_dir: str, async_save: bool) -> None:
    outcomes = run_ranks(save_then_die, 4, root, local_dir, 5, async_save, env=ENV, timeout=180)
    assert all(o.status == "died" for o in outcomes), [(o.rank, o.status, o.value) for o in outcomes]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_recover_from_node_and_peers_then_durable(tmp_path: os.PathLike, async_save: bool) -> None:
    root, local_dir = _dirs(tmp_path)
    _save_kill(root, local_dir, async_save)
    node0, node1 = local_dir.format(node=0), local_dir.format(node=1)
    # Local retention keeps the last two steps; durable has step 3 only (durable_every=3).
    assert _committed(node0) == _committed(node1) == ["step-00000004", "step-00000005"]
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-00000003"]
    shutil.rmtree(node1)

    # (a) node 0 alone (2 ranks): its own files plus node 1's replicas, nothing from durable.
    got = _ok(_without_durable(root, run_ranks, load_and_check, 2, root, local_dir, env=ENV, timeout=120))
    assert [g["step"] for g in got] == [5, 5] and [g["k"] for g in got] == [5, 5]
    assert {g["source"] for g in got} == {"local"} and sum(g["peer_bytes"] for g in got) == 0

    # (b) 4 ranks, node 1 empty: it is served by node 0, still nothing from durable.
    got = _ok(_without_durable(root, run_ranks, load_and_check, 4, root, local_dir, env=ENV, timeout=120))
    assert [g["k"] for g in got] == [5] * 4 and {g["source"] for g in got} == {"peers"}
    assert got[0]["peer_bytes"] == got[1]["peer_bytes"] == 0 and got[2]["peer_bytes"] + got[3]["peer_bytes"] > 0
    assert "step-00000005" in os.listdir(node1)  # node 1 holds step 5 again

    # (c) both local directories gone: the newest durable step.
    shutil.rmtree(os.path.join(tmp_path, "shm"))
    got = _ok(run_ranks(load_and_check, 4, root, local_dir, env=ENV, timeout=120))
    assert [g["k"] for g in got] == [3] * 4 and {g["source"] for g in got} == {"durable"}


def test_kill_during_local_save_recovers_previous_step(tmp_path: os.PathLike) -> None:
    root, local_dir = _dirs(tmp_path)
    group = start_ranks(save_then_die_mid_save, 4, root, local_dir, 5, env=ENV)
    node0 = local_dir.format(node=0)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and group.procs[3].is_alive():
        time.sleep(0.1)
    time.sleep(2.0)  # ranks 0-2 go on with step 6 as far as they can without rank 3
    outcomes = group.collect(0.0)
    assert outcomes[3].status == "died"
    # Step 6 never committed on any node (how much of it was written depends on where rank 3 died).
    assert not os.path.exists(os.path.join(node0, "step-00000006", MARKER_NAME))
    shutil.rmtree(local_dir.format(node=1))
    got = _ok(_without_durable(root, run_ranks, load_and_check, 4, root, local_dir, env=ENV, timeout=120))
    assert [g["step"] for g in got] == [5] * 4 and [g["k"] for g in got] == [5] * 4


def test_recover_resharded_fsdp2(tmp_path: os.PathLike) -> None:
    """FSDP2 model + AdamW on 2 nodes x 2 ranks, node 1 lost: FSDP2 on node 0's 2 ranks, from the
    local tier, parameters and optimizer states bit-exact."""
    root, local_dir = _dirs(tmp_path)
    outcomes = run_ranks(fsdp2_save_then_die, 4, root, local_dir, 4, env=ENV, timeout=180)
    assert all(o.status == "died" for o in outcomes), [(o.rank, o.status, o.value) for o in outcomes]
    shutil.rmtree(local_dir.format(node=1))
    got = _ok(_without_durable(root, run_ranks, fsdp2_load_and_check, 2, root, local_dir, 4, env=ENV, timeout=120))
    assert got == [{"step": 4, "k": 4, "source": "local", "exact": True, "exact_optim": True}] * 2


def test_without_replicas_a_lost_node_means_durable(tmp_path: os.PathLike) -> None:
    """local_replicas=0: node 1's files were only on node 1, so step 5 is incomplete everywhere."""
    root, local_dir = _dirs(tmp_path)
    outcomes = run_ranks(save_then_die, 4, root, local_dir, 5, False, 0, env=ENV, timeout=180)
    assert all(o.status == "died" for o in outcomes), [(o.rank, o.status, o.value) for o in outcomes]
    node0 = local_dir.format(node=0)
    step5 = os.path.join(node0, "step-00000005", "data")
    assert sorted(name.split("-")[0] for _, _, names in os.walk(step5) for name in names) == ["0", "1"]
    shutil.rmtree(local_dir.format(node=1))
    got = _ok(run_ranks(load_and_check, 4, root, local_dir, env=ENV, timeout=120))
    assert [g["k"] for g in got] == [3] * 4 and {g["source"] for g in got} == {"durable"}


def test_placement_is_decided_once() -> None:
    from tessera.engine.dist import World
    from tessera.manager.local_tier import LocalTier

    tier = LocalTier("/tmp/unused-{node}", "/tmp/root", replicas=1, keep_last=2, process_group=None)
    world = World(0, 1, None)
    first = tier.placement(world)
    assert tier.placement(world) is first  # cached: no second exchange of node indices
    assert first.targets == ((),)  # one node: no replica


def test_a_replica_that_does_not_fit_fails_the_save_everywhere(tmp_path: os.PathLike) -> None:
    """The receiving node's filesystem refuses the replica (RLIMIT_FSIZE, as a full /dev/shm
    would): a StorageError on both ranks, no partial file, the previous step recovers."""
    root, local_dir = _dirs(tmp_path)
    got = _ok(run_ranks(replica_space_runs_out, 2, root, local_dir, env={"LOCAL_WORLD_SIZE": "1"}, timeout=120))
    for rank, g in enumerate(got):
        assert g["error"] is not None and g["error"].startswith("StorageError"), (rank, g["error"])
        assert "replicating" in g["error"], g["error"]
        assert g["leftovers"] == [], (rank, g["leftovers"])
        assert (g["step"], g["source"], g["exact"]) == (1, "local", True), (rank, g)
    assert "File too large" in got[1]["error"]
    assert _committed(local_dir.format(node=0)) == _committed(local_dir.format(node=1)) == ["step-00000001"]


def test_a_durable_copy_committed_by_a_rank_that_then_died_stays_whole(tmp_path: os.PathLike) -> None:
    """Rank 1 cannot tell whether rank 0 published before dying, so it keeps its uploads:
    the durable step 2 verifies and loads, with the local tier gone."""
    root, local_dir = _dirs(tmp_path)
    group = start_ranks(
        durable_copy_dies_after_publish, 2, root, local_dir, env={"LOCAL_WORLD_SIZE": "1", "TESSERA_TIMEOUT_S": "10"}
    )
    out = group.collect(120)
    assert out[0].status == "died", out[0]
    assert out[1].status == "ok" and out[1].value["error"] is not None, out[1]
    shutil.rmtree(os.path.join(tmp_path, "shm"))
    mgr = CheckpointManager(root)
    report = verify(mgr.step_url(2))
    assert report.ok, report.summary()
    state = empty_state()
    got = mgr.load(state)
    assert (got.step, check_state(state)) == (2, 2)


def test_transfers_arrive_whole_and_a_failed_receiver_fails_every_rank(tmp_path: os.PathLike) -> None:
    """Files of odd sizes (one empty) between 3 ranks arrive bit-exact; a receiver that cannot
    create its file fails the transfer on every rank, naming it, with no partial file left."""
    import hashlib

    got = _ok(run_ranks(transfer_files, 3, str(tmp_path), timeout=120))

    def digest(rank: int, name: str) -> str:
        with open(os.path.join(tmp_path, str(rank), name), "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()

    want = {
        0: {"a-from-1": digest(1, "a-from-1"), "d-from-2": digest(2, "d-from-2")},
        1: {"a-from-0": digest(0, "a-from-0"), "d-from-2": digest(2, "d-from-2")},
        2: {"b-from-0": digest(0, "b-from-0"), "c-from-1": digest(1, "c-from-1")},
    }
    assert [g["digests"] for g in got] == [want[0], want[1], want[2]]
    assert [g["received"] for g in got] == [10_007 + 3_000, 10_007 + 3_000, 999]
    for rank, g in enumerate(got):
        assert g["error"] is not None and "blocked/y" in g["error"] and "rank 1" in g["error"], (rank, g["error"])
    assert not [n for _, _, names in os.walk(tmp_path) for n in names if ".recv-" in n]


# ----------------------------------------------------------------------------------------
# Identity: local steps belong to a run and its durable root (2 nodes x 1 rank)

ONE = {"LOCAL_WORLD_SIZE": "1"}


def _run(fn, *args):  # type: ignore[no-untyped-def]
    return _ok(run_ranks(fn, 2, *args, env=ONE, timeout=180))


def test_a_fresh_run_on_a_deleted_root_never_sees_the_old_runs_local_steps(tmp_path: os.PathLike) -> None:
    """An old run leaves local steps 200 and 300 behind; its root is deleted; a new run with
    the same root and local_dir saves step 10 (durable), is killed and restarts: step 10."""
    root, local_dir = _dirs(tmp_path)
    old = _run(save_steps, root, local_dir, [100, 200, 300], 100)
    assert [o["errors"] for o in old] == [{}, {}]
    shutil.rmtree(root)
    new = _run(save_steps, root, local_dir, [10], 10)
    for rank, o in enumerate(new):
        assert o["latest_before"] is None, (rank, o)  # the idiom starts from scratch
        assert o["errors"] == {}, (rank, o["errors"])
        assert o["steps_after"] == [10], (rank, o["steps_after"])
    # The old steps were removed, with one warning (rank 0) naming them.
    stale = [w for w in new[0]["warnings"] if "another root id" in w]
    assert len(stale) == 1 and "200" in stale[0] and "300" in stale[0], new[0]["warnings"]
    assert not any("another root id" in w for w in new[1]["warnings"]), new[1]["warnings"]
    for node in (0, 1):
        assert _committed(local_dir.format(node=node)) == ["step-00000010"]
    got = _run(resume_idiom, root, local_dir, 10)
    assert [(g["step"], g["k"]) for g in got] == [(10, 10)] * 2, got


def test_a_deleted_root_makes_its_local_steps_unloadable(tmp_path: os.PathLike) -> None:
    """Nothing durable, root deleted: load finds nothing (never the old local steps), and says so."""
    root, local_dir = _dirs(tmp_path)
    _run(save_steps, root, local_dir, [1, 2], 1000)
    shutil.rmtree(root, ignore_errors=True)  # the old code never created it
    got = _run(load_or_error, root, local_dir, 1000)
    for g in got:
        assert g["step"] is None and g["error"].startswith("CheckpointNotFoundError"), g
        assert "local tier" in g["error"], g["error"]
    assert _committed(local_dir.format(node=0)) == _committed(local_dir.format(node=1)) == []


def test_latest_step_and_the_resume_idiom_count_local_steps(tmp_path: os.PathLike) -> None:
    """durable_every far away: only local steps exist, and the README's idiom resumes from them."""
    root, local_dir = _dirs(tmp_path)
    first = _run(save_steps, root, local_dir, [1, 2, 3], 1000)
    assert [o["steps_after"] for o in first] == [[2, 3], [2, 3]]
    got = _run(resume_idiom, root, local_dir, 1000)
    for g in got:
        assert (g["latest"], g["steps"], g["step"], g["k"], g["source"]) == (3, [2, 3], 3, 3, "local"), g


def test_a_rollback_fences_the_newer_local_steps_and_saves_go_on(tmp_path: os.PathLike) -> None:
    """load(step=100) after 300 (every hundredth step durable), then saves 110 and 120: they
    commit, 200 and 300 are gone locally and under the durable root, and a restart resumes
    from 120."""
    root, local_dir = _dirs(tmp_path)
    got = _run(rollback_then_save, root, local_dir)
    for g in got:
        assert g["rolled_back"] == (100, 100) and g["errors"] == {}, g
        assert g["steps"] == [100, 110, 120], g
    durable = CheckpointManager(root)  # the durable 200 and 300 went too, and `latest` with them
    assert (durable.steps(), durable.pointer_step()) == ([100], 100)
    got = _run(resume_idiom, root, local_dir, 100)
    assert [(g["step"], g["k"]) for g in got] == [(120, 120)] * 2, got


# ----------------------------------------------------------------------------------------
# Corruption: a bad copy is replaced by an intact one, else an older intact step loads


def _rank0_files(node_dir: str, step: int) -> list[str]:
    data = os.path.join(node_dir, f"step-{step:08d}", "data")
    return sorted(os.path.join(d, n) for d, _, names in os.walk(data) for n in names if n.startswith("0-"))


def _flip_last_bit(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte ^ 1]))


def test_a_corrupt_local_file_is_fetched_intact_from_its_replica(tmp_path: os.PathLike) -> None:
    """2 nodes x 1 rank, nothing durable: one bit flipped in node 0's own step-5 file. Node 1's
    replica of it is intact: step 5 loads, and a warning names the file and node 0."""
    root, local_dir = _dirs(tmp_path)
    _run(save_steps, root, local_dir, [1, 2, 3, 4, 5], 1000)
    (bad,) = _rank0_files(local_dir.format(node=0), 5)
    _flip_last_bit(bad)
    got = _run(load_or_error, root, local_dir, 1000)
    assert [(g["step"], g["k"], g["error"], g["source"]) for g in got] == [(5, 5, None, "peers")] * 2, got
    with open(bad, "rb") as a, open(bad.replace("node-0", "node-1"), "rb") as b:
        assert a.read() == b.read()  # node 0's copy was replaced by node 1's
    (warning,) = [w for w in got[0]["warnings"] if "bad copies" in w]
    assert os.path.relpath(bad, os.path.join(local_dir.format(node=0), "step-00000005")) in warning, warning
    assert "node 0" in warning and "node 1" not in warning, warning


def test_a_step_corrupt_everywhere_gives_way_to_the_newest_intact_local_step(tmp_path: os.PathLike) -> None:
    """durable_every=3: both copies of rank 0's step-5 file are bad; step 4 (local, intact
    everywhere) loads rather than the durable step 3."""
    root, local_dir = _dirs(tmp_path)
    _run(save_steps, root, local_dir, [1, 2, 3, 4, 5], 3)
    for node in (0, 1):
        for path in _rank0_files(local_dir.format(node=node), 5):
            _flip_last_bit(path)
    got = _run(load_or_error, root, local_dir, 3)
    assert [(g["step"], g["k"], g["source"]) for g in got] == [(4, 4, "local")] * 2, got
    (warning,) = [w for w in got[0]["warnings"] if "bad copies" in w]
    assert "node 0" in warning and "node 1" in warning and "step 5" in warning, warning


def test_when_no_local_step_is_intact_the_error_names_the_local_tier(tmp_path: os.PathLike) -> None:
    root, local_dir = _dirs(tmp_path)
    _run(save_steps, root, local_dir, [1, 2, 3, 4, 5], 1000)
    for node in (0, 1):
        for step in (4, 5):
            for path in _rank0_files(local_dir.format(node=node), step):
                _flip_last_bit(path)
    got = _run(load_or_error, root, local_dir, 1000)
    for g in got:
        assert g["error"] is not None and g["error"].startswith("CheckpointNotFoundError"), g
        assert "local tier" in g["error"] and "bad copy: step 5" in g["error"] and "step 4" in g["error"], g["error"]


# ----------------------------------------------------------------------------------------
# Removing a run's host-memory steps (tier:: roots)


@pytest.fixture
def tier_root(tmp_path: os.PathLike):  # type: ignore[no-untyped-def]
    """A durable root under tmp_path; its tier:: host-memory directory is removed afterwards."""
    from tessera.storage.host_memory import default_memory_root, prune_empty_parents

    root = os.path.join(tmp_path, "run-7")
    yield root
    memory = default_memory_root(root)
    shutil.rmtree(memory, ignore_errors=True)
    prune_empty_parents(memory)


def test_remove_local_steps_frees_host_memory(tier_root: str) -> None:
    import torch

    with CheckpointManager("tier::" + tier_root, keep_last=2) as mgr:
        for k in (1, 2):
            mgr.save(k, {"w": torch.full((4,), float(k))})
        memory = mgr.local_dir
        assert memory is not None and _committed(memory) == ["step-00000001", "step-00000002"]
        assert mgr.remove_local_steps() == [1, 2]
        assert not os.path.exists(memory) and not os.path.exists(os.path.dirname(memory))  # empty parents too
        assert mgr.steps() == [1, 2]  # the durable steps stay
        got = mgr.load({"w": torch.zeros(4)})
        assert (got.step, got.source) == (2, "durable")


def test_cli_remove_local_after_the_job(tier_root: str, capsys: pytest.CaptureFixture) -> None:
    import torch

    from tessera.cli import main

    with CheckpointManager("tier::" + tier_root, durable_every=10) as mgr:
        mgr.save(3, {"w": torch.ones(4)})
        memory = mgr.local_dir
    assert memory is not None and _committed(memory) == ["step-00000003"]
    assert main(["remove-local", "tier::" + tier_root]) == 0
    assert "removed 1 local step(s)" in capsys.readouterr().out
    assert not os.path.exists(memory)
    assert main(["remove-local", "tier::" + tier_root]) == 0
    assert "no local step" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------
# SIGKILL during replication, the durable copy and recovery (3 nodes x 1 rank)

KILL_ENV = {"LOCAL_WORLD_SIZE": "1", "TESSERA_TIMEOUT_S": "10"}


def _kill_run(fn, world: int, *args) -> list:  # type: ignore[no-untyped-def]
    out = start_ranks(fn, world, *args, env=KILL_ENV).collect(150)
    return out


def _load3(root: str, local_dir: str, world: int = 3) -> list[dict]:
    return _ok(run_ranks(load_and_check, world, root, local_dir, env=ONE, timeout=150))


@pytest.mark.slow
def test_kill_during_replication_then_recovery_then_a_smaller_job(tmp_path: os.PathLike) -> None:
    """Node 2 dies entering step 3's replication: step 3 is committed nowhere and step 2 loads.
    Then node 1's directory is lost and a rank dies as the fetch from peers starts: the next
    restart still recovers step 2; and a 2-node job without node 2's directory too."""
    root, local_dir = _dirs(tmp_path)
    out = _kill_run(save_and_kill_at, 3, root, local_dir, 2, "replicating")
    assert out[2].status == "died", out[2]
    assert all(o.status == "ok" and o.value["error"] for o in out[:2]), out[:2]
    for node in range(3):
        assert "step-00000003" not in _committed(local_dir.format(node=node))
    got = _without_durable(root, _load3, root, local_dir)  # each node fetches the file it lacks
    assert [(g["step"], g["k"], g["source"]) for g in got] == [(2, 2, "peers")] * 3, got

    shutil.rmtree(local_dir.format(node=1))
    out = _kill_run(recover_and_kill, 3, root, local_dir, 1)
    assert out[1].status == "died", out[1]
    assert all(o.status == "ok" for o in (out[0], out[2])), out
    got = _without_durable(root, _load3, root, local_dir)
    assert [(g["step"], g["k"]) for g in got] == [(2, 2)] * 3 and got[1]["peer_bytes"] > 0, got
    assert not [n for _, _, names in os.walk(os.path.join(tmp_path, "shm")) for n in names if ".recv-" in n]

    shutil.rmtree(local_dir.format(node=2))
    got = _without_durable(root, _load3, root, local_dir, 2)
    assert [(g["step"], g["k"]) for g in got] == [(2, 2)] * 2, got


@pytest.mark.slow
def test_kill_after_replication_before_the_commit_marker(tmp_path: os.PathLike) -> None:
    """Node 1 dies after step 3's replicas are written, before its commit marker: the step is
    complete on the other nodes between them, so it loads (the guarantee's 'an error does not
    prove nothing was committed')."""
    root, local_dir = _dirs(tmp_path)
    out = _kill_run(save_and_kill_at, 3, root, local_dir, 1, "replicated")
    assert out[1].status == "died", out[1]
    assert "step-00000003" not in _committed(local_dir.format(node=1))
    got = _without_durable(root, _load3, root, local_dir)
    assert [(g["step"], g["k"]) for g in got] == [(3, 3)] * 3, got


@pytest.mark.slow
def test_kill_during_the_durable_copy(tmp_path: os.PathLike) -> None:
    """Node 1 dies halfway through uploading step 3: step 3 is committed locally and loads; the
    durable root still has step 2 committed; the next save (4) commits durably."""
    root, local_dir = _dirs(tmp_path)
    out = _kill_run(save_and_kill_at, 3, root, local_dir, 1, "durable")
    assert out[1].status == "died", out[1]
    assert not os.path.exists(os.path.join(root, "step-00000003", "manifest.json"))
    got = _ok(run_ranks(load_save_on, 3, root, local_dir, 4, env=ONE, timeout=150))
    assert [(g["step"], g["k"]) for g in got] == [(3, 3)] * 3, (
        got
    )  # from the local tier: durable step 3 never committed
    shutil.rmtree(os.path.join(tmp_path, "shm"))
    got = _load3(root, local_dir)
    assert [(g["step"], g["k"], g["source"]) for g in got] == [(4, 4, "durable")] * 3, got
    assert verify(os.path.join(root, "step-00000004")).ok
