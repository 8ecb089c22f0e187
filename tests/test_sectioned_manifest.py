"""The manifest in sections (format version 2): each loading rank reads the index and only its part.

Saves are forced into sections (``TESSERA_SECTIONED_MANIFEST_TILES=0``). Real gloo ranks load
them resharded (N -> M, DTensor, flat shards, replicated, pipeline stages) through a storage
that counts what each rank reads: a rank reads the index and exactly the sections of the
saving ranks whose data files it reads (those whose tiles meet its targets), bit-exact. A
damaged section is an error naming the section and the rank; every other reader (verify,
inspect, diff, rename, convert, the manager's resume and dedup's base) reads the whole manifest.
"""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest
import torch

import tessera
from tessera.cli import EXIT_OK, main
from tessera.errors import ManifestError
from tessera.format.chunking import Chunking
from tessera.format.manifest import (
    MANIFEST_NAME,
    SECTIONS_NAME,
    build_index,
    decode,
    decode_index,
    encode_sectioned,
    manifest_tail,
)
from tessera.storage import FileStorage
from tests.dist_utils import run_distributed, run_ranks
from tests.layouts import expected_local, hold, local_part, truth, zeros_like_held

SECTIONED = {"TESSERA_SECTIONED_MANIFEST_TILES": "0"}
TENSORS = {"w": ((24, 6), torch.float32), "b": ((16, 2), torch.bfloat16), "e": ((12, 5), torch.int64)}
LAYOUTS = ["dt_shard0", "dt_2d", "flat", "sharded_uneven", "replicated"]


class CountingStorage(FileStorage):
    """A checkpoint directory that records every read: path, offset and bytes."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.reads: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()

    def _note(self, path: str, offset: int, n: int) -> None:
        with self._lock:
            self.reads.append((path, offset, n))

    def read_file(self, path: str) -> bytes:
        data = super().read_file(path)
        self._note(path, 0, len(data))
        return data

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        super().read_into(path, offset, out)
        self._note(path, offset, len(out))

    def read_bounded(self, path: str, limit: int) -> bytes | int:
        got = super().read_bounded(path, limit)
        self._note(path, 0, 0 if isinstance(got, int) else len(got))
        return got

    def map_range(self, path: str, offset: int, length: int) -> memoryview:
        self._note(path, offset, length)
        return super().map_range(path, offset, length)


def _state(layout: str, rank: int, world: int, zero: bool) -> dict:
    make = zeros_like_held if zero else hold
    return {"t": {name: make(layout, truth(shape, dt), rank, world) for name, (shape, dt) in TENSORS.items()}}


def _save(rank: int, world: int, root: str) -> None:
    os.environ.update(SECTIONED)
    for layout in LAYOUTS:
        tessera.save(os.path.join(root, layout), _state(layout, rank, world, zero=False))
    stage = (
        {"stage0": {"w": truth((10, 3), torch.float32)}}
        if rank == 0
        else {"stage1": {"w": truth((8, 2), torch.float32, 1)}}
    )
    tessera.save(os.path.join(root, "stages"), stage)


def _bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _what_was_read(store: CountingStorage, path: str) -> tuple[set[int], set[int], int]:
    """(saving ranks of the sections read, saving ranks of the data files read, section bytes read)."""
    index = decode_index(_bytes(os.path.join(path, MANIFEST_NAME)))
    blob = _bytes(os.path.join(path, index.sections_path))
    section_ranks, data_ranks, nbytes = set(), set(), 0
    for p, offset, n in store.reads:
        if p.endswith(SECTIONS_NAME):
            nbytes += n
            for s in range(index.section_count):
                lo, hi = int(index.offset[s]), int(index.offset[s] + index.length[s])
                if offset < hi and lo < offset + n:
                    section_ranks.add(json.loads(blob[lo:hi])["rank"])
        elif p.endswith(".safetensors"):
            data_ranks.add(int(os.path.basename(p).split("-")[0]))
    return section_ranks, data_ranks, nbytes


def _load(rank: int, world: int, root: str, layouts: tuple[str, ...] = tuple(LAYOUTS)) -> list[tuple[str, int, int]]:
    out = []
    for layout in layouts:
        path = os.path.join(root, layout)
        store = CountingStorage(path)
        target = _state(layout, rank, world, zero=True)
        tessera.load(path, target, storage=store)
        for name, (shape, dt) in TENSORS.items():
            want = expected_local(layout, truth(shape, dt), rank, world)
            assert torch.equal(local_part(target["t"][name]), want), f"{layout} rank {rank}: {name} differs"
        sections, data, nbytes = _what_was_read(store, path)
        assert sections == data, f"{layout} rank {rank}: read the sections of ranks {sections}, data of {data}"
        out.append((layout, len(sections), nbytes))
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("sectioned"))
    run_distributed(_save, 4, root)
    return root


@pytest.mark.parametrize("world", [2, 3])
def test_resharded_loads_read_only_their_sections(saved: str, world: int) -> None:
    for layout in [*LAYOUTS, "stages"]:
        assert json.loads(_bytes(os.path.join(saved, layout, MANIFEST_NAME)))["version"] == 2
    results = run_distributed(_load, world, saved)
    for layout in ["dt_shard0", "flat", "sharded_uneven"]:  # sharded over 4 saving ranks, loaded by fewer
        index = decode_index(_bytes(os.path.join(saved, layout, MANIFEST_NAME)))
        full = index.sections_bytes
        read = [n for rank in results for lay, _, n in rank if lay == layout]
        assert max(read) < full, f"{layout}: some rank read every section ({read} of {full} bytes)"


def _save_counting_sections(rank: int, world: int, root: str) -> dict[str, int]:
    """Save two layouts, counting the sections this process encodes and decodes."""
    from tessera.format import rank_report
    from tessera.format.manifest import sections as sections_module

    os.environ.update(SECTIONED)
    calls = {"encoded": 0, "decoded": 0}
    encode_section, parse_section = rank_report.encode_section, rank_report.parse_section

    def counted_encode(*args, **kwargs):
        calls["encoded"] += 1
        return encode_section(*args, **kwargs)

    def counted_parse(*args, **kwargs):
        calls["decoded"] += 1
        return parse_section(*args, **kwargs)

    saved = (rank_report.encode_section, sections_module.encode_section, rank_report.parse_section)
    rank_report.encode_section = sections_module.encode_section = counted_encode
    rank_report.parse_section = counted_parse
    try:
        for layout in ("flat", "dt_2d"):
            tessera.save(os.path.join(root, layout), _state(layout, rank, world, zero=False))
    finally:
        rank_report.encode_section, sections_module.encode_section, rank_report.parse_section = saved
    return calls


def test_each_rank_encodes_its_own_section_and_rank_0_only_joins_them(tmp_path) -> None:
    root = str(tmp_path)
    calls = run_distributed(_save_counting_sections, 4, root)
    # Every rank encoded its own section of each save, once; rank 0 decoded none and encoded no other.
    assert calls == [{"encoded": 2, "decoded": 0}] * 4, calls
    for layout in ("flat", "dt_2d"):
        path = os.path.join(root, layout)
        index = decode_index(_bytes(os.path.join(path, MANIFEST_NAME)))
        assert index.section_rank.tolist() == [0, 1, 2, 3]
        blob = _bytes(os.path.join(path, index.sections_path))
        for s in range(4):
            section = json.loads(blob[int(index.offset[s]) : int(index.offset[s] + index.length[s])])
            assert section["rank"] == s and all(f[1] == s for f in section["files"])
            assert section["timings"]["write"] >= 0  # the rank's own timings travel in its section
        # ...not in the index every loading rank reads; read whole, the manifest has them as version 1.
        assert json.loads(_bytes(os.path.join(path, MANIFEST_NAME)))["timings"]["save"]["ranks"] == {}
        assert sorted(tessera.read_manifest(path).timings["save"]["ranks"]) == ["0", "1", "2", "3"]
    # Loaded N -> M (4 -> 3) bit-exact, each rank reading only the sections it needs.
    results = run_distributed(_load, 3, root, ("flat", "dt_2d"))
    full = decode_index(_bytes(os.path.join(root, "flat", MANIFEST_NAME))).sections_bytes
    read = [n for rank in results for lay, _, n in rank if lay == "flat"]
    assert max(read) < full, f"flat: some rank read every section ({read} of {full} bytes)"
    assert tessera.verify(os.path.join(root, "dt_2d")).ok


def test_a_report_carries_its_section_in_index_order_and_must_agree_with_it() -> None:
    import numpy as np
    import xxhash

    from tessera.format.rank_report import RankReportDoc, ReportTiles, decode_report, encode_report

    def report(names: list[int]) -> bytes:
        tiles = ReportTiles(
            (("data/s/1-0.safetensors", 300),),
            ("b", "a"),
            np.zeros(3, np.int64),
            np.array(names),
            np.array([[8, 0], [4, 0], [0, 0]], dtype=np.int64),
            np.tile(np.array([[4, 3]], dtype=np.int64), (3, 1)),
            np.array([200, 100, 0]),
            np.ones(3, np.int64),
            np.array([9, 8, 7], dtype=np.uint64),
        )
        return encode_report(RankReportDoc(1, "s", tiles, {}, {}, {}))

    data = report([1, 0, 0])
    lean = decode_report(data, source="r", rank=1, save_id="s", details=False)
    assert lean.tiles is None and lean.section is not None and lean.geometry is not None
    # In the section's order: by tensor (in the report's list), then by offsets.
    assert lean.geometry.name.tolist() == [0, 0, 1]
    assert lean.geometry.offsets[:, 0].tolist() == [0, 4, 8]
    full = decode_report(data, source="r", rank=1, save_id="s")
    assert full.tiles is not None and full.tiles.checksums.tolist() == [7, 8, 9]
    assert full.tiles.byte_offset.tolist() == [0, 100, 200]
    # A report whose section lists other tiles than its geometry (an altered, re-signed report).
    other = decode_report(report([0, 0, 0]), source="r", rank=1, save_id="s", details=False)
    assert lean.section in data and len(other.section) == len(lean.section)
    forged = data.rpartition(b"\n")[0].replace(lean.section, other.section)
    forged += b"\n" + xxhash.xxh3_64_hexdigest(forged).encode()
    assert decode_report(forged, source="r", rank=1, save_id="s", details=False).section == other.section
    with pytest.raises(ManifestError, match="r: invalid report of rank 1: its section and its geometry list different"):
        decode_report(forged, source="r", rank=1, save_id="s")


def _load_stage(rank: int, world: int, root: str) -> tuple[int, list[str]]:
    path = os.path.join(root, "stages")
    store = CountingStorage(path)
    state = {"stage0": {"w": torch.zeros(10, 3)}} if rank == 0 else {"stage1": {"w": torch.zeros(8, 2)}}
    tessera.load(path, state, storage=store)
    want = truth((10, 3), torch.float32) if rank == 0 else truth((8, 2), torch.float32, 1)
    assert torch.equal(next(iter(state.values()))["w"], want)
    sections, data, _ = _what_was_read(store, path)
    assert sections == data == {rank}, (sections, data)
    return rank, sorted(sections)


def test_pipeline_stages_read_only_their_own_section(saved: str) -> None:
    assert run_distributed(_load_stage, 2, saved) == [(0, [0]), (1, [1])]


def _load_damaged(rank: int, world: int, path: str) -> None:
    tessera.load(path, _state("dt_shard0", rank, world, zero=True))


def test_a_damaged_section_names_the_section_and_the_rank(saved: str, tmp_path) -> None:
    import shutil

    path = str(tmp_path / "ck")
    shutil.copytree(os.path.join(saved, "dt_shard0"), path)
    index = decode_index(_bytes(os.path.join(path, MANIFEST_NAME)))
    sections = os.path.join(path, index.sections_path)
    blob = bytearray(_bytes(sections))
    s = 3  # the last saving rank's: read by the last loading rank only
    at = int(index.offset[s]) + int(index.length[s]) - 10
    blob[at] = ord("0") if blob[at] != ord("0") else ord("1")
    with open(sections, "wb") as f:
        f.write(bytes(blob))
    outcomes = run_ranks(_load_damaged, 2, path, timeout=120)
    for o in outcomes:
        assert o.status == "error", o
        msg = o.value["message"]
        assert "section 3 of" in msg and "rank 1" in msg and "checksum mismatch" in msg, msg
    with pytest.raises(ManifestError, match="section 3 of .*checksum mismatch"):
        tessera.read_manifest(path)


def test_small_saves_stay_version_1_and_version_2_is_refused_by_the_inline_decoder(tmp_path, monkeypatch) -> None:
    state = {"w": truth((6, 4), torch.float32), "step": 3}
    tessera.save(str(tmp_path / "v1"), state)
    data = _bytes(tmp_path / "v1" / MANIFEST_NAME)
    assert json.loads(data)["version"] == 1
    monkeypatch.setenv("TESSERA_SECTIONED_MANIFEST_TILES", "0")
    tessera.save(str(tmp_path / "v2"), state)
    index = _bytes(tmp_path / "v2" / MANIFEST_NAME)
    assert json.loads(index)["version"] == 2
    with pytest.raises(ManifestError, match="format version 2: an index whose tiles are in sections"):
        decode(index)
    for where in ("v1", "v2"):
        out = {"w": torch.zeros(6, 4), "step": 0}
        tessera.load(str(tmp_path / where), out)
        assert torch.equal(out["w"], state["w"]) and out["step"] == 3
    # One manifest, two forms: the sectioned one read whole is the inline one.
    m1, m2 = tessera.read_manifest(str(tmp_path / "v1")), tessera.read_manifest(str(tmp_path / "v2"))
    assert m2.version == 2 and m2.values == m1.values
    idx, secs = encode_sectioned(m1)
    again = decode_index(idx)
    assert again.assemble({0: again.decode_section(0, secs)}).tensors == m1.tensors


def test_every_reader_reads_a_sectioned_checkpoint(saved: str, tmp_path, monkeypatch, capsys) -> None:
    from tessera.convert import RenameRule, diff_checkpoints, rename_tensors

    path = os.path.join(saved, "dt_2d")
    assert tessera.verify(path).ok
    assert main(["verify", path]) == EXIT_OK
    capsys.readouterr()
    assert main(["inspect", path, "--json"]) == EXIT_OK
    assert "t.w" in json.dumps(json.loads(capsys.readouterr().out))
    report = diff_checkpoints(path, os.path.join(saved, "flat"))
    assert not report.tensors and report.same_tensors == len(TENSORS)
    monkeypatch.setenv("TESSERA_SECTIONED_MANIFEST_TILES", "0")
    pt = str(tmp_path / "m.pt")
    assert main(["convert", path, pt, "--to", "torch"]) == EXIT_OK
    assert torch.equal(torch.load(pt)["t.w"], truth(*TENSORS["w"]))
    import shutil

    copy = str(tmp_path / "renamed")
    shutil.copytree(path, copy)
    rename_tensors(copy, [RenameRule("t.", "net.")])
    out = {"net": {name: torch.zeros(shape, dtype=dt) for name, (shape, dt) in TENSORS.items()}}
    tessera.load(copy, out)
    assert torch.equal(out["net"]["w"], truth(*TENSORS["w"]))


def test_manager_resume_and_dedup_base_read_sectioned_steps(tmp_path, monkeypatch) -> None:
    from tessera.manager import CheckpointManager

    monkeypatch.setenv("TESSERA_SECTIONED_MANIFEST_TILES", "0")
    root = str(tmp_path / "run")
    frozen = truth((32, 8), torch.float32)
    with CheckpointManager(root, dedup=True) as mgr:
        for step in (1, 2):
            mgr.save(step, {"frozen": frozen, "moving": torch.full((4,), float(step))})
    steps = sorted(d for d in os.listdir(root) if d.startswith("step-"))
    for d in steps:
        assert json.loads(_bytes(os.path.join(root, d, MANIFEST_NAME)))["version"] == 2
    second = tessera.read_manifest(os.path.join(root, steps[1]))
    first = tessera.read_manifest(os.path.join(root, steps[0]))
    # Step 2 references the frozen tensor's tiles step 1 stored: its base was read from sections.
    assert {t.file for t in second.tensors["frozen"].tiles} == {t.file for t in first.tensors["frozen"].tiles}
    with CheckpointManager(root, dedup=True) as mgr:
        state = {"frozen": torch.zeros(32, 8), "moving": torch.zeros(4)}
        assert mgr.load(state).step == 2
        assert torch.equal(state["frozen"], frozen) and torch.equal(state["moving"], torch.full((4,), 2.0))
        mgr.save(3, {"frozen": frozen, "moving": torch.full((4,), 3.0)})  # collects with sectioned steps
    assert tessera.verify(os.path.join(root, steps[1])).ok


def _small_manifest(paths: tuple[str, ...] = ("data/s/0-0.safetensors", "data/s/1-0.safetensors")):
    import numpy as np

    from tessera.format.manifest import FileEntry, Manifest, TensorEntry, TileTable

    offs = np.array([[0, 0], [4, 0]], dtype=np.int64)
    lens = np.array([[4, 3], [4, 3]], dtype=np.int64)
    table = TileTable(
        paths,
        np.array([0, 1]),
        offs,
        lens,
        np.array([64, 64]),
        np.array([48, 48]),
        np.array([1, 1]),
        np.array([7, 9], dtype=np.uint64),
    )
    files = (FileEntry(paths[0], 0, 112), FileEntry(paths[1], 1, 112))
    return Manifest("s", 2, 4096, {"w": TensorEntry("float32", (8, 3), table=table)}, files=files)


def _patched(index, s: int, data: bytes):
    """``index`` with section ``s``'s length and checksum those of ``data`` (a forged, consistent index)."""
    import xxhash

    index.length, index.checksums = index.length.copy(), index.checksums.copy()
    index.length[s] = len(data)
    index.checksums[s] = xxhash.xxh3_64_intdigest(data)
    return index


def test_sections_are_hostile_input_like_the_manifest() -> None:
    m = _small_manifest()
    idx, secs = encode_sectioned(m)
    index = decode_index(idx)
    first = secs[: int(index.length[0])]
    # A file reference that leaves the checkpoint.
    bad = first.replace(b'"data/s/0-0.safetensors"', b'"../../etc/0-0.safetensor"')
    with pytest.raises(ManifestError, match="section 0 of"):
        _patched(decode_index(idx), 0, bad).decode_section(0, bad)
    # A section that holds another number of a tensor's tiles than the index says.
    doc = json.loads(first)
    doc["tiles"]["count"] = 0
    for k in ("tensor", "file", "byte_offset", "chunks"):
        doc["tiles"][k] = {"dtype": "int8", "data": ""}
    doc["tiles"]["checksums"] = {"dtype": "uint64", "data": ""}
    empty = json.dumps(doc).encode()
    forged = _patched(decode_index(idx), 0, empty)
    sec0 = forged.decode_section(0, empty)
    sec1 = forged.decode_section(1, secs[int(index.offset[1]) :])
    with pytest.raises(ManifestError, match="section 0 of .* fewer of its tiles"):
        forged.assemble({0: sec0, 1: sec1})
    # An index that declares more tiles than its sections file could describe.
    doc = json.loads(idx)
    doc["tensors"]["w"]["tile_index"]["count"] = 10**6
    with pytest.raises(ManifestError, match="tile_index.count 1000000"):
        decode_index(json.dumps(doc).encode())
    # A section's range outside the sections file.
    doc = json.loads(idx)
    doc["sections"]["bytes"] = 10
    with pytest.raises(ManifestError, match="outside"):
        decode_index(json.dumps(doc).encode())


def _many_tiles_manifest(rows: int = 5000, ranks: int = 8):
    """One (rows, 4) float32 tensor saved as one-row tiles by ``ranks`` ranks (contiguous row ranges)."""
    import numpy as np

    from tessera.format.manifest import FileEntry, Manifest, TensorEntry, TileTable

    per = -(-rows // ranks)
    paths = tuple(f"data/s/{r}-0.safetensors" for r in range(ranks))
    owner = np.arange(rows) // per
    offs = np.stack([np.arange(rows), np.zeros(rows, np.int64)], axis=1)
    lens = np.tile(np.array([[1, 4]], dtype=np.int64), (rows, 1))
    byte_offset = (np.arange(rows) - owner * per) * 16
    sums = np.arange(rows, dtype=np.uint64) * 7919
    table = TileTable(paths, owner, offs, lens, byte_offset, np.full(rows, 16), np.ones(rows, np.int64), sums)
    files = tuple(FileEntry(p, r, per * 16) for r, p in enumerate(paths))
    return Manifest("s", ranks, 4096, {"w": TensorEntry("float32", (rows, 4), table=table)}, files=files)


def test_a_rank_inflates_only_the_geometry_blocks_near_its_boxes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tessera.format.manifest.blocks.BLOCK_TILES", 1024)
    m = _many_tiles_manifest()
    idx, secs = encode_sectioned(m)
    index = decode_index(idx)
    g = index.geometry["w"]
    assert g.block_count == 5 and g.inflated == 0
    rows = {"w": index.rows_for("w", [((2500, 1), (10, 2))])}
    assert rows["w"].tolist() == list(range(2500, 2510))
    assert g.inflated == 1  # of 5 blocks
    numbers = index.sections_of(rows)
    assert numbers == [4]  # rows 2500..2509 were written by rank 4 (625 rows per rank)
    got = (
        index.assemble(
            {
                s: index.decode_section(s, secs[int(index.offset[s]) : int(index.offset[s] + index.length[s])])
                for s in numbers
            },
            rows,
        )
        .tensors["w"]
        .table
    )
    want = m.tensors["w"].table
    assert got.offsets.tolist() == want.offsets[2500:2510].tolist()
    assert got.checksums.tolist() == want.checksums[2500:2510].tolist()
    assert got.byte_offset.tolist() == want.byte_offset[2500:2510].tolist()
    assert g.inflated == 1
    # The whole manifest, as tools read it, is the manifest saved.
    whole = index.assemble(
        {
            s: index.decode_section(s, secs[int(index.offset[s]) : int(index.offset[s] + index.length[s])])
            for s in range(8)
        }
    )
    assert whole.tensors == m.tensors


def test_geometry_blocks_are_hostile_input(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tessera.format.manifest.blocks.BLOCK_TILES", 1024)
    import base64
    import zlib

    import numpy as np

    from tessera.format.manifest.encoder import _int_column

    m = _many_tiles_manifest()
    idx, secs = encode_sectioned(m)

    def forged(blocks=None, **fields) -> bytes:
        doc = json.loads(idx)
        doc["tensors"]["w"]["tile_index"].update(fields)
        if blocks is not None:
            doc["tile_blocks"] = col(blocks)
        return json.dumps(doc).encode()

    def col(values) -> dict:
        parts: list[bytes] = []
        _int_column(parts, np.asarray(values, dtype=np.int64))
        return json.loads(b"".join(parts))

    index = decode_index(idx)
    g = index.geometry["w"]
    table = np.stack([g.first, g.end, np.diff(g._at), g.lead], axis=1)
    everything = [((0, 0), (5000, 4))]
    # A block whose tiles lie outside the range the index gives it (a reader trusts it to skip blocks).
    lie = table.copy()
    lie[0, 0] = 1
    index = decode_index(forged(lie))
    with pytest.raises(ManifestError, match="tile_index block 0: a tile lies outside the block's range"):
        index.rows_for("w", everything)
    with pytest.raises(ManifestError, match="tile_index block 0: a tile lies outside the block's range \\[1, "):
        decode_index(forged(lie)).rows_for_many({"w": everything})
    # A block that inflates past its rows (bounded: never more than the widest rows + 1 byte).
    bomb = zlib.compress(b"\0" * (1 << 24))
    sizes = table.copy()
    sizes[:, 2] = [len(bomb), 0, 0, 0, 0]
    index = decode_index(forged(sizes, data=base64.b64encode(bomb).decode()))
    with pytest.raises(ManifestError, match="tile_index block 0 holds 40961 bytes, expected 1, 2, 4 or 8 x 5120"):
        index.rows_for("w", everything)
    # Sizes that disagree with the data, a block table of the wrong length, blocks too large.
    sizes[:, 2] = 1
    index = decode_index(forged(sizes))
    with pytest.raises(ManifestError, match="tile_index.data holds"):
        index.rows_for("w", everything)
    with pytest.raises(ManifestError, match="tile_blocks holds"):
        decode_index(forged(table[:4]))
    with pytest.raises(ManifestError, match="tile_index.block 4194304 is over"):
        decode_index(forged(block=1 << 22))
    # A block whose lead (the place of its first rows in their section) is not theirs: rows of
    # block 1 (1,024..) are tiles 399.. of section 1 (625 tiles, rows 625..1,249).
    sections = {
        s: index.decode_section(s, secs[int(index.offset[s]) : int(index.offset[s] + index.length[s])])
        for s in range(8)
    }
    assert table[1, 3] == 399
    far = table.copy()
    far[1, 3] = 699
    forged_index = decode_index(forged(far))
    with pytest.raises(
        ManifestError, match="section 1 of .* fewer of its tiles than the index says \\(not its tile 699\\)"
    ):
        forged_index.assemble(sections, {"w": forged_index.rows_for("w", [((1024, 0), (1, 4))])})
    near = table.copy()
    near[1, 3] = 400  # each row then names the next row's tile: only a whole read can tell
    forged_index = decode_index(forged(near))
    with pytest.raises(
        ManifestError, match="section 1 of .* fewer of its tiles than the index says \\(not its tile 625\\)"
    ):
        forged_index.assemble(sections)
    # Sections that decrease along a tensor's rows (a section's rows would not be one run).
    small = _small_manifest()
    _, small_secs = encode_sectioned(small)
    cut = decode_index(encode_sectioned(small)[0]).length
    two = [small_secs[: int(cut[0])], small_secs[int(cut[0]) :]]
    offs = small.tensors["w"].table.offsets
    lens = small.tensors["w"].table.lengths
    backwards = build_index(
        ("s", 2, Chunking(4096)),
        [("w", "float32", (8, 3))],
        np.zeros(2, np.int64),
        offs,
        lens,
        np.array([1, 0]),
        two,
        np.array([0, 1]),
        np.array([0, 0]),
        [np.array([0])],
        manifest_tail(small),
    )
    with pytest.raises(ManifestError, match="tile_index block 0: the sections of a tensor's rows must never decrease"):
        decode_index(backwards).rows_for("w", [((0, 0), (8, 3))])


@pytest.mark.parametrize("batch", [16384, 600])
@pytest.mark.parametrize("shuffled", [False, True])
def test_many_tensors_rows_are_found_at_once_as_one_by_one(
    shuffled: bool, batch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rows_for_many`` (one pass over every tensor's boxes, bisection inside sorted blocks, met
    blocks searched side by side in batches of ``batch`` rows) finds the rows ``rows_for`` and a
    brute-force scan find, sorted or not, 1-D and 2-D."""
    import dataclasses

    import numpy as np

    from tessera.format.manifest import TensorEntry, TileTable

    monkeypatch.setattr("tessera.format.manifest.blocks.BLOCK_TILES", 256)  # many blocks per tensor
    monkeypatch.setattr("tessera.format.manifest.blocks.BATCH_ROWS", batch)

    m = _many_tiles_manifest(3000, 6)
    t = m.tensors["w"].table
    order = np.random.default_rng(0).permutation(len(t)) if shuffled else np.arange(len(t))
    # A 1-D tensor of variable tiles: each of "w"'s tiles seen as a flat range of its own length.
    lens1 = 1 + np.arange(len(t)) % 3
    offs1 = np.concatenate([[0], np.cumsum(lens1)[:-1]])
    cols = [t.file[order], t.byte_offset[order], t.nbytes[order], t.chunks[order], t.checksums[order]]
    w = TileTable(t.paths, cols[0], t.offsets[order], t.lengths[order], cols[1], cols[2], cols[3], cols[4])
    v = TileTable(t.paths, cols[0], offs1[order, None], lens1[order, None], cols[1], cols[2], cols[3], cols[4])
    tensors = {
        "w": TensorEntry("float32", (3000, 4), table=w),
        "v": TensorEntry("float32", (int(lens1.sum()),), table=v),
    }
    index = decode_index(encode_sectioned(dataclasses.replace(m, tensors=tensors))[0])
    boxes = {
        "w": [((0, 0), (1, 4)), ((1500, 1), (700, 2)), ((2999, 3), (1, 1))],
        "v": [((17,), (40,)), ((5000,), (1,))],
    }
    many = index.rows_for_many(boxes)
    places = {name: index._take(name, rows)[2] for name, rows in many.items()}  # as the pick gave them
    for name, bs in boxes.items():
        table = tensors[name].table
        brute = set()
        for o, ln in bs:
            lo, hi = np.array(o), np.array(o) + np.array(ln)
            brute |= set(
                np.flatnonzero(((table.offsets < hi) & (table.offsets + table.lengths > lo)).all(axis=1)).tolist()
            )
        # The index numbers a tensor's rows by section (then offsets): compare the boxes found.
        assert many[name].tolist() == index.rows_for(name, bs).tolist()
        found = sorted(map(tuple, index._take(name, many[name])[0].tolist()))
        assert found == sorted(map(tuple, table.offsets[sorted(brute)].tolist()))
        # Each row's place (section, k) as reading the tensor's every block gives it.
        g = index.geometry[name]
        rows, _, _, place = g.rows(np.arange(g.block_count))
        assert places[name].tolist() == place[np.searchsorted(rows, many[name])].tolist()


def test_blocks_narrowed_at_once_are_the_bytes_narrowed_one_by_one() -> None:
    """The commit narrows all of a tensor's geometry blocks in one pass per width: each block's
    bytes are what narrowing it alone gives (widths 1, 2, 4 and 8 mixed, a short last block)."""
    from tessera.format.manifest import blocks

    rng = np.random.default_rng(0)
    for n, w in [(1, 5), (5, 3), (513, 5), (2048, 7)]:
        for scale in (3, 200, 40000, 2**40):
            d = rng.integers(-scale, scale, (n, w))
            d[::97] *= 1 << 20  # some blocks wider than the rest
            for b in (1, 7, 512):
                assert blocks._narrowed_blocks(d, b) == [_narrow(d[i : i + b].T) for i in range(0, n, b)]


def _narrow(values: np.ndarray) -> bytes:
    """One block's columns in the narrowest of int8, int16, int32, int64 that holds them."""
    lo, hi = int(values.min()), int(values.max())
    t = next(t for t in ("<i1", "<i2", "<i4", "<i8") if np.iinfo(t).min <= lo and hi <= np.iinfo(t).max)
    return np.ascontiguousarray(values, dtype=t).tobytes()
