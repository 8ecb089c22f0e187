"""The local tier with parity instead of replicas (issue #35): ``local_parity=(k, m)``.

Nodes are simulated on one machine: real gloo processes with ``LOCAL_WORLD_SIZE=1`` are nodes
of one rank, each with its own ``local_dir`` through ``{node}``. Recovery runs with the durable
root's steps moved away (or with none saved): any durable read would find nothing.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from tessera.manager import CheckpointManager
from tessera.manager.local_tier import NodeInventory, StepHolding, choose_step
from tessera.manager.local_tier.codec import ISAL, SLICE, XOR, Codec, codec_for
from tessera.manager.local_tier.inventory import MARKER_NAME
from tessera.manager.local_tier.stripes import ParityLayout, effective
from tests.crash_worker import run_ranks, start_ranks
from tests.local_parity_worker import (
    load_and_check,
    recover_and_kill,
    rollback_then_save,
    save_and_kill_encoding,
    save_steps,
    sweep_losses,
)
from tests.test_local_tier import _flip_last_bit, _without_durable

ONE = {"LOCAL_WORLD_SIZE": "1"}


def _dirs(tmp_path: os.PathLike) -> tuple[str, str]:
    return os.path.join(tmp_path, "durable"), os.path.join(tmp_path, "shm", "node-{node}")


def _ok(outcomes: list) -> list:
    bad = [o for o in outcomes if o.status != "ok"]
    assert not bad, "\n".join(f"rank {o.rank}: {o.status}: {o.value and o.value.get('traceback')}" for o in bad)
    return [o.value for o in outcomes]


def _save(root: str, local_dir: str, world: int, parity: tuple[int, int], steps: list[int], **kw: object) -> None:
    names = ("durable_every", "async_save", "max_staging_bytes", "chunk", "compress")
    defaults = {"durable_every": 1000, "async_save": False, "max_staging_bytes": None, "chunk": None, "compress": False}
    args = [kw.get(name, defaults[name]) for name in names]
    _ok(run_ranks(save_steps, world, root, local_dir, parity, steps, *args, env=ONE, timeout=180))


def _files(node_dir: str, step: int, part: str) -> list[str]:
    top = os.path.join(node_dir, f"step-{step:08d}", part)
    return sorted(os.path.join(d, n) for d, _, names in os.walk(top) for n in names)


def _bytes(node_dir: str, step: int, part: str) -> int:
    return sum(os.path.getsize(p) for p in _files(node_dir, step, part))


# ----------------------------------------------------------------------------------------
# The layout and the code (pure)


@pytest.mark.parametrize("size", [1001, 2 * SLICE + 17])
def test_codec_rebuilds_every_choice_of_m_lost_blocks(size: int) -> None:
    rng = np.random.default_rng(0)
    for k, m in ((4, 2), (5, 1), (2, 1), (1, 1), (1, 2), (3, 3)):
        codec = Codec(k, m, codec_for(m))
        data = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(k)]
        parity = codec.encode(data)
        assert all(p.shape == (size,) and p.dtype == np.uint8 for p in parity)
        blocks = dict(enumerate(data + parity))
        for lost in itertools.combinations(range(k + m), m):
            left = dict(list((n, b) for n, b in blocks.items() if n not in lost)[:k])
            got = codec.decode(left, list(range(k)))
            assert all(np.array_equal(got[t], data[t]) and got[t].flags.writeable for t in range(k)), (k, m, lost)


def test_parity_codec_is_recorded_and_only_the_encoding_code_decodes() -> None:
    layout = ParityLayout.build(4, 2, list(range(6)), [(r, 4000) for r in range(6)])
    assert layout is not None and layout.codec == ISAL
    doc = layout.with_crc({(i, p): 0 for i in range(6) for p in range(2)}).to_doc()
    assert ParityLayout.from_doc(doc).codec == ISAL
    # Parity from another code (an older tessera's zfec) is never decoded by this one.
    with pytest.raises(ValueError, match="encoded with 'zfec', which this tessera does not decode"):
        ParityLayout.from_doc({**doc, "codec": "zfec"})
    with pytest.raises(ValueError, match="not one this tessera decodes"):
        Codec(4, 2, XOR)


def test_m_of_two_or_more_without_pyeclib_is_refused_saying_what_to_install(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pyeclib.ec_iface", None)  # as if not installed
    with pytest.raises(ValueError, match=r"local_parity=\(4, 2\) needs pyeclib .*pip install pyeclib"):
        CheckpointManager(str(tmp_path / "root"), local_dir=str(tmp_path / "local"), local_parity=(4, 2))
    CheckpointManager(str(tmp_path / "root"), local_dir=str(tmp_path / "local"), local_parity=(5, 1))  # XOR: numpy


def test_stripes_rotate_so_every_node_keeps_m_over_k_and_any_m_losses_leave_k() -> None:
    for k, m, n in ((4, 2, 6), (5, 1, 6), (2, 1, 3), (4, 2, 9), (3, 1, 7)):
        layout = ParityLayout.build(k, m, list(range(n)), [(r, 1000 * k) for r in range(n)])
        assert layout is not None and (layout.k, layout.m) == (k, m)
        # Each node keeps m parity blocks of 1000 bytes (its stream is 1000 * k): m/k extra.
        kept = [sum(layout.block(i) for i, _ in layout.parity_of(pos)) for pos in range(n)]
        assert kept == [1000 * m] * n, (k, m, n, kept)
        for i in range(n):  # the k + m blocks of a stripe are on distinct nodes
            holders = {layout.data_pos(i, t) for t in range(k)} | {layout.parity_pos(i, p) for p in range(m)}
            assert len(holders) == k + m
        for lost in itertools.combinations(range(n), m):
            held = [frozenset() if pos in lost else frozenset([pos]) for pos in range(n)]
            parity = [frozenset() if pos in lost else frozenset(layout.parity_of(pos)) for pos in range(n)]
            assert layout.shortfall(held, parity) == [], (k, m, n, lost)
        lost = tuple(range(m + 1))  # m + 1 neighbours: a stripe lost more than m blocks
        held = [frozenset() if pos in lost else frozenset([pos]) for pos in range(n)]
        parity = [frozenset() if pos in lost else frozenset(layout.parity_of(pos)) for pos in range(n)]
        assert layout.shortfall(held, parity), (k, m, n)


def test_small_jobs_get_a_smaller_code_and_one_node_none() -> None:
    assert effective(4, 2, 6) == (4, 2) and effective(4, 2, 5) == (3, 2) and effective(4, 2, 3) == (1, 2)
    assert effective(2, 1, 2) == (1, 1)  # two nodes: each node's stream copied to the other
    assert ParityLayout.build(2, 1, [0, 0], [(0, 10), (1, 10)]) is None  # one node: no parity


def test_choose_step_takes_a_step_parity_can_rebuild() -> None:
    layout = ParityLayout.build(2, 1, [0, 1, 2], [(0, 8), (1, 8), (2, 8)])
    assert layout is not None
    layout = layout.with_crc({(i, 0): 0 for i in range(3)})

    def node(pos: int, files: set[int], parity: set) -> NodeInventory:
        return NodeInventory(pos, (StepHolding(5, "s", 3, frozenset(files), 10, 0, layout, frozenset(parity)),))

    a, b = node(0, {0}, {(1, 0)}), node(1, {1}, {(2, 0)})
    assert choose_step([a, b]) == (5, "s")  # node 2's file rebuilt from stripes 1 and 2
    assert choose_step([a, node(1, {1}, set())]) is None  # stripe 2 lost its parity and node 2's data


# ----------------------------------------------------------------------------------------
# Saves, losses and recovery on real gloo groups


def test_save_keeps_m_over_k_of_parity_and_commits_it(tmp_path: os.PathLike) -> None:
    root, local_dir = _dirs(tmp_path)
    _save(root, local_dir, 6, (4, 2), [1, 2])
    for node in range(6):
        d = local_dir.format(node=node)
        assert sorted(n for n in os.listdir(d) if os.path.exists(os.path.join(d, n, MARKER_NAME))) == [
            "step-00000001",
            "step-00000002",
        ]
        own, parity = _bytes(d, 2, "data"), _bytes(d, 2, "parity")
        with open(os.path.join(d, "step-00000002", MARKER_NAME)) as f:
            layout = ParityLayout.from_doc(json.load(f)["parity"])
        assert layout.lengths[node] == own and (layout.k, layout.m) == (4, 2)
        # Each node keeps m = 2 blocks, each padded to the largest segment of its stripe.
        assert len(_files(d, 2, "parity")) == 2
        assert parity == sum(layout.block(i) for i, _ in layout.parity_of(node)), node
        if node == 0:  # its two stripes (1 and 2) are of nodes 1-5, whose streams are all alike
            assert 0 < parity <= layout.lengths[1] * 2 / 4 * 1.02, (own, parity)
    # Nothing went to the durable root but its identity and timeline.
    assert not [n for n in os.listdir(root) if n.startswith("step-")]


def _pristine(local_dir: str, world: int) -> str:
    """Copy every node directory aside; the copy's template."""
    pristine = local_dir.replace("node-{node}", "pristine-{node}")
    for node in range(world):
        shutil.copytree(local_dir.format(node=node), pristine.format(node=node))
    return pristine


@pytest.mark.parametrize(("world", "parity"), [(6, (4, 2)), (6, (5, 1)), (3, (2, 1))], ids=["4+2", "5+1", "2+1"])
def test_every_choice_of_m_lost_nodes_recovers_bit_exact(tmp_path: os.PathLike, world: int, parity: tuple) -> None:
    """Every set of m nodes comes back empty in turn (the same world size); each time the last
    step is rebuilt from the rest of the stripes and loads bit-exact into another layout (full
    tensors), with no step under the durable root to read. Parity moves in chunks of 100,003
    bytes: several rounds, chunk edges inside files and across them."""
    root, local_dir = _dirs(tmp_path)
    _save(root, local_dir, world, parity, [1, 2], chunk=100_003)
    pristine = _pristine(local_dir, world)
    cases = [list(c) for c in itertools.combinations(range(world), parity[1])]
    args = (root, local_dir, parity, pristine, cases, 100_003)
    got = _ok(run_ranks(sweep_losses, world, *args, env=ONE, timeout=300))
    assert not [n for n in os.listdir(root) if n.startswith("step-")]
    for rank, results in enumerate(got):
        assert [(r["lost"], r["step"], r["k"]) for r in results] == [(c, 2, 2) for c in cases], rank
    # The nodes that came back empty received bytes; the others read their own files.
    for i, case in enumerate(cases):
        assert all(got[n][i]["peer_bytes"] > 0 for n in case), case


def test_parity_covers_compressed_steps_as_stored(tmp_path: os.PathLike) -> None:
    """compress=True with 4+2 parity on 6 nodes: parity is computed over the compressed files the
    nodes keep (m/k of what they store, not of the logical bytes), and two lost nodes are rebuilt
    bit-exact from them."""
    root, local_dir = _dirs(tmp_path)
    _save(root, local_dir, 6, (4, 2), [1, 2], compress=True)
    step_dir = os.path.join(local_dir.format(node=0), "step-00000002")
    with open(os.path.join(step_dir, "manifest.json")) as f:
        assert json.load(f)["version"] == 3  # frames: the files are compressed
    own = [_bytes(local_dir.format(node=node), 2, "data") for node in range(6)]  # one rank per node
    parity = [_bytes(local_dir.format(node=node), 2, "parity") for node in range(6)]
    assert all(0 < p <= 2 * -(-max(own) // 4) for p in parity), (own, parity)
    pristine = _pristine(local_dir, 6)
    args = (root, local_dir, (4, 2), pristine, [[1, 4], [0, 5]])
    got = _ok(run_ranks(sweep_losses, 6, *args, env=ONE, timeout=300))
    for rank, results in enumerate(got):
        assert [(r["lost"], r["step"], r["k"]) for r in results] == [([1, 4], 2, 2), ([0, 5], 2, 2)], rank


def test_fresh_processes_then_survivors_alone_then_more_than_m_lost(tmp_path: os.PathLike) -> None:
    """4+2 on 6 nodes, every second step durable. (a) Nodes 1 and 4 lost, 6 fresh processes:
    step 3 from parity. (b) Nodes 1 and 3 lost, a job of the 4 survivors (nodes 0, 2, 4, 5):
    step 3. (c) Nodes 1, 2 and 3 lost: no stripe rebuilds; the newest durable step (2) loads,
    with a warning naming the lost blocks."""
    root, local_dir = _dirs(tmp_path)
    _save(root, local_dir, 6, (4, 2), [1, 2, 3], durable_every=2)
    pristine = _pristine(local_dir, 6)

    def restore(lost: list[int]) -> None:
        for node in range(6):
            shutil.rmtree(local_dir.format(node=node), ignore_errors=True)
            if node not in lost:
                shutil.copytree(pristine.format(node=node), local_dir.format(node=node))

    restore([1, 4])
    got = _ok(_without_durable(root, run_ranks, load_and_check, 6, root, local_dir, (4, 2), env=ONE, timeout=180))
    assert [(g["step"], g["k"]) for g in got] == [(3, 3)] * 6, got
    assert got[1]["peer_bytes"] > 0 and got[4]["peer_bytes"] > 0

    restore([1, 3])
    survivors = [0, 2, 4, 5]
    got = _ok(
        _without_durable(root, run_ranks, load_and_check, 4, root, local_dir, (4, 2), survivors, env=ONE, timeout=180)
    )
    assert [(g["step"], g["k"], g["source"]) for g in got] == [(3, 3, "peers")] * 4, got

    restore([1, 2, 3])
    got = _ok(run_ranks(load_and_check, 6, root, local_dir, (4, 2), env=ONE, timeout=180))
    assert [(g["step"], g["k"], g["source"]) for g in got] == [(2, 2, "durable")] * 6, got
    (warning,) = [w for w in got[0]["warnings"] if "step 3 cannot be rebuilt" in w]
    assert "durable" in warning and "data of node 1" in warning and "data of node 3" in warning, warning


def test_a_corrupt_parity_block_is_found_by_its_checksum(tmp_path: os.PathLike) -> None:
    """4+2, node 1 lost and the parity block 0 of stripe 1 (node 1's first segment) corrupt on
    node 5: the block fails its checksum, is removed, and node 1's stream is rebuilt from the other
    parity block of the stripe; a warning names the file and node 5."""
    root, local_dir = _dirs(tmp_path)
    _save(root, local_dir, 6, (4, 2), [1, 2])
    shutil.rmtree(local_dir.format(node=1))
    (bad,) = [p for p in _files(local_dir.format(node=5), 2, "parity") if p.endswith("/1-0.bin")]
    _flip_last_bit(bad)
    got = _ok(_without_durable(root, run_ranks, load_and_check, 6, root, local_dir, (4, 2), env=ONE, timeout=180))
    assert [(g["step"], g["k"]) for g in got] == [(2, 2)] * 6, got
    (warning,) = [w for w in got[0]["warnings"] if "bad copies" in w]
    assert "1-0.bin on node 5" in warning and "checksum (xxh3-64)" in warning, warning
    assert not os.path.exists(bad)


def test_a_corrupt_data_file_is_rebuilt_from_its_stripes(tmp_path: os.PathLike) -> None:
    """2+1 on 3 nodes, nothing lost, one bit flipped in node 0's own file of step 2 (no other
    copy exists): the load finds it, the file is removed and rebuilt from parity, step 2 loads."""
    root, local_dir = _dirs(tmp_path)
    _save(root, local_dir, 3, (2, 1), [1, 2])
    (bad,) = _files(local_dir.format(node=0), 2, "data")
    _flip_last_bit(bad)
    got = _ok(_without_durable(root, run_ranks, load_and_check, 3, root, local_dir, (2, 1), env=ONE, timeout=180))
    assert [(g["step"], g["k"]) for g in got] == [(2, 2)] * 3, got
    (warning,) = [w for w in got[0]["warnings"] if "bad copies" in w]
    assert "node 0" in warning and "step 2" in warning, warning


def test_a_node_killed_during_encoding_leaves_the_step_uncommitted(tmp_path: os.PathLike) -> None:
    """2+1 on 3 nodes: node 1 is SIGKILLed in the middle of step 3's parity encoding. No node
    commits step 3; with node 1's directory lost too, step 2 is rebuilt from parity."""
    root, local_dir = _dirs(tmp_path)
    env = {"LOCAL_WORLD_SIZE": "1", "TESSERA_TIMEOUT_S": "10"}
    out = start_ranks(save_and_kill_encoding, 3, root, local_dir, (2, 1), 1, env=env).collect(150)
    assert out[1].status == "died", out[1]
    assert all(o.status == "ok" and o.value["error"] for o in (out[0], out[2])), out
    for node in range(3):
        assert not os.path.exists(os.path.join(local_dir.format(node=node), "step-00000003", MARKER_NAME))
    shutil.rmtree(local_dir.format(node=1))
    got = _ok(_without_durable(root, run_ranks, load_and_check, 3, root, local_dir, (2, 1), env=ONE, timeout=180))
    assert [(g["step"], g["k"]) for g in got] == [(2, 2)] * 3, got


def test_async_saves_under_a_memory_budget(tmp_path: os.PathLike) -> None:
    """2+1 on 3 nodes, asynchronous saves with a 1 MiB staging budget (parity is encoded in the
    background from the files in local_dir); node 2 lost: the last step is rebuilt."""
    root, local_dir = _dirs(tmp_path)
    _save(root, local_dir, 3, (2, 1), [1, 2, 3], durable_every=1000, async_save=True, max_staging_bytes=1 << 20)
    shutil.rmtree(local_dir.format(node=2))
    got = _ok(_without_durable(root, run_ranks, load_and_check, 3, root, local_dir, (2, 1), env=ONE, timeout=180))
    assert [(g["step"], g["k"]) for g in got] == [(3, 3)] * 3, got


def test_a_two_node_job_keeps_a_copy_and_survives_one_loss(
    tmp_path: os.PathLike, capsys: pytest.CaptureFixture
) -> None:
    """local_parity=(2, 1) on 2 nodes is 1+1: node 0 alone recovers node 1's files. `tessera
    local` shows what node 0 keeps."""
    from tessera.cli import main

    root, local_dir = _dirs(tmp_path)
    _save(root, local_dir, 2, (2, 1), [1])
    assert _bytes(local_dir.format(node=0), 1, "parity") == _bytes(local_dir.format(node=1), 1, "data")
    capsys.readouterr()
    assert main(["local", root, "--local-dir", local_dir, "--node", "0", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["steps"]
    want = _bytes(local_dir.format(node=0), 1, "data"), _bytes(local_dir.format(node=1), 1, "data")
    assert (row["step"], row["committed"], row["protection"]) == (1, True, "parity 1+1"), row
    assert (row["data_bytes"], row["parity_bytes"]) == want, row
    shutil.rmtree(local_dir.format(node=1))
    got = _ok(_without_durable(root, run_ranks, load_and_check, 1, root, local_dir, (2, 1), env=ONE, timeout=180))
    assert [(g["step"], g["k"]) for g in got] == [(1, 1)], got


def test_local_parity_arguments() -> None:
    with pytest.raises(ValueError, match="do not also give local_replicas"):
        CheckpointManager("/tmp/unused", local_dir="/tmp/unused-{node}", local_parity=(4, 2), local_replicas=1)
    for bad in ((4, 0), (0, 1), (4,), "4+2", (4.0, 2)):
        with pytest.raises(ValueError, match="local_parity must be"):
            CheckpointManager("/tmp/unused", local_dir="/tmp/unused-{node}", local_parity=bad)  # type: ignore[arg-type]


def test_a_rollback_fences_parity_of_the_abandoned_timeline(tmp_path: os.PathLike) -> None:
    """2+1 on 3 nodes: 100, 200, 300, a rollback to 100, then 110 and 120. Every node then gets
    its step 300 back as it was (data, parity, marker of the old epoch) and node 1 is lost:
    parity could rebuild 300, but it is off the timeline; 120 is rebuilt and loads."""
    root, local_dir = _dirs(tmp_path)
    keep = os.path.join(tmp_path, "keep-{node}")
    got = _ok(run_ranks(rollback_then_save, 3, root, local_dir, (2, 1), keep, env=ONE, timeout=180))
    assert [g["rolled_back"] for g in got] == [(100, 100)] * 3, got
    assert [g["steps"] for g in got] == [[100, 110, 120]] * 3, got
    shutil.rmtree(local_dir.format(node=1))
    got = _ok(run_ranks(load_and_check, 3, root, local_dir, (2, 1), env=ONE, timeout=180))
    assert [(g["step"], g["k"], g["source"]) for g in got] == [(120, 120, "peers")] * 3, got


def test_a_node_killed_during_the_rebuild_leaves_nothing_half_written(tmp_path: os.PathLike) -> None:
    """2+1 on 3 nodes, node 1 lost; node 0 is SIGKILLed as it starts sending its blocks for the
    rebuild of node 1's files, which node 1 has created: they are removed (no partial file),
    node 1 commits nothing, and the next restart rebuilds and loads step 2."""
    root, local_dir = _dirs(tmp_path)
    _save(root, local_dir, 3, (2, 1), [1, 2])
    shutil.rmtree(local_dir.format(node=1))
    env = {"LOCAL_WORLD_SIZE": "1", "TESSERA_TIMEOUT_S": "10"}
    out = start_ranks(recover_and_kill, 3, root, local_dir, (2, 1), 0, env=env).collect(150)
    assert out[0].status == "died", out[0]
    assert all(o.status == "ok" and o.value["error"] for o in out[1:]), out
    shm = os.path.join(tmp_path, "shm")
    assert not [n for _, _, names in os.walk(shm) for n in names if ".recv-" in n]
    assert not os.path.exists(os.path.join(local_dir.format(node=1), "step-00000002", MARKER_NAME))
    got = _ok(_without_durable(root, run_ranks, load_and_check, 3, root, local_dir, (2, 1), env=ONE, timeout=180))
    assert [(g["step"], g["k"]) for g in got] == [(2, 2)] * 3, got


def test_nodes_of_two_ranks(tmp_path: os.PathLike) -> None:
    """3 nodes x 2 ranks, 2+1 (each node's stream is both ranks' files): node 1 lost, then 6
    ranks load step 2 (node 1 rebuilt), and so do the 4 ranks of nodes 0 and 2 alone."""
    root, local_dir = _dirs(tmp_path)
    two = {"LOCAL_WORLD_SIZE": "2"}
    _ok(run_ranks(save_steps, 6, root, local_dir, (2, 1), [1, 2], env=two, timeout=180))
    for node in range(3):
        names = [os.path.basename(p).split("-")[0] for p in _files(local_dir.format(node=node), 2, "data")]
        assert sorted(names) == [str(2 * node), str(2 * node + 1)], (node, names)  # own files only
    pristine = _pristine(local_dir, 3)
    shutil.rmtree(local_dir.format(node=1))
    got = _ok(_without_durable(root, run_ranks, load_and_check, 6, root, local_dir, (2, 1), env=two, timeout=180))
    assert [(g["step"], g["k"]) for g in got] == [(2, 2)] * 6, got
    for node in range(3):
        shutil.rmtree(local_dir.format(node=node), ignore_errors=True)
        if node != 1:
            shutil.copytree(pristine.format(node=node), local_dir.format(node=node))
    args = (root, local_dir, (2, 1), [0, 0, 2, 2])
    got = _ok(_without_durable(root, run_ranks, load_and_check, 4, *args, env=two, timeout=180))
    assert [(g["step"], g["k"], g["source"]) for g in got] == [(2, 2, "peers")] * 4, got
