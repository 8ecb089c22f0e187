"""The original error type reaches the caller on every rank, with each rank's cause attached.

``except tessera.StateMismatchError`` (``MissingKeysError``, ``StorageError``, ...) must work
the same in a single process and on every rank of a multi-rank job; ``DistributedError`` is
left for ranks that failed differently (and for timeouts).
"""

from __future__ import annotations

import errno
import os

import pytest
import torch

import tessera
from tessera.errors import RankFailure, collective_error
from tessera.storage import FileStorage
from tests.dist_utils import run_distributed

NO_TIMINGS = tessera.LoadOptions(record_timings=False)


def _state(rank: int) -> dict:
    return {"w": tessera.ShardedTensor(torch.full((2, 3), float(rank)), (4, 3), (2 * rank, 0)), "step": 1}


def _outcome(fn) -> tuple[str, dict[int, str], str]:
    try:
        fn()
    except tessera.CheckpointError as e:
        return type(e).__name__, dict(e.failures), str(e)
    return "no error", {}, ""


class _FailingWrites(FileStorage):
    """A real local backend whose data writes fail (as a full disk does) on one rank."""

    def __init__(self, url: str, fail: bool) -> None:
        super().__init__(url)
        self.fail = fail

    def write_file(self, path, chunks):
        if self.fail and path.startswith("data/"):
            raise tessera.StorageError(f"injected: No space left on device writing {path}")
        return super().write_file(path, chunks)


def _typed_failures(rank: int, world: int, path: str) -> dict:
    tessera.save(path, _state(rank))
    out: dict = {}

    # Only rank 1's target has a wrong shape.
    def wrong_shape() -> None:
        target = {"w": tessera.ShardedTensor(torch.zeros(2, 3 + rank), (4, 3 + rank), (2 * rank, 0)), "step": 0}
        tessera.load(path, target, options=NO_TIMINGS)

    try:
        wrong_shape()
    except tessera.StateMismatchError as e:  # the point: this except clause works on every rank
        out["shape"] = (type(e).__name__, dict(e.failures), str(e))
    # Every rank misses a key.
    try:
        tessera.load(path, {**_state(rank), f"extra{rank}": torch.zeros(1)}, options=NO_TIMINGS)
    except tessera.MissingKeysError as e:
        out["missing"] = (type(e).__name__, dict(e.failures), str(e))
    # Writes fail on rank 1 only.
    try:
        tessera.save(path, _state(rank), storage=_FailingWrites(path, fail=rank == 1))
    except tessera.StorageError as e:
        out["storage"] = (type(e).__name__, dict(e.failures), str(e))
    # Different failures on different ranks: a DistributedError listing both.
    state = _state(rank)
    state["bad"] = object() if rank == 0 else torch.empty(2, device="meta")
    out["mixed"] = _outcome(lambda: tessera.save(path, state))
    # The checkpoint of the first save is intact and loads after all that.
    target = {"w": tessera.ShardedTensor(torch.zeros(2, 3), (4, 3), (2 * rank, 0)), "step": 0}
    tessera.load(path, target, options=NO_TIMINGS)
    out["intact"] = torch.equal(target["w"].local, torch.full((2, 3), float(rank)))
    return out


def test_the_original_error_type_reaches_every_rank(tmp_path) -> None:
    out = run_distributed(_typed_failures, 2, str(tmp_path / "c"))
    for rank, o in enumerate(out):
        kind, failures, message = o["shape"]
        assert kind == "StateMismatchError" and set(failures) == {1}, (rank, o["shape"])
        assert "'w'" in failures[1] and "rank 1" in message and "'w'" in message
        kind, failures, message = o["missing"]
        assert kind == "MissingKeysError" and set(failures) == {0, 1}, (rank, o["missing"])
        assert "'extra0'" in failures[0] and "'extra1'" in failures[1] and "'extra1'" in message
        kind, failures, message = o["storage"]
        assert kind == "StorageError" and set(failures) == {1}, (rank, o["storage"])
        assert "No space left" in failures[1] and (rank == 1 or "rank 1" in message)
        kind, failures, message = o["mixed"]
        assert kind == "DistributedError" and set(failures) == {0, 1}, (rank, o["mixed"])
        assert failures[0].startswith("PickleNotAllowedError") and "'bad'" in failures[0]
        assert failures[1].startswith("InvalidStateError") and "meta" in failures[1]
        assert o["intact"]


def test_single_process_raises_the_same_types(tmp_path) -> None:
    path = str(tmp_path / "c")
    tessera.save(path, {"w": torch.ones(4), "step": 1})
    with pytest.raises(tessera.StateMismatchError, match="'w'"):
        tessera.load(path, {"w": torch.zeros(5), "step": 0}, options=NO_TIMINGS)
    with pytest.raises(tessera.MissingKeysError, match="'x'"):
        tessera.load(path, {"w": torch.zeros(4), "x": torch.zeros(1)}, options=NO_TIMINGS)
    with pytest.raises(tessera.StorageError, match="No space left") as info:
        tessera.save(path, {"w": torch.ones(4)}, storage=_FailingWrites(path, fail=True))
    assert not isinstance(info.value, tessera.errors.DistributedError)


class _ManifestWriteFails(FileStorage):
    """ENOSPC writing the manifest's temporary file (the fenced publish, ``replace_if``, and
    ``write_atomic`` both write one); data files are written normally."""

    def _write_new(self, full, data):
        if os.path.basename(full).startswith("manifest.json.tmp-"):
            raise OSError(errno.ENOSPC, "No space left on device (injected)", full)
        super()._write_new(full, data)


def test_a_failed_manifest_write_in_one_process_is_a_storage_error(tmp_path) -> None:
    path = str(tmp_path / "c")
    with pytest.raises(tessera.StorageError, match="committing .*manifest.json failed.*No space left") as info:
        tessera.save(path, {"w": torch.ones(4)}, storage=_ManifestWriteFails(path))
    assert not isinstance(info.value, tessera.errors.DistributedError)
    assert not os.path.exists(os.path.join(path, "manifest.json"))


def test_collective_error_picks_the_common_tessera_type() -> None:
    def rec(rank: int, e: BaseException) -> RankFailure:
        return RankFailure.of(rank, e)

    same = collective_error(
        "x", {0: rec(0, tessera.errors.ManifestError("a")), 1: rec(1, tessera.errors.ManifestError("b"))}
    )
    assert type(same) is tessera.errors.ManifestError and same.failures == {
        0: "ManifestError: a",
        1: "ManifestError: b",
    }
    related = collective_error(
        "x", {0: rec(0, tessera.MissingKeysError("a")), 1: rec(1, tessera.StateMismatchError("b"))}
    )
    assert type(related) is tessera.StateMismatchError
    mixed = collective_error("x", {0: rec(0, tessera.errors.ManifestError("a")), 1: rec(1, tessera.StorageError("b"))})
    assert type(mixed) is tessera.errors.DistributedError and "rank 1: StorageError: b" in str(mixed)
    builtin = collective_error("x", {0: rec(0, TypeError("a"))})
    assert type(builtin) is tessera.errors.DistributedError
    text = collective_error("x", {0: "something"})
    assert type(text) is tessera.errors.DistributedError
