"""Pins of dedup saves protect a rank's shared writes whatever the clocks and however slow rank 0 is.

Ranks other than 0 pin and write a save's new shared tiles before rank 0 claims the save (they do
not wait for it). A collection in that gap must not take them: not when the pinning rank's clock is
behind, and not when rank 0's retention and collection outlast any grace period.
"""

from __future__ import annotations

import os
import time

import pytest

from tessera.engine.saving import dedup
from tessera.engine.tile_pins import read_pins, write_pin
from tessera.format.manifest import FileEntry
from tessera.manager import CheckpointManager
from tessera.manager.shared_tiles import SharedTiles
from tessera.storage import FileStorage
from tests.dist_utils import run_distributed
from tests.test_dedup import PINS, TILES, check_root, rank_state

SKEW_S = 600.0  # rank 1's clock, 10 minutes behind
SLOW_S = 130.0  # rank 0's collection, longer than the 120 s any grace period allowed


def _saves(rank: int, world: int, root: str, case: str) -> list[int]:
    real_time = time.time
    offset = [0.0]
    if case == "skewed clock" and rank == 1:
        offset[0] = -SKEW_S
    time.time = lambda: real_time() + offset[0]  # this rank's clock, for everything in its process
    real_collect = SharedTiles.collect

    def slow_collect(self: SharedTiles) -> list[str]:
        # Rank 0 collects after each commit; the other ranks go on to the next save meanwhile,
        # pin and write. The wait lets them; the clock jump makes the collection "take" SLOW_S.
        time.sleep(1.5)
        if case == "slow retention":
            offset[0] += SLOW_S
        return real_collect(self)

    if rank == 0:
        SharedTiles.collect = slow_collect  # type: ignore[method-assign]
    committed = []
    with CheckpointManager(root, dedup=True, keep_last=2) as mgr:
        for step in range(1, 5):
            mgr.save(step, rank_state(step, rank, world))
            committed.append(step)
    return committed


@pytest.mark.parametrize("case", ["skewed clock", "slow retention"])
def test_a_rank_s_shared_writes_survive_a_collection_before_rank_0_claims(tmp_path, case: str) -> None:
    root = str(tmp_path / "run")
    out = run_distributed(_saves, 2, root, case)
    assert out == [[1, 2, 3, 4], [1, 2, 3, 4]], out
    refs = check_root(root, [3, 4])  # every kept step verifies and loads bit-exactly
    assert {".pins", *set().union(*refs.values())} >= set(os.listdir(os.path.join(root, TILES))) - {PINS}


def test_a_save_whose_new_tiles_were_collected_says_so(tmp_path) -> None:
    """The commit check names the cause: the rank's pin went with its files (a collection), or not (by hand)."""
    tiles = FileStorage(str(tmp_path / TILES))
    save_id = "00000000000000aa"
    write_pin(tiles, save_id, str(tmp_path / "step-00000002"), frozenset(), rank=1)
    path = f"@tiles/{save_id}/1-0.safetensors"
    missing = {path: FileEntry(path, 1, 8)}
    assert "deleted by hand" in dedup.why_missing(tiles, save_id, missing)
    tiles.delete([f"{PINS}/{save_id}.r1"])
    assert not read_pins(tiles)
    why = dedup.why_missing(tiles, save_id, missing)
    assert "pins of rank(s) [1] of this save are gone too" in why and "collection" in why, why
