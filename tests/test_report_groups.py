"""Report groups (issue #38): each group's leader combines its members' reports after the vote,
so that rank 0 reads ``N / group`` files at the commit; a group file that is late, torn or of
another save only makes rank 0 read those members' own reports."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import tessera
from tessera.engine.saving import report_groups
from tessera.errors import ManifestError
from tessera.format.rank_report import report_dir, report_path
from tessera.format.report_group import decode_group, encode_group, group_path, members
from tessera.storage.local import FileStorage
from tests.dist_utils import run_distributed


class CountingStorage(FileStorage):
    """A real FileStorage that records the paths it reads; a ``torn`` group file is written with
    one member's report damaged (as a torn write would leave it)."""

    def __init__(self, url: str, torn: str = "") -> None:
        super().__init__(url)
        self.reads: list[str] = []
        self.torn = torn

    def read_file(self, path: str) -> bytes:
        self.reads.append(path)
        return super().read_file(path)

    def write_atomic(self, path: str, data: bytes) -> None:
        if self.torn and path.endswith(self.torn):
            data = data[:-3] + b"xyz"  # the last member's checksum no longer matches
        super().write_atomic(path, data)


def _state(rank: int, world: int) -> dict[str, Any]:
    w = torch.arange(40 * 8, dtype=torch.float32).reshape(40, 8)
    lo, hi = 40 * rank // world, 40 * (rank + 1) // world
    return {"w": tessera.ShardedTensor(w[lo:hi].clone(), (40, 8), (lo, 0)), "step": 7}


def _save(rank: int, world: int, path: str, torn: str) -> list[str]:
    os.environ["TESSERA_REPORT_GROUP"] = "2"  # groups {0, 1}, {2, 3}, {4}
    store = CountingStorage(path, torn if rank == 2 else "")
    tessera.save(path, _state(rank, world), storage=store)
    return [p for p in store.reads if "/reports/" in p]


@pytest.mark.parametrize("torn", ["", "group-2.bin"], ids=["groups", "a-torn-group"])
def test_rank_0_reads_group_files_and_nothing_of_them_stays(tmp_path: Path, torn: str) -> None:
    path = str(tmp_path / "ckpt")
    reads = run_distributed(_save, 5, path, torn)
    save_id = tessera.read_manifest(path).save_id
    # Rank 0 read the report of rank 1 (its own group) and the files of the groups of 2 and 4...
    expected = [report_path(save_id, 1), group_path(save_id, 2), group_path(save_id, 4)]
    if torn:  # ...and, where the group of 2 lost rank 3's report, rank 3's own file.
        expected.append(report_path(save_id, 3))
    assert sorted(set(reads[0])) == sorted(expected), reads[0]  # a group file not yet there is read again
    # The leaders read their members' reports; the others nothing.
    assert reads[2] == [report_path(save_id, 3)] and reads[1] == reads[3] == reads[4] == []
    left = os.path.join(path, report_dir(save_id))
    assert not os.path.exists(left) or not os.listdir(left)  # reports and groups removed
    target = {"w": torch.zeros(40, 8), "step": 0}
    tessera.load(path, target)
    assert torch.equal(target["w"], torch.arange(40 * 8, dtype=torch.float32).reshape(40, 8))
    assert target["step"] == 7 and tessera.verify(path).ok


def _reports_on_disk(root: Path, save_id: str, world: int) -> tuple[FileStorage, dict[int, bytes]]:
    """Reports-like files (a line and its xxh3) of ranks 1..world-1, written as ranks do."""
    import xxhash

    store = FileStorage(str(root))
    out = {}
    for r in range(world):
        body = f'{{"rank": {r}}}'.encode()
        out[r] = body + b"\n" + xxhash.xxh3_64_hexdigest(body).encode()
        if r:
            store.write_atomic(report_path(save_id, r), out[r])
    return store, out


def test_a_late_group_is_read_from_its_members_own_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_REPORT_GROUP", "3")  # groups {0, 1, 2}, {3, 4, 5}, {6}
    monkeypatch.setattr(report_groups, "WAIT_S", 0.3)
    store, reports = _reports_on_disk(tmp_path, "s1", 7)
    store.write_atomic(group_path("s1", 3), encode_group("s1", 3, {r: reports[r] for r in members(3, 3, 7)}))
    read: list[int] = []

    def read_one(rank: int) -> bytes:
        read.append(rank)
        return store.read_file(report_path("s1", rank))

    save = SimpleNamespace(store=store, save_id="s1", path=str(tmp_path))
    got = report_groups.read_all(save, 7, read_one, 4)  # type: ignore[arg-type]
    assert got == {r: reports[r] for r in range(1, 7)}
    assert sorted(read) == [1, 2, 6]  # its own group, and the group of 6 that never came


def test_a_group_file_is_checked_like_the_reports_it_holds() -> None:
    reports = {4: b"a\n" + b"0" * 16, 5: b"b\n" + b"1" * 16}
    data = encode_group("s1", 4, reports)
    kw: dict[str, Any] = {"source": "g", "save_id": "s1", "leader": 4, "expected": range(4, 6)}
    assert decode_group(data, **kw) == {}  # neither checksum matches: read their own files
    with pytest.raises(ManifestError, match="the group of rank 4 in save 's1'"):
        decode_group(data, **{**kw, "save_id": "s2"})
    with pytest.raises(ManifestError, match=r"it lists ranks \[4, 5\], expected \[4, 5, 6\]"):
        decode_group(data, **{**kw, "expected": range(4, 7)})
    with pytest.raises(ManifestError, match="do not add up"):
        decode_group(data[:-1], **kw)
    with pytest.raises(ManifestError, match="not a tessera report group"):
        decode_group(b"garbage", **kw)
