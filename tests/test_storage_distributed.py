"""Multi-process saves and loads through S3 (a moto server on 127.0.0.1).

Every rank is a real spawned process in a gloo group (``run_distributed``). Ranks reach the
server the way a user's job would: ``AWS_ENDPOINT_URL`` and the credentials in the
environment with plain ``s3://`` URLs, or a configured backend passed as ``storage=``. Data
is random bits (NaN payloads included), compared bit for bit.

* S3: 2 ranks save DTensor ``Shard(0)`` state; 3 ranks load it as ``Shard(1)``; a plain
  process loads it whole.
* The bucket is deleted by the test process while the ranks are writing: every rank raises
  a ``CheckpointError`` naming ``NoSuchBucket``, and no ``manifest.json`` appears even though
  the bucket is back before the commit.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from s3_server import (  # noqa: F401 (fixtures)
    make_bucket,
    moto_endpoint,
    s3_bucket,
    s3_client,
    s3_options,
)
from torch.distributed.tensor import DTensor, Shard

import tessera
from tessera.errors import StorageError
from tessera.options import PlanOptions
from tessera.storage import FsspecStorage, RetryOptions
from tessera.storage.base import Buffer
from tests.dist_utils import run_distributed
from tests.layouts import mesh

pytestmark = pytest.mark.s3

TENSORS = {
    "model.w": ((37, 20), torch.float32),
    "model.emb": ((11, 6), torch.bfloat16),
    "optim.exp_avg": ((9, 5, 4), torch.float64),
    "optim.count": ((7, 3), torch.int64),
}
STEP = 1234


# ---------------------------------------------------------------------------------------------
# Helpers (module level: spawned ranks import them)


def _use_s3(endpoint: str) -> None:
    """What a launcher exports for every rank: endpoint and credentials."""
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_CONFIG_FILE="/dev/null",
        AWS_SHARED_CREDENTIALS_FILE="/dev/null",
        AWS_EC2_METADATA_DISABLED="true",
        NO_PROXY="127.0.0.1,localhost",
    )


def _truth(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bytes viewed as ``dtype``: every bit pattern (NaNs too) must survive."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + seed)
    n = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def _chunk(full: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """``rank``'s DTensor shard of ``full`` under ``Shard(dim)`` (torch's chunking rule)."""
    chunks = torch.chunk(full, world, dim=dim)
    return (chunks[rank] if rank < len(chunks) else full.narrow(dim, 0, 0)).clone()


def _state(rank: int, world: int, dim: int, *, zero: bool = False, seed: int = 0) -> dict:
    """``{"model": {...}, "optim": {...}, "step": ...}`` of DTensors ``Shard(dim)`` on all ranks."""
    device_mesh = mesh((world,))
    state: dict = {"step": -1 if zero else STEP + seed}
    for fqn, (shape, dtype) in TENSORS.items():
        full = _truth(fqn, shape, dtype, seed)
        local = _chunk(torch.zeros_like(full) if zero else full, dim, rank, world)
        top, leaf = fqn.split(".")
        state.setdefault(top, {})[leaf] = DTensor.from_local(
            local, device_mesh, [Shard(dim)], shape=full.shape, stride=full.stride()
        )
    return state


def _mismatches(state: dict, rank: int, world: int, dim: int, seed: int = 0) -> list[str]:
    """Names of the tensors (and plain values) that did not load bit-exactly on this rank."""
    bad = [] if state["step"] == STEP + seed else ["step"]
    for fqn, (shape, dtype) in TENSORS.items():
        top, leaf = fqn.split(".")
        want = _chunk(_truth(fqn, shape, dtype, seed), dim, rank, world)
        if not _same_bits(state[top][leaf].to_local(), want):
            bad.append(fqn)
    return bad


def _load_whole(url: str, endpoint: str, seed: int = 0) -> list[str]:
    """Load ``url`` into plain full-size tensors in this (non-distributed) process; mismatches."""
    target: dict = {"step": -1}
    for fqn, (shape, dtype) in TENSORS.items():
        top, leaf = fqn.split(".")
        target.setdefault(top, {})[leaf] = torch.zeros(shape, dtype=dtype)
    tessera.load(url, target, storage=FsspecStorage(url, s3_options(endpoint)))
    bad = [] if target["step"] == STEP + seed else ["step"]
    for fqn, (shape, dtype) in TENSORS.items():
        top, leaf = fqn.split(".")
        if not _same_bits(target[top][leaf], _truth(fqn, shape, dtype, seed)):
            bad.append(fqn)
    return bad


# ---------------------------------------------------------------------------------------------
# S3: save on 2 ranks, load resharded on 3 and in one plain process


def _save_s3(rank: int, world: int, endpoint: str, s3_url: str) -> None:
    _use_s3(endpoint)
    tessera.save(s3_url, _state(rank, world, dim=0))


def _load_s3(rank: int, world: int, endpoint: str, s3_url: str) -> list[str]:
    _use_s3(endpoint)
    target = _state(rank, world, dim=1, zero=True)
    result = tessera.load(s3_url, target)
    assert result.missing_keys == [] and result.unexpected_keys == []
    return _mismatches(target, rank, world, dim=1)


@pytest.fixture(scope="module")
def roundtrip(moto_endpoint: str, s3_bucket: str) -> dict:
    """Save the checkpoint on 2 ranks; check it in this process; reload it on 3 fresh ranks."""
    s3_url = f"s3://{s3_bucket}/{uuid.uuid4().hex[:12]}/direct"
    run_distributed(_save_s3, 2, moto_endpoint, s3_url)
    return {
        "whole": _load_whole(s3_url, moto_endpoint),
        "resharded": run_distributed(_load_s3, 3, moto_endpoint, s3_url),
    }


def test_s3_shard0_on_2_ranks_loads_as_shard1_on_3_ranks(roundtrip: dict) -> None:
    for rank, bad in enumerate(roundtrip["resharded"]):
        assert bad == [], f"rank {rank}"


def test_s3_checkpoints_load_whole_in_a_plain_process(roundtrip: dict) -> None:
    assert roundtrip["whole"] == []


# ---------------------------------------------------------------------------------------------
# The bucket disappears mid-save


class _PausingS3Storage(FsspecStorage):
    """Real S3 storage that lets the test act between this rank's data files.

    The rank's first data file is written normally; the others wait until the test has
    deleted the bucket. A failed write waits until the test has re-created the bucket, so
    the commit runs against an existing bucket: only tessera can keep the manifest out.
    """

    def __init__(self, url: str, sync_dir: str, rank: int) -> None:
        super().__init__(url, retry=RetryOptions(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.05))
        self._sync, self._rank = Path(sync_dir), rank
        self._lock = threading.Lock()
        self._started = 0

    def write_file(self, path: str, chunks: Iterable[Buffer]) -> None:
        if not path.startswith("data/"):  # rank 0's owner marker (tessera.engine.commit.claim)
            super().write_file(path, chunks)
            return
        with self._lock:
            first = self._started == 0
            self._started += 1
        if first:
            super().write_file(path, chunks)
            (self._sync / f"wrote-{self._rank}").touch()
            return
        _await_file(self._sync / "bucket-deleted")
        try:
            super().write_file(path, chunks)
        except StorageError:
            (self._sync / f"failed-{self._rank}").touch()
            _await_file(self._sync / "bucket-recreated")
            raise


def _await_file(path: Path, timeout: float = 60.0, abort: Callable[[], bool] = lambda: False) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if abort() or time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} did not appear")
        time.sleep(0.01)


def _save_into_vanishing_bucket(rank: int, world: int, endpoint: str, url: str, sync_dir: str) -> tuple:
    _use_s3(endpoint)
    device_mesh = mesh((world,))
    state = {  # 6 MiB of float32, 2 MiB per rank: two data files per rank with these options
        f"layer{i}": DTensor.from_local(
            _chunk(torch.arange(768 * 512, dtype=torch.float32).reshape(768, 512) + i, 0, rank, world),
            device_mesh,
            [Shard(0)],
            shape=(768, 512),
            stride=(512, 1),
        )
        for i in range(4)
    }
    options = tessera.SaveOptions(plan=PlanOptions(files_per_rank=2, min_file_bytes=256 << 10))
    store = _PausingS3Storage(url, sync_dir, rank)
    try:
        tessera.save(url, state, storage=store, options=options)
    except tessera.CheckpointError as e:
        return type(e).__name__, str(e), sorted(getattr(e, "failures", {})), store._started
    return None, "", [], store._started


def test_bucket_deleted_mid_save_fails_every_rank_and_commits_nothing(
    moto_endpoint: str,
    tmp_path: Path,
) -> None:
    world = 3
    bucket = make_bucket(moto_endpoint)
    url = f"s3://{bucket}/run/step-10"
    client = s3_client(moto_endpoint)
    with ThreadPoolExecutor(1) as pool:
        ranks = pool.submit(
            run_distributed, _save_into_vanishing_bucket, world, moto_endpoint, url, str(tmp_path), timeout=120
        )

        def wait(name: str) -> None:
            try:
                _await_file(tmp_path / name, 120, ranks.done)
            except TimeoutError:
                if ranks.done():
                    ranks.result()  # the ranks' own failure, with their tracebacks
                raise

        for r in range(world):  # every rank has one data file in S3 and the next one waiting
            wait(f"wrote-{r}")
        for obj in client.list_objects_v2(Bucket=bucket).get("Contents", []):
            client.delete_object(Bucket=bucket, Key=obj["Key"])
        client.delete_bucket(Bucket=bucket)
        (tmp_path / "bucket-deleted").touch()
        for r in range(world):
            wait(f"failed-{r}")
        client.create_bucket(Bucket=bucket)
        (tmp_path / "bucket-recreated").touch()
        results = ranks.result(timeout=120)
    for rank, (kind, message, failed, files) in enumerate(results):
        assert kind is not None, f"rank {rank}: the save did not fail"
        assert files == 2, f"rank {rank} wrote {files} data files, the test needs 2"
        assert failed == list(range(world)), f"rank {rank}: {message}"
        assert "NoSuchBucket" in message and f"bucket '{bucket}' does not exist" in message, f"rank {rank}: {message}"
        assert "data/" in message  # names the file
    assert client.list_objects_v2(Bucket=bucket).get("KeyCount") == 0  # no manifest.json, no data left
    with pytest.raises(tessera.CheckpointNotFoundError):
        tessera.read_manifest(url, storage=FsspecStorage(url, s3_options(moto_endpoint)))
