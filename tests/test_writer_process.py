"""The process writer (``SaveOptions(writer=WriterMode.PROCESS)``, issue #13 item 3).

Files written by the writer process must be byte-identical to the thread writer's, the
process and its shared-memory arena are reused across saves, failures surface as the same
typed error on every rank as with threads, and the writer never outlives its parent.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import tessera
from tessera import SaveOptions, StagingMode
from tessera.engine.saving import writer_process
from tessera.errors import StorageError
from tessera.options import WriterMode
from tests.dist_utils import run_distributed

THREAD = SaveOptions(writer=WriterMode.THREAD)
PROCESS = SaveOptions(writer=WriterMode.PROCESS)
REPO = Path(__file__).resolve().parent.parent


def _state(seed: int = 0) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(300, 70, generator=g),
        "half": torch.randn(33, 9, generator=g).to(torch.bfloat16),
        "ids": torch.arange(17, dtype=torch.int64) * (seed + 1),
        "strided": torch.randn(40, 30, generator=g).t(),  # not contiguous
        "empty": torch.zeros(0, 5),
        "step": seed,
    }


def _data_files(path: Path) -> dict[str, bytes]:
    """``{file name: bytes}`` of the checkpoint's data files (save ids differ between saves)."""
    return {f.name: f.read_bytes() for f in sorted(path.glob("data/*/*"))}


def _checksums(path: Path) -> dict[str, list]:
    manifest = json.loads((path / "manifest.json").read_text())
    return {k: v.get("table") or v.get("tiles") for k, v in manifest["tensors"].items()}


def _assert_loads(path: Path | str, state: dict[str, object]) -> None:
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()}
    tessera.load(str(path), target)
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(target[k], v), k
        else:
            assert target[k] == v, k


@pytest.fixture(autouse=True)
def _fresh_writer():
    writer_process.shutdown()
    yield
    writer_process.shutdown()


def test_process_writer_files_are_identical_to_the_thread_writer(tmp_path: Path) -> None:
    state = _state()
    tessera.save(str(tmp_path / "thread"), state, options=THREAD)
    tessera.save(str(tmp_path / "process"), state, options=PROCESS)
    tessera.async_save(str(tmp_path / "process-async"), state, options=PROCESS).wait()
    overlapped = SaveOptions(writer=WriterMode.THREAD, staging=StagingMode.BACKGROUND)
    tessera.async_save(str(tmp_path / "thread-async"), state, options=overlapped).wait()  # copy overlaps writes
    want = _data_files(tmp_path / "thread")
    assert want
    assert _data_files(tmp_path / "thread-async") == want
    assert _data_files(tmp_path / "process") == want
    assert _data_files(tmp_path / "process-async") == want
    assert _checksums(tmp_path / "process") == _checksums(tmp_path / "thread")
    _assert_loads(tmp_path / "process", state)
    _assert_loads(tmp_path / "process-async", state)


def test_the_writer_process_and_its_arena_are_reused_across_saves(tmp_path: Path) -> None:
    writer = writer_process._writer()
    pids, arenas = set(), set()
    states = [_state(seed) for seed in range(4)]
    pending = None
    for i, state in enumerate(states):
        if i % 2:
            pending = tessera.async_save(str(tmp_path / f"s{i}"), state, options=PROCESS)
            pending.wait()
        else:
            tessera.save(str(tmp_path / f"s{i}"), state, options=PROCESS)
        pids.add(writer.pid)
        assert writer._arena is not None
        arenas.add(id(writer._arena))
    assert len(pids) == 1 and None not in pids
    assert len(arenas) == 1  # same sizes: the shared memory of the first save is reused
    for i, state in enumerate(states):
        _assert_loads(tmp_path / f"s{i}", state)
    # A larger state grows the arena; the process stays.
    big = {**states[0], "more": torch.randn(500, 100)}
    tessera.save(str(tmp_path / "big"), big, options=PROCESS)
    assert writer.pid in pids and id(writer._arena) not in arenas
    _assert_loads(tmp_path / "big", big)


def test_a_dead_writer_process_is_replaced_by_the_next_save(tmp_path: Path) -> None:
    state = _state()
    tessera.save(str(tmp_path / "a"), state, options=PROCESS)
    writer = writer_process._writer()
    old = writer.pid
    assert old is not None
    os.kill(old, signal.SIGKILL)
    writer._proc.wait(timeout=30)
    tessera.save(str(tmp_path / "b"), state, options=PROCESS)
    assert writer.pid not in (None, old)
    _assert_loads(tmp_path / "b", state)


def test_the_writer_dying_mid_request_is_a_storage_error(tmp_path: Path) -> None:
    tessera.save(str(tmp_path / "a"), _state(), options=PROCESS)
    writer = writer_process._writer()
    os.kill(writer.pid, signal.SIGKILL)
    writer._proc.wait(timeout=30)
    with writer._lock, pytest.raises(StorageError, match="writer process died"):
        writer._call(writer._channel, ("stop",), "testing")


def test_a_writer_process_killed_during_a_save_fails_that_save_with_a_storage_error(tmp_path: Path) -> None:
    state = _state()
    tessera.save(str(tmp_path / "a"), state, options=PROCESS)
    writer = writer_process._writer()
    pid = writer.pid
    os.kill(pid, signal.SIGSTOP)  # the request reaches a child that cannot answer
    try:
        pending = tessera.async_save(str(tmp_path / "b"), state, options=PROCESS)
        pending.wait_staged()
        time.sleep(1.0)  # the tiny state is in the arena and the request sent by now
    finally:
        os.kill(pid, signal.SIGKILL)
    with pytest.raises(StorageError, match="writer process died"):
        pending.wait()
    assert not (tmp_path / "b" / "manifest.json").exists()
    assert not list((tmp_path / "b").glob("data/*/*"))
    tessera.save(str(tmp_path / "c"), state, options=PROCESS)  # a new writer process takes over
    assert writer.pid not in (None, pid)
    _assert_loads(tmp_path / "c", state)


def test_backends_other_than_files_fall_back_to_threads() -> None:
    state = _state()
    tessera.save("memory://tessera-writer-process/a", state, options=PROCESS)
    assert writer_process._writer().pid is None  # nothing was sent to a writer process
    _assert_loads("memory://tessera-writer-process/a", state)


def _sharded(rank: int, world: int, seed: int) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(64, 48, generator=g)
    rows = full.shape[0] // world
    local = full[rank * rows : (rank + 1) * rows].clone()
    return {
        "w": DTensor.from_local(local, mesh, [Shard(0)], shape=full.shape, stride=full.stride()),
        "bias": torch.arange(7.0) + seed,  # replicated: written once, by one rank
        "full": full,
    }


def _two_ranks_identical(rank: int, world: int, root: str) -> None:
    for seed in range(3):  # several saves in a row: the arena is reused
        state = _sharded(rank, world, seed)
        tessera.save(f"{root}/thread-{seed}", state, options=THREAD)
        tessera.save(f"{root}/process-{seed}", state, options=PROCESS)
        pending = tessera.async_save(f"{root}/async-{seed}", state, options=PROCESS)
        pending.wait()
        target = _sharded(rank, world, seed + 100)
        tessera.load(f"{root}/async-{seed}", target)
        assert torch.equal(target["w"].to_local(), state["w"].to_local())
        assert torch.equal(target["bias"], state["bias"])
    writer_process.shutdown()


def test_two_ranks_write_identical_files_with_the_process_writer(tmp_path: Path) -> None:
    run_distributed(_two_ranks_identical, 2, str(tmp_path))
    for seed in range(3):
        want = _data_files(tmp_path / f"thread-{seed}")
        assert {n.split("-")[0] for n in want} == {"0", "1"}  # both ranks wrote
        assert _data_files(tmp_path / f"process-{seed}") == want
        assert _data_files(tmp_path / f"async-{seed}") == want
        assert _checksums(tmp_path / f"process-{seed}") == _checksums(tmp_path / f"thread-{seed}")


def _failing_write(rank: int, world: int, root: str, writer: str) -> tuple[str, str]:
    path = f"{root}/{writer}"
    if rank == 0:
        os.makedirs(path)
        Path(path, "data").write_text("a file where the data directory goes")
    torch.distributed.barrier()
    try:
        tessera.save(path, _sharded(rank, world, 0), options=SaveOptions(writer=WriterMode(writer)))
    except Exception as e:
        return type(e).__name__, str(e)
    finally:
        writer_process.shutdown()
    raise AssertionError(f"rank {rank}: the save did not fail")


def test_a_failing_write_in_the_writer_process_is_the_usual_typed_error_on_every_rank(tmp_path: Path) -> None:
    threads = run_distributed(_failing_write, 2, str(tmp_path), "thread")
    process = run_distributed(_failing_write, 2, str(tmp_path), "process")
    for rank, ((t_type, _), (p_type, p_msg)) in enumerate(zip(threads, process)):
        assert p_type == t_type == "StorageError", (rank, t_type, p_type, p_msg)
        assert "rank 0" in p_msg and "rank 1" in p_msg, p_msg
    assert not (tmp_path / "process" / "manifest.json").exists()


def test_the_writer_process_exits_when_its_parent_is_killed(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import os, sys, time, torch, tessera
        from tessera import SaveOptions
        from tessera.engine.saving import writer_process
        tessera.save({str(tmp_path / "ck")!r}, {{"w": torch.ones(10)}}, options=SaveOptions(writer="process"))
        print(writer_process._writer().pid, flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        cwd=str(tmp_path),
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        child = int(parent.stdout.readline())
        os.kill(child, 0)  # alive while its parent is
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child), f"writer process {child} outlived its parent"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has exited (init reaps it)
    except FileNotFoundError:
        return False


def _failing_copy(rank: int, world: int, root: str) -> tuple[str, str, list[str]]:
    """Rank 1's background copy fails after its first tile (its writes have started by then)."""
    from tessera.engine.saving import staging as stage

    if rank == 1:
        real = stage.StagingBuffer.stage

        def failing(self, sources, *, copy, after=None, on_staged=None, **kwargs):
            def first_only(i, view):
                if i > 0:
                    raise RuntimeError("injected copy failure")
                on_staged(i, view)

            return real(self, sources, copy=copy, after=after, on_staged=first_only if on_staged else None, **kwargs)

        stage.StagingBuffer.stage = failing
    state = _sharded(rank, world, 0)
    state["more"] = torch.arange(12.0) + rank  # a second tile on every rank
    try:
        opts = SaveOptions(writer=WriterMode.THREAD, staging=StagingMode.BACKGROUND)  # copy in the background
        tessera.async_save(f"{root}/ck", state, options=opts).wait()
    except Exception as e:
        return type(e).__name__, str(e), sorted(p.name for p in Path(root, "ck").glob("data/*/*"))
    raise AssertionError(f"rank {rank}: the save did not fail")


def test_a_copy_failing_while_files_are_written_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    results = run_distributed(_failing_copy, 2, str(tmp_path))
    for kind, message, _ in results:
        assert kind == "CheckpointError", (kind, message)
        assert "rank 1: staging tensors to host memory failed" in message and "injected copy failure" in message
    assert not (tmp_path / "ck" / "manifest.json").exists()
    assert not list((tmp_path / "ck").glob("data/*/*"))  # partial files of the failed save are gone
