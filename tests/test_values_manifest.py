"""Plain-value encoding and the manifest format (round trip, golden bytes, strictness)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tessera.errors import ManifestError, PickleNotAllowedError
from tessera.format.manifest import FileEntry, Manifest, PerRankEntry, TensorEntry, Tile, decode, encode
from tessera.format.values import decode_value, encode_value


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        3,
        -(2**70),
        1.5,
        "s",
        [1, "a", None],
        (1, (2, 3)),
        {"a": (1, 2)},
        {1: "int key", (1, 2): "tuple"},
        b"\x00bytes",
        {"__tuple__": "a key that looks like a tag"},
        torch.bfloat16,
        torch.Size([2, 3]),
        [],
    ],
)
def test_plain_values_round_trip(value: object) -> None:
    enc = encode_value(value, "v")
    dec = decode_value(json.loads(json.dumps(enc)), "v")
    want = tuple(value) if isinstance(value, torch.Size) else value
    assert dec == want and type(dec) is type(want)


def test_non_finite_floats() -> None:
    for f in (math.inf, -math.inf):
        assert decode_value(json.loads(json.dumps(encode_value(f, "v"), allow_nan=False)), "v") == f
    assert math.isnan(decode_value(encode_value(math.nan, "v"), "v"))


class Opaque:
    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque)


def test_pickle_needs_opt_in_at_save_and_load() -> None:
    with pytest.raises(PickleNotAllowedError, match="'v'.*Opaque.*allow_pickle"):
        encode_value(Opaque(), "v")
    enc = encode_value(Opaque(), "v", allow_pickle=True)
    with pytest.raises(PickleNotAllowedError, match="'v'"):
        decode_value(enc, "v")
    assert decode_value(enc, "v", allow_pickle=True) == Opaque()


def _manifest() -> Manifest:
    f = "data/abc/0-0.safetensors"
    return Manifest(
        save_id="abc",
        world_size=2,
        chunk_bytes=4096,
        tensors={
            "w": TensorEntry("float32", (4, 2), (Tile(f, (0, 0), (4, 2), 128, 32, (0x0123456789ABCDEF,)),)),
            "s": TensorEntry("bfloat16", (), (Tile(f, (), (), 160, 2, (1,)),)),
        },
        values={"step": 3},
        per_rank={"rng": PerRankEntry("error", (1, 2))},
        files=(FileEntry(f, 0, 162),),
        layout={"world_size": 2},
    )


GOLDEN = (
    b'{"format":"tessera","version":1,"save_id":"abc","world_size":2,"checksum":{"algorithm":"xxh3_64","chunk_bytes":4096},'
    b'"files":[{"path":"data/abc/0-0.safetensors","rank":0,"bytes":162}],"tensors":{"w":{"dtype":"float32","shape":[4,2],'
    b'"tiles":[[0,[0,0],[4,2],128,["0123456789abcdef"]]]},"s":{"dtype":"bfloat16","shape":[],"tiles":[[0,[],[],160,'
    b'["0000000000000001"]]]}},"values":{"step":3},"per_rank":{"rng":{"on_resize":"error","values":[1,2]}},'
    b'"layout":{"world_size":2},"timings":{},"metadata":{}}'
)


def test_manifest_golden_bytes_and_round_trip() -> None:
    m = _manifest()
    assert encode(m) == GOLDEN
    assert decode(GOLDEN) == m


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d.update(version=99), "newer"),
        (lambda d: d.update(format="dcp"), "format"),
        (lambda d: d["files"][0].update(path="../../etc/passwd"), "outside"),
        (lambda d: d["files"][0].update(path="/etc/passwd"), "outside"),
        (lambda d: d["tensors"]["w"].update(dtype="object"), "dtype"),
        (lambda d: d["tensors"]["w"]["tiles"][0].__setitem__(2, [5, 2]), "outside shape"),
        (lambda d: d["tensors"]["w"]["tiles"][0].__setitem__(3, 150), "exceed"),
        (lambda d: d["tensors"]["w"]["tiles"][0].__setitem__(4, []), "checksums"),
        (lambda d: d["tensors"]["w"]["tiles"][0].__setitem__(0, 7), "file #7"),
        (lambda d: d["tensors"]["w"].update(shape=[4, True]), "integer"),
    ],
)
def test_manifest_decoder_rejects_bad_input(mutate, match: str) -> None:
    doc = json.loads(GOLDEN)
    mutate(doc)
    with pytest.raises(ManifestError, match=match):
        decode(json.dumps(doc).encode())


def test_manifest_decoder_rejects_truncation() -> None:
    with pytest.raises(ManifestError, match="truncated|JSON"):
        decode(GOLDEN[:-10])


def _many_tiles(n: int = 40) -> Manifest:
    """A tensor of ``n`` row tiles spread over two files: stored as a columnar tile table."""
    files = (
        FileEntry("data/x/0-0.safetensors", 0, 64 + 20 * 8 * n),
        FileEntry("data/x/1-0.safetensors", 1, 64 + 20 * 8 * n),
    )
    tiles = tuple(Tile(files[i % 2].path, (i, 0), (1, 20), 64 + 80 * i, 80, (i * 7919 + 1,)) for i in range(n))
    return Manifest("x", 2, 4096, {"big": TensorEntry("float32", (n, 20), tiles)}, files=files)


def test_many_tiles_use_the_columnar_table_and_round_trip() -> None:
    m = _many_tiles()
    data = encode(m)
    doc = json.loads(data)
    assert "tile_table" in doc["tensors"]["big"] and "tiles" not in doc["tensors"]["big"]
    back = decode(data)
    assert back == m
    entry = back.tensors["big"]
    assert entry.tile(7) == m.tensors["big"].tiles[7]  # one tile without building the rest
    assert entry.table.offsets[:, 0].tolist() == list(range(40))


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("offsets", "not base64!", "base64"),
        ("file", "AAAA", "zlib"),
        ("lengths", "AAAA", "zlib"),
        ("count", 41, "bytes"),
        ("count", -1, "integer"),
        ("checksums", "", "bytes"),
    ],
)
def test_tile_table_decoder_rejects_bad_columns(key: str, value: object, match: str) -> None:
    doc = json.loads(encode(_many_tiles()))
    doc["tensors"]["big"]["tile_table"][key] = value
    with pytest.raises(ManifestError, match=match):
        decode(json.dumps(doc).encode())


@pytest.mark.parametrize("form", ["column object", "first form (base64 of zlib int64)"])
def test_tile_table_values_are_validated_like_lists(form: str) -> None:
    import base64
    import zlib

    data = encode(_many_tiles())
    doc = json.loads(data)
    table = doc["tensors"]["big"]["tile_table"]
    offs = decode(data).tensors["big"].table.offsets.astype("<i8").reshape(-1)
    offs[0] = 1 << 40  # far outside the tensor
    packed = base64.b64encode(zlib.compress(offs.tobytes())).decode()
    table["offsets"] = {"dtype": "int64", "zlib": True, "data": packed} if form == "column object" else packed
    with pytest.raises(ManifestError, match="outside shape"):
        decode(json.dumps(doc).encode())
