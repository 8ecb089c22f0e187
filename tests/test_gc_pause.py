"""The cyclic collector paused while a load is planned: never a full collection inside, and
back on afterwards exactly when it was on before (nested and concurrent pauses)."""

from __future__ import annotations

import gc
import threading

import numpy as np
import torch

from tessera.engine.gc_pause import gc_paused
from tessera.engine.loading.plan import ReadTarget, plan_reads
from tessera.format.geometry import Box
from tessera.format.manifest import FileEntry, Manifest, TensorEntry, TileTable


def _manifest(tensors: int, tiles: int) -> Manifest:
    """``tensors`` vectors of ``tiles`` tiles of 4 elements each, one file."""
    n = tiles
    table = TileTable(
        ("data/s/0-0.safetensors",),
        np.zeros(n, np.int64),
        (np.arange(n, dtype=np.int64) * 4).reshape(n, 1),
        np.full((n, 1), 4, np.int64),
        np.arange(n, dtype=np.int64) * 16,
        np.full(n, 16, np.int64),
        np.ones(n, np.int64),
        np.zeros(n, np.uint64),
    )
    entries = {f"t{i}": TensorEntry("float32", (4 * n,), table=table) for i in range(tensors)}
    return Manifest("s", 1, 1 << 20, entries, files=(FileEntry("data/s/0-0.safetensors", 0, 16 * n),))


def test_a_load_plan_runs_no_collection_and_leaves_the_collector_as_it_found_it() -> None:
    m = _manifest(400, 64)
    targets = [ReadTarget(f"t{i}", Box((1,), (254,)), torch.empty(254)) for i in range(400)]
    seen: list[int] = []
    inside = threading.Event()

    def count(phase: str, info: dict) -> None:
        if phase == "start" and inside.is_set():
            seen.append(info["generation"])

    gc.callbacks.append(count)
    was = gc.isenabled()
    try:
        gc.enable()
        gc.set_threshold(10)  # collect after every 10 allocations: hundreds of times in 400 targets
        inside.set()
        try:
            plan_reads(m, targets)
        finally:
            inside.clear()
            gc.set_threshold(700)
        # At most the one young collection when the pause ends (of what was allocated inside).
        assert len(seen) <= 1, seen
        assert gc.isenabled()
        gc.disable()  # a caller that runs without the collector keeps it off
        plan_reads(m, targets[:3])
        assert not gc.isenabled()
    finally:
        gc.callbacks.remove(count)
        (gc.enable if was else gc.disable)()


def test_nested_and_concurrent_pauses_resume_once_at_the_end() -> None:
    was = gc.isenabled()
    gc.enable()
    try:
        entered, release = threading.Barrier(2), threading.Event()

        def other() -> None:
            with gc_paused():
                entered.wait()
                release.wait()

        t = threading.Thread(target=other)
        with gc_paused():
            with gc_paused():
                assert not gc.isenabled()
            assert not gc.isenabled()
            t.start()
            entered.wait()
        assert not gc.isenabled()  # the other thread's pause is still on
        release.set()
        t.join()
        assert gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
