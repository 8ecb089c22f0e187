"""Attacks on a CheckpointManager whose root is on S3 (loopback moto server): retention, a zombie
writer, a saver killed mid-upload.

A *zombie* is an old incarnation of the job, stopped with SIGSTOP in the middle of a save while
its replacement resumes, saves newer steps and applies retention, then resumed with SIGCONT to
finish its save of an old step. Real processes, real signals, real gloo groups, real S3 requests.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

import tessera
from tessera.manager import CheckpointManager
from tessera.storage import FsspecStorage
from tests.crash_worker import check_state, empty_state, make_rank_state, make_state, start_ranks
from tests.dist_utils import run_distributed
from tests.s3_server import FaultProxy, fault_proxy, moto_endpoint, s3_bucket, s3_options  # noqa: F401 - fixtures

pytestmark = [pytest.mark.s3, pytest.mark.distributed]

NO_TIMINGS = tessera.LoadOptions(record_timings=False)
MiB = 1 << 20


def _touch(path: str) -> None:
    with open(path, "w"):
        pass


def _wait_file(path: str, procs: Iterable[Any] = (), timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        for p in procs:
            assert p.is_alive(), f"process {p.pid} died (exit code {p.exitcode}) before {path} appeared"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def _state(k: int, rank: int, world: int) -> dict[str, Any]:
    return make_state(k) if world == 1 else make_rank_state(k, rank, world)


# --------------------------------------------------------------------------------------
# A storage backend that stops its own process (SIGSTOP) at one point of a save


class PausingS3Storage(FsspecStorage):
    """A real :class:`FsspecStorage` that, on rank 0, writes ``<control>/stopped`` and stops
    its own process with SIGSTOP at one point of the save (``at``):

    * ``"claim"``: right after the owner marker is written (before any data);
    * ``"data"``: right after the first data file is uploaded;
    * ``"publish"``: right after the commit check listed the files, before the manifest PUT.
    """

    def __init__(self, url: str, options: dict[str, Any], *, at: str, control: str) -> None:
        super().__init__(url, options)
        self.at, self.control, self.fired = at, control, False

    def _pause(self) -> None:
        if not self.fired:
            self.fired = True
            _touch(os.path.join(self.control, "stopped"))
            os.kill(os.getpid(), signal.SIGSTOP)

    def write_file(self, path: str, chunks: Any) -> None:
        super().write_file(path, chunks)
        if (self.at == "claim" and path.startswith(".tessera-saves/")) or (
            self.at == "data" and path.startswith("data/")
        ):
            self._pause()

    def file_sizes(self, prefix: str) -> dict[str, int]:
        # The commit check's listing: the files are all there. The manifest PUT comes next.
        sizes = super().file_sizes(prefix)
        if self.at == "publish":
            self._pause()
        return sizes


def old_incarnation(
    rank: int, world: int, root: str, opts: dict[str, Any], zombie_step: int, at: str, control: str, async_save: bool
) -> str:
    """The old job: saves steps 2 and 4, waits for ``<control>/go``, then saves ``zombie_step``
    through a :class:`PausingS3Storage` (rank 0 stops itself at ``at``). Returns the outcome."""
    torch.set_num_threads(1)
    zombie_url = f"{root}/step-{zombie_step:08d}"

    def factory(url: str) -> FsspecStorage:
        if rank == 0 and url == zombie_url:
            return PausingS3Storage(url, opts, at=at, control=control)
        return FsspecStorage(url, opts)

    mgr = CheckpointManager(root, keep_last=2, storage_factory=factory)
    for k in (2, 4):
        mgr.save(k, _state(k, rank, world))
    if rank == 0:
        _touch(os.path.join(control, "ready"))
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(control, "go")):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    try:
        out = mgr.save(zombie_step, _state(zombie_step, rank, world), async_save=async_save)
        if isinstance(out, tessera.PendingSave):
            out.wait()
        mgr.close()
    except tessera.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


def new_incarnation(
    rank: int, world: int, root: str, opts: dict[str, Any], steps: list[int], async_save: bool
) -> list[int]:
    """The replacement job: resumes (if anything is committed), then saves ``steps``."""
    torch.set_num_threads(1)
    with CheckpointManager(root, keep_last=2, async_save=async_save, storage_options=opts) as mgr:
        for k in steps:
            out = mgr.save(k, _state(k, rank, world))
            if isinstance(out, tessera.PendingSave):
                out.wait_staged()
        mgr.wait()
        return mgr.steps()


def _load_step(root: str, opts: dict[str, Any], step: int) -> int:
    state = empty_state()
    tessera.load(f"{root}/step-{step:08d}", state, storage_options=opts, options=NO_TIMINGS)
    return check_state(state)


def _check_root(root: str, opts: dict[str, Any], newest: int) -> list[int]:
    """Every committed step under ``root`` verifies and loads exactly; ``latest`` and a resume
    land on ``newest``. Returns the committed steps."""
    mgr = CheckpointManager(root, keep_last=2, storage_options=opts, load_options=NO_TIMINGS)
    try:
        steps = mgr.steps()
        for s in steps:
            report = tessera.verify(mgr.step_url(s), storage=FsspecStorage(mgr.step_url(s), opts))
            assert report.ok, f"step {s} is committed but broken: {report.summary()}"
            assert _load_step(root, opts, s) == s
        assert mgr.pointer_step() == newest
        state = empty_state()
        loaded = mgr.load(state)
        assert loaded.step == newest and not loaded.skipped, loaded
        assert check_state(state) == newest
        return steps
    finally:
        mgr.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("at", "world", "async_save", "new_steps"),
    [
        # The zombie stops between its commit check and its manifest PUT; the replacement
        # saves the same step number (committed, then deleted by retention), or skips it (the
        # zombie's step is then an incomplete leftover older than the replacement's steps).
        ("publish", 1, False, [5, 6, 7, 8]),
        ("publish", 2, True, [7, 8]),
        ("publish", 1, True, [7, 8]),
        # The zombie stops after its marker, or after one data file.
        ("claim", 2, False, [5, 6, 7, 8]),
        ("data", 1, True, [5, 6, 7, 8]),
        ("data", 2, False, [7, 8]),
    ],
)
def test_a_zombie_writer_resumed_after_retention_never_breaks_the_root(
    tmp_path: Path, moto_endpoint: str, s3_bucket: str, at: str, world: int, async_save: bool, new_steps: list[int]
) -> None:
    # Before the fix, a zombie stopped before its manifest PUT published a manifest naming
    # files the replacement's retention had deleted, and reported success: a "committed"
    # step 6 that did not load.
    opts = s3_options(moto_endpoint)
    root = f"s3://{s3_bucket}/{uuid.uuid4().hex}/run"
    control = str(tmp_path)
    zombie = start_ranks(old_incarnation, world, root, opts, 6, at, control, async_save)
    try:
        _wait_file(os.path.join(control, "ready"), zombie.procs)
        _touch(os.path.join(control, "go"))
        _wait_file(os.path.join(control, "stopped"), zombie.procs)
        kept = run_distributed(new_incarnation, world, root, opts, new_steps, async_save)[0]
        assert kept == new_steps[-2:], kept  # step 4 and the leftovers of step 6 were deleted
        os.kill(zombie.procs[0].pid, signal.SIGCONT)
        outcomes = zombie.collect(120)
    finally:
        for p in zombie.procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
    assert [o.status for o in outcomes] == ["ok"] * world, outcomes
    results = [o.value for o in outcomes]
    steps = _check_root(root, opts, new_steps[-1])
    if results[0] == "ok":  # the zombie committed: then step 6 is complete and exactly its state
        assert 6 in steps and _load_step(root, opts, 6) == 6
    else:  # or it failed cleanly, on every rank, and committed nothing
        assert all(r.split(":")[0] in ("ConcurrentSaveError", "CommitCheckError") for r in results), results
        assert 6 not in steps, steps
    # The replacement's next save leaves only what retention keeps.
    run_distributed(new_incarnation, world, root, opts, [9], False)
    store = FsspecStorage(root, opts)
    assert sorted({p.split("/")[0] for p in store.list("")}) == ["latest", "step-00000008", "step-00000009"]
    _check_root(root, opts, 9)


# --------------------------------------------------------------------------------------
# A saver killed with SIGKILL while its data is being uploaded


def big_state(k: int, rank: int, world: int) -> dict[str, Any]:
    """12 MiB of float32 split over the ranks (several 5 MiB parts per file), and ``k``."""
    n = 3 * MiB
    w = torch.arange(n, dtype=torch.float32) + k
    if world > 1:
        piece = n // world
        return {"w": tessera.ShardedTensor(w[rank * piece : (rank + 1) * piece].clone(), (n,), (rank * piece,)), "k": k}
    return {"w": w, "k": k}


def upload_saver(rank: int, world: int, root: str, opts: dict[str, Any], control: str, async_save: bool) -> None:
    """Saves steps 1 and 2, then (after ``<control>/go``) step 3; killed during step 3."""
    torch.set_num_threads(1)
    mgr = CheckpointManager(
        root,
        keep_last=2,
        async_save=async_save,
        storage_factory=lambda url: FsspecStorage(url, opts, part_size=5 * MiB),
    )
    for k in (1, 2, 3):
        if k == 3:
            if rank == 0:
                _touch(os.path.join(control, "ready"))
            while not os.path.exists(os.path.join(control, "go")):
                time.sleep(0.02)
        out = mgr.save(k, big_state(k, rank, world))
        if isinstance(out, tessera.PendingSave):
            out.wait()
    time.sleep(600)  # not reached: killed during step 3


@pytest.mark.parametrize(("world", "async_save"), [(1, False), (2, True)])
def test_a_saver_killed_mid_upload_leaves_the_previous_steps(
    tmp_path: Path, fault_proxy: tuple[FaultProxy, str], s3_bucket: str, world: int, async_save: bool
) -> None:
    # Holds: the killed save never committed, so step 3 is invisible, steps 1-2 load, and
    # the next save removes what the killed one left.
    proxy, endpoint = fault_proxy
    opts = s3_options(endpoint)
    root = f"s3://{s3_bucket}/{uuid.uuid4().hex}/run"
    control = str(tmp_path)
    group = start_ranks(upload_saver, world, root, opts, control, async_save)
    stall = None
    try:
        _wait_file(os.path.join(control, "ready"), group.procs)
        stall = proxy.inject("upload_part", "stall", 1)  # the first part of step 3 hangs in flight
        _touch(os.path.join(control, "go"))
        deadline = time.monotonic() + 60
        while stall.hits == 0:
            assert time.monotonic() < deadline, "step 3 never started uploading"
            time.sleep(0.01)
        time.sleep(0.3)  # the other parts and ranks upload meanwhile
        for p in group.procs:
            p.kill()  # SIGKILL
        group.collect(30)
    finally:
        if stall is not None:
            stall.gate.set()
        for p in group.procs:
            if p.is_alive():
                p.kill()
    store = FsspecStorage(root, opts)
    assert any(p.startswith("step-00000003/") for p in store.list("")), "the killed save left nothing"
    mgr = CheckpointManager(root, keep_last=2, storage_options=opts, load_options=NO_TIMINGS)
    try:
        assert mgr.steps() == [1, 2]
        assert mgr.pointer_step() == 2
        for s in (2, 1):
            state = {"w": torch.zeros(3 * MiB), "k": -1}
            loaded = mgr.load(state, step=s)
            assert loaded.step == s and state["k"] == s
            assert torch.equal(state["w"], big_state(s, 0, 1)["w"])
        with pytest.raises(tessera.errors.CheckpointNotFoundError):
            tessera.load(mgr.step_url(3), {"w": torch.zeros(3 * MiB), "k": -1}, storage_options=opts)
        mgr.save(3, big_state(3, 0, 1))
        assert mgr.steps() == [2, 3]
        report = tessera.verify(mgr.step_url(3), storage=FsspecStorage(mgr.step_url(3), opts))
        assert report.ok and report.unreferenced_files == (), report.summary()
        assert not [p for p in store.list("step-00000003") if "/.tessera-saves/" in p]
    finally:
        mgr.close()


# --------------------------------------------------------------------------------------
# The two sides of the S3 fence against retention, one request at a time


def test_s3_publish_and_retention_each_see_the_other(moto_endpoint: str, s3_bucket: str) -> None:
    # S3 cannot condition a PUT on another object, so a save puts its manifest and then looks
    # at its owner marker, while retention deletes the markers and then looks at the manifest.
    # Before the fix a save published over a deleted marker, and a manifest deleted since the
    # claim gave a raw FileNotFoundError instead of ConcurrentSaveError.
    from tessera.errors import ConcurrentSaveError

    store = FsspecStorage(f"s3://{s3_bucket}/{uuid.uuid4().hex}/step", s3_options(moto_endpoint))
    m = tessera.format.manifest.MANIFEST_NAME
    # Retention first: the save finds its marker gone after its PUT and withdraws the manifest.
    store.write_file(".tessera-saves/a", [b""])
    assert store.uncommit(m, None, [".tessera-saves/a"])
    with pytest.raises(ConcurrentSaveError, match="owner marker"):
        store.replace_if(m, b"first", None, owner=".tessera-saves/a")
    assert store.version(m) is None
    # The save first: its manifest stands and retention backs off (deleting nothing else).
    store.write_file(".tessera-saves/b", [b""])
    store.replace_if(m, b"second", None, owner=".tessera-saves/b")
    assert not store.uncommit(m, None, [".tessera-saves/b"])
    assert store.read_file(m) == b"second"
    # Retention of a committed step deletes the manifest only while it is the one it listed.
    v = store.version(m)
    store.replace_if(m, b"third", v)
    assert not store.uncommit(m, v, [])
    assert store.read_file(m) == b"third"
    v = store.version(m)
    assert store.uncommit(m, v, [])
    # A save that started from the manifest retention deleted is fenced off, with the right type.
    with pytest.raises(ConcurrentSaveError, match="deleted"):
        store.replace_if(m, b"fourth", v)
    assert store.list("") == [".tessera-saves/b"]
