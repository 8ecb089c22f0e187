"""Integrity: damaged data and manifests that disagree with the data are caught by load and verify.

A two-rank checkpoint is saved once (real gloo ranks); each test damages a copy of it and
checks that ``tessera.load`` fails with an error naming the tensor, the file and the rank,
and that ``tessera.verify`` reports the problem with the tensor, the file and the rank that
wrote the file.
"""

from __future__ import annotations

import json
import os
import shutil
import tracemalloc
from pathlib import Path

import pytest
import torch

import tessera
from tessera.format.manifest import MANIFEST_NAME
from tessera.storage import FileStorage
from tessera.tools.verification import Problem, ProblemKind, VerifyReport, verify
from tests.crash_worker import run_ranks

CHUNK = 4096
SHAPE = (64, 64)  # float32: each rank's half is 8 KiB, two checksum chunks


def _truth() -> torch.Tensor:
    return torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).reshape(SHAPE) * 0.25


def _emb() -> torch.Tensor:
    return torch.arange(40, dtype=torch.int64) * 3


def _save_two_ranks(rank: int, world: int, path: str) -> None:
    rows = SHAPE[0] // world
    local = _truth()[rank * rows : (rank + 1) * rows].clone()
    state = {"w": tessera.ShardedTensor(local, SHAPE, (rank * rows, 0)), "emb": _emb(), "step": 5}
    tessera.save(path, state, options=tessera.SaveOptions(chunk_bytes=CHUNK))


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("golden") / "ckpt")
    out = run_ranks(_save_two_ranks, 2, path, timeout=180)
    assert [o.status for o in out] == ["ok", "ok"], [o.value for o in out]
    return path


@pytest.fixture
def ckpt(golden: str, tmp_path) -> str:
    path = str(tmp_path / "ckpt")
    shutil.copytree(golden, path)
    return path


def _target() -> dict:
    return {"w": torch.zeros(SHAPE), "emb": torch.zeros(40, dtype=torch.int64), "step": 0}


def _rank1_file(path: str) -> tuple[str, int, int]:
    """Rank 1's data file (relative path), and the byte offset and size of its 'w' tile."""
    m = tessera.read_manifest(path)
    (f,) = [f.path for f in m.files if f.rank == 1]
    (tile,) = [t for t in m.tensors["w"].tiles if t.file == f]
    return f, tile.byte_offset, tile.nbytes


def _edit_manifest(path: str, edit) -> None:
    mp = os.path.join(path, MANIFEST_NAME)
    doc = json.loads(Path(mp).read_bytes())
    edit(doc)
    with open(mp, "w") as fh:
        json.dump(doc, fh)


def _w_tile_of_rank1(doc: dict) -> list:
    index = next(i for i, f in enumerate(doc["files"]) if f["rank"] == 1)
    return next(t for t in doc["tensors"]["w"]["tiles"] if t[0] == index)


def _only(report: VerifyReport, kind: ProblemKind) -> list[Problem]:
    return [p for p in report.problems if p.kind == kind]


def _assert_names_all(problem: Problem, tensor: str, file: str, rank: int) -> None:
    assert (problem.tensor, problem.file, problem.rank) == (tensor, file, rank), problem
    assert f"'{tensor}'" in problem.message and file in problem.message and f"rank {rank}" in problem.message


def _load_error(path: str) -> tessera.CheckpointError:
    target = _target()
    with pytest.raises(tessera.CorruptCheckpointError) as info:
        tessera.load(path, target)
    return info.value


def _flip(path: str, offset: int, mask: int = 0x04) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


# --------------------------------------------------------------------------------------


def test_intact_checkpoint_verifies_and_loads(ckpt: str) -> None:
    report = verify(ckpt)
    assert report.ok, report.summary()
    m = tessera.read_manifest(ckpt)
    assert report.bytes_checked == m.total_bytes and report.files == 2 and report.tensors == 2
    assert report.tiles == 3 and report.unreferenced_files == () and report.pickled_values == ()
    report.raise_if_failed()
    target = _target()
    tessera.load(ckpt, target)
    assert torch.equal(target["w"], _truth()) and torch.equal(target["emb"], _emb()) and target["step"] == 5


@pytest.mark.parametrize("where", ["first_byte", "second_chunk", "last_byte"])
def test_flipped_bit_in_tile_data(ckpt: str, where: str) -> None:
    rel, start, nbytes = _rank1_file(ckpt)
    offset = {"first_byte": start, "second_chunk": start + CHUNK + 17, "last_byte": start + nbytes - 1}[where]
    _flip(os.path.join(ckpt, rel), offset)
    err = str(_load_error(ckpt))
    assert "checksum mismatch" in err and "'w'" in err and rel in err and "rank 0" in err  # the loading rank
    (p,) = report_problems = verify(ckpt).problems
    assert p.kind == ProblemKind.CHECKSUM and "1 of 2 chunk(s)" in p.message, report_problems
    _assert_names_all(p, "w", rel, 1)


def test_flipped_bit_in_safetensors_header(ckpt: str) -> None:
    rel, _, _ = _rank1_file(ckpt)
    _flip(os.path.join(ckpt, rel), 8, mask=0x20)  # the JSON header's first byte: '{' -> '['
    report = verify(ckpt)
    (p,) = report.problems
    assert p.kind == ProblemKind.HEADER and p.file == rel and p.rank == 1 and "not a valid safetensors" in p.message
    # Loads never read headers: the tiles themselves are intact and verified.
    target = _target()
    tessera.load(ckpt, target)
    assert torch.equal(target["w"], _truth())


def _rewrite_header(path: str, edit) -> None:
    """Apply ``edit`` to a data file's safetensors header, keeping its length (and every data offset)."""
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        header["__metadata__"] = {"format": "pt"}  # room for a longer shape
        edit(header)
        body = json.dumps(header, separators=(",", ":")).encode()
        assert len(body) <= n
        f.seek(8)
        f.write(body + b" " * (n - len(body)))


@pytest.mark.parametrize(
    ("tensor", "field", "lie"),
    [("w", "dtype", "I32"), ("w", "shape", [64, 32]), ("emb", "shape", [8, 5]), ("emb", "dtype", "F64")],
)
def test_verify_reports_a_header_that_lies_about_dtype_or_shape(
    ckpt: str, capsys, tensor: str, field: str, lie
) -> None:
    from safetensors import safe_open

    from tessera.cli import main

    m = tessera.read_manifest(ckpt)
    tile = m.tensors[tensor].tiles[-1]
    rank = next(f.rank for f in m.files if f.path == tile.file)
    key = f"{tensor}[" + ",".join(f"{o}:{o + n}" for o, n in zip(tile.offsets, tile.lengths)) + "]"
    full = os.path.join(ckpt, tile.file)
    before = safe_open(full, "pt").get_tensor(key)
    _rewrite_header(full, lambda h: h[key].__setitem__(field, lie))
    # The bytes did not move, but every other safetensors reader now gets wrong values.
    after = safe_open(full, "pt").get_tensor(key)
    assert after.dtype != before.dtype or after.shape != before.shape
    report = verify(ckpt)
    (p,) = report.problems
    assert p.kind == ProblemKind.HEADER and not report.ok
    _assert_names_all(p, tensor, tile.file, rank)
    assert f"{field} {lie!r}" in p.message and key in p.message, p.message
    assert main(["verify", ckpt]) == 1
    out = "".join(capsys.readouterr().out.split())  # the console wraps long lines
    assert "FAILED" in out and f"tensor'{tensor}'" in out and "othersafetensorsreaderswouldreadwrongvalues" in out
    # Loads place tiles by the manifest and check their checksums, never the header: still exact.
    target = _target()
    tessera.load(ckpt, target)
    assert torch.equal(target["w"], _truth()) and torch.equal(target["emb"], _emb())


def test_truncated_file(ckpt: str) -> None:
    rel, _, _ = _rank1_file(ckpt)
    full = os.path.join(ckpt, rel)
    os.truncate(full, os.path.getsize(full) - 100)
    err = str(_load_error(ckpt))
    assert "truncated" in err and rel in err and "'w'" in err and "rank" in err
    report = verify(ckpt)
    sizes = _only(report, ProblemKind.FILE_SIZE)
    assert sizes and all(p.file == rel and p.rank == 1 for p in sizes)
    assert any("truncated" in p.message and p.tensor == "w" for p in sizes)
    assert not _only(report, ProblemKind.CHECKSUM)


def test_missing_data_file(ckpt: str) -> None:
    rel, _, _ = _rank1_file(ckpt)
    os.remove(os.path.join(ckpt, rel))
    err = str(_load_error(ckpt))
    assert "missing" in err and rel in err and "'w'" in err and "rank" in err
    (p,) = verify(ckpt).problems
    assert p.kind == ProblemKind.MISSING_FILE
    _assert_names_all(p, "w", rel, 1)


def test_manifest_byte_offset_that_does_not_match_the_data(ckpt: str) -> None:
    rel, _, _ = _rank1_file(ckpt)
    _edit_manifest(ckpt, lambda doc: _w_tile_of_rank1(doc).__setitem__(3, _w_tile_of_rank1(doc)[3] - 64))
    err = str(_load_error(ckpt))
    assert "checksum mismatch" in err and "'w'" in err and rel in err
    report = verify(ckpt)
    (chk,) = _only(report, ProblemKind.CHECKSUM)
    _assert_names_all(chk, "w", rel, 1)
    (hdr,) = _only(report, ProblemKind.HEADER)
    _assert_names_all(hdr, "w", rel, 1)
    assert "the manifest does not match the data" in hdr.message


def test_manifest_checksum_that_does_not_match_the_data(ckpt: str) -> None:
    rel, _, _ = _rank1_file(ckpt)

    def edit(doc: dict) -> None:
        sums = _w_tile_of_rank1(doc)[4]
        sums[1] = f"{int(sums[1], 16) ^ 1:016x}"

    _edit_manifest(ckpt, edit)
    err = str(_load_error(ckpt))
    assert "checksum mismatch" in err and "'w'" in err and rel in err
    (p,) = verify(ckpt).problems
    assert p.kind == ProblemKind.CHECKSUM
    _assert_names_all(p, "w", rel, 1)


def test_manifest_file_size_that_does_not_match_the_file(ckpt: str) -> None:
    rel, _, _ = _rank1_file(ckpt)

    def edit(doc: dict) -> None:
        next(f for f in doc["files"] if f["rank"] == 1)["bytes"] += 8

    _edit_manifest(ckpt, edit)
    (p,) = verify(ckpt).problems
    assert p.kind == ProblemKind.FILE_SIZE and "truncated" in p.message and p.rank == 1 and p.file == rel


def test_manifest_missing_a_tile_leaves_a_gap(ckpt: str) -> None:
    _edit_manifest(ckpt, lambda doc: doc["tensors"]["w"]["tiles"].remove(_w_tile_of_rank1(doc)))
    err = str(_load_error(ckpt))
    assert "'w'" in err and "cover" in err
    (p,) = verify(ckpt).problems
    assert p.kind == ProblemKind.COVERAGE and p.tensor == "w" and "2048 of 4096" in p.message


def test_manifest_tiles_that_overlap_and_leave_a_gap_are_refused_by_load(ckpt: str) -> None:
    # Rank 1's half claims rows [16, 48): the volume matches, rows [48, 64) are covered by nobody.
    _edit_manifest(ckpt, lambda doc: _w_tile_of_rank1(doc).__setitem__(1, [16, 0]))
    target = _target()
    try:
        tessera.load(ckpt, target)
    except tessera.CorruptCheckpointError:
        return
    wrong = (target["w"] != _truth()).any(dim=1).nonzero().flatten().tolist()
    raise AssertionError(f"load accepted overlapping tiles and returned wrong rows {wrong[0]}..{wrong[-1]} of 'w'")


@pytest.mark.parametrize(("offsets", "what"), [([16, 0], "overlap"), ([0, 0], "cover 2048 of 4096")])
def test_verify_reports_tiles_moved_in_the_manifest(ckpt: str, offsets: list[int], what: str) -> None:
    rel, _, _ = _rank1_file(ckpt)
    _edit_manifest(ckpt, lambda doc: _w_tile_of_rank1(doc).__setitem__(1, offsets))
    report = verify(ckpt)
    (cov,) = _only(report, ProblemKind.COVERAGE)
    assert cov.tensor == "w" and what in cov.message and rel in cov.message
    (hdr,) = _only(report, ProblemKind.HEADER)  # the file's header still names the true box
    _assert_names_all(hdr, "w", rel, 1)


def test_manifest_tile_beyond_its_file_is_refused(ckpt: str) -> None:
    rel, _, _ = _rank1_file(ckpt)
    _edit_manifest(ckpt, lambda doc: _w_tile_of_rank1(doc).__setitem__(3, 10**9))
    with pytest.raises(tessera.errors.ManifestError, match=rf"'w'.*{rel}"):
        tessera.load(ckpt, _target())
    (p,) = verify(ckpt).problems
    assert p.kind == ProblemKind.MANIFEST and "'w'" in p.message and rel in p.message


def _shift_tile_by_one_byte(path: str) -> None:
    """Re-lay the file so the 'w' tile starts one byte later: checksums still match, alignment is gone."""
    m = tessera.read_manifest(path)
    doc = json.loads(Path(path, MANIFEST_NAME).read_bytes())
    (f,) = [f for f in m.files if f.rank == 1]
    full = os.path.join(path, f.path)
    raw = Path(full).read_bytes()
    tile = _w_tile_of_rank1(doc)
    start = tile[3]
    others = [t for e in doc["tensors"].values() for t in e["tiles"] if t[0] == tile[0] and t[3] > start]
    Path(full).write_bytes(raw[:start] + b"\0" + raw[start:])
    for t in [tile, *others]:
        t[3] += 1
    next(x for x in doc["files"] if x["rank"] == 1)["bytes"] += 1
    with open(os.path.join(path, MANIFEST_NAME), "w") as fh:
        json.dump(doc, fh)


class _UnmappedStorage(FileStorage):
    """A local backend without ``map_range``: reads go through buffers, as on object stores."""

    map_range = None


@pytest.mark.parametrize(
    "unmapped",
    [
        False,
        True,
    ],
    ids=["mapped", "buffered"],
)
def test_misaligned_tile_is_refused_or_read_exactly(ckpt: str, unmapped: bool) -> None:
    _shift_tile_by_one_byte(ckpt)
    part = torch.zeros(16, 64)  # rows 40-56 of rank 1's tile: a partial read
    store = _UnmappedStorage(ckpt) if unmapped else None
    try:
        tessera.load(ckpt, {"w": tessera.ShardedTensor(part, SHAPE, (40, 0))}, strict=False, storage=store)
    except tessera.CorruptCheckpointError:
        return
    assert torch.equal(part, _truth()[40:56]), "a misaligned tile was loaded as garbage"


def test_unreferenced_files_are_reported_but_not_problems(ckpt: str) -> None:
    leftover = os.path.join(ckpt, "data", "0123456789abcdef", "0-0.safetensors")
    os.makedirs(os.path.dirname(leftover))
    Path(leftover).write_bytes(b"partial write of a crashed save")
    report = verify(ckpt)
    assert report.ok and report.unreferenced_files == ("data/0123456789abcdef/0-0.safetensors",)


def test_uncommitted_checkpoint(tmp_path, ckpt: str) -> None:
    os.remove(os.path.join(ckpt, MANIFEST_NAME))
    report = verify(ckpt)
    (p,) = report.problems
    assert not report.ok and p.kind == ProblemKind.MANIFEST and "save never committed" in p.message
    with pytest.raises(tessera.CorruptCheckpointError, match="save never committed"):
        report.raise_if_failed()


def test_many_problems_are_all_reported(ckpt: str) -> None:
    m = tessera.read_manifest(ckpt)
    for f in m.files:
        tile = next(t for e in m.tensors.values() for t in e.tiles if t.file == f.path)
        _flip(os.path.join(ckpt, f.path), tile.byte_offset)
    report = verify(ckpt)
    checksum = _only(report, ProblemKind.CHECKSUM)
    assert sorted(p.rank for p in checksum) == [0, 1] and not report.ok
    assert "2 problem(s)" in report.summary()


@pytest.mark.parametrize("chunk_bytes", [64 << 10, 64 << 20])
def test_verify_streams_with_bounded_memory(tmp_path, chunk_bytes: int) -> None:
    path = str(tmp_path / "big")
    big = torch.arange(6 << 20, dtype=torch.float32)  # 24 MiB in one tile
    tessera.save(path, {"big": big}, options=tessera.SaveOptions(chunk_bytes=chunk_bytes))
    del big
    tracemalloc.start()
    try:
        report = verify(path, threads=1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.ok and report.bytes_checked == 24 << 20
    assert peak < 10 << 20, f"verify held {peak / 2**20:.1f} MiB for a 24 MiB tile"
    # ...and it still finds a flipped bit at the very end of the tile.
    m = tessera.read_manifest(path)
    (tile,) = m.tensors["big"].tiles
    _flip(os.path.join(path, tile.file), tile.byte_offset + tile.nbytes - 1)
    (p,) = verify(path, threads=1).problems
    assert p.kind == ProblemKind.CHECKSUM and p.tensor == "big" and p.rank == 0
