"""The deprecated one-checkpoint host-memory tier: two-stage commit, load preference, deferred deletes,
failures, exit (a manager's ``tier::`` root is the local tier: tests/test_local_tier.py, test_manager.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from s3_server import FaultProxy, fault_proxy, moto_endpoint, s3_bucket, s3_options  # noqa: F401 (fixtures)

import tessera
from tessera.errors import StorageError
from tessera.storage import FileStorage, FsspecStorage, MemoryTierStorage, RetryOptions, storage_for
from tessera.storage.memory_tier import default_memory_root

FAST_RETRY = RetryOptions(max_attempts=5, initial_backoff_s=0.01, max_backoff_s=0.05)


@pytest.fixture
def durable(tmp_path: Path) -> FileStorage:
    return FileStorage(str(tmp_path / "durable"))


def _tier(durable: object, tmp_path: Path, name: str = "shm", **kwargs: object) -> MemoryTierStorage:
    return MemoryTierStorage(durable, memory_root=str(tmp_path / name), **kwargs)  # type: ignore[arg-type]


def _save(tier: MemoryTierStorage, gen: str, files: dict[str, bytes], manifest: bytes) -> None:
    for name, content in files.items():
        tier.write_file(f"data/{gen}/{name}", [memoryview(content)])
    tier.write_atomic("manifest.json", manifest)


def test_the_one_checkpoint_tier_is_deprecated_with_a_pointer_to_the_local_tier(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    try:
        with pytest.warns(DeprecationWarning, match=r"CheckpointManager\('tier::<url>'\)") as seen:
            tessera.save("tier::" + path, {"w": torch.arange(4.0)})
            storage_for("tier::" + path).wait_persisted()
    finally:
        shutil.rmtree(default_memory_root(path), ignore_errors=True)
    assert any(w.filename == __file__ for w in seen)  # attributed to the caller, not to tessera
    with pytest.warns(DeprecationWarning, match="deprecated"):
        MemoryTierStorage(str(tmp_path / "other"), memory_root=str(tmp_path / "mem"))


def test_commit_lands_in_memory_then_durable(durable: FileStorage, tmp_path: Path) -> None:
    tier = _tier(durable, tmp_path)
    try:
        _save(tier, "g1", {"0-0.safetensors": b"a" * 1000, "1-0.safetensors": b"b" * 10}, b'{"save_id": "g1"}')
        tier.wait_persisted()
        for store in (tier.memory, durable):
            assert store.list() == ["data/g1/0-0.safetensors", "data/g1/1-0.safetensors", "manifest.json"]
            assert store.read_file("manifest.json") == b'{"save_id": "g1"}'
            assert store.read_file("data/g1/0-0.safetensors") == b"a" * 1000
    finally:
        tier.close()


@pytest.mark.s3
def test_durable_manifest_is_written_last(
    fault_proxy: tuple[FaultProxy, str],
    s3_bucket: str,
    tmp_path: Path,
) -> None:
    proxy, endpoint = fault_proxy
    durable = FsspecStorage(f"s3://{s3_bucket}/{uuid.uuid4().hex}", s3_options(endpoint), retry=FAST_RETRY)
    throttled = proxy.inject("put_object", "slowdown", 3)  # persistence retries through throttling
    tier = _tier(durable, tmp_path)
    try:
        files = {f"{r}-0.safetensors": os.urandom(20_000 + r) for r in range(6)}
        _save(tier, "g1", files, b'{"save_id": "g1"}')
        tier.wait_persisted()
    finally:
        tier.close()
    assert throttled.hits == 3
    puts = [path for kind, path in proxy.seen if kind == "put_object"]
    assert puts[-1].endswith("/manifest.json")
    # The throttled requests were data files (copied first); the manifest went up once, last.
    assert sum(p.endswith("/manifest.json") for p in puts) == 1
    assert sorted(durable.list()) == sorted([f"data/g1/{n}" for n in files] + ["manifest.json"])
    for name, content in files.items():
        assert durable.read_file(f"data/g1/{name}") == content


@pytest.mark.s3
def test_cleanup_after_commit_does_not_wait_for_the_durable_copy(
    fault_proxy: tuple[FaultProxy, str],
    s3_bucket: str,
    tmp_path: Path,
) -> None:
    proxy, endpoint = fault_proxy
    durable = FsspecStorage(f"s3://{s3_bucket}/{uuid.uuid4().hex}", s3_options(endpoint), retry=FAST_RETRY)
    tier = _tier(durable, tmp_path)
    _save(tier, "g1", {"x.bin": b"1"}, b"m1")
    tier.wait_persisted()
    stall = proxy.inject("put_object", "stall", 1)  # the durable copy of g2 hangs
    try:
        _save(tier, "g2", {"x.bin": b"2"}, b"m2")
        # What the save does right after its commit: list, then delete the old generation.
        assert tier.list("data") == ["data/g1/x.bin", "data/g2/x.bin"]
        tier.delete(["data/g1/x.bin"])
        deadline = time.monotonic() + 10
        while stall.hits == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stall.hits == 1  # the persistence is really held up at this point
        with pytest.raises(TimeoutError):
            tier.wait_persisted(timeout=0.05)
        assert durable.read_file("manifest.json") == b"m1"
        assert durable.exists("data/g1/x.bin")  # still referenced by the durable manifest
        # A load opens its own object for the URL; it still waits for this commit to land.
        fresh = _tier(durable, tmp_path)
        with ThreadPoolExecutor(1) as pool:
            loaded = pool.submit(fresh.read_file, "manifest.json")
            time.sleep(0.2)
            assert not loaded.done()
            stall.gate.set()
            assert loaded.result(timeout=30) == b"m2"
        assert durable.read_file("manifest.json") == b"m2"
        assert not durable.exists("data/g1/x.bin")  # the deferred delete, after the commit
    finally:
        stall.gate.set()
        tier.close()


def test_load_prefers_the_memory_copy_only_when_manifests_match(durable: FileStorage, tmp_path: Path) -> None:
    tier = _tier(durable, tmp_path)
    try:
        _save(tier, "g1", {"0-0.safetensors": b"memory!!"}, b'{"save_id": "g1"}')
        tier.wait_persisted()
    finally:
        tier.close()
    # Make the two copies distinguishable (same size) behind the tier's back.
    durable.write_file("data/g1/0-0.safetensors", [b"durable!"])

    reader = _tier(durable, tmp_path)  # a fresh process on the same node
    assert reader.read_file("manifest.json") == b'{"save_id": "g1"}'
    out = bytearray(8)
    reader.read_into("data/g1/0-0.safetensors", 0, memoryview(out))
    assert bytes(out) == b"memory!!"
    assert reader.read_file("data/g1/0-0.safetensors") == b"memory!!"

    # Another job committed a different checkpoint at the durable URL: memory is stale.
    durable.write_atomic("manifest.json", b'{"save_id": "other"}')
    reader = _tier(durable, tmp_path)
    assert reader.read_file("manifest.json") == b'{"save_id": "other"}'
    reader.read_into("data/g1/0-0.safetensors", 0, memoryview(out))
    assert bytes(out) == b"durable!"


def test_files_missing_from_memory_are_read_from_durable(durable: FileStorage, tmp_path: Path) -> None:
    tier = _tier(durable, tmp_path)
    try:
        _save(tier, "g1", {"a.bin": b"A" * 100, "b.bin": b"B" * 100}, b"{}")
        tier.wait_persisted()
    finally:
        tier.close()
    os.unlink(tmp_path / "shm" / "data" / "g1" / "b.bin")  # e.g. written by another node
    reader = _tier(durable, tmp_path)
    reader.read_file("manifest.json")
    out = bytearray(10)
    reader.read_into("data/g1/b.bin", 5, memoryview(out))
    assert bytes(out) == b"B" * 10
    assert reader.size("data/g1/b.bin") == 100


def test_a_memory_only_commit_is_not_loaded_but_can_be_pushed_out(durable: FileStorage, tmp_path: Path) -> None:
    tier = _tier(durable, tmp_path)
    _save(tier, "g1", {"x.bin": b"1"}, b'{"save_id": "g1"}')
    tier.close()
    # The process dies after committing g2 in memory, before persisting it.
    crashed = _tier(durable, tmp_path, auto_persist=False)
    _save(crashed, "g2", {"x.bin": b"2"}, b'{"save_id": "g2"}')
    assert durable.read_file("manifest.json") == b'{"save_id": "g1"}'

    restarted = _tier(durable, tmp_path)
    assert restarted.read_file("manifest.json") == b'{"save_id": "g1"}'
    assert restarted.read_file("data/g1/x.bin") == b"1"
    assert not restarted.exists("manifest.json.tmp")
    restarted.persist().result()
    assert restarted.read_file("manifest.json") == b'{"save_id": "g2"}'
    assert durable.read_file("data/g2/x.bin") == b"2"
    restarted.close()


def test_deletes_reach_durable_only_after_the_next_durable_commit(durable: FileStorage, tmp_path: Path) -> None:
    tier = _tier(durable, tmp_path, auto_persist=False)
    try:
        _save(tier, "g1", {"x.bin": b"1"}, b'{"save_id": "g1"}')
        tier.persist().result()
        _save(tier, "g2", {"x.bin": b"2"}, b'{"save_id": "g2"}')  # committed in memory only
        tier.delete(["data/g1/x.bin"])  # the save's cleanup of the previous generation
        assert not (tmp_path / "shm" / "data" / "g1" / "x.bin").exists()
        # The durable store still holds g1, complete: its file must survive.
        assert durable.read_file("manifest.json") == b'{"save_id": "g1"}'
        assert durable.read_file("data/g1/x.bin") == b"1"
        tier.persist().result()
        assert durable.read_file("manifest.json") == b'{"save_id": "g2"}'
        assert not durable.exists("data/g1/x.bin")
        # Once durable is caught up, deletes apply at once.
        tier.delete(["data/g2/x.bin"])
        assert not durable.exists("data/g2/x.bin")
    finally:
        tier.close()


def test_rewriting_a_deleted_path_cancels_its_deferred_delete(durable: FileStorage, tmp_path: Path) -> None:
    tier = _tier(durable, tmp_path, auto_persist=False)
    try:
        _save(tier, "g1", {"x.bin": b"1"}, b"m1")
        tier.persist().result()
        tier.write_atomic("manifest.json", b"m2")
        tier.delete(["data/g1/x.bin"])
        tier.write_file("data/g1/x.bin", [b"again"])
        tier.persist().result()
        assert durable.read_file("data/g1/x.bin") == b"again"
    finally:
        tier.close()


def test_multi_node_protocol(durable: FileStorage, tmp_path: Path) -> None:
    # Two nodes, each with its own memory directory, share one durable store.
    node0 = _tier(durable, tmp_path, "shm0", auto_persist=False)
    node1 = _tier(durable, tmp_path, "shm1", auto_persist=False)
    try:
        node0.write_file("data/g1/0-0.safetensors", [b"rank0"])
        node1.write_file("data/g1/1-0.safetensors", [b"rank1"])
        node0.write_atomic("manifest.json", b'{"save_id": "g1"}')  # rank 0 commits in memory
        assert not durable.exists("manifest.json")
        for node, mine in ((node0, "data/g1/0-0.safetensors"), (node1, "data/g1/1-0.safetensors")):
            node.persist(files=[mine], commit=False).result()
        assert not durable.exists("manifest.json")  # not before rank 0 publishes it
        node0.persist(files=[], commit=True).result()  # after a barrier, rank 0 only
        assert durable.list() == ["data/g1/0-0.safetensors", "data/g1/1-0.safetensors", "manifest.json"]
        assert node0.read_file("manifest.json") == b'{"save_id": "g1"}'
        assert node0.read_file("data/g1/1-0.safetensors") == b"rank1"  # not in node 0's memory
    finally:
        node0.close()
        node1.close()


def test_commit_is_refused_after_a_failed_file_copy(durable: FileStorage, tmp_path: Path) -> None:
    tier = _tier(durable, tmp_path, auto_persist=False)
    try:
        _save(tier, "g1", {"x.bin": b"1"}, b"m1")
        with pytest.raises(StorageError, match="vanished"):
            tier.persist(files=["data/g1/x.bin", "data/g1/never-written.bin"], commit=False).result()
        with pytest.raises(StorageError, match="never-written.bin"):
            tier.persist(files=[], commit=True).result()
        assert not durable.exists("manifest.json")  # nothing was published
        tier.delete(["data/g1/never-written.bin"])  # the save gave that file up
        tier.persist(files=[], commit=True).result()
        assert durable.read_file("manifest.json") == b"m1"
    finally:
        tier.close()


def test_multi_node_selects_per_rank_persistence(
    durable: FileStorage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert _tier(durable, tmp_path).per_rank
    with pytest.raises(ValueError, match="per_rank=False"):
        _tier(durable, tmp_path, per_rank=False)
    assert not _tier(durable, tmp_path, auto_persist=False).per_rank
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert not _tier(durable, tmp_path).per_rank


@pytest.mark.s3
def test_failed_persistence_keeps_the_previous_durable_commit(
    moto_endpoint: str,
    s3_bucket: str,
    tmp_path: Path,
) -> None:
    good = FsspecStorage(f"s3://{s3_bucket}/{uuid.uuid4().hex}", s3_options(moto_endpoint), retry=FAST_RETRY)
    missing = FsspecStorage(
        f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/x", s3_options(moto_endpoint), retry=FAST_RETRY
    )
    tier = _tier(missing, tmp_path)
    _save(tier, "g1", {"x.bin": b"1"}, b"{}")  # the memory commit itself succeeds
    with pytest.raises(StorageError, match="still holds its previous commit") as info:
        tier.wait_persisted()
    assert "does not exist" in str(info.value)
    with pytest.raises(StorageError):  # close() reports it too, after stopping its threads
        tier.close()
    # And against a working store, a later commit supersedes a failed one.
    tier = _tier(good, tmp_path, "shm2")
    _save(tier, "g1", {"x.bin": b"1"}, b"m1")
    tier.wait_persisted()
    assert good.read_file("manifest.json") == b"m1"
    tier.close()


def test_pending_persistence_completes_at_interpreter_exit(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        from tessera.storage import MemoryTierStorage
        tier = MemoryTierStorage({str(tmp_path / "durable")!r}, memory_root={str(tmp_path / "shm")!r})
        for i in range(20):
            tier.write_file(f"data/{{i}}.bin", [bytes(1 << 20)])
        tier.write_atomic("manifest.json", b"done")
        # no wait_persisted(): the interpreter exits with the persistence in flight
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=os.getcwd(), timeout=120)
    durable = FileStorage(str(tmp_path / "durable"))
    assert durable.read_file("manifest.json") == b"done"
    assert len(durable.list("data")) == 20


def test_default_memory_root_nests_like_the_checkpoints() -> None:
    run, step = default_memory_root("s3://bucket/run"), default_memory_root("s3://bucket/run/step-1")
    assert step == os.path.join(run, "step-1")
    assert default_memory_root("s3://other/run") != run  # another bucket, another directory
    assert default_memory_root("gs://bucket/run") != run
    assert default_memory_root("/ckpt/run") == default_memory_root("file:///ckpt/run")
    escaped = default_memory_root("s3://bucket/../../etc")
    assert escaped.startswith(os.path.dirname(run)) and ".." not in escaped
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        assert run.startswith("/dev/shm/tessera/s3-bucket-") and run.endswith("/run")


def test_a_tier_on_the_run_root_sees_and_cleans_step_memory_copies(tmp_path: Path) -> None:
    # What a checkpoint manager does: one tier per step for saves, one on the root for
    # listing, the "latest" pointer and retention.
    root_url, shm = str(tmp_path / "run"), tmp_path / "shm"
    step_tiers = {}
    for step in (1, 2):
        tier = MemoryTierStorage(f"{root_url}/step-{step}", memory_root=str(shm / f"step-{step}"))
        _save(tier, "g", {"x.bin": bytes([step])}, b"m%d" % step)
        step_tiers[step] = tier
    step_tiers[2].close()
    step_tiers[1].close()
    hung = MemoryTierStorage(f"{root_url}/step-3", memory_root=str(shm / "step-3"), auto_persist=False)
    _save(hung, "g", {"x.bin": b"3"}, b"m3")  # committed in memory only: not committed yet
    hung.close()

    root = MemoryTierStorage(root_url, memory_root=str(shm))
    try:
        listed = root.list()
        assert "step-1/manifest.json" in listed and "step-2/manifest.json" in listed
        assert "step-3/manifest.json" not in listed and not root.exists("step-3/manifest.json")
        assert "step-3/data/g/x.bin" in listed
        root.write_atomic("latest", b"step-2\n")  # written through: durable at once
        assert FileStorage(root_url).read_file("latest") == b"step-2\n"
        root.delete(["step-1/manifest.json"])
        root.delete(["step-1/data/g/x.bin"])
        assert not (shm / "step-1").exists()  # the memory copy went with it
        assert not FileStorage(root_url).exists("step-1/manifest.json")
        with pytest.raises(ValueError, match="step-2/manifest.json"):
            root.write_atomic("step-2/manifest.json", b"{}")
    finally:
        root.close()
