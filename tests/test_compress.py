"""Compressed tiles (``SaveOptions(compress=True)``, issue #34): bit-exact round trips of every
dtype, partial decoding, hostile frames, and every path a tile takes (writer threads and
process, a memory budget, async saves, 2 -> 3 ranks, S3, the manager with dedup, verify,
inspect, convert).

Sizes are small (a few hundred KiB at most) with a small ``chunk_bytes``, so that tensors span
several frames and each test stays well under a second or two.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

import tessera
from tessera.engine.loading.plan import ReadTarget
from tessera.errors import CorruptCheckpointError, ManifestError
from tessera.format.codec import file_header
from tessera.format.geometry import Box
from tessera.format.manifest import decode
from tessera.manager import CheckpointManager
from tessera.options import SaveOptions, WriterMode
from tessera.shards import ShardedTensor
from tests.dist_utils import run_distributed
from tests.s3_server import moto_endpoint, s3_bucket, s3_options  # noqa: F401 - fixtures

CHUNK = 16384
NO_TIMINGS = tessera.LoadOptions(record_timings=False)


def _opts(**kw: object) -> SaveOptions:
    return SaveOptions(compress=True, chunk_bytes=CHUNK, **kw)  # type: ignore[arg-type]


def _special_floats(dtype: torch.dtype, n: int, g: torch.Generator) -> torch.Tensor:
    """Trained-like values plus NaNs with payloads, -0.0, infinities and denormals (bit patterns)."""
    t = (torch.randn(n, generator=g) * 0.02).to(dtype)
    bits = {
        torch.float32: torch.int32,
        torch.float64: torch.int64,
        torch.bfloat16: torch.int16,
        torch.float16: torch.int16,
    }
    if dtype in bits:
        raw = t.view(bits[dtype])
        size = torch.finfo(dtype).bits
        nan_payload = {32: 0x7FC01234, 64: 0x7FF8000000ABCDEF, 16: 0x7E55 if dtype is torch.float16 else 0x7FC5}[size]
        neg_zero = {32: -(2**31), 64: -(2**63), 16: -(2**15)}[size]
        raw[:8] = torch.tensor([nan_payload, neg_zero, 1, 3, -1, 0, 7, nan_payload - 1], dtype=raw.dtype)
    return t


def _every_dtype(g: torch.Generator) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for dt in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        out[str(dt).removeprefix("torch.")] = _special_floats(dt, 7000, g).reshape(70, 100)
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
        out[str(dt).removeprefix("torch.")] = torch.randint(0, 256, (9000,), dtype=torch.uint8, generator=g).view(dt)
    out["int64"] = torch.randint(-5, 5, (3000,), dtype=torch.int64, generator=g)
    out["int32"] = torch.arange(9000, dtype=torch.int32).reshape(90, 100)
    out["int8"] = torch.randint(-128, 127, (5000,), dtype=torch.int8, generator=g)
    out["uint8_random"] = torch.randint(0, 256, (40000,), dtype=torch.uint8, generator=g)  # incompressible
    out["bool"] = torch.rand(20000, generator=g) > 0.7
    out["complex64"] = torch.randn(3000, dtype=torch.complex64, generator=g)
    out["complex128"] = torch.randn(1000, dtype=torch.complex128, generator=g)
    out["scalar"] = torch.tensor(-0.0)
    out["odd"] = torch.randn(7, 3, 5, generator=g)  # smaller than a frame header: stored raw
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8) if t.dtype is not torch.bool else t.reshape(-1)


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(_bits(got[k]), _bits(v)), f"{k} differs"


def _load_into_zeros(path: str, state: dict[str, torch.Tensor], **kw: object) -> tessera.LoadResult:
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    result = tessera.load(path, target, options=NO_TIMINGS, **kw)  # type: ignore[arg-type]
    _assert_same(target, state)
    return result


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def _stored(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("data/*/*.safetensors"))


@pytest.mark.parametrize("writer", [WriterMode.THREAD, WriterMode.PROCESS])
def test_every_dtype_round_trips_bit_exact(tmp_path: Path, writer: WriterMode) -> None:
    state = _every_dtype(torch.Generator().manual_seed(0))
    path = tmp_path / "ckpt"
    tessera.save(str(path), state, options=_opts(writer=writer))
    doc = _manifest(path)
    assert doc["version"] == 3
    assert all("frames" in f for f in doc["files"])
    _load_into_zeros(str(path), state)
    logical = sum(v.numel() * v.element_size() for v in state.values())
    assert _stored(path) < logical  # the float and integer tensors shrink
    # the random bytes are stored raw: frames no smaller than their chunks
    m = tessera.read_manifest(str(path))
    rnd = m.tensors["uint8_random"].tiles[0]
    table = next(f.frames for f in m.files if f.path == rnd.file)
    assert table is not None and table.stored_bytes(rnd.byte_offset, rnd.byte_offset + rnd.nbytes) == rnd.nbytes


def test_uncompressed_saves_keep_version_1_and_safetensors_files(tmp_path: Path) -> None:
    state = {"w": torch.randn(100, 100)}
    tessera.save(str(tmp_path / "a"), state, options=SaveOptions(compress=False))
    doc = _manifest(tmp_path / "a")
    assert doc["version"] == 1 and all("frames" not in f for f in doc["files"])


def test_env_knob_turns_compression_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TESSERA_COMPRESS", "1")
    assert SaveOptions().compress is True
    monkeypatch.setenv("TESSERA_COMPRESS", "0")
    assert SaveOptions().compress is False


def test_compressed_saves_default_to_small_chunks_and_an_explicit_size_stays(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("TESSERA_CHUNK_BYTES", raising=False)
    monkeypatch.delenv("TESSERA_COMPRESS", raising=False)
    assert SaveOptions().chunk_bytes == 4 << 20
    assert SaveOptions(compress=True).chunk_bytes == SaveOptions(compress="auto").chunk_bytes == 256 << 10
    assert SaveOptions(compress=True, chunk_bytes=1 << 20).chunk_bytes == 1 << 20
    # the manager's compress= reaches a chunk size left at its default, not one the user chose
    with tessera.CheckpointManager(str(tmp_path / "m"), compress=True) as mgr:
        assert mgr.save_options.chunk_bytes == 256 << 10
    explicit = SaveOptions(chunk_bytes=1 << 20)
    with tessera.CheckpointManager(str(tmp_path / "n"), compress=True, save_options=explicit) as mgr:
        assert mgr.save_options.chunk_bytes == 1 << 20
    monkeypatch.setenv("TESSERA_CHUNK_BYTES", str(64 << 10))
    assert SaveOptions(compress=True).chunk_bytes == SaveOptions().chunk_bytes == 64 << 10
    monkeypatch.delenv("TESSERA_CHUNK_BYTES")
    # by default, a third of a 12 MiB tensor decodes at most two 256 KiB chunks more than it needs
    w = (torch.randn(3072, 1024) * 0.02).to(torch.float32)
    tessera.save(str(tmp_path / "c"), {"w": w}, options=SaveOptions(compress=True))
    assert _manifest(tmp_path / "c")["checksum"]["chunk_bytes"] == 256 << 10
    part = torch.zeros(1024, 1024)
    res = tessera.load(str(tmp_path / "c"), {"w": ShardedTensor(part, (3072, 1024), (1000, 0))}, options=NO_TIMINGS)
    assert torch.equal(part, w[1000:2024])
    assert part.numel() * 4 <= res.decoded_bytes <= part.numel() * 4 + 2 * (256 << 10)
    # loaded whole, the tile is read and decoded in pieces by the reader's threads, each into its place
    whole = torch.zeros_like(w)
    res = tessera.load(str(tmp_path / "c"), {"w": whole}, options=NO_TIMINGS)
    assert torch.equal(whole, w) and res.decoded_bytes == w.numel() * 4


def test_a_partial_load_decodes_only_the_chunks_it_needs(tmp_path: Path) -> None:
    rows, cols = 256, 1024  # 1 MiB of float32: 64 chunks of 16 KiB
    w = (torch.randn(rows, cols) * 0.02).to(torch.float32)
    tessera.save(str(tmp_path / "c"), {"w": w}, options=_opts())
    part = torch.zeros(16, cols)  # rows 100..115: 64 KiB, 4 or 5 chunks
    res = tessera.load(str(tmp_path / "c"), {"w": ShardedTensor(part, (rows, cols), (100, 0))}, options=NO_TIMINGS)
    assert torch.equal(part, w[100:116])
    needed = part.numel() * 4
    assert needed <= res.decoded_bytes <= needed + 2 * CHUNK


def _corrupt_first_frame(path: Path, how: str) -> str:
    """Damage the first compressed frame of the file holding ``w``; returns that file's name."""
    doc = _manifest(path)
    fi = doc["tensors"]["w"]["tiles"][0][0]
    entry = doc["files"][fi]
    m = tessera.read_manifest(str(path))
    table = next(f.frames for f in m.files if f.path == entry["path"])
    assert table is not None
    k = next(i for i in range(len(table.logical)) if table.stored[i] < table.logical[i])
    a, b = table.stored_span(k)
    file = path / entry["path"]
    data = bytearray(file.read_bytes())
    if how == "flip":
        data[(a + b) // 2] ^= 0xFF
    else:  # the frame's header declares 1 GiB of output (blosc2 header bytes 4..8: nbytes)
        data[a + 4 : a + 8] = (1 << 30).to_bytes(4, "little")
    file.write_bytes(bytes(data))
    return entry["path"]


@pytest.mark.parametrize("how", ["flip", "lie"])
def test_a_corrupt_or_lying_frame_fails_the_load_naming_tensor_file_and_rank(tmp_path: Path, how: str) -> None:
    w = torch.randn(64, 512) * 0.02
    tessera.save(str(tmp_path / "c"), {"w": w}, options=_opts())
    name = _corrupt_first_frame(tmp_path / "c", how)
    with pytest.raises(CorruptCheckpointError) as e:
        tessera.load(str(tmp_path / "c"), {"w": torch.zeros_like(w)}, options=NO_TIMINGS)
    text = str(e.value)
    assert "'w'" in text and name in text and "rank 0" in text
    report = tessera.verify(str(tmp_path / "c"))
    assert not report.ok and any(p.tensor == "w" for p in report.problems)


def test_a_manifest_whose_frames_lie_about_the_file_is_refused(tmp_path: Path) -> None:
    tessera.save(str(tmp_path / "c"), {"w": torch.randn(64, 512)}, options=_opts())
    doc = _manifest(tmp_path / "c")
    doc["files"][0]["bytes"] += 1  # the frames no longer end where the file does
    with pytest.raises(ManifestError, match="frames end at byte"):
        decode(json.dumps(doc).encode())
    doc["files"][0]["bytes"] -= 1
    doc["files"][0]["frames"]["codec"] = "lzma"
    with pytest.raises(ManifestError, match="upgrade tessera"):
        decode(json.dumps(doc).encode())
    doc["version"] = 1  # frames in a manifest that claims the uncompressed format
    doc["files"][0]["frames"]["codec"] = "blosc2-zstd"
    with pytest.raises(ManifestError, match="version 1"):
        decode(json.dumps(doc).encode())
    doc["version"] = 4  # the sectioned form: an index, not an inline manifest
    with pytest.raises(ManifestError, match="format version 4: an index whose tiles are in sections"):
        decode(json.dumps(doc).encode())
    doc["version"] = 5
    with pytest.raises(ManifestError, match=r"format version 5 is newer than this tessera reads \(4\); upgrade"):
        decode(json.dumps(doc).encode())


def test_verify_and_inspect_read_compressed_checkpoints(tmp_path: Path) -> None:
    from tessera.tools.describe import inspect_data

    state = {"w": torch.randn(128, 256) * 0.02, "b": (torch.randn(4096) * 0.02).to(torch.bfloat16)}
    tessera.save(str(tmp_path / "c"), state, options=_opts())
    report = tessera.verify(str(tmp_path / "c"))
    assert report.ok, report.problems
    assert report.bytes_checked == sum(v.numel() * v.element_size() for v in state.values())
    data = inspect_data(str(tmp_path / "c"))
    per = {t["name"]: t for t in data["tensors"]}
    assert per["b"]["stored_bytes"] < per["b"]["bytes"] / 1.2  # bf16 weights: about 1.4x
    assert data["stored_bytes"] == sum(t["stored_bytes"] for t in data["tensors"])
    header = (tmp_path / "c" / _manifest(tmp_path / "c")["files"][0]["path"]).read_bytes()[:128]
    assert header == file_header() and len(header) == 128


def test_async_save_under_a_memory_budget_compresses_streamed_tiles(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    state = {"a": torch.randn(300, 200, generator=g) * 0.02, "b": torch.randn(50000, generator=g).to(torch.bfloat16)}
    pending = tessera.async_save(str(tmp_path / "c"), state, options=_opts(max_staging_bytes=20000))
    pending.wait()
    assert _manifest(tmp_path / "c")["version"] == 3
    _load_into_zeros(str(tmp_path / "c"), state)


def test_convert_reads_a_compressed_checkpoint(tmp_path: Path) -> None:
    from tessera.tools.convert import convert_checkpoint

    state = {"w": torch.randn(64, 64), "n": torch.arange(100)}
    tessera.save(str(tmp_path / "c"), state, options=_opts())
    convert_checkpoint(str(tmp_path / "c"), str(tmp_path / "out.pt"), dst_format="torch")
    loaded = torch.load(tmp_path / "out.pt", weights_only=True)
    _assert_same({k: loaded[k] for k in state}, state)


def test_convert_to_tessera_writes_compressed_with_the_knob(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from tessera.tools.convert import convert_checkpoint

    state = {"w": torch.randn(128, 64) * 0.02, "n": torch.arange(100)}
    torch.save(state, tmp_path / "in.pt")
    monkeypatch.setenv("TESSERA_COMPRESS", "1")
    convert_checkpoint(str(tmp_path / "in.pt"), str(tmp_path / "out"))
    assert _manifest(tmp_path / "out")["version"] == 3
    _load_into_zeros(str(tmp_path / "out"), state)
    monkeypatch.setenv("TESSERA_COMPRESS", "0")
    convert_checkpoint(str(tmp_path / "out"), str(tmp_path / "plain"), src_format="tessera", dst_format="torch")
    _assert_same({k: v for k, v in torch.load(tmp_path / "plain", weights_only=True).items() if k in state}, state)


def test_manager_compress_with_dedup_keeps_every_step_loadable(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    frozen = torch.randn(256, 256) * 0.02
    states = {}
    with CheckpointManager(root, dedup=True, compress=True, load_options=NO_TIMINGS) as mgr:
        for step in (1, 2, 3):
            states[step] = {"frozen": frozen, "moving": torch.full((1000,), float(step))}
            mgr.save(step, states[step])
    shutil.rmtree(os.path.join(root, "step-00000001"))  # the step whose files the others reference
    for step in (2, 3):
        _load_into_zeros(os.path.join(root, f"step-{step:08d}"), states[step])
        doc = json.loads(Path(root, f"step-{step:08d}", "manifest.json").read_text())
        assert doc["version"] == 3


# -- Two ranks save, three load --------------------------------------------------------------

ROWS, COLS = 96, 512


def _global() -> torch.Tensor:
    return (torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(3)) * 0.02).to(torch.float32)


def _rows(rank: int, world: int) -> tuple[int, int]:
    per = math.ceil(ROWS / world)
    return rank * per, min(ROWS, (rank + 1) * per)


def _save_rows(rank: int, world: int, path: str) -> None:
    a, b = _rows(rank, world)
    tessera.save(path, {"w": ShardedTensor(_global()[a:b].clone(), (ROWS, COLS), (a, 0))}, options=_opts())


def _load_rows(rank: int, world: int, path: str) -> tuple[int, int]:
    a, b = _rows(rank, world)
    part = torch.zeros(b - a, COLS)
    res = tessera.load(path, {"w": ShardedTensor(part, (ROWS, COLS), (a, 0))}, options=NO_TIMINGS)
    assert torch.equal(part, _global()[a:b])
    return res.decoded_bytes, part.numel() * 4


def test_two_ranks_save_compressed_three_load_decoding_only_their_rows(tmp_path: Path) -> None:
    path = str(tmp_path / "c")
    run_distributed(_save_rows, 2, path)
    results = run_distributed(_load_rows, 3, path)
    for decoded, needed in results:
        # whole chunks around each rank's rows: at most one extra chunk at each end of each tile
        assert needed <= decoded <= needed + 4 * CHUNK


@pytest.mark.s3
def test_compressed_save_and_load_on_s3(moto_endpoint: str, s3_bucket: str) -> None:
    opts = s3_options(moto_endpoint)
    url = f"s3://{s3_bucket}/{uuid.uuid4().hex}/ckpt"
    state = _every_dtype(torch.Generator().manual_seed(4))
    tessera.save(url, state, options=_opts(), storage_options=opts)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    tessera.load(url, target, options=NO_TIMINGS, storage_options=opts)
    _assert_same(target, state)
    assert tessera.read_manifest(url, storage_options=opts).version == 3
    assert tessera.verify(url, storage=tessera.storage.storage_for(url, storage_options=opts)).ok


@pytest.mark.s3
def test_a_sectioned_compressed_checkpoint_on_s3(
    moto_endpoint: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TESSERA_SECTIONED_MANIFEST_TILES", "0")
    opts = s3_options(moto_endpoint)
    url = f"s3://{s3_bucket}/{uuid.uuid4().hex}/ckpt"
    state = _every_dtype(torch.Generator().manual_seed(8))
    tessera.save(url, state, options=_opts(), storage_options=opts)
    assert tessera.read_manifest(url, storage_options=opts).version == 4
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    tessera.load(url, target, options=NO_TIMINGS, storage_options=opts)
    _assert_same(target, state)
    assert tessera.verify(url, storage=tessera.storage.storage_for(url, storage_options=opts)).ok


def test_frames_bound_declared_sizes_before_decoding() -> None:
    from tessera.format.codec import FrameError, decode_chunk, encode_chunk

    data = np.arange(4096, dtype=np.float32).tobytes()
    frame = encode_chunk(data, 4)
    assert frame is not None and len(frame) < len(data)
    out = bytearray(len(data))
    decode_chunk(frame, memoryview(out))
    assert bytes(out) == data
    with pytest.raises(FrameError, match="declares"):
        decode_chunk(frame, memoryview(bytearray(len(data) - 4)))
    with pytest.raises(FrameError):
        decode_chunk(frame[:-5], memoryview(out))
    assert encode_chunk(os.urandom(8192), 1) is None  # incompressible: stored raw


def test_the_local_tier_keeps_compressed_steps(tmp_path: Path) -> None:
    state = {"w": torch.randn(256, 256) * 0.02, "b": (torch.randn(5000) * 0.02).to(torch.bfloat16)}
    local = str(tmp_path / "local" / "t-{node}")
    with CheckpointManager(
        str(tmp_path / "root"),
        local_dir=local,
        local_replicas=0,
        durable_every=2,
        compress=True,
        load_options=NO_TIMINGS,
    ) as mgr:
        mgr.save(1, state)  # local only
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        assert mgr.load(target).step == 1
        _assert_same(target, state)
    node_manifest = tmp_path / "local" / "t-0" / "step-00000001" / "manifest.json"
    assert json.loads(node_manifest.read_text())["version"] == 3


def test_a_compressed_manifest_past_the_sections_threshold_is_sectioned_as_version_4(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TESSERA_SECTIONED_MANIFEST_TILES", "0")  # every save large enough for sections
    state = _every_dtype(torch.Generator().manual_seed(6))
    tessera.save(str(tmp_path / "c"), state, options=_opts())
    doc = _manifest(tmp_path / "c")
    assert doc["version"] == 4 and "files" not in doc  # an index: the frame tables are in the sections
    _load_into_zeros(str(tmp_path / "c"), state)
    m = tessera.read_manifest(str(tmp_path / "c"))
    assert m.version == 4 and all(f.frames is not None for f in m.files)
    assert tessera.verify(str(tmp_path / "c")).ok
    tessera.save(str(tmp_path / "p"), state, options=SaveOptions(compress=False))
    assert _manifest(tmp_path / "p")["version"] == 2


def test_frame_columns_of_a_hostile_file_size_are_bounded_by_the_document(tmp_path: Path) -> None:
    """A file that declares a huge size cannot make its frame columns a decompression bomb: the
    frame tables of one document inflate to at most 256 times its size plus 16 MiB, all together."""
    import base64
    import zlib

    from tessera.format.codec import FRAME_COLUMN_RATIO, FRAME_COLUMN_SLACK

    tessera.save(str(tmp_path / "c"), {"w": torch.randn(64, 512)}, options=_opts())
    doc = _manifest(tmp_path / "c")
    z = zlib.compressobj(9)
    bomb = b"".join(z.compress(bytes(1 << 20)) for _ in range(256)) + z.flush()  # 256 MiB of zeros in ~250 KB
    doc["files"][0]["bytes"] = 1 << 60
    doc["files"][0]["frames"]["logical"] = base64.b64encode(bomb).decode()
    data = json.dumps(doc).encode()
    assert FRAME_COLUMN_RATIO * len(data) + FRAME_COLUMN_SLACK < 256 << 20
    with pytest.raises(ManifestError, match="frame tables inflate past 256x the document's size"):
        decode(data)


def _sections_run(rank: int, world: int, path: str, save: bool) -> tuple[int, int]:
    os.environ["TESSERA_SECTIONED_MANIFEST_TILES"] = "0"
    if save:
        _save_rows(rank, world, path)
        return 0, 0
    from tessera.engine.loading.manifest import open_manifest

    _, part = open_manifest(tessera.storage.storage_for(path), path, rank)
    assert part is not None
    a, b = _rows(rank, world)
    part.narrow([ReadTarget("w", Box((a, 0), (b - a, COLS)), torch.zeros(b - a, COLS))])
    decoded, needed = _load_rows(rank, world, path)
    assert needed <= decoded <= needed + 4 * CHUNK
    return part.sections_read, part.index.section_count


def test_a_sectioned_compressed_load_reads_only_the_sections_it_needs(tmp_path: Path) -> None:
    path = str(tmp_path / "c")
    run_distributed(_sections_run, 4, path, True)
    assert tessera.read_manifest(path).version == 4
    # 2 loading ranks of 4 saving ones: each rank's rows are two saving ranks' rows.
    assert run_distributed(_sections_run, 2, path, False) == [(2, 4), (2, 4)]


def test_a_version_2_index_whose_section_lists_frames_is_refused(tmp_path: Path) -> None:
    """A frame table in a section of a version 2 index (which older readers would read as plain
    bytes) is refused, naming the section; as is a lying frame table in a version 4 one."""
    import xxhash

    monkey = pytest.MonkeyPatch()
    monkey.setenv("TESSERA_SECTIONED_MANIFEST_TILES", "0")
    try:
        tessera.save(str(tmp_path / "c"), {"w": _global()}, options=_opts())
    finally:
        monkey.undo()
    doc = _manifest(tmp_path / "c")
    sections = tmp_path / "c" / doc["sections"]["path"]
    original = sections.read_bytes()
    # (a version 2 index cuts every tile in chunk_bytes chunks: the per-tile rule goes too)
    uniform = {"algorithm": "xxh3_64", "chunk_bytes": doc["checksum"]["chunk_bytes"]}
    (tmp_path / "c" / "manifest.json").write_text(json.dumps({**doc, "version": 2, "checksum": uniform}))
    with pytest.raises(ManifestError, match=r"section 0 .*\[path, rank, bytes\] \(version 2\)"):
        tessera.load(str(tmp_path / "c"), {"w": torch.zeros(ROWS, COLS)})
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(doc))
    lying = original.replace(b'"start":128', b'"start":129', 1)
    assert lying != original
    sections.write_bytes(lying)
    digest = np.frombuffer(np.array([xxhash.xxh3_64_intdigest(lying)], dtype="<u8").tobytes(), dtype=np.uint8)
    table = dict(
        doc["sections"],
        checksums={"dtype": "uint64", "data": __import__("base64").b64encode(digest.tobytes()).decode()},
    )
    (tmp_path / "c" / "manifest.json").write_text(json.dumps({**doc, "sections": table}))
    with pytest.raises(ManifestError, match=r"section 0 .*files\[0\].*frames"):
        tessera.load(str(tmp_path / "c"), {"w": torch.zeros(ROWS, COLS)})


def test_diff_compares_a_compressed_checkpoint_with_an_uncompressed_one(tmp_path: Path) -> None:
    from tessera.convert.compare import diff_checkpoints

    state = {"w": torch.randn(128, 64) * 0.02, "h": (torch.randn(3000) * 0.02).to(torch.bfloat16)}
    tessera.save(str(tmp_path / "c"), state, options=_opts())
    tessera.save(str(tmp_path / "p"), state, options=SaveOptions(compress=False))
    same = diff_checkpoints(str(tmp_path / "c"), str(tmp_path / "p"))
    assert not same.tensors and same.same_tensors == 2
    state["w"][5, 5] += 1
    tessera.save(str(tmp_path / "p"), state, options=SaveOptions(compress=False))
    assert [d.name for d in diff_checkpoints(str(tmp_path / "c"), str(tmp_path / "p")).tensors] == ["w"]


# -- Delta tiles (dedup=True and compress=True) ----------------------------------------------------


def _training_like(steps: int, g: torch.Generator) -> dict[int, dict[str, torch.Tensor]]:
    """States of a slowly moving model: every step changes every weight a little."""
    w = torch.randn(128, 256, generator=g) * 0.02
    m = torch.rand(8192, generator=g) * 1e-6
    out = {}
    for s in range(1, steps + 1):
        w = w + torch.randn(w.shape, generator=g) * 1e-5
        m = m * 0.999 + torch.rand(m.shape, generator=g) * 1e-9
        out[s] = {"w": w.clone(), "exp_avg_sq": m.clone(), "bf": w.to(torch.bfloat16)[:64], "frozen": torch.ones(64)}
    return out


def _delta_files(root: str, step: int) -> tuple[int, int]:
    """(files the step's manifest lists, of which with delta frames)."""
    doc = json.loads(Path(root, f"step-{step:08d}", "manifest.json").read_text())
    return len(doc["files"]), sum("delta" in f.get("frames", {}) for f in doc["files"])


def test_delta_tiles_are_smaller_chains_end_and_every_step_loads_after_any_other_is_deleted(tmp_path: Path) -> None:
    states = _training_like(11, torch.Generator().manual_seed(5))
    root = str(tmp_path / "run")
    written = {}
    with CheckpointManager(root, dedup=True, compress=True, save_options=_opts(), load_options=NO_TIMINGS) as mgr:
        for s, st in states.items():
            written[s] = mgr.save(s, st).bytes_written
    assert written[2] < 0.85 * written[1]  # a delta step is smaller than a whole one
    assert _delta_files(root, 2)[1] >= 1
    # chains end: step 9 is 8 hops from step 1, so step 10 stores whole tiles again
    assert _delta_files(root, 9)[1] >= 1 and _delta_files(root, 10)[1] == 0
    assert written[10] > written[9]
    for gone in (1, 5, 9):  # the head of a chain, a middle link, its last link
        copy = tmp_path / f"without-{gone}"
        shutil.copytree(root, copy)
        shutil.rmtree(copy / f"step-{gone:08d}")
        for s, st in states.items():
            if s != gone:
                _load_into_zeros(str(copy / f"step-{s:08d}"), st)
        shutil.rmtree(copy)
    assert tessera.verify(os.path.join(root, "step-00000009")).ok


def test_retention_keeps_the_parents_of_delta_tiles(tmp_path: Path) -> None:
    states = _training_like(7, torch.Generator().manual_seed(6))
    root = str(tmp_path / "run")
    with CheckpointManager(
        root, dedup=True, compress=True, keep_last=2, save_options=_opts(), load_options=NO_TIMINGS
    ) as mgr:
        for s, st in states.items():
            mgr.save(s, st)
        assert mgr.steps() == [6, 7]
    files, deltas = _delta_files(root, 7)
    assert deltas >= 1 and files > 2  # step 7 lists its parents' files: the collection kept them
    for s in (6, 7):
        _load_into_zeros(os.path.join(root, f"step-{s:08d}"), states[s])


def test_every_dtype_round_trips_delta_coded(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(7)
    one = _every_dtype(g)
    two = {}
    for k, v in one.items():  # change a few elements' bits: most of each tile is unchanged
        b = v.clone()
        raw = b.reshape(-1).view(torch.uint8) if b.dtype is not torch.bool else None
        if raw is not None:
            raw[::97] ^= 0x5A
        else:
            b.reshape(-1)[::97] ^= True
        two[k] = b
    root = str(tmp_path / "run")
    with CheckpointManager(root, dedup=True, compress=True, save_options=_opts(), load_options=NO_TIMINGS) as mgr:
        mgr.save(1, one)
        mgr.save(2, two)
    assert _delta_files(root, 2)[1] >= 1
    shutil.rmtree(os.path.join(root, "step-00000001"))
    _load_into_zeros(os.path.join(root, "step-00000002"), two)


def test_a_corrupt_parent_frame_fails_the_child_and_hostile_delta_columns_are_refused(tmp_path: Path) -> None:
    states = _training_like(2, torch.Generator().manual_seed(8))
    root = tmp_path / "run"
    with CheckpointManager(str(root), dedup=True, compress=True, save_options=_opts(), load_options=NO_TIMINGS) as mgr:
        for s, st in states.items():
            mgr.save(s, st)
    doc = _manifest(root / "step-00000002")
    child = next(f for f in doc["files"] if "delta" in f.get("frames", {}))
    parents = child["frames"]["delta"]["parents"]
    hostile = json.loads(json.dumps(doc))
    hostile["files"] = [f for f in doc["files"] if f["path"] not in parents]
    with pytest.raises(ManifestError, match="delta frames need"):
        decode(json.dumps(hostile).encode())
    hostile = json.loads(json.dumps(doc))
    entry = next(f for f in hostile["files"] if f["path"] == child["path"])
    entry["frames"]["delta"]["parents"] = []
    with pytest.raises(ManifestError, match="parent index past the parents"):
        decode(json.dumps(hostile).encode())
    # the parent's bytes damaged: the child's tiles that are differences from them fail to load
    parent = parents[0].removeprefix("@tiles/")
    pfile = root / ".tessera-tiles" / parent
    data = bytearray(pfile.read_bytes())
    for i in range(200, len(data), 997):
        data[i] ^= 0xFF
    pfile.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError):
        _load_into_zeros(str(root / "step-00000002"), states[2])


def _save_delta_steps(rank: int, world: int, root: str) -> None:
    states = _training_like(3, torch.Generator().manual_seed(9))
    with CheckpointManager(root, dedup=True, compress=True, save_options=_opts(), load_options=NO_TIMINGS) as mgr:
        for s, st in states.items():
            a, b = _rows(rank, world)
            w = st["w"]
            mgr.save(
                s,
                {
                    **st,
                    "w": ShardedTensor(
                        w[a * 128 // ROWS : b * 128 // ROWS].clone(), tuple(w.shape), (a * 128 // ROWS, 0)
                    ),
                },
            )


def _load_delta_step(rank: int, world: int, root: str) -> None:
    want = _training_like(3, torch.Generator().manual_seed(9))[3]
    a, b = _rows(rank, world)
    lo, hi = a * 128 // ROWS, b * 128 // ROWS
    part = torch.zeros(hi - lo, 256)
    target = {k: torch.zeros_like(v) for k, v in want.items() if k != "w"}
    tessera.load(
        os.path.join(root, "step-00000003"),
        {**target, "w": ShardedTensor(part, (128, 256), (lo, 0))},
        options=NO_TIMINGS,
    )
    assert torch.equal(part, want["w"][lo:hi])
    _assert_same(target, {k: v for k, v in want.items() if k != "w"})


@pytest.mark.slow  # 3 steps on 2 ranks, then 3 ranks: about 10-30 s on the 2-core machine
def test_delta_tiles_saved_on_two_ranks_load_on_three(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    run_distributed(_save_delta_steps, 2, root)
    assert _delta_files(root, 3)[1] >= 1
    shutil.rmtree(os.path.join(root, "step-00000001"))
    run_distributed(_load_delta_step, 3, root)


@pytest.mark.s3
def test_delta_tiles_on_s3(moto_endpoint: str, s3_bucket: str) -> None:
    opts = s3_options(moto_endpoint)
    root = f"s3://{s3_bucket}/{uuid.uuid4().hex}/run"
    states = _training_like(3, torch.Generator().manual_seed(10))
    with CheckpointManager(
        root, dedup=True, compress=True, storage_options=opts, save_options=_opts(), load_options=NO_TIMINGS
    ) as mgr:
        for s, st in states.items():
            mgr.save(s, st)
    m = tessera.read_manifest(f"{root}/step-00000003", storage_options=opts)
    assert any(f.frames is not None and f.frames.delta is not None for f in m.files)
    target = {k: torch.zeros_like(v) for k, v in states[3].items()}
    tessera.load(f"{root}/step-00000003", target, options=NO_TIMINGS, storage_options=opts)
    _assert_same(target, states[3])


def test_a_copy_of_a_compressed_delta_coded_step_is_self_contained(tmp_path: Path) -> None:
    from tessera.tools.copy import copy_checkpoint

    g = torch.Generator().manual_seed(9)
    state = {"w": torch.randn(256, 256, generator=g) * 0.02, "b": torch.randn(4096, generator=g) * 0.02}
    with CheckpointManager(str(tmp_path / "run"), dedup=True, compress=True, keep_last=3) as mgr:
        mgr.save(1, state)
        state["w"].add_(1e-4)
        mgr.save(2, state)
    src = str(tmp_path / "run" / "step-00000002")
    assert any(f.frames is not None and f.frames.delta is not None for f in tessera.read_manifest(src).files)
    copy_checkpoint(src, str(tmp_path / "copy"))
    shutil.rmtree(tmp_path / "run")  # the copy needs nothing of the root
    _load_into_zeros(str(tmp_path / "copy"), state)
    assert tessera.verify(str(tmp_path / "copy")).ok


def test_chunks_coded_in_groups_come_back_in_order_and_whole() -> None:
    """Coding threads take runs of chunks (``GROUP_BYTES``), and the frames still come out in the
    file's order, one per chunk, a chunk larger than a group in a group of its own."""
    from concurrent.futures import ThreadPoolExecutor

    from tessera.engine.saving import coded_files

    sizes = [100, 300, 50, 700, 10, 10, 10, 2000, 5]
    todo = [(k % 3, k, bytes(n)) for k, n in enumerate(sizes)]
    groups = list(coded_files._groups(iter(todo), 400))
    assert [[len(c) for _, _, c in g] for g in groups] == [[100, 300], [50], [700], [10, 10, 10], [2000], [5]]
    with ThreadPoolExecutor(2) as pool:
        got = list(coded_files._in_order(lambda g: [(i, k, len(c)) for i, k, c in g], iter(todo), pool, 3, 400))
    assert got == [(i, k, len(c)) for i, k, c in todo]
    assert list(coded_files._in_order(lambda g: [len(g)], iter(todo), None, 3, 400)) == [1] * len(todo)


def test_delta_frames_read_in_runs_and_a_parent_out_of_place_or_depth_is_refused(tmp_path: Path) -> None:
    """A range of many delta frames adds its parents with one read per run, bit-exact at any cut
    (runs split by a partial first or last frame); a parent column that points at bytes that are
    not one frame one hop nearer a whole one is refused, not added."""
    import dataclasses

    from tessera.engine.frames import read_logical
    from tessera.format.codec import FrameError
    from tessera.storage import storage_for

    states = _training_like(3, torch.Generator().manual_seed(9))
    root = tmp_path / "run"
    with CheckpointManager(str(root), dedup=True, compress=True, save_options=_opts(), load_options=NO_TIMINGS) as mgr:
        for s, st in states.items():
            mgr.save(s, st)
    manifest = tessera.read_manifest(str(root / "step-00000003"))
    tables = {f.path: f.frames for f in manifest.files}
    child = next(f for f in manifest.files if f.frames is not None and f.frames.delta is not None)
    table = child.frames
    assert table is not None and table.delta is not None and int((table.delta.depth > 0).sum()) >= 4
    tiles = storage_for(str(root / ".tessera-tiles"))

    def locate(ref: str) -> str:
        return ref.removeprefix("@tiles/")

    def read(t: object, lo: int, hi: int) -> bytes:
        out = bytearray(hi - lo)
        read_logical(tiles, child.path, t, lo, memoryview(out), tables={**tables, child.path: t}, locate=locate)  # type: ignore[arg-type]
        return bytes(out)

    lo, hi = table.logical_start, table.logical_end
    whole = read(table, lo, hi)
    for a, b in [(lo + 3, hi - 5), (lo + CHUNK // 2, lo + 3 * CHUNK + 7), (hi - CHUNK - 1, hi)]:
        assert read(table, a, b) == whole[a - lo : b - lo]
    shifted = dataclasses.replace(table.delta, offset=np.where(table.delta.depth > 0, table.delta.offset + 4, 0))
    with pytest.raises(FrameError, match="hops from a whole one"):
        read(dataclasses.replace(table, delta=shifted), lo, hi)
    deeper = dataclasses.replace(table.delta, depth=np.where(table.delta.depth > 0, table.delta.depth + 1, 0))
    with pytest.raises(FrameError, match="hops from a whole one"):
        read(dataclasses.replace(table, delta=deeper), lo, hi)
