"""Chunk sizes per tile: a save that may compress cuts small tiles finer (``tessera.format.chunking``).

A chunk is what a load verifies and, compressed, decodes whole; a box cut across a tile of a few
hundred KiB must not decode most of the tile. Checked: the rule itself (scalar and array forms
agree), what the manifest records and in which format version, resharded loads of small tiles
decoding little more than they need, dedup and delta tiles across steps, and hostile values.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import tessera
from tessera.errors import ManifestError
from tessera.format.chunking import MIN_CHUNK_BYTES, TILE_CHUNKS, Chunking
from tessera.manager import CheckpointManager
from tessera.options import SaveOptions
from tessera.shards import ShardedTensor

NO_TIMINGS = tessera.LoadOptions(record_timings=False)


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def _model() -> dict[str, torch.Tensor]:
    """Tensors of 0.25 to 2 MB, one tile each (the small transformer of bench_compress_train)."""
    g = torch.Generator().manual_seed(0)
    return {f"t{rows}": torch.randn(rows, 256, generator=g) * 0.02 for rows in (256, 384, 512, 1024, 2048)}


def test_the_rule_is_one_function_of_the_tile_length() -> None:
    rng = random.Random(0)
    lengths = [0, 1, 4095, 16384, 300_000, 1 << 20, (8 << 20) - 1, 8 << 20, 1 << 33]
    lengths += [rng.randrange(1, 1 << 34) for _ in range(2000)]
    for chunking in (Chunking(256 << 10, TILE_CHUNKS, MIN_CHUNK_BYTES), Chunking(100_000, 7, 4096), Chunking(1 << 22)):
        sizes = chunking.sizes(np.array(lengths, dtype=np.int64))
        assert sizes.tolist() == [chunking.of(n) for n in lengths]
        assert all(
            chunking.min_chunk_bytes <= c <= chunking.chunk_bytes for c in sizes.tolist() if chunking.tile_chunks
        )
        counts = chunking.counts(np.array(lengths, dtype=np.int64)).tolist()
        assert counts == [-(-n // chunking.of(n)) for n in lengths]
    per_tile = Chunking.for_save(256 << 10, True)
    assert per_tile == Chunking.for_save(256 << 10, "auto") == Chunking(256 << 10, 32, 32 << 10)
    assert Chunking.for_save(4 << 20, False) == Chunking(4 << 20)
    # a small tile in 32 to 64 chunks (32 KiB at least), a large one in chunks of chunk_bytes
    assert [per_tile.of(n) for n in (256 << 10, 1 << 20, 2 << 20, 8 << 20, 1 << 30)] == [
        32 << 10,
        32 << 10,
        64 << 10,
        256 << 10,
        256 << 10,
    ]
    assert Chunking.from_json(per_tile.to_json(), 256 << 10) == per_tile
    assert Chunking.from_json({"chunk_bytes": 4096}, 4096) == Chunking(4096)


def test_a_compressed_save_cuts_small_tiles_finer_and_a_resharded_load_decodes_little_more(tmp_path: Path) -> None:
    model = _model()
    tessera.save(str(tmp_path / "c"), model, options=SaveOptions(compress=True))
    doc = _manifest(tmp_path / "c")
    assert doc["version"] == 3
    assert doc["checksum"] == {
        "algorithm": "xxh3_64",
        "chunk_bytes": 256 << 10,
        "tile_chunks": 32,
        "min_chunk_bytes": 32 << 10,
    }
    manifest = tessera.read_manifest(str(tmp_path / "c"))
    for name in model:
        (tile,) = manifest.tensors[name].tiles
        assert len(tile.checksums) == -(-tile.nbytes // manifest.tile_chunking.of(tile.nbytes)) >= 8
    # three ranks each load a third of every tensor's rows (2 -> 3 ranks, as a resharded job)
    decoded = needed = 0
    for r in range(3):
        state = {}
        for name, t in model.items():
            rows = t.shape[0]
            a, b = r * rows // 3, (r + 1) * rows // 3
            state[name] = ShardedTensor(torch.zeros(b - a, 256), tuple(t.shape), (a, 0))
        res = tessera.load(str(tmp_path / "c"), state, options=NO_TIMINGS)
        for name, t in model.items():
            part = state[name].local
            a = state[name].global_offset[0]
            assert torch.equal(part, t[a : a + part.shape[0]])
            needed += part.numel() * 4
        decoded += res.decoded_bytes
    assert needed <= decoded <= 1.1 * needed, decoded / needed
    # uncompressed saves keep one chunk size for every tile, in version 1
    tessera.save(str(tmp_path / "p"), model)
    assert _manifest(tmp_path / "p")["checksum"] == {"algorithm": "xxh3_64", "chunk_bytes": 4 << 20}
    assert _manifest(tmp_path / "p")["version"] == 1


def test_auto_records_the_chunk_rule_in_version_3_even_where_it_wrote_every_file_plain(tmp_path: Path) -> None:
    tessera.save(str(tmp_path / "a"), _model(), options=SaveOptions(compress="auto"))
    doc = _manifest(tmp_path / "a")
    assert doc["version"] == 3 and doc["checksum"]["tile_chunks"] == 32
    out = {k: torch.zeros_like(v) for k, v in _model().items()}
    tessera.load(str(tmp_path / "a"), out)
    assert all(torch.equal(out[k], v) for k, v in _model().items())
    assert tessera.verify(str(tmp_path / "a")).ok


def test_dedup_and_delta_tiles_compare_chunks_of_the_same_size_across_steps(tmp_path: Path) -> None:
    model = _model()

    def stored() -> int:
        return sum(f.stat().st_size for f in (tmp_path / "m").rglob("*") if f.is_file())

    with CheckpointManager(str(tmp_path / "m"), dedup=True, compress=True) as mgr:
        mgr.save(1, model)
        mgr.wait()
        first = stored()
        changed = {k: v.clone() for k, v in model.items()}
        changed["t1024"][10, 3] += 1.0  # one chunk of one tensor changes
        mgr.save(2, changed)
        mgr.wait()
    # the second step references the unchanged tiles (their chunks compare) and stores one changed tile
    assert stored() - first < 0.4 * first
    for step, want in ((1, model), (2, changed)):
        out = {k: torch.zeros_like(v) for k, v in want.items()}
        with CheckpointManager(str(tmp_path / "m")) as mgr:
            mgr.load(out, step=step)
        assert all(torch.equal(out[k], v) for k, v in want.items())


@pytest.mark.parametrize(
    "checksum",
    [
        {"tile_chunks": 0, "min_chunk_bytes": 16384},
        {"tile_chunks": -3, "min_chunk_bytes": 16384},
        {"tile_chunks": 1 << 40, "min_chunk_bytes": 16384},
        {"tile_chunks": 32, "min_chunk_bytes": 0},
        {"tile_chunks": 32, "min_chunk_bytes": (256 << 10) + 1},
        {"tile_chunks": 32},
        {"tile_chunks": "32", "min_chunk_bytes": 16384},
        {"tile_chunks": 16, "min_chunk_bytes": 16384},  # well-formed, but not the rule the tiles were cut by
    ],
)
def test_a_hostile_or_wrong_chunk_rule_is_refused(tmp_path: Path, checksum: dict) -> None:
    tessera.save(str(tmp_path / "c"), _model(), options=SaveOptions(compress=True))
    doc = _manifest(tmp_path / "c")
    doc["checksum"] = {"algorithm": "xxh3_64", "chunk_bytes": 256 << 10, **checksum}
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(doc))
    out = {k: torch.zeros_like(v) for k, v in _model().items()}
    with pytest.raises(ManifestError, match="tile_chunks|min_chunk_bytes|chunk checksums per tile"):
        tessera.load(str(tmp_path / "c"), out)


def test_a_version_1_manifest_with_a_chunk_rule_is_refused(tmp_path: Path) -> None:
    tessera.save(str(tmp_path / "p"), _model())
    doc = _manifest(tmp_path / "p")
    doc["checksum"].update(tile_chunks=32, min_chunk_bytes=16384)
    (tmp_path / "p" / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="only versions 3 and 4"):
        tessera.read_manifest(str(tmp_path / "p"))


@pytest.mark.parametrize("chunk", [1000, 32 << 10, 4 << 20])
def test_plain_writes_hand_on_pieces_of_whole_chunks_with_every_chunks_checksum(chunk: int) -> None:
    """Small chunks are handed to the backend in pieces of about a MiB (one per chunk cost a few
    microseconds each); the checksums stay one per chunk, streamed or staged whole."""
    import xxhash

    from tessera.engine.saving.write import WRITE_PIECE_BYTES, ChunkSums, checksum_pieces

    data = memoryview(np.random.default_rng(0).integers(0, 256, 3 * WRITE_PIECE_BYTES + 12345, dtype=np.uint8))
    want = [xxhash.xxh3_64_intdigest(data[i : i + chunk]) for i in range(0, len(data), chunk)]
    pieces = list(checksum_pieces(data, chunk))
    assert b"".join(bytes(p) for p, _ in pieces) == bytes(data)
    assert [h for _, hs in pieces for h in hs] == want
    assert all(len(p) % chunk == 0 and len(p) >= min(chunk, WRITE_PIECE_BYTES) for p, _ in pieces[:-1])
    sums = ChunkSums(chunk)
    streamed, bound = [], 0
    unit = max(chunk, WRITE_PIECE_BYTES)  # every part but a feed's last is at least this long
    for a, b in [(0, 7), (7, 5 * chunk + 3), (5 * chunk + 3, len(data))]:
        streamed += [bytes(p) for p in sums.feed(data[a:b])]
        bound += (b - a) // unit + 2
    assert b"".join(streamed) == bytes(data) and sums.done() == tuple(want)
    assert len(streamed) <= bound
