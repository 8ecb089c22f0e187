"""The commit protocol (docs/guarantees.md, "The commit protocol"): issue #10, items 2-4, 6 and 9.

Each reproduction of the issue is a test here, run against real processes, real filesystems
(a small tmpfs for full disks), loopback S3 (moto) for the object-store variants:

2. two writers of one path: at most one wins, the other fails clearly, the path loads;
3. ranks that pass different paths fail on every rank, naming the mismatch;
4. a full disk: a failed save leaves nothing behind; a manager can free room first;
6. background failures nobody waited for are printed at exit;
9. fsync order: data files, their directories, the manifest, its directory.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch

import tessera
from tessera.errors import CommitCheckError, ConcurrentSaveError, LocationMismatchError, StorageError
from tessera.format.manifest import MANIFEST_NAME
from tessera.storage import FileStorage
from tessera.tools.verification import verify
from tests.crash_worker import check_state, empty_state, gated_save, make_state, start
from tests.dist_utils import run_distributed
from tests.s3_server import FaultProxy, fault_proxy, moto_endpoint, s3_bucket, s3_options  # noqa: F401 - fixtures

REPO = Path(__file__).resolve().parents[1]
NO_TIMINGS = tessera.LoadOptions(record_timings=False)


def _load(path: str, **kw: object) -> int:
    state = empty_state()
    tessera.load(path, state, options=NO_TIMINGS, **kw)
    return check_state(state)


def _tree(root: str) -> list[str]:
    out = []
    for d, _, files in os.walk(root):
        out += [os.path.relpath(os.path.join(d, f), root) for f in files]
    return sorted(out)


# --------------------------------------------------------------------------------------
# 2. Two writers, one path: fenced


def _overlap(tmp_path: Path, target: str, storage_options: dict | None = None) -> tuple[str, str]:
    """Writer B claims the path and writes its data, then waits before publishing; writer A
    (this process) saves the whole way through; then B goes on. Returns (A's outcome, B's)."""
    entered, gate, result = (str(tmp_path / n) for n in ("entered", "gate", "result"))
    proc = start(gated_save, target, 7, entered, gate, result, storage_options)
    try:
        deadline = 120
        import time

        t0 = time.monotonic()
        while not os.path.exists(entered):
            assert proc.is_alive(), "writer B died"
            assert time.monotonic() - t0 < deadline, "writer B never reached its commit"
            time.sleep(0.01)
        try:
            tessera.save(target, make_state(3), storage_options=storage_options)
            a = "ok"
        except Exception as e:
            a = f"{type(e).__name__}: {e}"
        Path(gate).touch()
        proc.join(120)
        return a, Path(result).read_text()
    finally:
        if proc.is_alive():
            proc.kill()


def test_two_writers_on_one_path_never_both_succeed_with_a_broken_checkpoint(tmp_path: Path) -> None:
    # Reproduction 2: the first writer's cleanup deleted the second writer's data files, and the
    # second then committed a manifest pointing at them: both succeeded, nothing loaded.
    path = str(tmp_path / "ckpt")
    tessera.save(path, make_state(1))
    a, b = _overlap(tmp_path, path)
    assert a == "ok"
    assert b.startswith("ConcurrentSaveError"), b
    assert _load(path) == 3  # the winner's checkpoint, complete
    report = verify(path)
    assert report.ok and report.unreferenced_files == (), report.summary()
    tessera.save(path, make_state(4))  # the path is usable; nothing is left of the loser
    assert _load(path) == 4
    assert sorted(os.listdir(os.path.join(path, "data"))) == [tessera.read_manifest(path).save_id]
    assert not os.path.exists(os.path.join(path, ".tessera-saves"))


@pytest.mark.s3
def test_two_writers_on_one_s3_path_are_fenced_by_a_conditional_put(
    tmp_path: Path, moto_endpoint: str, s3_bucket: str
) -> None:
    url = f"s3://{s3_bucket}/{uuid.uuid4().hex}/ckpt"
    opts = s3_options(moto_endpoint)
    tessera.save(url, make_state(1), storage_options=opts)
    a, b = _overlap(tmp_path, url, opts)
    assert a == "ok"
    assert b.startswith("ConcurrentSaveError"), b
    state = empty_state()
    tessera.load(url, state, storage_options=opts, options=NO_TIMINGS)
    assert check_state(state) == 3


@pytest.mark.s3
def test_s3_commit_refuses_a_manifest_changed_since_the_claim(moto_endpoint: str, s3_bucket: str) -> None:
    from tessera.storage import FsspecStorage

    store = FsspecStorage(f"s3://{s3_bucket}/{uuid.uuid4().hex}", s3_options(moto_endpoint))
    assert store.version(MANIFEST_NAME) is None
    store.replace_if(MANIFEST_NAME, b"one", None)
    v1 = store.version(MANIFEST_NAME)
    with pytest.raises(ConcurrentSaveError):
        store.replace_if(MANIFEST_NAME, b"two", None)  # it exists now
    store.replace_if(MANIFEST_NAME, b"two", v1)
    with pytest.raises(ConcurrentSaveError):
        store.replace_if(MANIFEST_NAME, b"three", v1)  # stale version
    assert store.read_file(MANIFEST_NAME) == b"two"
    assert store.file_sizes("") == {MANIFEST_NAME: 3}


@pytest.mark.s3
def test_s3_commit_checks_many_files_with_one_listing(fault_proxy: tuple[FaultProxy, str], s3_bucket: str) -> None:
    # The check must stay cheap: one LIST per 1,000 objects, not one HEAD per file. And a
    # conditional manifest PUT whose answer is lost is recognised as having landed.
    from tessera.options import PlanOptions

    proxy, endpoint = fault_proxy
    url = f"s3://{s3_bucket}/{uuid.uuid4().hex}/ckpt"
    opts = s3_options(endpoint)
    state = {f"t{i}": torch.full((8,), float(i)) for i in range(64)}
    options = tessera.SaveOptions(plan=PlanOptions(files_per_rank=64, min_file_bytes=1))
    proxy.seen.clear()
    tessera.save(url, state, storage_options=opts, options=options)
    files = tessera.read_manifest(url, storage_options=opts).files
    assert len(files) == 64
    heads = [p for kind, p in proxy.seen if kind == "head"]
    lists = [p for kind, p in proxy.seen if kind == "list"]
    # The manifest's version (claim, publish), and the owner marker once after the PUT (the
    # fence against another job's retention).
    assert all(p.endswith("/manifest.json") or "/.tessera-saves/" in p for p in heads) and len(heads) <= 4, heads
    assert len(lists) <= 6, lists  # a constant: check, markers before, data, markers after, timings
    # The manifest PUT takes effect but its answer is lost: the retry is refused (412), yet
    # the object holds exactly this save's manifest, so the save succeeds.
    from tessera.storage import FsspecStorage, RetryOptions

    class LoseTheCommitAnswer(FsspecStorage):
        def replace_if(self, path: str, data: bytes, expected: str | None, *, owner: str | None = None) -> None:
            proxy.inject("put_object", "lose_answer", 1)
            super().replace_if(path, data, expected, owner=owner)

    store = LoseTheCommitAnswer(
        url, opts, retry=RetryOptions(max_attempts=4, initial_backoff_s=0.01, max_backoff_s=0.05)
    )
    state2 = {f"t{i}": torch.full((8,), float(i) + 0.5) for i in range(64)}
    proxy.seen.clear()
    result = tessera.save(url, state2, storage=store, options=options)
    puts = [p for kind, p in proxy.seen if kind == "put_object" and p.endswith("/manifest.json")]
    assert len(puts) == 2, puts  # the lost attempt and the refused retry
    assert tessera.read_manifest(url, storage_options=opts).save_id == result.save_id
    out = {f"t{i}": torch.zeros(8) for i in range(64)}
    tessera.load(url, out, storage_options=opts, options=NO_TIMINGS)
    assert torch.equal(out["t63"], state2["t63"])


def test_commit_checks_every_file_it_commits(tmp_path: Path) -> None:
    # A data file that vanished between the write and the commit is named, and nothing commits.
    class Losing(FileStorage):
        def write_atomic(self, path: str, data: bytes) -> None:
            super().write_atomic(path, data)

        def sync_dirs(self, paths) -> None:  # type: ignore[no-untyped-def]
            super().sync_dirs(paths)
            for p in paths:
                os.unlink(self._abs(p))  # storage "lost" the write

    path = str(tmp_path / "ckpt")
    tessera.save(path, make_state(1))
    with pytest.raises(CommitCheckError, match=r"data/[0-9a-f]+/0-0\.safetensors \(written by rank 0\): missing"):
        tessera.save(path, make_state(2), storage=Losing(path))
    assert _load(path) == 1


# --------------------------------------------------------------------------------------
# 3. Ranks that pass different paths


def _save_per_rank_path(rank: int, world: int, root: str) -> str:
    try:
        tessera.save(os.path.join(root, f"node-{rank}"), {"w": torch.full((4,), float(rank))})
    except LocationMismatchError as e:
        return str(e)
    return "saved"


def test_ranks_that_pass_different_paths_fail_on_every_rank(tmp_path: Path) -> None:
    # Reproduction 3: rank 0 committed a manifest naming files that exist only under rank 1's path.
    out = run_distributed(_save_per_rank_path, 2, str(tmp_path))
    for msg in out:
        assert "do not agree on where the checkpoint is" in msg, out
        assert f"rank 0: file://{tmp_path}/node-0" in msg and f"rank 1: file://{tmp_path}/node-1" in msg
    for r in range(2):
        assert not os.path.exists(tmp_path / f"node-{r}" / MANIFEST_NAME)
        assert [f for f in _tree(str(tmp_path / f"node-{r}")) if not f.endswith(".tessera-lock")] == []


# --------------------------------------------------------------------------------------
# 4. Full disk


DISK_BYTES = 12 << 20


def _usage(root: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


@pytest.fixture
def small_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A 12 MiB filesystem: a real tmpfs where mounting is allowed (root), else a directory
    whose writes fail with ENOSPC, at the ``os.write`` call, once its files would exceed 12 MiB."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(mnt)]
    use_tmpfs = os.environ.get("TESSERA_TEST_NO_TMPFS") != "1"  # to exercise the fallback
    if use_tmpfs and subprocess.run(mount, capture_output=True).returncode == 0:
        try:
            yield mnt
        finally:
            subprocess.run(["umount", "-l", str(mnt)], check=False)
        return
    real_write = os.write

    def write(fd: int, data) -> int:  # type: ignore[no-untyped-def]
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if target.startswith(str(mnt) + "/") and _usage(mnt) + len(memoryview(data).cast("B")) > DISK_BYTES:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    yield mnt


def _free(mnt: Path) -> int:
    return shutil.disk_usage(mnt).free if os.path.ismount(mnt) else DISK_BYTES - _usage(mnt)


def _mb_state(mb: float, k: int) -> dict:
    return {"w": torch.full((int(mb * (1 << 20)) // 4,), float(k)), "k": k}


def test_full_disk_save_leaves_nothing_behind(small_disk: Path) -> None:
    # Reproduction 4: the failed save left its partial data file, the disk stayed full, and
    # every later save failed too.
    tessera.save(str(small_disk / "a"), _mb_state(4, 1))
    free = _free(small_disk)
    with pytest.raises(StorageError, match="No space left on device"):
        tessera.save(str(small_disk / "b"), _mb_state(9, 2))
    assert _tree(str(small_disk / "b")) in ([], [".tessera-lock"])
    assert _free(small_disk) == free
    tessera.save(str(small_disk / "c"), _mb_state(4, 3))  # fits in what is left
    state = {"w": torch.zeros((1 << 20,)), "k": 0}
    tessera.load(str(small_disk / "c"), state, options=NO_TIMINGS)
    assert state["k"] == 3 and bool((state["w"] == 3).all())


def test_manager_applies_retention_before_saving_when_asked(small_disk: Path) -> None:
    root = str(small_disk / "run")
    with tessera.CheckpointManager(root, keep_last=2) as mgr:
        mgr.save(1, _mb_state(4, 1))
        mgr.save(2, _mb_state(4, 2))
        with pytest.raises(StorageError):  # retention only after a commit: no room for step 3
            mgr.save(3, _mb_state(4, 3))
        assert mgr.steps() == [1, 2]
    with tessera.CheckpointManager(root, keep_last=2, retention_before_save=True) as mgr:
        mgr.save(3, _mb_state(4, 3))  # step 1 goes first, step 2 (the newest) stays
        assert mgr.steps() == [2, 3]
        assert mgr.pointer_step() == 3


def test_enospc_writing_the_manifest_is_a_storage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Single process: an ENOSPC while writing the manifest used to surface as DistributedError.
    real_write = os.write

    def write(fd: int, data) -> int:  # type: ignore[no-untyped-def]
        if ".tmp-" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    path = str(tmp_path / "ckpt")
    tessera.save(path, make_state(1))
    monkeypatch.setattr(os, "write", write)
    with pytest.raises(StorageError, match="No space left on device") as info:
        tessera.save(path, make_state(2))
    assert not isinstance(info.value, tessera.errors.DistributedError)
    monkeypatch.undo()
    assert _load(path) == 1
    m = tessera.read_manifest(path)
    assert sorted(os.listdir(os.path.join(path, "data"))) == [m.save_id]  # the failed save's files are gone


# --------------------------------------------------------------------------------------
# 6. Nothing fails silently


def _run_script(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": str(REPO), "TESSERA_TIMEOUT_S": "60"}
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path
    )


def test_unwaited_async_failure_is_printed_at_exit(tmp_path: Path) -> None:
    # Reproduction 6a: nothing was printed.
    r = _run_script(
        tmp_path,
        """
        import torch, tessera
        open("blocker", "w").write("a file, not a directory")
        tessera.async_save("blocker/ckpt", {"w": torch.ones(3)})
        """,
    )
    assert "tessera: ERROR: the asynchronous save to blocker/ckpt failed in the background" in r.stderr, r.stderr
    assert "was NOT committed" in r.stderr


def test_manager_closed_after_the_process_group_is_gone_says_what_to_do(tmp_path: Path) -> None:
    # Reproduction 6b: only "a pending save failed at exit" in the log.
    r = _run_script(
        tmp_path,
        f"""
        import os, torch, torch.distributed as dist, torch.multiprocessing as mp, tessera

        def rank(r):
            dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=r, world_size=2)
            mgr = tessera.CheckpointManager("{tmp_path}/run", async_save=True)
            mgr.save(1, {{"w": torch.ones(1 << 16) * r}})
            dist.destroy_process_group()  # the bug: before mgr.close()

        if __name__ == "__main__":
            ps = [mp.get_context("spawn").Process(target=rank, args=(r,)) for r in range(2)]
            [p.start() for p in ps]
            [p.join(240) for p in ps]
        """,
    )
    if "destroyed" not in r.stderr and os.path.exists(tmp_path / "run" / "step-00000001" / MANIFEST_NAME):
        pytest.skip("the save finished before the process group was destroyed (no race this time)")
    assert "tessera: ERROR: checkpoint manager for" in r.stderr, r.stderr
    assert "before torch.distributed.destroy_process_group()" in r.stderr, r.stderr


# --------------------------------------------------------------------------------------
# 9. fsync order


def test_fsync_order_data_then_directories_then_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Reproduction 9: data/<id>/ was fsync'ed when created (before its files existed), never after.
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst, **kw) -> None:  # type: ignore[no-untyped-def]
        real_replace(src, dst, **kw)
        events.append(("replace", os.path.abspath(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    root = str(tmp_path / "run")
    with tessera.CheckpointManager(root) as mgr:
        mgr.save(5, make_state(1))
    monkeypatch.undo()
    ckpt = os.path.join(root, "step-00000005")
    m = tessera.read_manifest(ckpt)
    commit = events.index(("replace", os.path.join(ckpt, MANIFEST_NAME)))
    for f in m.files:
        full = os.path.join(ckpt, f.path)
        data_sync = events.index(("fsync", full))
        dir_syncs = [i for i, e in enumerate(events) if e == ("fsync", os.path.dirname(full))]
        assert any(data_sync < i < commit for i in dir_syncs), (
            f"{f.path}'s directory is not fsync'ed between it and the commit"
        )
    assert ("fsync", ckpt) in events[commit + 1 :], "the manifest's directory is not fsync'ed after the commit"
    tmp_syncs = [i for i, (kind, p) in enumerate(events[:commit]) if kind == "fsync" and MANIFEST_NAME + ".tmp-" in p]
    assert tmp_syncs, "the manifest is not fsync'ed before it is published"
    latest = events.index(("replace", os.path.join(root, "latest")))
    assert latest > commit
    assert ("fsync", root) in events[latest + 1 :], "latest's directory is not fsync'ed"
