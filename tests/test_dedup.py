"""Dedup (``CheckpointManager(dedup=True)``) on real process groups, real kills and real S3.

A training-like state has a frozen part (1.5 MiB of row shards plus a replicated table) and
a changing part (a flat shard, a bf16 row-sharded moment, a replicated schedule, and a tensor
that changes only on odd steps, so that a step references tiles of several older saves).
Every value is a pure function of the step, so a load is checked bit for bit against it;
bytes are counted on disk (or in the bucket), never taken from the library's own report.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import signal
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tessera
from tessera.engine.tile_pins import read_pins
from tessera.errors import MissingTilesError
from tessera.manager import CheckpointManager
from tessera.storage import FileStorage, FsspecStorage
from tests.crash_worker import log_progress, read_progress, wait_for_line
from tests.dist_utils import run_distributed, start, start_ranks
from tests.s3_server import moto_endpoint, s3_bucket, s3_client, s3_options  # noqa: F401 - fixtures

NO_TIMINGS = tessera.LoadOptions(record_timings=False)
KILLED = -signal.SIGKILL
TILES = ".tessera-tiles"
PINS = ".pins"

# -- The state ---------------------------------------------------------------------------------

ROWS, COLS = 48, 8192  # frozen, row-sharded: 1.5 MiB of float32 (48 rows split over 1, 2 or 3 ranks)
EMB = 16384  # frozen, replicated: 64 KiB of int32
FLAT = (30, 70)  # changing, FlatShard with uneven ranges: 8400 bytes of float32
MOM = (48, 64)  # changing, row-sharded bfloat16: 6144 bytes
SCHED = 16  # changing, replicated float64: 128 bytes
ODD = 256  # changes on odd steps only, replicated float32: 1024 bytes

FROZEN_BYTES = ROWS * COLS * 4 + EMB * 4
CHANGING_BYTES = math.prod(FLAT) * 4 + math.prod(MOM) * 2 + SCHED * 8  # plus ODD * 4 on odd steps
OVERHEAD = 8 * 1024  # safetensors headers, manifests, owner markers, `latest`: far below FROZEN_BYTES


def changing_bytes(step: int) -> int:
    return CHANGING_BYTES + (ODD * 4 if step % 2 else 0)


def truth(step: int, job: int = 0) -> dict[str, Any]:
    """The global state at ``step``; ``job`` changes every value (two jobs share no tile)."""
    return {
        "base": {
            "w": torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * 0.25 + 1000 * job,
            "emb": torch.arange(EMB, dtype=torch.int32) * 3 + job,
        },
        "lora": {
            "a": (torch.arange(math.prod(FLAT), dtype=torch.float64) * 0.37 + step * 1.5 + job).float().reshape(FLAT)
        },
        "opt": {
            "m": ((torch.arange(math.prod(MOM)) % 97 + step + job) % 256).reshape(MOM).to(torch.bfloat16),
            "sched": torch.full((SCHED,), step + 0.5 * job, dtype=torch.float64),
            "odd": torch.arange(ODD, dtype=torch.float32) + 10 * ((step + 1) // 2) + job,
        },
        "step": step,
    }


def _flat_bounds(world: int) -> list[int]:
    n = math.prod(FLAT)
    return [n * r * (r + 1) // (world * (world + 1)) for r in range(world + 1)]  # uneven on purpose


def rank_state(step: int, rank: int, world: int, job: int = 0) -> dict[str, Any]:
    """What ``rank`` of ``world`` holds of ``truth(step, job)``."""
    t = truth(step, job)
    rows = ROWS // world
    mrows = MOM[0] // world
    lo, hi = _flat_bounds(world)[rank : rank + 2]
    return {
        "base": {
            "w": tessera.ShardedTensor(
                t["base"]["w"][rank * rows : (rank + 1) * rows].clone(), (ROWS, COLS), (rank * rows, 0)
            ),
            "emb": t["base"]["emb"],
        },
        "lora": {"a": tessera.FlatShard(t["lora"]["a"].reshape(-1)[lo:hi].clone(), FLAT, lo)},
        "opt": {
            "m": tessera.ShardedTensor(
                t["opt"]["m"][rank * mrows : (rank + 1) * mrows].clone(), MOM, (rank * mrows, 0)
            ),
            "sched": t["opt"]["sched"],
            "odd": t["opt"]["odd"],
        },
        "step": step,
    }


def _tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {}
    for group in ("base", "lora", "opt"):
        for name, v in state[group].items():
            local = (
                v.local
                if isinstance(v, tessera.ShardedTensor)
                else v.local_1d
                if isinstance(v, tessera.FlatShard)
                else v
            )
            out[f"{group}.{name}"] = local
    return out


def blank(rank: int, world: int) -> dict[str, Any]:
    """A target shaped like ``rank_state`` (``world`` 0: plain global tensors, one process), zeroed."""
    state = truth(0) if world == 0 else rank_state(0, rank, world)
    for t in _tensors(state).values():
        t.zero_()
    state["step"] = -1
    return state


def mismatches(state: dict[str, Any], step: int, rank: int, world: int, job: int = 0) -> list[str]:
    """The tensors of ``state`` that are not bit for bit those of ``step`` (empty: all exact)."""
    want = truth(step, job) if world == 0 else rank_state(step, rank, world, job)
    got_t, want_t = _tensors(state), _tensors(want)
    bad = [n for n in want_t if not (got_t[n].dtype == want_t[n].dtype and torch.equal(got_t[n], want_t[n]))]
    if state["step"] != step:
        bad.append(f"step={state['step']}")
    return bad


def load_step(url: str, rank: int = 0, world: int = 0, **kw: Any) -> dict[str, Any]:
    state = blank(rank, world)
    tessera.load(url, state, options=NO_TIMINGS, **kw)
    return state


# -- What is on disk ---------------------------------------------------------------------------


def files_under(root: str) -> dict[str, tuple[int, int, int]]:
    """Every file under ``root``: (size, inode, mtime_ns), to tell new or replaced files."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            try:
                st = os.stat(p)
            except FileNotFoundError:
                continue
            out[p] = (st.st_size, st.st_ino, st.st_mtime_ns)
    return out


def new_bytes(before: dict[str, tuple[int, int, int]], after: dict[str, tuple[int, int, int]]) -> int:
    return sum(v[0] for p, v in after.items() if before.get(p) != v)


def tile_dirs(root: str) -> set[str]:
    """Save-id directories in the root's shared tile directory (pins left out)."""
    path = os.path.join(root, TILES)
    return {n for n in os.listdir(path) if n != PINS} if os.path.isdir(path) else set()


def referenced_dirs(url: str, **kw: Any) -> set[str]:
    """Shared directories a committed step's manifest references."""
    return {f.path.split("/")[1] for f in tessera.read_manifest(url, **kw).files if f.path.startswith("@tiles/")}


def check_root(root: str, steps: Iterable[int] | None = None) -> dict[int, set[str]]:
    """Every committed step (or ``steps``, which must be exactly the committed ones) verifies and
    loads bit-exactly; returns the shared directories each references."""
    mgr = CheckpointManager(root)
    found = mgr.steps()
    if steps is not None:
        assert found == sorted(steps), found
    refs = {}
    for s in found:
        url = mgr.step_url(s)
        report = tessera.verify(url)
        assert report.ok, report.summary()
        bad = mismatches(load_step(url), s, 0, 0)
        assert not bad, f"step {s}: {bad} differ"
        refs[s] = referenced_dirs(url)
    return refs


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# -- 1, 2: dedup on and off load the same bits, on 1 and 3 ranks; a resharded load ----------------


def save_steps(rank: int, world: int, roots: dict[bool, str], steps: list[int]) -> dict[bool, list[int]]:
    """Save ``steps`` under each root (dedup off and on); rank 0 returns the bytes each save added."""
    added: dict[bool, list[int]] = {False: [], True: []}
    for dedup, root in roots.items():
        with CheckpointManager(root, dedup=dedup, load_options=NO_TIMINGS) as mgr:
            for s in steps:
                _barrier()
                before = files_under(root) if rank == 0 else {}
                mgr.save(s, rank_state(s, rank, world))
                _barrier()  # rank 0 returns after `latest` and collection; the others at the commit
                if rank == 0:
                    added[dedup].append(new_bytes(before, files_under(root)))
    return added


def load_every_step(rank: int, world: int, roots: dict[bool, str], steps: list[int]) -> list[str]:
    """Load every step of both roots into fresh state (on this rank's layout); what differs."""
    problems = []
    for s in steps:
        loaded = {}
        for dedup, root in roots.items():
            state = loaded[dedup] = load_step(f"{root}/step-{s:08d}", rank, world)
            problems += [f"rank {rank} step {s} dedup={dedup}: {n}" for n in mismatches(state, s, rank, world)]
        a, b = _tensors(loaded[False]), _tensors(loaded[True])
        problems += [f"rank {rank} step {s}: {n} differs on/off" for n in a if not torch.equal(a[n], b[n])]
    return problems


def save_and_load(
    rank: int, world: int, roots: dict[bool, str], steps: list[int]
) -> tuple[dict[bool, list[int]], list[str]]:
    added = save_steps(rank, world, roots, steps)
    _barrier()
    return added, load_every_step(rank, world, roots, steps)


STEPS = [1, 2, 3]


def _check_bytes(added: dict[bool, list[int]]) -> None:
    off, on = added[False], added[True]
    assert all(n >= FROZEN_BYTES + CHANGING_BYTES for n in off), off
    assert on[0] >= FROZEN_BYTES + changing_bytes(1), on  # the first save writes everything
    for s, n in zip(STEPS[1:], on[1:]):
        # A later save writes the changing tensors (and nothing of the frozen 1.5 MiB).
        assert changing_bytes(s) <= n <= changing_bytes(s) + OVERHEAD, (s, n, on)


@pytest.fixture(scope="module")
def saved_on_3_ranks(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[bool, str], dict[bool, list[int]], list[list[str]]]:
    """Both roots saved on 3 gloo ranks, each step loaded back on the same ranks."""
    base = tmp_path_factory.mktemp("three-ranks")
    roots = {False: str(base / "plain"), True: str(base / "dedup")}
    out = run_distributed(save_and_load, 3, roots, STEPS)
    return roots, out[0][0], [o[1] for o in out]


def test_dedup_loads_the_same_bits_on_one_process_and_writes_only_what_changed(tmp_path: Path) -> None:
    roots = {False: str(tmp_path / "plain"), True: str(tmp_path / "dedup")}
    added, problems = save_and_load(0, 1, roots, STEPS)  # no process group
    assert problems == []
    _check_bytes(added)
    # And into plain global tensors, as a user without shard types loads it.
    for s in STEPS:
        assert mismatches(load_step(f"{roots[True]}/step-{s:08d}"), s, 0, 0) == []
    refs = check_root(roots[True], STEPS)
    first = tessera.read_manifest(f"{roots[True]}/step-00000001").save_id
    assert all(first in refs[s] for s in STEPS)  # the frozen part is stored once
    assert tile_dirs(roots[True]) == set().union(*refs.values())


def test_dedup_loads_the_same_bits_on_three_ranks_and_writes_only_what_changed(saved_on_3_ranks) -> None:
    roots, added, problems = saved_on_3_ranks
    assert problems == [[], [], []]
    _check_bytes(added)
    refs = check_root(roots[True], STEPS)
    ids = {s: tessera.read_manifest(f"{roots[True]}/step-{s:08d}").save_id for s in STEPS}
    # Step 2 references step 1's directory (frozen part, `odd`); step 3 still step 1's (frozen).
    assert refs[2] == {ids[1], ids[2]} and refs[3] == {ids[1], ids[3]}, (refs, ids)
    assert os.listdir(f"{roots[True]}/step-00000003") == ["manifest.json"]  # nothing in the step itself


def load_and_go_on(rank: int, world: int, root: str, steps: list[int]) -> list[str]:
    """Load every step on this world's layout, then save the next step there with dedup."""
    problems = load_every_step(rank, world, {True: root, False: root}, steps)
    nxt = steps[-1] + 1
    with CheckpointManager(root, dedup=True) as mgr:  # builds on `latest`, a step of another world
        mgr.save(nxt, rank_state(nxt, rank, world))
    _barrier()
    return problems + mismatches(load_step(f"{root}/step-{nxt:08d}", rank, world), nxt, rank, world)


def test_a_dedup_root_saved_on_3_ranks_loads_on_2_ranks_and_on_one_process(saved_on_3_ranks, tmp_path) -> None:
    roots, _, _ = saved_on_3_ranks
    root = str(tmp_path / "dedup")
    shutil.copytree(roots[True], root)  # the whole root, its shared tiles included
    assert run_distributed(load_and_go_on, 2, root, STEPS) == [[], []]
    for s in STEPS:
        assert mismatches(load_step(f"{roots[True]}/step-{s:08d}"), s, 0, 0) == []
    # Step 4, saved on 2 ranks, references the replicated tensors that did not change (same box on
    # any world: the frozen table of step 1, `odd` of step 3) and writes the row shards, whose
    # boxes differ.
    refs = check_root(root, [*STEPS, 4])
    ids = _save_ids(root)
    assert refs[4] == {ids[1], ids[3], ids[4]}, (refs, ids)
    assert sum(os.path.getsize(p) for p in Path(root, TILES, ids[4]).iterdir()) >= FROZEN_BYTES - EMB * 4


def test_async_dedup_saves_write_what_changed_and_load_what_was_staged(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    added = []
    with CheckpointManager(root, dedup=True, async_save=True) as mgr:
        for s in STEPS:
            before = files_under(root)
            state = rank_state(s, 0, 1)
            pending = mgr.save(s, state)
            assert isinstance(pending, tessera.PendingSave)
            pending.wait_staged()
            for t in _tensors(state).values():  # training goes on: the save must not see it
                t.add_(1)
            pending.wait()
            added.append(new_bytes(before, files_under(root)))
    assert added[0] >= FROZEN_BYTES
    assert all(changing_bytes(s) <= n <= changing_bytes(s) + OVERHEAD for s, n in zip(STEPS[1:], added[1:])), added
    refs = check_root(root, STEPS)
    assert tile_dirs(root) == set().union(*refs.values())


# -- 3: steps deleted by retention or by hand ------------------------------------------------------


def _save(mgr: CheckpointManager, steps: Iterable[int], job: int = 0) -> None:
    for s in steps:
        mgr.save(s, rank_state(s, 0, 1, job))


def _save_ids(root: str) -> dict[int, str]:
    mgr = CheckpointManager(root)
    return {s: tessera.read_manifest(mgr.step_url(s)).save_id for s in mgr.steps()}


def test_retention_keeps_every_directory_a_kept_step_references(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    ids: dict[int, str] = {}
    with CheckpointManager(root, dedup=True, keep_last=2) as mgr:
        for s in range(1, 6):
            _save(mgr, [s])
            ids.update(_save_ids(root))
    refs = check_root(root, [4, 5])
    # Step 4 takes `odd` from step 3 (deleted) and the frozen part from step 1 (deleted).
    assert refs[4] == {ids[1], ids[3], ids[4]} and refs[5] == {ids[1], ids[5]}, (refs, ids)
    assert tile_dirs(root) == {ids[1], ids[3], ids[4], ids[5]}  # step 2's directory was collected
    assert not os.path.exists(os.path.join(root, TILES, PINS))  # every save removed its pin


def test_collection_removes_dead_pins_and_empty_directories_of_killed_saves(tmp_path: Path) -> None:
    """What a save killed early leaves (a pin, an empty directory, files) goes once the save cannot commit."""
    root = str(tmp_path / "run")
    with CheckpointManager(root, dedup=True) as mgr:
        _save(mgr, [1])
    tiles = os.path.join(root, TILES)
    os.makedirs(os.path.join(tiles, "0123456789abcdef"))  # killed between mkdir and its first file
    dead = os.path.join(tiles, "fedcba9876543210")  # killed mid-write: files, a pin, no owner marker
    os.makedirs(dead)
    with open(os.path.join(dead, "0-0.safetensors"), "wb") as f:
        f.write(b"x" * 100)
    FileStorage(tiles).write_atomic(
        f"{PINS}/fedcba9876543210",
        b'{"save_id": "fedcba9876543210", "checkpoint": "%s", "dirs": [], "created": %f}'
        % (os.path.join(root, "step-00000002").encode(), time.time() - 3600),
    )
    young = os.path.join(tiles, "aaaaaaaaaaaaaaaa")  # rank 1 of a save whose rank 0 has not claimed yet: spared
    os.makedirs(young)
    with open(os.path.join(young, "1-0.safetensors"), "wb") as f:
        f.write(b"y")
    FileStorage(tiles).write_atomic(
        f"{PINS}/aaaaaaaaaaaaaaaa.r1",
        b'{"save_id": "aaaaaaaaaaaaaaaa", "checkpoint": "%s", "dirs": [], "created": %f}'
        % (os.path.join(root, "step-00000003").encode(), time.time()),
    )
    with CheckpointManager(root, dedup=True) as mgr:
        mgr.apply_retention()
    left = sorted(os.listdir(tiles))
    assert "0123456789abcdef" not in left and "fedcba9876543210" not in left, left
    assert "aaaaaaaaaaaaaaaa" in left and [p.save_id for p in read_pins(FileStorage(tiles))] == ["aaaaaaaaaaaaaaaa"]
    check_root(root, [1])


def test_steps_removed_by_hand_leave_the_others_loadable(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    with CheckpointManager(root, dedup=True) as mgr:
        _save(mgr, range(1, 6))
        ids = _save_ids(root)
        shutil.rmtree(mgr.step_url(1))  # holds the frozen part every step references
        shutil.rmtree(mgr.step_url(3))  # holds the `odd` that step 4 references
        _save(mgr, [6])  # collection runs after the commit
        refs = check_root(root, [2, 4, 5, 6])
        assert tile_dirs(root) == set().union(*refs.values())
        assert {ids[1], ids[3]} <= tile_dirs(root)
        # The step this manager builds on goes too (step 7, whose directory holds the `odd` that
        # step 8 would reuse): its tiles are no longer protected by any manifest, so step 8 must
        # not reference them; it writes everything again.
        _save(mgr, [7])
        ids7 = _save_ids(root)[7]
        shutil.rmtree(mgr.step_url(7))
        before = files_under(root)
        _save(mgr, [8])
        assert new_bytes(before, files_under(root)) >= FROZEN_BYTES
    refs = check_root(root, [2, 4, 5, 6, 8])
    assert refs[8] == {_save_ids(root)[8]}, refs
    assert ids7 not in tile_dirs(root)  # only step 7 referenced it: collected
    assert tile_dirs(root) == set().union(*refs.values())
    # A fresh manager builds on `latest` (step 8: it writes only what changed), and its
    # collection breaks none of the steps retention keeps.
    before = files_under(root)
    with CheckpointManager(root, dedup=True, keep_last=3) as mgr:
        _save(mgr, [9])
    assert new_bytes(before, files_under(root)) <= changing_bytes(9) + OVERHEAD
    refs = check_root(root, [6, 8, 9])
    assert tile_dirs(root) == set().union(*refs.values())


# -- 4: a step copied elsewhere by hand --------------------------------------------------------------


def test_a_step_copied_without_its_root_names_where_it_was_saved(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    with CheckpointManager(root, dedup=True) as mgr:
        _save(mgr, [1, 2])
        original = mgr.step_url(2)
    copy = str(tmp_path / "elsewhere" / "step-00000002")
    shutil.copytree(original, copy)
    with pytest.raises(MissingTilesError) as caught:
        load_step(copy)
    assert original in str(caught.value) and copy in str(caught.value), caught.value
    assert isinstance(caught.value, FileNotFoundError)
    assert not tessera.verify(copy).ok
    assert mismatches(load_step(original), 2, 0, 0) == []  # the original is untouched


# -- 5a: rank 0 SIGKILLed during dedup saves -------------------------------------------------------


class SlowStorage(FileStorage):
    """A real :class:`FileStorage` that sleeps a little before each write and delete, so that a
    kill at a random moment lands in any phase of a save (staging, pin, data, commit, collection)."""

    delay = 0.01

    def write_file(self, path: str, chunks: Any) -> None:
        time.sleep(self.delay)
        super().write_file(path, chunks)

    def write_atomic(self, path: str, data: bytes) -> None:
        time.sleep(self.delay)
        super().write_atomic(path, data)

    def delete(self, paths: Iterable[str]) -> None:
        time.sleep(self.delay)
        super().delete(paths)


def dedup_save_loop(rank: int, world: int, root: str, progress_dir: str, first: int, compress: bool = False) -> None:
    """Save k = first, first+1, ... under a dedup manager (keep_last=2) until killed."""
    torch.set_num_threads(1)
    progress = os.path.join(progress_dir, str(rank))
    mgr = CheckpointManager(root, dedup=True, keep_last=2, storage_factory=SlowStorage, compress=compress)
    log_progress(progress, "ready")
    for k in range(first, first + 10**6):
        log_progress(progress, f"begin {k}")
        mgr.save(k, rank_state(k, rank, world))
        log_progress(progress, f"done {k}")


def _check_after_kill(root: str, progress_dir: str, world: int) -> str:
    begun = max(read_progress(os.path.join(progress_dir, str(r)))[0] for r in range(world))
    done = read_progress(os.path.join(progress_dir, "0"))[1]  # rank 0 returns after the commit
    refs = check_root(root)  # every committed step verifies and loads bit-exactly
    newest = max(refs, default=0)
    assert done <= newest <= begun, f"newest committed step {newest}; rank 0 finished {done}, began {begun}"
    # The next save builds on what is there and collects what the dead save left.
    nxt = max(begun, newest) + 1
    with CheckpointManager(root, dedup=True, keep_last=2) as mgr:
        _save(mgr, [nxt])
    refs = check_root(root)
    assert nxt in refs and len(refs) <= 2, refs
    left = tile_dirs(root) - set().union(*refs.values())
    assert left <= _committed_pins(root), f"unreferenced shared directories are left: {left}"
    return "new" if newest > done else "old" if begun > done else "idle"


def _committed_pins(root: str) -> set[str]:
    """What the pins of committed saves protect: a save killed between its commit and the removal
    of its pin leaves one, and it protects its directories as long as its step exists. So do the
    pins of a save whose rank 0 died before it claimed its path (no pin of rank 0): for their lease."""
    out: set[str] = set()
    pins = read_pins(FileStorage(os.path.join(root, TILES)))
    claimed = {p.save_id for p in pins if p.rank == 0}
    for pin in pins:
        if pin.save_id not in claimed:
            out |= pin.protects
            continue
        try:
            if tessera.read_manifest(pin.checkpoint).save_id == pin.save_id:
                out |= pin.protects
        except tessera.CheckpointNotFoundError:
            pass
    return out


def _kill_trials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, world: int, n: int, seed: int, compress: bool = False
) -> dict[str, int]:
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    for trial in range(n):
        root = str(tmp_path / f"run-{trial}")
        progress = str(tmp_path / f"progress-{trial}")
        os.makedirs(progress)
        with CheckpointManager(root, dedup=True, compress=compress) as mgr:
            _save(mgr, [1])  # a committed step with the frozen part, to build on
        if world == 1:
            proc = start(dedup_save_loop, 0, 1, root, progress, 2, compress)
            wait_for_line(os.path.join(progress, "0"), "ready")
            proc.join(rng.uniform(0.05, 0.8))
            proc.kill()
            proc.join()
            assert proc.exitcode == KILLED, f"trial {trial}: the saver ended by itself ({proc.exitcode})"
        else:
            group = start_ranks(dedup_save_loop, world, root, progress, 2, env={"TESSERA_TIMEOUT_S": "10"})
            for r in range(world):
                wait_for_line(os.path.join(progress, str(r)), "ready")
            group.procs[0].join(rng.uniform(0.1, 1.0))
            group.kill(0)
            out = group.collect(40)
            assert out[0].status == "died", out[0]
            for o in out[1:]:  # the others learn that rank 0 is gone, and stop
                assert o.status == "error" and o.error_is("DistributedError"), o
        what = _check_after_kill(root, progress, world)
        outcomes[what] = outcomes.get(what, 0) + 1
    return outcomes


def test_a_dedup_saver_killed_at_random_moments_leaves_every_committed_step(tmp_path, monkeypatch) -> None:
    outcomes = _kill_trials(tmp_path, monkeypatch, world=1, n=4, seed=5)
    print(f"one process killed: {outcomes}")
    assert sum(outcomes.values()) == 4, outcomes


@pytest.mark.slow
def test_a_saver_of_delta_tiles_killed_at_random_moments_leaves_every_committed_step(tmp_path, monkeypatch) -> None:
    """The same with compress=True: delta chains (compression docs), parents kept by every step."""
    outcomes = _kill_trials(tmp_path, monkeypatch, world=1, n=4, seed=7, compress=True)
    print(f"one process of delta tiles killed: {outcomes}")
    assert sum(outcomes.values()) == 4, outcomes


@pytest.mark.slow
def test_rank_0_of_3_killed_during_dedup_saves_leaves_every_committed_step(tmp_path, monkeypatch) -> None:
    outcomes = _kill_trials(tmp_path, monkeypatch, world=3, n=3, seed=6)
    print(f"three ranks, rank 0 killed: {outcomes}")
    assert sum(outcomes.values()) == 3, outcomes


# -- 5b: collection SIGKILLed midway -----------------------------------------------------------------


class SlowTileDeletes(FileStorage):
    """A real :class:`FileStorage`; in the shared tile directory each delete logs and takes a while."""

    progress = ""

    def delete(self, paths: Iterable[str]) -> None:
        paths = list(paths)
        if self.root.rstrip("/").endswith(TILES) and paths:
            log_progress(self.progress, f"deleting {paths[0]}")
            time.sleep(0.15)
        super().delete(paths)


def collect_slowly(root: str, progress: str) -> None:
    torch.set_num_threads(1)
    SlowTileDeletes.progress = progress
    CheckpointManager(root, dedup=True, keep_last=1, storage_factory=SlowTileDeletes).apply_retention()
    log_progress(progress, "finished")


def _count(progress: str, prefix: str) -> int:
    if not os.path.exists(progress):
        return 0
    with open(progress) as f:
        return sum(1 for line in f if line.startswith(prefix))


def test_collection_killed_midway_leaves_committed_steps_and_the_next_one_finishes(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    with CheckpointManager(root, dedup=True) as mgr:  # keep all: nothing collected yet
        _save(mgr, range(1, 9))
    ids = _save_ids(root)
    assert tile_dirs(root) == set(ids.values())
    progress = str(tmp_path / "progress")
    proc = start(collect_slowly, root, progress)
    deadline = time.monotonic() + 60
    while _count(progress, "deleting") < 3:  # retention is over; collection is on its 3rd directory
        assert proc.is_alive() and time.monotonic() < deadline, f"collection ended early ({proc.exitcode})"
        time.sleep(0.01)
    proc.kill()
    proc.join()
    assert proc.exitcode == KILLED and _count(progress, "finished") == 0
    refs = check_root(root, [8])  # retention had deleted steps 1-7; step 8 is intact
    assert refs[8] == {ids[1], ids[7], ids[8]}, (refs, ids)  # frozen from 1, `odd` from 7
    left = tile_dirs(root) - refs[8]
    assert 0 < len(left) < 5, left  # some unreferenced directories are still there
    CheckpointManager(root, dedup=True, keep_last=1).apply_retention()
    assert tile_dirs(root) == refs[8]
    check_root(root, [8])


# -- 6: two jobs on one root ------------------------------------------------------------------------


class GatedStorage(FileStorage):
    """A real :class:`FileStorage` that, once armed, stops a save at one point until ``gate`` exists:
    ``"write"`` (its first data file in the shared tile directory: after the pin) or ``"publish"``
    (its manifest: every tile written and checked)."""

    at = ""
    entered = ""
    gate = ""

    def _wait(self) -> None:
        cls = type(self)
        if not cls.gate:
            return
        gate, cls.gate = cls.gate, ""
        log_progress(cls.entered, "entered")
        deadline = time.monotonic() + 60
        while not os.path.exists(gate):
            assert time.monotonic() < deadline, f"{gate} never appeared"
            time.sleep(0.01)

    def write_file(self, path: str, chunks: Any) -> None:
        if self.at == "write" and self.root.rstrip("/").endswith(TILES):
            self._wait()
        super().write_file(path, chunks)

    def write_atomic(self, path: str, data: bytes) -> None:
        if self.at == "publish" and path == "manifest.json":
            self._wait()
        super().write_atomic(path, data)

    def replace_if(self, path: str, data: bytes, expected: str | None, **kw: Any) -> None:
        if self.at == "publish" and path == "manifest.json":
            self._wait()
        super().replace_if(path, data, expected, **kw)


def job_b(root: str, control: str, at: str) -> None:
    """Job B: save step 1, wait for ``go``, then save step 4 stopped at ``at`` until ``gate``."""
    torch.set_num_threads(1)
    GatedStorage.at = at
    with CheckpointManager(root, dedup=True, storage_factory=GatedStorage) as mgr:
        _save(mgr, [1], job=1)
        log_progress(os.path.join(control, "b"), "saved 1")
        wait_for_line(os.path.join(control, "b"), "go")
        GatedStorage.entered = os.path.join(control, "b")
        GatedStorage.gate = os.path.join(control, "gate")
        try:
            _save(mgr, [4], job=1)
            log_progress(os.path.join(control, "b"), "saved 4")
        except BaseException as e:
            log_progress(os.path.join(control, "b"), f"failed {type(e).__name__}: {e}")


@pytest.mark.parametrize("at", ["write", "publish"])
def test_another_jobs_collection_spares_what_a_save_in_flight_references(tmp_path: Path, at: str) -> None:
    root = str(tmp_path / "run")
    control = str(tmp_path / "control")
    os.makedirs(control)
    b_log = os.path.join(control, "b")
    proc = start(job_b, root, control, at)
    wait_for_line(b_log, "saved 1")
    with CheckpointManager(root, dedup=True) as job_a:  # keeps everything; shares no tile with B...
        _save(job_a, [2], job=0)
        _save(job_a, [3], job=2)  # ...nor step 3 with step 2: step 2's directory is collectable
    ids = _save_ids(root)
    log_progress(b_log, "go")
    wait_for_line(b_log, "entered")
    # B's step 4 is pinned and in flight; job A applies keep_last=1: steps 1 and 2 go.
    assert CheckpointManager(root, dedup=True, keep_last=1).apply_retention() == [1, 2]
    assert ids[2] not in tile_dirs(root)  # the collection ran...
    assert ids[1] in tile_dirs(root)  # ...and spared what B's pin names
    Path(control, "gate").touch()
    proc.join(60)
    assert proc.exitcode == 0
    assert "saved 4" in Path(b_log).read_text().splitlines(), Path(b_log).read_text()  # or why it failed
    url = f"{root}/step-00000004"
    report = tessera.verify(url)
    assert report.ok, report.summary()
    assert mismatches(load_step(url), 4, 0, 0, job=1) == []
    assert ids[1] in referenced_dirs(url)  # B really built on its step 1
    # Once B's pin is gone, the next collection keeps exactly what the kept steps reference.
    CheckpointManager(root, dedup=True, keep_last=1).apply_retention()
    assert tile_dirs(root) == referenced_dirs(url)
    assert mismatches(load_step(url), 4, 0, 0, job=1) == []


class HookedStorage(FileStorage):
    """A real :class:`FileStorage` that runs ``hook`` once, when the pins are listed."""

    hook: Any = None

    def list(self, prefix: str = "") -> list[str]:
        cls = type(self)
        if prefix == PINS and cls.hook is not None:
            hook, cls.hook = cls.hook, None
            hook()
        return super().list(prefix)


def test_a_save_that_commits_while_another_job_collects_keeps_its_tiles(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    with CheckpointManager(root, dedup=True, keep_last=1, storage_factory=HookedStorage) as job_a:
        _save(job_a, [1, 2])

        def job_b_saves() -> None:  # between job A's listing of manifests and its listing of pins
            with CheckpointManager(root, dedup=True) as job_b:
                _save(job_b, [3])

        HookedStorage.hook = job_b_saves
        try:
            job_a.apply_retention()
        finally:
            HookedStorage.hook = None
    url = f"{root}/step-00000003"
    assert tessera.read_manifest(url).save_id in referenced_dirs(url)  # step 3 wrote its changed tiles
    report = tessera.verify(url)
    assert report.ok, report.summary()
    assert mismatches(load_step(url), 3, 0, 0) == []


# -- 7: S3 (moto on loopback) ---------------------------------------------------------------------


def _objects(endpoint: str, bucket: str, prefix: str) -> dict[str, int]:
    client = s3_client(endpoint)
    out: dict[str, int] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        out.update({o["Key"][len(prefix) :]: o["Size"] for o in page.get("Contents", [])})
    return out


def _s3_dirs(objects: dict[str, int]) -> dict[str, int]:
    """Bytes per shared directory (pins left out)."""
    out: dict[str, int] = {}
    for key, size in objects.items():
        parts = key.split("/")
        if parts[0] == TILES and parts[1] != PINS:
            out[parts[1]] = out.get(parts[1], 0) + size
    return out


@pytest.mark.s3
def test_dedup_on_s3_stores_the_frozen_part_once_and_survives_deleted_steps(moto_endpoint: str, s3_bucket: str) -> None:
    opts = s3_options(moto_endpoint)
    prefix = f"{uuid.uuid4().hex}/run/"
    root = f"s3://{s3_bucket}/{prefix}".rstrip("/")
    added = []
    with CheckpointManager(root, dedup=True, storage_options=opts, load_options=NO_TIMINGS) as mgr:
        for s in (1, 2, 3):
            before = _objects(moto_endpoint, s3_bucket, prefix)
            _save(mgr, [s])
            after = _objects(moto_endpoint, s3_bucket, prefix)
            added.append(sum(n for k, n in after.items() if before.get(k) != n))
        urls = {s: mgr.step_url(s) for s in (1, 2, 3)}
    assert added[0] >= FROZEN_BYTES
    assert all(changing_bytes(s) <= n <= changing_bytes(s) + OVERHEAD for s, n in zip((2, 3), added[1:])), added
    ids = {s: tessera.read_manifest(u, storage_options=opts).save_id for s, u in urls.items()}
    sizes = _s3_dirs(_objects(moto_endpoint, s3_bucket, prefix))
    assert set(sizes) == set(ids.values()) and sizes[ids[1]] >= FROZEN_BYTES, sizes
    # Step 2's objects deleted by hand; steps 1 and 3 still load bit-exactly.
    client = s3_client(moto_endpoint)
    step2 = [k for k in _objects(moto_endpoint, s3_bucket, prefix) if k.startswith("step-00000002/")]
    assert step2
    client.delete_objects(Bucket=s3_bucket, Delete={"Objects": [{"Key": prefix + k} for k in step2]})
    for s in (1, 3):
        assert mismatches(load_step(urls[s], storage_options=opts), s, 0, 0) == []
        report = tessera.verify(urls[s], storage=FsspecStorage(urls[s], opts))
        assert report.ok, report.summary()
    # Collection removes step 2's directory (nothing else references it), and only that.
    with CheckpointManager(root, dedup=True, storage_options=opts) as mgr:
        assert mgr.steps() == [1, 3]
        mgr.apply_retention()
    assert set(_s3_dirs(_objects(moto_endpoint, s3_bucket, prefix))) == {ids[1], ids[3]}
    for s in (1, 3):
        assert mismatches(load_step(urls[s], storage_options=opts), s, 0, 0) == []


# -- Arguments ---------------------------------------------------------------------------------------


def test_dedup_with_a_local_tier_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="dedup"):
        CheckpointManager(str(tmp_path / "run"), dedup=True, local_dir=str(tmp_path / "local"))
    assert not os.path.exists(tmp_path / "run" / TILES)


@pytest.mark.parametrize("changed_chunk", [0, 2, 4])
def test_a_tile_that_changes_in_any_chunk_is_written_whole_with_correct_checksums(
    tmp_path: Path, changed_chunk
) -> None:
    """The comparison stops at the first differing chunk and the write reuses the checksums found so far."""
    root = str(tmp_path / "run")
    opts = tessera.SaveOptions(chunk_bytes=4096)
    t = torch.arange(5 * 1024, dtype=torch.float32)  # five 4 KiB chunks
    with CheckpointManager(root, dedup=True, save_options=opts) as mgr:
        mgr.save(1, {"t": t})
        t[changed_chunk * 1024 + 7] = -1.0
        written = mgr.save(2, {"t": t}).bytes_written
    assert written >= t.numel() * 4  # the whole tile again, not only the chunk that changed
    report = tessera.verify(mgr.step_url(2))
    assert report.ok and report.bytes_checked >= t.numel() * 4, report.problems
    out = {"t": torch.zeros_like(t)}
    tessera.load(mgr.step_url(2), out)
    assert torch.equal(out["t"], t)


def delete_and_load_on_ranks(rank: int, world: int, root: str) -> list[str]:
    """Retention (keep_last=2) deletes steps 1 and 2, rank 0 removes step 3 by hand; every rank
    then loads step 4 and a step saved after the removal, bit for bit on its own layout."""
    with CheckpointManager(root, dedup=True, keep_last=2, load_options=NO_TIMINGS) as mgr:
        for s in (1, 2, 3, 4):
            mgr.save(s, rank_state(s, rank, world))
        _barrier()
        if rank == 0:
            shutil.rmtree(f"{root}/step-00000003")
        _barrier()
        mgr.save(5, rank_state(5, rank, world))
        _barrier()
        kept = mgr.steps()
    problems = [f"kept {kept}"] if kept != [4, 5] else []
    for s in (4, 5):
        problems += [
            f"step {s}: {n}" for n in mismatches(load_step(f"{root}/step-{s:08d}", rank, world), s, rank, world)
        ]
    return problems


def test_steps_deleted_by_retention_and_by_hand_leave_the_others_loadable_on_three_ranks(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    assert run_distributed(delete_and_load_on_ranks, 3, root) == [[], [], []]
    refs = check_root(root, [4, 5])  # every byte of both verifies, and nothing they use was collected
    assert tile_dirs(root) == refs[4] | refs[5]


def test_a_save_whose_shared_tiles_were_deleted_by_hand_fails_and_the_next_one_writes_everything(
    tmp_path: Path,
) -> None:
    """Deleting a directory of `.tessera-tiles` by hand breaks the steps that use it (verify says so);
    the save that would reference it fails its commit check, and the manager starts over."""
    root = str(tmp_path / "run")
    with CheckpointManager(root, dedup=True) as mgr:
        _save(mgr, [1, 2])
        first = tessera.read_manifest(mgr.step_url(1)).save_id
        shutil.rmtree(os.path.join(root, TILES, first))  # holds the frozen part every step uses
        assert not tessera.verify(mgr.step_url(2)).ok
        with pytest.raises(tessera.errors.CommitCheckError, match="shared tile file"):
            mgr.save(3, rank_state(3, 0, 1))
        before = files_under(root)
        mgr.save(4, rank_state(4, 0, 1))
        assert new_bytes(before, files_under(root)) >= FROZEN_BYTES + changing_bytes(4)
    assert mismatches(load_step(f"{root}/step-00000004"), 4, 0, 0) == []
    assert tessera.verify(f"{root}/step-00000004").ok
