"""Manifests at scale: the column encoding of tile tables, lazy decoding, and load planning by search.

The encoder narrows, delta-codes and deflates integer columns and stores checksums raw; the
decoder still reads the first form (base64 of deflated int64) and keeps every hostile-input
bound. ``decode(lazy=True)`` decodes a tensor's table on first use, and ``plan_reads`` finds
the tiles near a box by binary search; both must give exactly what the eager, scanning
versions gave, and report the same problems.
"""

from __future__ import annotations

import base64
import json
import threading
import tracemalloc
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessera.engine.loading.plan import ReadTarget, plan_reads
from tessera.errors import CorruptCheckpointError, ManifestError
from tessera.format.geometry import Box
from tessera.format.manifest import FileEntry, Manifest, TensorEntry, Tile, TileTable, decode, encode
from tessera.format.manifest import tiles as tiles_module

CHUNK = 4096


def _table(
    paths: tuple[str, ...], offs: np.ndarray, lens: np.ndarray, size: int, rng: np.random.Generator
) -> TileTable:
    """A table of the boxes ``offs``/``lens`` laid out one after another in the files, in turn."""
    n = len(offs)
    nbytes = (lens.prod(axis=1) if lens.shape[1] else np.ones(n, dtype=np.int64)) * size
    file = np.arange(n, dtype=np.int64) % len(paths)
    byte_offset = np.zeros(n, dtype=np.int64)
    for f in range(len(paths)):
        mine = file == f
        byte_offset[mine] = 64 + np.cumsum(nbytes[mine]) - nbytes[mine]
    chunks = -(-nbytes // CHUNK)
    sums = rng.integers(0, 1 << 64, int(chunks.sum()), dtype=np.uint64, endpoint=False)
    return TileTable(paths, file, offs, lens, byte_offset, nbytes, chunks, sums)


def _rows(shape: tuple[int, ...], step: int) -> tuple[np.ndarray, np.ndarray]:
    """Row blocks of ``step`` rows (the last one shorter) over the whole tensor."""
    starts = np.arange(0, shape[0], step, dtype=np.int64)
    offs = np.zeros((len(starts), len(shape)), dtype=np.int64)
    offs[:, 0] = starts
    lens = np.tile(np.asarray(shape, dtype=np.int64), (len(starts), 1))
    lens[:, 0] = np.minimum(starts + step, shape[0]) - starts
    return offs, lens


def _grid(shape: tuple[int, int], rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    r, c = np.meshgrid(np.arange(0, shape[0], rows), np.arange(0, shape[1], cols), indexing="ij")
    offs = np.stack([r.ravel(), c.ravel()], axis=1).astype(np.int64)
    lens = np.stack(
        [np.minimum(offs[:, 0] + rows, shape[0]) - offs[:, 0], np.minimum(offs[:, 1] + cols, shape[1]) - offs[:, 1]],
        axis=1,
    )
    return offs, lens


def _big_manifest(seed: int = 0, shuffle: bool = True) -> Manifest:
    """Table-form tensors of several ranks and layouts, tiles in a shuffled order, a few multi-chunk."""
    rng = np.random.default_rng(seed)
    paths = tuple(f"data/s/{r}-0.safetensors" for r in range(5))
    specs = {
        "rows": ((300, 7), *_rows((300, 7), 3), 4),
        "grid": ((64, 48), *_grid((64, 48), 4, 16), 2),
        "vec": ((1000,), *_rows((1000,), 37), 8),
        "cube": ((20, 6, 5), *_rows((20, 6, 5), 1), 4),
        "wide": ((40, 3000), *_rows((40, 3000), 2), 4),  # 24000-byte tiles: 6 checksums each
        # A tall tile beside short ones: in offset order, tile ends along dim 0 go down and up.
        "mixed": (
            (10, 7),
            np.array([[0, 0]] + [[2 * i, 3] for i in range(5)], dtype=np.int64),
            np.array([[10, 3]] + [[2, 4]] * 5, dtype=np.int64),
            4,
        ),
    }
    tensors = {}
    for name, (shape, offs, lens, size) in specs.items():
        if shuffle:
            order = rng.permutation(len(offs))
            offs, lens = offs[order], lens[order]
        dtype = {2: "bfloat16", 4: "float32", 8: "float64"}[size]
        tensors[name] = TensorEntry(dtype, shape, table=_table(paths, offs, lens, size, rng))
    tensors["scalar"] = TensorEntry("int64", (), (Tile(paths[0], (), (), 0, 8, (7,)),))
    tensors["empty"] = TensorEntry("float32", (0, 4), ())
    end = np.zeros(len(paths), dtype=np.int64)
    for e in tensors.values():
        t = e.table
        if len(t):
            np.maximum.at(end, np.asarray([paths.index(t.paths[f]) for f in t.file.tolist()]), t.byte_offset + t.nbytes)
    files = tuple(FileEntry(p, r, int(end[r]) + 64) for r, p in enumerate(paths))
    return Manifest("s", 5, CHUNK, tensors, files=files)


def _columns(t: TileTable) -> tuple:
    return (
        [t.paths[i] for i in t.file.tolist()],
        t.offsets.tolist(),
        t.lengths.tolist(),
        t.byte_offset.tolist(),
        t.nbytes.tolist(),
        t.chunks.tolist(),
        t.checksums.tolist(),
    )


# --------------------------------------------------------------------------------------
# The column encoding


@pytest.mark.parametrize("lazy", [False, True])
def test_table_columns_round_trip_exactly(lazy: bool) -> None:
    m = _big_manifest()
    back = decode(encode(m), lazy=lazy)
    assert back == m
    for name, e in m.tensors.items():
        assert _columns(back.tensors[name].table) == _columns(e.table), name


def test_integer_columns_are_narrow_and_checksums_raw() -> None:
    doc = json.loads(encode(_big_manifest(shuffle=False)))
    table = doc["tensors"]["rows"]["tile_table"]
    assert table["checksums"].keys() == {"dtype", "data"} and table["checksums"]["dtype"] == "uint64"
    assert len(base64.b64decode(table["checksums"]["data"])) == 8 * 100  # one checksum per tile, not deflated
    # Sorted row blocks: offsets step by 3 rows, so they are stored as one-byte deltas.
    assert table["offsets"] == {**table["offsets"], "dtype": "int8", "delta": True, "zlib": True}
    assert table["chunks"]["dtype"] == "int8"


def test_the_first_form_of_tile_tables_still_decodes() -> None:
    """Manifests written before the column objects: every column base64 of deflated int64 / uint64."""
    m = _big_manifest()
    doc = json.loads(encode(m))
    index = {f.path: i for i, f in enumerate(m.files)}
    for name, e in m.tensors.items():
        if "tile_table" not in doc["tensors"][name]:
            continue
        t = e.table
        cols = {
            "file": np.asarray([index[t.paths[f]] for f in t.file.tolist()]),
            "offsets": t.offsets,
            "lengths": t.lengths,
            "byte_offset": t.byte_offset,
            "chunks": t.chunks,
        }
        old = {k: base64.b64encode(zlib.compress(np.asarray(v, "<i8").tobytes())).decode() for k, v in cols.items()}
        old["checksums"] = base64.b64encode(zlib.compress(t.checksums.astype("<u8").tobytes())).decode()
        doc["tensors"][name]["tile_table"] = {"count": len(t), **old}
    assert decode(json.dumps(doc).encode()) == m


def _doc_with(edit) -> bytes:
    doc = json.loads(encode(_big_manifest(shuffle=False)))
    edit(doc["tensors"]["rows"]["tile_table"])
    return json.dumps(doc).encode()


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda t: t["offsets"].update(dtype="uint64"), "dtype must be int8"),
        (lambda t: t["offsets"].update(dtype="float32"), "dtype must be int8"),
        (lambda t: t["checksums"].update(dtype="int64"), "dtype must be uint64"),
        (lambda t: t["checksums"].update(delta=True), "checksums take no delta"),
        (lambda t: t["offsets"].update(delta=1), "true or false"),
        (lambda t: t["offsets"].update(zlib="yes"), "true or false"),
        (lambda t: t["offsets"].update(data=7), "base64 string"),
        (lambda t: t.update(offsets=[1, 2]), "string or a column object"),
        (lambda t: t["offsets"].update(data="not base64!"), "base64"),
        (lambda t: t["offsets"].update(zlib=False), "holds"),  # deflated bytes read as raw
        (lambda t: t["checksums"].update(data=t["checksums"]["data"][:-12]), "base64|holds"),
        (lambda t: t["file"].update(data=_b64(zlib.compress(b"\x00" * 10_000))), "holds"),  # inflates past count
        # Deltas that wrap below zero: refused like any negative value.
        (
            lambda t: t["byte_offset"].update(dtype="int8", delta=True, zlib=False, data=_b64(b"\x10" + b"\xf0" * 99)),
            "non-negative",
        ),
        (
            lambda t: t["file"].update(
                dtype="int64", delta=False, zlib=False, data=_b64(np.full(100, 1 << 62, "<i8").tobytes())
            ),
            "below 2\\*\\*62",
        ),
    ],
)
def test_column_objects_are_strict(edit, match: str) -> None:
    data = _doc_with(edit)
    with pytest.raises(ManifestError, match=match):
        decode(data)
    m = decode(data, lazy=True)  # the same problem, found when the tensor is used
    with pytest.raises(ManifestError, match=match):
        len(m.tensors["rows"].table)


def test_delta_coded_values_are_validated_like_any_other() -> None:
    # One delta of +1000 rows puts every later tile outside the tensor.
    deltas = np.full(100, 3, dtype="<i2")
    deltas[0], deltas[50] = 0, 1000
    offs = np.zeros((100, 2), dtype="<i2")
    offs[:, 0] = deltas
    data = _doc_with(lambda t: t["offsets"].update(dtype="int16", delta=True, zlib=False, data=_b64(offs.tobytes())))
    with pytest.raises(ManifestError, match="tensor 'rows'.*outside shape"):
        decode(data)


# --------------------------------------------------------------------------------------
# Lazy decoding


def _hostile(data: bytes, name: str = "grid") -> bytes:
    """``name``'s table made invalid in a way only decoding it can find (a tile past its file's end)."""
    doc = json.loads(data)
    doc["tensors"][name]["tile_table"]["byte_offset"] = {
        "dtype": "int64",
        "zlib": True,
        "data": _b64(zlib.compress(np.full(doc["tensors"][name]["tile_table"]["count"], 1 << 40, "<i8").tobytes())),
    }
    return json.dumps(doc).encode()


def test_a_hostile_table_is_reported_when_its_tensor_is_used_and_by_the_eager_forms() -> None:
    data = _hostile(encode(_big_manifest()))
    with pytest.raises(ManifestError, match=r"^ckpt/manifest.json: .*tensor 'grid'.*exceed file"):
        decode(data, source="ckpt/manifest.json")
    m = decode(data, source="ckpt/manifest.json", lazy=True)
    assert m.tensors["grid"].num_tiles == 48  # the declared count, without decoding
    assert len(m.tensors["rows"].table) == 100  # other tensors are fine
    for _ in range(2):  # the same error every time, naming the source and the tensor
        with pytest.raises(ManifestError, match=r"^ckpt/manifest.json: invalid manifest: tensor 'grid'.*exceed file"):
            len(m.tensors["grid"].table)
    with pytest.raises(ManifestError, match=r"^ckpt/manifest.json: .*tensor 'grid'"):
        m.tensors["grid"].tile(0)
    with pytest.raises(ManifestError, match="tensor 'grid'"):
        decode(data, lazy=True).validate_all()


def test_a_lazy_decode_decodes_only_the_tensors_used(monkeypatch: pytest.MonkeyPatch) -> None:
    decoded: list[str] = []
    real = tiles_module._decode_tiles

    def counting(ctx, name, *args):
        decoded.append(name)
        return real(ctx, name, *args)

    monkeypatch.setattr(tiles_module, "_decode_tiles", counting)
    m0 = _big_manifest()
    data = encode(m0)
    m = decode(data, lazy=True)
    assert decoded == [] and {n: e.num_tiles for n, e in m.tensors.items()} == {
        n: e.num_tiles for n, e in m0.tensors.items()
    }
    assert m.tensors["vec"].tile(3) == m0.tensors["vec"].tile(3)
    len(m.tensors["vec"].table)
    assert decoded == ["vec"]
    # A load plan decodes the tensors its targets name, and nothing else.
    target = ReadTarget("rows", Box((10, 0), (20, 7)), torch.empty(20, 7))
    plan_reads(m, [target])
    assert decoded == ["vec", "rows"]
    m.validate_all()
    assert sorted(decoded) == sorted(m.tensors)
    decoded.clear()
    decode(data)
    assert sorted(decoded) == sorted(m.tensors)


def test_a_lazy_table_is_decoded_once_across_threads() -> None:
    m = decode(encode(_big_manifest()), lazy=True)
    got: list[TileTable] = []
    threads = [threading.Thread(target=lambda: got.append(m.tensors["wide"].table)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and all(t is got[0] for t in got)


def _constant_table(count: int, chunks: int) -> dict:
    """A legacy table of ``count`` one-element tiles that deflates to almost nothing."""
    z = lambda n, v, dt: base64.b64encode(zlib.compress(np.full(n, v, dt).tobytes(), 9)).decode()  # noqa: E731
    return {
        "count": count,
        "file": z(count, 0, "<i8"),
        "offsets": z(count, 0, "<i8"),
        "lengths": z(count, 1, "<i8"),
        "byte_offset": z(count, 0, "<i8"),
        "chunks": z(count, chunks, "<i8"),
        "checksums": z(count * chunks, 0, "<u8"),
    }


@pytest.mark.parametrize(
    ("count", "chunks", "match", "when"),
    # many-checksums declares 128 MiB of checksums, 19x what its 180 KB manifest may inflate to
    # and 19x the allocation bound below (a larger table checks nothing more, and its 2 GiB
    # zlib.compress took 16 s of the test).
    [(1 << 22, 1, "tile_table.count", "decode"), (1 << 12, 1 << 12, "tile_table.chunks", "use")],
    ids=["many-tiles", "many-checksums"],
)
def test_a_lazy_decode_keeps_the_allocation_bound(count: int, chunks: int, match: str, when: str) -> None:
    doc = json.loads(encode(_big_manifest()))
    doc["tensors"]["z"] = {"dtype": "uint8", "shape": [1], "tile_table": _constant_table(count, chunks)}
    data = json.dumps(doc).encode()
    tracemalloc.start()
    try:
        if when == "decode":  # a declared count is charged before any table is decoded
            with pytest.raises(ManifestError, match=match):
                decode(data, lazy=True)
        else:
            m = decode(data, lazy=True)
            with pytest.raises(ManifestError, match=match):
                len(m.tensors["z"].table)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * len(data) + (4 << 20), f"a {len(data)}-byte manifest allocated {peak / 2**20:.1f} MiB"


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(data=st.data())
def test_fuzzed_tables_fail_alike_eager_and_lazy(data: st.DataObject) -> None:
    doc = json.loads(encode(_big_manifest(shuffle=False)))
    name = data.draw(st.sampled_from(["rows", "grid", "vec", "cube"]))
    table = doc["tensors"][name]["tile_table"]
    for _ in range(data.draw(st.integers(1, 3))):
        key = data.draw(st.sampled_from(["count", "file", "offsets", "lengths", "byte_offset", "chunks", "checksums"]))
        if key == "count":
            table["count"] += data.draw(st.sampled_from([-1, 1, 1 << 20, -table["count"]]))
            continue
        col = table[key]
        what = data.draw(st.sampled_from(["dtype", "delta", "zlib", "bytes", "flip"]))
        if what == "dtype":
            col["dtype"] = data.draw(st.sampled_from(["int8", "int16", "int32", "int64", "uint64", "x"]))
        elif what in ("delta", "zlib"):
            col[what] = not col.get(what, False)
        elif what == "bytes":
            n = data.draw(st.integers(0, 64))
            col.update(zlib=False, data=_b64(data.draw(st.binary(min_size=n, max_size=n))))
        else:
            raw = bytearray(base64.b64decode(col["data"]))
            if raw:
                raw[data.draw(st.integers(0, len(raw) - 1))] ^= 1 << data.draw(st.integers(0, 7))
            col["data"] = _b64(bytes(raw))
    blob = json.dumps(doc).encode()
    try:
        eager: Manifest | str = decode(blob)
    except ManifestError as e:
        eager = str(e)
    try:
        m = decode(blob, lazy=True)
        m.validate_all()
        lazy: Manifest | str = m
    except ManifestError as e:
        lazy = str(e)
    assert type(eager) is type(lazy)
    if isinstance(eager, str):
        assert eager == lazy
    else:
        assert eager == lazy


# --------------------------------------------------------------------------------------
# Load planning by binary search


def _scan_plan(m: Manifest, fqn: str, box: Box) -> list[int]:
    """The tiles that meet ``box``, by a scan of every tile (what plan_reads did before)."""
    t = m.tensors[fqn].table
    lo = np.maximum(t.offsets, np.asarray(box.offsets))
    hi = np.minimum(t.offsets + t.lengths, np.asarray(box.stops))
    return np.flatnonzero((hi > lo).all(axis=1)).tolist()


def _copies(reqs) -> list[tuple]:
    return sorted((c.fqn, c.tile.offsets, c.rel.offsets, c.rel.lengths) for r in reqs for c in r.copies)


@pytest.mark.parametrize("shuffle", [False, True])
def test_plan_reads_finds_exactly_the_tiles_a_scan_finds(shuffle: bool) -> None:
    m = decode(encode(_big_manifest(seed=3, shuffle=shuffle)))
    rng = np.random.default_rng(1)
    for fqn in ("rows", "grid", "vec", "cube", "wide", "mixed"):
        shape = m.tensors[fqn].shape
        for _ in range(30):
            a = [int(rng.integers(0, s)) for s in shape]
            b = [int(rng.integers(x + 1, s + 1)) for x, s in zip(a, shape)]
            box = Box(tuple(a), tuple(y - x for x, y in zip(a, b)))
            target = ReadTarget(fqn, box, torch.empty(box.lengths, dtype=torch.float32))
            reqs = plan_reads(m, [target], max_read_bytes=1 << 30)
            tiles = {c.tile.offsets for r in reqs for c in r.copies}
            t = m.tensors[fqn].table
            assert tiles == {tuple(t.offsets[i].tolist()) for i in _scan_plan(m, fqn, box)}
            assert sum(c.rel.numel for r in reqs for c in r.copies) == box.numel


def _edited(m: Manifest, fqn: str, i: int, offsets: tuple[int, ...]) -> Manifest:
    """``m`` with tile ``i`` of ``fqn`` moved to ``offsets`` (a gap where it was, an overlap where it lands)."""
    e = m.tensors[fqn]
    t = e.table
    offs = t.offsets.copy()
    offs[i] = offsets
    table = TileTable(t.paths, t.file, offs, t.lengths, t.byte_offset, t.nbytes, t.chunks, t.checksums)
    return Manifest(
        m.save_id,
        m.world_size,
        m.chunk_bytes,
        {**m.tensors, fqn: TensorEntry(e.dtype, e.shape, table=table)},
        files=m.files,
    )


def test_plan_reads_refuses_an_overlap_inside_a_box_and_ignores_one_outside() -> None:
    m = _big_manifest(shuffle=False)
    bad = _edited(m, "rows", 10, (33, 0))  # rows [30, 33) uncovered, [33, 36) covered twice
    short = ReadTarget("rows", Box((31, 0), (5, 7)), torch.empty(5, 7))  # 2 rows missing, 3 twice: 6 of 5
    with pytest.raises(CorruptCheckpointError, match="tensor 'rows'.*cover 42 of the 35 elements.*rank 3"):
        plan_reads(bad, [short], rank=3)
    straddle = ReadTarget("rows", Box((30, 0), (6, 7)), torch.empty(6, 7))  # the volume matches, tiles overlap
    with pytest.raises(CorruptCheckpointError, match="tensor 'rows'.*rank 3 loads.*overlap"):
        plan_reads(bad, [straddle], rank=3)
    whole = ReadTarget("rows", Box((0, 0), (300, 7)), torch.empty(300, 7))  # 100 tiles: the sweep, not pairs
    with pytest.raises(CorruptCheckpointError, match="tensor 'rows'.*overlap"):
        plan_reads(bad, [whole])
    elsewhere = ReadTarget("rows", Box((200, 0), (50, 7)), torch.empty(50, 7))
    assert plan_reads(bad, [elsewhere])  # this box is covered exactly once: the load may go on


def test_plan_reads_checks_a_table_of_a_few_tiles_as_a_large_one() -> None:
    """A table narrowed to a few tiles is searched in plain Python: the same hits, and the same
    refusals of a gap and of an overlap, as the bisection of a large table."""
    rng = np.random.default_rng(1)
    paths = ("data/s/0-0.safetensors",)
    offs, lens = _grid((12, 8), 4, 4)  # 6 tiles of 4 x 4
    m = Manifest(
        "s",
        1,
        CHUNK,
        {"g": TensorEntry("float32", (12, 8), table=_table(paths, offs, lens, 4, rng))},
        files=(FileEntry(paths[0], 0, 1 << 20),),
    )
    box = Box((2, 3), (7, 4))
    reqs = plan_reads(m, [ReadTarget("g", box, torch.empty(7, 4))], max_read_bytes=1 << 30)
    got = sorted((c.tile.offsets, c.rel.offsets, c.rel.lengths) for r in reqs for c in r.copies)
    assert got == [
        ((0, 0), (2, 3), (2, 1)),
        ((0, 4), (2, 0), (2, 3)),
        ((4, 0), (0, 3), (4, 1)),
        ((4, 4), (0, 0), (4, 3)),
        ((8, 0), (0, 3), (1, 1)),
        ((8, 4), (0, 0), (1, 3)),
    ]
    moved = _edited(m, "g", 3, (4, 3))  # columns 3..6 of rows 4..7: column 3 twice, column 7 never
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'g'.*rank 2 loads.*\[4, 2\]\.\.\[8, 4\] and \[4, 3\]"):
        plan_reads(moved, [ReadTarget("g", Box((4, 2), (4, 6)), torch.empty(4, 6))], rank=2)  # volume right
    with pytest.raises(CorruptCheckpointError, match="tensor 'g'.*cover 4 of the 8 elements.*rank 2"):
        plan_reads(moved, [ReadTarget("g", Box((4, 6), (4, 2)), torch.empty(4, 2))], rank=2)
    assert plan_reads(moved, [ReadTarget("g", Box((0, 0), (4, 8)), torch.empty(4, 8))])  # rows 0..3 are fine


def test_plan_reads_refuses_an_overlap_in_shuffled_tiles() -> None:
    m = _big_manifest(shuffle=True)
    t = m.tensors["vec"].table
    i = int(np.flatnonzero(t.offsets[:, 0] == 37 * 10)[0])
    bad = _edited(m, "vec", i, (37 * 10 + 5,))  # a gap of 5 at 370, an overlap of 5 at 407
    whole = ReadTarget("vec", Box((0,), (1000,)), torch.empty(1000, dtype=torch.float64))
    with pytest.raises(CorruptCheckpointError, match="tensor 'vec'.*overlap"):
        plan_reads(bad, [whole])


def test_plan_reads_checks_more_than_64_tiles_in_one_box() -> None:
    paths = ("data/s/0-0.safetensors",)
    rng = np.random.default_rng(0)
    offs, lens = _rows((200,), 1)
    offs[100] = 99  # row 100 missing, row 99 twice: 200 hits, volume right
    table = _table(paths, offs, lens, 4, rng)
    m = Manifest(
        "s", 1, CHUNK, {"v": TensorEntry("float32", (200,), table=table)}, files=(FileEntry(paths[0], 0, 1 << 20),)
    )
    with pytest.raises(CorruptCheckpointError, match="tensor 'v'.*overlap"):
        plan_reads(m, [ReadTarget("v", Box((0,), (200,)), torch.empty(200))])
    ok = Manifest(
        "s",
        1,
        CHUNK,
        {"v": TensorEntry("float32", (200,), table=_table(paths, *_rows((200,), 1), 4, rng))},
        files=m.files,
    )
    assert len(plan_reads(ok, [ReadTarget("v", Box((0,), (200,)), torch.empty(200))])) >= 1
