"""No hangs: when a rank raises, dies or hangs during a save or load, the others fail fast.

Ranks run on real gloo groups through ``tests.crash_worker.run_ranks``, which (unlike
``run_distributed``) reports dead and hung ranks instead of failing on them. Faults come
from the state itself (a value that cannot be saved, a Stateful that kills its process) or
from a storage backend subclassing FileStorage that fails, kills or stalls on one rank.
"""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch

import tessera
from tessera.manager import CheckpointManager
from tessera.storage import FileStorage
from tests.crash_worker import run_ranks

TIMEOUT_S = 10  # TESSERA_TIMEOUT_S in the ranks
SLACK_S = 8  # scheduling noise on a loaded machine
ENV = {"TESSERA_TIMEOUT_S": str(TIMEOUT_S)}


def _state(rank: int, world: int, fill: float = 1.0) -> dict:
    rows = 4
    local = torch.full((rows, 8), fill) + torch.arange(rows * 8, dtype=torch.float32).reshape(rows, 8) + rank * 100
    return {"w": tessera.ShardedTensor(local, (rows * world, 8), (rows * rank, 0)), "step": 1}


class _FailingStorage(FileStorage):
    """FileStorage that misbehaves on one rank: ``raise``, ``exit`` or ``stall`` at one call."""

    def __init__(self, url: str, rank: int, bad_rank: int, how: str, call: str = "write_file") -> None:
        super().__init__(url)
        self.bad = rank == bad_rank
        self.how = how
        self.call = call

    def _trip(self, call: str) -> None:
        if not self.bad or call != self.call:
            return
        if self.how == "raise":
            raise tessera.StorageError(f"injected failure of {call} on this rank (disk full)")
        if self.how == "exit":
            os._exit(1)
        if self.how == "stall":
            time.sleep(600)

    def write_file(self, path, chunks):
        self._trip("write_file")
        return super().write_file(path, chunks)

    def read_into(self, path, offset, out):
        self._trip("read_into")
        return super().read_into(path, offset, out)


# --------------------------------------------------------------------------------------
# A rank raises: every rank raises, naming that rank's cause


def _unpicklable_on_rank1(rank: int, world: int, path: str) -> dict:
    state = _state(rank, world)
    state["extra"] = object() if rank == 1 else 3  # needs pickle on rank 1 only
    try:
        tessera.save(path, state)
    except tessera.CheckpointError as e:
        failed = (type(e).__name__, str(e))
    else:
        failed = None
    # The group is still usable: a clean save and load afterwards work on every rank.
    tessera.save(path, _state(rank, world))
    target = _state(rank, world, fill=0.0)
    target["w"].local.zero_()
    tessera.load(path, target)
    return {"failed": failed, "reloaded": torch.equal(target["w"].local, _state(rank, world)["w"].local)}


def test_error_during_flatten_on_one_rank_is_raised_on_all(tmp_path) -> None:
    t0 = time.monotonic()
    out = run_ranks(_unpicklable_on_rank1, 3, str(tmp_path / "ckpt"), env=ENV, timeout=120)
    assert [o.status for o in out] == ["ok"] * 3, [o.value for o in out]
    for o in out:
        kind, message = o.value["failed"]
        if o.rank == 1:
            assert kind == "PickleNotAllowedError" and "'extra'" in message
        else:  # the same type on every rank, naming the rank that failed
            assert kind == "PickleNotAllowedError", message
            assert "rank 1: PickleNotAllowedError" in message and "'extra'" in message
        assert o.value["reloaded"]
    assert max(o.seconds for o in out) < 60, "a reported failure must not wait for a timeout"
    assert time.monotonic() - t0 < 120


def _raise_while_writing(rank: int, world: int, path: str) -> dict:
    tessera.save(path, _state(rank, world, fill=1.0))
    before = sorted(os.listdir(os.path.join(path, "data")))
    store = _FailingStorage(path, rank, 1, "raise")
    try:
        tessera.save(path, _state(rank, world, fill=2.0), storage=store)
        failed = None
    except tessera.CheckpointError as e:
        failed = (type(e).__name__, str(e))
    target = _state(rank, world, fill=0.0)
    tessera.load(path, target)
    return {
        "failed": failed,
        "old_intact": torch.equal(target["w"].local, _state(rank, world, fill=1.0)["w"].local),
        "data_dirs": (before, sorted(os.listdir(os.path.join(path, "data")))),
    }


def test_storage_error_on_one_rank_fails_the_save_everywhere(tmp_path) -> None:
    out = run_ranks(_raise_while_writing, 2, str(tmp_path / "ckpt"), env=ENV, timeout=120)
    assert [o.status for o in out] == ["ok", "ok"], [o.value for o in out]
    for o in out:
        kind, message = o.value["failed"]
        assert "injected failure of write_file" in message
        assert kind == "StorageError", message
        if o.rank == 0:
            assert "rank 1:" in message
        assert o.value["old_intact"], "a failed save must leave the committed checkpoint intact"
    before, after = out[0].value["data_dirs"]
    assert before == after, "files of the failed save must be removed"


# --------------------------------------------------------------------------------------
# A rank dies: the others get a clear error within the timeout


class _ExitingStateful:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def state_dict(self) -> dict:
        if self.rank == 1:
            os._exit(1)
        return {"x": torch.ones(3)}

    def load_state_dict(self, sd: dict) -> None:
        pass


def _die_in_flatten(rank: int, world: int, path: str) -> None:
    tessera.save(path, {"s": _ExitingStateful(rank), "w": torch.ones(4)})


def _die_while_writing(rank: int, world: int, path: str) -> None:
    tessera.save(path, _state(rank, world), storage=_FailingStorage(path, rank, 1, "exit"))


def _die_while_loading(rank: int, world: int, path: str) -> None:
    tessera.save(path, _state(rank, world))
    target = _state(rank, world, fill=0.0)
    tessera.load(path, target, storage=_FailingStorage(path, rank, 1, "exit", call="read_into"))


def _die_during_async_manager_save(rank: int, world: int, root: str) -> dict:
    def factory(url: str) -> FileStorage:
        return _FailingStorage(url, rank, 1 if url.endswith("step-00000002") else -1, "exit")

    mgr = CheckpointManager(root, async_save=True, storage_factory=factory)
    mgr.save(1, _state(rank, world)).wait()
    pending = mgr.save(2, _state(rank, world, fill=2.0))  # rank 1 dies writing step 2
    try:
        pending.wait()
    finally:
        mgr.close()  # the failure was seen by wait(): close() does not raise it again


@pytest.mark.parametrize(
    ("fn", "world"),
    [(_die_in_flatten, 3), (_die_while_writing, 2), (_die_while_loading, 2), (_die_during_async_manager_save, 2)],
    ids=["flatten", "write", "load", "manager-async"],
)
def test_a_dead_rank_fails_the_others_within_the_timeout(tmp_path, fn, world: int) -> None:
    out = run_ranks(fn, world, str(tmp_path / "ckpt"), env=ENV, timeout=TIMEOUT_S + 90)
    assert out[1].status == "died" and out[1].exitcode == 1
    for o in out:
        if o.rank == 1:
            continue
        assert o.status == "error", f"rank {o.rank}: {o.status} {o.value}"
        assert o.error_is("DistributedError"), o.value["traceback"]
        assert "another rank died or hangs" in o.value["message"] or "rank 1" in o.value["message"]
        assert o.seconds < TIMEOUT_S + SLACK_S, f"rank {o.rank} needed {o.seconds:.1f}s to notice"


def test_a_dead_rank_leaves_the_previous_manager_step_loadable(tmp_path) -> None:
    root = str(tmp_path / "run")
    out = run_ranks(_die_during_async_manager_save, 2, root, env=ENV, timeout=TIMEOUT_S + 90)
    assert out[1].status == "died" and out[0].error_is("DistributedError")
    mgr = CheckpointManager(root)
    assert mgr.steps() == [1] and mgr.pointer_step() == 1
    # Rank 0 removed the failed save's files (rank 1 died writing them): nothing of step 2 is left.
    step2 = os.path.join(root, "step-00000002", "data")
    assert [name for _, _, names in os.walk(step2) for name in names] == []
    target = {"w": torch.zeros(8, 8), "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an empty step-2 directory may be reported as skipped
        assert mgr.load(target).step == 1
    want = torch.cat([_state(r, 2)["w"].local for r in range(2)])
    assert torch.equal(target["w"], want)


# --------------------------------------------------------------------------------------
# A rank hangs: the others time out after TESSERA_TIMEOUT_S


def _stall_while_writing(rank: int, world: int, path: str) -> None:
    tessera.save(path, _state(rank, world), storage=_FailingStorage(path, rank, 1, "stall"))


def test_a_hung_rank_times_the_others_out(tmp_path) -> None:
    timeout = 4
    out = run_ranks(
        _stall_while_writing,
        2,
        str(tmp_path / "ckpt"),
        env={"TESSERA_TIMEOUT_S": str(timeout)},
        timeout=90,
        wait_for=[0],
    )
    assert out[1].status == "hung"
    rank0 = out[0]
    assert rank0.status == "error"
    assert timeout - 0.5 <= rank0.seconds < timeout + SLACK_S, rank0.seconds
    assert rank0.error_is("CollectiveTimeoutError"), rank0.value["traceback"]
    assert "TESSERA_TIMEOUT_S" in rank0.value["message"]


# --------------------------------------------------------------------------------------
# A rank fails while staging: the others must hear about it, not wait for the timeout


class _FailsToStage(torch.Tensor):
    """A tensor whose copy to host memory fails (as a device-to-host copy can on one rank)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "copy_" and any(isinstance(a, _FailsToStage) for a in args[1:]):
            raise RuntimeError("injected: copying to host memory failed on this rank")
        return super().__torch_function__(func, types, args, kwargs or {})


def _fail_staging_on_rank1(rank: int, world: int, path: str) -> dict:
    state = _state(rank, world)
    if rank == 1:
        state["w"] = tessera.ShardedTensor(state["w"].local.as_subclass(_FailsToStage), (8, 8), (4, 0))
    t0 = time.monotonic()
    try:
        tessera.async_save(path, state).wait()
        failed = None
    except Exception as e:
        failed = (type(e).__name__, str(e))
    took = time.monotonic() - t0
    done = path + ".rank0-returned"
    if rank == 0:
        open(done, "w").close()
    else:  # the training loop goes on: this rank is alive, not dead, until rank 0 has its answer
        deadline = time.monotonic() + TIMEOUT_S + 5
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
    return {"failed": failed, "seconds": took}


def test_a_staging_failure_on_one_rank_is_reported_to_all_at_once(tmp_path) -> None:
    out = run_ranks(_fail_staging_on_rank1, 2, str(tmp_path / "ckpt"), env=ENV, timeout=TIMEOUT_S + 60)
    assert [o.status for o in out] == ["ok", "ok"], [o.value for o in out]
    type_of_rank1, own_message = out[1].value["failed"]
    assert "injected" in own_message
    kind, message = out[0].value["failed"]
    # Rank 1's own error type (a CheckpointError naming the staging failure), not a generic one.
    assert kind == type_of_rank1 and "rank 1" in message and "injected" in message, (message, type_of_rank1)
    assert out[0].value["seconds"] < TIMEOUT_S / 2, f"rank 0 waited {out[0].value['seconds']:.1f}s"
