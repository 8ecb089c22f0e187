"""CheckpointManager: step directories, the latest pointer, retention, resuming past bad steps."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
import warnings
from pathlib import Path

import pytest
import torch

import tessera
from tessera.manager import CheckpointManager, StepLoadResult, parse_step_dirname, step_dirname
from tessera.storage import FileStorage
from tests.dist_utils import run_distributed


def _state(step: int) -> dict:
    return {
        "model": {"w": torch.arange(64, dtype=torch.float32) * step, "b": torch.full((3, 5), step, dtype=torch.int32)},
        "step": step,
    }


def _blank() -> dict:
    return {"model": {"w": torch.zeros(64), "b": torch.zeros(3, 5, dtype=torch.int32)}, "step": -1}


def _assert_is(state: dict, step: int) -> None:
    want = _state(step)
    assert state["step"] == step
    assert torch.equal(state["model"]["w"], want["model"]["w"]) and torch.equal(state["model"]["b"], want["model"]["b"])


def _data_file(step_dir: str) -> str:
    for dirpath, _, files in os.walk(os.path.join(step_dir, "data")):
        for f in sorted(files):
            return os.path.join(dirpath, f)
    raise AssertionError(f"no data file under {step_dir}")


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path) -> str:
    """A manager root on the local filesystem and on fsspec's in-memory filesystem."""
    if request.param == "local":
        return str(tmp_path / "run")
    return f"memory://tessera-test-{uuid.uuid4().hex}/run"


# --------------------------------------------------------------------------------------
# Naming


def test_step_directory_names_round_trip_and_sort() -> None:
    names = [step_dirname(s) for s in (0, 7, 100, 99_999_999, 100_000_000, 123_456_789_012)]
    assert names[:3] == ["step-00000000", "step-00000007", "step-00000100"]
    assert [parse_step_dirname(n) for n in names] == [0, 7, 100, 99_999_999, 100_000_000, 123_456_789_012]
    for bad in ("step-100", "step-000000100", "step-0000010a", "latest", "step-", "xstep-00000001", "step--0000001"):
        assert parse_step_dirname(bad) is None, bad


@pytest.mark.parametrize(
    ("bad", "error"), [(-1, ValueError), (1.0, TypeError), ("3", TypeError), (True, TypeError), (None, TypeError)]
)
def test_bad_step_numbers_are_refused(tmp_path, bad, error) -> None:
    mgr = CheckpointManager(str(tmp_path))
    with pytest.raises(error, match="step"):
        mgr.save(bad, _state(1))


@pytest.mark.parametrize("kwargs", [{"keep_last": 0}, {"keep_every": 0}, {"keep_last": 2.5}, {"keep_every": -3}])
def test_bad_retention_arguments_are_refused(tmp_path, kwargs) -> None:
    with pytest.raises(ValueError, match="keep_"):
        CheckpointManager(str(tmp_path), **kwargs)


# --------------------------------------------------------------------------------------
# Save, list, load


@pytest.mark.parametrize("async_save", [False, True])
def test_save_and_resume_bit_exact(root: str, async_save: bool) -> None:
    with CheckpointManager(root, async_save=async_save) as mgr:
        assert mgr.steps() == [] and mgr.latest_step() is None and mgr.pointer_step() is None
        for step in (10, 20, 30):
            state = _state(step)
            out = mgr.save(step, state)
            if async_save:
                assert isinstance(out, tessera.PendingSave)
                out.wait_staged()
                state["model"]["w"].add_(1000)  # training continues; the save keeps its snapshot
                state["step"] = -5
            else:
                assert isinstance(out, tessera.SaveResult) and out.path == mgr.step_url(step)
        mgr.wait()
        assert mgr.steps() == [10, 20, 30] and mgr.latest_step() == 30 and mgr.pointer_step() == 30
    with CheckpointManager(root) as fresh:
        target = _blank()
        loaded = fresh.load(target)
        assert isinstance(loaded, StepLoadResult) and loaded.step == 30 and loaded.skipped == {}
        assert loaded.result.missing_keys == [] and loaded.result.bytes_read > 0
        _assert_is(target, 30)
        target = _blank()
        assert fresh.load(target, step=10).step == 10
        _assert_is(target, 10)
        # The step directory is an ordinary checkpoint.
        target = _blank()
        tessera.load(fresh.step_url(20), target)
        _assert_is(target, 20)


def test_layout_on_disk(tmp_path) -> None:
    root = str(tmp_path / "run")
    with CheckpointManager(root) as mgr:
        mgr.save(5, _state(5))
        mgr.save(1234, _state(1234))
    assert sorted(os.listdir(root)) == ["latest", "step-00000005", "step-00001234"]
    assert Path(root, "latest").read_text() == "step-00001234\n"
    assert os.path.exists(os.path.join(root, "step-00001234", "manifest.json"))


def test_pointer_only_moves_forward(tmp_path) -> None:
    with CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(50, _state(50))
        mgr.save(40, _state(40))  # an older step number saved later
        assert mgr.pointer_step() == 50 and mgr.latest_step() == 50


def test_saving_an_existing_step_replaces_it(tmp_path) -> None:
    with CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(3, _state(3))
        mgr.save(3, _state(4) | {"step": 3, "model": _state(4)["model"]})
        target = _blank()
        mgr.load(target)
        assert target["step"] == 3 and torch.equal(target["model"]["w"], _state(4)["model"]["w"])
        assert len(os.listdir(os.path.join(mgr.step_url(3), "data"))) == 1


def test_foreign_files_under_root_are_ignored(tmp_path) -> None:
    root = tmp_path / "run"
    (root / "notes").mkdir(parents=True)
    (root / "notes" / "readme.txt").write_text("hi")
    (root / "step-12").mkdir()  # not canonical
    (root / "step-12" / "manifest.json").write_text("{}")
    (root / "step-00000009x").mkdir()
    with CheckpointManager(str(root), keep_last=1) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
        assert mgr.steps() == [2]
    assert (root / "notes" / "readme.txt").exists() and (root / "step-12" / "manifest.json").exists()


# --------------------------------------------------------------------------------------
# Retention


@pytest.mark.parametrize(
    ("keep_last", "keep_every", "expected"),
    [
        (None, None, list(range(1, 13))),
        (1, None, [12]),
        (3, None, [10, 11, 12]),
        (2, 5, [5, 10, 11, 12]),
        (1, 4, [4, 8, 12]),
        (None, 4, list(range(1, 13))),
    ],
)
def test_retention(root: str, keep_last, keep_every, expected) -> None:
    with CheckpointManager(root, keep_last=keep_last, keep_every=keep_every, async_save=True) as mgr:
        for step in range(1, 13):
            mgr.save(step, _state(step))
        mgr.wait()
        assert mgr.steps() == expected
        assert mgr.latest_step() == 12 and mgr.pointer_step() == 12


def test_retention_keeps_the_pointer_step_and_removes_dead_leftovers(tmp_path) -> None:
    root = tmp_path / "run"
    with CheckpointManager(str(root), keep_last=1) as mgr:
        mgr.save(50, _state(50))
        mgr.save(40, _state(40))  # pointer stays at 50, the newest
        assert mgr.steps() == [40, 50]  # the step just saved is never deleted by its own retention
        # Leftovers of crashed saves: one older than the next commit, one newer.
        for step in (45, 70):
            d = root / step_dirname(step) / "data" / "abc"
            d.mkdir(parents=True)
            (d / "0-0.safetensors").write_bytes(b"partial")
        mgr.save(60, _state(60))
        assert mgr.steps() == [60] and mgr.pointer_step() == 60
    names = sorted(os.listdir(root))
    assert names == ["latest", "step-00000060", "step-00000070"], names  # no empty directories left


def test_retention_never_deletes_the_step_latest_names(tmp_path) -> None:
    with CheckpointManager(str(tmp_path), keep_last=1) as mgr:
        mgr.save(100, _state(100))
        mgr.save(7, _state(7))  # older number: latest still names 100, which must survive
        assert 100 in mgr.steps() and mgr.pointer_step() == 100


class _NoPointerStorage(FileStorage):
    """Fails every write of ``latest``: the pointer lags behind the commits."""

    def write_atomic(self, path: str, data: bytes) -> None:
        if path == "latest":
            raise tessera.StorageError("injected: cannot write latest")
        super().write_atomic(path, data)


def test_pointer_failure_does_not_fail_the_save_and_load_still_finds_the_newest(tmp_path, caplog) -> None:
    root = str(tmp_path / "run")
    with CheckpointManager(root) as mgr:
        mgr.save(1, _state(1))
    with CheckpointManager(root, storage_factory=_NoPointerStorage) as mgr:
        mgr.save(2, _state(2))
        assert "moving" in caplog.text and "latest" in caplog.text
        assert mgr.pointer_step() == 1 and mgr.latest_step() == 2
        target = _blank()
        assert mgr.load(target).step == 2
        _assert_is(target, 2)


class _InterruptedDelete(FileStorage):
    """Fails to delete the data of step 1: a deletion cut short after removing the manifest."""

    def delete(self, paths) -> None:
        paths = list(paths)
        if any(p.startswith("step-00000001/data/") for p in paths):
            raise tessera.StorageError("injected: connection lost while deleting")
        super().delete(paths)


def test_interrupted_deletion_leaves_an_incomplete_step_not_a_corrupt_one(tmp_path) -> None:
    root = str(tmp_path / "run")
    with CheckpointManager(root) as mgr:
        mgr.save(1, _state(1))
    with CheckpointManager(root, keep_last=1, storage_factory=_InterruptedDelete) as mgr:
        mgr.save(2, _state(2))  # retention deletes step 1: manifest first, then the rest fails
    assert os.path.exists(os.path.join(root, "step-00000001", "data"))
    assert not os.path.exists(os.path.join(root, "step-00000001", "manifest.json"))
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [2]
        mgr.save(3, _state(3))  # the next retention removes the leftover (older than step 3)
    assert sorted(os.listdir(root)) == ["latest", "step-00000002", "step-00000003"]


# --------------------------------------------------------------------------------------
# Resuming past incomplete and corrupt steps


def _saved_run(root: str, steps: list[int]) -> CheckpointManager:
    mgr = CheckpointManager(root)
    for s in steps:
        mgr.save(s, _state(s))
    return mgr


@pytest.mark.parametrize("damage", ["incomplete", "garbage_manifest", "flipped_bit", "missing_file", "truncated"])
def test_load_skips_a_bad_newest_step_with_a_warning(tmp_path, damage: str) -> None:
    root = str(tmp_path / "run")
    mgr = _saved_run(root, [1, 2, 3])
    step3 = mgr.step_url(3)
    reason = {
        "incomplete": "incomplete",
        "garbage_manifest": "invalid manifest",
        "flipped_bit": "checksum mismatch",
        "missing_file": "missing",
        "truncated": "truncated",
    }[damage]
    if damage == "incomplete":
        os.remove(os.path.join(step3, "manifest.json"))
    elif damage == "garbage_manifest":
        with open(os.path.join(step3, "manifest.json"), "r+b") as f:
            f.truncate(100)
    elif damage == "flipped_bit":
        path = _data_file(step3)
        raw = bytearray(Path(path).read_bytes())
        raw[-3] ^= 0x10
        Path(path).write_bytes(raw)
    elif damage == "missing_file":
        os.remove(_data_file(step3))
    else:
        path = _data_file(step3)
        os.truncate(path, os.path.getsize(path) - 9)
    target = _blank()
    with pytest.warns(RuntimeWarning, match=rf"skipping checkpoint step 3 .*{reason}"):
        loaded = mgr.load(target)
    assert loaded.step == 2 and list(loaded.skipped) == [3] and reason in loaded.skipped[3]
    _assert_is(target, 2)
    if damage != "incomplete":
        # Asked for explicitly, a bad step is an error, not a fallback.
        with pytest.raises(tessera.CorruptCheckpointError):
            mgr.load(_blank(), step=3)


def test_load_with_nothing_loadable_lists_every_reason(tmp_path) -> None:
    root = str(tmp_path / "run")
    mgr = _saved_run(root, [1, 2])
    os.remove(os.path.join(mgr.step_url(2), "manifest.json"))
    os.remove(_data_file(mgr.step_url(1)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(tessera.CheckpointNotFoundError) as info:
            mgr.load(_blank())
    assert "step 2: incomplete" in str(info.value) and "step 1: corrupt" in str(info.value)
    with pytest.raises(tessera.CheckpointNotFoundError, match="no steps"):
        CheckpointManager(str(tmp_path / "empty")).load(_blank())


def test_a_state_mismatch_is_raised_not_skipped(tmp_path) -> None:
    mgr = _saved_run(str(tmp_path / "run"), [1, 2])
    wrong = _blank()
    wrong["model"]["w"] = torch.zeros(65)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no step may be skipped for this
        with pytest.raises(tessera.StateMismatchError, match="'model.w'"):
            mgr.load(wrong)


def test_pickled_values_need_the_managers_opt_in(tmp_path) -> None:
    root = str(tmp_path / "run")
    with CheckpointManager(root, allow_pickle=True) as mgr:
        mgr.save(1, {"w": torch.ones(2), "obj": {1, 2, 3}})
    with CheckpointManager(root) as mgr, pytest.raises(tessera.errors.PickleNotAllowedError):
        mgr.load({"w": torch.zeros(2), "obj": None})
    with CheckpointManager(root, allow_pickle=True) as mgr:
        target = {"w": torch.zeros(2), "obj": None}
        mgr.load(target)
        assert target["obj"] == {1, 2, 3}


# --------------------------------------------------------------------------------------
# Lifecycle


def test_async_failure_is_raised_by_wait_and_never_lost(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    mgr = CheckpointManager(str(blocker / "run"), async_save=True)
    pending = mgr.save(1, _state(1))
    with pytest.raises(tessera.CheckpointError):
        pending.wait()
    mgr.save(2, _state(2))  # the failure was seen: not raised again
    with pytest.raises(tessera.CheckpointError):
        mgr.close()  # nobody waited for step 2: close() raises its failure
    with pytest.raises(ValueError, match="closed"):
        mgr.save(3, _state(3))


def test_context_manager_drains_the_pending_save(tmp_path) -> None:
    root = str(tmp_path / "run")
    with CheckpointManager(root, async_save=True) as mgr:
        mgr.save(1, _state(1))
    assert mgr._pending is None and mgr._thread is None
    assert CheckpointManager(root).steps() == [1]


_EXIT_SCRIPT = """
import sys, torch
from tessera.manager import CheckpointManager
mgr = CheckpointManager(sys.argv[1], async_save=True)
mgr.save(7, {"w": torch.arange(300000, dtype=torch.float32), "step": 7})
# no wait(), no close(): interpreter exit must finish the save
"""


def test_interpreter_exit_drains_a_pending_save(tmp_path) -> None:
    root = str(tmp_path / "run")
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, root], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr
    target = {"w": torch.zeros(300000), "step": 0}
    mgr = CheckpointManager(root)
    assert mgr.load(target).step == 7 and mgr.pointer_step() == 7
    assert torch.equal(target["w"], torch.arange(300000, dtype=torch.float32))


# --------------------------------------------------------------------------------------
# Two ranks


def _two_rank_run(rank: int, world: int, root: str) -> dict:
    def state(step: int) -> dict:
        local = torch.arange(32, dtype=torch.float32).reshape(4, 8) + 100 * rank + step
        return {
            "w": tessera.ShardedTensor(local, (8, 8), (4 * rank, 0)),
            "r": torch.full((5,), float(step)),
            "step": step,
        }

    with CheckpointManager(root, keep_last=2, async_save=True) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step))
        mgr.wait()
    torch.distributed.barrier()  # rank 0 applies retention after its commit; rank 1 may be ahead
    steps = CheckpointManager(root).steps()
    # Rank 0 corrupts a file rank 1 wrote in step 3: both ranks must skip to step 2 together.
    if rank == 0:
        manifest = tessera.read_manifest(os.path.join(root, "step-00000003"))
        victim = next(f.path for f in manifest.files if f.rank == 1)
        path = os.path.join(root, "step-00000003", victim)
        raw = bytearray(Path(path).read_bytes())
        raw[-1] ^= 0xFF
        Path(path).write_bytes(raw)
    torch.distributed.barrier()
    target = state(0)
    target["w"].local.zero_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = CheckpointManager(root).load(target)
    want = state(2)
    return {
        "steps": steps,
        "loaded": loaded.step,
        "skipped": sorted(loaded.skipped),
        "exact": torch.equal(target["w"].local, want["w"].local) and torch.equal(target["r"], want["r"]),
        "warned": len(caught),
    }


def test_two_ranks_save_retain_and_skip_a_corrupt_step_together(tmp_path) -> None:
    root = str(tmp_path / "run")
    out = run_distributed(_two_rank_run, 2, root)
    for rank, o in enumerate(out):
        assert o["steps"] == [2, 3] and o["loaded"] == 2 and o["skipped"] == [3] and o["exact"], (rank, o)
    assert out[0]["warned"] == 1 and out[1]["warned"] == 0  # job-wide news comes from rank 0 only
    assert Path(root, "latest").read_text() == "step-00000003\n"


def test_a_tier_root_is_the_local_tier_in_host_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``CheckpointManager("tier::<url>")`` is the local tier (one concept): whole steps in
    ``default_memory_root(url)``, every step also durable under ``url``, loads from memory."""
    from tessera.storage.host_memory import default_memory_root

    for var in ("GROUP_RANK", "RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    durable = str(tmp_path / "run")
    memory = default_memory_root(durable)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)  # the manager's spelling is not the deprecated one
            with CheckpointManager("tier::" + durable, keep_last=1, local_keep_last=1, async_save=True) as mgr:
                assert mgr.root == durable and mgr.local_dir == memory
                for step in (1, 2):
                    mgr.save(step, _state(step))
                mgr.wait()
                assert mgr.steps() == [2] and mgr.pointer_step() == 2
        # The durable store holds the committed step, the pointer and the root's identity and timeline...
        assert sorted(os.listdir(durable)) == [".tessera-root-id", ".tessera-timeline", "latest", "step-00000002"]
        assert os.path.exists(os.path.join(durable, "step-00000002", "manifest.json"))
        # ...host memory holds the same step, committed locally; retention removed step 1 from both.
        assert sorted(os.listdir(memory)) == ["step-00000002"]
        assert os.path.exists(os.path.join(memory, "step-00000002", "local-commit.json"))
        manifests = [Path(d, "step-00000002", "manifest.json").read_bytes() for d in (memory, durable)]
        assert manifests[0] == manifests[1]
        # A restarted process on this node loads from memory; a durable-only manager from the root.
        target = _blank()
        with CheckpointManager("tier::" + durable) as mgr:
            loaded = mgr.load(target)
        assert (loaded.step, loaded.source) == (2, "local")
        _assert_is(target, 2)
        target = _blank()
        assert CheckpointManager(durable).load(target).step == 2
        _assert_is(target, 2)
    finally:
        shutil.rmtree(memory, ignore_errors=True)


# ----------------------------------------------------------------------------------------
# The local tier in one process (multi-node recovery: tests/test_local_tier.py)


def test_local_tier_single_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("GROUP_RANK", "RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    root, local = str(tmp_path / "durable"), str(tmp_path / "shm" / "n{node}")
    mgr = CheckpointManager(root, keep_last=2, local_dir=local, local_replicas=1, durable_every=2)
    for k in range(1, 6):
        mgr.save(k, {"w": torch.full((3,), float(k)), "k": k})
    assert mgr.steps(local=False) == [2, 4]  # durable: multiples of durable_every only
    assert mgr.steps() == [2, 4, 5]  # and the local steps (4 and 5)
    node = tmp_path / "shm" / "n0"
    committed = sorted(p.name for p in node.iterdir() if (p / "local-commit.json").exists())
    assert committed == [step_dirname(4), step_dirname(5)]  # keeps 2
    state = {"w": torch.zeros(3), "k": 0}
    got = mgr.load(state)
    assert (got.step, got.source, got.peer_bytes, state["k"]) == (5, "local", 0, 5)
    assert torch.equal(state["w"], torch.full((3,), 5.0))
    shutil.rmtree(tmp_path / "shm")
    got = mgr.load(state)
    assert (got.step, got.source, state["k"]) == (4, "durable", 4)
    assert torch.equal(state["w"], torch.full((3,), 4.0))
    mgr.close()


def test_a_local_manifest_replaced_by_another_save_is_not_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A zombie job writing into the same local_dir replaces a committed local step's manifest:
    its save id no longer matches the commit marker's, so the step is skipped with a warning and
    the newest durable step loads, never the other job's data under this step's name."""
    for var in ("GROUP_RANK", "RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    root, local = str(tmp_path / "durable"), str(tmp_path / "shm")
    with CheckpointManager(root, local_dir=local, durable_every=2) as mgr:
        for k in (1, 2, 3):
            mgr.save(k, {"w": torch.full((3,), float(k))})
    # The other job's save of "step 3", complete with its files, lands in the same directory.
    other = str(tmp_path / "other")
    tessera.save(other, {"w": torch.full((3,), 99.0)})
    step3 = Path(local, step_dirname(3))
    shutil.copytree(Path(other, "data"), step3 / "data", dirs_exist_ok=True)
    shutil.copy(Path(other, "manifest.json"), step3 / "manifest.json")
    state = {"w": torch.zeros(3)}
    with (
        CheckpointManager(root, local_dir=local, durable_every=2) as mgr,
        pytest.warns(RuntimeWarning, match="is another job writing into"),
    ):
        got = mgr.load(state)
    assert (got.step, got.source) == (2, "durable")
    assert torch.equal(state["w"], torch.full((3,), 2.0))


def test_local_tier_async_and_specific_step(tmp_path: Path) -> None:
    root, local = str(tmp_path / "durable"), str(tmp_path / "shm")
    with CheckpointManager(root, local_dir=local, durable_every=3, async_save=True) as mgr:
        for k in range(1, 5):
            pending = mgr.save(k, {"w": torch.full((2,), float(k))})
        pending.wait()  # type: ignore[union-attr]
        state = {"w": torch.zeros(2)}
        assert (mgr.load(state, step=3).source, state["w"][0].item()) == ("local", 3.0)
        assert (mgr.load(state).step, state["w"][0].item()) == (4, 4.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"local_dir": "/x", "local_replicas": -1},
        {"local_dir": "/x", "durable_every": 0},
        {"local_dir": "/x", "local_keep_last": 0},
        {"local_dir": "s3://b/x"},
    ],
)
def test_local_tier_arguments_checked(tmp_path: Path, kwargs: dict) -> None:
    with pytest.raises(ValueError):
        CheckpointManager(str(tmp_path), **kwargs)


def test_local_tier_ignores_another_runs_steps(tmp_path: Path) -> None:
    """A local_dir reused by a run with another durable root: its steps are not this run's."""
    local = str(tmp_path / "shm")
    with CheckpointManager(str(tmp_path / "run-a"), local_dir=local, durable_every=100) as a:
        a.save(7, {"w": torch.full((2,), 7.0)})
    with CheckpointManager(str(tmp_path / "run-b"), local_dir=local, durable_every=2) as b:
        for k in (1, 2):
            b.save(k, {"w": torch.full((2,), float(k))})
        b.wait()
        # Local retention (keep 2) counts run-b's steps only: run-a's newer step 7 is left alone.
        node = tmp_path / "shm"
        assert sorted(p.name for p in node.iterdir() if (p / "local-commit.json").exists()) == [
            step_dirname(1),
            step_dirname(2),
            step_dirname(7),
        ]
        state = {"w": torch.zeros(2)}
        got = b.load(state)
        assert (got.step, got.source, state["w"][0].item()) == (2, "local", 2.0)
        shutil.rmtree(tmp_path / "shm" / step_dirname(2))
        got = b.load(state)  # run-a's step 7 is in the local_dir, but not run-b's; durable 2 beats local 1
        assert (got.step, got.source, state["w"][0].item()) == (2, "durable", 2.0)
